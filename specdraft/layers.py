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
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from specdraft import kernels, ops
from specdraft.ops import apply_rotary, rms_norm, rotary_store_kv, silu_and_mul

from .attention import PagedAttention
from .attn_metadata import AttentionMetadata

# The fused decode path's split attention: False, a merge launch after attention; True,
# the O projection merges the partials on its loads (kernels.fused_linear's x_splits), one
# launch a layer fewer. Bench and tests set it.
MERGE_IN_O_PROJ = False

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
        return ops.linear(x, self.weight, self.bias)


class Int8Linear(nn.Module):
    """y = x (W_q * scale)^T with W_q int8 [out_features, in_features] and one float32
    scale per output row (kernels.linear_int8); no bias. For a draft's lm_head, the
    largest read of its step: see `quantize_lm_head`."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Parameters (frozen), so that whatever counts a model's weights counts these
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: Linear) -> Int8Linear:
        """A copy of a bias-free Linear, quantized per row (kernels.quantize_rows_int8);
        the Linear itself is left as it is."""
        if not isinstance(linear, Linear):
            raise TypeError(f"linear must be a specdraft Linear, got {type(linear).__name__}")
        if linear.bias is not None:
            raise ValueError("linear has a bias: Int8Linear takes bias-free projections")
        return cls(*kernels.quantize_rows_int8(linear.weight))

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) would round the scales: they stay float32 (and move devices).
        scale = self.scale.data
        super()._apply(fn, recurse)
        if self.scale.dtype != torch.float32:
            self.scale.data = scale.to(self.scale.device)
        return self

    # select_logits hands it the rows it needs (x_rows) instead of gathering them first
    takes_x_rows = True

    def forward(self, x: torch.Tensor, *, x_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x's rows (all, or x_rows: int64 row indices) through the int8 projection."""
        pdl = kernels.pdl_supported(x.device)
        return ops.linear_int8(x, self.weight, self.scale, x_rows=x_rows, pdl=pdl)


def quantize_lm_head(model: nn.Module) -> nn.Module:
    """Give `model` (a draft: an EAGLE-1 / EAGLE-3 head or a Llama-style draft) an int8
    copy of its lm_head, per-row scaled; returns the model. The draft then reads half
    the lm_head bytes a step. A head that shares the target's lm_head gets its own copy:
    the target's stays as it is. Drafts only propose, so the output distribution stays
    the target's; what can change is acceptance (near-ties of the draft's logits)."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, Int8Linear):
        return model
    if not isinstance(head, Linear):
        raise TypeError(f"model.lm_head must be a specdraft Linear, got {type(head).__name__}")
    model.lm_head = Int8Linear.from_linear(head)
    return model


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
    The table covers max_positions positions (the kernel clamps others into it, so a
    padded row never reads outside it); a model refuses metadata whose max_seq_len is
    over max_positions (check_step_inputs), so real positions never reach the clamp."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int, *, device):
        super().__init__()
        head_dim = kernels.as_int("head_dim", head_dim)
        max_positions = kernels.as_int("max_positions", max_positions)
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim must be even and >= 2 for rotary, got {head_dim}")
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
        """Rotary and the K/V store are one launch (ops.rotary_store_kv): q is rotated in
        place, rotated k and v go to the cache, k in the QKV output stays unrotated."""
        want = self.qkv_proj.in_features
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != want:
            raise ValueError(
                f"x has shape {tuple(getattr(x, 'shape', ()))}, expected [num_tokens, {want}]"
            )
        return self.o_proj(self.attend(self.qkv_proj(x), meta, kv_cache))

    def project_attend(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVPair,
        *,
        norm_weight: torch.Tensor | None,
        eps: float,
        pdl: bool,
        late_meta: bool = False,
        merge: bool = True,
    ) -> tuple[torch.Tensor, kernels.AttentionSplits | None]:
        """The fused decode path's attention half: QKV projection (with the RMSNorm
        before it folded in), rotary, the K/V store and attention; returns ([num_tokens,
        Hq D], None). One launch for the first three where kernels.fused_qkv_rope takes
        the shapes (whole heads rotated), else fused_linear then rotary_store_kv.
        late_meta: the kernel before wrote meta's positions and slots (fused_qkv_rope's
        flag; the two-launch path reads them a launch later anyway). merge=False: a
        split attention launch leaves its partials unmerged and returns them second (the
        output unwritten: the O projection merges them on its loads)."""
        t = x.shape[0]
        cos_sin = self.rotary.cos_sin_cache
        if not kernels.fused_qkv_rope_supported(x.shape[1], self.head_dim, cos_sin.shape[1]):
            qkv = ops.fused_linear(
                x, self.qkv_proj.weight, bias=self.qkv_proj.bias, norm_weight=norm_weight,
                eps=eps, pdl=pdl,
            )  # fmt: skip
            q = self._rotate_store(qkv, meta, kv_cache, pdl)
            return self._attend_stored(q, kv_cache, meta, pdl, merge)
        q_out = torch.empty((t, self.q_size), dtype=x.dtype, device=x.device)
        q = q_out.view(t, self.num_heads, self.head_dim)
        # All checks before the first write (the launch writes the cache); q's heads stand
        # in for k and v, which the launch writes to the cache only.
        stand_in = q[:, : self.num_kv_heads]
        self.attn.check(q, stand_in, stand_in, kv_cache, meta)
        k_cache, v_cache = kv_cache
        ops.fused_qkv_rope(
            x, self.qkv_proj.weight, meta.positions, cos_sin, k_cache, v_cache,
            meta.slot_mapping, num_q_heads=self.num_heads, bias=self.qkv_proj.bias,
            norm_weight=norm_weight, eps=eps, out=q_out, pdl=pdl, late_meta=late_meta,
        )  # fmt: skip
        return self._attend_stored(q, kv_cache, meta, pdl, merge)

    def _attend_stored(self, q, kv_cache, meta, pdl: bool, merge: bool):
        """Attention over a cache that holds this step's K/V: ([T, Hq D], splits)."""
        t = q.shape[0]
        if merge:
            stand_in = q[:, : self.num_kv_heads]  # stored=True: k and v are not read
            out = self.attn(q, stand_in, stand_in, kv_cache, meta, stored=True, pdl=pdl)
            splits = None
        else:
            out, splits = self.attn.forward_unmerged(q, kv_cache, meta, pdl=pdl)
        return out.view(t, self.q_size), splits

    def attend(
        self, qkv: torch.Tensor, meta: AttentionMetadata, kv_cache: KVPair, *, pdl: bool = False
    ) -> torch.Tensor:
        """Rotary, the K/V store and attention over the QKV projection's output qkv
        [num_tokens, (Hq + 2 Hkv) D]; returns [num_tokens, Hq D] (q is rotated in place)."""
        return self._attend_stored(self._rotate_store(qkv, meta, kv_cache, pdl), kv_cache, meta,
                                   pdl, True)[0]  # fmt: skip

    def _rotate_store(self, qkv, meta, kv_cache, pdl: bool) -> torch.Tensor:
        """Rotary and the K/V store over qkv [num_tokens, (Hq + 2 Hkv) D]; returns q
        [num_tokens, Hq, D], rotated in place."""
        t = qkv.shape[0]
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
            t, self.num_kv_heads, self.head_dim
        )
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        # All checks before the first write: the fused kernel rotates q in place and
        # writes the cache, and a call refused after it would leave this step's K/V there.
        self.attn.check(q, k, v, kv_cache, meta)
        k_cache, v_cache = kv_cache
        rotary_store_kv(
            q, k, v, meta.positions, self.rotary.cos_sin_cache, k_cache, v_cache,
            meta.slot_mapping, pdl=pdl,
        )  # fmt: skip
        return q


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one GEMM."""

    def __init__(self, hidden: int, intermediate: int, *, dtype, device):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False, dtype=dtype, device=device)
        self.down_proj = Linear(intermediate, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """With a residual: residual + the MLP's output, added in place inside the down
        GEMM (the residual must be the caller's own stream)."""
        act = silu_and_mul(self.gate_up_proj(x))
        if residual is None or self.down_proj.bias is not None:
            out = self.down_proj(act)
            return out if residual is None else out + residual
        return ops.linear_residual_(act, self.down_proj.weight, residual)


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
        *,
        add_residual: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """residual None (first layer): `hidden` becomes the residual and is updated in
        place, so it must be a tensor the model owns. add_residual: return (the layer's
        whole output, mlp + residual, from the down GEMM, None), for a model whose last
        layer has no norm after it (EAGLE-1)."""
        if residual is None:
            residual = hidden
            x = hidden if self.input_layernorm is None else self.input_layernorm(hidden)
        else:
            if self.input_layernorm is None:
                raise ValueError("a layer without input_layernorm must be the first layer")
            x, residual = self.input_layernorm(hidden, residual)
        x = self.self_attn(x, meta, kv_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        if add_residual:
            return self.mlp(x, residual), None
        return self.mlp(x), residual

    def projection_shapes(self) -> list[tuple[int, int]]:
        """[N, K] of the four projections the fused path launches (kernels.max_fused_rows)."""
        attn, mlp = self.self_attn, self.mlp
        return [tuple(p.weight.shape) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                 mlp.down_proj)]  # fmt: skip

    def forward_fused(
        self,
        stream: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVPair,
        *,
        pdl: bool,
        late_meta: bool = False,
    ) -> None:
        """The layer on the fused decode path (ops.fused_decode): `stream` [T, H] is the
        residual stream entering the layer (what forward's hidden + residual sums to) and
        leaves it holding the layer's output, updated in place. Five launches (six when
        attention splits its keys: the merge): norm + QKV + rotary + K/V store
        (Attention.project_attend), attention, O + residual, norm + gate/up +
        SiLU-and-multiply, down + residual; each rounds once, from float32, where forward
        rounds the norm, the GEMM output and the product too. late_meta: see
        Attention.project_attend."""
        attn, mlp = self.self_attn, self.mlp
        if stream.dim() != 2 or stream.shape[1] != attn.qkv_proj.in_features:
            raise ValueError(
                f"stream has shape {tuple(stream.shape)}, expected "
                f"[num_tokens, {attn.qkv_proj.in_features}]"
            )
        norm = self.input_layernorm
        out, splits = attn.project_attend(
            stream, meta, kv_cache, norm_weight=None if norm is None else norm.weight,
            eps=1e-6 if norm is None else norm.eps, pdl=pdl, late_meta=late_meta,
            merge=not MERGE_IN_O_PROJ,
        )  # fmt: skip
        ops.fused_linear(
            out, attn.o_proj.weight, bias=attn.o_proj.bias, residual=stream, out=stream, pdl=pdl,
            x_splits=splits,
        )  # fmt: skip
        post = self.post_attention_layernorm
        act = ops.fused_linear(
            stream, mlp.gate_up_proj.weight, norm_weight=post.weight, eps=post.eps, glu=True,
            pdl=pdl,
        )  # fmt: skip
        ops.fused_linear(
            act, mlp.down_proj.weight, bias=mlp.down_proj.bias, residual=stream, out=stream,
            pdl=pdl,
        )  # fmt: skip


def fused_row_limit(owner: torch.nn.Module, layers, *extra: torch.Tensor) -> int:
    """Rows up to which `owner`'s forward takes the fused decode path:
    kernels.max_fused_rows of its decoder layers' projections and the `extra` weights,
    computed once and kept on the module."""
    rows = owner.__dict__.get("_fused_rows")
    if rows is None:
        shapes = [s for layer in layers for s in layer.projection_shapes()]
        shapes += [tuple(w.shape) for w in extra]
        rows = owner.__dict__["_fused_rows"] = kernels.max_fused_rows(shapes)
    return rows


def layer_caches(
    kv_caches,
    num_layers: int,
    *,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
) -> list[KVPair]:
    """Per-layer (k_cache, v_cache) pairs from a KVCache or a sequence of pairs, each
    checked (when the model's shape is given) before any layer writes to any of them."""
    if hasattr(kv_caches, "layer") and hasattr(kv_caches, "num_layers"):
        if kv_caches.num_layers < num_layers:
            raise ValueError(
                f"KV cache has {kv_caches.num_layers} layers, the model needs {num_layers}"
            )
        pairs = [kv_caches.layer(i) for i in range(num_layers)]
    else:
        try:
            pairs = list(kv_caches)
        except TypeError:
            raise TypeError(
                f"kv_caches must be a KVCache or a sequence of (k_cache, v_cache) pairs, "
                f"got {type(kv_caches).__name__}"
            ) from None
        if len(pairs) != num_layers:
            raise ValueError(f"kv_caches has {len(pairs)} (k, v) pairs, the model has {num_layers}")
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"kv_caches[{i}] must be a (k_cache, v_cache) pair")
        for which, t in zip(("k_cache", "v_cache"), pair):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"kv_caches[{i}] {which} must be a tensor, got {type(t).__name__}")
            if num_kv_heads is not None and (
                t.dim() != 4
                or tuple(t.shape[2:])
                != (
                    num_kv_heads,
                    head_dim,
                )
            ):
                raise ValueError(
                    f"kv_caches[{i}] {which} has shape {tuple(t.shape)}, expected [num_blocks, "
                    f"block_size, {num_kv_heads}, {head_dim}] for this model"
                )
            if dtype is not None and t.dtype != dtype:
                raise TypeError(f"kv_caches[{i}] {which} is {t.dtype}, the model runs in {dtype}")
        if pair[0].shape != pair[1].shape:
            raise ValueError(
                f"kv_caches[{i}]: k_cache {tuple(pair[0].shape)} and v_cache "
                f"{tuple(pair[1].shape)} differ"
            )
    return pairs


def check_step_inputs(
    input_ids: torch.Tensor,
    meta: AttentionMetadata,
    *,
    vocab_size: int,
    rotary: RotaryEmbedding,
    logits_indices: torch.Tensor | None,
    all_logits: bool,
) -> None:
    """Everything a model forward can check before its first write: the ids' shape
    (and, where validation is on, their values), the rotary table against the metadata's
    length bound, and the logits selection."""
    if not isinstance(meta, AttentionMetadata):
        raise TypeError(f"meta must be an AttentionMetadata, got {type(meta).__name__}")
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 1 or input_ids.shape[0] != meta.num_tokens:
        raise ValueError(
            f"input_ids has shape {tuple(input_ids.shape)}, expected [{meta.num_tokens}]"
        )
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must be int64 or int32, got {input_ids.dtype}")
    if meta.max_seq_len > rotary.max_positions:
        raise ValueError(
            f"the metadata allows sequences of {meta.max_seq_len} tokens (max_model_len) but "
            f"the model's rotary table has {rotary.max_positions} positions: build the model "
            f"with max_positions >= {meta.max_seq_len}"
        )
    if kernels.validation_enabled(input_ids) and input_ids.numel():
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"input_ids holds token id {bad}, outside [0, {vocab_size})")
    if all_logits:
        if logits_indices is not None:
            raise ValueError("give logits_indices or all_logits=True, not both")
        return
    if logits_indices is None:
        return
    check_row_index(
        "logits_indices", logits_indices, device=input_ids.device, bound=meta.num_tokens
    )


def check_row_index(name: str, idx, *, device, bound: int, length: int | None = None) -> None:
    """`idx` must be a 1-D int64 tensor of row indices on `device` (`length` long when
    given) whose values lie in [0, bound); the values are checked in validation mode
    only (reading them is a synchronisation on the GPU)."""
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(idx).__name__}")
    if idx.dtype != torch.int64 or idx.dim() != 1:
        raise TypeError(f"{name} must be a 1-D int64 tensor, got {idx.dtype} {idx.dim()}-D")
    if idx.device != device or (length is not None and idx.shape[0] != length):
        want = "" if length is None else f"[{length}] "
        raise ValueError(f"{name} {tuple(idx.shape)} on {idx.device} must be {want}on {device}")
    if kernels.validation_enabled(idx) and idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= bound:
            raise ValueError(f"{name} holds row {lo if lo < 0 else hi}, outside [0, {bound})")


def select_logits(
    hidden: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    meta: AttentionMetadata,
    logits_indices: torch.Tensor | None,
    all_logits: bool,
) -> torch.Tensor:
    """lm_head over the rows of `hidden` that need logits: every row with all_logits,
    else logits_indices (a device int64 tensor of row indices, checked by
    check_step_inputs), else each request's last token (meta.last_token_idx; padded
    requests read row 0, or with meta.last_is_row, a decode step's, their own padding
    row: every row as it is, no gather launch). An lm_head with `takes_x_rows` set
    (Int8Linear, a draft round's partials head) reads those rows itself (x_rows=):
    no gather launch either."""
    if all_logits or (logits_indices is None and meta.last_is_row):
        return lm_head(hidden)
    idx = meta.last_token_idx if logits_indices is None else logits_indices
    if getattr(lm_head, "takes_x_rows", False):
        return lm_head(hidden, x_rows=idx)
    return lm_head(hidden.index_select(0, idx))
