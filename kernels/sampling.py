"""Fused sampling without top-k / top-p: temperature, greedy rows mixed in, in three
launches.

The definition is specdraft.sampling (`filtered_probs`, `sample`); this is its fast path
for batches whose rows use no filter. Per row: z = logits.float() / T (T = 1 on greedy
rows), p = softmax(z), and the token is the winner of the exponential race argmax_i
p_i / E_i, with E_i = -log1p(-u_i) and u_i specdraft.sampling's keyed uniforms, bit for
bit (SplitMix64 over seed, position, stream and counter = vocabulary index, in uint64).
Greedy rows take the first argmax of the raw logits and their probs row is one-hot there.

1. partials (row tiles x vocab blocks): per block max of z, sum exp(z - block max) and
   first argmax (of z; on greedy rows z is the raw logits, x / 1 == x).
2. race (row tiles x vocab blocks): row max m and sum s from the partials; p = exp(z - m)
   / s, written to probs when asked; per block the best p / E and its first index.
3. pick (row tiles): the best block (ties to the lowest block, hence the lowest index,
   like torch.argmax); greedy rows take the argmax from the partials.

Passes over [N, V]: logits read twice (launches 1 and 2), probs written once when asked;
nothing else [N, V]-sized is allocated. p and p / E are computed with the same
operations as the torch definition (exp, then correctly rounded divisions), so tokens
differ from it only where two ratios are within float rounding of each other (the exp
and the order of the row sum round differently).

Fixed grids, no host read, scratch cached per (N, V, device, config) and never freed
(captured graphs hold its addresses): capturable in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .guard import INTERPRET
from .launch import CachedLaunch, specialization_key

# The keyed uniforms and the exponential of kernels/rejection.py (the same bits as
# specdraft.sampling.keyed_uniform); shared, not copied.
from .rejection import _exponential, _stream_key, _uniform

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_STREAMS = (1, 2, 3, 4, 5)  # specdraft.sampling.Stream values (the runtime checks names)
_LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ------------------------------------------------------------------------------ kernels

if INTERPRET:

    @triton.jit
    def _exp(x):
        return tl.exp(x)

else:
    from triton.language.extra import libdevice

    @triton.jit
    def _exp(x):
        # expf, as torch's CUDA exp: tl.exp is ex2.approx(x * log2 e), ~1e-6 off at
        # |x| ~ 20, enough to move race ratios past float rounding of the definition's.
        return libdevice.exp(x)


@triton.jit
def _row_temperature(greedy_ptr, temp_ptr, rows, rmask):
    """Greedy flag and divisor per row: 1 on greedy rows (their z is the raw logits) and
    on rows past the batch."""
    g = tl.load(greedy_ptr + rows, mask=rmask, other=1) != 0
    t = tl.where(g, 1.0, tl.load(temp_ptr + rows, mask=rmask, other=1.0))
    return g, t


@triton.jit
def _load_z(logits_ptr, stride_lm, stride_lv, rows, offs, mask, t):
    """z = logits.float() / T, correctly rounded like torch.div; -inf where masked."""
    ptrs = logits_ptr + rows[:, None] * stride_lm + offs[None, :] * stride_lv
    x = tl.load(ptrs, mask=mask, other=float("-inf")).to(tl.float32)
    return tl.math.div_rn(x, t[:, None])


@triton.jit
def _partials_kernel(
    logits_ptr, stride_lm, stride_lv, greedy_ptr, temp_ptr,
    pmax_ptr, psum_ptr, parg_ptr, N, V, NB,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    blk = tl.program_id(1)
    offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    rmask = rows < N
    mask = rmask[:, None] & (offs < V)[None, :]
    _, t = _row_temperature(greedy_ptr, temp_ptr, rows, rmask)
    z = _load_z(logits_ptr, stride_lm, stride_lv, rows, offs, mask, t)
    bmax, barg = tl.max(z, axis=1, return_indices=True, return_indices_tie_break_left=True)
    ref = tl.where(bmax == float("-inf"), 0.0, bmax)  # an all -inf block sums to 0
    bsum = tl.sum(_exp(z - ref[:, None]), axis=1)
    out = rows * NB + blk
    tl.store(pmax_ptr + out, bmax, mask=rmask)
    tl.store(psum_ptr + out, bsum, mask=rmask)
    tl.store(parg_ptr + out, (barg + blk * BLOCK_V).to(tl.int32), mask=rmask)


@triton.jit
def _row_argmax(pmax_ptr, parg_ptr, rows, rmask, NB, NBP: tl.constexpr):
    """First argmax of the row from the partials: the first block holding the max, then
    that block's first index."""
    blocks = tl.arange(0, NBP)
    pmask = rmask[:, None] & (blocks < NB)[None, :]
    pm = tl.load(pmax_ptr + rows[:, None] * NB + blocks[None, :], mask=pmask, other=float("-inf"))
    best = tl.argmax(pm, axis=1, tie_break_left=True)
    return tl.load(parg_ptr + rows * NB + best, mask=rmask, other=0)


@triton.jit
def _race_kernel(
    logits_ptr, stride_lm, stride_lv, greedy_ptr, temp_ptr, seed_ptr, pos_ptr, stride_pos,
    pmax_ptr, psum_ptr, parg_ptr, probs_ptr, stride_pm, rval_ptr, ridx_ptr, N, V, NB,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr, NBP: tl.constexpr,
    WRITE_PROBS: tl.constexpr, RACE: tl.constexpr, STREAM_MUL: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    blk = tl.program_id(1)
    offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    rmask = rows < N
    mask = rmask[:, None] & (offs < V)[None, :]
    g, t = _row_temperature(greedy_ptr, temp_ptr, rows, rmask)
    # Row max and mass from the partials (NB floats per row: cheap to repeat per block).
    blocks = tl.arange(0, NBP)
    pmask = rmask[:, None] & (blocks < NB)[None, :]
    pm = tl.load(pmax_ptr + rows[:, None] * NB + blocks[None, :], mask=pmask, other=float("-inf"))
    ps = tl.load(psum_ptr + rows[:, None] * NB + blocks[None, :], mask=pmask, other=0.0)
    m = tl.where(rmask, tl.max(pm, axis=1), 0.0)  # finite on rows past the batch
    s = tl.sum(ps * tl.where(pm == float("-inf"), 0.0, _exp(pm - m[:, None])), axis=1)
    s = tl.where(rmask, s, 1.0)
    z = _load_z(logits_ptr, stride_lm, stride_lv, rows, offs, mask, t)
    # As the definition: exp(z - m), then one correctly rounded division by the sum.
    p = tl.math.div_rn(_exp(z - m[:, None]), s[:, None])
    top = _row_argmax(pmax_ptr, parg_ptr, rows, rmask, NB, NBP)
    one_hot = tl.where(offs[None, :] == top[:, None], 1.0, 0.0)
    p = tl.where(g[:, None], one_hot, p)
    if WRITE_PROBS:
        tl.store(probs_ptr + rows[:, None] * stride_pm + offs[None, :], p, mask=mask)
    if RACE:
        racing = rmask & (g == 0)  # greedy rows take their argmax in the pick kernel
        if tl.sum(racing.to(tl.int32), axis=0) > 0:
            seed = tl.load(seed_ptr + rows, mask=racing, other=0)
            pos = tl.load(pos_ptr + rows * stride_pos, mask=racing, other=0).to(tl.int64)
            h = _stream_key(seed, pos, STREAM_MUL)
            u = _uniform(h[:, None], offs[None, :].to(tl.uint64))
            # p / E as the definition divides (not exp(z - m) / E: the same winner up to
            # rounding, but the definition's roundings are these).
            ratio = tl.where(mask, tl.math.div_rn(p, _exponential(u)), -1.0)
            best, arg = tl.max(
                ratio, axis=1, return_indices=True, return_indices_tie_break_left=True
            )
            out = rows * NB + blk
            tl.store(rval_ptr + out, best, mask=racing)
            tl.store(ridx_ptr + out, (arg + blk * BLOCK_V).to(tl.int32), mask=racing)


@triton.jit
def _pick_kernel(
    greedy_ptr, pmax_ptr, parg_ptr, rval_ptr, ridx_ptr, tokens_ptr, N, NB,
    ROWS: tl.constexpr, NBP: tl.constexpr, RACE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < N
    token = _row_argmax(pmax_ptr, parg_ptr, rows, rmask, NB, NBP).to(tl.int64)
    if RACE:
        racing = rmask & (tl.load(greedy_ptr + rows, mask=rmask, other=1) == 0)
        blocks = tl.arange(0, NBP)
        smask = racing[:, None] & (blocks < NB)[None, :]
        rv = tl.load(rval_ptr + rows[:, None] * NB + blocks[None, :], mask=smask, other=-1.0)
        _, rblk = tl.max(rv, axis=1, return_indices=True, return_indices_tie_break_left=True)
        won = tl.load(ridx_ptr + rows * NB + rblk, mask=racing, other=0)
        token = tl.where(racing, won.to(tl.int64), token)
    tl.store(tokens_ptr + rows, token, mask=rmask)


# ----------------------------------------------------------------------------- launcher


@dataclass(frozen=True)
class SampleConfig:
    """block_v: vocabulary block per program (power of two); rows: rows per program
    (power of two; > 1 only at small vocabularies); num_warps for the [N, V] launches;
    rows_pick: rows per program of the pick launch."""

    block_v: int
    rows: int
    num_warps: int
    rows_pick: int


def _p2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def choose_sample_config(num_rows: int, vocab: int) -> SampleConfig:
    """GPU: tiles of 1024 elements on 4 warps (8 per thread: the race holds several
    uint64 temporaries per element), one row per program from V 1024 on (V 49152: 48
    programs per row, so one row already spreads over a third of the SMs). The
    interpreter pays per op, not per element: tiles of 2^16 elements, but blocks of at
    most 256 so that small test vocabularies still cross blocks."""
    block_v = min(_p2(vocab), 256 if INTERPRET else 1024)
    tile = 1 << 16 if INTERPRET else 1024
    rows = max(1, min(_p2(num_rows), tile // block_v))
    rows_pick = min(_p2(num_rows), 256 if INTERPRET else 32)
    return SampleConfig(block_v=block_v, rows=rows, num_warps=4, rows_pick=rows_pick)


class SampleWorkspace:
    """Per (row, vocab block) partials: max, sum, argmax; race best ratio and index."""

    def __init__(self, num_rows: int, vocab: int, device: torch.device, cfg: SampleConfig):
        nb = triton.cdiv(vocab, cfg.block_v)
        kw = {"device": device}
        self.config = cfg
        self.part_max = torch.empty(num_rows, nb, dtype=torch.float32, **kw)
        self.part_sum = torch.empty(num_rows, nb, dtype=torch.float32, **kw)
        self.part_arg = torch.empty(num_rows, nb, dtype=torch.int32, **kw)
        self.race_val = torch.empty(num_rows, nb, dtype=torch.float32, **kw)
        self.race_idx = torch.empty(num_rows, nb, dtype=torch.int32, **kw)


# Never evicted: a captured graph keeps reading its workspace's addresses. Small: 20
# bytes per (row, vocab block), e.g. 61 KB at N 64, V 49152.
_WORKSPACES: dict[tuple, SampleWorkspace] = {}


def sample_workspace(
    num_rows: int, vocab: int, device: torch.device, cfg: SampleConfig
) -> SampleWorkspace:
    """The scratch for one (N, V, device, config), allocated on first use and reused."""
    key = (num_rows, vocab, torch.device(device), cfg)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = SampleWorkspace(num_rows, vocab, torch.device(device), cfg)
    return ws


def _check(name: str, t: object, dtypes: tuple, shape: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} dtype must be one of {dtypes}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, logits on {device}")


def check_sample_args(logits, greedy, temperature, seed, positions, stream) -> tuple[int, int]:
    """The launcher's contract; returns (N, V)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a [N, V] tensor, got {getattr(logits, 'shape', logits)}")
    if logits.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"logits dtype must be one of {_LOGIT_DTYPES}, got {logits.dtype}")
    n, v = logits.shape
    if v == 0:
        raise ValueError("logits must have at least one column (V >= 1)")
    dev = logits.device
    _check("greedy", greedy, (torch.bool,), (n,), dev)
    _check("temperature", temperature, (torch.float32,), (n,), dev)
    _check("seed", seed, (torch.int64,), (n,), dev)
    _check("positions", positions, (torch.int32, torch.int64), (n,), dev)
    for name, t in (("greedy", greedy), ("temperature", temperature), ("seed", seed)):
        if n > 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")
    if stream not in _STREAMS:
        raise ValueError(f"stream must be one of {list(_STREAMS)}, got {stream!r}")
    return n, v


_PARTIALS = CachedLaunch(_partials_kernel)
_RACE = CachedLaunch(_race_kernel)
_PICK = CachedLaunch(_pick_kernel)


@dataclass(frozen=True)
class _Plan:
    """What one input geometry fixes: sizes, workspace, grids, compiled-kernel keys. It
    holds no input tensor (eager callers pass fresh logits every call)."""

    n: int
    v: int
    nb: int
    nbp: int
    cfg: SampleConfig
    ws: SampleWorkspace
    keys: tuple


# Keyed by geometry (shapes, strides, dtypes, devices, alignment), not addresses.
_PLANS: dict[tuple, _Plan] = {}


def _geometry(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def _args(plan: _Plan, logits, greedy, temperature, seed, positions, stream_mul, probs,
          probs_stride, tokens, write_probs, race) -> tuple[tuple, tuple, tuple]:  # fmt: skip
    ws, n, v, nb = plan.ws, plan.n, plan.v, plan.nb
    lm, lv = logits.stride()
    rows, bv = plan.cfg.rows, plan.cfg.block_v
    args1 = (logits, lm, lv, greedy, temperature, ws.part_max, ws.part_sum, ws.part_arg,
             n, v, nb, rows, bv)  # fmt: skip
    # Without probs the race kernel gets a workspace tensor that it never writes.
    args2 = (logits, lm, lv, greedy, temperature, seed, positions, positions.stride(0),
             ws.part_max, ws.part_sum, ws.part_arg, ws.part_max if probs is None else probs,
             probs_stride, ws.race_val, ws.race_idx, n, v, nb,
             rows, bv, plan.nbp, write_probs, race, stream_mul)  # fmt: skip
    args3 = (greedy, ws.part_max, ws.part_arg, ws.race_val, ws.race_idx, tokens, n, nb,
             plan.cfg.rows_pick, plan.nbp, race)  # fmt: skip
    return args1, args2, args3


def _plan(
    logits, greedy, temperature, seed, positions, stream, write_probs, race, probs_stride
) -> _Plan:
    n, v = check_sample_args(logits, greedy, temperature, seed, positions, stream)
    cfg = choose_sample_config(n, v)
    ws = sample_workspace(n, v, logits.device, cfg)
    nb = ws.part_max.shape[1]
    plan = _Plan(n, v, nb, _p2(nb), cfg, ws, ())
    # Outputs are aligned (torch.empty, or checked) and the probs row stride is part of
    # the plan's signature: the keys of a call with aligned stand-ins hold for all.
    tokens = torch.empty(1, dtype=torch.int64, device=logits.device)
    probs = torch.empty(1, dtype=torch.float32, device=logits.device) if write_probs else None
    dev = (logits.device.type, logits.device.index)
    a1, a2, a3 = _args(plan, logits, greedy, temperature, seed, positions,
                       _stream_mul(stream), probs, probs_stride, tokens, write_probs,
                       race)  # fmt: skip
    return replace(
        plan, keys=tuple((dev, cfg.num_warps) + specialization_key(a) for a in (a1, a2, a3))
    )


def _check_out(name: str, t: object, dtype: torch.dtype, shape: tuple, device) -> None:
    _check(name, t, (dtype,), shape, device)
    if t.stride(-1) != 1 and shape[-1] > 1 or t.data_ptr() % 16:
        raise ValueError(f"{name} must have unit stride along its last dim and be 16-byte "
                         f"aligned, got strides {t.stride()}")  # fmt: skip
    if len(shape) == 2 and shape[0] > 1 and t.stride(0) < shape[1]:
        raise ValueError(f"{name} rows must not overlap, got strides {t.stride()}")


def _stream_mul(stream: int) -> int:
    return (_GOLDEN * (stream + 1)) & _M64


def sample_tokens(
    logits: torch.Tensor,
    greedy: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    positions: torch.Tensor,
    stream: int,
    *,
    return_probs: bool = False,
    all_greedy: bool = False,
    out_tokens: torch.Tensor | None = None,
    out_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """specdraft.sampling.sample for rows without top-k / top-p (module docstring).

    logits [N, V] fp16/bf16/fp32; per row [N]: greedy bool, temperature float32 (read on
    rows not greedy), seed int64, positions int32/int64; stream: a
    specdraft.sampling.Stream value. all_greedy: the caller's host-side promise that
    every row is greedy (no race: every token is the row's argmax). Returns tokens int64
    [N] and, with return_probs, probs float32 [N, V] (softmax(logits / T), one-hot on
    greedy rows), freshly allocated unless out_tokens (int64 [N]) / out_probs (float32
    [N, V] with unit column stride and any row stride, e.g. q[:, j] of a [B, K, V] q;
    implies return_probs) are given; else (tokens, None).

    No host read, fixed grids: capturable in a CUDA graph. The checks run once per input
    geometry (shapes, strides, dtypes, devices)."""
    write_probs, race = bool(return_probs) or out_probs is not None, not all_greedy
    tensors = (logits, greedy, temperature, seed, positions)
    try:
        v = logits.shape[-1]
        pstride = v if out_probs is None else out_probs.stride(0)
        sig = (*(_geometry(t) for t in tensors), stream, write_probs, race, pstride)
    except (AttributeError, TypeError, IndexError):  # the checks below say what is wrong
        sig = pstride = None
    plan = None if sig is None else _PLANS.get(sig)
    if plan is None:
        plan = _plan(*tensors, stream, write_probs, race, pstride)
        if sig is not None:
            if len(_PLANS) >= 256:
                _PLANS.clear()  # plans only hold checks and keys; workspaces stay
            _PLANS[sig] = plan
    n, v = plan.n, plan.v
    dev = logits.device
    if out_tokens is None:
        tokens = torch.empty(n, dtype=torch.int64, device=dev)
    else:
        _check_out("out_tokens", out_tokens, torch.int64, (n,), dev)
        tokens = out_tokens
    if out_probs is not None:
        _check_out("out_probs", out_probs, torch.float32, (n, v), dev)
        probs = out_probs
    else:
        probs = torch.empty(n, v, dtype=torch.float32, device=dev) if write_probs else None
    if n == 0:
        return tokens, probs
    a1, a2, a3 = _args(plan, *tensors, _stream_mul(stream), probs, pstride, tokens,
                       write_probs, race)  # fmt: skip
    k1, k2, k3 = plan.keys
    grid = (triton.cdiv(n, plan.cfg.rows), plan.nb)
    options = {"num_warps": plan.cfg.num_warps}
    _PARTIALS(k1, grid, a1, options)
    _RACE(k2, grid, a2, options)
    _PICK(k3, (triton.cdiv(n, plan.cfg.rows_pick),), a3, options)
    return tokens, probs


# ------------------------------------------------------------- the batch's parameter rows


@triton.jit(do_not_specialize=["n_index", "n_rows"])
def _gather_params_kernel(
    index_ptr, n_index, n_rows, g_ptr, t_ptr, k_ptr, p_ptr, s_ptr,
    og_ptr, ot_ptr, ok_ptr, op_ptr, os_ptr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n_index
    row = tl.load(index_ptr + i, mask=m, other=0).to(tl.int64)
    row = tl.where((row >= 0) & (row < n_rows), row, 0)
    tl.store(og_ptr + i, tl.load(g_ptr + row, mask=m), mask=m)
    tl.store(ot_ptr + i, tl.load(t_ptr + row, mask=m), mask=m)
    tl.store(ok_ptr + i, tl.load(k_ptr + row, mask=m), mask=m)
    tl.store(op_ptr + i, tl.load(p_ptr + row, mask=m), mask=m)
    tl.store(os_ptr + i, tl.load(s_ptr + row, mask=m), mask=m)


_GATHER = CachedLaunch(_gather_params_kernel)


def gather_params(
    index: torch.Tensor, greedy, temperature, top_k, top_p, seed
) -> tuple[torch.Tensor, ...]:
    """The five per-row sampling parameters (specdraft.sampling.SamplingTensors' fields,
    each [rows]) at `index` (int32/int64 [n]) in one launch, as fresh tensors; an index
    outside [0, rows) (padding: -1) reads row 0. Replaces five index_selects and the
    clamp of the batch's rows on every step."""
    fields = (greedy, temperature, top_k, top_p, seed)
    if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.dtype not in (
        torch.int32, torch.int64,
    ):  # fmt: skip
        raise TypeError(f"index must be a 1-D int32/int64 tensor, got {index!r:.80}")
    n_rows = greedy.shape[0]
    for name, t in zip(("greedy", "temperature", "top_k", "top_p", "seed"), fields):
        if t.dim() != 1 or t.shape[0] != n_rows or t.stride(0) != 1 or t.device != index.device:
            raise ValueError(
                f"{name} must be a contiguous [{n_rows}] tensor on {index.device}, got "
                f"{tuple(t.shape)} on {t.device}"
            )
    n = index.shape[0]
    outs = tuple(torch.empty(n, dtype=t.dtype, device=t.device) for t in fields)
    if n == 0 or n_rows == 0:
        return outs
    block = min(1024, max(16, triton.next_power_of_2(n)))
    # every field moves as plain values; the bool one as its bytes
    raw = [t.view(torch.uint8) if t.dtype == torch.bool else t for t in (*fields, *outs)]
    args = (index, n, n_rows, *raw, block)
    # n and n_rows are not specialized (a kernel compiled for n == 1 must not serve n == 5)
    key = (index.device.index,) + specialization_key((index, *raw, block))
    _GATHER(key, (triton.cdiv(n, block),), args, {"num_warps": 1 if block <= 256 else 4})
    return outs
