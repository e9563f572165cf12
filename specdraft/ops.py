"""The runtime's kernel calls, on whichever path the tensors allow.

CUDA tensors run the Triton kernels (specdraft.kernels). CPU tensors run them under the
Triton interpreter when TRITON_INTERPRET=1 was set before specdraft was imported (the
tests do this), and otherwise run the PyTorch implementation of the same math
(specdraft.torch_ops), so the library works on a machine without a GPU.

`use_backend("torch" | "triton")` forces a path for a block of code (the tests compare
the two on the same model); `SPECDRAFT_BACKEND` does the same for a whole process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from specdraft import kernels, torch_ops
from specdraft.kernels.fused_linear import MAX_K as _FUSED_MAX_K
from specdraft.kernels.fused_linear import ROWS_MAX_K as _ROWS_MAX_K

_BACKENDS = ("torch", "triton")
_forced: str | None = None


def _from_env() -> str | None:
    value = os.environ.get("SPECDRAFT_BACKEND") or None
    if value is not None and value not in _BACKENDS:
        raise ValueError(f"SPECDRAFT_BACKEND must be one of {_BACKENDS} or unset, got {value!r}")
    return value


def set_backend(name: str | None) -> None:
    """Force "torch" or "triton" for every later call; None returns to the default
    (Triton for CUDA tensors or under the interpreter, PyTorch otherwise)."""
    global _forced
    if name is not None and name not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS} or None, got {name!r}")
    _forced = name


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Context manager form of set_backend."""
    global _forced
    before = _forced
    set_backend(name)
    try:
        yield
    finally:
        _forced = before


def backend_for(t: torch.Tensor) -> str:
    """The path a call on tensor `t` takes now."""
    forced = _forced or _from_env()
    if forced is not None:
        return forced
    if t.device.type == "cuda" or kernels.INTERPRET:
        return "triton"
    return "torch"


# On the PyTorch path each call first runs its kernel launcher's argument checks (nothing
# is launched), so both paths refuse the same inputs with the same messages.


def _impl(name: str, t: torch.Tensor):
    module = kernels if backend_for(t) == "triton" else torch_ops
    return getattr(module, name)


_small_m_linear = os.environ.get("SPECDRAFT_GEMV", "") == "1"


def set_small_m_linear(enabled: bool) -> None:
    """Route Linear layers with at most 16 rows of input on the Triton backend through
    kernels.linear_small_m instead of cuBLAS (off by default: bench/gemv.py measures
    whether it pays on a GPU). Applies to calls made, or graphs captured, afterwards."""
    global _small_m_linear
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _small_m_linear = enabled


# One row of input with K past the rows kernel's (fused_linear.ROWS_MAX_K) goes through
# kernels.fused_linear's wide kernel instead of cuBLAS. H200 (stop 34, one row, bf16,
# weights rotated out of L2, µs against cuBLAS): 128256 x 4096 (a Llama-3 lm_head) 231.3
# / 248.6 (the read floor 233.0), 28672 x 4096 53.9 / 56.3, 4096 x 14336 28.2 / 32.0; at
# K 576 (SmolLM2's lm_head, the rows kernel) 17.6 / 16.4, so smaller K stays on cuBLAS;
# at 4 rows the wide kernel runs its rows one after another, 2-4x slower.


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b): cuBLAS (F.linear); on the Triton backend one row with a wide K
    through kernels.fused_linear (above; off with the fused decode path,
    set_fused_decode), or the small-M Triton kernel when enabled and x is [M <= 16, K]
    with contiguous rows."""
    if (
        _fused_decode
        and x.dim() == 2
        and x.shape[0] == 1
        and weight.dim() == 2
        and _ROWS_MAX_K < weight.shape[1] <= _FUSED_MAX_K
        and x.dtype == weight.dtype
        and (bias is None or bias.dtype == weight.dtype)
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and not (x.requires_grad or weight.requires_grad)  # no backward through a kernel
        and backend_for(x) == "triton"
    ):
        return kernels.fused_linear(x, weight, bias=bias, pdl=kernels.pdl_supported(x.device))
    if (
        _small_m_linear
        and x.dim() == 2
        and x.shape[0] <= kernels.gemv.MAX_ROWS
        and x.shape[0] >= 1
        and x.stride(1) == 1
        and backend_for(x) == "triton"
    ):
        return kernels.linear_small_m(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


_fused_decode = os.environ.get("SPECDRAFT_FUSED", "1") != "0"
# Rows up to which the fused path runs, for every model (None: each model's own limit,
# kernels.max_fused_rows of its projections' shapes); the decode benchmark sets it.
_fused_rows: int | None = None
# Under Triton's interpreter forwards of more than this many rows take the unfused path
# unless _fused_rows says otherwise, to keep the CPU tests short (CI, stop 26: the 8-row
# limit took them 719 -> 1215 s with the wide kernel's row loop, which ran each row in
# Python).
_INTERPRET_FUSED_ROWS = 4


def set_fused_decode(enabled: bool) -> None:
    """Whether decoder layers run inputs of a few rows (4, or up to 8 for models small
    enough: kernels.max_fused_rows) on the Triton backend through the fused decode
    path (each projection one
    kernels.fused_linear launch with its RMSNorm, SiLU-and-multiply and residual add
    folded in, launched with programmatic dependent launch where the GPU has it), and
    single rows with a wide K through its wide kernel (linear). On by default;
    SPECDRAFT_FUSED=0 turns it off for a process. Applies to calls made, or graphs
    captured, afterwards."""
    global _fused_decode
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _fused_decode = enabled


def fused_decode(x: torch.Tensor, max_rows: int = 4, *, rows: int | None = None) -> bool:
    """Whether a decoder forward over hidden states `x` [num_tokens, H] takes the fused
    decode path now (see set_fused_decode): at most `max_rows` rows (the model's
    kernels.max_fused_rows) on the Triton backend. rows: the forward's token count
    when x holds other rows (a state table its tokens gather from)."""
    limit = _fused_rows
    if limit is None:
        limit = min(max_rows, _INTERPRET_FUSED_ROWS) if kernels.INTERPRET else max_rows
    rows = x.shape[0] if rows is None else rows
    return _fused_decode and x.dim() == 2 and 1 <= rows <= limit and backend_for(x) == "triton"


def fused_linear(x: torch.Tensor, weight: torch.Tensor, **kw) -> torch.Tensor:
    """kernels.fused_linear (Triton backend only: the fused decode path's projection)."""
    return kernels.fused_linear(x, weight, **kw)


def fused_qkv_rope(x: torch.Tensor, weight: torch.Tensor, *args, **kw) -> torch.Tensor:
    """kernels.fused_qkv_rope (Triton backend only: the fused decode path's QKV
    projection with rotary and the K/V store)."""
    return kernels.fused_qkv_rope(x, weight, *args, **kw)


def linear_residual_(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual += x W^T in place, one cuBLAS call (the addition in the GEMM's float32
    epilogue, one rounding; in place, so no copy of the residual first): a layer's output
    with its residual stream added. Returns residual."""
    return residual.addmm_(x, weight.t())


def embed_rows(ids: torch.Tensor, table: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """[num_tokens, E] = table[ids]: one launch with programmatic dependent launch
    (pdl=True) on the Triton backend (the fused decode path's gather), F.embedding on
    the PyTorch one."""
    impl = _impl("embed_rows", table)
    if impl is torch_ops.embed_rows:
        kernels.check_embed_rows_args(ids, table)
        return impl(ids, table)
    return impl(ids, table, pdl=pdl)


def embed_concat(ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """[num_tokens, E + H]: each token's embedding row, then its hidden state (EAGLE-1's
    fc input); one launch on the Triton backend."""
    impl = _impl("embed_concat", table)
    if impl is torch_ops.embed_concat:
        kernels.check_embed_concat_args(ids, table, hidden)
    return impl(ids, table, hidden)


def embed_fc_takes(ids: torch.Tensor, fc_weight: torch.Tensor) -> bool:
    """Whether embed_fc forms fc([embed(ids); hidden]) in one launch now: the Triton
    backend and a shape kernels.embed_fc takes."""
    return backend_for(fc_weight) == "triton" and kernels.embed_fc_supported(
        ids.shape[0], fc_weight.shape[1]
    )


def embed_fc(ids, table, hidden, weight, bias=None, **kw) -> torch.Tensor:
    """kernels.embed_fc (Triton backend only, see embed_fc_takes): EAGLE-1's fc over
    [table[ids]; hidden[hidden_rows]] in one launch."""
    return kernels.embed_fc(ids, table, hidden, weight, bias, **kw)


def resolve_fed_ids(ids: torch.Tensor, last_token: torch.Tensor) -> torch.Tensor:
    """int64 [n]: ids with each device-fed entry -(row + 1) replaced by last_token[row];
    one launch on the Triton backend."""
    impl = _impl("resolve_fed_ids", ids)
    if impl is torch_ops.resolve_fed_ids:
        kernels.check_resolve_fed_ids_args(ids, last_token)
    return impl(ids, last_token)


def linear_int8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, **kw):
    """x @ (weight int8 [N, K] * scale [N, 1])^T in x's dtype (kernels.linear_int8)."""
    if backend_for(x) == "triton":
        return kernels.linear_int8(x, weight, scale, **kw)
    kw["act_int8"] = kernels.resolve_act_int8(kw.get("act_int8"))
    kernels.check_linear_int8_args(x, weight, scale, out=kw.get("out"), x_rows=kw.get("x_rows"))
    return torch_ops.linear_int8(x, weight, scale, **kw)


def linear_int8_partials(
    x, weight, scale, part_val, part_idx, *, x_rows=None, pdl=False, act_int8=None
) -> int:
    """A greedy argmax over x (weight * scale)^T (x's rows x_rows) left as (maximum,
    first column) per column block in part_val / part_idx, no logits written; returns
    the block count (kernels.linear_int8_partials; the PyTorch path writes one block)."""
    args = (x, weight, scale, part_val, part_idx)
    if backend_for(x) == "triton":
        return kernels.linear_int8_partials(*args, x_rows=x_rows, pdl=pdl, act_int8=act_int8)
    act_int8 = kernels.resolve_act_int8(act_int8)
    kernels.check_linear_int8_partials_args(*args, x_rows)
    return torch_ops.linear_int8_partials(*args, x_rows=x_rows, act_int8=act_int8)


def argmax(
    logits: torch.Tensor, *, out=None, tickets=None, offsets=None, pdl: bool = False
) -> torch.Tensor:
    """int64 [rows]: the first index of each row's maximum (greedy decoding), plus
    offsets[index] with an id map; into `out` (any 1-D int64 view) when given. With
    `tickets` (kernels.argmax_rows) the Triton backend takes one launch (with `pdl`,
    a programmatic dependent one)."""
    if backend_for(logits) == "triton":
        return kernels.argmax_rows(logits, out=out, tickets=tickets, offsets=offsets, pdl=pdl)
    kernels.check_argmax_args(logits, out=out, tickets=tickets, offsets=offsets)
    idx = logits.argmax(dim=-1)
    if offsets is not None:
        idx = idx + offsets[idx]
    if out is None:
        return idx
    return out.copy_(idx)


def paged_attention(
    q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, *, pdl=False, **kw
):
    """pdl: programmatic dependent launch on the Triton backend (the PyTorch path has no
    launches to chain)."""
    impl = _impl("paged_attention", q)
    if impl is torch_ops.paged_attention:
        # Same argument checks as the kernel's launcher, nothing launched.
        kernels.check_paged_attention_args(
            q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, **kw
        )
        return impl(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, **kw)
    return impl(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, pdl=pdl, **kw)


def paged_attention_unmerged(q, *args, **kw):
    """kernels.paged_attention_unmerged (Triton backend only: the fused decode path's
    attention, whose split partials the output projection merges on its loads)."""
    return kernels.paged_attention_unmerged(q, *args, **kw)


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    impl = _impl("store_kv", k)
    if impl is torch_ops.store_kv:
        kernels.check_store_kv_args(k, v, k_cache, v_cache, slot_mapping)
    impl(k, v, k_cache, v_cache, slot_mapping)


def rms_norm(x, weight, eps, **kw):
    impl = _impl("rms_norm", x)
    if impl is torch_ops.rms_norm:
        kernels.check_rms_norm_args(x, weight, eps, **kw)
    return impl(x, weight, eps, **kw)


def apply_rotary(q, k, positions, cos_sin_cache) -> None:
    impl = _impl("apply_rotary", q)
    if impl is torch_ops.apply_rotary:
        kernels.check_rotary_args(q, k, positions, cos_sin_cache)
    impl(q, k, positions, cos_sin_cache)


def rotary_store_kv(
    q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, *, pdl: bool = False
) -> None:
    """apply_rotary then store_kv in one launch on the Triton backend: q rotated in
    place, rotated k and v written to the cache at their slots, k itself left unrotated
    (kernels.rotary_store_kv; pdl: with programmatic dependent launch). Both paths check
    everything before writing anything."""
    impl = _impl("rotary_store_kv", q)
    if impl is torch_ops.rotary_store_kv:
        kernels.check_rotary_store_kv_args(
            q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping
        )
        impl(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
        return
    impl(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, pdl=pdl)


def silu_and_mul(x, *, out=None):
    impl = _impl("silu_and_mul", x)
    if impl is torch_ops.silu_and_mul:
        kernels.check_silu_and_mul_args(x, out=out)
    return impl(x, out=out)


def prepare_slot_mapping(positions, query_start_loc, block_table, block_size, out, **kw):
    """Checks the buffers once (as the kernel's launcher does) and returns the per-step
    launch(num_reqs, num_tokens) of the chosen path."""
    checked = kernels.prepare_slot_mapping(
        positions, query_start_loc, block_table, block_size, out, _device_check=False, **kw
    )
    if backend_for(out) == "triton":
        return checked
    torch_launch = torch_ops.prepare_slot_mapping(
        positions, query_start_loc, block_table, block_size, out, **kw
    )

    def launch(num_reqs: int, num_tokens: int) -> None:
        checked.check(num_reqs, num_tokens)
        torch_launch(num_reqs, num_tokens)

    return launch
