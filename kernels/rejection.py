"""Lossless rejection sampler for speculative decoding: four launches, six with top-k / top-p.

Request b owns target rows b * (K + 1) + j (j = 0..K) and drafts x_j, j < k[b]. Row j's
target distribution p_j is specdraft.sampling's filtered_probs (temperature, then top-k,
then top-p, ties kept whole); q_j is the draft's. Draft j is accepted with probability
min(1, p_j(x_j) / q_j(x_j)); the first rejected position r emits a token drawn from
max(p_r - q_r, 0), and a request whose k drafts all pass emits a bonus token from p_k.
Greedy requests accept while x_j == argmax(row j) and emit the argmax at r.

1. partials (rows x vocab blocks): per block max, first argmax, sum exp(z - max), min and
   second max, with z = logits / T. Nothing [B, K, V]-sized is written.
2. init (row tiles): row max and sum from the partials; for rows using top-k / top-p
   the band, a key interval known to hold the threshold (below).
3. band (rows x vocab blocks; filtered launches only): compacts each filtered row's band
   into its scratch row and sums the mass inside and below the band.
4. threshold (row tiles; filtered launches only): the smallest kept value, found
   exactly from the compacted band (below), and the kept mass.
5. resample (request tiles x vocab blocks): each program repeats its requests' walk
   over the drafts (a few loads and hashes) to find r, then runs an exponential race
   over its vocabulary block of the residual (or of p for the bonus).
6. finalize (request tiles): the walk again, the race winner, tokens, counts and the
   per-position counters (atomics).
Greedy-only launches (no q) run 1 and 6. Passes over the [B * (K + 1), V] logits: greedy
and unfiltered 1, filtered 2 (partials, band) while every band fits the scratch.

Top-k / top-p thresholds. Keys are the int32 images of z's float32 bits ordered like the
values (-0 folded into +0), so "kept iff z >= thr" is a key comparison and tie groups are
single keys. The k-th largest value (with multiplicity) and the top-p cut (the largest
value v with mass(z >= v) >= top_p * mass) are found by narrowing a key interval (lo, hi]
known to hold the answer. Starting intervals (the band): top-k from the k-th largest of
the block maxima and second maxima (2 per block: k <= 2 * blocks gets a tight band);
top-p from a floor below which every token is provably cut, from the block partials
(max, second max, sum; see _band_floor), so that a peaked row has a band of a few dozen
to a few thousand tokens. The band kernel compacts the band in parallel over the whole
grid (per-row atomic offsets, up to cap_big candidates). The threshold kernel then works
on the compacted band only: once the interval's candidates fit (CAP) the answer is read
off exactly by comparing them pairwise; otherwise a pass over the band counts them and
sums their mass per key bucket (NSPLIT power-of-two buckets), keeps the bucket holding
the answer and compacts its candidates for the next pass. A band over cap_big (a top-k
with k > 2 * blocks, a very flat row) is searched the same way over the vocabulary row
(correct, slower: one serial pass per narrowing step). Top-p after top-k reads the
top-k band, which holds every top-k survivor.

Masses in the search are int64 fixed point (exp(z - max) * 2^S, S = 62 - bits(V - 1)):
sums are exact, so they do not depend on the compaction's order and the thresholds are
bit-for-bit reproducible (graph replays); the resolution (2^-46 at V 49152) is far finer
than float32. The kept mass is converted to float32 once. Sums are in a different order
from torch's cumsum: a token whose preceding mass is within float rounding of top_p * mass
may fall the other way (the rules and ties are the same).

Random draws are specdraft.sampling's keyed uniforms, bit for bit: SplitMix64 over
(seed, position, stream, counter) in uint64. Acceptance: counter 0 at the draft's
position on the ACCEPT stream; residual / bonus: an exponential race (argmax of
weight / E, E = -log1p(-u)) with counter = vocabulary index on RESIDUAL / BONUS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .guard import INTERPRET, validation_enabled
from .launch import CachedLaunch, specialization_key

# specdraft.sampling.Stream values; the runtime passes its own (the kernels never import
# the runtime) and the wrapper checks they agree.
ACCEPT, RESIDUAL, BONUS = 2, 3, 4
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
# Key of -inf: the smallest key a non-NaN float32 has.
KEY_NEG_INF = tl.constexpr(-2139095041)


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


if INTERPRET:

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
    def _exponential(u):
        # log1p, not log(1 - u): winners of a flat race have tiny u (sampling.py).
        return -libdevice.log1p(-u)


@triton.jit
def _key(z):
    """Order-preserving int64 key of float32 z (z == 0 folded to +0 by the caller)."""
    bits = z.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _value(key):
    k = key.to(tl.int32)
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _nbits(x):
    """Bits needed for int64 x >= 0 (0 for 0), by a six-step binary search."""
    n = tl.zeros_like(x)
    for s in tl.static_range(5, -1, -1):
        t = x >> (1 << s)
        c = t > 0
        x = tl.where(c, t, x)
        n += tl.where(c, 1 << s, 0)
    return n + (x > 0).to(tl.int64)


@triton.jit
def _load_z(logits_ptr, stride_lm, rows, offs, mask, t):
    """z = logits / T (correctly rounded, like torch.div), -0 folded into +0."""
    ptrs = logits_ptr + rows[:, None] * stride_lm + offs[None, :]
    x = tl.load(ptrs, mask=mask, other=float("-inf")).to(tl.float32)
    if (tl.min(t, axis=0) == 1.0) & (tl.max(t, axis=0) == 1.0):
        z = x  # x / 1 == x: skip the ~10-instruction IEEE division
    else:
        z = tl.math.div_rn(x, t[:, None])
    return tl.where(z == 0.0, 0.0, z)


# ------------------------------------------------------------------- 1. block partials


@triton.jit
def _partials_kernel(
    logits_ptr, stride_lm, greedy_ptr, temp_ptr,
    pmax_ptr, parg_ptr, psum_ptr, pmin_ptr, pmax2_ptr,
    num_rows, V, K1, NB,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr, SAMPLED: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    blk = tl.program_id(1)
    offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    rmask = rows < num_rows
    mask = rmask[:, None] & (offs < V)[None, :]
    if SAMPLED:
        req = rows // K1
        g = tl.load(greedy_ptr + req, mask=rmask, other=1) != 0
        t = tl.where(g, 1.0, tl.load(temp_ptr + req, mask=rmask, other=1.0))
        z = _load_z(logits_ptr, stride_lm, rows, offs, mask, t)
    else:
        # Greedy: the argmax of the raw logits (float32 conversion keeps their order).
        ptrs = logits_ptr + rows[:, None] * stride_lm + offs[None, :]
        z = tl.load(ptrs, mask=mask, other=float("-inf")).to(tl.float32)
    bmax, barg = tl.max(z, axis=1, return_indices=True, return_indices_tie_break_left=True)
    out = rows * NB + blk
    tl.store(pmax_ptr + out, bmax, mask=rmask)
    tl.store(parg_ptr + out, (barg + blk * BLOCK_V).to(tl.int32), mask=rmask)
    if SAMPLED:
        ref = tl.where(bmax == float("-inf"), 0.0, bmax)
        tl.store(psum_ptr + out, tl.sum(tl.exp(z - ref[:, None]), axis=1), mask=rmask)
        tl.store(pmin_ptr + out, tl.min(tl.where(mask, z, float("inf")), axis=1), mask=rmask)
        # The second largest (the max again if tied): bounds the mass below a value.
        cols = tl.arange(0, BLOCK_V)
        z2 = tl.where(cols[None, :] == barg[:, None], float("-inf"), z)
        tl.store(pmax2_ptr + out, tl.max(z2, axis=1), mask=rmask)


# ------------------------------------------------------------------------ 2. threshold


@triton.jit
def _fx(z, m, FXS: tl.constexpr):
    """exp(z - m) <= 1 as an int64 of FXS units (the vocabulary's worth fits 2^62). Sums
    of these are exact, so they do not depend on the order of the candidates, which the
    band compaction's atomics leave unspecified: the thresholds stay deterministic."""
    return (tl.exp(z - m) * FXS).to(tl.int64)


@triton.jit
def _select(
    logits_ptr, stride_lm, cand_ptr, stride_c, rows, active, t, m, V,
    floor_key, klo, khi, target_cnt, target_fx, src_big, nbig, hist_first,
    MASS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
    CAPB: tl.constexpr, NSPLIT: tl.constexpr, LOG2_NSPLIT: tl.constexpr,
    MAX_PASSES: tl.constexpr, CHUNK: tl.constexpr, FXS: tl.constexpr,
):  # fmt: skip
    """Per row, the threshold value and the kept mass (int64, FXS units; module
    docstring). Candidates are survivors (key >= floor_key) with key in (klo, khi];
    count mode finds the target_cnt-th largest value, mass mode the top-p cut: the
    largest v whose mass of values >= v reaches target_fx (float64, FXS units).

    Scratch row: [0, CAP) the candidates being resolved, [CAP, CAP + CAPB) the band's
    candidates. A row with src_big set reads its nbig band candidates there (the band
    kernel compacted them, or this search's first pass did); the others read the
    vocabulary row, and their first pass fills the band region when it fits."""
    cols = tl.arange(0, BLOCK)
    slots = tl.arange(0, CAP)
    dvec = tl.arange(0, NSPLIT)
    done = active == 0
    thr = tl.full([ROWS], float("-inf"), tl.float32)
    kept = tl.zeros([ROWS], tl.int64)
    above_c = tl.zeros([ROWS], tl.int32)
    above_m = tl.zeros([ROWS], tl.int64)
    cbase = cand_ptr + rows[:, None] * stride_c
    for it in range(MAX_PASSES):
        if tl.sum((done == 0).to(tl.int32), axis=0) > 0:
            live = done == 0
            from_big = live & (src_big > 0)
            fill = live & (src_big == 0) & (it == 0)  # this pass fills the band region
            out0 = tl.where(fill, CAP, 0)
            capr = tl.where(fill, CAPB, CAP)
            length = tl.max(tl.where(live, tl.where(from_big, nbig, V), 0), axis=0)
            # Reading the band region, the first pass is already a narrowing one.
            hist = (it > 0) | hist_first | (tl.sum(from_big.to(tl.int32), axis=0) > 0)
            shift = tl.maximum(_nbits(khi - klo - 1) - LOG2_NSPLIT, 0)
            gc = tl.zeros([ROWS, NSPLIT], tl.int32)
            gm = tl.zeros([ROWS, NSPLIT], tl.int64)
            n = tl.zeros([ROWS], tl.int32)
            tl.debug_barrier()  # the previous pass's scratch reads are finished
            for v0 in range(0, length, BLOCK):
                offs = v0 + cols
                mask_b = from_big[:, None] & (offs[None, :] < nbig[:, None])
                zb = tl.load(cbase + CAP + offs[None, :], mask=mask_b, other=float("-inf"))
                mask_l = (live & (from_big == 0))[:, None] & (offs < V)[None, :]
                zl = _load_z(logits_ptr, stride_lm, rows, offs, mask_l, t)
                z = tl.where(from_big[:, None], zb, zl)
                mask = mask_b | mask_l
                key = _key(z)
                surv = mask & (key >= floor_key[:, None])
                cand = surv & (key > klo[:, None]) & (key <= khi[:, None])
                if hist:
                    e = _fx(z, m[:, None], FXS)
                    # Suffix form: bucket >= d, so the scan below needs no cumsum.
                    b = (key - klo[:, None] - 1) >> shift[:, None]
                    ge = cand[:, :, None] & (b[:, :, None] >= dvec[None, None, :])
                    gc += tl.sum(ge.to(tl.int32), axis=1)
                    gm += tl.sum(tl.where(ge, e[:, :, None], 0), axis=1)
                ci = cand.to(tl.int32)
                if tl.min(n - capr, axis=0) <= 0:  # once every row overflowed, only count
                    idx = n[:, None] + tl.cumsum(ci, axis=1) - 1
                    tl.store(cbase + out0[:, None] + idx, z, mask=cand & (idx < capr[:, None]))
                n += tl.sum(ci, axis=1)
            # Candidates that fit: the answer is the largest candidate v whose count or
            # mass of values >= v (plus what lies above the interval) reaches the
            # target; pairwise in CHUNK slices, no sort (ties count whole by >=).
            small = live & (n <= CAP)
            tl.debug_barrier()  # compaction stores are visible to every thread
            valid = small[:, None] & (slots[None, :] < n[:, None])
            vals = tl.load(cbase + out0[:, None] + slots[None, :], mask=valid,
                           other=float("-inf"))  # fmt: skip
            ev = tl.where(valid, _fx(vals, m[:, None], FXS), 0)
            v_hit = tl.full([ROWS], float("-inf"), tl.float32)
            any_hit = tl.zeros([ROWS], tl.int32)
            for c0 in tl.static_range(0, CAP, CHUNK):
                ci = c0 + tl.arange(0, CHUNK)
                vi_ok = small[:, None] & (ci[None, :] < n[:, None])
                vi = tl.load(cbase + out0[:, None] + ci[None, :], mask=vi_ok,
                             other=float("-inf"))  # fmt: skip
                ge = valid[:, None, :] & (vals[:, None, :] >= vi[:, :, None])
                if MASS:
                    got = tl.sum(tl.where(ge, ev[:, None, :], 0), axis=2)
                    hit = vi_ok & ((above_m[:, None] + got).to(tl.float64) >= target_fx[:, None])
                else:
                    got = tl.sum(ge.to(tl.int32), axis=2)
                    hit = vi_ok & (above_c[:, None] + got >= target_cnt[:, None])
                v_hit = tl.maximum(v_hit, tl.max(tl.where(hit, vi, float("-inf")), axis=1))
                any_hit = tl.maximum(any_hit, tl.max(hit.to(tl.int32), axis=1))
            # Float rounding can leave the target unreached: keep every candidate.
            v_last = tl.min(tl.where(valid, vals, float("inf")), axis=1)
            v = tl.where(any_hit > 0, v_hit, v_last)
            kept_s = above_m + tl.sum(tl.where(valid & (vals >= v[:, None]), ev, 0), axis=1)
            thr = tl.where(small, v, thr)
            kept = tl.where(small, kept_s, kept)
            done = done | small
            # The rest: keep the bucket that holds the answer.
            narrow = live & (small == 0) & hist
            if MASS:
                ok = (above_m[:, None] + gm).to(tl.float64) >= target_fx[:, None]
            else:
                ok = above_c[:, None] + gc >= target_cnt[:, None]
            dstar = tl.max(tl.where(ok, dvec[None, :], -1), axis=1)
            lowest = tl.max(tl.where(gc == n[:, None], dvec[None, :], 0), axis=1)
            dstar = tl.where(dstar < 0, lowest, dstar)
            at_d = dvec[None, :] == dstar[:, None]
            nx_d = dvec[None, :] == dstar[:, None] + 1
            m_at = tl.sum(tl.where(at_d, gm, 0), axis=1)
            m_nx = tl.sum(tl.where(nx_d, gm, 0), axis=1)
            c_nx = tl.sum(tl.where(nx_d, gc, 0), axis=1)
            d64 = dstar.to(tl.int64)
            new_lo = klo + (d64 << shift)
            new_hi = tl.minimum(klo + ((d64 + 1) << shift), khi)
            single = narrow & (new_hi - new_lo == 1)
            thr = tl.where(single, _value(new_hi), thr)
            kept = tl.where(single, above_m + m_at, kept)
            done = done | single
            klo = tl.where(narrow, new_lo, klo)
            khi = tl.where(narrow, new_hi, khi)
            above_c = tl.where(narrow, above_c + c_nx, above_c)
            above_m = tl.where(narrow, above_m + m_nx, above_m)
            # Rows that filled the band region read it from now on, if it all fit.
            src_big = tl.where(fill & (n <= CAPB), 1, src_big)
            nbig = tl.where(fill, n, nbig)
    # Unreachable with MAX_PASSES from the launcher (the key width shrinks NSPLIT-fold
    # per pass); keep the interval's top value rather than garbage.
    thr = tl.where(done, thr, _value(khi))
    kept = tl.where(done, kept, above_m)
    return thr, kept, src_big, nbig


@triton.jit
def _band_floor(pm, ps, pmax2_ptr, rows, blocks, pmask, m, total, kept, p, z_lo, V, NB, BV):
    """Raise the top-p band's floor by bisection on a bound of the mass below a value L
    from the block partials: a block whose max is < L counts whole; one whose second
    largest is < L <= its max counts all but its max; else at most min(the mass beyond
    its top two, (block size - 2) * e(L)). Where the bound stays under (1 - top_p) *
    the kept mass, less rounding slack, every token below L is cut. A peaked row (most
    of each block's mass in its top one or two tokens) gets a floor just under its top
    tokens: at V 49152, ~100 candidates instead of ~15000 for the V-wide bound."""
    pm2 = tl.load(pmax2_ptr + rows[:, None] * NB + blocks[None, :], mask=pmask,
                  other=float("-inf"))  # fmt: skip
    top1 = tl.where(pm == float("-inf"), 0.0, tl.exp(pm - m[:, None]))
    top2 = tl.where(pm2 == float("-inf"), 0.0, tl.exp(pm2 - m[:, None]))
    mass = ps * top1
    but_max = tl.maximum(mass - top1, 0.0)
    rest = tl.maximum(mass - top1 - top2, 0.0)
    others = tl.maximum(tl.minimum(BV, V - blocks * BV) - 2, 0).to(tl.float32)[None, :]
    # 0.1% and 1e-5 of the row's mass: far above float32 rounding of these sums.
    budget = 0.999 * (1.0 - p) * kept - 1e-5 * total
    lo = z_lo
    hi = m
    for _ in tl.static_range(20):
        mid = 0.5 * (lo + hi)
        below = tl.where(pm < mid[:, None], mass, 0.0)
        below += tl.where((pm >= mid[:, None]) & (pm2 < mid[:, None]), but_max, 0.0)
        cap = tl.minimum(rest, others * tl.exp(mid - m)[:, None])
        below += tl.where(pm2 >= mid[:, None], cap, 0.0)
        ok = tl.sum(tl.where(pmask, below, 0.0), axis=1) <= budget
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo


@triton.jit
def _row_stats(pmax_ptr, psum_ptr, rows, rmask, blocks, pmask, NB):
    pm = tl.load(pmax_ptr + rows[:, None] * NB + blocks[None, :], mask=pmask, other=float("-inf"))
    ps = tl.load(psum_ptr + rows[:, None] * NB + blocks[None, :], mask=pmask, other=0.0)
    m = tl.where(rmask, tl.max(pm, axis=1), 0.0)  # finite on rows past the batch
    scale = tl.where(pm == float("-inf"), 0.0, tl.exp(pm - m[:, None]))
    total = tl.sum(ps * scale, axis=1)
    return pm, ps, m, total


@triton.jit
def _row_filter(greedy_ptr, temp_ptr, topk_ptr, topp_ptr, rows, rmask, K1, V):
    req = rows // K1
    g = tl.load(greedy_ptr + req, mask=rmask, other=1) != 0
    t = tl.where(g, 1.0, tl.load(temp_ptr + req, mask=rmask, other=1.0))
    k = tl.load(topk_ptr + req, mask=rmask, other=0)
    p = tl.load(topp_ptr + req, mask=rmask, other=1.0)
    use_k = rmask & (g == 0) & (k > 0) & (k < V)
    use_p = rmask & (g == 0) & (p < 1.0)
    return t, k, p, use_k, use_p


@triton.jit
def _init_kernel(
    greedy_ptr, temp_ptr, topk_ptr, topp_ptr,
    pmax_ptr, psum_ptr, pmin_ptr, pmax2_ptr, rmax_ptr, rthr_ptr, rsum_ptr,
    blo_ptr, bon_ptr, bcnt_ptr, bin_ptr, bbelow_ptr,
    num_rows, V, K1, NB, BV,
    ROWS: tl.constexpr, NBP: tl.constexpr, FILTER: tl.constexpr,
):  # fmt: skip
    """Row max and mass from the partials; with FILTER, each filtered row's band: the
    key interval (lo, key(max)] that the band kernel compacts. Top-k rows: lo below the
    k-th largest of the block maxima and second maxima (k of them reach it, so t_k is at
    least that); top-p rows: lo at the floor below which every token is cut."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < num_rows
    blocks = tl.arange(0, NBP)
    pmask = rmask[:, None] & (blocks < NB)[None, :]
    pm, ps, m, total = _row_stats(pmax_ptr, psum_ptr, rows, rmask, blocks, pmask, NB)
    tl.store(rmax_ptr + rows, m, mask=rmask)
    tl.store(rthr_ptr + rows, tl.full([ROWS], float("-inf"), tl.float32), mask=rmask)
    tl.store(rsum_ptr + rows, total, mask=rmask)
    if FILTER:
        t, k, p, use_k, use_p = _row_filter(greedy_ptr, temp_ptr, topk_ptr, topp_ptr, rows,
                                            rmask, K1, V)  # fmt: skip
        lo = tl.full([ROWS], KEY_NEG_INF, tl.int64)
        if tl.sum(use_k.to(tl.int32), axis=0) > 0:
            pm2 = tl.load(pmax2_ptr + rows[:, None] * NB + blocks[None, :], mask=pmask,
                          other=float("-inf"))  # fmt: skip
            # Pairwise counts (no tl.sort: slow interpreted) of maxima and second maxima
            # (distinct tokens) >= each of them.
            c1 = tl.sum((pm[:, None, :] >= pm[:, :, None]).to(tl.int32), axis=2)
            c1 += tl.sum((pm2[:, None, :] >= pm[:, :, None]).to(tl.int32), axis=2)
            c2 = tl.sum((pm[:, None, :] >= pm2[:, :, None]).to(tl.int32), axis=2)
            c2 += tl.sum((pm2[:, None, :] >= pm2[:, :, None]).to(tl.int32), axis=2)
            kth = tl.maximum(
                tl.max(tl.where(pmask & (c1 >= k[:, None]), pm, float("-inf")), axis=1),
                tl.max(tl.where(pmask & (c2 >= k[:, None]), pm2, float("-inf")), axis=1),
            )
            zmin = tl.min(tl.load(pmin_ptr + rows[:, None] * NB + blocks[None, :], mask=pmask,
                                  other=float("inf")), axis=1)  # fmt: skip
            lb = tl.where(kth > float("-inf"), kth, zmin)
            lo = tl.where(use_k, _key(tl.where(lb == 0.0, 0.0, lb)) - 1, lo)
        p_only = use_p & (use_k == 0)
        if tl.sum(p_only.to(tl.int32), axis=0) > 0:
            # Tokens with e < (1 - top_p) * mass / V together hold under (1 - top_p) of
            # the mass, so the cut is above them (one e of margin for rounding).
            z_lo = m + tl.log(tl.where(p_only, (1.0 - p) * total / V, 1.0)) - 1.0
            z_lo = _band_floor(pm, ps, pmax2_ptr, rows, blocks, pmask, m, total, total, p, z_lo,
                               V, NB, BV)  # fmt: skip
            lo = tl.where(p_only, _key(tl.where(z_lo == 0.0, 0.0, z_lo)) - 1, lo)
        tl.store(blo_ptr + rows, lo, mask=rmask)
        tl.store(bon_ptr + rows, (use_k | use_p).to(tl.int32), mask=rmask)
        tl.store(bcnt_ptr + rows, tl.zeros([ROWS], tl.int32), mask=rmask)
        tl.store(bin_ptr + rows, tl.zeros([ROWS], tl.int64), mask=rmask)
        tl.store(bbelow_ptr + rows, tl.zeros([ROWS], tl.int64), mask=rmask)


@triton.jit
def _band_kernel(
    logits_ptr, stride_lm, greedy_ptr, temp_ptr, rmax_ptr, blo_ptr, bon_ptr,
    bcnt_ptr, bin_ptr, bbelow_ptr, cand_ptr, stride_c, num_rows, V, K1,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr, CAP: tl.constexpr, CAPB: tl.constexpr,
    FXS: tl.constexpr,
):  # fmt: skip
    """(rows x vocabulary blocks): compact each filtered row's band candidates into its
    scratch row (offsets from a per-row atomic counter, so in no fixed order) and add up
    the mass inside and below the band (int64: exact, order-free)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < num_rows
    on = tl.load(bon_ptr + rows, mask=rmask, other=0) != 0
    if tl.sum(on.to(tl.int32), axis=0) == 0:
        return
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    req = rows // K1
    g = tl.load(greedy_ptr + req, mask=on, other=1) != 0
    t = tl.where(g, 1.0, tl.load(temp_ptr + req, mask=on, other=1.0))
    m = tl.load(rmax_ptr + rows, mask=on, other=0.0)
    lo = tl.load(blo_ptr + rows, mask=on, other=0)
    hi = _key(m)
    mask = on[:, None] & (offs < V)[None, :]
    z = _load_z(logits_ptr, stride_lm, rows, offs, mask, t)
    key = _key(z)
    cand = mask & (key > lo[:, None]) & (key <= hi[:, None])
    e = _fx(z, m[:, None], FXS)
    inside = tl.sum(tl.where(cand, e, 0), axis=1)
    below = tl.sum(tl.where(mask & (key <= lo[:, None]), e, 0), axis=1)
    tl.atomic_add(bin_ptr + rows, inside, mask=on & (inside > 0))
    tl.atomic_add(bbelow_ptr + rows, below, mask=on & (below > 0))
    ci = cand.to(tl.int32)
    cnt = tl.sum(ci, axis=1)
    base = tl.atomic_add(bcnt_ptr + rows, cnt, mask=on & (cnt > 0))
    idx = base[:, None] + tl.cumsum(ci, axis=1) - 1
    ptrs = cand_ptr + rows[:, None] * stride_c + CAP + idx
    tl.store(ptrs, z, mask=cand & (cnt > 0)[:, None] & (idx < CAPB))


@triton.jit
def _threshold_kernel(
    logits_ptr, stride_lm, greedy_ptr, temp_ptr, topk_ptr, topp_ptr,
    pmax_ptr, psum_ptr, pmax2_ptr, rthr_ptr, rsum_ptr,
    blo_ptr, bcnt_ptr, bin_ptr, bbelow_ptr, cand_ptr, stride_c,
    num_rows, V, K1, NB, BV,
    ROWS: tl.constexpr, NBP: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
    CAPB: tl.constexpr, NSPLIT: tl.constexpr, LOG2_NSPLIT: tl.constexpr,
    MAX_PASSES: tl.constexpr, CHUNK: tl.constexpr, FXS: tl.constexpr,
):  # fmt: skip
    """Filtered rows' thresholds and kept mass, from the band the band kernel compacted
    (or from the vocabulary row where the band overflowed the scratch)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < num_rows
    blocks = tl.arange(0, NBP)
    pmask = rmask[:, None] & (blocks < NB)[None, :]
    t, k, p, use_k, use_p = _row_filter(greedy_ptr, temp_ptr, topk_ptr, topp_ptr, rows, rmask,
                                        K1, V)  # fmt: skip
    if tl.sum((use_k | use_p).to(tl.int32), axis=0) == 0:
        return
    pm, ps, m, total = _row_stats(pmax_ptr, psum_ptr, rows, rmask, blocks, pmask, NB)
    on = use_k | use_p
    lo = tl.load(blo_ptr + rows, mask=on, other=0)
    nbig = tl.load(bcnt_ptr + rows, mask=on, other=0)
    src = (on & (nbig <= CAPB)).to(tl.int32)
    band_fx = tl.load(bin_ptr + rows, mask=on, other=0) + tl.load(bbelow_ptr + rows, mask=on,
                                                                   other=0)  # fmt: skip
    key_m = _key(m)
    all_keys = tl.full([ROWS], KEY_NEG_INF, tl.int64)
    thr = tl.full([ROWS], float("-inf"), tl.float32)
    kept = band_fx
    if tl.sum(use_k.to(tl.int32), axis=0) > 0:
        thr_k, kept_k, src, nbig = _select(
            logits_ptr, stride_lm, cand_ptr, stride_c, rows, use_k, t, m, V,
            all_keys, lo, key_m, k, tl.zeros([ROWS], tl.float64), src, nbig, True,
            False, ROWS, BLOCK, CAP, CAPB, NSPLIT, LOG2_NSPLIT, MAX_PASSES, CHUNK, FXS,
        )  # fmt: skip
        thr = tl.where(use_k, thr_k, thr)
        kept = tl.where(use_k, kept_k, kept)
    if tl.sum(use_p.to(tl.int32), axis=0) > 0:
        floor_key = tl.where(use_k, _key(thr), all_keys)
        if tl.sum((use_p & use_k).to(tl.int32), axis=0) > 0:
            # After top-k the band floor depends on the kept mass: found here.
            kept_f = (kept.to(tl.float64) * (1.0 / FXS)).to(tl.float32)
            z_lo = m + tl.log(tl.where(use_p, (1.0 - p) * kept_f / V, 1.0)) - 1.0
            z_lo = _band_floor(pm, ps, pmax2_ptr, rows, blocks, pmask, m, total, kept_f, p,
                               z_lo, V, NB, BV)  # fmt: skip
            lo_k = tl.maximum(_key(tl.where(z_lo == 0.0, 0.0, z_lo)), floor_key) - 1
            lo = tl.where(use_k, lo_k, lo)
        target = p.to(tl.float64) * kept.to(tl.float64)
        thr_p, kept_p, src, nbig = _select(
            logits_ptr, stride_lm, cand_ptr, stride_c, rows, use_p, t, m, V,
            floor_key, lo, key_m, k, target, src, nbig, False,
            True, ROWS, BLOCK, CAP, CAPB, NSPLIT, LOG2_NSPLIT, MAX_PASSES, CHUNK, FXS,
        )  # fmt: skip
        thr = tl.where(use_p, thr_p, thr)
        kept = tl.where(use_p, kept_p, kept)
    kept_f = (kept.to(tl.float64) * (1.0 / FXS)).to(tl.float32)
    tl.store(rthr_ptr + rows, thr, mask=on)
    tl.store(rsum_ptr + rows, kept_f, mask=on)


# ----------------------------------------------------------------------------- the walk


@triton.jit
def _walk(
    req, rmask, drafts_ptr, stride_db, logits_ptr, stride_lm, q_ptr, stride_qb, stride_qk,
    greedy, t, seed, pos, rmax_ptr, rthr_ptr, rsum_ptr, pmax_ptr, parg_ptr, K, V, NB,
    KP: tl.constexpr, NBP: tl.constexpr, SAMPLED: tl.constexpr, NEED_GREEDY: tl.constexpr,
    ACCEPT_MUL: tl.constexpr,
):  # fmt: skip
    """Drafts [R, KP] (-1 past K), k and r (first rejected position, k if none) per
    request. Every decision of a request is independent of the others, so the walk is a
    parallel test of all K drafts followed by a min, not a loop."""
    j = tl.arange(0, KP)
    jm = rmask[:, None] & (j < K)[None, :]
    d = tl.load(drafts_ptr + req[:, None] * stride_db + j[None, :], mask=jm, other=-1)
    k = tl.min(tl.where((d == -1) | (jm == 0), j[None, :], K), axis=1)
    present = j[None, :] < k[:, None]
    in_vocab = (d >= 0) & (d < V)
    live = present & in_vocab  # ids outside the vocabulary are read nowhere, never accepted
    dc = tl.where(in_vocab, d, 0)
    row = req[:, None] * (K + 1) + j[None, :]
    acc = tl.zeros([req.shape[0], KP], tl.int1)
    amx = tl.zeros([req.shape[0], KP], tl.int64)
    if NEED_GREEDY:
        # Every row's argmax (rows 0..K: the bonus row's too, for _finish), its block
        # maxima and their indices read together, so no load waits on another.
        blocks = tl.arange(0, NBP)
        pptr = row[:, :, None] * NB + blocks[None, None, :]
        rows_ok = rmask[:, None] & (j <= K)[None, :]
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
        px = tl.math.div_rn(tl.where(z >= thr, tl.exp(z - m), 0.0), tot)
        qptrs = q_ptr + req[:, None] * stride_qb + j[None, :] * stride_qk + dc
        qx = tl.load(qptrs, mask=live, other=1.0)
        h = _stream_key(seed[:, None], pos[:, None] + j[None, :], ACCEPT_MUL)
        u = _uniform(h, tl.zeros([req.shape[0], KP], tl.uint64))
        # min(1, p/q) > u; p >= q accepts outright, p == 0 never.
        acc_s = (px > 0.0) & ((px >= qx) | (u * qx < px))
        if NEED_GREEDY:
            acc = tl.where(greedy[:, None], acc, acc_s)
        else:
            acc = acc_s
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


# ------------------------------------------------------------------------- 3. resample


@triton.jit
def _resample_kernel(
    logits_ptr, stride_lm, drafts_ptr, stride_db, q_ptr, stride_qb, stride_qk,
    greedy_ptr, temp_ptr, seed_ptr, pos_ptr, rmax_ptr, rthr_ptr, rsum_ptr,
    rval_ptr, ridx_ptr, B, K, V, NB2,
    ROWS: tl.constexpr, KP: tl.constexpr, BLOCK_V: tl.constexpr,
    ACCEPT_MUL: tl.constexpr, RESIDUAL_MUL: tl.constexpr, BONUS_MUL: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    blk = tl.program_id(1)
    rmask = req < B
    greedy, t, seed, pos = _load_request(req, rmask, greedy_ptr, temp_ptr, seed_ptr, pos_ptr,
                                         True)  # fmt: skip
    # Padded (position < 0) and greedy requests need no race.
    racing = rmask & (greedy == 0) & (pos >= 0)
    if tl.sum(racing.to(tl.int32), axis=0) == 0:
        return
    _, k, r, _ = _walk(
        req, racing, drafts_ptr, stride_db, logits_ptr, stride_lm, q_ptr, stride_qb,
        stride_qk, greedy, t, seed, pos, rmax_ptr, rthr_ptr, rsum_ptr, rmax_ptr, rmax_ptr,
        K, V, 1, KP, 1, True, False, ACCEPT_MUL,
    )  # fmt: skip
    row = req * (K + 1) + r
    offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = racing[:, None] & (offs < V)[None, :]
    z = _load_z(logits_ptr, stride_lm, row, offs, mask, t)
    m = tl.load(rmax_ptr + row, mask=racing, other=0.0)
    thr = tl.load(rthr_ptr + row, mask=racing, other=0.0)
    tot = tl.load(rsum_ptr + row, mask=racing, other=1.0)
    p = tl.math.div_rn(tl.where(z >= thr[:, None], tl.exp(z - m[:, None]), 0.0), tot[:, None])
    residual = r < k
    qrow = tl.minimum(r, K - 1)  # a bonus row has no q row; nothing is read for it
    qptrs = q_ptr + req[:, None] * stride_qb + qrow[:, None] * stride_qk + offs[None, :]
    qv = tl.load(qptrs, mask=mask & residual[:, None], other=0.0)
    w = tl.where(residual[:, None], tl.maximum(p - qv, 0.0), p)
    h = _stream_key(seed, pos + r, tl.where(residual, RESIDUAL_MUL, BONUS_MUL))
    u = _uniform(h[:, None], offs[None, :].to(tl.uint64))
    ratio = tl.where(mask, tl.math.div_rn(w, _exponential(u)), -1.0)
    best, arg = tl.max(ratio, axis=1, return_indices=True, return_indices_tie_break_left=True)
    tl.store(rval_ptr + req * NB2 + blk, best, mask=racing)
    tl.store(ridx_ptr + req * NB2 + blk, (arg + blk * BLOCK_V).to(tl.int32), mask=racing)


# ------------------------------------------------------------------------- 4. finalize


@triton.jit
def _finalize_kernel(
    logits_ptr, stride_lm, drafts_ptr, stride_db, q_ptr, stride_qb, stride_qk,
    greedy_ptr, temp_ptr, seed_ptr, pos_ptr, rmax_ptr, rthr_ptr, rsum_ptr,
    pmax_ptr, parg_ptr, rval_ptr, ridx_ptr,
    tokens_ptr, stride_tb, nacc_ptr, nemit_ptr, cprop_ptr, cacc_ptr,
    B, K, V, NB, NB2,
    ROWS: tl.constexpr, KP: tl.constexpr, NBP: tl.constexpr, NB2P: tl.constexpr,
    SAMPLED: tl.constexpr, ACCEPT_MUL: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    _finish(
        req, req < B, logits_ptr, stride_lm, drafts_ptr, stride_db, q_ptr, stride_qb,
        stride_qk, greedy_ptr, temp_ptr, seed_ptr, pos_ptr, rmax_ptr, rthr_ptr, rsum_ptr,
        pmax_ptr, parg_ptr, rval_ptr, ridx_ptr, tokens_ptr, stride_tb, nacc_ptr, nemit_ptr,
        cprop_ptr, cacc_ptr, K, V, NB, NB2, KP, NBP, NB2P, SAMPLED, ACCEPT_MUL,
    )  # fmt: skip


@triton.jit
def _finish(
    req, rmask, logits_ptr, stride_lm, drafts_ptr, stride_db, q_ptr, stride_qb, stride_qk,
    greedy_ptr, temp_ptr, seed_ptr, pos_ptr, rmax_ptr, rthr_ptr, rsum_ptr,
    pmax_ptr, parg_ptr, rval_ptr, ridx_ptr,
    tokens_ptr, stride_tb, nacc_ptr, nemit_ptr, cprop_ptr, cacc_ptr,
    K, V, NB, NB2,
    KP: tl.constexpr, NBP: tl.constexpr, NB2P: tl.constexpr,
    SAMPLED: tl.constexpr, ACCEPT_MUL: tl.constexpr,
):  # fmt: skip
    """Requests `req` (rmask): the walk over their drafts, then the tokens, counts and
    counters written."""
    greedy, t, seed, pos = _load_request(req, rmask, greedy_ptr, temp_ptr, seed_ptr, pos_ptr,
                                         SAMPLED)  # fmt: skip
    real = rmask & (pos >= 0)
    d, k, r, amx = _walk(
        req, real, drafts_ptr, stride_db, logits_ptr, stride_lm, q_ptr, stride_qb, stride_qk,
        greedy, t, seed, pos, rmax_ptr, rthr_ptr, rsum_ptr, pmax_ptr, parg_ptr, K, V, NB,
        KP, NBP, SAMPLED, True, ACCEPT_MUL,
    )  # fmt: skip
    # The target's argmax of row r (greedy token; fallback for a degenerate residual).
    jj = tl.arange(0, KP)  # KP >= K + 1: one tile holds the whole token row
    token = tl.sum(tl.where(jj[None, :] == r[:, None], amx, 0), axis=1)
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
    STAGES: tl.constexpr, PER_ROW: tl.constexpr,
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
    order and loads no padding rows (KP > K + 1)."""
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
    base = logits_ptr + rows[:, None] * stride_lm
    lane = tl.arange(0, SUB)
    lo = blk * BLOCK_V
    best = tl.full([rows.shape[0], SUB], float("-inf"), tl.float32)
    where = tl.zeros([rows.shape[0], SUB], tl.int32) + (lo + lane)[None, :]
    for c in tl.range(0, BLOCK_V, SUB, num_stages=STAGES):
        offs = lo + c + lane
        mask = rmask[:, None] & (offs < V)[None, :]
        z = tl.load(base + offs[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        up = z > best  # strict: a lane keeps its first index of a tie
        best = tl.where(up, z, best)
        where = tl.where(up, offs[None, :], where)
    bmax = tl.max(best, axis=1)
    barg = tl.min(tl.where(best == bmax[:, None], where, 2147483647), axis=1)
    out = rows * NB + blk
    tl.store(pmax_ptr + out, bmax, mask=rmask)
    tl.store(parg_ptr + out, barg, mask=rmask)
    ticket = tl.atomic_add(done_ptr + req, 1, sem="acq_rel")
    if ticket == programs - 1:
        tl.store(done_ptr + req, 0)
        one = req + tl.arange(0, 1)
        _finish(
            one, one >= 0, logits_ptr, stride_lm, drafts_ptr, stride_db, logits_ptr, 0, 0,
            pos_ptr, pos_ptr, pos_ptr, pos_ptr, pmax_ptr, pmax_ptr, pmax_ptr, pmax_ptr,
            parg_ptr, pmax_ptr, parg_ptr, tokens_ptr, stride_tb, nacc_ptr, nemit_ptr,
            cprop_ptr, cacc_ptr, K, V, NB, 1, KP, NBP, 1, False, 0,
        )  # fmt: skip


# -------------------------------------------------------------------------- launcher


@dataclass(frozen=True)
class RejectionConfig:
    """Tile sizes (all powers of two). block_v / rows_p: partials tile; block_t / rows_t:
    threshold chunk; cap: candidates resolved pairwise; cap_big: band candidates per row
    that the band kernel compacts and the search reads instead of the row (16384 on the
    GPU: the N(0, 3^2) top-p 0.9 band at V 49152 is ~11k tokens); nsplit: key buckets per
    narrowing pass; block_r / rows_r: race tile; rows_w: requests per finalize program."""

    block_v: int
    rows_p: int
    block_t: int
    rows_t: int
    cap: int
    cap_big: int
    nsplit: int
    block_r: int
    rows_r: int
    rows_w: int
    block_g: int | None = None  # the all-greedy launch's vocabulary tile (None: block_v)
    sub_g: int | None = None  # columns it reads per loop iteration (None: the whole tile)
    warps_g: int | None = None  # its warps (None: by tile size)
    stages_g: int = 1  # its loop's pipelining depth
    row_g: bool = False  # one target row per program (else a request's K + 1 rows); the
    # grid's second dimension is then B * (K + 1) <= 65535

    @property
    def max_passes(self) -> int:
        # Key widths start below 2^33 and shrink nsplit-fold per narrowing pass; one
        # more for the first, compaction-only pass.
        return -(-33 // (self.nsplit.bit_length() - 1)) + 2


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
    block_t = min(_p2(vocab), 16 if INTERPRET else 1024)
    block_r = min(_p2(vocab), 2048)
    kp = _p2(k_max + 1)
    nb = _p2(-(-vocab // block_v))
    # The threshold search holds [rows, block, nsplit] one-hot tiles on the GPU.
    tile_t = tile if INTERPRET else tile // 8
    # The all-greedy launch (H200, stop 23 sweeps): ~256 programs or more, 1024-column
    # tiles at batch 1; with many rows, one row per program and ~1500 programs of up to
    # 32k columns read 2048 at a time (B 64, K 5, V 49152: 16384 columns).
    many = min(32768, _p2(vocab * rows // 1536))
    block_g = min(_p2(vocab), max(1024, min(4096, _p2(vocab * num_reqs // 256)), many))
    return RejectionConfig(
        block_v=block_v,
        rows_p=max(1, min(tile // block_v, _p2(rows))),
        block_t=block_t,
        rows_t=max(1, min(tile_t // block_t, _p2(rows))),
        cap=_p2(cap) if cap is not None else min(256, _p2(vocab)),
        cap_big=min(1024 if INTERPRET else 16384, _p2(vocab)),
        nsplit=8,
        block_r=block_r,
        rows_r=max(1, min(tile // block_r, _p2(num_reqs))),
        rows_w=max(1, min(tile // (kp * nb), _p2(num_reqs), 1024 if INTERPRET else 64)),
        block_g=block_v if INTERPRET else block_g,
        sub_g=None if INTERPRET else min(block_g, 2048 if block_g >= 16384 else 512),
        warps_g=None if INTERPRET else (8 if block_g >= 16384 else 4),
        stages_g=1,
        row_g=not INTERPRET and rows >= 16,
    )


@dataclass
class RejectionWorkspace:
    """Scratch the launches share, allocated once (graphs keep its addresses):
    per (row, vocab block) partials, per-row max / threshold / kept mass, the
    candidate scratch of the threshold search with its band state (reset by the init
    kernel on every call) and the per-block race winners."""

    config: RejectionConfig
    vocab: int
    part_max: torch.Tensor  # [rows, nb] float32
    part_arg: torch.Tensor  # [rows, nb] int32
    part_sum: torch.Tensor  # [rows, nb] float32
    part_min: torch.Tensor  # [rows, nb] float32
    part_max2: torch.Tensor  # [rows, nb] float32: second largest
    row_max: torch.Tensor  # [rows] float32
    row_thr: torch.Tensor  # [rows] float32
    row_sum: torch.Tensor  # [rows] float32
    cand: torch.Tensor  # [rows, cap + cap_big] float32
    band_lo: torch.Tensor  # [rows] int64: key below each filtered row's band
    band_on: torch.Tensor  # [rows] int32: the row is filtered
    band_cnt: torch.Tensor  # [rows] int32: band candidates (compacted while <= cap_big)
    band_in: torch.Tensor  # [rows] int64: mass inside the band, fixed point
    band_below: torch.Tensor  # [rows] int64: mass below the band, fixed point
    race_val: torch.Tensor  # [reqs, nb2] float32
    race_idx: torch.Tensor  # [reqs, nb2] int32
    done: torch.Tensor  # [reqs] int32: the greedy launch's tickets, zero between calls

    @classmethod
    def allocate(
        cls, num_reqs: int, k_max: int, vocab: int, device, config: RejectionConfig | None = None
    ) -> RejectionWorkspace:
        cfg = config or choose_rejection_config(vocab, num_reqs, k_max)
        rows = num_reqs * (k_max + 1)
        nb, nb2 = -(-vocab // cfg.block_v), -(-vocab // cfg.block_r)
        f32 = {"device": device, "dtype": torch.float32}
        i32 = {"device": device, "dtype": torch.int32}
        return cls(
            cfg, vocab,
            torch.empty(rows, nb, **f32), torch.empty(rows, nb, **i32),
            torch.empty(rows, nb, **f32), torch.empty(rows, nb, **f32),
            torch.empty(rows, nb, **f32),
            torch.empty(rows, **f32), torch.empty(rows, **f32), torch.empty(rows, **f32),
            torch.empty(rows, cfg.cap + cfg.cap_big, **f32),
            torch.empty(rows, device=device, dtype=torch.int64), torch.empty(rows, **i32),
            torch.empty(rows, **i32), torch.empty(rows, device=device, dtype=torch.int64),
            torch.empty(rows, device=device, dtype=torch.int64),
            torch.empty(num_reqs, nb2, **f32), torch.empty(num_reqs, nb2, **i32),
            torch.zeros(num_reqs, **i32),
        )  # fmt: skip


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

    def add(self, launches: list, grid, args, num_warps) -> None:
        """Append this kernel's launch (cached launcher, key, grid, args, options)."""
        key = specialization_key(args) + (num_warps,)
        launches.append((self._cached, key, grid, args, {"num_warps": num_warps}))


_PARTIALS = _Launcher(_partials_kernel)
_INIT = _Launcher(_init_kernel)
_BAND = _Launcher(_band_kernel)
_THRESHOLD = _Launcher(_threshold_kernel)
_RESAMPLE = _Launcher(_resample_kernel)
_FINALIZE = _Launcher(_finalize_kernel)
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
    is the caller's host-side promise that no request uses top-k or top-p.

    No host read (draft-id values are checked only in validation mode, never during
    capture), fixed grids: capturable in a CUDA graph per (B, K, V)."""
    tensors = (target_logits, draft_tokens, draft_probs, greedy, temperature, top_k, top_p,
               seed, positions, out_tokens, out_num_accepted, out_num_emitted,
               proposed_counts, accepted_counts)  # fmt: skip
    # The same buffers step after step: the checks and the launch arguments are made once
    # per buffer set. A plan holds its tensors, so their memory (hence a matching
    # signature) cannot belong to other tensors while it is cached.
    sig = (*(_geometry(t) for t in tensors), id(workspace), bool(any_filter), tuple(streams))
    plan = _PLANS.get(sig)
    if plan is None or plan[0] is not workspace:
        plan = _plan(*tensors, workspace, any_filter, streams)
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
    accepted_counts, workspace, any_filter, streams,
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
        sub = min(cfg.sub_g or bg, bg)
        nbg = triton.cdiv(v, bg)
        per_row = bool(cfg.row_g) and rows <= 65535  # the grid's second dimension
        warps = cfg.warps_g or (8 if (1 if per_row else kp) * sub >= 8192 else 4)
        _GREEDY.add(
            launches,
            (nbg, rows) if per_row else (b, nbg),
            (target_logits, lm, draft_tokens, draft_tokens.stride(0), positions, ws.part_max,
             ws.part_arg, ws.done, out_tokens, out_tokens.stride(0), out_num_accepted,
             out_num_emitted, proposed_counts, accepted_counts, k, v, nbg, kp, bg, sub,
             _p2(nbg), cfg.stages_g, per_row),
            warps,
        )  # fmt: skip
        return workspace, b, v, launches
    _PARTIALS.add(
        launches,
        (triton.cdiv(rows, cfg.rows_p), triton.cdiv(v, cfg.block_v)),
        (target_logits, lm, greedy, temperature, ws.part_max, ws.part_arg, ws.part_sum,
         ws.part_min, ws.part_max2, rows, v, k + 1, nb, cfg.rows_p, cfg.block_v, sampled),
        4,
    )  # fmt: skip
    if sampled:
        nbp = _p2(nb)
        _INIT.add(
            launches,
            (triton.cdiv(rows, cfg.rows_t),),
            (greedy, temperature, top_k, top_p, ws.part_max, ws.part_sum, ws.part_min,
             ws.part_max2, ws.row_max, ws.row_thr, ws.row_sum, ws.band_lo, ws.band_on,
             ws.band_cnt, ws.band_in, ws.band_below, rows, v, k + 1, nb, cfg.block_v,
             cfg.rows_t, nbp, bool(any_filter)),
            4,
        )  # fmt: skip
    if sampled and any_filter:
        fxs = float(2 ** (62 - (v - 1).bit_length()))  # v * 2^S <= 2^62: int64 sums fit
        _BAND.add(
            launches,
            (triton.cdiv(rows, cfg.rows_p), triton.cdiv(v, cfg.block_v)),
            (target_logits, lm, greedy, temperature, ws.row_max, ws.band_lo, ws.band_on,
             ws.band_cnt, ws.band_in, ws.band_below, ws.cand, ws.cand.stride(0), rows, v,
             k + 1, cfg.rows_p, cfg.block_v, cfg.cap, cfg.cap_big, fxs),
            4,
        )  # fmt: skip
        _THRESHOLD.add(
            launches,
            (triton.cdiv(rows, cfg.rows_t),),
            (target_logits, lm, greedy, temperature, top_k, top_p, ws.part_max, ws.part_sum,
             ws.part_max2, ws.row_thr, ws.row_sum, ws.band_lo, ws.band_cnt, ws.band_in,
             ws.band_below, ws.cand, ws.cand.stride(0), rows, v, k + 1, nb, cfg.block_v,
             cfg.rows_t, nbp, cfg.block_t, cfg.cap, cfg.cap_big, cfg.nsplit,
             cfg.nsplit.bit_length() - 1, cfg.max_passes, min(cfg.cap, 32), fxs),
            8 if cfg.block_t >= 1024 else 4,
        )  # fmt: skip
    if sampled:
        _RESAMPLE.add(
            launches,
            (triton.cdiv(b, cfg.rows_r), nb2),
            (target_logits, lm, draft_tokens, draft_tokens.stride(0), q, *sq, greedy,
             temperature, seed, positions, ws.row_max, ws.row_thr, ws.row_sum, ws.race_val,
             ws.race_idx, b, k, v, nb2, cfg.rows_r, kp, cfg.block_r, mul_a, mul_r, mul_b),
            8 if cfg.block_r >= 2048 else 4,
        )  # fmt: skip
    _FINALIZE.add(
        launches,
        (triton.cdiv(b, cfg.rows_w),),
        (target_logits, lm, draft_tokens, draft_tokens.stride(0), q, *sq, greedy, temperature,
         seed, positions, ws.row_max, ws.row_thr, ws.row_sum, ws.part_max, ws.part_arg,
         ws.race_val, ws.race_idx, out_tokens, out_tokens.stride(0), out_num_accepted,
         out_num_emitted, proposed_counts, accepted_counts, b, k, v, nb, nb2, cfg.rows_w, kp,
         _p2(nb), _p2(nb2), sampled, mul_a),
        4,
    )  # fmt: skip
    return workspace, b, v, launches
