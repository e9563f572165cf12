"""Drive models through the runtime (block tables, MetadataBuilder, paged KV cache), and
a plain-PyTorch float64 reference of the decoder math the EAGLE heads use."""

from __future__ import annotations

import inspect
import math

import torch

from specdraft.attn_metadata import AttentionMetadata, MetadataBuilder
from specdraft.batch import ScheduledBatch
from specdraft.block_table import BlockTables
from specdraft.config import CacheConfig, LimitsConfig
from specdraft.input_buffers import InputBuffers
from specdraft.kv_cache import KVCache
from specdraft.models.config import DecoderConfig


class PagedRunner:
    """Requests join with a prompt and then decode; `step` grows their blocks, builds
    the metadata padded by pad_reqs / pad_tokens and returns it."""

    def __init__(
        self,
        cfg: DecoderConfig,
        device,
        *,
        dtype=None,
        max_num_reqs: int = 4,
        max_num_tokens: int = 64,
        max_model_len: int = 64,
        block_size: int = 16,
        num_blocks: int | None = None,
    ):
        self.limits = LimitsConfig(max_num_reqs, max_num_tokens, max_model_len)
        blocks_per_req = self.limits.max_blocks_per_req(block_size)
        num_blocks = num_blocks or max_num_reqs * blocks_per_req + 1
        self.cache = KVCache(
            cfg.runtime_config(dtype), CacheConfig(block_size, num_blocks=num_blocks), device
        )
        self.cache.data.normal_()  # poison: nothing may read K/V it did not write
        self.cache.data[:, :, 0].zero_()
        self.tables = BlockTables(max_num_reqs, blocks_per_req, block_size, num_blocks, device)
        buffers = InputBuffers(self.limits, device)
        self.builder = MetadataBuilder(self.limits, buffers, self.tables, self.cache)
        self.lens: dict = {}

    def step(self, reqs, *, pad_reqs: int = 0, pad_tokens: int = 0) -> AttentionMetadata:
        """reqs: (req_id, new token ids) pairs; new ids join, known ones continue."""
        sched = []
        for rid, toks in reqs:
            toks = [int(t) for t in toks]
            start = self.lens.get(rid, 0)
            if rid in self.tables:
                assert self.tables.grow(rid, start + len(toks))
            else:
                self.tables.add_request(rid, start + len(toks))
            sched.append((rid, toks, start))
            self.lens[rid] = start + len(toks)
        batch = ScheduledBatch.from_requests(sched)
        return self.builder.build(
            batch,
            num_reqs_padded=batch.num_reqs + pad_reqs,
            num_tokens_padded=batch.num_tokens + pad_tokens,
        )


def hf_forward(model, input_ids: torch.Tensor, cache=None, **kw):
    """One transformers forward with its KV cache: (logits, cache). transformers 5.x
    renamed past_key_values to cache in later minor versions; both are handled."""
    if cache is not None:
        params = inspect.signature(model.forward).parameters
        kw["cache" if "cache" in params else "past_key_values"] = cache
    out = model(input_ids, use_cache=True, **kw)
    new = out["cache"] if "cache" in out else out["past_key_values"]
    return out, new


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double().cpu(), ref.double().cpu()
    return float((got - ref).norm() / ref.norm())


# ---- float64 reference of the decoder math (weights in checkpoint names) ---------------


def ref_rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def ref_rope(x, pos, theta):
    """Default (unscaled) rotary, half-split convention; x [n, H, D], pos [n]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = pos.double()[:, None] * inv[None, :]
    cos, sin = f.cos()[:, None, :], f.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RefLayer:
    """One decoder layer's attention and MLP over contiguous per-request K/V history."""

    def __init__(self, w: dict, prefix: str, cfg: DecoderConfig):
        self.w = {
            k[len(prefix) + 1 :]: v.double().cpu() for k, v in w.items() if k.startswith(prefix)
        }
        self.cfg = cfg
        self.k: dict = {}
        self.v: dict = {}

    def lin(self, name, x):
        y = x @ self.w[f"{name}.weight"].T
        b = self.w.get(f"{name}.bias")
        return y if b is None else y + b

    def norm(self, name, x):
        return ref_rmsnorm(x, self.w[f"{name}.weight"], self.cfg.rms_norm_eps)

    def attn(self, rid, x, pos):
        c = self.cfg
        n, d = x.shape[0], c.head_dim
        q = ref_rope(self.lin("self_attn.q_proj", x).view(n, c.num_heads, d), pos, c.rope.theta)
        k = ref_rope(self.lin("self_attn.k_proj", x).view(n, c.num_kv_heads, d), pos, c.rope.theta)
        v = self.lin("self_attn.v_proj", x).view(n, c.num_kv_heads, d)
        self.k[rid] = torch.cat([self.k[rid], k]) if rid in self.k else k
        self.v[rid] = torch.cat([self.v[rid], v]) if rid in self.v else v
        rep = c.num_heads // c.num_kv_heads
        kk = self.k[rid].repeat_interleave(rep, 1)
        vv = self.v[rid].repeat_interleave(rep, 1)
        total = kk.shape[0]
        s = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(d)
        mask = torch.arange(total)[None, :] > torch.arange(total - n, total)[:, None]
        p = torch.softmax(s.masked_fill(mask, float("-inf")), -1)
        o = torch.einsum("hqk,khd->qhd", p, vv).reshape(n, -1)
        return self.lin("self_attn.o_proj", o)

    def mlp(self, x):
        g, u = self.lin("mlp.gate_proj", x), self.lin("mlp.up_proj", x)
        return self.lin("mlp.down_proj", torch.nn.functional.silu(g) * u)


class RefEagle:
    """EAGLE-1 (eagle3=False) or EAGLE-3 head math for one request at a time, float64.
    embed / lm_head: the (shared or own) weights; returns (hidden, last-token logits)."""

    def __init__(self, w: dict, cfg: DecoderConfig, embed, lm_head, *, eagle3: bool):
        self.w = {k: v.double().cpu() for k, v in w.items() if v.is_floating_point()}
        self.cfg, self.eagle3 = cfg, eagle3
        self.embed, self.lm_head = embed.double().cpu(), lm_head.double().cpu()
        self.layer = RefLayer(w, "midlayer" if eagle3 else "layers.0", cfg)

    def __call__(self, rid, ids, hidden, pos):
        c, L = self.cfg, self.layer
        e = self.embed[ids.cpu()]
        hidden = hidden.double().cpu()
        if not self.eagle3:
            x = torch.cat([e, hidden], -1) @ self.w["fc.weight"].T
            if "fc.bias" in self.w:
                x = x + self.w["fc.bias"]
            residual = x + L.attn(rid, x, pos)
            out = residual + L.mlp(L.norm("post_attention_layernorm", residual))
            return out, out[-1] @ self.lm_head.T
        if hidden.shape[-1] != c.hidden_size:
            hidden = hidden @ self.w["fc.weight"].T
        hn = L.norm("hidden_norm", hidden)
        residual = hn if c.norm_before_residual else hidden
        a = L.attn(rid, torch.cat([L.norm("input_layernorm", e), hn], -1), pos)
        residual = residual + a
        pre = residual + L.mlp(L.norm("post_attention_layernorm", residual))
        normed = ref_rmsnorm(pre, self.w["norm.weight"], c.rms_norm_eps)
        return pre, normed[-1] @ self.lm_head.T
