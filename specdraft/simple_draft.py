"""A small draft step built from the project's layers, for capture tests and benchmarks
until the real draft models are wired in: embedding, attention layers over the paged
cache with residual connections, an lm_head and a greedy token per request."""

from __future__ import annotations

import torch

from .attention import PagedAttention
from .attn_metadata import AttentionMetadata
from .config import ModelConfig
from .kv_cache import KVCache


class SimpleDraftModel(torch.nn.Module):
    """Seeded random weights. Outputs go to persistent buffers (`out_tokens`,
    `out_hidden`, [max_num_reqs, ...]) so a captured graph's results stay readable."""

    def __init__(self, cfg: ModelConfig, max_num_reqs: int, device, seed: int = 0):
        super().__init__()
        g = torch.Generator(device="cpu").manual_seed(seed)
        h, hq, hkv, d = cfg.hidden_size, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim

        def w(*shape, scale):
            return (torch.randn(*shape, generator=g) * scale).to(cfg.dtype).to(device)

        self.cfg = cfg
        self.embed = w(cfg.vocab_size, h, scale=1.0)
        self.qkv = [w(h, (hq + 2 * hkv) * d, scale=h**-0.5) for _ in range(cfg.num_layers)]
        self.o = [w(hq * d, h, scale=(hq * d) ** -0.5) for _ in range(cfg.num_layers)]
        self.lm_head = w(cfg.vocab_size, h, scale=h**-0.5)
        self.attn = PagedAttention(
            hq, hkv, d, sliding_window=cfg.sliding_window, softcap=cfg.softcap
        )
        self.out_tokens = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.out_hidden = torch.zeros(max_num_reqs, h, dtype=cfg.dtype, device=device)

    def forward(self, meta: AttentionMetadata, kv_cache: KVCache) -> tuple[torch.Tensor, ...]:
        cfg = self.cfg
        hq, hkv, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
        x = self.embed[meta.input_ids]
        for i in range(cfg.num_layers):
            xn = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
            qkv = xn @ self.qkv[i]
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            n = x.shape[0]
            a = self.attn(
                q.reshape(n, hq, d),
                k.reshape(n, hkv, d),
                v.reshape(n, hkv, d),
                kv_cache.layer(i),
                meta,
            )
            x = x + a.reshape(n, hq * d) @ self.o[i]
        last = x[meta.last_token_idx]
        logits = last @ self.lm_head.t()
        r = meta.num_reqs
        self.out_tokens[:r].copy_(logits.argmax(-1))
        self.out_hidden[:r].copy_(last)
        return self.out_tokens[:r], self.out_hidden[:r]
