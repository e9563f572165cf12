"""Step inputs in one launch each: EAGLE-1's [embed(token); hidden] per token (alone, or
formed on load by its fc: embed_fc), and the target's device-fed token ids resolved.

An EAGLE-1 head feeds fc with the concatenation of the token's embedding row and a
hidden state (the target's, or the head's own from the step before). torch builds it in
two launches (the embedding gather, then the cat); here one program per token copies
both halves into the [num_tokens, E + H] input of fc. Ids are the caller's to check
(the models validate input ids against the vocabulary before anything runs); an id
outside the table is clamped into it, so no read leaves the tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .draft_round import (
    AdvanceFold,
    _advance_position,
    _advance_slot,
    _advance_store,
    _advance_token,
)
from .fused_linear import (
    ROWS_MAX_K,
    _lanes_sum,
    _rows_part,
    _rows_program,
    _rows_tile,
    _rows_w,
)
from .guard import INTERPRET
from .launch import CachedLaunch, pdl_launch, specialization_key
from .paged_attention import _check_tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _embed_concat_kernel(
    ids_ptr, table_ptr, stride_t, hid_ptr, stride_h, out_ptr, stride_o, n_vocab,
    E: tl.constexpr, H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    tok = tl.load(ids_ptr + t).to(tl.int64)
    tok = tl.minimum(tl.maximum(tok, 0), n_vocab - 1)
    ce = tl.arange(0, BLOCK_E)
    e = tl.load(table_ptr + tok * stride_t + ce, mask=ce < E)
    tl.store(out_ptr + t * stride_o + ce, e.to(out_ptr.dtype.element_ty), mask=ce < E)
    ch = tl.arange(0, BLOCK_H)
    h = tl.load(hid_ptr + t * stride_h + ch, mask=ch < H)
    tl.store(out_ptr + t * stride_o + E + ch, h.to(out_ptr.dtype.element_ty), mask=ch < H)


_LAUNCH = CachedLaunch(_embed_concat_kernel)


def check_embed_concat_args(
    ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, out: torch.Tensor | None = None
) -> None:
    """embed_concat's argument checks (nothing launched)."""
    _check_tensor("ids", ids, 1, (torch.int32, torch.int64))
    _check_tensor("table", table, 2, _DTYPES)
    _check_tensor("hidden", hidden, 2, _DTYPES)
    n, e, h = ids.shape[0], table.shape[1], hidden.shape[1]
    if hidden.shape[0] != n:
        raise ValueError(f"hidden has {hidden.shape[0]} rows, ids {n}: one per token")
    if hidden.dtype != table.dtype:
        raise TypeError(f"hidden has dtype {hidden.dtype}, table {table.dtype}: they must agree")
    if table.shape[0] == 0:
        raise ValueError("table has no rows")
    devices = {t.device for t in (ids, table, hidden)}
    if out is not None:
        _check_tensor("out", out, 2, (table.dtype,))
        if tuple(out.shape) != (n, e + h):
            raise ValueError(f"out has shape {tuple(out.shape)}, expected [{n}, {e + h}]")
        devices.add(out.device)
    if len(devices) != 1:
        raise ValueError(f"ids, table, hidden and out must share a device, got {devices}")


def embed_concat(
    ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """[num_tokens, E + H]: table[ids] then hidden, row by row (torch.cat([F.embedding(
    ids, table), hidden], -1)). ids [num_tokens] int32/int64, table [vocab, E], hidden
    [num_tokens, H] of table's dtype."""
    check_embed_concat_args(ids, table, hidden, out)
    n, e, h = ids.shape[0], table.shape[1], hidden.shape[1]
    if out is None:
        out = torch.empty(n, e + h, dtype=table.dtype, device=table.device)
    if n == 0:
        return out
    args = (ids, table, table.stride(0), hidden, hidden.stride(0), out, out.stride(0),
            table.shape[0], e, h, triton.next_power_of_2(e), triton.next_power_of_2(h))  # fmt: skip
    warps = 4 if max(e, h) >= 512 else 1
    dev = table.device.index
    _LAUNCH(specialization_key(args) + (dev,), (n,), args, {"num_warps": warps})
    return out


# The decode step's embedding gather as a Triton launch with programmatic dependent
# launch, where torch's (index_select) has none: the gather starts while the kernel
# before it finishes, and the first layer's launch loads its weights while the gather
# runs. H100, SmolLM2's step under a graph, context 256, against torch's gather in the
# same process (bench/NOTES.md, stop 61): -1.1 µs at 1 row, -3 at 4, -1.7 to -4.4 at 8,
# the logits bit-equal.
@triton.jit
def _embed_rows_kernel(ids_ptr, table_ptr, out_ptr, n, n_vocab, E, stride_t, stride_o,
                      ROWS: tl.constexpr, BLOCK_E: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
    if GDC:  # the ids may be the kernel just before's output (resolve_fed_ids)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = (tl.program_id(0) * ROWS + tl.arange(0, ROWS))[:, None].to(tl.int64)
    live = t < n
    tok = tl.load(ids_ptr + t, mask=live, other=0).to(tl.int64)
    tok = tl.minimum(tl.maximum(tok, 0), n_vocab - 1)
    ce = tl.arange(0, BLOCK_E)[None, :]
    ok = live & (ce < E)
    e = tl.load(table_ptr + tok * stride_t + ce, mask=ok)
    tl.store(out_ptr + t * stride_o + ce, e.to(out_ptr.dtype.element_ty), mask=ok)


_EMBED_ROWS = CachedLaunch(_embed_rows_kernel)


def check_embed_rows_args(
    ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None = None
) -> None:
    """embed_rows's argument checks (nothing launched)."""
    _check_tensor("ids", ids, 1, (torch.int32, torch.int64))
    _check_tensor("table", table, 2, _DTYPES)
    if table.shape[0] == 0:
        raise ValueError("table has no rows")
    if table.stride(1) != 1:
        raise ValueError(f"table needs contiguous rows, has strides {table.stride()}")
    devices = {ids.device, table.device}
    if out is not None:
        _check_tensor("out", out, 2, (table.dtype,))
        if tuple(out.shape) != (ids.shape[0], table.shape[1]):
            raise ValueError(
                f"out has shape {tuple(out.shape)}, expected [{ids.shape[0]}, {table.shape[1]}]"
            )
        if out.stride(1) != 1:
            raise ValueError(f"out needs contiguous rows, has strides {out.stride()}")
        devices.add(out.device)
    if len(devices) != 1:
        raise ValueError(f"ids, table and out must share a device, got {devices}")


def embed_rows(
    ids: torch.Tensor, table: torch.Tensor, *, out: torch.Tensor | None = None, pdl: bool = False
) -> torch.Tensor:
    """[num_tokens, E] = table[ids] (F.embedding) in one launch, with programmatic
    dependent launch when pdl=True (see kernels.pdl_supported). ids int32 / int64 are the
    caller's to check against the table (the models do, before anything runs); an id
    outside it is clamped into it, so no read leaves the table."""
    check_embed_rows_args(ids, table, out)
    n, e = ids.shape[0], table.shape[1]
    if out is None:
        out = torch.empty(n, e, dtype=table.dtype, device=table.device)
    if n == 0 or e == 0:
        return out
    # one row a program (a decode step's few rows: latency); the interpreter pays per
    # program, so there all rows in one
    rows = min(64, triton.next_power_of_2(n)) if INTERPRET else 1
    gdc, options = pdl_launch(pdl)
    block = triton.next_power_of_2(e)
    args = (ids, table, out, n, table.shape[0], e, table.stride(0), out.stride(0), rows, block,
            gdc)  # fmt: skip
    warps = 4 if block >= 512 else 1
    _EMBED_ROWS(specialization_key(args) + (table.device.index,), (triton.cdiv(n, rows),), args,
               {"num_warps": warps, **options})  # fmt: skip
    return out


@triton.jit
def _resolve_fed_ids_kernel(ids_ptr, last_ptr, out_ptr, n, n_rows, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    ids = tl.load(ids_ptr + offs, mask=live, other=0).to(tl.int64)
    fed = ids < 0
    row = tl.minimum(-1 - ids, n_rows - 1)  # fed: >= 0
    tok = tl.load(last_ptr + row, mask=live & fed, other=0)
    tl.store(out_ptr + offs, tl.where(fed, tok, ids), mask=live)


_RESOLVE = CachedLaunch(_resolve_fed_ids_kernel)


def check_resolve_fed_ids_args(
    ids: torch.Tensor, last_token: torch.Tensor, out: torch.Tensor | None = None
) -> None:
    """resolve_fed_ids's argument checks (nothing launched)."""
    _check_tensor("ids", ids, 1, (torch.int64,))
    _check_tensor("last_token", last_token, 1, (torch.int64,))
    if last_token.shape[0] == 0:
        raise ValueError("last_token has no rows")
    devices = {ids.device, last_token.device}
    if out is not None:
        _check_tensor("out", out, 1, (torch.int64,))
        if out.shape != ids.shape:
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(ids.shape)}")
        devices.add(out.device)
    if len(devices) != 1:
        raise ValueError(f"ids, last_token and out must share a device, got {devices}")


def resolve_fed_ids(
    ids: torch.Tensor, last_token: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """int64 [n]: ids with each device-fed entry -(row + 1) replaced by last_token[row]
    (the token the step before sampled for that block-table row), the others as they
    are; what torch does in five launches (compare, negate, clamp, gather, select) in
    one. A fed row past the table reads its last row: no read leaves last_token."""
    check_resolve_fed_ids_args(ids, last_token, out)
    n = ids.shape[0]
    if out is None:
        out = torch.empty_like(ids)
    if n == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    args = (ids, last_token, out, n, last_token.shape[0], block)
    warps = 4 if block >= 512 else 1
    _RESOLVE(specialization_key(args) + (ids.device.index,), (triton.cdiv(n, block),), args,
             {"num_warps": warps})  # fmt: skip
    return out


# EAGLE-1's fc with its input formed on load: fc([table[ids]; hidden[rows]]) in one
# launch, where embed_concat, a gather of the hidden rows and fc take three. The product
# is fused_linear's rows kernel, tile for tile (same K layout, columns, summation order),
# so its output equals embed_concat then fused_linear bit for bit.
EMBED_FC_MAX_ROWS = 8  # fused_linear's rows kernel


@triton.jit
def _cat_x(e_ptr, tok, h_ptr, hr, kk, km, rmask, nn, E, stride_e, stride_h):
    """[table[tok]; hidden[hr]] over one K piece, [BN, R, KH, KL] float32."""
    ptr = tl.where(kk < E, e_ptr + tok * stride_e + kk, h_ptr + hr * stride_h + (kk - E))
    return tl.load(ptr + nn * 0, mask=km & rmask & (nn * 0 == 0), other=0.0).to(tl.float32)


@triton.jit
def _embed_fc_kernel(
    ids_ptr, e_ptr, h_ptr, hrow_ptr, w_ptr, b_ptr, out_ptr, M, N, K, E, n_vocab, n_hidden,
    stride_e, stride_h, stride_w, stride_o,
    KH1: tl.constexpr, KH2: tl.constexpr, KL: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_HROW: tl.constexpr, GDC: tl.constexpr, ROWS: tl.constexpr,
    # ADVANCE: a draft round's advance done on the way (AdvanceFold.args)
    a_slots, a_tok, a_stride_tok, a_val, a_idx, a_stride_p, a_blocks, a_off, a_rows,
    a_stride_rows, a_cur_pos, a_pos, a_seq, a_slot, a_max_blocks, a_vocab, a_null_row,
    A_BLOCK_SIZE: tl.constexpr, A_FROM_PARTS: tl.constexpr, A_HAS_OFF: tl.constexpr,
    A_BLOCK_P: tl.constexpr, ADVANCE: tl.constexpr,
):  # fmt: skip
    rr, nn, rows, cols, omask = _rows_program(M, N, BLOCK_N, ROWS)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    k1, km1, w1 = _rows_w(w_ptr, nn, N, K, stride_w, 0, KH1, KL)
    if KH2 > 0:
        k2, km2, w2 = _rows_w(w_ptr, nn, N, K, stride_w, KH1 * KL, KH2, KL)
    if ADVANCE:  # every program forms the ids; program 0 alone writes the step's inputs
        ri = tl.arange(0, ROWS)
        in_batch = ri < M
        writer = in_batch & (ri * 0 + tl.program_id(0) == 0)  # (a tensor: the interpreter)
        real, slot = _advance_slot(a_slots, ri, in_batch)
        pos, slot_out = _advance_position(a_cur_pos, a_rows, a_stride_rows, ri, real & writer,
                                          slot, a_null_row, a_max_blocks, A_BLOCK_SIZE)  # fmt: skip
    if GDC:  # the ids and hidden rows are the kernels' before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    w1 = w1.to(tl.float32)  # after the wait, as in fused_linear's _rows_gemv
    if KH2 > 0:
        w2 = w2.to(tl.float32)
    rmask = rr < M
    if ADVANCE:
        t = _advance_token(a_tok, a_stride_tok, a_val, a_idx, a_stride_p, a_blocks, a_off, ri,
                           in_batch, real, a_vocab, writer, A_FROM_PARTS, A_HAS_OFF, ROWS,
                           A_BLOCK_P)  # fmt: skip
        _advance_store(a_cur_pos, ids_ptr, a_pos, a_seq, a_slot, ri, writer, real & writer, t,
                       pos, slot_out)  # fmt: skip
        tok = t[None, :, None, None]
    else:
        tok = tl.load(ids_ptr + rr, mask=rmask, other=0).to(tl.int64)
    tok = tl.minimum(tl.maximum(tok, 0), n_vocab - 1)
    hr = rr.to(tl.int64)
    if HAS_HROW:
        hr = tl.load(hrow_ptr + rr, mask=rmask, other=0)
    hr = tl.minimum(tl.maximum(hr, 0), n_hidden - 1)
    part = _rows_part(w1, _cat_x(e_ptr, tok, h_ptr, hr, k1, km1, rmask, nn, E, stride_e, stride_h))
    if KH2 > 0:
        x2 = _cat_x(e_ptr, tok, h_ptr, hr, k2, km2, rmask, nn, E, stride_e, stride_h)
        part += _rows_part(w2, x2)
    acc = _lanes_sum(part)
    if HAS_BIAS:
        acc += bias
    tl.store(out_ptr + rows * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=omask)


_EMBED_FC = CachedLaunch(_embed_fc_kernel)


def embed_fc_supported(num_tokens: int, in_features: int) -> bool:
    """Whether embed_fc takes num_tokens rows into an fc of this width: the rows
    kernel's rows and K."""
    return 1 <= num_tokens <= EMBED_FC_MAX_ROWS and in_features <= ROWS_MAX_K


def check_embed_fc_args(ids, table, hidden, weight, bias=None, hidden_rows=None) -> None:
    """embed_fc's argument checks (nothing launched)."""
    _check_tensor("ids", ids, 1, (torch.int32, torch.int64))
    _check_tensor("table", table, 2, _DTYPES)
    _check_tensor("hidden", hidden, 2, (table.dtype,))
    _check_tensor("weight", weight, 2, (table.dtype,))
    n, e, h = ids.shape[0], table.shape[1], hidden.shape[1]
    if weight.shape[1] != e + h:
        raise ValueError(f"weight {tuple(weight.shape)} must have E + H = {e + h} columns")
    if not embed_fc_supported(n, e + h):
        raise ValueError(
            f"embed_fc takes 1 to {EMBED_FC_MAX_ROWS} ids and E + H <= {ROWS_MAX_K}, "
            f"got {n} ids, E + H {e + h}"
        )
    if table.shape[0] == 0 or hidden.shape[0] == 0:
        raise ValueError("table and hidden need at least one row")
    if hidden_rows is not None:
        _check_tensor("hidden_rows", hidden_rows, 1, (torch.int64,))
        if hidden_rows.shape[0] != n:
            raise ValueError(f"hidden_rows has {hidden_rows.shape[0]} rows, ids {n}")
    elif hidden.shape[0] != n:
        raise ValueError(f"hidden has {hidden.shape[0]} rows, ids {n}: one per token")
    if bias is not None:
        _check_tensor("bias", bias, 1, (table.dtype,))
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected [{weight.shape[0]}]")
    tensors = (ids, table, hidden, weight, bias, hidden_rows)
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"ids, table, hidden, weight, bias and hidden_rows must share a "
                         f"device, got {devices}")  # fmt: skip


def embed_fc(
    ids: torch.Tensor,
    table: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    hidden_rows: torch.Tensor | None = None,
    pdl: bool = False,
    advance: AdvanceFold | None = None,
) -> torch.Tensor:
    """[num_tokens, N] = [table[ids]; hidden[hidden_rows]] weight^T (+ bias), one launch
    (hidden's rows in order when hidden_rows is None). Ids and hidden rows outside
    their tensors are clamped into them (the caller checks them). pdl: programmatic
    dependent launch (see kernels.pdl_supported). advance: a draft round's advance
    (DraftRoundKernels.advance_fold) done on the way, over the same rows: the ids are
    the tokens it computes (every program forms them), and program 0 writes what the
    advance kernel would (ids must then be advance.d_ids). The step's next kernel
    must read positions and slots after its PDL wait (fused_qkv_rope's late_meta)."""
    check_embed_fc_args(ids, table, hidden, weight, bias, hidden_rows)
    m, e = ids.shape[0], table.shape[1]
    if advance is not None:
        if not isinstance(advance, AdvanceFold):
            raise TypeError(f"advance must be an AdvanceFold, got {type(advance).__name__}")
        d_ids = advance.d_ids
        if advance.num_rows != m or ids.data_ptr() != d_ids.data_ptr() or ids.stride(0) != 1:
            raise ValueError(
                f"ids must be the advance's own d_ids ({advance.num_rows} rows), got "
                f"{m} ids elsewhere"
            )
    n, k = weight.shape
    out = torch.empty((m, n), dtype=table.dtype, device=table.device)
    kh1, kh2, kl, block_n, warps = _rows_tile(k, table.element_size())
    rows = triton.next_power_of_2(m)
    gdc, options = pdl_launch(pdl)
    if advance is None:
        i = ids  # pointers nothing reads
        adv = (i, i, 0, i, i, 0, 0, i, i, 0, i, i, i, i, 0, 0, 0, 1, False, False, 16, False)
    else:
        adv = advance.args + (True,)
    args = (ids, table, hidden, hidden_rows if hidden_rows is not None else ids, weight,
            bias if bias is not None else weight, out, m, n, k, e, table.shape[0],
            hidden.shape[0], table.stride(0), hidden.stride(0), weight.stride(0),
            out.stride(0), kh1, kh2, kl, block_n, bias is not None, hidden_rows is not None,
            gdc, rows) + adv  # fmt: skip
    key = specialization_key(args) + (table.device.index, warps)
    _EMBED_FC(key, (triton.cdiv(n, block_n), 1), args, {"num_warps": warps, **options})
    return out
