"""Layers of a Llama-family decoder over the paged KV cache.

Every layer that touches the cache or the positions takes the AttentionMetadata
explicitly. Nothing here reads a tensor's values on the host or picks a shape from
them, so a forward pass can be captured in a CUDA graph for a batch descriptor and
replayed with new contents in the persistent buffers. GEMMs are torch (cuBLAS); the
element-wise work around them is fused in Triton kernels (RMSNorm with residual add,
rotary embedding, SiLU-and-multiply).

Parameters are created empty (filled by the loader or the random-weight builder) and
never require grad: these modules are for inference only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.kernels import apply_rotary, rms_norm, silu_and_mul

from .attention import PagedAttention
from .attn_metadata import AttentionMetadata

if TYPE_CHECKING:  # specdraft.models imports this module
    from .models.config import DecoderConfig, RopeConfig

KVPair = tuple[torch.Tensor, torch.Tensor]


def _param(shape: tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b); W [out_features, in_features] as in checkpoints."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype, device):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param((out_features, in_features), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, *, dtype, device):
        super().__init__()
        self.weight = _param((num_embeddings, dim), dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm; with a residual, adds it first (fused) and returns (normed, residual)."""

    def __init__(self, hidden: int, eps: float, *, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device), False)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        *,
        residual_out: torch.Tensor | None = None,
    ):
        return rms_norm(x, self.weight, self.eps, residual=residual, residual_out=residual_out)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], float32, computed as transformers does
    (default, linear and llama3 rope types)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def cos_sin_table(head_dim: int, rope: RopeConfig, max_positions: int, device) -> torch.Tensor:
    """float32 [max_positions, head_dim]: cos(p f) in the first half, sin(p f) in the
    second, f the inverse frequencies (the rows the rotary kernel reads)."""
    inv_freq = rope_inv_freq(head_dim, rope)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=1).to(device)


class RotaryEmbedding(nn.Module):
    """Rotates q and k in place at the positions in the metadata's persistent buffer.
    The table covers max_positions positions; later ones are clamped to the last row."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int, *, device):
        super().__init__()
        if max_positions < 1:
            raise ValueError(f"max_positions must be >= 1, got {max_positions}")
        self.head_dim, self.rope, self.max_positions = head_dim, rope, max_positions
        table = cos_sin_table(head_dim, rope, max_positions, device)
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) would round the table; rebuild it in float32 on the new device.
        super()._apply(fn, recurse)
        dev = self.cos_sin_cache.device
        if self.cos_sin_cache.dtype != torch.float32:
            self.cos_sin_cache = cos_sin_table(self.head_dim, self.rope, self.max_positions, dev)
        return self

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> None:
        apply_rotary(q, k, positions, self.cos_sin_cache)


class Attention(nn.Module):
    """Fused QKV projection, rotary, KV store + paged attention, output projection.
    input_size is hidden_size except in EAGLE-3 (2 * hidden_size)."""

    def __init__(
        self, cfg: DecoderConfig, rotary: RotaryEmbedding, *, input_size: int, dtype, device
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        qkv_size = self.q_size + 2 * self.kv_size
        self.qkv_proj = Linear(input_size, qkv_size, bias=cfg.qkv_bias, dtype=dtype, device=device)
        self.o_proj = Linear(
            self.q_size, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype, device=device
        )
        self.rotary = rotary
        self.attn = PagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: KVPair) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
            t, self.num_kv_heads, self.head_dim
        )
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        self.rotary(q, k, meta.positions)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.view(t, self.q_size))


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one GEMM."""

    def __init__(self, hidden: int, intermediate: int, *, dtype, device):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False, dtype=dtype, device=device)
        self.down_proj = Linear(intermediate, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer carrying the residual stream separately (vLLM style):
    forward(hidden, residual) returns (mlp output, residual), and the next norm adds
    them. input_norm=False drops the input RMSNorm (layer 0 of an EAGLE-1 head)."""

    def __init__(
        self,
        cfg: DecoderConfig,
        rotary: RotaryEmbedding,
        *,
        dtype,
        device,
        input_norm: bool = True,
        attn_input_size: int | None = None,
    ):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, dtype=dtype, device=device) if input_norm else None
        self.self_attn = Attention(
            cfg, rotary, input_size=attn_input_size or h, dtype=dtype, device=device
        )
        self.post_attention_layernorm = RMSNorm(h, eps, dtype=dtype, device=device)
        self.mlp = GatedMLP(h, cfg.intermediate_size, dtype=dtype, device=device)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        kv_cache: KVPair,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual None (first layer): `hidden` becomes the residual and is updated in
        place, so it must be a tensor the model owns."""
        if residual is None:
            residual = hidden
            x = hidden if self.input_layernorm is None else self.input_layernorm(hidden)
        else:
            if self.input_layernorm is None:
                raise ValueError("a layer without input_layernorm must be the first layer")
            x, residual = self.input_layernorm(hidden, residual)
        x = self.self_attn(x, meta, kv_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def layer_caches(kv_caches, num_layers: int) -> list[KVPair]:
    """Per-layer (k_cache, v_cache) pairs from a KVCache or a sequence of pairs."""
    if hasattr(kv_caches, "layer") and hasattr(kv_caches, "num_layers"):
        if kv_caches.num_layers < num_layers:
            raise ValueError(
                f"KV cache has {kv_caches.num_layers} layers, the model needs {num_layers}"
            )
        return [kv_caches.layer(i) for i in range(num_layers)]
    pairs = list(kv_caches)
    if len(pairs) != num_layers:
        raise ValueError(f"kv_caches has {len(pairs)} (k, v) pairs, the model has {num_layers}")
    return pairs


def select_logits(
    hidden: torch.Tensor,
    lm_head: Linear,
    meta: AttentionMetadata,
    logits_indices: torch.Tensor | None,
    all_logits: bool,
) -> torch.Tensor:
    """lm_head over the rows of `hidden` that need logits: every row with all_logits,
    else logits_indices (a device int64 tensor of row indices), else each request's
    last token (meta.last_token_idx; padded requests read row 0)."""
    if all_logits:
        if logits_indices is not None:
            raise ValueError("give logits_indices or all_logits=True, not both")
        return lm_head(hidden)
    idx = meta.last_token_idx if logits_indices is None else logits_indices
    if idx.dtype != torch.int64 or idx.dim() != 1:
        raise TypeError(f"logits_indices must be a 1-D int64 tensor, got {idx.dtype} {idx.dim()}-D")
    return lm_head(hidden.index_select(0, idx))
