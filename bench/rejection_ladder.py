"""Where the rejection sampler's full-width passes and its cut spend their time (issue 12).

The sampler's partials pass reads every target row once (B 64, K 5, V 49152: 384 bf16
rows, 37.7 MB) and took 31 µs on the H200 (stop 25), 3.5x its bytes at the read
bandwidth; its race reads one row of logits and q per request and took 35 µs. This
benchmark times ladders of stand-in kernels over the same data, each rung adding one
piece of the real pass, so the cost of each piece shows:

- partials, per (rows, vocabulary block) program: `read` (a sum), `max`, `argmax` (max
  and first index), `+expsum` (sum of exp(z - block max)), `+min` (smallest value),
  `+screen` (mass and count above the row's draft value: the sampler's screen); for
  several tiles (rows x columns, warps), the sampler's own being 4 x 1024 at 8 warps;
- race, per (request, vocabulary block) program over `sub`-wide slices: `read` (logits
  and q), `+p` (the filtered p = exp(z - m) / mass, residual max(p - q, 0)), `+hash`
  (the keyed uniform per element), `+race` (E = -log1p(-u), ratio, running argmax),
  `+race nz` (the race with both divisions skipping zero dividends, as the sampler's
  race does since stop 47: whether a zero dividend costs div_rn its slow path). Each
  race rung runs unfiltered and with a threshold that keeps ~5% of a row ("cut": most
  p, hence most dividends, zero, as under top-p).

- cut, one program a row (as the sampler's one-pass bracket, 16 warps, 2048-column
  chunks) over each request's first row, a bracket of ~1024 values placed around the
  row's top-p 0.9 cut: `sort` (the strided 2048-value sample sorted, alone), `pass` (one
  pass over the row: exact int64 mass and count above the bracket), `+slots` (the
  bracket's values stored into each lane's slots), `+compact+sort` (the slots made dense,
  sorted, their running masses scanned), `one try` (the sample's sort, then all of that:
  one try of the bracket). The sampler's cut takes 59-200 µs a call (stop 48): whether
  its sorts or its pass cost that shows here.

Each rung is timed under CUDA-graph replay cycling 3 input sets (bench.common), next to
its bytes floor at the read bandwidth measured in the same run. The sampler's own
launches: `python -m bench.rejection --per-launch`. The stand-ins reuse the sampler's
hash and exponential (kernels/rejection.py), and a CPU test checks each rung's output
against PyTorch, so a rung computes what it claims.

    python -m bench.rejection_ladder [--out results] [--batch 64] [--k 5] [--vocab 49152]
        [--passes partials,race,cut]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.common import (
    environment,
    markdown_table,
    read_bandwidth_tbps,
    save_results,
    time_graph_us,
)
from specdraft.kernels import rejection as kr

PARTIAL_RUNGS = ("read", "max", "argmax", "+expsum", "+min", "+screen")
RACE_RUNGS = ("read", "+p", "+hash", "+race", "+race nz")
# (rows, columns, warps) per partials program; the first is the sampler's (stop 46)
PARTIAL_TILES = ((4, 1024, 8), (1, 4096, 8), (2, 4096, 8), (1, 8192, 8), (1, 16384, 16))
# (columns, slice, warps) per race program; the first is the sampler's
RACE_TILES = ((2048, 512, 4), (2048, 1024, 4), (4096, 1024, 8), (1024, 1024, 4))
CUT_RUNGS = ("sort", "pass", "+slots", "+compact+sort", "one try")
# the sampler's one-pass bracket at large vocabularies: chunk, sample, scratch, lane
# slots, warps (RejectionConfig block_t, sample_f, cap_f, lanes_f, warps_f)
CUT_TILE = (2048, 2048, 2048, 8, 16)


@triton.jit
def _partials_ladder(
    x_ptr, stride, draft_ptr, out_ptr, num_rows, V, NB,
    ROWS: tl.constexpr, BLOCK_V: tl.constexpr, RUNG: tl.constexpr,
):  # fmt: skip
    """out[row * NB + blk, 0:6]: sum | max, argmax, sum exp, min, mass and count above
    the draft's value, as far as RUNG goes (0 read ... 5 screen)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    blk = tl.program_id(1)
    offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    rmask = rows < num_rows
    mask = rmask[:, None] & (offs < V)[None, :]
    z = tl.load(x_ptr + rows[:, None] * stride + offs[None, :], mask=mask, other=float("-inf"))
    z = z.to(tl.float32)
    o = out_ptr + (rows * NB + blk) * 6
    if RUNG == 0:
        tl.store(o, tl.sum(tl.where(mask, z, 0.0), axis=1), mask=rmask)
    else:
        if RUNG == 1:
            bmax = tl.max(z, axis=1)
        else:
            bmax, barg = tl.max(z, axis=1, return_indices=True, return_indices_tie_break_left=True)
            tl.store(o + 1, (barg + blk * BLOCK_V).to(tl.float32), mask=rmask)
        tl.store(o, bmax, mask=rmask)
        if RUNG >= 3:
            ez = tl.exp(z - tl.where(bmax == float("-inf"), 0.0, bmax)[:, None])
            tl.store(o + 2, tl.sum(ez, axis=1), mask=rmask)
            if RUNG >= 4:
                tl.store(o + 3, tl.min(tl.where(mask, z, float("inf")), axis=1), mask=rmask)
            if RUNG >= 5:
                d = tl.load(draft_ptr + rows, mask=rmask, other=0)
                xd = tl.load(x_ptr + rows * stride + d, mask=rmask, other=0.0).to(tl.float32)
                above = z > xd[:, None]
                tl.store(o + 4, tl.sum(tl.where(above, ez, 0.0), axis=1), mask=rmask)
                tl.store(o + 5, tl.sum(above.to(tl.int32), axis=1).to(tl.float32), mask=rmask)


@triton.jit
def _race_ladder(
    x_ptr, stride, q_ptr, stride_q, m_ptr, thr_ptr, tot_ptr, seed_ptr, pos_ptr, out_ptr,
    V, NB, BLOCK_V: tl.constexpr, SUB: tl.constexpr, RUNG: tl.constexpr,
    RESIDUAL_MUL: tl.constexpr,
):  # fmt: skip
    """Request b's slice of block blk, SUB columns at a time: out[b * NB + blk, 0:2] =
    sum of logits + q (RUNG 0); sum of max(p - q, 0) (1); sum of w * u (2); the race's
    best ratio and its index (3; 4: the divisions skip zero dividends)."""
    b = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    lane = tl.arange(0, SUB)
    m = tl.load(m_ptr + b)
    thr = tl.load(thr_ptr + b)
    tot = tl.load(tot_ptr + b)
    h = kr._stream_key(tl.load(seed_ptr + b), tl.load(pos_ptr + b), RESIDUAL_MUL)
    acc = tl.zeros([SUB], tl.float32)
    best = tl.full([SUB], -1.0, tl.float32)
    where = tl.zeros([SUB], tl.int32)
    for c in range(0, BLOCK_V, SUB):
        offs = blk * BLOCK_V + c + lane
        mask = offs < V
        z = tl.load(x_ptr + b * stride + offs, mask=mask, other=float("-inf")).to(tl.float32)
        qv = tl.load(q_ptr + b * stride_q + offs, mask=mask, other=0.0)
        if RUNG == 0:
            acc += tl.where(mask, z, 0.0) + qv
        else:
            e = tl.where(z >= thr, tl.exp(z - m), 0.0)
            p = kr._div_nonneg(e, tot) if RUNG == 4 else tl.math.div_rn(e, tot)
            w = tl.maximum(p - qv, 0.0)
            if RUNG == 1:
                acc += w
            else:
                u = kr._uniform(h, offs.to(tl.uint64))
                if RUNG == 2:
                    acc += w * u
                else:
                    e = kr._exponential(u)
                    ratio = kr._div_nonneg(w, e) if RUNG == 4 else tl.math.div_rn(w, e)
                    ratio = tl.where(mask, ratio, -1.0)
                    up = ratio > best
                    best = tl.where(up, ratio, best)
                    where = tl.where(up, offs, where)
    o = out_ptr + (b * NB + blk) * 2
    if RUNG < 3:
        tl.store(o, tl.sum(acc, axis=0))
    else:
        bmax = tl.max(best, axis=0)
        tl.store(o, bmax)
        tl.store(o + 1, tl.min(tl.where(best == bmax, where, 2147483647), axis=0).to(tl.float32))


def partials_ladder(x, drafts, rung: int, rows: int, block_v: int, warps: int, out=None):
    """Rung `rung` over x [R, V] with one draft id per row; returns out [R, NB, 6]."""
    r, v = x.shape
    nb = triton.cdiv(v, block_v)
    if out is None:
        out = torch.full((r, nb, 6), float("nan"), device=x.device)
    grid = (triton.cdiv(r, rows), nb)
    _partials_ladder[grid](x, x.stride(0), drafts, out, r, v, nb, rows, block_v, rung,
                           num_warps=warps)  # fmt: skip
    return out


def race_ladder(x, q, m, thr, tot, seed, pos, rung, block_v, sub, warps, out=None):
    """Rung `rung` over x [B, V] logits and q [B, V]; returns out [B, NB, 2]."""
    b, v = x.shape
    nb = triton.cdiv(v, block_v)
    if out is None:
        out = torch.full((b, nb, 2), float("nan"), device=x.device)
    mul = kr._stream_mul(kr.RESIDUAL)
    _race_ladder[(b, nb)](x, x.stride(0), q, q.stride(0), m, thr, tot, seed, pos, out, v, nb,
                          block_v, sub, rung, mul, num_warps=warps)  # fmt: skip
    return out


@triton.jit
def _cut_ladder(
    x_ptr, stride, m_ptr, blo_ptr, bhi_ptr, scratch_ptr, out_ptr, V,
    BLOCK: tl.constexpr, SAMPLE: tl.constexpr, CAP: tl.constexpr, LANES: tl.constexpr,
    FXS: tl.constexpr, RUNG: tl.constexpr,
):  # fmt: skip
    """Row r's out[r, 0:6] as far as RUNG goes: 0 sum of the sorted sample times its rank
    (order-dependent: the sort's proof); 1, 2 count and mass (exp(z - m), int64 FXS units
    summed, as a float) above b_hi; 3 the bracket's count n (values in [b_lo, b_hi], each
    lane's first LANES); 4 the bracket's value of rank n // 2 from the top; 5 the first
    rank whose running mass from the top reaches half the bracket's mass."""
    r = tl.program_id(0).to(tl.int64)
    base = x_ptr + r * stride
    o = out_ptr + r * 6
    if (RUNG == 0) | (RUNG == 4):
        si = tl.arange(0, SAMPLE)
        sz = kr._row_z(base + (si.to(tl.int64) * V) // SAMPLE, si < SAMPLE, 1.0)
        s = tl.sort(sz, descending=True)
        tl.store(o, tl.sum(tl.where(s > float("-inf"), s, 0.0) * si.to(tl.float32), axis=0))
    if RUNG >= 1:
        m = tl.load(m_ptr + r)
        b_lo = tl.load(blo_ptr + r)
        b_hi = tl.load(bhi_ptr + r)
        cols = tl.arange(0, BLOCK)
        cbase = scratch_ptr + r * (CAP + LANES * BLOCK)  # CAP dense values, then lane slots
        lbase = cbase + CAP
        above_cv = tl.zeros([BLOCK], tl.int32)
        above_mv = tl.zeros([BLOCK], tl.int64)
        cnt = tl.zeros([BLOCK], tl.int32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + cols
            z = kr._row_z(base + offs, offs < V, 1.0)
            up = z > b_hi
            above_mv += tl.where(up, kr._fx(z, m, FXS), 0)
            above_cv += up.to(tl.int32)
            if RUNG >= 2:
                inb = (z >= b_lo) & (z <= b_hi)
                tl.store(lbase + cnt * BLOCK + cols, z, mask=inb & (cnt < LANES))
                cnt += inb.to(tl.int32)
        tl.store(o + 1, tl.sum(above_cv, axis=0).to(tl.float32))
        tl.store(o + 2, (tl.sum(above_mv, axis=0).to(tl.float64) * (1.0 / FXS)).to(tl.float32))
        if RUNG >= 2:
            mine = tl.minimum(cnt, LANES)
            n = tl.sum(mine, axis=0)
            tl.store(o + 3, n.to(tl.float32))
            if RUNG >= 3:
                start = tl.cumsum(mine, axis=0) - mine
                tl.debug_barrier()  # the slots' stores are visible to every thread
                for j in tl.static_range(LANES):
                    vj = tl.load(lbase + j * BLOCK + cols, mask=j < mine, other=0.0)
                    tl.store(cbase + start + j, vj, mask=(j < mine) & (start + j < CAP))
                tl.debug_barrier()  # the compaction's stores likewise
                slots = tl.arange(0, CAP)
                live = slots < n
                vals = tl.sort(tl.load(cbase + slots, mask=live, other=float("-inf")),
                               descending=True)  # fmt: skip
                e = tl.where(live, kr._fx(vals, m, FXS), 0)
                csum = tl.cumsum(e, axis=0)
                half = tl.sum(e, axis=0)
                i = tl.min(tl.where(live & (2 * csum >= half), slots, CAP), axis=0)
                tl.store(o + 4, tl.max(tl.where(slots == n // 2, vals, float("-inf")), axis=0))
                tl.store(o + 5, i.to(tl.float32))


def cut_ladder(x, m, b_lo, b_hi, rung: int, tile=CUT_TILE, out=None, scratch=None):
    """Rung `rung` over the rows of x [R, V] with row maxima m and brackets [b_lo, b_hi];
    returns out [R, 6] (NaN where the rung writes nothing)."""
    r, v = x.shape
    block, sample, cap, lanes, warps = tile
    if out is None:
        out = torch.full((r, 6), float("nan"), device=x.device)
    if scratch is None:
        scratch = torch.empty(r * (cap + lanes * block), device=x.device)
    fxs = float(2 ** (62 - (v - 1).bit_length()))  # the sampler's units (v * FXS <= 2^62)
    _cut_ladder[(r,)](x, x.stride(0), m, b_lo, b_hi, scratch, out, v, block, sample, cap,
                      lanes, fxs, rung, num_warps=warps)  # fmt: skip
    return out


def top_p_brackets(z: torch.Tensor, top_p: float = 0.9, half: int = 512):
    """Per row of z [R, V] (float32): the value `half` ranks above and below the row's
    top-p cut (its first rank from the top whose running probability reaches top_p), as
    the sampler's sample would place a bracket of about 2 * half values."""
    s = torch.sort(z, dim=-1, descending=True).values
    cum = torch.softmax(s, -1).cumsum(-1)
    c = (cum < top_p).sum(-1, keepdim=True)
    v = z.shape[-1]
    b_hi = s.gather(1, (c - half).clamp(0, v - 1)).squeeze(1)
    b_lo = s.gather(1, (c + half).clamp(0, v - 1)).squeeze(1)
    return b_lo.contiguous(), b_hi.contiguous()


def make_sets(b: int, k: int, v: int, n: int = 3) -> list[dict]:
    """n input sets on the GPU: bench.rejection's gaussian logits and blurred q."""
    from bench.rejection import make_inputs

    sets = []
    for seed in range(n):
        logits, drafts, q, positions = make_inputs(b, k, v, "gaussian", True, seed)
        z = logits.float()
        m = z.max(-1).values
        rows = torch.arange(b, device=z.device) * (k + 1)  # each request's row 0 races
        zr = z[rows]
        tot = torch.exp(zr - m[rows, None]).sum(-1)
        # "cut": keep the top ~5% of each row, the mass of the kept tokens as the total
        thr = torch.quantile(zr, 0.95, dim=-1)
        kept = torch.where(zr >= thr[:, None], torch.exp(zr - m[rows, None]), 0.0).sum(-1)
        sets.append(
            dict(
                logits=logits, drafts=torch.cat([drafts, drafts[:, :1]], 1).reshape(-1),
                race_x=logits[rows], q=q[:, 0].contiguous(), m=m[rows].contiguous(),
                thr=torch.full((b,), float("-inf"), device=z.device), tot=tot,
                cut_thr=thr.contiguous(), cut_tot=kept, seed=torch.arange(b, device=z.device),
                pos=positions, brackets=top_p_brackets(zr),
            )
        )  # fmt: skip
    return sets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--passes", default="partials,race,cut", help="ladders, comma-separated")
    args = ap.parse_args(argv)
    passes = set(args.passes.split(","))
    if not passes or not passes <= {"partials", "race", "cut"}:
        ap.error(f"--passes {args.passes!r}: a comma-separated subset of partials,race,cut")
    if not torch.cuda.is_available():
        print("bench.rejection_ladder needs an NVIDIA GPU; tests/test_bench_rejection.py "
              "checks its kernels on the CPU")  # fmt: skip
        return 2
    env = environment()
    env["read_tbps"] = bw = read_bandwidth_tbps()
    b, k, v = args.batch, args.k, args.vocab
    sets = make_sets(b, k, v)
    rows_out = []
    part_bytes = b * (k + 1) * v * 2
    for rows, block_v, warps in PARTIAL_TILES if "partials" in passes else ():
        for rung, name in enumerate(PARTIAL_RUNGS):
            outs = [partials_ladder(s["logits"], s["drafts"], rung, rows, block_v, warps)
                    for s in sets]  # fmt: skip
            fns = [
                partial(partials_ladder, s["logits"], s["drafts"], rung, rows, block_v, warps, o)
                for s, o in zip(sets, outs, strict=True)
            ]
            us = time_graph_us(fns, min_launches=30)
            rows_out.append(dict(pass_="partials", tile=f"{rows}x{block_v} w{warps}", rung=name,
                                 us=us, floor_us=part_bytes / (bw * 1e6)))  # fmt: skip
            print(rows_out[-1], flush=True)
    race_bytes = b * v * (2 + 4)
    for (block_v, sub, warps), cut, (rung, name) in itertools.product(
        RACE_TILES if "race" in passes else (), (False, True), enumerate(RACE_RUNGS)
    ):
        thr, tot = ("cut_thr", "cut_tot") if cut else ("thr", "tot")
        args_ = [(s["race_x"], s["q"], s["m"], s[thr], s[tot], s["seed"], s["pos"])
                 for s in sets]  # fmt: skip
        outs = [race_ladder(*a, rung, block_v, sub, warps) for a in args_]
        fns = [
            partial(race_ladder, *a, rung, block_v, sub, warps, o)
            for a, o in zip(args_, outs, strict=True)
        ]
        us = time_graph_us(fns, min_launches=30)
        rows_out.append(dict(pass_="race cut" if cut else "race",
                             tile=f"{block_v}/{sub} w{warps}", rung=name,
                             us=us, floor_us=race_bytes / (bw * 1e6)))  # fmt: skip
        print(rows_out[-1], flush=True)
    for rung, name in enumerate(CUT_RUNGS if "cut" in passes else ()):
        args_ = [(s["race_x"], s["m"], *s["brackets"]) for s in sets]
        scratch = torch.empty(b * (CUT_TILE[2] + CUT_TILE[3] * CUT_TILE[0]), device="cuda")
        outs = [cut_ladder(*a, rung, scratch=scratch) for a in args_]
        fns = [
            partial(cut_ladder, *a, rung, out=o, scratch=scratch)
            for a, o in zip(args_, outs, strict=True)
        ]
        us = time_graph_us(fns, min_launches=30)
        # bytes read: the sample (sort, one try) and the row (every rung but the sort)
        read = b * 2 * (CUT_TILE[1] * (rung in (0, 4)) + v * (rung != 0))
        rows_out.append(dict(pass_="cut", tile="{}/{}/{}/{} w{}".format(*CUT_TILE), rung=name,
                             us=us, floor_us=read / (bw * 1e6)))  # fmt: skip
        print(rows_out[-1], flush=True)
    cols = [("pass_", "pass"), ("tile", "tile"), ("rung", "rung"), ("us", "µs"),
            ("floor_us", "bytes floor µs")]  # fmt: skip
    head = f"{env['gpu']}, read {bw:.2f} TB/s, B {b} K {k} V {v}, {env['date']}\n\n"
    table = markdown_table(rows_out, cols)
    print(table)
    save_results(args.out, "rejection_ladder", {"env": env, "rows": rows_out}, head + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
