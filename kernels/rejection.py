"""Lossless rejection sampler for speculative decoding: four launches, five or six with top-k /
top-p; one when every request is greedy.

Request b owns target rows b * (K + 1) + j (j = 0..K) and drafts x_j, j < k[b]. Row j's
target distribution p_j is specdraft.sampling's filtered_probs (temperature, then top-k,
then top-p, ties kept whole); q_j is the draft's. Draft j is accepted with probability
min(1, p_j(x_j) / q_j(x_j)); the first rejected position r emits a token drawn from
max(p_r - q_r, 0), and a request whose k drafts all pass emits a bonus token from p_k.
Greedy requests accept while x_j == argmax(row j) and emit the argmax at r.

1. partials (rows x vocab blocks): per block max, first argmax, sum exp(z - max) and the
   smallest finite value, with z = logits / T; screened, also the mass and count of the
   block's values above the row's draft token. Nothing [B, K, V]-sized is written.
   At large vocabularies on the GPU a program reads one row's block (up to 16384
   columns) in slices into per-lane values reduced once: the max in a first read, the
   sums relative to it in a second (from L1 / L2).
2. init (row tiles): row max and mass from the partials; thresholds reset to -inf;
   screened, each row's screening state (below).
3. cut (row tiles; launched only when a request filters): the top-k and top-p
   thresholds and the kept mass (below), each row with its own search state; screened,
   only the rows a decision needs. With one row per program (large vocabularies on the
   GPU) a bracket launch goes first (below) and the narrowing launch only finishes the
   rows it missed.
4. walk (request tiles): each request's k and r, once: a parallel test of its drafts.
5. resample (request tiles x vocab blocks): an exponential race over the block of the
   residual (or of p for the bonus); each request's last program to finish (a ticket
   per request) writes its tokens, counts and the per-position counters. With
   RejectionConfig.pack_r (on at large vocabularies on the GPU) a first read lists the
   block's kept columns and only they are drawn: top-k and top-p keep a few percent of
   a row.
Greedy-only launches (no q) take one kernel: per-block argmax, and the request's last
program walks it and writes its tokens.

Cuts. The k-th largest value (with multiplicity) and the top-p cut (the largest value v
whose mass of values >= v reaches top_p times the mass, after top-k when both are set)
are found in [lo, hi]: top-k starts from the row's smallest finite value, top-p from a
floor below which every token is provably cut (the tokens under (1 - top_p) * mass / n
together hold less than (1 - top_p) of it). Each pass reads the row once and sums, per
lane then once per pass, the exact count and fixed-point mass above hi and above a pivot,
and a histogram of counts over equal value bins of [lo, hi]. Count bounds on each bin's
mass (its count times exp at the bin's edges) give the first bin that may reach the
target and the first that surely does; the next interval spans them, cut again at the
pivot (whose exact mass says on which side the answer lies), so it shrinks even where
the bounds are loose. Once the interval's count fits the scratch (cap) the next pass
compacts it and the answer is read off pairwise; a single value left is the answer. Real
rows take 2-3 passes. A tile's rows search side by side: a pass reads the rows not yet
done, and each row's outcome (done, or its next interval) is a masked update, so every
row takes the steps it would take alone and the thresholds do not depend on the tiling.

Split (RejectionConfig.split_f > 0, off by default): a row with top-p and no top-k
takes only its sample and bracket in the bracket launch, which lists it; the pass is
spread over programs of split_f columns (each sums its chunk's mass above the bracket and
appends the bracket's values at an offset a per-row counter hands out), and a closing
launch sorts the bracket and finds the cut, or leaves the row to the narrowing launch.
Bisect (RejectionConfig.bisect_f, on at large vocabularies): a bracket's cut is found
without the sort, by bisecting its values' order keys with exact sums (_bisect_keys).

The bracket launch (one row per program; RejectionConfig.cap_f > 0): a strided sample
of the row (sample_f values), sorted, estimates where the cut lies
and brackets it with a margin of two binomial standard deviations of the sample's count;
one pass sums the exact mass and count above the bracket and compacts the bracket's
values (up to cap_f), which sorted give the cut by their running sums. A bracket that
missed narrows the interval to the side the exact sums point to and the next try
estimates within it (tries_f tries); a row still unresolved is marked for the narrowing
launch. Its threshold is the same value: the fixed-point masses define the cut exactly.

Screening (RejectionConfig.screen, on by default). A cut costs a row far more than the
pass that reads it, and most rows need none: the walk stops at the first rejection, and
a draft's fate is usually clear without the exact kept mass M. With the mass above the
draft's value (C, from the partials) and the row's mass Z: top-p keeps the token iff
C < top_p * Z, and then M lies in [max(top_p * Z, C + its own mass), Z], so p = e / M lies
in a bracket; acceptance (p > 0 and (p >= q or u q < p)) grows with p, so the bracket's
ends decide it unless u falls between them. Top-k cuts the token iff at least k values lie
above it (an exact count); after top-k, M lies in [C + its own mass, Z] and top-p keeps
the token if C < top_p (C + its own mass). Each row gets SURE_ACCEPT, SURE_REJECT or
EXACT (with margins of 2^-12 Z over the float estimates); a request's cuts run only on
its EXACT rows from
its first row not surely accepted up to its first SURE_REJECT (or its bonus row), and on
that row, where the residual or bonus draw needs the kept set. The decisions, hence the
outputs, are bit for bit the unscreened sampler's. On B 64, K 5, V 49152 with the
benchmark's blurred drafts about 70 of the 384 rows need a cut instead of 384 (CPU
count of the rule in float64; the GPU figure is bench.rejection's "rows cut").

Masses are int64 fixed point (exp(z - m) * 2^S, S = 62 - bits(V - 1)): sums are exact, so
they do not depend on the order of the additions and the thresholds are bit-for-bit
reproducible; the resolution (2^-46 at V 49152) is far finer than float32. The kept mass
is converted to float32 once. The top-p target is top_p times the row's float32 mass
from the partials: a token whose preceding mass is within float rounding of it may fall
the other way from torch's cumsum (the rules and ties are the same).

Random draws are specdraft.sampling's keyed uniforms, bit for bit: SplitMix64 over
(seed, position, stream, counter) in uint64. Acceptance: counter 0 at the draft's
position on the ACCEPT stream; residual / bonus: an exponential race (argmax of
weight / E, E = -log1p(-u)) with counter = vocabulary index on RESIDUAL / BONUS.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from .guard import INTERPRET, validation_enabled
from .launch import CachedLaunch, pdl_launch, specialization_key

# specdraft.sampling.Stream values; the runtime passes its own (the kernels never import
# the runtime) and the wrapper checks they agree.
ACCEPT, RESIDUAL, BONUS = 2, 3, 4
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _stream_mul(stream: int) -> int:
    return (_GOLDEN * (stream + 1)) & _M64


# ------------------------------------------------------------------------------ helpers


@triton.jit
def _mix64(x):
    """SplitMix64 finaliser on uint64 (wrapping multiplies, logical shifts)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _stream_key(seed, pos, stream_mul):
    g = tl.full([], 0x9E3779B97F4A7C15, tl.uint64)
    h = _mix64(seed.to(tl.uint64) + g)
    h = _mix64(h + (pos.to(tl.uint64) + 1) * g)
    return _mix64(h + stream_mul)


@triton.jit
def _uniform(h, counter):
    """keyed_uniform's float32 in [2^-53, 1 - 2^-24] for key h and a uint64 counter."""
    g = tl.full([], 0x9E3779B97F4A7C15, tl.uint64)
    x = _mix64(h + (counter + 1) * g)
    u = ((x >> 11) | 1).to(tl.float32) * 1.1102230246251565e-16  # exact: < 2^53, times 2^-53
    return tl.minimum(u, 0.99999994039535522)


@triton.jit
def _div_nonneg(a, b):
    """a / b correctly rounded, for a >= 0 (not NaN) and b > 0, with a == 0 answered as
    +0 without dividing: the same bits as div_rn. A zero dividend may send div_rn's fast
    path to its slow-path call (sm_90 SASS: FCHK, then CALL), and the race divides zeros
    wherever top-k / top-p cut a token or p <= q."""
    nz = a > 0.0
    return tl.where(nz, tl.math.div_rn(tl.where(nz, a, 1.0), b), 0.0)


@triton.jit
def _first_max(best, where):
    """Per row of per-lane running maxima best [R, N] and their columns where: the max,
    and the smallest column holding it (lanes keep their first column of a tie)."""
    bmax = tl.max(best, axis=1)
    return bmax, tl.min(tl.where(best == bmax[:, None], where, 2147483647), axis=1)


if INTERPRET:

    @triton.jit
    def _exp_ftz(x):
        """exp(x), results below 2^-126 flushed to 0 (the GPU form's ex2.approx.ftz)."""
        e = tl.exp(x)
        return tl.where(e < 1.1754943508222875e-38, 0.0, e)

    @triton.jit
    def _scatter_store(ptrs, vals, mask):
        tl.store(ptrs, vals, mask=mask)

    @triton.jit
    def _scatter_count(base, idx, mask):
        tl.atomic_add(base + idx, tl.full(idx.shape, 1, tl.int32), mask=mask, sem="relaxed")

    @triton.jit
    def _exponential(u):
        """-log1p(-u) rounded to float32: float64 series below 2^-12 (where 1 - u is not
        exact), -log(1 - u) above (exact 1 - u). libdevice is not in the interpreter."""
        v = u.to(tl.float64)
        series = v + v * v * (0.5 + v * (0.3333333333333333 + v * 0.25))
        return tl.where(v < 0.000244140625, series, -tl.log(1.0 - v)).to(tl.float32)

else:
    from triton.language.extra import libdevice

    @triton.jit
    def _exp_ftz(x):
        """exp(x) as tl.exp computes it (x times log2(e) in float32, then ex2.approx),
        but with ex2.approx.ftz: results below 2^-126 are 0, not subnormal, and the three
        instructions tl.exp spends on that range (a compare and two predicated
        multiplies) are gone. The same bits wherever the result is normal."""
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * 1.4426950408889634],
            dtype=tl.float32, is_pure=True, pack=1,
        )  # fmt: skip

    @triton.jit
    def _scatter_store(ptrs, vals, mask):
        """tl.store(ptrs, vals, mask) of int32 values, each thread storing the elements it
        holds: a store whose addresses are data (a list's slots) otherwise goes through
        shared memory first, to the layout the compiler picks for addresses it cannot
        prove contiguous (offline sm_90: 8 STS / LDS pairs, and the mask's, for 8 values
        a thread)."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.global.b32 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r,r", [ptrs, vals, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @triton.jit
    def _scatter_count(base, idx, mask):
        """A relaxed atomic add of 1 at base[idx] (int32; idx >= 0 where mask holds), each
        thread for the elements it holds (red.global, no result; the address by one
        mad.wide.u32). Through tl.atomic_add the compiler moved the addresses through
        shared memory to another layout, and a signed offset takes ~6 instructions of
        64-bit arithmetic an element (offline sm_90, _hist_cut_kernel)."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u64 a; setp.ne.s32 p, $3, 0; mad.wide.u32 a, $2, 4, $1;"
            " @p red.relaxed.gpu.global.add.u32 [a], 1; mov.u32 $0, 0; }",
            "=r,l,r,r", [tl.broadcast_to(base, idx.shape), idx, mask.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @triton.jit
    def _exponential(u):
        # log1p, not log(1 - u): winners of a flat race have tiny u (sampling.py).
        return -libdevice.log1p(-u)


@triton.jit
def _gdc_enter(GDC: tl.constexpr):
    """With programmatic dependent launch (GDC), the sampler kernels' first step: wait
    for the kernel before (everything they read comes from earlier launches), then let
    the next one start launching."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _load_z(rowp, offs, mask, t, t1):
    """z = logits / T (correctly rounded, like torch.div), -0 folded into +0, of a tile's
    rows (rowp [ROWS]: each row's first logit; t [ROWS]) at columns offs ([ROWS, N] or
    [1, N]); t1: every T of the tile is 1 (x / 1 == x: no ~10-instruction IEEE division)."""
    return _z_of(tl.load(rowp[:, None] + offs, mask=mask, other=float("-inf")), t[:, None], t1)


@triton.jit
def _z_of(x, t, t1):
    """_load_z's z of loaded logits x (any shape; t broadcast against it)."""
    x = x.to(tl.float32)
    if t1:
        z = x
    else:
        z = tl.math.div_rn(x, t)
    return tl.where(z == 0.0, 0.0, z)


# ------------------------------------------------------------------- 1. block partials


@triton.jit
def _partials_kernel(
    logits_ptr, stride_lm, greedy_ptr, temp_ptr,
    pmax_ptr, parg_ptr, psum_ptr, pmin_ptr, drafts_ptr, stride_db, pabove_ptr, pcnt_ptr,
    num_rows, V, K1, NB,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr, SUB: tl.constexpr, SCREEN: tl.constexpr,
    ONE: tl.constexpr = False, FTZ: tl.constexpr = False, LAZY: tl.constexpr = False,
    GDC: tl.constexpr = False,
):  # fmt: skip
    """Per (row, vocabulary block) of a call with q (all-greedy calls take
    _greedy_kernel): max, first argmax, sum exp(z - max) and the smallest finite value.
    SCREEN: also, for row j < K of a request, the mass (as exp(z - max)) and the count of
    the block's values above z at the row's draft token (garbage for other rows, which
    nothing reads).

    The block is read SUB columns at a time into per-lane running values, reduced once
    at the end (as the all-greedy launch does): a first loop keeps each lane's largest
    value and its first index; a second reads the block again (from L1 / L2) for the
    sums relative to the block's max. A reduction a value per block, not per SUB slice:
    at SUB = BLOCK_V the block is read once, into registers both reductions use.
    ONE (RejectionConfig.one_pass_v): the block is read once, in slices, by
    _partials_one_pass (FTZ, RejectionConfig.ftz_v: its exps by _exp_ftz; LAZY,
    RejectionConfig.lazy_v: its argmax found after the loop)."""
    _gdc_enter(GDC)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    blk = tl.program_id(1)
    lo = blk * BLOCK_V
    lane = tl.arange(0, SUB)
    rmask = rows < num_rows
    req = rows // K1
    g = tl.load(greedy_ptr + req, mask=rmask, other=1) != 0
    t = tl.where(g, 1.0, tl.load(temp_ptr + req, mask=rmask, other=1.0))
    t1 = (tl.min(t, axis=0) == 1.0) & (tl.max(t, axis=0) == 1.0)
    rowp = logits_ptr + rows * stride_lm
    out = rows * NB + blk
    if ONE:
        _partials_one_pass(
            rows, rmask, req, t, t1, rowp, lo, out, pmax_ptr, parg_ptr, psum_ptr, pmin_ptr,
            drafts_ptr, stride_db, pabove_ptr, pcnt_ptr, V, K1, ROWS, BLOCK_V, SUB, SCREEN,
            FTZ, LAZY,
        )  # fmt: skip
        return
    if SUB == BLOCK_V:
        # One slice: the block is read once, into registers both reductions use (the
        # same values, hence the same bits, as the loops below run once).
        whole = lo + lane
        zall = _load_z(rowp, whole[None, :], rmask[:, None] & (whole < V)[None, :], t, t1)
        best = zall
        where = tl.zeros([ROWS, SUB], tl.int32) + whole[None, :]
    else:
        best = tl.full([ROWS, SUB], float("-inf"), tl.float32)
        where = tl.zeros([ROWS, SUB], tl.int32) + (lo + lane)[None, :]
        for c in tl.range(0, BLOCK_V, SUB):
            offs = lo + c + lane
            mask = rmask[:, None] & (offs < V)[None, :]
            z = _load_z(rowp, offs[None, :], mask, t, t1)
            up = z > best  # strict: a lane keeps its first index of a tie
            best = tl.where(up, z, best)
            where = tl.where(up, offs[None, :], where)
    # The first index holding the max (a block of -inf: its first column, as before)
    bmax, barg = _first_max(best, where)
    tl.store(pmax_ptr + out, bmax, mask=rmask)
    tl.store(parg_ptr + out, barg, mask=rmask)
    ref = tl.where(bmax == float("-inf"), 0.0, bmax)
    if SCREEN:
        zd = _draft_z(rows, rmask, req, t, rowp, drafts_ptr, stride_db, V, K1)
    total = tl.zeros([ROWS, SUB], tl.float32)
    # The smallest finite value (+inf for none): the low end of a top-k search.
    low = tl.full([ROWS, SUB], float("inf"), tl.float32)
    above_sum = tl.zeros([ROWS, SUB], tl.float32)
    above_cnt = tl.zeros([ROWS, SUB], tl.int32)
    for c in tl.range(0, BLOCK_V, SUB):
        if SUB == BLOCK_V:
            z = zall
        else:
            offs = lo + c + lane
            mask = rmask[:, None] & (offs < V)[None, :]
            z = _load_z(rowp, offs[None, :], mask, t, t1)
        ez = tl.exp(z - ref[:, None])
        total += ez
        low = tl.minimum(low, _no_neg_inf(z))
        if SCREEN:
            above = z > zd[:, None]
            above_sum += tl.where(above, ez, 0.0)
            above_cnt += above.to(tl.int32)
    tl.store(psum_ptr + out, tl.sum(total, axis=1), mask=rmask)
    tl.store(pmin_ptr + out, tl.min(low, axis=1), mask=rmask)
    if SCREEN:
        tl.store(pabove_ptr + out, tl.sum(above_sum, axis=1), mask=rmask)
        tl.store(pcnt_ptr + out, tl.sum(above_cnt, axis=1), mask=rmask)


@triton.jit
def _no_neg_inf(z):
    """z with -inf as +inf: a minimum over it is the smallest finite value (+inf: none)."""
    return tl.where(z > float("-inf"), z, float("inf"))


@triton.jit
def _draft_z(rows, rmask, req, t, rowp, drafts_ptr, stride_db, V, K1):
    """z at each row's draft token (row j < K of its request; garbage elsewhere, which
    nothing reads), exactly as the row's own z."""
    j = rows % K1
    has = rmask & (j < K1 - 1)
    d = tl.load(drafts_ptr + req * stride_db + j, mask=has, other=-1)
    has = has & (d >= 0) & (d < V)
    xd = tl.load(rowp + tl.where(has, d, 0), mask=has, other=0.0)
    return tl.math.div_rn(xd.to(tl.float32), t)


@triton.jit
def _lazy_first_argmax(rowp, rmask, m, sl, lo, col, t, t1, V):
    """After a LAZY loop over a block (groups of 8 columns col [G, 8]; per row and group
    position its max m and the offset sl of the slice that first held it): each
    position's first column holding its max, from that slice read again (z recomputed
    from the same logits: the same bits); a position that saw only -inf: lo, the block's
    first column."""
    seen = rmask[:, None] & (m > float("-inf"))
    offs = lo + sl[:, :, None] + col[None, :, :]
    x = tl.load(rowp[:, None, None] + offs, mask=seen[:, :, None] & (offs < V),
                other=float("-inf"))  # fmt: skip
    _, gidx = _group_argmax(_z_of(x, t[:, None, None], t1), offs)
    return tl.where(seen, gidx, lo)


@triton.jit
def _group_argmax(z, offs):
    """Each group's max (z [ROWS, G, 8], groups along the last axis) and the first of
    its columns (offs) holding it."""
    gmax = tl.max(z, axis=2)
    return gmax, tl.min(tl.where(z == gmax[:, :, None], offs, 2147483647), axis=2)


@triton.jit
def _partials_one_pass(
    rows, rmask, req, t, t1, rowp, lo, out, pmax_ptr, parg_ptr, psum_ptr, pmin_ptr,
    drafts_ptr, stride_db, pabove_ptr, pcnt_ptr, V, K1,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr, SUB: tl.constexpr, SCREEN: tl.constexpr,
    FTZ: tl.constexpr = False, LAZY: tl.constexpr = False,
):  # fmt: skip
    """_partials_kernel's block read once. A slice is taken as groups of 8 adjacent
    columns (one thread's vector load); each group position keeps its own running max,
    first argmax, smallest finite value and sums relative to its max, rescaled (one exp a
    group) when a slice raises that max. The max, argmax, smallest value and count are
    the two-pass kernel's bits; the sums agree to float32 rounding. FTZ: the exps by
    _exp_ftz (a subnormal term becomes 0: each lane's total holds its max's 1, so only
    the masses above a draft can tell, by less than 2^-126). LAZY: a group position keeps
    only the slice that last raised its max (one select a group, where the first argmax
    takes ~3 instructions a column); after the loop it reloads its 8 columns of that
    slice (L1 / L2) and takes the first holding its max: the same slice and the same
    column, so the same argmax. Its smallest value is taken over -inf too (a min a
    column instead of a compare, a select and a min); a position whose minimum is -inf
    reads its columns again for the smallest finite one: the same value."""
    G: tl.constexpr = SUB // 8
    col = tl.arange(0, G)[:, None] * 8 + tl.arange(0, 8)[None, :]  # [G, 8]
    if SCREEN:
        zd = _draft_z(rows, rmask, req, t, rowp, drafts_ptr, stride_db, V, K1)
    else:
        zd = tl.zeros([ROWS], tl.float32)
    m = tl.full([ROWS, G], float("-inf"), tl.float32)
    where = tl.zeros([ROWS, G], tl.int32) + (0 if LAZY else lo)  # LAZY: a slice offset
    total = tl.zeros([ROWS, G], tl.float32)
    low = tl.full([ROWS, G], float("inf"), tl.float32)
    above_sum = tl.zeros([ROWS, G], tl.float32)
    above_cnt = tl.zeros([ROWS, G], tl.int32)
    for c in tl.range(0, BLOCK_V, SUB):
        offs = (lo + c + col)[None, :, :]  # [1, G, 8]
        mask = rmask[:, None, None] & (offs < V)
        x = tl.load(rowp[:, None, None] + offs, mask=mask, other=float("-inf"))
        z = _z_of(x, t[:, None, None], t1)
        # Taken where the group's max beats the lane's (strict: a lane keeps its first
        # index of a tie).
        if LAZY:
            gmax = tl.max(z, axis=2)
            where = tl.where(gmax > m, c, where)
        else:
            gmax, gidx = _group_argmax(z, offs)
            where = tl.where(gmax > m, gidx, where)
        mn = tl.maximum(m, gmax)
        ref = tl.where(mn == float("-inf"), 0.0, mn)
        if FTZ:
            scale = _exp_ftz(m - ref)
            ez = _exp_ftz(z - ref[:, :, None])
        else:
            scale = tl.exp(m - ref)  # 1 where the max stands; 0 from an all -inf history
            ez = tl.exp(z - ref[:, :, None])
        total = total * scale + tl.sum(ez, axis=2)
        if LAZY:
            low = tl.minimum(low, tl.min(z, axis=2))  # -inf included: redone below
        else:
            low = tl.minimum(low, tl.min(_no_neg_inf(z), axis=2))
        if SCREEN:
            above = z > zd[:, None, None]
            above_sum = above_sum * scale + tl.sum(tl.where(above, ez, 0.0), axis=2)
            above_cnt += tl.sum(above.to(tl.int32), axis=2)
        m = mn
    if LAZY:
        where = _lazy_first_argmax(rowp, rmask, m, where, lo, col, t, t1, V)
        # the smallest finite value of a position that met a -inf (a -inf logit, or
        # columns past V), from its columns read again
        inf = rmask[:, None] & (low == float("-inf"))
        if tl.max(inf.to(tl.int32)) != 0:
            low = tl.where(inf, float("inf"), low)
            for c in tl.range(0, BLOCK_V, SUB):
                cc = lo + c + col[None, :, :]
                x = tl.load(rowp[:, None, None] + cc, mask=inf[:, :, None] & (cc < V),
                            other=float("-inf"))  # fmt: skip
                z = _z_of(x, t[:, None, None], t1)
                low = tl.minimum(low, tl.min(_no_neg_inf(z), axis=2))
    bmax, barg = _first_max(m, where)
    tl.store(pmax_ptr + out, bmax, mask=rmask)
    tl.store(parg_ptr + out, barg, mask=rmask)
    ref = tl.where(bmax == float("-inf"), 0.0, bmax)
    lane = tl.exp(m - ref[:, None])  # each lane's sums onto the block's max
    tl.store(psum_ptr + out, tl.sum(total * lane, axis=1), mask=rmask)
    tl.store(pmin_ptr + out, tl.min(low, axis=1), mask=rmask)
    if SCREEN:
        tl.store(pabove_ptr + out, tl.sum(above_sum * lane, axis=1), mask=rmask)
        tl.store(pcnt_ptr + out, tl.sum(above_cnt, axis=1), mask=rmask)


# ------------------------------------------------------------------------ 2. row stats


# Screening states (RejectionConfig.screen), one per target row.
EXACT, SURE_ACCEPT, SURE_REJECT, NO_DRAFT, NOTHING = 0, 1, 2, 3, 4
_EXACT, _SURE_ACCEPT, _SURE_REJECT = tl.constexpr(EXACT), tl.constexpr(1), tl.constexpr(2)
_NO_DRAFT, _NOTHING = tl.constexpr(NO_DRAFT), tl.constexpr(NOTHING)
# A row's todo state between the bracket launch and the narrowing one: its top-p bracket
# opened for the split pass (RejectionConfig.split_f), not yet closed.
_SPLIT_OPEN = tl.constexpr(2)
# Relative margin on the screen's float estimates of masses (sums of exp(z - max) taken
# per block and rescaled: within ~5e-5 of the exact fixed-point sums, the cut's own exp
# error bound being 1.5e-5 a term).
_SCREEN_TOL = tl.constexpr(2.0**-12)


@triton.jit
def _request_drafts(req, rmask, drafts_ptr, stride_db, K, KP: tl.constexpr):
    """Requests' drafts [R, KP] (-1 past K and where rmask is off) and k [R], the ids
    before the first -1 (the drafts it proposes)."""
    j = tl.arange(0, KP)
    jm = rmask[:, None] & (j < K)[None, :]
    d = tl.load(drafts_ptr + req[:, None] * stride_db + j[None, :], mask=jm, other=-1)
    return d, tl.min(tl.where((d == -1) | (jm == 0), j[None, :], K), axis=1)


@triton.jit
def _screen(
    rows, rmask, m, tot, above, cnt, logits_ptr, stride_lm, drafts_ptr, stride_db,
    q_ptr, stride_qb, stride_qk, greedy_ptr, temp_ptr, topk_ptr, topp_ptr, seed_ptr, pos_ptr,
    V, K1, KP: tl.constexpr, ACCEPT_MUL: tl.constexpr,
):  # fmt: skip
    """Each row's screening state (module docstring, "Screening"): SURE_ACCEPT /
    SURE_REJECT where its draft's acceptance is decided whatever the row's exact cut,
    EXACT where only the cut decides (or the row needs none), NO_DRAFT past the
    request's drafts (the bonus row among them), NOTHING where nothing is decided
    (greedy and padded requests, rows past the batch). `above` / `cnt`: the mass
    (relative to the row max m, float) and count of the values above the draft's."""
    req = rows // K1
    j = rows % K1
    dall, k = _request_drafts(req, rmask, drafts_ptr, stride_db, K1 - 1, KP)
    d = tl.sum(tl.where(tl.arange(0, KP)[None, :] == j[:, None], dall, 0), axis=1)
    greedy = tl.load(greedy_ptr + req, mask=rmask, other=1) != 0
    pos = tl.load(pos_ptr + req, mask=rmask, other=-1)
    topk = tl.load(topk_ptr + req, mask=rmask, other=0)
    topp = tl.load(topp_ptr + req, mask=rmask, other=1.0)
    use_k = (topk > 0) & (topk < V)
    use_p = topp < 1.0
    present = j < k
    in_vocab = (d >= 0) & (d < V)
    nothing = (rmask == 0) | greedy | (pos < 0)
    live = present & in_vocab & (nothing == 0) & (use_k | use_p) & (m > float("-inf"))
    dc = tl.where(live, d, 0)
    t = tl.load(temp_ptr + req, mask=live, other=1.0)
    x = tl.load(logits_ptr + rows * stride_lm + dc, mask=live, other=0.0).to(tl.float32)
    ex = tl.exp(tl.math.div_rn(x, t) - m)  # the walk's exp(z - m)
    qx = tl.load(q_ptr + req * stride_qb + j * stride_qk + dc, mask=live, other=1.0)
    seed = tl.load(seed_ptr + req, mask=live, other=0)
    u = _uniform(_stream_key(seed, pos + j, ACCEPT_MUL), tl.zeros(rows.shape, tl.uint64))
    # Top-k keeps the token iff fewer than k values lie above it. Top-p keeps it iff the
    # mass strictly above it is below top_p times the mass it filters: the row's, or after
    # top-k its survivors', which lies between the mass from the token up (all survivors
    # when the token is one) and the row's.
    tot64 = tot.to(tl.float64)
    c64 = above.to(tl.float64)
    own = c64 + ex.to(tl.float64)  # the mass from the token up (its ties: at least itself)
    margin = tot64 * _SCREEN_TOL
    in_k = (use_k == 0) | (cnt < topk)
    target = topp.to(tl.float64) * tot64
    target_lo = tl.where(use_k, topp.to(tl.float64) * own, target)
    cut = (use_p & (c64 > target + margin)) | (in_k == 0)
    kept = in_k & ((use_p == 0) | (c64 < target_lo - margin))
    # A kept token's row keeps a mass M in [max(top-p's target, the mass from it up), tot]
    # (after top-k the target is not known, and the second bound alone holds): bounds on
    # p = exp(z - m) / M, and acceptance (p > 0 and (p >= q or u q < p)) grows with p.
    floor = tl.where(use_p & (use_k == 0), target, 0.0)
    m_lo = (tl.maximum(floor, own) * (1.0 - _SCREEN_TOL)).to(tl.float32)
    m_hi = (tot64 * (1.0 + _SCREEN_TOL)).to(tl.float32)
    p_lo = tl.math.div_rn(ex, m_hi)
    p_hi = tl.math.div_rn(ex, tl.maximum(m_lo, 1e-30))
    acc_lo = (p_lo > 0.0) & ((p_lo >= qx) | (u * qx < p_lo))
    acc_hi = (p_hi > 0.0) & ((p_hi >= qx) | (u * qx < p_hi))
    state = tl.where(kept & acc_lo, _SURE_ACCEPT, _EXACT)
    state = tl.where((kept & (acc_hi == 0)) | cut, _SURE_REJECT, state)
    state = tl.where(live, state, _EXACT)
    state = tl.where(present & (in_vocab == 0), _SURE_REJECT, state)  # never accepted
    state = tl.where(present, state, _NO_DRAFT)
    return tl.where(nothing, _NOTHING, state)


@triton.jit
def _init_kernel(
    pmax_ptr, psum_ptr, rmax_ptr, rthr_ptr, rsum_ptr, num_rows, NB,
    pabove_ptr, pcnt_ptr, state_ptr, logits_ptr, stride_lm, drafts_ptr, stride_db,
    q_ptr, stride_qb, stride_qk, greedy_ptr, temp_ptr, topk_ptr, topp_ptr, seed_ptr, pos_ptr,
    V, K1, slist_ptr,
    ROWS: tl.constexpr, NBP: tl.constexpr, SCREEN: tl.constexpr, KP: tl.constexpr,
    ACCEPT_MUL: tl.constexpr, SPLIT: tl.constexpr,
    GDC: tl.constexpr = False,
):  # fmt: skip
    """Row max and mass (relative to the max) from the block partials; thresholds reset
    to -inf (kept: every token), which the cut kernel overwrites for filtered rows.
    SCREEN: each row's screening state too. SPLIT: the split cut's list of opened rows
    emptied (its count, slot 0)."""
    _gdc_enter(GDC)
    if SPLIT:  # noqa: SIM102 (a constexpr branch, then a device one)
        if tl.program_id(0) == 0:
            tl.store(slist_ptr, 0)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < num_rows
    blocks = tl.arange(0, NBP)
    pmask = rmask[:, None] & (blocks < NB)[None, :]
    pm = tl.load(pmax_ptr + rows[:, None] * NB + blocks[None, :], mask=pmask, other=float("-inf"))
    ps = tl.load(psum_ptr + rows[:, None] * NB + blocks[None, :], mask=pmask, other=0.0)
    m = tl.where(rmask, tl.max(pm, axis=1), 0.0)  # finite on rows past the batch
    scale = tl.where(pm == float("-inf"), 0.0, tl.exp(pm - m[:, None]))
    tot = tl.sum(ps * scale, axis=1)
    tl.store(rmax_ptr + rows, m, mask=rmask)
    tl.store(rthr_ptr + rows, tl.full([ROWS], float("-inf"), tl.float32), mask=rmask)
    tl.store(rsum_ptr + rows, tot, mask=rmask)
    if SCREEN:
        pa = tl.load(pabove_ptr + rows[:, None] * NB + blocks[None, :], mask=pmask, other=0.0)
        pc = tl.load(pcnt_ptr + rows[:, None] * NB + blocks[None, :], mask=pmask, other=0)
        state = _screen(
            rows, rmask, m, tot, tl.sum(pa * scale, axis=1), tl.sum(pc, axis=1), logits_ptr,
            stride_lm, drafts_ptr, stride_db, q_ptr, stride_qb, stride_qk, greedy_ptr, temp_ptr,
            topk_ptr, topp_ptr, seed_ptr, pos_ptr, V, K1, KP, ACCEPT_MUL,
        )  # fmt: skip
        tl.store(state_ptr + rows, state, mask=rmask)


@triton.jit
def _needs_cut(state_ptr, rows, rmask, K1, KP: tl.constexpr):
    """Rows whose exact cut a screened call needs: of each request, the first row with
    SURE_REJECT or NO_DRAFT (s: the residual's row if the walk gets there, else the
    bonus row) and the EXACT rows from the first row not surely accepted up to s (one
    of them may be where the walk stops instead)."""
    req = rows // K1
    j = rows % K1
    jj = tl.arange(0, KP)
    st = tl.load(state_ptr + req[:, None] * K1 + jj[None, :],
                 mask=rmask[:, None] & (jj < K1)[None, :], other=_NO_DRAFT)  # fmt: skip
    first = tl.min(tl.where(st != _SURE_ACCEPT, jj[None, :], KP), axis=1)
    s = tl.min(tl.where(st >= _SURE_REJECT, jj[None, :], KP), axis=1)
    mine = tl.sum(tl.where(jj[None, :] == j[:, None], st, 0), axis=1)
    need = (j == s) | ((j >= first) & (j < s) & (mine == _EXACT))
    return rmask & need & (mine != _NOTHING)


# ------------------------------------------------------------------------- 3. the cuts


@triton.jit
def _fx(z, m, FXS: tl.constexpr):
    """exp(z - m) <= 1 as an int64 of FXS units (the vocabulary's worth fits 2^62). Sums
    of these are exact, hence independent of the order they are added in. The exp
    flushes subnormal results to 0 (_exp_ftz): such a term is below 2^-126 * FXS <= 2^-64
    of a unit and truncates to 0 either way, so these are tl.exp's units bit for bit, for
    a compare and two multiplies fewer a value on the GPU."""
    return (_exp_ftz(z - m) * FXS).to(tl.int64)


@triton.jit
def _fx_f32(mass, FXS: tl.constexpr):
    """An int64 sum of _fx units as a float32 mass (relative to m)."""
    return (mass.to(tl.float64) * (1.0 / FXS)).to(tl.float32)


@triton.jit
def _top_p_bounds(p, kept_f, kept_c, floor_v, zmin, m, FXS: tl.constexpr):
    """The top-p search over the survivors (kept_c values of mass kept_f at or above
    floor_v): its lower end and its goal in _fx units. Tokens with exp(z - m) < (1 - p) *
    mass / count hold under (1 - p) of the mass together, so the cut is above them (one e
    of margin for rounding). One definition for _cut_kernel and _cut_fast's fused cut,
    which must agree bit for bit."""
    lo = m + tl.log((1.0 - p) * kept_f / kept_c.to(tl.float32)) - 1.0
    lo = tl.minimum(tl.maximum(lo, tl.maximum(floor_v, zmin)), m)
    return lo, _top_p_goal(p, kept_f, FXS)


@triton.jit
def _top_p_goal(p, kept_f, FXS: tl.constexpr):
    """The top-p cut's goal in _fx units: top_p times the survivors' float32 mass."""
    return p.to(tl.float64) * kept_f.to(tl.float64) * FXS


@triton.jit
def _below(x):
    """The largest float32 below x (finite x)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x > 0.0, bits - 1, tl.where(x < 0.0, bits + 1, -2147483647))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _row_z(ptrs, mask, t):
    """A row's z = logits / T (correctly rounded), -0 folded into +0; -inf where masked."""
    return _z_of(tl.load(ptrs, mask=mask, other=float("-inf")), t, t == 1.0)


@triton.jit
def _cut_row(
    logits_ptr, stride_lm, cand_ptr, row, t, m, V, floor_v, lo, hi, target_c, target_m,
    MASS: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, NBIN: tl.constexpr,
    MAX_PASSES: tl.constexpr, CHUNK: tl.constexpr, FXS: tl.constexpr,
):  # fmt: skip
    """One row's cut with scalar state: _cut_tile's algorithm, arithmetic and results for
    a single row (tests check the two bit for bit). The GPU takes it at large
    vocabularies, one row per program, where _cut_tile's per-row vectors spill registers
    (sm_90 SASS: 35.6k instructions with 2k local loads and stores, against 18.7k and
    10)."""
    cols = tl.arange(0, BLOCK)
    bins = tl.arange(0, NBIN)
    slots = tl.arange(0, CAP)
    base = logits_ptr + row * stride_lm
    cbase = cand_ptr + row * CAP
    thr = hi
    kept_c = tl.zeros([], tl.int32)
    kept_m = tl.zeros([], tl.int64)
    done = tl.zeros([], tl.int32)
    compact = tl.zeros([], tl.int32)
    pivot = hi
    for _ in range(MAX_PASSES):
        if done == 0:
            span = hi - lo
            scale = tl.where(span > 0.0, NBIN / tl.maximum(span, 1e-30), 0.0)
            hist = tl.zeros([NBIN], tl.int32)
            n = tl.zeros([], tl.int32)  # compaction offset (compacting passes only)
            # Per-lane running sums, reduced once after the pass.
            above_cv = tl.zeros([BLOCK], tl.int32)
            above_mv = tl.zeros([BLOCK], tl.int64)
            ge_cv = tl.zeros([BLOCK], tl.int32)
            ge_mv = tl.zeros([BLOCK], tl.int64)
            wminv = tl.full([BLOCK], float("inf"), tl.float32)
            wmaxv = tl.full([BLOCK], float("-inf"), tl.float32)
            tl.debug_barrier()  # the previous pass's scratch reads are finished
            for v0 in range(0, V, BLOCK):
                offs = v0 + cols
                ok = offs < V
                z = _row_z(base + offs, ok, t)
                surv = ok & (z >= floor_v) & (z > float("-inf"))
                e = _fx(z, m, FXS)
                up = surv & (z > hi)
                above_cv += up.to(tl.int32)
                above_mv += tl.where(up, e, 0)
                ge = surv & (z >= pivot)
                ge_cv += ge.to(tl.int32)
                ge_mv += tl.where(ge, e, 0)
                win = surv & (z >= lo) & (z <= hi)
                b = tl.minimum(((hi - z) * scale).to(tl.int32), NBIN - 1)
                hist += tl.histogram(tl.where(win, b, 0), NBIN, mask=win)
                wminv = tl.minimum(wminv, tl.where(win, z, float("inf")))
                wmaxv = tl.maximum(wmaxv, tl.where(win, z, float("-inf")))
                if compact != 0:
                    wi = win.to(tl.int32)
                    idx = n + tl.cumsum(wi, axis=0) - 1
                    tl.store(cbase + idx, z, mask=win & (idx < CAP))
                    n += tl.sum(wi, axis=0)
            n = tl.sum(hist, axis=0)
            above_c = tl.sum(above_cv, axis=0)
            above_m = tl.sum(above_mv, axis=0)
            ge_c = tl.sum(ge_cv, axis=0)
            ge_m = tl.sum(ge_mv, axis=0)
            wmin = tl.min(wminv, axis=0)
            wmax = tl.max(wmaxv, axis=0)
            if n == 0:
                # Nothing in [lo, hi] (rounding left the target unreached): keep what is
                # above it; no survivor equals hi, so the test z >= hi says the same.
                thr = hi
                kept_c = above_c
                kept_m = above_m
                done = done | 1
            elif wmin == wmax:
                # One value left (a tie group): it is the cut.
                thr = wmin
                kept_c = above_c + n
                kept_m = above_m + n.to(tl.int64) * _fx(wmin, m, FXS)
                done = done | 1
            elif (compact != 0) & (n <= CAP):
                tl.debug_barrier()  # the compaction's stores are visible to every thread
                valid = slots < n
                vals = tl.load(cbase + slots, mask=valid, other=float("-inf"))
                ev = tl.where(valid, _fx(vals, m, FXS), 0)
                v_hit = tl.full([], float("-inf"), tl.float32)
                for c0 in tl.static_range(0, CAP, CHUNK):
                    ci = c0 + tl.arange(0, CHUNK)
                    vi_ok = ci < n
                    vi = tl.load(cbase + ci, mask=vi_ok, other=float("-inf"))
                    ge = valid[None, :] & (vals[None, :] >= vi[:, None])
                    if MASS:
                        got = tl.sum(tl.where(ge, ev[None, :], 0), axis=1)
                        hit = vi_ok & ((above_m + got).to(tl.float64) >= target_m)
                    else:
                        got = tl.sum(ge.to(tl.int32), axis=1)
                        hit = vi_ok & (above_c + got >= target_c)
                    v_hit = tl.maximum(v_hit, tl.max(tl.where(hit, vi, float("-inf")), axis=0))
                # Float rounding can leave the target unreached: keep every candidate.
                v = tl.where(v_hit > float("-inf"), v_hit, wmin)
                keep = valid & (vals >= v)
                thr = v
                kept_c = above_c + tl.sum(keep.to(tl.int32), axis=0)
                kept_m = above_m + tl.sum(tl.where(keep, ev, 0), axis=0)
                done = done | 1
            else:
                # Members of bin i lie in [hi - (i+1)/scale, hi - i/scale] up to rounding
                # (delta: a few ulps of the interval's ends and of its span).
                delta = (tl.abs(hi) + tl.abs(lo)) * 4.76837158203125e-07  # 2^-21
                delta += span * 9.5367431640625e-07  # 2^-20
                fi = bins.to(tl.float32)
                if MASS:
                    top = tl.minimum(hi - fi / scale + delta, hi)
                    bot = tl.maximum(hi - (fi + 1.0) / scale - delta, lo)
                    c64 = hist.to(tl.float64)
                    eu = tl.exp(top - m).to(tl.float64) * (FXS * 1.0000153)
                    el = tl.exp(bot - m).to(tl.float64) * (FXS * 0.9999847) - 1.0
                    upper = above_m.to(tl.float64) + tl.cumsum(c64 * eu, axis=0)
                    lower = above_m.to(tl.float64) + tl.cumsum(c64 * tl.maximum(el, 0.0), axis=0)
                    first = tl.min(tl.where(upper >= target_m, bins, NBIN - 1), axis=0)
                    last = tl.min(tl.where(lower >= target_m, bins, NBIN - 1), axis=0)
                else:
                    counts = above_c + tl.cumsum(hist, axis=0)
                    first = tl.min(tl.where(counts >= target_c, bins, NBIN - 1), axis=0)
                    last = first
                inw = (bins >= first) & (bins <= last)
                est = tl.sum(tl.where(inw, hist, 0), axis=0)
                new_hi = tl.minimum(hi - first.to(tl.float32) / scale + delta, hi)
                new_lo = tl.maximum(hi - (last + 1).to(tl.float32) / scale - delta, lo)
                # The pivot's exact count / mass says on which side of it the cut lies;
                # that halves the interval's count when the bounds cannot narrow it.
                if MASS:
                    at_or_above = ge_m.to(tl.float64) >= target_m
                else:
                    at_or_above = ge_c >= target_c
                if at_or_above:
                    new_lo = tl.maximum(new_lo, pivot)
                else:
                    new_hi = tl.minimum(new_hi, _below(pivot))
                # Next pivot: the edge splitting the window's count in two, else the
                # middle of the new interval.
                half = tl.cumsum(tl.where(inw, hist, 0), axis=0) >= (est + 1) // 2
                j = tl.min(tl.where(half, bins, NBIN - 1), axis=0)
                pivot = hi - (j + 1).to(tl.float32) / scale
                mid = new_lo + 0.5 * (new_hi - new_lo)
                pivot = tl.where((pivot > new_lo) & (pivot <= new_hi), pivot, mid)
                hi = new_hi
                lo = new_lo
                compact = (est <= CAP).to(tl.int32)
    # Not reached with the launcher's MAX_PASSES for real rows (each pass shrinks the
    # interval about NBIN / (last - first + 1)-fold); keep its top rather than garbage.
    if done == 0:
        thr = hi
    return thr, kept_c, kept_m


@triton.jit
def _above(x):
    """The smallest float32 above x (finite x; -0 folded into +0)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x > 0.0, bits + 1, tl.where(x < 0.0, bits - 1, 1))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _key(x):
    """float32 -> int32 whose order is the floats' (an involution on the bits; finite x,
    -0 folded into +0 beforehand)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _sum_min_max(s1, lo1, hi1, s2, lo2, hi2):
    """tl.reduce's combine for (sum, min, max) triples."""
    return s1 + s2, tl.minimum(lo1, lo2), tl.maximum(hi1, hi2)


@triton.jit
def _bisect_keys(vals, valid, e, above_c, above_m, target_c, target_m, MASS: tl.constexpr,
                 INTERP: tl.constexpr = False):  # fmt: skip
    """The largest of the valid vals (unordered; e their _fx masses) whose measure at or
    above it (above_m + their masses >= it, or above_c + their count) reaches the target:
    (found, value). The measure only changes at a value, so a bisection over the int32
    keys between the smallest and the largest valid value ends on that value's key (at
    most 32 steps of one masked sum each); exactly the first crossing of the sorted
    running sum (_bracket_cut), ties included. INTERP (RejectionConfig.interp_f): one
    point a step where the measure, taken as linear in the key between the two ends,
    crosses the target; the end it replaces moves on to the nearest value's key (the
    measure is the same there), so the search runs over values rather than keys. A step
    that does not halve the interval is followed by a midpoint step: at most about twice
    the bisection's steps."""
    # int32 keys (registers: up to 8 values a thread); the ends and steps in int64
    # scalars (an interval may span 2^32 keys), a point between them in int32 again
    keys = _key(vals)
    klo = tl.min(tl.where(valid, keys, 2147483647), axis=0).to(tl.int64)
    khi = tl.max(tl.where(valid, keys, -2147483648), axis=0).to(tl.int64)
    # the measure at the smallest value (every value counted)
    if MASS:
        at_lo = above_m + tl.sum(e, axis=0)
        found = at_lo.to(tl.float64) >= target_m
    else:
        at_lo = above_c + tl.sum(valid.to(tl.int32), axis=0)
        found = at_lo >= target_c
    found = found & (klo <= khi)
    if found & INTERP:
        m_lo = at_lo.to(tl.float64)  # the measure at klo
        if MASS:
            m_hi = above_m.to(tl.float64)  # and past khi
            goal = target_m
        else:
            m_hi = above_c.to(tl.float64)
            goal = target_c.to(tl.float64)
        interp = True
        while klo < khi:
            span = khi - klo
            mid = klo + (span + 1) // 2
            if interp:
                f = tl.where(m_lo > m_hi, (m_lo - goal) / (m_lo - m_hi), 0.5)
                f = tl.minimum(tl.maximum(f, 0.0), 1.0)
                off = (f * (span + 1).to(tl.float64)).to(tl.int64)
                mid = klo + tl.minimum(tl.maximum(off, 1), span)
            ge = valid & (keys >= mid.to(tl.int32))  # klo < mid <= khi
            if MASS:
                w = tl.where(ge, e, 0)
            else:
                w = ge.to(tl.int64)
            got, up, down = tl.reduce(
                (w, tl.where(ge, keys, 2147483647), tl.where(valid & ~ge, keys, -2147483648)),
                0, _sum_min_max,
            )  # fmt: skip
            if MASS:
                here = (above_m + got).to(tl.float64)
            else:
                here = (above_c + got).to(tl.float64)
            if here >= goal:
                klo = up.to(tl.int64)  # the smallest value at or above mid: the same measure
                m_lo = here
            else:
                khi = down.to(tl.int64)  # the largest value below mid: every key past it fails
                m_hi = here
            interp = 2 * (khi - klo) <= span
    elif found:
        while klo < khi:
            mid = klo + (khi - klo + 1) // 2
            ge = valid & (keys >= mid.to(tl.int32))  # klo < mid <= khi
            if MASS:
                reach = (above_m + tl.sum(tl.where(ge, e, 0), axis=0)).to(tl.float64) >= target_m
            else:
                reach = above_c + tl.sum(ge.to(tl.int32), axis=0) >= target_c
            if reach:
                klo = mid
            else:
                khi = mid - 1
    return found, _key(klo.to(tl.int32)).to(tl.float32, bitcast=True)


@triton.jit
def _bracket_cut(
    cbase, n, above_c, above_m, target_c, target_m, m, lo, hi, b_lo, a_hi, ok, fused, thr_p,
    kept_mp, p_top, zmin,
    MASS: tl.constexpr, FXS: tl.constexpr, FUSE_P: tl.constexpr, SIZE: tl.constexpr,
    BISECT: tl.constexpr = 0,
):  # fmt: skip
    """_cut_fast's answer from its compacted bracket: the n <= SIZE values at cbase,
    sorted in a SIZE-wide tile (the first n slots of a wider one: the same values in the
    same order, so the same answer for any SIZE >= n). Returns (thr, kept count, kept
    mass, ok, hi, a_hi, fused, thr_p, kept mass_p) as _cut_fast carries them. BISECT
    (never with FUSE_P, which needs the order; 0 off, 1 interpolated steps, 2 binary ones):
    the same cut without the sort, by _bisect_keys."""
    slots = tl.arange(0, SIZE)
    vals = tl.load(cbase + slots, mask=slots < n, other=float("-inf"))
    if BISECT:
        tl.static_assert(not FUSE_P, "the fused top-p cut needs the sorted bracket")
        e = tl.where(slots < n, _fx(vals, m, FXS), 0)
        found, v_hit = _bisect_keys(vals, slots < n, e, above_c, above_m, target_c, target_m,
                                    MASS, BISECT == 1)  # fmt: skip
    else:
        vals = tl.sort(vals, descending=True)
        e = tl.where(slots < n, _fx(vals, m, FXS), 0)
        if MASS:
            hit = (above_m + tl.cumsum(e, axis=0)).to(tl.float64) >= target_m
        else:
            hit = above_c + slots + 1 >= target_c
        i = tl.min(tl.where(hit & (slots < n), slots, SIZE), axis=0)
        found = i < n
        v_hit = tl.max(tl.where(slots == i, vals, float("-inf")), axis=0)
    v = hi
    if found:
        v = v_hit
        ok = ok + 1
    elif b_lo <= lo:
        # Float rounding left the target unreached: keep every survivor
        # (_cut_row ends the same way); none at all keeps what is above hi.
        v = tl.where(n > 0, tl.min(tl.where(slots < n, vals, float("inf")), axis=0),
                     hi)  # fmt: skip
        ok = ok + 1
    else:
        hi = _below(b_lo)  # the cut is below the bracket
        if MASS:
            a_hi = _fx_f32(above_m + tl.sum(e, axis=0), FXS)
        else:
            a_hi = (above_c + n).to(tl.float32)
    keep = (slots < n) & (vals >= v)
    thr = v
    kept_c = above_c + tl.sum(keep.to(tl.int32), axis=0)
    kept_m = above_m + tl.sum(tl.where(keep, e, 0), axis=0)
    if FUSE_P:  # noqa: SIM102 (a constexpr branch, then a device one)
        if (ok != 0) & (above_c == 0) & (p_top < 1.0):
            # _cut_kernel's top-p set-up over these survivors
            lo_p, goal_p = _top_p_bounds(p_top, _fx_f32(kept_m, FXS), kept_c, v,
                                         zmin, m, FXS)  # fmt: skip
            # The largest candidate in [lo_p, m] whose mass from the top
            # reaches the goal (first crossing of the running sum, which is
            # exact: int64), else the smallest candidate (float rounding
            # left the goal unreached: keep them all, as _cut_row does).
            cand_p = keep & (vals >= lo_p)
            run_p = tl.cumsum(tl.where(keep, e, 0), axis=0)
            hit_p = cand_p & (run_p.to(tl.float64) >= goal_p)
            ip = tl.min(tl.where(hit_p, slots, SIZE), axis=0)
            vp = tl.max(tl.where(slots == ip, vals, float("-inf")), axis=0)
            low_p = tl.min(tl.where(cand_p, vals, float("inf")), axis=0)
            thr_p = tl.where(ip < SIZE, vp, low_p)
            kept_mp = tl.sum(tl.where(keep & (vals >= thr_p), e, 0), axis=0)
            fused = fused + 1
    return thr, kept_c, kept_m, ok, hi, a_hi, fused, thr_p, kept_mp


@triton.jit
def _sized_bracket_cut(
    cbase, n, above_c, above_m, target_c, target_m, m, lo, hi, b_lo, a_hi, ok, fused, thr_p,
    kept_mp, p_top, zmin,
    MASS: tl.constexpr, FXS: tl.constexpr, FUSE_P: tl.constexpr, SMALL: tl.constexpr,
    CAP: tl.constexpr, BISECT: tl.constexpr,
):  # fmt: skip
    """_bracket_cut in a SMALL-wide tile where the bracket fits one (SMALL > 0: a narrower
    sort or bisection), else CAP-wide: the same answer either way."""
    if SMALL > 0:
        if n <= SMALL:
            thr, kept_c, kept_m, ok, hi, a_hi, fused, thr_p, kept_mp = _bracket_cut(
                cbase, n, above_c, above_m, target_c, target_m, m, lo, hi, b_lo, a_hi, ok,
                fused, thr_p, kept_mp, p_top, zmin, MASS, FXS, FUSE_P, SMALL, BISECT,
            )  # fmt: skip
        else:
            thr, kept_c, kept_m, ok, hi, a_hi, fused, thr_p, kept_mp = _bracket_cut(
                cbase, n, above_c, above_m, target_c, target_m, m, lo, hi, b_lo, a_hi, ok,
                fused, thr_p, kept_mp, p_top, zmin, MASS, FXS, FUSE_P, CAP, BISECT,
            )  # fmt: skip
    else:
        thr, kept_c, kept_m, ok, hi, a_hi, fused, thr_p, kept_mp = _bracket_cut(
            cbase, n, above_c, above_m, target_c, target_m, m, lo, hi, b_lo, a_hi, ok, fused,
            thr_p, kept_mp, p_top, zmin, MASS, FXS, FUSE_P, CAP, BISECT,
        )  # fmt: skip
    return thr, kept_c, kept_m, ok, hi, a_hi, fused, thr_p, kept_mp


@triton.jit
def _margin(r, SAMPLE: tl.constexpr):
    """The bracket's half-width in sample values around the estimated cut's rank r
    (from the top of [lo, hi]): two binomial standard deviations of the sample's count
    above it, plus 3."""
    f = tl.minimum(tl.maximum(r, 1).to(tl.float32) / SAMPLE, 1.0)
    return (2.0 * tl.sqrt(SAMPLE * f * (1.0 - f))).to(tl.int32) + 3


@triton.jit
def _estimate(w, a_hi, m_lo, goal):
    """Estimated measure of the values at or above each sample position (w: the measure
    each sample value or bin stands for, from the top): from the top, or from the bottom
    when the goal is nearer m_lo (the bulk below the cut is better sampled than the few
    heavy values above it)."""
    cum = tl.cumsum(w, axis=0)
    return tl.where(goal - a_hi < m_lo - goal, a_hi + cum, m_lo - (tl.sum(w, axis=0) - cum))


@triton.jit
def _sorted_bracket(s, ws, lo, hi, a_hi, m_lo, goal, SAMPLE: tl.constexpr):
    """_cut_fast's bracket [b_lo, b_hi] from the sorted sample s (descending; ws the
    measure each value stands for): the sample's values in [lo, hi] are s[i0:i1], the
    estimated cut is the first whose measure from the top reaches the goal, and the
    bracket's ends are the values _margin ranks above and below it (hi / lo past the
    ends)."""
    si = tl.arange(0, SAMPLE)
    inside = (s >= lo) & (s <= hi)
    i0 = tl.sum((s > hi).to(tl.int32), axis=0)
    i1 = i0 + tl.sum(inside.to(tl.int32), axis=0)
    est = _estimate(tl.where(inside, ws, 0.0), a_hi, m_lo, goal)
    i_star = i0 + tl.sum((inside & (est < goal)).to(tl.int32), axis=0)
    d = _margin(i_star - i0, SAMPLE)
    ih = i_star - d
    il = i_star + d
    b_hi = tl.where(ih >= i0, tl.max(tl.where(si == ih, s, float("-inf")), axis=0), hi)
    b_lo = tl.where(il < i1, tl.max(tl.where(si == il, s, float("-inf")), axis=0), lo)
    return b_lo, b_hi


@triton.jit
def _row_sample(base, V, t, m, lo, hi, MASS: tl.constexpr, SAMPLE: tl.constexpr):
    """A row's strided sample of SAMPLE values, those in [lo, hi] sorted once (s,
    descending), with the measure each stands for (ws: its mass, or count, times the row
    values it stands for)."""
    si = tl.arange(0, SAMPLE)
    sz = _row_z(base + (si.to(tl.int64) * V) // SAMPLE, si < SAMPLE, t)
    per = V / SAMPLE
    s = tl.sort(tl.where((sz >= lo) & (sz <= hi), sz, float("-inf")), descending=True)
    if MASS:
        ws = tl.where(s > float("-inf"), tl.exp(s - m), 0.0) * per
    else:
        ws = tl.where(s > float("-inf"), per, 0.0)
    return s, ws


@triton.jit
def _pass_chunk(z, cnt, above_mv, above_cv, lbase, cols, b_lo, b_hi, m, FXS: tl.constexpr,
                LANES: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """One chunk of _cut_fast's pass (z: its values, one a lane): the exact mass and
    count above the bracket, and the bracket's values into each lane's own slots."""
    up = z > b_hi  # b_hi >= lo >= floor_v: every such value survives
    # top-k's kept mass too; a value at or below b_hi as -inf: a 0 term (a 32-bit select,
    # not a 64-bit one after the conversion)
    above_mv += _fx(tl.where(up, z, float("-inf")), m, FXS)
    above_cv += up.to(tl.int32)
    inb = (z >= b_lo) & (z <= b_hi)
    tl.store(lbase + cnt * BLOCK + cols, z, mask=inb & (cnt < LANES))
    return cnt + inb.to(tl.int32), above_mv, above_cv


@triton.jit
def _pass_vec_chunk(z, cnt, above_mv, above_cv, lbase, cols, b_lo, b_hi, m, FXS: tl.constexpr,
                    LANES: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """_pass_chunk for a chunk of 8 adjacent columns a lane (z [BLOCK, 8], one lane's
    columns along the last axis, in its registers): the lane's sums over its 8 values, and
    its bracket values into its next slots in column order (an in-lane running count)."""
    up = z > b_hi
    above_mv += tl.sum(_fx(tl.where(up, z, float("-inf")), m, FXS), axis=1)  # as above
    above_cv += tl.sum(up.to(tl.int32), axis=1)
    inb = (z >= b_lo) & (z <= b_hi)
    w = inb.to(tl.int32)
    slot = cnt[:, None] + tl.cumsum(w, axis=1) - w
    tl.store(lbase + slot * BLOCK + cols[:, None], z, mask=inb & (slot < LANES))
    return cnt + tl.sum(w, axis=1), above_mv, above_cv


@triton.jit
def _cut_fast(
    logits_ptr, stride_lm, cand_ptr, row, t, m, V, floor_v, lo, hi, target_c, target_m, total,
    p_top, zmin,
    MASS: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, SAMPLE: tl.constexpr,
    TRIES: tl.constexpr, LANES: tl.constexpr, STAGES: tl.constexpr, FXS: tl.constexpr,
    FUSE_P: tl.constexpr, SMALL: tl.constexpr, BISECT: tl.constexpr = 0,
    LOADS: tl.constexpr = 1,
):  # fmt: skip
    """_cut_row's answer in one pass over the row when a sample places it well.

    A strided sample of SAMPLE values, sorted once, estimates where the cut lies in
    [lo, hi] and brackets it [b_lo, b_hi] with a margin of two binomial standard
    deviations of the sample's count. One pass then sums the exact (int64) mass and
    count above b_hi and compacts the bracket's values into the row's scratch; sorted,
    their running sums give the cut. No histogram: a few comparisons and one exp a
    value. A bracket that missed narrows [lo, hi] to the side holding the cut, whose
    exact mass the pass just measured, and the next try estimates within it (the heavy
    values that misled the sample are then counted exactly). Returns (thr, kept count,
    kept mass, ok, lo, hi): ok 0 after TRIES misses, [lo, hi] still holding the cut for
    _cut_row to finish. `total`: the survivors' float32 mass (relative to m).

    FUSE_P (a top-k cut, MASS False): where the try that found the cut had nothing above
    its bracket, every survivor is among its sorted values, and the top-p cut over them
    (top_p p_top < 1; zmin the row's smallest value) is taken from those values as
    _cut_kernel's own top-p cut would set it up and find it: the same lower bound, goal,
    threshold and kept mass, bit for bit. Also returns (fused, thr_p, kept mass_p);
    fused 0 leaves the top-p cut to its own call. SMALL > 0: a bracket of at most SMALL
    values is sorted SMALL wide, not CAP (_bracket_cut: the same answer). LOADS 1: one
    BLOCK-column chunk an iteration (_pass_chunk), its load waited out before its
    lane-slot stores (the compiler cannot move a load above a store it cannot prove
    apart). LOADS 16: two chunks of 8 adjacent columns a lane an iteration
    (_pass_vec_chunk), both vector loads issued before the first store, and the
    compaction after the pass takes four slots' loads at a time; a lane's slots then
    hold other columns than with one column a lane, so a bracket may overflow a lane
    where the other layout did not (the next try then takes it: the same cut)."""
    base = logits_ptr + row * stride_lm
    cbase = cand_ptr + row * (CAP + LANES * BLOCK)  # CAP dense values, then lane slots
    lbase = cbase + CAP
    lo = tl.maximum(lo, floor_v)  # survivors only: z >= floor_v
    cols = tl.arange(0, BLOCK)
    if MASS:
        goal = (target_m * (1.0 / FXS)).to(tl.float32)
    else:
        goal = target_c.to(tl.float32)
    s, ws = _row_sample(base, V, t, m, lo, hi, MASS, SAMPLE)
    # Measure above hi and at or above lo, as far as known (exact after a try).
    a_hi = tl.zeros([], tl.float32)
    if MASS:
        m_lo = total
    else:
        m_lo = V * 1.0
    thr = hi
    kept_c = tl.zeros([], tl.int32)
    kept_m = tl.zeros([], tl.int64)
    ok = tl.zeros([], tl.int32)
    fused = tl.zeros([], tl.int32)
    thr_p = hi
    kept_mp = tl.zeros([], tl.int64)
    for _ in range(TRIES):
        if ok == 0:
            # 1. The bracket [b_lo, b_hi], from the sample.
            b_lo, b_hi = _sorted_bracket(s, ws, lo, hi, a_hi, m_lo, goal, SAMPLE)
            # 2. One pass: the exact measure above b_hi, the bracket compacted.
            above_cv = tl.zeros([BLOCK], tl.int32)
            above_mv = tl.zeros([BLOCK], tl.int64)
            n = tl.zeros([], tl.int32)
            tl.debug_barrier()  # earlier readers of the scratch are done
            # Each lane keeps the bracket's values it meets in LANES slots of its
            # own: no block-wide step inside the loop. The slots are made dense
            # after it (one scan); a lane with more values overflows the try.
            cnt = tl.zeros([BLOCK], tl.int32)
            if LOADS == 16:
                # Two chunks of 8 adjacent columns a lane (one 16-byte load each for 16-bit
                # logits) an iteration: 16 columns a lane in flight in two loads, where 4
                # one-column chunks took four.
                vec = cols[:, None] * 8 + tl.arange(0, 8)[None, :]
                for v0 in tl.range(0, V, 16 * BLOCK, num_stages=STAGES):
                    o0 = v0 + vec
                    o1 = o0 + 8 * BLOCK
                    x0 = tl.load(base + o0, mask=o0 < V, other=float("-inf"))
                    x1 = tl.load(base + o1, mask=o1 < V, other=float("-inf"))
                    z0 = _z_of(x0, t, t == 1.0)
                    z1 = _z_of(x1, t, t == 1.0)
                    cnt, above_mv, above_cv = _pass_vec_chunk(
                        z0, cnt, above_mv, above_cv, lbase, cols, b_lo, b_hi, m, FXS, LANES,
                        BLOCK,
                    )  # fmt: skip
                    cnt, above_mv, above_cv = _pass_vec_chunk(
                        z1, cnt, above_mv, above_cv, lbase, cols, b_lo, b_hi, m, FXS, LANES,
                        BLOCK,
                    )  # fmt: skip
            else:
                tl.static_assert(LOADS == 1, "loads_f is 1 or 16")
                for v0 in tl.range(0, V, BLOCK, num_stages=STAGES):
                    offs = v0 + cols
                    z = _row_z(base + offs, offs < V, t)
                    cnt, above_mv, above_cv = _pass_chunk(
                        z, cnt, above_mv, above_cv, lbase, cols, b_lo, b_hi, m, FXS, LANES,
                        BLOCK,
                    )  # fmt: skip
            mine = tl.minimum(cnt, LANES)
            start = tl.cumsum(mine, axis=0) - mine
            n = tl.sum(mine, axis=0)
            if tl.max(cnt, axis=0) > LANES:
                n = CAP + 1  # values were dropped: as if the bracket overflowed
            elif n <= CAP:
                tl.debug_barrier()  # the slots' stores are visible to every thread
                if (LOADS == 16) & (LANES % 4 == 0):
                    # four slots' loads before their stores, as in the pass
                    for j in tl.static_range(0, LANES, 4):
                        w0 = tl.load(lbase + j * BLOCK + cols, mask=j < mine, other=0.0)
                        w1 = tl.load(lbase + (j + 1) * BLOCK + cols, mask=j + 1 < mine, other=0.0)
                        w2 = tl.load(lbase + (j + 2) * BLOCK + cols, mask=j + 2 < mine, other=0.0)
                        w3 = tl.load(lbase + (j + 3) * BLOCK + cols, mask=j + 3 < mine, other=0.0)
                        tl.store(cbase + start + j, w0, mask=j < mine)
                        tl.store(cbase + start + j + 1, w1, mask=j + 1 < mine)
                        tl.store(cbase + start + j + 2, w2, mask=j + 2 < mine)
                        tl.store(cbase + start + j + 3, w3, mask=j + 3 < mine)
                else:
                    for j in tl.static_range(LANES):
                        vj = tl.load(lbase + j * BLOCK + cols, mask=j < mine, other=0.0)
                        tl.store(cbase + start + j, vj, mask=j < mine)
            above_c = tl.sum(above_cv, axis=0)
            above_m = tl.sum(above_mv, axis=0)
            if MASS:
                past = above_m.to(tl.float64) >= target_m
                a_b = _fx_f32(above_m, FXS)
            else:
                past = above_c >= target_c
                a_b = above_c.to(tl.float32)
            if past:
                lo = _above(b_hi)  # the cut is above the bracket
                m_lo = a_b
            elif n <= CAP:
                tl.debug_barrier()  # the compaction's stores are visible to every thread
                thr, kept_c, kept_m, ok, hi, a_hi, fused, thr_p, kept_mp = _sized_bracket_cut(
                    cbase, n, above_c, above_m, target_c, target_m, m, lo, hi, b_lo, a_hi, ok,
                    fused, thr_p, kept_mp, p_top, zmin, MASS, FXS, FUSE_P, SMALL, CAP, BISECT,
                )  # fmt: skip
            else:
                hi = b_hi  # the cut is in the bracket, too full to compact
                a_hi = a_b
    return thr, kept_c, kept_m, ok, lo, hi, fused, thr_p, kept_mp


@triton.jit
def _cut_tile(
    logits_ptr, stride_lm, cand_ptr, rows, live, t, m, V, floor_v, lo, hi, target_c, target_m,
    MASS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
    NBIN: tl.constexpr, MAX_PASSES: tl.constexpr, CHUNK: tl.constexpr, FXS: tl.constexpr,
):  # fmt: skip
    """A tile of cuts (module docstring): for each of the ROWS rows with `live` set, the
    largest value v among its survivors (z >= floor_v, z finite) whose count (MASS False:
    target_c) or fixed-point mass (MASS True: target_m, float64 FXS units) of survivors
    >= v reaches the target, known to lie in [lo, hi]. Returns, per row, (v, the count
    and the mass of survivors >= v); rows not live get hi and zeros.

    Each pass reads the rows not yet done once: the exact count and mass above hi, and a
    histogram of counts over NBIN equal value bins of [lo, hi]. The bins' mass bounds
    (count times exp at the bin's edges) pick the first bin that may reach the target
    and the first that surely does; the next interval spans them. A pass whose window
    was predicted to fit CAP compacts it into the row's scratch, and the answer is read
    off pairwise. Every row keeps its own interval and state; the passes go on while
    any row of the tile is not done, and each outcome is a masked per-row update."""
    cols = tl.arange(0, BLOCK)
    bins = tl.arange(0, NBIN)
    slots = tl.arange(0, CAP)
    # A row's histogram bins follow the previous row's: one 1-D histogram per chunk.
    bin0 = tl.arange(0, ROWS)[:, None] * NBIN
    base = logits_ptr + rows * stride_lm
    cbase = cand_ptr + rows * CAP
    unit = (tl.min(t, axis=0) == 1.0) & (tl.max(t, axis=0) == 1.0)
    thr = hi
    kept_c = tl.zeros([ROWS], tl.int32)
    kept_m = tl.zeros([ROWS], tl.int64)
    done = (live == 0).to(tl.int32)
    compact = tl.zeros([ROWS], tl.int32)
    pivot = hi
    for _ in range(MAX_PASSES):
        if tl.min(done, axis=0) == 0:
            act = done == 0
            span = hi - lo
            scale = tl.where(span > 0.0, NBIN / tl.maximum(span, 1e-30), 0.0)
            hist = tl.zeros([ROWS, NBIN], tl.int32)
            n = tl.zeros([ROWS], tl.int32)  # compaction offsets (compacting rows only)
            # Per-lane running sums, reduced once after the pass.
            above_cv = tl.zeros([ROWS, BLOCK], tl.int32)
            above_mv = tl.zeros([ROWS, BLOCK], tl.int64)
            ge_cv = tl.zeros([ROWS, BLOCK], tl.int32)
            ge_mv = tl.zeros([ROWS, BLOCK], tl.int64)
            wminv = tl.full([ROWS, BLOCK], float("inf"), tl.float32)
            wmaxv = tl.full([ROWS, BLOCK], float("-inf"), tl.float32)
            compacting = tl.max(compact, axis=0) != 0
            tl.debug_barrier()  # the previous pass's scratch reads are finished
            for v0 in range(0, V, BLOCK):
                offs = v0 + cols
                ok = act[:, None] & (offs < V)[None, :]
                x = tl.load(base[:, None] + offs[None, :], mask=ok, other=float("-inf"))
                x = x.to(tl.float32)
                if unit:  # x / 1 == x: skip the ~10-instruction IEEE division
                    z = x
                else:
                    z = tl.math.div_rn(x, t[:, None])
                z = tl.where(z == 0.0, 0.0, z)
                surv = ok & (z >= floor_v[:, None]) & (z > float("-inf"))
                e = _fx(z, m[:, None], FXS)
                up = surv & (z > hi[:, None])
                above_cv += up.to(tl.int32)
                above_mv += tl.where(up, e, 0)
                ge = surv & (z >= pivot[:, None])
                ge_cv += ge.to(tl.int32)
                ge_mv += tl.where(ge, e, 0)
                win = surv & (z >= lo[:, None]) & (z <= hi[:, None])
                b = tl.minimum(((hi[:, None] - z) * scale[:, None]).to(tl.int32), NBIN - 1)
                b = tl.reshape(tl.where(win, b, 0) + bin0, [ROWS * BLOCK])
                h = tl.histogram(b, ROWS * NBIN, mask=tl.reshape(win, [ROWS * BLOCK]))
                hist += tl.reshape(h, [ROWS, NBIN])
                wminv = tl.minimum(wminv, tl.where(win, z, float("inf")))
                wmaxv = tl.maximum(wmaxv, tl.where(win, z, float("-inf")))
                if compacting:
                    wi = (win & (compact != 0)[:, None]).to(tl.int32)
                    idx = n[:, None] + tl.cumsum(wi, axis=1) - 1
                    # Not z itself: storing it inside this branch makes Triton's sm_90
                    # layout pass break dominance for float32 logits (an MLIR error;
                    # tests/sm90_compile.py).
                    zc = tl.where(wi != 0, z, 0.0)
                    tl.store(cbase[:, None] + idx, zc, mask=(wi != 0) & (idx < CAP))
                    n += tl.sum(wi, axis=1)
            n = tl.sum(hist, axis=1)
            above_c = tl.sum(above_cv, axis=1)
            above_m = tl.sum(above_mv, axis=1)
            ge_c = tl.sum(ge_cv, axis=1)
            ge_m = tl.sum(ge_mv, axis=1)
            wmin = tl.min(wminv, axis=1)
            wmax = tl.max(wmaxv, axis=1)
            # Each active row takes one of four outcomes.
            # Nothing in [lo, hi] (rounding left the target unreached): keep what is above
            # it; no survivor equals hi, so the test z >= hi says the same.
            empty = act & (n == 0)
            # One value left (a tie group): it is the cut.
            single = act & (n != 0) & (wmin == wmax)
            # The window is in the scratch: read the cut off pairwise.
            pairs = act & (n != 0) & (wmin != wmax) & (compact != 0) & (n <= CAP)
            # Else narrow the interval.
            narrow = act & (n != 0) & (wmin != wmax) & ((compact == 0) | (n > CAP))
            thr = tl.where(empty, hi, tl.where(single, wmin, thr))
            kept_c = tl.where(empty, above_c, tl.where(single, above_c + n, kept_c))
            kept_m = tl.where(empty, above_m, kept_m)
            kept_m = tl.where(single, above_m + n.to(tl.int64) * _fx(wmin, m, FXS), kept_m)
            if tl.max(pairs.to(tl.int32), axis=0) != 0:
                tl.debug_barrier()  # the compaction's stores are visible to every thread
                valid = pairs[:, None] & (slots[None, :] < n[:, None])
                vals = tl.load(cbase[:, None] + slots[None, :], mask=valid, other=float("-inf"))
                ev = tl.where(valid, _fx(vals, m[:, None], FXS), 0)
                v_hit = tl.full([ROWS], float("-inf"), tl.float32)
                for c0 in tl.static_range(0, CAP, CHUNK):
                    ci = c0 + tl.arange(0, CHUNK)
                    vi_ok = pairs[:, None] & (ci[None, :] < n[:, None])
                    vi = tl.load(cbase[:, None] + ci[None, :], mask=vi_ok, other=float("-inf"))
                    ge = valid[:, None, :] & (vals[:, None, :] >= vi[:, :, None])
                    if MASS:
                        got = tl.sum(tl.where(ge, ev[:, None, :], 0), axis=2)
                        got = (above_m[:, None] + got).to(tl.float64)
                        hit = vi_ok & (got >= target_m[:, None])
                    else:
                        got = tl.sum(ge.to(tl.int32), axis=2)
                        hit = vi_ok & (above_c[:, None] + got >= target_c[:, None])
                    v_hit = tl.maximum(v_hit, tl.max(tl.where(hit, vi, float("-inf")), axis=1))
                # Float rounding can leave the target unreached: keep every candidate.
                v = tl.where(v_hit > float("-inf"), v_hit, wmin)
                keep = valid & (vals >= v[:, None])
                thr = tl.where(pairs, v, thr)
                kept_c = tl.where(pairs, above_c + tl.sum(keep.to(tl.int32), axis=1), kept_c)
                kept_m = tl.where(pairs, above_m + tl.sum(tl.where(keep, ev, 0), axis=1), kept_m)
            if tl.max(narrow.to(tl.int32), axis=0) != 0:
                # Members of bin i lie in [hi - (i+1)/scale, hi - i/scale] up to rounding
                # (delta: a few ulps of the interval's ends and of its span).
                delta = (tl.abs(hi) + tl.abs(lo)) * 4.76837158203125e-07  # 2^-21
                delta += span * 9.5367431640625e-07  # 2^-20
                bi = bins[None, :]
                fi = bi.to(tl.float32)
                if MASS:
                    hi_c, sc, dc = hi[:, None], scale[:, None], delta[:, None]
                    top = tl.minimum(hi_c - fi / sc + dc, hi_c)
                    bot = tl.maximum(hi_c - (fi + 1.0) / sc - dc, lo[:, None])
                    c64 = hist.to(tl.float64)
                    eu = tl.exp(top - m[:, None]).to(tl.float64) * (FXS * 1.0000153)
                    el = tl.exp(bot - m[:, None]).to(tl.float64) * (FXS * 0.9999847) - 1.0
                    am = above_m.to(tl.float64)[:, None]
                    upper = am + tl.cumsum(c64 * eu, axis=1)
                    lower = am + tl.cumsum(c64 * tl.maximum(el, 0.0), axis=1)
                    first = tl.min(tl.where(upper >= target_m[:, None], bi, NBIN - 1), axis=1)
                    last = tl.min(tl.where(lower >= target_m[:, None], bi, NBIN - 1), axis=1)
                else:
                    counts = above_c[:, None] + tl.cumsum(hist, axis=1)
                    first = tl.min(tl.where(counts >= target_c[:, None], bi, NBIN - 1), axis=1)
                    last = first
                inw = (bi >= first[:, None]) & (bi <= last[:, None])
                est = tl.sum(tl.where(inw, hist, 0), axis=1)
                new_hi = tl.minimum(hi - first.to(tl.float32) / scale + delta, hi)
                new_lo = tl.maximum(hi - (last + 1).to(tl.float32) / scale - delta, lo)
                # The pivot's exact count / mass says on which side of it the cut lies;
                # that halves the interval's count when the bounds cannot narrow it.
                if MASS:
                    at_or_above = ge_m.to(tl.float64) >= target_m
                else:
                    at_or_above = ge_c >= target_c
                new_lo = tl.where(at_or_above, tl.maximum(new_lo, pivot), new_lo)
                new_hi = tl.where(at_or_above, new_hi, tl.minimum(new_hi, _below(pivot)))
                # Next pivot: the edge splitting the window's count in two, else the
                # middle of the new interval.
                half = tl.cumsum(tl.where(inw, hist, 0), axis=1) >= ((est + 1) // 2)[:, None]
                j = tl.min(tl.where(half, bi, NBIN - 1), axis=1)
                nxt = hi - (j + 1).to(tl.float32) / scale
                mid = new_lo + 0.5 * (new_hi - new_lo)
                nxt = tl.where((nxt > new_lo) & (nxt <= new_hi), nxt, mid)
                pivot = tl.where(narrow, nxt, pivot)
                hi = tl.where(narrow, new_hi, hi)
                lo = tl.where(narrow, new_lo, lo)
                compact = tl.where(narrow, (est <= CAP).to(tl.int32), compact)
            done = done | (empty | single | pairs).to(tl.int32)
    # Not reached with the launcher's MAX_PASSES for real rows (each pass shrinks the
    # interval about NBIN / (last - first + 1)-fold); keep its top rather than garbage.
    thr = tl.where(done == 0, hi, thr)
    return thr, kept_c, kept_m


@triton.jit
def _cut(
    logits_ptr, stride_lm, cand_ptr, fast_ptr, rows, live, t, m, V, floor_v, lo, hi,
    target_c, target_m, total, p_top, zmin,
    MASS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
    NBIN: tl.constexpr, MAX_PASSES: tl.constexpr, CHUNK: tl.constexpr, FXS: tl.constexpr,
    CAP_F: tl.constexpr, SAMPLE: tl.constexpr, TRIES: tl.constexpr, LANES: tl.constexpr,
    STAGES: tl.constexpr, FAST_ONLY: tl.constexpr, FUSE_P: tl.constexpr, SMALL_F: tl.constexpr,
    BISECT: tl.constexpr = 0, LOADS: tl.constexpr = 1,
):  # fmt: skip
    """_cut_tile's contract, plus ok [ROWS] (0: not found). One row takes _cut_row
    (scalar state), first trying _cut_fast's pass when CAP_F > 0; FAST_ONLY leaves a
    row it missed to a later launch (so this one carries none of _cut_row's registers),
    else _cut_row finishes it. Also fused, thr_p, kept_mp [ROWS]: _cut_fast's top-p cut
    taken with a top-k cut (FUSE_P; fused 0 where it was not)."""
    if ROWS == 1:
        row = tl.sum(rows, axis=0)
        t1 = tl.sum(t, axis=0)
        m1 = tl.sum(m, axis=0)
        fl1 = tl.sum(floor_v, axis=0)
        lo1 = tl.sum(lo, axis=0)
        hi1 = tl.sum(hi, axis=0)
        tc1 = tl.sum(target_c, axis=0)
        tm1 = tl.sum(target_m, axis=0)
        ok = tl.zeros([], tl.int32)
        v = hi1
        c = tl.zeros([], tl.int32)
        mass = tl.zeros([], tl.int64)
        fused1 = tl.zeros([], tl.int32)
        thr_p1 = hi1
        mass_p1 = tl.zeros([], tl.int64)
        if CAP_F > 0:
            v, c, mass, ok, lo1, hi1, fused1, thr_p1, mass_p1 = _cut_fast(
                logits_ptr, stride_lm, fast_ptr, row, t1, m1, V, fl1, lo1, hi1, tc1, tm1,
                tl.sum(total, axis=0), tl.sum(p_top, axis=0), tl.sum(zmin, axis=0), MASS,
                BLOCK, CAP_F, SAMPLE, TRIES, LANES, STAGES, FXS, FUSE_P, SMALL_F, BISECT, LOADS,
            )  # fmt: skip
        if FAST_ONLY:
            pass
        elif ok == 0:
            ok = ok + 1
            v, c, mass = _cut_row(
                logits_ptr, stride_lm, cand_ptr, row, t1, m1, V, fl1, lo1, hi1, tc1, tm1,
                MASS, BLOCK, CAP, NBIN, MAX_PASSES, CHUNK, FXS,
            )  # fmt: skip
        thr = tl.where(live, v, hi)
        kept_c = tl.where(live, c, 0).to(tl.int32)
        kept_m = tl.where(live, mass, 0).to(tl.int64)
        found = tl.where(live, ok, 1)
        fused = tl.where(live, fused1, 0)
        thr_p = tl.where(live, thr_p1, hi)
        kept_mp = tl.where(live, mass_p1, 0).to(tl.int64)
    else:
        thr, kept_c, kept_m = _cut_tile(
            logits_ptr, stride_lm, cand_ptr, rows, live, t, m, V, floor_v, lo, hi, target_c,
            target_m, MASS, ROWS, BLOCK, CAP, NBIN, MAX_PASSES, CHUNK, FXS,
        )  # fmt: skip
        found = tl.full([ROWS], 1, tl.int32)
        fused = tl.zeros([ROWS], tl.int32)
        thr_p = hi
        kept_mp = tl.zeros([ROWS], tl.int64)
    return thr, kept_c, kept_m, found, fused, thr_p, kept_mp


@triton.jit
def _cut_kernel(
    logits_ptr, stride_lm, greedy_ptr, temp_ptr, topk_ptr, topp_ptr,
    pmin_ptr, rmax_ptr, rthr_ptr, rsum_ptr, cand_ptr, fast_ptr, todo_ptr, state_ptr,
    sbr_ptr, sgoal_ptr, sn_ptr, slist_ptr, hdone_ptr,
    num_rows, V, K1, NB,
    ROWS: tl.constexpr, NBP: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
    NBIN: tl.constexpr, MAX_PASSES: tl.constexpr, CHUNK: tl.constexpr, FXS: tl.constexpr,
    CAP_F: tl.constexpr, SAMPLE: tl.constexpr, TRIES: tl.constexpr, LANES: tl.constexpr,
    STAGES: tl.constexpr, FAST_ONLY: tl.constexpr, TODO: tl.constexpr,
    SCREEN: tl.constexpr, KP: tl.constexpr, FUSE_KP: tl.constexpr, SMALL_F: tl.constexpr,
    SAMPLE_K: tl.constexpr, SPLIT: tl.constexpr, BISECT_K: tl.constexpr, BISECT_P: tl.constexpr,
    HIST: tl.constexpr, LOADS: tl.constexpr = 1, GDC: tl.constexpr = False,
):  # fmt: skip
    """A tile of ROWS rows per program; a filtered row gets the top-k cut (the k-th
    largest value), then the top-p cut over the top-k survivors, and its threshold and
    kept mass are written. Other rows are left as the init kernel wrote them.
    FAST_ONLY: _cut_fast's passes only; a row either cut misses is marked in todo, not
    written. TODO: only the rows marked in todo (the launch after a FAST_ONLY one).
    SCREEN: only the rows the screened walk needs (_needs_cut). FUSE_KP: a row with both
    takes its top-p cut from the top-k cut's bracket where that held every survivor
    (_cut_fast), with no cut of its own; the same thresholds and masses. SMALL_F: _cut_fast's
    narrow bracket sort; SAMPLE_K: the top-k cut's sample (SAMPLE: the top-p cut's).
    HIST: not the rows _hist_cut_kernel cut (hdone)."""
    _gdc_enter(GDC)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < num_rows
    missed = tl.zeros([ROWS], tl.int32)
    split = rows < 0  # rows whose top-p bracket the split launches take (SPLIT)
    req = rows // K1
    greedy = tl.load(greedy_ptr + req, mask=rmask, other=1) != 0
    k = tl.load(topk_ptr + req, mask=rmask, other=0)
    p = tl.load(topp_ptr + req, mask=rmask, other=1.0)
    m = tl.load(rmax_ptr + rows, mask=rmask, other=float("-inf"))
    use_k = (k > 0) & (k < V)
    use_p = p < 1.0
    live = rmask & (greedy == 0) & (use_k | use_p) & (m > float("-inf"))
    if TODO:
        live = live & (tl.load(todo_ptr + rows, mask=rmask, other=0) != 0)
    elif SCREEN:
        live = live & _needs_cut(state_ptr, rows, rmask, K1, KP)
    if HIST:
        live = live & (tl.load(hdone_ptr + rows, mask=rmask, other=0) == 0)
    if tl.max(live.to(tl.int32), axis=0) != 0:
        use_k = live & use_k
        use_p = live & use_p
        m = tl.where(live, m, 0.0)
        t = tl.load(temp_ptr + req, mask=live, other=1.0)
        total = tl.load(rsum_ptr + rows, mask=live, other=1.0)
        blocks = tl.arange(0, NBP)
        pmask = live[:, None] & (blocks < NB)[None, :]
        pmin = tl.load(pmin_ptr + rows[:, None] * NB + blocks[None, :], mask=pmask,
                       other=float("inf"))  # fmt: skip
        zmin = tl.min(pmin, axis=1)
        thr = tl.full([ROWS], float("-inf"), tl.float32)
        kept_f = total
        kept_c = tl.zeros([ROWS], tl.int32) + V
        fused = tl.zeros([ROWS], tl.int32)
        thr_pf = thr
        kept_pf = tl.zeros([ROWS], tl.int64)
        if SPLIT > 0:  # noqa: SIM102 (a constexpr branch, then a device one; ROWS is 1)
            split = use_p & ~use_k
            if tl.max(split.to(tl.int32), axis=0) != 0:
                # The top-p cut's set-up below, for a row without top-k; its first
                # try's bracket, left to _split_pass_kernel and _split_close_kernel.
                lo, target = _top_p_bounds(p, kept_f, kept_c, thr, zmin, m, FXS)
                row = tl.sum(rows, axis=0)
                m1 = tl.sum(m, axis=0)
                lo1 = tl.sum(lo, axis=0)
                tm1 = tl.sum(target, axis=0)
                s, ws = _row_sample(logits_ptr + row * stride_lm, V, tl.sum(t, axis=0), m1,
                                    lo1, m1, True, SAMPLE)  # fmt: skip
                b_lo, b_hi = _sorted_bracket(
                    s, ws, lo1, m1, tl.zeros([], tl.float32),
                    tl.sum(total, axis=0), (tm1 * (1.0 / FXS)).to(tl.float32), SAMPLE,
                )  # fmt: skip
                tl.store(sbr_ptr + row * 3, lo1)
                tl.store(sbr_ptr + row * 3 + 1, b_lo)
                tl.store(sbr_ptr + row * 3 + 2, b_hi)
                tl.store(sgoal_ptr + row, tm1)
                tl.store(sn_ptr + row, 0)
                tl.store(slist_ptr + 1 + tl.atomic_add(slist_ptr, 1), row.to(tl.int32))
            use_p = use_p & ~split
        if tl.max(use_k.to(tl.int32), axis=0) != 0:
            # No floor: thr is -inf here.
            thr_k, kept_ck, kept_m, ok, fused, thr_pf, kept_pf = _cut(
                logits_ptr, stride_lm, cand_ptr, fast_ptr, rows, use_k, t, m, V, thr, zmin,
                m, k, tl.zeros([ROWS], tl.float64), total, p, zmin, False, ROWS, BLOCK, CAP,
                NBIN, MAX_PASSES, CHUNK, FXS, CAP_F, SAMPLE_K, TRIES, LANES, STAGES, FAST_ONLY,
                FUSE_KP, SMALL_F, BISECT_K, LOADS,
            )  # fmt: skip
            missed = missed | (ok == 0).to(tl.int32)
            thr = tl.where(use_k, thr_k, thr)
            kept_c = tl.where(use_k, kept_ck, kept_c)
            kept_f = tl.where(use_k, _fx_f32(kept_m, FXS), kept_f)
        fused = use_p & (fused != 0)
        if tl.max(fused.to(tl.int32), axis=0) != 0:  # the top-k cut's bracket gave top-p's
            thr = tl.where(fused, thr_pf, thr)
            kept_f = tl.where(fused, _fx_f32(kept_pf, FXS), kept_f)
            use_p = use_p & ~fused
        if tl.max(use_p.to(tl.int32), axis=0) != 0:
            lo, target = _top_p_bounds(p, kept_f, kept_c, thr, zmin, m, FXS)
            thr_p, _, kept_m, ok, _, _, _ = _cut(
                logits_ptr, stride_lm, cand_ptr, fast_ptr, rows, use_p & (missed == 0), t, m,
                V, thr, lo, m, tl.zeros([ROWS], tl.int32), target, kept_f, p, zmin, True, ROWS,
                BLOCK, CAP, NBIN, MAX_PASSES, CHUNK, FXS, CAP_F, SAMPLE, TRIES, LANES, STAGES,
                FAST_ONLY, False, SMALL_F, BISECT_P, LOADS,
            )  # fmt: skip
            missed = missed | (ok == 0).to(tl.int32)
            thr = tl.where(use_p, thr_p, thr)
            kept_f = tl.where(use_p, _fx_f32(kept_m, FXS), kept_f)
        tl.store(rthr_ptr + rows, thr, mask=live & (missed == 0) & ~split)
        tl.store(rsum_ptr + rows, kept_f, mask=live & (missed == 0) & ~split)
    if FAST_ONLY:
        tl.store(todo_ptr + rows, tl.where(split, _SPLIT_OPEN, missed), mask=rmask)


@triton.jit
def _split_pass_kernel(
    logits_ptr, stride_lm, temp_ptr, rmax_ptr, slist_ptr, sbr_ptr, sn_ptr, smass_ptr, fast_ptr,
    stride_f, V, K1, NSPLIT,
    CHUNK: tl.constexpr, CAP: tl.constexpr, FXS: tl.constexpr, GDC: tl.constexpr = False,
):  # fmt: skip
    """_cut_fast's pass over one CHUNK of each opened row (program (i, chunk) takes the
    rows i, i + grid, ... of the bracket launch's list): the exact mass above the
    bracket's top, written per chunk, and the bracket's values appended to the row's
    scratch at an offset a per-row counter hands out (the first CAP kept; the counter goes
    on counting). The order they land in does not matter: the closing launch sorts (or
    bisects) them. Only opened rows get programs, however few they are."""
    _gdc_enter(GDC)
    c = tl.program_id(1)
    for i in range(tl.program_id(0), tl.load(slist_ptr), tl.num_programs(0)):
        row = tl.load(slist_ptr + 1 + i).to(tl.int64)
        m = tl.load(rmax_ptr + row)
        t = tl.load(temp_ptr + row // K1)
        b_lo = tl.load(sbr_ptr + row * 3 + 1)
        b_hi = tl.load(sbr_ptr + row * 3 + 2)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        z = _row_z(logits_ptr + row * stride_lm + offs, offs < V, t)
        up = z > b_hi  # b_hi >= lo: every such value survives
        tl.store(smass_ptr + row * NSPLIT + c, tl.sum(tl.where(up, _fx(z, m, FXS), 0), axis=0))
        inb = (z >= b_lo) & (z <= b_hi)
        wi = inb.to(tl.int32)
        n = tl.sum(wi, axis=0)
        if n > 0:
            start = tl.atomic_add(sn_ptr + row, n)
            idx = start + tl.cumsum(wi, axis=0) - 1
            tl.store(fast_ptr + row * stride_f + idx, z, mask=inb & (idx < CAP))


@triton.jit
def _split_close_kernel(
    rmax_ptr, rthr_ptr, rsum_ptr, todo_ptr, slist_ptr, sbr_ptr, sgoal_ptr, sn_ptr, smass_ptr,
    fast_ptr, stride_f, NSPLIT,
    NSP: tl.constexpr, CAP: tl.constexpr, FXS: tl.constexpr, SMALL: tl.constexpr,
    BISECT: tl.constexpr, GDC: tl.constexpr = False,
):  # fmt: skip
    """The opened rows after their split pass (program i takes the rows i, i + grid, ...
    of the list): _cut_fast's decision after its first try's pass, on the summed chunks.
    The cut found in the bracket is written (todo 0); a row whose cut lies outside it, or
    whose bracket overflowed the scratch, is left to the narrowing launch (todo 1), which
    finds the same cut over the whole row."""
    _gdc_enter(GDC)
    for i in range(tl.program_id(0), tl.load(slist_ptr), tl.num_programs(0)):
        row = tl.load(slist_ptr + 1 + i).to(tl.int64)
        m = tl.load(rmax_ptr + row)
        lo = tl.load(sbr_ptr + row * 3)
        b_lo = tl.load(sbr_ptr + row * 3 + 1)
        target = tl.load(sgoal_ptr + row)
        n = tl.load(sn_ptr + row)
        cs = tl.arange(0, NSP)
        above_m = tl.sum(tl.load(smass_ptr + row * NSPLIT + cs, mask=cs < NSPLIT, other=0), axis=0)
        ok = tl.zeros([], tl.int32)
        thr = m
        kept_m = tl.zeros([], tl.int64)
        if (above_m.to(tl.float64) < target) & (n <= CAP):
            zi = tl.zeros([], tl.int32)
            zf = tl.zeros([], tl.float32)
            thr, _, kept_m, ok, _, _, _, _, _ = _sized_bracket_cut(
                fast_ptr + row * stride_f, n, zi, above_m, zi, target, m, lo, m, b_lo, zf, zi,
                zi, m, kept_m, zf, zf, True, FXS, False, SMALL, CAP, BISECT,
            )  # fmt: skip
        if ok != 0:
            tl.store(rthr_ptr + row, thr)
            tl.store(rsum_ptr + row, _fx_f32(kept_m, FXS))
        tl.store(todo_ptr + row, 1 - ok)


@triton.jit
def _flip16(s):
    """A negative int32 (sign-extended 16 bits)'s 15 low bits flipped: its own inverse."""
    return s ^ ((s >> 15) & 0x7FFF)


@triton.jit
def _key16(x):
    """A 16-bit float's order key (int32 in [-32768, 32767]): a larger value has a larger
    key, -0 the key just below +0's, and adjacent keys are adjacent values."""
    return _flip16(x.to(tl.int16, bitcast=True).to(tl.int32))


@triton.jit
def _of_key16(key, dtype: tl.constexpr):
    """_key16's inverse (keys in range)."""
    return _flip16(key).to(tl.int16).to(dtype, bitcast=True)


@triton.jit
def _hist_cut_kernel(
    logits_ptr, stride_lm, greedy_ptr, temp_ptr, topk_ptr, topp_ptr, rmax_ptr, rthr_ptr,
    rsum_ptr, state_ptr, hist_ptr, ticket_ptr, hdone_ptr, V, K1,
    KP: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, NBIN: tl.constexpr,
    FXS: tl.constexpr, SCREEN: tl.constexpr, GDC: tl.constexpr = False,
):  # fmt: skip
    """The top-p cut of 16-bit logits without top-k, from counts of equal values
    (RejectionConfig.hist_p). Program (b, c) reads chunk c (SUB columns at a time) of
    each row of request b that needs a cut and counts its values by key distance below a
    key just above the row's max (NBIN bins, one distinct logit each; a last bin counts
    values above that key, which a wrong estimate would leave). Every value in a bin is
    the same z, so a bin's mass is its count times that value's _fx units: exactly what
    the cut's passes sum value by value. The request's last program for a row (a ticket
    a row) runs the bins' running mass from the top: the first bin reaching the goal is
    the cut and its running mass the kept mass, bit for bit the bracket's (same
    definition, same integer sums). It writes them and marks the row done (hdone), and
    puts the bins and the ticket back to zero. A row whose cut lies past the last bin,
    or whose next bin holds the same z (a tie across keys: -0 and +0, or two logits one
    z after the division by T), or that had a value above the top key, is left to the
    bracket launch (hdone 0)."""
    _gdc_enter(GDC)
    req = tl.program_id(0)
    c = tl.program_id(1)
    jj = tl.arange(0, KP)
    rows = req.to(tl.int64) * K1 + jj
    rmask = jj < K1
    if c == 0:
        tl.store(hdone_ptr + rows, tl.zeros([KP], tl.int32), mask=rmask)
    greedy = tl.load(greedy_ptr + req)
    k = tl.load(topk_ptr + req)
    p = tl.load(topp_ptr + req)
    if (greedy == 0) & (p < 1.0) & ((k <= 0) | (k >= V)):
        m = tl.load(rmax_ptr + rows, mask=rmask, other=float("-inf"))
        need = rmask & (m > float("-inf")) & (m < float("inf"))
        if SCREEN:
            need = need & _needs_cut(state_ptr, rows, rmask, K1, KP)
        t = tl.load(temp_ptr + req)
        t1 = t == 1.0
        sub = tl.arange(0, SUB)
        bins = tl.arange(0, NBIN)
        dtype = logits_ptr.dtype.element_ty
        for j in range(K1):
            if tl.sum(tl.where(jj == j, need.to(tl.int32), 0), axis=0) != 0:
                row = req.to(tl.int64) * K1 + j
                mj = tl.load(rmax_ptr + row)
                # m * T rounds to the max's logit (or next to it): two keys of margin
                top = _key16((mj * t).to(dtype)) + 2
                hrow = hist_ptr + row * (NBIN + 1)
                high = tl.full([SUB], -32768, tl.int32)  # each lane's largest key
                for c0 in tl.range(0, CHUNK, SUB):
                    cols = c * CHUNK + c0 + sub
                    cmask = cols < V
                    x = tl.load(logits_ptr + row * stride_lm + cols, mask=cmask,
                                other=float("-inf"))  # fmt: skip
                    key = _key16(x)
                    high = tl.maximum(high, key)
                    d = top - key  # in the bins where 0 <= d < NBIN (one unsigned compare)
                    _scatter_count(hrow, d, cmask & (d.to(tl.uint32) < NBIN))
                if tl.max(high, axis=0) > top:
                    tl.atomic_add(hrow + NBIN, 1, sem="relaxed")
                # every thread's counts before the release of the ticket; the last
                # program's acquire makes all of them visible
                tl.debug_barrier()
                tk = tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel")
                if tk == tl.num_programs(1) - 1:
                    tl.store(ticket_ptr + row, 0)
                    cnt = tl.load(hrow + bins, cache_modifier=".cg")
                    over = tl.load(hrow + NBIN, cache_modifier=".cg")
                    tl.store(hrow + bins, tl.zeros([NBIN], tl.int32))
                    tl.store(hrow + NBIN, 0)
                    kb = top - bins
                    valid = (kb >= -32768) & (cnt > 0)
                    zb = _z_of(_of_key16(tl.where(kb >= -32768, kb, 0), dtype), t, t1)
                    mass = tl.where(valid, cnt.to(tl.int64) * _fx(zb, mj, FXS), 0)
                    run = tl.cumsum(mass, axis=0)
                    goal = _top_p_goal(p, tl.load(rsum_ptr + row), FXS)
                    at = tl.min(tl.where(run.to(tl.float64) >= goal, bins, NBIN), axis=0)
                    thr = tl.max(tl.where(bins == at, zb, float("-inf")), axis=0)
                    after = tl.max(tl.where(bins == at + 1, zb, float("-inf")), axis=0)
                    kept = tl.sum(tl.where(bins == at, run, 0), axis=0)
                    if (at < NBIN - 1) & (over == 0) & (after != thr):
                        tl.store(rthr_ptr + row, thr)
                        tl.store(rsum_ptr + row, _fx_f32(kept, FXS))
                        tl.store(hdone_ptr + row, 1)


# ----------------------------------------------------------------------------- the walk


@triton.jit
def _walk(
    req, rmask, drafts_ptr, stride_db, logits_ptr, stride_lm, q_ptr, stride_qb, stride_qk,
    greedy, t, seed, pos, rmax_ptr, rthr_ptr, rsum_ptr, pmax_ptr, parg_ptr, state_ptr, K, V, NB,
    KP: tl.constexpr, NBP: tl.constexpr, SAMPLED: tl.constexpr, ACCEPT_MUL: tl.constexpr,
    SCREEN: tl.constexpr,
):  # fmt: skip
    """Drafts [R, KP] (-1 past K), k, r (first rejected position, k if none) per
    request, and each greedy request's row argmaxes [R, KP]. Every decision of a request
    is independent of the others, so the walk is a parallel test of all K drafts
    followed by a min, not a loop."""
    j = tl.arange(0, KP)
    d, k = _request_drafts(req, rmask, drafts_ptr, stride_db, K, KP)
    present = j[None, :] < k[:, None]
    in_vocab = (d >= 0) & (d < V)
    live = present & in_vocab  # ids outside the vocabulary are read nowhere, never accepted
    dc = tl.where(in_vocab, d, 0)
    row = req[:, None] * (K + 1) + j[None, :]
    # Every row's argmax (rows 0..K: the bonus row's too, for _emit), its block
    # maxima and their indices read together, so no load waits on another.
    blocks = tl.arange(0, NBP)
    pptr = row[:, :, None] * NB + blocks[None, None, :]
    rows_ok = (rmask & greedy)[:, None] & (j <= K)[None, :]
    pmask = rows_ok[:, :, None] & (blocks < NB)[None, None, :]
    pm = tl.load(pmax_ptr + pptr, mask=pmask, other=float("-inf"))
    pa = tl.load(parg_ptr + pptr, mask=pmask, other=0)
    best = tl.argmax(pm, axis=2, tie_break_left=True)  # first block: first index
    amx = tl.sum(tl.where(blocks[None, None, :] == best[:, :, None], pa, 0), axis=2)
    amx = amx.to(tl.int64)
    acc = amx == d
    if SAMPLED:
        x = tl.load(logits_ptr + row * stride_lm + dc, mask=live, other=0.0).to(tl.float32)
        z = tl.math.div_rn(x, t[:, None])
        m = tl.load(rmax_ptr + row, mask=live, other=0.0)
        thr = tl.load(rthr_ptr + row, mask=live, other=0.0)
        tot = tl.load(rsum_ptr + row, mask=live, other=1.0)
        px = _div_nonneg(tl.where(z >= thr, tl.exp(z - m), 0.0), tot)
        qptrs = q_ptr + req[:, None] * stride_qb + j[None, :] * stride_qk + dc
        qx = tl.load(qptrs, mask=live, other=1.0)
        h = _stream_key(seed[:, None], pos[:, None] + j[None, :], ACCEPT_MUL)
        u = _uniform(h, tl.zeros([req.shape[0], KP], tl.uint64))
        # min(1, p/q) > u; p >= q accepts outright, p == 0 never.
        acc_s = (px > 0.0) & ((px >= qx) | (u * qx < px))
        if SCREEN:  # rows decided without their cut (which may not have run)
            st = tl.load(state_ptr + row, mask=live, other=_EXACT)
            acc_s = tl.where(st == _SURE_ACCEPT, True, tl.where(st == _SURE_REJECT, False, acc_s))
        acc = tl.where(greedy[:, None], acc, acc_s)
    acc = acc & live
    r = tl.min(tl.where(present & (acc == 0), j[None, :], k[:, None]), axis=1)
    return d, k, r, amx


@triton.jit
def _load_request(req, rmask, greedy_ptr, temp_ptr, seed_ptr, pos_ptr, SAMPLED: tl.constexpr):
    pos = tl.load(pos_ptr + req, mask=rmask, other=-1)
    if SAMPLED:
        greedy = tl.load(greedy_ptr + req, mask=rmask, other=1) != 0
        t = tl.where(greedy, 1.0, tl.load(temp_ptr + req, mask=rmask, other=1.0))
        seed = tl.load(seed_ptr + req, mask=rmask, other=0)
    else:
        greedy = rmask | True
        t = tl.full(req.shape, 1.0, tl.float32)
        seed = tl.zeros(req.shape, tl.int64)
    return greedy, t, seed, pos


# ----------------------------------------------------------------------- 4. the walk


@triton.jit
def _walk_kernel(
    logits_ptr, stride_lm, drafts_ptr, stride_db, q_ptr, stride_qb, stride_qk,
    greedy_ptr, temp_ptr, seed_ptr, pos_ptr, rmax_ptr, rthr_ptr, rsum_ptr, pmax_ptr, parg_ptr,
    state_ptr, walk_ptr, B, K, V, NB,
    ROWS: tl.constexpr, KP: tl.constexpr, NBP: tl.constexpr, ACCEPT_MUL: tl.constexpr,
    SCREEN: tl.constexpr,
    GDC: tl.constexpr = False,
):  # fmt: skip
    """Each request's walk, once: k (drafts proposed) and r (first rejected position, k
    if none) into walk [B, 2]; a padded request gets 0 and 0. SCREEN: rows the screen
    decided take its decision."""
    _gdc_enter(GDC)
    req = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = req < B
    greedy, t, seed, pos = _load_request(req, rmask, greedy_ptr, temp_ptr, seed_ptr, pos_ptr,
                                         True)  # fmt: skip
    real = rmask & (pos >= 0)
    _, k, r, _ = _walk(
        req, real, drafts_ptr, stride_db, logits_ptr, stride_lm, q_ptr, stride_qb, stride_qk,
        greedy, t, seed, pos, rmax_ptr, rthr_ptr, rsum_ptr, pmax_ptr, parg_ptr, state_ptr, K,
        V, NB, KP, NBP, True, ACCEPT_MUL, SCREEN,
    )  # fmt: skip
    tl.store(walk_ptr + req * 2, tl.where(real, k, 0).to(tl.int32), mask=rmask)
    tl.store(walk_ptr + req * 2 + 1, tl.where(real, r, 0).to(tl.int32), mask=rmask)


# ---------------------------------------------------------------- 5. resample and emit


@triton.jit
def _race_weight(rowp, qrowp, cols, mask, t, t1, thr, m, tot, residual):
    """A race's weights at columns cols ([ROWS, N] or [1, N]; mask): max(p - q, 0) for a
    residual row, p for a bonus row, with p = exp(z - max) / kept mass where z >= the
    threshold, else 0."""
    z = _load_z(rowp, cols, mask, t, t1)
    p = _div_nonneg(tl.where(z >= thr[:, None], tl.exp(z - m[:, None]), 0.0), tot[:, None])
    qv = tl.load(qrowp[:, None] + cols, mask=mask & residual[:, None], other=0.0)
    return tl.where(residual[:, None], tl.maximum(p - qv, 0.0), p)


@triton.jit
def _race_whole(rowp, qrowp, h, race, blk, t, t1, thr, m, tot, residual, V,
                ROWS: tl.constexpr, BLOCK_V: tl.constexpr, SUB: tl.constexpr):  # fmt: skip
    """The exponential race of a tile's requests over all of vocabulary block blk, SUB
    columns at a time (_race_weight's weights): each request's best weight / E and its
    first column."""
    lane = tl.arange(0, SUB)
    best = tl.full([ROWS, SUB], -1.0, tl.float32)
    where = tl.zeros([ROWS, SUB], tl.int32)
    for c in range(0, BLOCK_V, SUB):
        offs = blk * BLOCK_V + c + lane
        mask = race[:, None] & (offs < V)[None, :]
        w = _race_weight(rowp, qrowp, offs[None, :], mask, t, t1, thr, m, tot, residual)
        draw = tl.max(w, axis=1) > 0.0
        if tl.max(draw.to(tl.int32), axis=0) != 0:
            ratio = _div_nonneg(w, _exponential(_uniform(h, offs.to(tl.uint64)[None, :])))
            ratio = tl.where(mask & draw[:, None], ratio, -1.0)
            up = ratio > best  # strict: a lane keeps its first index of a tie
            best = tl.where(up, ratio, best)
            where = tl.where(up, offs[None, :], where)
    return _first_max(best, where)


@triton.jit
def _race_packed(rowp, qrowp, h, race, blk, t, t1, thr, m, tot, residual, V, listp,
                 ROWS: tl.constexpr, BLOCK_V: tl.constexpr, SUB: tl.constexpr,
                 PACK: tl.constexpr, CH: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """_race_whole's race, drawn only where a weight can be positive: a first read of
    the block lists each request's kept columns (z >= the threshold, in column order, at
    most PACK at listp [ROWS]), and the draws (a keyed uniform, its exponential and a
    division: most of a column's instructions) run over the list, CH entries at a time.
    The list pass's loads are pipelined STAGES deep (RejectionConfig.stages_r). A tile
    with an unfiltered request, or a list past PACK, takes _race_whole. The same
    winner wherever the block's best weight / E is positive; where it is not, the
    request's token does not come from this block in either form."""
    lane = tl.arange(0, SUB)
    n = tl.zeros([ROWS], tl.int32)
    unfiltered = tl.max((race & (thr == float("-inf"))).to(tl.int32), axis=0) != 0
    if not unfiltered:
        for c in tl.range(0, BLOCK_V, SUB, num_stages=STAGES):
            offs = blk * BLOCK_V + c + lane
            mask = race[:, None] & (offs < V)[None, :]
            # z without _z_of's -0 fold: -0 and +0 compare alike
            x = tl.load(rowp[:, None] + offs[None, :], mask=mask, other=float("-inf"))
            z = x.to(tl.float32)
            if not t1:
                z = tl.math.div_rn(z, t[:, None])
            keep = (mask & (z >= thr[:, None])).to(tl.int32)
            at = n[:, None] + tl.cumsum(keep, axis=1) - keep  # the column's list slot
            _scatter_store(listp[:, None] + at, offs[None, :] + tl.zeros_like(at),
                           (keep != 0) & (at < PACK))  # fmt: skip
            n += tl.sum(keep, axis=1)
    nmax = tl.max(n, axis=0)
    if unfiltered or nmax > PACK:
        bmax, barg = _race_whole(
            rowp, qrowp, h, race, blk, t, t1, thr, m, tot, residual, V, ROWS, BLOCK_V, SUB
        )
    else:
        tl.debug_barrier()  # the list's stores before any thread reads them
        best = tl.full([ROWS, CH], -1.0, tl.float32)
        where = tl.zeros([ROWS, CH], tl.int32)
        for c in range(0, nmax, CH):
            j = c + tl.arange(0, CH)
            jm = race[:, None] & (j[None, :] < n[:, None])
            col = tl.load(listp[:, None] + j[None, :], mask=jm, other=0)
            w = _race_weight(rowp, qrowp, col, jm, t, t1, thr, m, tot, residual)
            ratio = _div_nonneg(w, _exponential(_uniform(h, col.to(tl.uint64))))
            ratio = tl.where(jm & (w > 0.0), ratio, -1.0)
            up = ratio > best  # strict: a lane's entries rise in column order
            best = tl.where(up, ratio, best)
            where = tl.where(up, col, where)
        bmax, barg = _first_max(best, where)
    return bmax, barg


@triton.jit
def _resample_kernel(
    logits_ptr, stride_lm, drafts_ptr, stride_db, q_ptr, stride_qb, stride_qk,
    greedy_ptr, temp_ptr, seed_ptr, pos_ptr, rmax_ptr, rthr_ptr, rsum_ptr,
    pmax_ptr, parg_ptr, walk_ptr, rval_ptr, ridx_ptr, list_ptr, done_ptr,
    tokens_ptr, stride_tb, nacc_ptr, nemit_ptr, cprop_ptr, cacc_ptr,
    B, K, V, NB, NB2,
    ROWS: tl.constexpr, KP: tl.constexpr, NBP: tl.constexpr, NB2P: tl.constexpr,
    BLOCK_V: tl.constexpr, SUB: tl.constexpr, RESIDUAL_MUL: tl.constexpr,
    BONUS_MUL: tl.constexpr, PACK: tl.constexpr = 0, CH: tl.constexpr = 1,
    STAGES: tl.constexpr = 1, GDC: tl.constexpr = False,
):  # fmt: skip
    """Program (i, blk): the exponential races of a tile of ROWS requests over
    vocabulary block blk of each one's residual max(p_r - q_r, 0) (or of p_k for the
    bonus), SUB columns at a time; a request whose slice weights are all zero (cut by
    top-k / top-p, or p <= q) draws nothing there, and a slice with no weight in the
    whole tile is skipped. Each request has its own ticket (as in the greedy kernel):
    the last of its NB2 programs writes its tokens, counts and counters, for every
    request of the tile it was last for. k and r come from the walk launch. PACK > 0
    (RejectionConfig.pack_r): the draws run over a list of the block's kept columns
    (_race_packed), in list_ptr's [B, NB2, PACK] slots."""
    _gdc_enter(GDC)
    req = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    blk = tl.program_id(1)
    rmask = req < B
    pos = tl.load(pos_ptr + req, mask=rmask, other=-1)
    greedy = tl.load(greedy_ptr + req, mask=rmask, other=1) != 0
    race = rmask & (greedy == 0) & (pos >= 0)  # padded and greedy requests need no race
    k = tl.load(walk_ptr + req * 2, mask=rmask, other=0)
    r = tl.load(walk_ptr + req * 2 + 1, mask=rmask, other=0)
    if tl.max(race.to(tl.int32), axis=0) != 0:
        t = tl.load(temp_ptr + req, mask=race, other=1.0)
        seed = tl.load(seed_ptr + req, mask=race, other=0)
        row = req * (K + 1) + r
        m = tl.load(rmax_ptr + row, mask=race, other=0.0)
        thr = tl.load(rthr_ptr + row, mask=race, other=0.0)
        tot = tl.load(rsum_ptr + row, mask=race, other=1.0)
        residual = r < k
        qrow = tl.minimum(r, K - 1)  # a bonus row has no q row; nothing is read for it
        h = _stream_key(seed, pos + r, tl.where(residual, RESIDUAL_MUL, BONUS_MUL))[:, None]
        t1 = (tl.min(t, axis=0) == 1.0) & (tl.max(t, axis=0) == 1.0)  # x / 1 == x: no division
        rowp = logits_ptr + row * stride_lm
        qrowp = q_ptr + req * stride_qb + qrow * stride_qk
        if PACK > 0:
            bmax, barg = _race_packed(
                rowp, qrowp, h, race, blk, t, t1, thr, m, tot, residual, V,
                list_ptr + (req * NB2 + blk) * PACK, ROWS, BLOCK_V, SUB, PACK, CH, STAGES,
            )  # fmt: skip
        else:
            bmax, barg = _race_whole(
                rowp, qrowp, h, race, blk, t, t1, thr, m, tot, residual, V, ROWS, BLOCK_V, SUB
            )
        tl.store(rval_ptr + req * NB2 + blk, bmax, mask=race)
        tl.store(ridx_ptr + req * NB2 + blk, barg, mask=race)
    # A request's ticket may be taken by another thread than the one that stored its
    # winner: the barrier puts every store of the tile before the tickets' release.
    tl.debug_barrier()
    ticket = tl.atomic_add(done_ptr + req, tl.full([ROWS], 1, tl.int32), mask=rmask, sem="acq_rel")
    last = rmask & (ticket == NB2 - 1)
    if tl.max(last.to(tl.int32), axis=0) != 0:
        tl.store(done_ptr + req, tl.zeros([ROWS], tl.int32), mask=last)
        jj = tl.arange(0, KP)
        real = last & (pos >= 0)
        dm = real[:, None] & (jj < K)[None, :]
        d = tl.load(drafts_ptr + req[:, None] * stride_db + jj[None, :], mask=dm, other=-1)
        _emit(
            req, last, real, greedy, d, k, r, k, pmax_ptr, parg_ptr, rval_ptr, ridx_ptr,
            tokens_ptr, stride_tb, nacc_ptr, nemit_ptr, cprop_ptr, cacc_ptr, K, NB, NB2, KP,
            NBP, NB2P, True, False,
        )  # fmt: skip


@triton.jit
def _finish(
    req, rmask, drafts_ptr, stride_db, pos_ptr, pmax_ptr, parg_ptr,
    tokens_ptr, stride_tb, nacc_ptr, nemit_ptr, cprop_ptr, cacc_ptr,
    K, V, NB, KP: tl.constexpr, NBP: tl.constexpr,
):  # fmt: skip
    """Greedy requests `req` (rmask): the walk over their drafts, then the tokens,
    counts and counters written."""
    greedy, t, seed, pos = _load_request(req, rmask, pos_ptr, pos_ptr, pos_ptr, pos_ptr, False)
    real = rmask & (pos >= 0)
    # The walk reads under rmask, not real, so that its loads need not wait for pos: a
    # padded request's drafts and partials are in bounds, and _emit writes it by real.
    d, k, r, amx = _walk(
        req, rmask, drafts_ptr, stride_db, pmax_ptr, 0, pmax_ptr, 0, 0, greedy, t, seed, pos,
        pmax_ptr, pmax_ptr, pmax_ptr, pmax_ptr, parg_ptr, parg_ptr, K, V, NB, KP, NBP, False, 0,
        False,
    )  # fmt: skip
    _emit(
        req, rmask, real, greedy, d, k, r, amx, pmax_ptr, parg_ptr, pmax_ptr, parg_ptr,
        tokens_ptr, stride_tb, nacc_ptr, nemit_ptr, cprop_ptr, cacc_ptr, K, NB, 1, KP, NBP, 1,
        False, True,
    )  # fmt: skip


@triton.jit
def _emit(
    req, rmask, real, greedy, d, k, r, amx, pmax_ptr, parg_ptr, rval_ptr, ridx_ptr,
    tokens_ptr, stride_tb, nacc_ptr, nemit_ptr, cprop_ptr, cacc_ptr, K, NB, NB2,
    KP: tl.constexpr, NBP: tl.constexpr, NB2P: tl.constexpr, SAMPLED: tl.constexpr,
    HAVE_AMX: tl.constexpr,
):  # fmt: skip
    """Requests `req` (rmask; real: not padded) with drafts d [R, KP], k and r: the
    tokens (accepted drafts, then the correction or bonus token, then -1), counts and
    per-position counters written. HAVE_AMX: amx [R, KP] holds every row's argmax
    (the walk's); else row r's is read from the partials (maxima and indices in one
    round trip)."""
    # The target's argmax of row r (greedy token; fallback for a degenerate residual).
    jj = tl.arange(0, KP)  # KP >= K + 1: one tile holds the whole token row
    if HAVE_AMX:
        token = tl.sum(tl.where(jj[None, :] == r[:, None], amx, 0), axis=1)
    else:
        row = req * (K + 1) + r
        blocks = tl.arange(0, NBP)
        pptr = row[:, None] * NB + blocks[None, :]
        pmask = real[:, None] & (blocks < NB)[None, :]
        pm = tl.load(pmax_ptr + pptr, mask=pmask, other=float("-inf"))
        pa = tl.load(parg_ptr + pptr, mask=pmask, other=0)
        best = tl.argmax(pm, axis=1, tie_break_left=True)
        token = tl.sum(tl.where(blocks[None, :] == best[:, None], pa, 0), axis=1).to(tl.int64)
    if SAMPLED:
        b2 = tl.arange(0, NB2P)
        smask = (real & (greedy == 0))[:, None] & (b2 < NB2)[None, :]
        rv = tl.load(rval_ptr + req[:, None] * NB2 + b2[None, :], mask=smask, other=-1.0)
        rbest, rblk = tl.max(rv, axis=1, return_indices=True, return_indices_tie_break_left=True)
        won = tl.load(ridx_ptr + req * NB2 + rblk, mask=real & (greedy == 0), other=0)
        # max(p - q, 0) is all zero only if p <= q everywhere after rounding (~never):
        # the argmax of p stands in for the undefined residual.
        token = tl.where((greedy == 0) & (rbest > 0.0), won.to(tl.int64), token)
    out = tl.where(jj[None, :] < r[:, None], d, -1)
    out = tl.where(jj[None, :] == r[:, None], token[:, None], out)
    out = tl.where(real[:, None], out, -1)
    tptr = tokens_ptr + req[:, None] * stride_tb + jj[None, :]
    tl.store(tptr, out, mask=rmask[:, None] & (jj <= K)[None, :])
    tl.store(nacc_ptr + req, tl.where(real, r, 0).to(tl.int32), mask=rmask)
    tl.store(nemit_ptr + req, tl.where(real, r + 1, 0).to(tl.int32), mask=rmask)
    # Counters: one atomic per position per program (column sums over the tile).
    prop = tl.sum((real[:, None] & (jj[None, :] < k[:, None])).to(tl.int64), axis=0)
    accd = tl.sum((real[:, None] & (jj[None, :] < r[:, None])).to(tl.int64), axis=0)
    cm = jj < K
    tl.atomic_add(cprop_ptr + jj, prop, mask=cm & (prop > 0))
    tl.atomic_add(cacc_ptr + jj, accd, mask=cm & (accd > 0))


@triton.jit
def _greedy_kernel(
    logits_ptr, stride_lm, drafts_ptr, stride_db, pos_ptr, pmax_ptr, parg_ptr, done_ptr,
    tokens_ptr, stride_tb, nacc_ptr, nemit_ptr, cprop_ptr, cacc_ptr,
    K, V, NB,
    KP: tl.constexpr, BLOCK_V: tl.constexpr, SUB: tl.constexpr, NBP: tl.constexpr,
    STAGES: tl.constexpr, PER_ROW: tl.constexpr, LAZY: tl.constexpr = False,
    GDC: tl.constexpr = False,
):  # fmt: skip
    """Every request greedy, in one launch. A program takes the argmax over vocabulary
    block blk of one target row (PER_ROW: program (blk, row)) or of request b's K + 1
    rows (program (b, blk)); the last of the request's programs to finish (a ticket from
    an acq_rel atomic, which also makes the others' partials visible to it) walks the
    request and writes its tokens, then resets the ticket for the next call. The block
    is read SUB columns at a time into per-lane running maxima (few registers, loads
    pipelined across iterations), reduced once at the end: the largest value, and the
    smallest index holding it. The partials are laid out [rows, NB] in the workspace
    (NB <= its columns). One row per program keeps a row's programs adjacent in launch
    order and loads no padding rows (KP > K + 1). LAZY (RejectionConfig.lazy_g): the
    slice is taken as groups of 8 adjacent columns, and a group position keeps its max
    and the slice that last raised it, its first column found after the loop
    (_lazy_first_argmax), as the partials' LAZY does: the same max and argmax."""
    _gdc_enter(GDC)
    if PER_ROW:
        blk = tl.program_id(0)
        rows = tl.program_id(1).to(tl.int64) + tl.arange(0, 1)
        rmask = rows >= 0
        req = tl.program_id(1).to(tl.int64) // (K + 1)
        programs = (K + 1) * NB
    else:
        req = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        j = tl.arange(0, KP)
        rows = req * (K + 1) + j
        rmask = j < K + 1
        programs = NB
    lo = blk * BLOCK_V
    if LAZY:
        G: tl.constexpr = SUB // 8
        col = tl.arange(0, G)[:, None] * 8 + tl.arange(0, 8)[None, :]  # [G, 8]
        rowp = logits_ptr + rows * stride_lm
        best = tl.full([rows.shape[0], G], float("-inf"), tl.float32)
        sl = tl.zeros([rows.shape[0], G], tl.int32)
        for c in tl.range(0, BLOCK_V, SUB, num_stages=STAGES):
            offs = (lo + c + col)[None, :, :]
            mask = rmask[:, None, None] & (offs < V)
            z = tl.load(rowp[:, None, None] + offs, mask=mask, other=float("-inf"))
            gmax = tl.max(z.to(tl.float32), axis=2)
            sl = tl.where(gmax > best, c, sl)  # strict: the first slice holding the max
            best = tl.maximum(best, gmax)
        t = tl.full([rows.shape[0]], 1.0, tl.float32)
        where = _lazy_first_argmax(rowp, rmask, best, sl, lo, col, t, True, V)
    else:
        base = logits_ptr + rows[:, None] * stride_lm
        lane = tl.arange(0, SUB)
        best = tl.full([rows.shape[0], SUB], float("-inf"), tl.float32)
        where = tl.zeros([rows.shape[0], SUB], tl.int32) + (lo + lane)[None, :]
        for c in tl.range(0, BLOCK_V, SUB, num_stages=STAGES):
            offs = lo + c + lane
            mask = rmask[:, None] & (offs < V)[None, :]
            z = tl.load(base + offs[None, :], mask=mask, other=float("-inf")).to(tl.float32)
            up = z > best  # strict: a lane keeps its first index of a tie
            best = tl.where(up, z, best)
            where = tl.where(up, offs[None, :], where)
    bmax, barg = _first_max(best, where)
    out = rows * NB + blk
    tl.store(pmax_ptr + out, bmax, mask=rmask)
    tl.store(parg_ptr + out, barg, mask=rmask)
    ticket = tl.atomic_add(done_ptr + req, 1, sem="acq_rel")
    if ticket == programs - 1:
        tl.store(done_ptr + req, 0)
        one = req + tl.arange(0, 1)
        _finish(
            one, one >= 0, drafts_ptr, stride_db, pos_ptr, pmax_ptr, parg_ptr, tokens_ptr,
            stride_tb, nacc_ptr, nemit_ptr, cprop_ptr, cacc_ptr, K, V, NB, KP, NBP,
        )  # fmt: skip


# -------------------------------------------------------------------------- launcher


@dataclass(frozen=True)
class RejectionConfig:
    """Tile sizes (powers of two; block_v and block_g may be multiples of their slices
    instead). block_v / rows_p: partials tile, read sub_v
    columns a loop iteration by warps_v warps (None: the whole tile at once, warps by its
    size); block_t: the cut kernel's chunk of a row; cap: candidates resolved pairwise;
    nbin: histogram bins per cut pass; block_r / sub_r: a race program's vocabulary block
    and the slice it draws at once; rows_w: requests per walk program; rows_t: rows per
    cut program; rows_r: requests per race program."""

    block_v: int
    rows_p: int
    block_t: int
    cap: int
    nbin: int
    block_r: int
    sub_r: int
    rows_w: int
    sub_v: int | None = None  # the partials' columns a loop iteration (None: block_v)
    warps_v: int | None = None  # the partials' warps (None: 8 from 4096-element tiles, else 4)
    # the all-greedy launch's vocabulary tile (None: block_v); a power of two, or a
    # multiple of sub_g (a loop bound only: 24576 takes V 49152 in two blocks)
    block_g: int | None = None
    sub_g: int | None = None  # columns it reads per loop iteration (None: the whole tile)
    warps_g: int | None = None  # its warps (None: by tile size)
    stages_g: int = 1  # its loop's pipelining depth
    chunk_t: int = 8  # candidates per slice of the cut's pairwise resolution (registers)
    rows_t: int = 1
    rows_r: int = 1
    cap_f: int = 0  # one-row cut programs: the one-pass bracket's scratch (0: no such pass)
    sample_f: int = 2048  # and the strided sample that places the bracket
    tries_f: int = 3  # brackets tried before the narrowing passes take over
    warps_f: int = 16  # the bracket launch's warps (8: ~230 registers a thread, 16: ~126)
    lanes_f: int = 8  # slots a lane keeps for the bracket's values (at least 1)
    stages_f: int = 1  # the bracket pass's load pipelining depth (lane slots only)
    # Columns a lane of the bracket pass has in flight (1 or 16). 1: one chunk an
    # iteration, its load waited out before its lane-slot stores (ncu, H100, stop 68: ~29%
    # of the cut launch's stall samples in the pass loop). 16: two chunks of 8 adjacent
    # columns a lane an iteration, one 16-byte load each, both loaded before the first
    # store. The same cut, bit for bit (CPU tests; GPU at V 49152); the lanes' slots hold
    # other columns, so a bracket may overflow a lane where one column a lane did not (a
    # miss the next try takes). On at large vocabularies: H100, B 64, K 5, V 49152, top-p
    # 0.9, four one-column chunks (stop 69's form) took the bracket launch 54.1 -> 46.6 µs;
    # 16 columns with interp_f, sample_f 1024 and cap_f 4096 the sampler 96.9 -> 94.6
    # (stop 70; the four-chunk form is gone).
    loads_f: int = 1
    row_g: bool = False  # the all-greedy launch: one target row per program (else a
    # request's K + 1 rows); used while B * (K + 1) <= 65535 (the grid's second dimension)
    screen: bool = True  # screen the drafts before the cuts: only the rows whose
    # decision needs its exact cut get one (module docstring, "Screening")
    # A row with top-k and top-p takes its top-p cut from the top-k cut's one-pass bracket
    # where that bracket held every top-k survivor (the usual case for a small k): no
    # second sample, pass and sort. The same thresholds and masses, bit for bit (CPU
    # tests). H200, B 64, K 5, top-k 50 + top-p 0.9: cut 116 -> 90 µs (stop 49).
    fuse_kp: bool = True
    # A bracket of at most small_f values (0: off; a power of two below cap_f) is sorted
    # in a small_f-wide tile instead of cap_f: top-k brackets hold a few hundred values,
    # and the sort's cost grows with its width (sm_90: 1416 instructions and 73 barriers
    # at 2048 values, 752 and 57 at 1024). The same answer, bit for bit (CPU tests). Off
    # until timed on a GPU (written at stop 49, when none was left).
    small_f: int = 0
    # The top-k cut's sample (0: sample_f). A count near the row's top needs few sample
    # values above it: at k 50 of 49152 a 512-value sample still brackets the cut within
    # ~500 row values (i* ~0.5, margin ~4.4 sample values of 96), and sorts a quarter of
    # the values. Off until timed on a GPU (stop 49).
    sample_k: int = 0
    # The top-p cut of a row without top-k split over programs of split_f columns each (0:
    # off; one-row cut programs only): the bracket launch places the bracket from its
    # sample and lists the row, _split_pass_kernel's programs sum the mass above it and
    # gather its values chunk by chunk, and _split_close_kernel sorts them; a miss goes to
    # the narrowing launch. The same thresholds and masses, bit for bit (CPU tests; GPU at
    # V 203). H100, B 64, K 5, V 49152, top-p 0.9 (stop 63): 116 µs at split_f 2048 and
    # rows_s 128 against 122, the cut's launches 18.7 + 18.9 + 13.7 + 1.2 against 55.9 +
    # 2.7: the two 2048-value sorts (sample, bracket) are most of what is left. Off: one
    # sample, and not GPU-checked at large vocabularies.
    split_f: int = 0
    rows_s: int = 128  # opened rows the split launches take at once (a loop over the rest)
    # The bracket's cut found by a bisection over its values' keys (_bisect_keys: at most
    # 32 masked sums over the values in registers) instead of a sort and a running sum
    # (a 2048-value tl.sort is ~13 µs of a program's time on the H100, stop 63's split
    # close launch); the same cut, bit for bit (CPU tests; GPU at V 49152). Not where the
    # top-k cut's bracket also gives the top-p cut (fuse_kp), which needs the order.
    # choose_rejection_config turns it on at large vocabularies: H100, B 64, K 5, V 49152,
    # top-p 0.9, the bracket launch 54.3 -> 51.3 µs alone, 46.6 -> 40.3 with four-chunk loads;
    # the whole sampler 112 -> 101 µs with both (stop 69).
    bisect_f: bool = False
    # The bisection's point placed where the measure, linear in the key between the ends,
    # crosses the target, its ends moved on to the nearest values (_bisect_keys, INTERP):
    # gaussian brackets take ~3.4 steps instead of ~20.6 (a PyTorch model, stop 69), at a
    # (sum, min, max) reduction a step. The same cut, bit for bit (CPU tests; GPU at V
    # 49152). On at large vocabularies (choose_rejection_config).
    interp_f: bool = False
    # The partials read their block once (_partials_one_pass: per-lane running max and sums
    # rescaled as the max rises, one exp a group of 8 columns) instead of twice (the max,
    # then the sums from L1 / L2). The same max, argmax, smallest value and count; the
    # sums to float32 rounding (CPU tests). choose_rejection_config turns it on at large
    # vocabularies: H100, B 64, K 5, V 49152, top-p 0.9, the partials launch 34.2 ->
    # 27.7 µs, the whole sampler 121.66 -> 112.61 (stop 68).
    one_pass_v: bool = False
    # The one-pass partials' exps flush subnormal results to 0 (_exp_ftz: ex2.approx.ftz,
    # three instructions an element fewer than tl.exp's range handling; offline sm_90,
    # stop 69: the loop's ~24 executed instructions an element, issue-bound at ~15 µs of
    # the launch's 27.7). The same max, argmax, smallest value and count; sums that differ
    # only where a term was subnormal (CPU tests; GPU bit for bit at V 49152). On at
    # large vocabularies: H100, B 64, K 5, V 49152, top-p 0.9, the partials launch 27.7
    # -> 26.3 µs (stop 70).
    ftz_v: bool = False
    # The one-pass partials' argmax and smallest finite value found after the loop
    # (_partials_one_pass, LAZY): a group of 8 columns keeps the slice that last raised
    # its max, not the column, and the column is found once from the slice reloaded; its
    # minimum takes -inf in, and a group that met one reads its columns again. Offline
    # sm_90 (stop 70): ~23 instructions a column run in the loop (with ftz_v), issue-bound;
    # these two take ~5 of them. The same outputs, bit for bit (CPU tests; GPU at V
    # 49152). On at large vocabularies: H100, B 64, K 5, V 49152, top-p 0.9, the
    # partials launch 26.2 -> 21.7 µs, the sampler 88.3 -> 85.6 (stop 71).
    lazy_v: bool = False
    # The all-greedy launch's argmax found after its loop (_greedy_kernel, LAZY): groups
    # of 8 columns keep their max and the slice that raised it, not a column each, and
    # a group's column is found once from its slice read again. The same max and argmax,
    # bit for bit (CPU tests; GPU at V 49152). Needs sub_g >= 8 (else the per-lane loop).
    lazy_g: bool = False
    # The partials launch's registers a thread (maxnreg; 0: the compiler's choice). The
    # lazy one-pass partials take 44 at B 64, K 5, V 49152 (offline sm_90): 5 programs of
    # 8 warps an SM, 1152 programs in 1.75 waves. On an H100 they read their 37.7 MB in
    # ~21.5 µs, the greedy launch the same bytes in 17.6 (45 registers; lazy_g's 32 took
    # it 14.8 -> 14.1 on an H200). Off: at 40 (38 registers, 6 programs an SM) the
    # partials took 21.6 -> 22.4 µs (H100, top-p 0.9, stop 73).
    regs_v: int = 0
    # The resample launch's register budget (maxnreg; 0: the compiler's). Its 768
    # programs (4096 columns drawn 1024 at a time, 4 warps, B 64, V 49152) are one wave
    # at 78 registers. 2048-column blocks take 1536 programs: 1.66 waves at their 70
    # registers (offline sm_90), one at a budget of 40 (drawn 512 at a time: 38
    # registers, 4 / 3 spills): not timed. With pack_r, 80 at large vocabularies
    # (choose_rejection_config).
    regs_r: int = 0
    # The race's draws only over the columns a block keeps (_race_packed; 0: off): a
    # first read lists a request's columns at or above its threshold, up to pack_r of
    # them, and the keyed uniform, its exponential and the division (~140 SASS
    # instructions a column, offline sm_90, B 64, K 5, V 49152) run on the list. Top-p 0.9
    # on the benchmark's gaussian rows keeps ~4% of a row (~180 of a 4096-column block);
    # an unfiltered request, or a longer list, takes the draws over every column. The
    # same winners and tokens (CPU tests; GPU at V 49152). On at large vocabularies
    # (choose_rejection_config).
    pack_r: int = 0
    # The top-p cut of 16-bit logits without top-k from counts of equal values (0: off;
    # bins, a power of two): _hist_cut_kernel's programs of chunk_h columns count each
    # cut row's values by their key's distance below the row's max, and each row's last
    # one finds the cut in the bins' running mass. A cut more than hist_p distinct
    # values below the max, or a tie across keys at it, is left to the bracket launch.
    # The same thresholds and masses, bit for bit (CPU tests; GPU at V 49152). On at
    # large vocabularies (choose_rejection_config).
    hist_p: int = 0
    chunk_h: int = 4096  # columns a program of it counts
    sub_h: int = 1024  # and reads at a time
    # The bracket launch finishes the rows its tries miss (the narrowing passes in the
    # same program) instead of leaving them to a launch of their own: one launch fewer
    # where, as with hist_p, few rows reach it. Not with split_f. Not timed.
    fold_n: bool = False
    # The packed race's list pass: its loads' pipelining depth (offline sm_90, 2: the
    # next 1024-column slice copied to shared memory (LDGSTS) while a slice is scanned).
    # The same lists. Not timed.
    stages_r: int = 1

    def __post_init__(self) -> None:
        # Every size is a tile width (tl.arange needs a power of two); tries_f, the stages
        # and rows_s are counts (tries_f 0: no bracket tries, every cut row narrows; a
        # loop takes at least one stage; rows_s is a grid; regs_v and regs_r are register
        # budgets, 0 for none; pack_r a list's length, 0 for none); cap_f, small_f,
        # sample_k and split_f may be 0 (off / sample_f).
        counts = {"tries_f": 0, "stages_f": 1, "stages_g": 1, "rows_s": 1, "regs_v": 0,
                  "regs_r": 0, "pack_r": 0, "stages_r": 1}  # fmt: skip
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in counts:
                if type(v) is not int or v < counts[f.name]:
                    raise ValueError(
                        f"RejectionConfig.{f.name} must be an int >= {counts[f.name]}, got {v!r}"
                    )
                continue
            if f.type == "bool" or v is None:
                continue
            # a block that is only a loop bound: any multiple of its (power-of-two) slice
            slice_of = {"block_g": "sub_g", "block_v": "sub_v"}.get(f.name)
            sub = getattr(self, slice_of) if slice_of else None
            if sub and v > 0 and v % sub == 0:
                continue
            zero = f.name in ("cap_f", "small_f", "sample_k", "split_f", "hist_p")
            if type(v) is not int or v < 0 or (v == 0 and not zero) or v & (v - 1):
                also = " or 0" if zero else f" or a multiple of {slice_of}" if slice_of else ""
                raise ValueError(
                    f"RejectionConfig.{f.name} must be a power of two{also}, got {v!r}"
                )
        if self.loads_f not in (1, 16):  # the pass's loops: one chunk, or 2 x 8 columns
            raise ValueError(f"RejectionConfig.loads_f must be 1 or 16, got {self.loads_f!r}")

    @property
    def max_passes(self) -> int:
        # A pass shrinks the interval about nbin / (bins in the window)-fold; 40 halvings
        # take a 2^8-wide interval below float32 resolution. Real rows take 2-3 passes.
        return -(-40 // (self.nbin.bit_length() - 1)) + 3


def _p2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def choose_rejection_config(
    vocab: int, num_reqs: int, k_max: int, *, cap: int | None = None
) -> RejectionConfig:
    """Tiles of about `tile` elements: one row per program at large vocabularies, many
    rows per program at small ones. The interpreter pays per op, not per element: it
    gets tiles 16x larger."""
    tile = 1 << 16 if INTERPRET else 4096
    rows = num_reqs * (k_max + 1)
    block_v = min(_p2(vocab), 1024)
    block_t = min(_p2(vocab), 2048)
    cap = _p2(cap) if cap is not None else min(256, _p2(vocab))
    nbin = 128
    block_r = min(_p2(vocab), 2048)
    sub_r = min(block_r, 4096 if INTERPRET else 512)
    kp = _p2(k_max + 1)
    # Blocks of up to 1024 columns: the walk's requests a program (rows_w) were tuned
    # with this count (8 a program at B 64, K 5) and keep it where the partials take
    # wider blocks.
    nb = _p2(-(-vocab // block_v))
    # Cut and race tiles. GPU: one row / request per program from 4096 columns on (a row
    # fills a program); below, as many as fit the tile with the cut's histogram and
    # pairwise slices (8 x cap) in it too, and races of at most 2048 columns. The
    # interpreter: a row chunk / race slice of `tile` (its other tensors are larger).
    wide = vocab >= 4096 and not INTERPRET
    # The all-greedy launch (H200, stop 23 sweeps): ~256 programs or more, 1024-column
    # tiles at batch 1; with many rows, one row per program and ~1500 programs of up to
    # 32k columns read 2048 at a time (B 64, K 5, V 49152: 16384 columns).
    many = min(32768, _p2(vocab * rows // 1536))
    block_g = min(_p2(vocab), max(1024, min(4096, _p2(vocab * num_reqs // 256)), many))
    rows_t = tile // (block_t if INTERPRET else max(block_t, nbin, 8 * cap))
    rows_r = (tile if INTERPRET else 2048) // sub_r
    sub_g = None if INTERPRET else min(block_g, 2048 if block_g >= 16384 else 512)
    warps_g = None if INTERPRET else (8 if block_g >= 16384 else 4)
    rows_p = max(1, min(tile // block_v, _p2(rows)))
    sub_v = warps_v = None
    lanes_f = RejectionConfig.lanes_f  # the field's default; the one-row cut's below
    if wide:
        # The partials take the all-greedy launch's tiles: one row a program, its block
        # read sub_g columns at a time into per-lane values reduced once (stop 47,
        # offline sm_90: ~3x fewer instructions an element than 4 x 1024 tiles reduced
        # whole, which made the pass instruction-bound: 31 µs for 8.4 µs of bytes). At
        # most 16384 columns: the second read of a block should still find it in L1 / L2.
        block_v, rows_p, sub_v, warps_v = min(block_g, 16384), 1, sub_g, warps_g
        # Race programs of 4096 columns drawn 1024 at a time: half the programs of 2048 /
        # 512 (768 at B 64, V 49152: under one wave where 1536 took 1.16), 62 registers
        # against 45. H200 (stop 49): the resample launch 25.3 -> 22.7 µs (top-p 0.9),
        # 23.8 -> 21.0 (no filter).
        block_r, sub_r = min(_p2(vocab), 4096), min(_p2(vocab), 1024)
        # The one-row cut: 512-column chunks, 16 bracket slots a lane. Triton 3.6 spills
        # the bracket launch at 126 registers: 65 / 58 spill stores / loads with 2048-
        # column chunks, 32 / 32 with these, and the narrowing launch 10 / 10 -> 0 / 0
        # (offline sm_90). H100, B 64, K 5, V 49152, top-p 0.9: 127.06 -> 122.41 µs
        # (stop 52) and 127.09 -> 121.6 (stop 55, another H100); 512 columns with 8
        # slots took 139.9 (bench/NOTES.md).
        block_t, lanes_f = min(_p2(vocab), 512), 16
    return RejectionConfig(
        block_v=block_v,
        rows_p=rows_p,
        sub_v=sub_v,
        warps_v=warps_v,
        block_t=block_t,
        cap=cap,
        nbin=nbin,
        block_r=block_r,
        sub_r=sub_r,
        rows_w=max(1, min(tile // (kp * nb), _p2(num_reqs), 1024 if INTERPRET else 64)),
        block_g=block_v if INTERPRET else block_g,
        sub_g=sub_g,
        warps_g=warps_g,
        stages_g=1,
        rows_t=1 if wide else max(1, min(rows_t, _p2(rows))),
        rows_r=1 if wide else max(1, min(rows_r, _p2(num_reqs))),
        row_g=not INTERPRET and rows >= 16,
        # Wide: a 1024-value sample placing brackets of up to 4096 values (a PyTorch model
        # of gaussian rows: 1490 on average, at most 2363), 16 columns a lane in flight,
        # the cut by interpolated bisection. H100, B 64, K 5, V 49152, top-p 0.9 (stop
        # 70): the sampler 101 -> 94.6 µs; a 512-value sample 97.8, but 210 with loads_f
        # 16 (rows to the narrowing launch).
        cap_f=4096 if wide else 0,
        sample_f=1024 if wide else 2048,
        lanes_f=lanes_f,
        loads_f=16 if wide else 1,
        bisect_f=wide,
        interp_f=wide,
        # The one-pass partials' exps flush subnormal results (same bits wherever a
        # result is normal): H100, stop 70, partials 27.7 -> 26.3 µs.
        ftz_v=wide,
        # and their argmax and smallest finite value are found after the loop (stop 71)
        lazy_v=wide,
        one_pass_v=wide,
        # The all-greedy launch's argmax found after its loop, with the one tile it was
        # timed at: 16384-column blocks read 2048 at a time (H200, stop 72, B 64, K 5,
        # V 49152: 14.8 -> 14.1 µs; an H100, stop 73: 17.4-17.6 either way, alternated).
        # V 128256's 32768-column blocks took 30.0 -> 31.1: off there, and at the small
        # batches' 1024-4096-column request tiles (untimed).
        lazy_g=not INTERPRET and block_g == 16384,
        # The race drawn over lists of the kept columns, a quarter of its block at most,
        # in 80 registers (78, no spills: 6 programs an SM, the 768 in one wave). H100,
        # B 64, K 5, V 49152 (stop 73): the resample launch 22.5 -> 13.0 µs at top-p 0.9
        # (the sampler 84.3 -> 74.8), 20.4 -> 10.7 at top-k 50; no filter 21.4 -> 21.0
        # (every tile draws over every column). pack_r alone 17.0-17.3 (94 registers).
        pack_r=block_r // 4 if wide else 0,
        regs_r=80 if wide else 0,
        # Top-p cuts of 16-bit rows from counts of equal values, 256 bins (every cut of the
        # benchmark's N(0, 3^2) bf16 rows lies 149-185 keys below its max). H100, B 64,
        # K 5, V 49152, top-p 0.9 (stop 74): the sampler 74.98 -> 68.95 µs (the bracket
        # launch 28.7 -> 3.2, the narrowing one 4.8 -> 1.7, the counts' own launch 23.7).
        hist_p=256 if wide else 0,
    )


@dataclass
class RejectionWorkspace:
    """Scratch the launches share, allocated once (graphs keep its addresses):
    per (row, vocab block) partials, per-row max / threshold / kept mass, the cut
    kernel's candidate scratch and the per-block race winners."""

    config: RejectionConfig
    vocab: int
    part_max: torch.Tensor  # [rows, nb] float32
    part_arg: torch.Tensor  # [rows, nb] int32
    part_sum: torch.Tensor  # [rows, nb] float32
    part_min: torch.Tensor  # [rows, nb] float32: smallest finite value (+inf: none)
    row_max: torch.Tensor  # [rows] float32
    row_thr: torch.Tensor  # [rows] float32
    row_sum: torch.Tensor  # [rows] float32: mass of the kept tokens, relative to the max
    cand: torch.Tensor  # [rows, cap] float32
    race_val: torch.Tensor  # [reqs, nb2] float32
    race_idx: torch.Tensor  # [reqs, nb2] int32
    walk: torch.Tensor  # [reqs, 2] int32: drafts proposed (k) and the first rejected (r)
    done: torch.Tensor  # [reqs] int32: the greedy launch's tickets, zero between calls
    cand_fast: torch.Tensor  # [rows, cap_f] float32 (one element when cap_f is 0)
    todo: torch.Tensor  # [rows] int32: rows the bracket launch left to the narrowing one
    part_above: torch.Tensor  # [rows, nb] float32: the screen's mass above the draft's value
    part_cnt: torch.Tensor  # [rows, nb] int32: and the count of values above it
    row_state: torch.Tensor  # [rows] int32: the screen's state of each row
    # The split top-p bracket (split_f; one element each when off): per row its lower end
    # and the bracket's ends ([rows, 3] float32), its goal in fixed point (float64),
    # the count of its values (int32), and per chunk the mass above it (int64); the
    # opened rows ([rows + 1] int32: their count, then the rows).
    split_b: torch.Tensor
    split_goal: torch.Tensor
    split_n: torch.Tensor
    split_mass: torch.Tensor
    split_list: torch.Tensor
    race_list: torch.Tensor  # [reqs, nb2 * pack_r] int32: the packed race's lists (pack_r)
    # hist_p's counts ([rows, hist_p + 1] int32), tickets and done marks ([rows] int32);
    # one element each when off. Counts and tickets are zero between calls.
    hist: torch.Tensor
    hist_ticket: torch.Tensor
    hist_done: torch.Tensor

    @classmethod
    def allocate(
        cls, num_reqs: int, k_max: int, vocab: int, device, config: RejectionConfig | None = None
    ) -> RejectionWorkspace:
        cfg = config or choose_rejection_config(vocab, num_reqs, k_max)
        rows = num_reqs * (k_max + 1)
        nb, nb2 = -(-vocab // cfg.block_v), -(-vocab // cfg.block_r)
        f32 = {"device": device, "dtype": torch.float32}
        i32 = {"device": device, "dtype": torch.int32}
        split = cfg.cap_f > 0 and cfg.split_f > 0
        srows, nsplit = (rows, -(-vocab // cfg.split_f)) if split else (1, 1)
        return cls(
            cfg, vocab,
            torch.empty(rows, nb, **f32), torch.empty(rows, nb, **i32),
            torch.empty(rows, nb, **f32), torch.empty(rows, nb, **f32),
            torch.empty(rows, **f32), torch.empty(rows, **f32), torch.empty(rows, **f32),
            torch.empty(rows, cfg.cap, **f32),
            torch.empty(num_reqs, nb2, **f32), torch.empty(num_reqs, nb2, **i32),
            torch.empty(num_reqs, 2, **i32), torch.zeros(num_reqs, **i32),
            torch.empty(rows if cfg.cap_f else 1, max(cfg.cap_f + cfg.lanes_f * cfg.block_t, 1),
                        **f32),  # fmt: skip
            torch.zeros(rows if cfg.cap_f else 1, **i32),
            torch.empty(rows, nb, **f32), torch.empty(rows, nb, **i32), torch.empty(rows, **i32),
            torch.empty(srows, 3, **f32), torch.empty(srows, device=device, dtype=torch.float64),
            torch.empty(srows, **i32),
            torch.empty(srows, nsplit, device=device, dtype=torch.int64),
            torch.zeros(srows + 1, **i32),
            torch.empty(num_reqs if cfg.pack_r else 1, max(nb2 * cfg.pack_r, 1), **i32),
            torch.zeros(rows if cfg.hist_p else 1, cfg.hist_p + 1, **i32),
            torch.zeros(rows if cfg.hist_p else 1, **i32),
            torch.zeros(rows if cfg.hist_p else 1, **i32),
        )  # fmt: skip


def screened_cut_rows(workspace: RejectionWorkspace, num_reqs: int, k_max: int) -> torch.Tensor:
    """The rows the last screened call sent to their cut ([B * (K + 1)] bool, the
    kernels' _needs_cut read back from the workspace's states; a host read: for tests and
    benchmarks). Meaningless after an unscreened call."""
    st = workspace.row_state[: num_reqs * (k_max + 1)].view(num_reqs, k_max + 1).long()
    j = torch.arange(k_max + 1, device=st.device)
    first = torch.where(st != SURE_ACCEPT, j, k_max + 1).amin(1, keepdim=True)
    s = torch.where(st >= SURE_REJECT, j, k_max + 1).amin(1, keepdim=True)
    need = (j == s) | ((j >= first) & (j < s) & (st == EXACT))
    return (need & (st != NOTHING)).view(-1).cpu()


def _check(name: str, t, ndim: int, dtypes: tuple, shape: tuple | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {tuple(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.numel() > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, strides {t.stride()}")


_LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_VOCAB = 2**31 - 2**20  # int32 token ids and block offsets


def check_rejection_args(
    target_logits, draft_tokens, draft_probs, greedy, temperature, top_k, top_p, seed,
    positions, out_tokens, out_num_accepted, out_num_emitted, proposed_counts,
    accepted_counts, workspace=None,
) -> tuple[int, int, int]:  # fmt: skip
    """rejection_sample's contract checks, nothing launched; returns (B, K_max, V)."""
    named = dict(locals())  # every argument by name, for the device check
    _check("draft_tokens", draft_tokens, 2, (torch.int64,))
    b, k = draft_tokens.shape
    _check("target_logits", target_logits, 2, _LOGIT_DTYPES)
    rows, v = target_logits.shape
    if rows != b * (k + 1):
        raise ValueError(
            f"target_logits has {rows} rows; draft_tokens {tuple(draft_tokens.shape)} needs "
            f"B * (K_max + 1) = {b * (k + 1)} (K_max + 1 rows per request)"
        )
    if not 1 <= v <= _MAX_VOCAB:
        raise ValueError(f"target_logits' vocabulary must be in [1, {_MAX_VOCAB}], got {v}")
    if draft_probs is not None:
        _check("draft_probs", draft_probs, 3, (torch.float32,))
        if tuple(draft_probs.shape) != (b, k, v):
            raise ValueError(
                f"draft_probs (q) must be [B, K_max, V] = {(b, k, v)} (vocabulary of "
                f"target_logits), got {tuple(draft_probs.shape)}"
            )
    for name, t, dt in (
        ("greedy", greedy, torch.bool), ("temperature", temperature, torch.float32),
        ("top_k", top_k, torch.int32), ("top_p", top_p, torch.float32),
        ("seed", seed, torch.int64), ("positions", positions, torch.int64),
        ("out_num_accepted", out_num_accepted, torch.int32),
        ("out_num_emitted", out_num_emitted, torch.int32),
    ):  # fmt: skip
        _check(name, t, 1, (dt,), (b,))
    _check("out_tokens", out_tokens, 2, (torch.int64,), (b, k + 1))
    for name, t in (("proposed_counts", proposed_counts), ("accepted_counts", accepted_counts)):
        _check(name, t, 1, (torch.int64,), (k,))
    for name, t in named.items():
        if isinstance(t, torch.Tensor) and t.device != draft_tokens.device:
            raise ValueError(f"{name} is on {t.device}, draft_tokens on {draft_tokens.device}")
    if workspace is not None:
        _check_workspace(workspace, b, k, v, draft_tokens.device)
    return b, k, v


def _check_workspace(ws: RejectionWorkspace, b: int, k: int, v: int, device) -> None:
    if not isinstance(ws, RejectionWorkspace):
        raise TypeError(f"workspace must be a RejectionWorkspace, got {type(ws).__name__}")
    rows = b * (k + 1)
    if ws.vocab != v:
        raise ValueError(f"workspace was allocated for vocabulary {ws.vocab}, logits have {v}")
    if ws.part_max.shape[0] < rows or ws.race_val.shape[0] < b:
        raise ValueError(
            f"workspace holds {ws.part_max.shape[0]} rows / {ws.race_val.shape[0]} requests, "
            f"this call needs {rows} / {b}"
        )
    if ws.part_max.device != device:
        raise ValueError(f"workspace is on {ws.part_max.device}, draft_tokens on {device}")


def validate_draft_tokens(draft_tokens: torch.Tensor, vocab: int) -> None:
    """Value checks (a host read: validation mode only): every draft id before the first
    -1 in [0, vocab), and only -1 after it."""
    d = draft_tokens.detach().to("cpu")
    if d.numel() == 0:
        return
    pad = d == -1
    after = pad.cumsum(dim=1) > 0
    bad = (after & ~pad) | (~after & ((d < 0) | (d >= vocab)))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        why = "follows a -1 (padding must be a suffix)" if after[b, j] else "outside the vocabulary"
        raise ValueError(
            f"draft_tokens[{b}, {j}] = {int(d[b, j])} {why}: ids must be in [0, {vocab}), "
            "then -1 to the end of the row"
        )


class _Launcher:
    def __init__(self, fn):
        self._cached = CachedLaunch(fn)

    def add(
        self, launches: list, grid, args, num_warps, pdl: bool = False, maxnreg: int = 0
    ) -> None:
        """Append this kernel's launch (cached launcher, key, grid, args, options); pdl:
        with programmatic dependent launch (the kernel's GDC, its last argument); maxnreg:
        the registers a thread may use (0: the compiler's choice)."""
        gdc, options = pdl_launch(pdl)
        if maxnreg and not INTERPRET:
            options = {**options, "maxnreg": maxnreg}
        args = (*args, gdc)
        key = specialization_key(args) + (num_warps, maxnreg)
        launches.append((self._cached, key, grid, args, {"num_warps": num_warps, **options}))


_PARTIALS = _Launcher(_partials_kernel)
_INIT = _Launcher(_init_kernel)
_CUT = _Launcher(_cut_kernel)
_RESAMPLE = _Launcher(_resample_kernel)
_WALK = _Launcher(_walk_kernel)
_SPLIT_PASS = _Launcher(_split_pass_kernel)
_SPLIT_CLOSE = _Launcher(_split_close_kernel)
_HIST = _Launcher(_hist_cut_kernel)
_GREEDY = _Launcher(_greedy_kernel)


def rejection_sample(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    positions: torch.Tensor,
    out_tokens: torch.Tensor,
    out_num_accepted: torch.Tensor,
    out_num_emitted: torch.Tensor,
    proposed_counts: torch.Tensor,
    accepted_counts: torch.Tensor,
    workspace: RejectionWorkspace,
    *,
    any_filter: bool = True,
    streams: tuple[int, int, int] = (ACCEPT, RESIDUAL, BONUS),
    pdl: bool = False,
) -> None:
    """Verify B requests' drafts against the target (module docstring).

    target_logits [B * (K + 1), V] (fp16/bf16/fp32); draft_tokens [B, K] int64, -1 padded
    (k[b] = the ids before the first -1); draft_probs q [B, K, V] float32, or None: every
    request greedy. Per request [B]: greedy bool, temperature / top_p float32, top_k
    int32, seed int64, positions int64 (the absolute position of draft 0; < 0 marks a
    padded request: tokens -1, counts 0, counters untouched). Writes out_tokens
    [B, K + 1] int64 (accepted drafts, then the correction or bonus token, then -1),
    out_num_accepted / out_num_emitted [B] int32 and adds to proposed_counts /
    accepted_counts [K] int64 (drafts proposed / accepted per position). any_filter=False
    is the caller's host-side promise that no request uses top-k or top-p. pdl: launch
    with programmatic dependent launch (kernels.pdl_supported); timing only.

    No host read (draft-id values are checked only in validation mode, never during
    capture), fixed grids: capturable in a CUDA graph per (B, K, V)."""
    tensors = (target_logits, draft_tokens, draft_probs, greedy, temperature, top_k, top_p,
               seed, positions, out_tokens, out_num_accepted, out_num_emitted,
               proposed_counts, accepted_counts)  # fmt: skip
    # The same buffers step after step: the checks and the launch arguments are made once
    # per buffer set. A plan holds its tensors, so their memory (hence a matching
    # signature) cannot belong to other tensors while it is cached.
    sig = (*(_geometry(t) for t in tensors), id(workspace), bool(any_filter), tuple(streams),
           bool(pdl))  # fmt: skip
    plan = _PLANS.get(sig)
    if plan is None or plan[0] is not workspace:
        plan = _plan(*tensors, workspace, any_filter, streams, pdl)
        if len(_PLANS) >= 4:
            _PLANS.clear()
        _PLANS[sig] = plan
    _, b, v, launches = plan
    capturing = draft_tokens.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and validation_enabled(draft_tokens):
        validate_draft_tokens(draft_tokens, v)
    for cached, key, grid, args, options in launches:
        cached(key, grid, args, options)


_PLANS: dict[tuple, tuple] = {}


def _geometry(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def _plan(
    target_logits, draft_tokens, draft_probs, greedy, temperature, top_k, top_p, seed,
    positions, out_tokens, out_num_accepted, out_num_emitted, proposed_counts,
    accepted_counts, workspace, any_filter, streams, pdl=False,
) -> tuple:  # fmt: skip
    """Check one buffer set and build its launches: (workspace, B, V, [(cached launch,
    key, grid, args, options)])."""
    b, k, v = check_rejection_args(
        target_logits, draft_tokens, draft_probs, greedy, temperature, top_k, top_p, seed,
        positions, out_tokens, out_num_accepted, out_num_emitted, proposed_counts,
        accepted_counts, workspace,
    )  # fmt: skip
    if len(streams) != 3 or len(set(streams)) != 3:
        raise ValueError(f"streams must be 3 distinct ids (accept, residual, bonus), got {streams}")
    launches: list[tuple] = []
    if b == 0:
        return workspace, b, v, launches
    ws, cfg = workspace, workspace.config
    sampled = draft_probs is not None
    q = draft_probs if sampled else ws.row_max  # never read without q
    sq = (q.stride(0), q.stride(1)) if sampled else (0, 0)
    rows, kp = b * (k + 1), _p2(k + 1)
    nb, nb2 = ws.part_max.shape[1], ws.race_val.shape[1]
    mul_a, mul_r, mul_b = (_stream_mul(s) for s in streams)
    lm = target_logits.stride(0)
    if not sampled:  # every request greedy: one launch
        bg = max(cfg.block_g or cfg.block_v, cfg.block_v)  # at most nb partials per row
        # without sub_g, the whole block a slice, or (a block_v that is a multiple of its
        # slice, not a power of two) its largest power-of-two divisor
        sub = min(cfg.sub_g or (bg & -bg), bg)
        nbg = triton.cdiv(v, bg)
        per_row = bool(cfg.row_g) and rows <= 65535  # the grid's second dimension
        warps = cfg.warps_g or (8 if (1 if per_row else kp) * sub >= 8192 else 4)
        _GREEDY.add(
            launches,
            (nbg, rows) if per_row else (b, nbg),
            (target_logits, lm, draft_tokens, draft_tokens.stride(0), positions, ws.part_max,
             ws.part_arg, ws.done, out_tokens, out_tokens.stride(0), out_num_accepted,
             out_num_emitted, proposed_counts, accepted_counts, k, v, nbg, kp, bg, sub,
             _p2(nbg), cfg.stages_g, per_row, bool(cfg.lazy_g) and sub >= 8),
            warps,
            pdl,
        )  # fmt: skip
        return workspace, b, v, launches
    # Screening only pays where a cut may run (and needs a draft row to screen).
    screen = bool(cfg.screen) and bool(any_filter) and k > 0
    db = draft_tokens.stride(0)
    sub_v = min(cfg.sub_v or cfg.block_v, cfg.block_v)
    one_pass = bool(cfg.one_pass_v) and sub_v >= 8
    _PARTIALS.add(
        launches,
        (triton.cdiv(rows, cfg.rows_p), triton.cdiv(v, cfg.block_v)),
        (target_logits, lm, greedy, temperature, ws.part_max, ws.part_arg, ws.part_sum,
         ws.part_min, draft_tokens, db, ws.part_above, ws.part_cnt, rows, v, k + 1, nb,
         cfg.rows_p, cfg.block_v, sub_v, screen, one_pass, one_pass and bool(cfg.ftz_v),
         one_pass and bool(cfg.lazy_v)),
        # Unless the config says (the sliced GPU tiles do): 8 warps from 4096-element
        # slices, 4 below. Screened or not, a config takes the same warps, so a block's
        # sum is the same bits either way.
        cfg.warps_v or (8 if cfg.rows_p * sub_v >= 4096 else 4),
        pdl,
        cfg.regs_v,
    )  # fmt: skip
    nbp = _p2(nb)
    # The cut's one-row bracket launch, and its top-p pass split over programs (the
    # workspace has the split's buffers when the config asks for it)
    fast = cfg.cap_f > 0 and cfg.rows_t == 1
    split = cfg.split_f if fast and any_filter else 0
    # the bracket's cut by bisection: 1 interpolated steps, 2 binary ones, 0 sorted
    bisect = (1 if cfg.interp_f else 2) if cfg.bisect_f and fast else 0
    # At most 32 rows a program on the GPU: a row's screen is a few hundred instructions,
    # and few partials a row (wide blocks) must not put the whole batch in one program.
    rows_i = max(1, min((1 << 16) // nbp if INTERPRET else min(2048 // nbp, 32), _p2(rows)))
    _INIT.add(
        launches,
        (triton.cdiv(rows, rows_i),),
        (ws.part_max, ws.part_sum, ws.row_max, ws.row_thr, ws.row_sum, rows, nb,
         ws.part_above, ws.part_cnt, ws.row_state, target_logits, lm, draft_tokens, db, q, *sq,
         greedy, temperature, top_k, top_p, seed, positions, v, k + 1, ws.split_list, rows_i,
         nbp, screen, kp, mul_a, split > 0),
        4,
        pdl,
    )  # fmt: skip
    if any_filter:
        fxs = float(2 ** (62 - (v - 1).bit_length()))  # v * 2^S <= 2^62: int64 sums fit
        # The top-p cuts of 16-bit rows from their values' counts first (hist_p); the
        # cut launches skip the rows it cut.
        hist = cfg.hist_p if target_logits.element_size() == 2 else 0
        if hist:
            _HIST.add(
                launches,
                (b, triton.cdiv(v, cfg.chunk_h)),
                (target_logits, lm, greedy, temperature, top_k, top_p, ws.row_max, ws.row_thr,
                 ws.row_sum, ws.row_state, ws.hist, ws.hist_ticket, ws.hist_done, v, k + 1, kp,
                 cfg.chunk_h, min(cfg.chunk_h, cfg.sub_h), hist, fxs, screen),
                8 if cfg.chunk_h >= 8192 else 4,
                pdl,
            )  # fmt: skip
        # With the one-pass bracket: its launch, then the narrowing passes for the rows
        # it missed (marked in todo); else the narrowing passes alone. The bracket's
        # options go to the narrowing launch as off (it never takes the bracket), so that
        # configurations that differ in them share its compiled kernel.
        # fold_n: the bracket launch finishes the rows it misses itself (no split).
        fold = bool(cfg.fold_n) and not split
        for cap_f, fast_only, todo in (
            ((cfg.cap_f, False, False),) if fast and fold
            else ((cfg.cap_f, True, False), (0, False, True)) if fast
            else ((0, False, False),)
        ):  # fmt: skip
            bracket = cap_f > 0
            _CUT.add(
                launches,
                (triton.cdiv(rows, cfg.rows_t),),
                (target_logits, lm, greedy, temperature, top_k, top_p, ws.part_min, ws.row_max,
                 ws.row_thr, ws.row_sum, ws.cand, ws.cand_fast, ws.todo, ws.row_state,
                 ws.split_b, ws.split_goal, ws.split_n, ws.split_list, ws.hist_done, rows, v,
                 k + 1, nb, cfg.rows_t, nbp, cfg.block_t, cfg.cap, cfg.nbin, cfg.max_passes,
                 min(cfg.cap, cfg.chunk_t), fxs, cap_f, cfg.sample_f, cfg.tries_f, cfg.lanes_f,
                 cfg.stages_f, fast_only, todo, screen, kp, bracket and bool(cfg.fuse_kp),
                 min(cfg.small_f, cap_f // 2),
                 (cfg.sample_k or cfg.sample_f) if bracket else cfg.sample_f,
                 split if bracket else 0,
                 bisect if bracket and not cfg.fuse_kp else 0, bisect if bracket else 0,
                 hist > 0 and not todo, cfg.loads_f if bracket else 1),
                cfg.warps_f if bracket else 8 if cfg.rows_t * cfg.block_t >= 2048 else 4,
                pdl,
            )  # fmt: skip
            if bracket and split:
                nsplit = ws.split_mass.shape[1]
                args = (ws.split_list, ws.split_b, ws.split_n, ws.split_mass, ws.cand_fast,
                        ws.cand_fast.stride(0))  # fmt: skip
                _SPLIT_PASS.add(
                    launches,
                    (min(rows, cfg.rows_s), nsplit),
                    (target_logits, lm, temperature, ws.row_max, *args, v, k + 1, nsplit,
                     split, cap_f, fxs),
                    min(max(split // 512, 4), 16),  # 8 warps at 4096: ~16 values a thread
                    pdl,
                )  # fmt: skip
                _SPLIT_CLOSE.add(
                    launches,
                    (min(rows, cfg.rows_s),),
                    (ws.row_max, ws.row_thr, ws.row_sum, ws.todo, ws.split_list, ws.split_b,
                     ws.split_goal,
                     ws.split_n, ws.split_mass, ws.cand_fast, ws.cand_fast.stride(0), nsplit,
                     _p2(nsplit), cap_f, fxs, min(cfg.small_f, cap_f // 2), bisect),
                    cfg.warps_f,
                    pdl,
                )  # fmt: skip
    _WALK.add(
        launches,
        (triton.cdiv(b, cfg.rows_w),),
        (target_logits, lm, draft_tokens, draft_tokens.stride(0), q, *sq, greedy,
         temperature, seed, positions, ws.row_max, ws.row_thr, ws.row_sum, ws.part_max,
         ws.part_arg, ws.row_state, ws.walk, b, k, v, nb, cfg.rows_w, kp, nbp, mul_a,
         screen),
        4,
        pdl,
    )  # fmt: skip
    sub_r = min(cfg.sub_r, cfg.block_r)
    race_tile = cfg.rows_r * sub_r
    _RESAMPLE.add(
        launches,
        (triton.cdiv(b, cfg.rows_r), nb2),
        (target_logits, lm, draft_tokens, draft_tokens.stride(0), q, *sq, greedy,
         temperature, seed, positions, ws.row_max, ws.row_thr, ws.row_sum, ws.part_max,
         ws.part_arg, ws.walk, ws.race_val, ws.race_idx, ws.race_list, ws.done, out_tokens,
         out_tokens.stride(0), out_num_accepted, out_num_emitted, proposed_counts,
         accepted_counts, b, k, v, nb, nb2, cfg.rows_r, kp, nbp, _p2(nb2),
         cfg.block_r, sub_r, mul_r, mul_b, cfg.pack_r, min(sub_r, 256), cfg.stages_r),
        8 if race_tile >= 2048 else 4 if race_tile >= 512 else 2 if race_tile >= 128 else 1,
        pdl,
        cfg.regs_r,
    )  # fmt: skip
    return workspace, b, v, launches
