"""What a dependent phase costs (GPU only): a kernel boundary against a grid barrier.

A decode step at batch 1 is a chain of small dependent phases (SmolLM2-135M: about six a
layer, 183 launches a step), each reading little: the 576 x 576 O projection is 0.66 MB,
0.15 µs at the H200's read bandwidth, yet a launch of the rows kernel costs ~2.4 µs in
a chain under graph replay (bench/NOTES.md). This benchmark asks how much of that is the
boundary itself, and whether a persistent kernel whose programs meet at a grid barrier
(one atomic counter, release on arrival, acquire while waiting) pays less for it.

One chain: L square projections x_{l+1} = W_l x_l, batch 1, bf16, W_l [D, D], the
weights of the whole chain several times L2 (each phase reads its weights from HBM, as a
model's layers do). Timed under CUDA-graph replay, µs a phase:
- launches: one launch a phase, the same program as below, stream-ordered;
- launches + PDL: the same, programmatic dependent launch (weights load before the wait);
- barrier: one persistent launch, a program a column tile; each program loads phase
  l + 1's weight tile before it waits for every program's phase-l store;
- rows kernel: the project's kernels.fused_linear at one row, PDL, one launch a phase.
Then the boundaries alone (empty launches with and without PDL; one launch of barriers
only).

Each barrier chain's output is checked bit for bit against its launch chain's (the same
tile code, so the same sums in the same order) before anything is timed.

Measured on an H100 (stop 52, bench/NOTES.md): a PDL boundary 0.61 µs, a grid barrier
1.0 µs; SmolLM2's four projections a layer 7.4 µs as PDL launches, 16.4 in one persistent
launch (a chain this file held then, through the rows kernel's helpers). The barriers do
not pay at these shapes: the persistent layer tail built on them, and the chain, were
removed.

`--rows-tiles` also times the rows kernel with other tiles (kernels.fused_linear's
ROWS_TILE: K whole or in runs, columns a program, warps).

    python -m bench.phase_barrier --out results [--bn 4,8,16] [--rows-tiles whole/8/4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

# A grid barrier: every program of the launch resident at once (here at most one an SM),
# meeting at one int32 counter. A program arrives after its stores (a CTA barrier, then
# one release add); it waits with acquire loads until the counter holds the arrivals it
# needs, then a CTA barrier. The last program to arrive after the last phase resets the
# counter. Under the interpreter programs run one after another: one program there.


@triton.jit
def grid_arrive(counter_ptr):
    """Every store of this program so far is visible to a program whose grid_wait
    counts this arrival. Returns the counter before the arrival."""
    tl.debug_barrier()  # every thread's stores precede the release
    return tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def grid_wait(counter_ptr, target):
    """Returns once the counter holds at least `target` arrivals."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()  # no thread reads before the acquire


@triton.jit
def grid_reset(counter_ptr, last_old, arrivals):
    """After a program's last arrival (which returned `last_old`): the last program of
    all `arrivals` sets the counter back to zero."""
    if last_old == arrivals - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _tile_w(w_ptr, n0, N, K, BN: tl.constexpr, BK: tl.constexpr):
    cols = n0 + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    return tl.load(w_ptr + cols[:, None] * K + ks[None, :],
                   mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)  # fmt: skip


@triton.jit
def _tile_out(w, x_ptr, y_ptr, n0, N, K, BN: tl.constexpr, BK: tl.constexpr):
    ks = tl.arange(0, BK)
    # .cg: x was written by other programs in this launch; read it at L2, not L1.
    x = tl.load(x_ptr + ks, mask=ks < K, other=0.0, cache_modifier=".cg")
    y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    cols = n0 + tl.arange(0, BN)
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _chain_barrier_kernel(x_ptr, w_ptr, counter_ptr, L, N, K,
                          BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """x [L + 1, K], w [L, N, K] (N == K), one program a BN-column tile, all resident.
    The counter starts at 0 and is left at 0: the last program to arrive after the
    last phase resets it, when no program waits on it any more."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n0 = pid * BN
    old = 0
    for i in range(L):
        w = _tile_w(w_ptr + i * N * K, n0, N, K, BN, BK)
        if i > 0:
            grid_wait(counter_ptr, i * nprog)
        _tile_out(w, x_ptr + i * K, x_ptr + (i + 1) * K, n0, N, K, BN, BK)
        old = grid_arrive(counter_ptr)
    grid_reset(counter_ptr, old, L * nprog)


@triton.jit
def _chain_phase_kernel(x_ptr, w_ptr, y_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr,
                        GDC: tl.constexpr):  # fmt: skip
    n0 = tl.program_id(0) * BN
    w = _tile_w(w_ptr, n0, N, K, BN, BK)
    if GDC:  # the weights are in flight; wait for the launch that wrote x
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _tile_out(w, x_ptr, y_ptr, n0, N, K, BN, BK)


@triton.jit
def _barriers_kernel(counter_ptr, L):
    """L grid barriers and nothing else: a barrier's own cost."""
    nprog = tl.num_programs(0)
    old = 0
    for i in range(L):
        if i > 0:
            grid_wait(counter_ptr, i * nprog)
        old = grid_arrive(counter_ptr)
    grid_reset(counter_ptr, old, L * nprog)


@triton.jit
def _empty_kernel(x_ptr, GDC: tl.constexpr):
    """A launch that only waits for the one before it (GDC) and lets the next start."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def chain_launches(x: torch.Tensor, w: torch.Tensor, *, bn: int, pdl: bool) -> None:
    """x[l + 1] = w[l] @ x[l] for every l, one launch a phase."""
    from specdraft.kernels.launch import pdl_launch

    layers, n, k = w.shape
    gdc, options = pdl_launch(pdl)
    bk = triton.next_power_of_2(k)
    for i in range(layers):
        _chain_phase_kernel[(triton.cdiv(n, bn),)](x[i], w[i], x[i + 1], n, k, bn, bk, gdc,
                                                    **options)  # fmt: skip


def chain_barrier(x: torch.Tensor, w: torch.Tensor, counter: torch.Tensor, *, bn: int) -> None:
    """The same chain in one persistent launch; counter: one int32, 0 on entry and exit."""
    layers, n, k = w.shape
    grid = triton.cdiv(n, bn)
    if x.is_cuda and grid > torch.cuda.get_device_properties(x.device).multi_processor_count:
        raise ValueError(f"bn {bn}: {grid} programs, more than one an SM")
    _chain_barrier_kernel[(grid,)](x, w, counter, layers, n, k, bn, triton.next_power_of_2(k))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--dim", type=int, default=576)
    ap.add_argument("--phases", type=int, default=240)
    ap.add_argument("--bn", default="8,16",
                    help="columns a program of the square chain; the barrier chain runs "
                    "where that leaves at most one program an SM")  # fmt: skip
    ap.add_argument("--rows-tiles", default="",
                    help="also the rows kernel with ROWS_TILE set: layout/columns/warps items, "
                    "e.g. whole/8/4,whole/2/1")  # fmt: skip
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.phase_barrier needs an NVIDIA GPU (tests/test_phase_barrier.py: the CPU)")
        return 2
    from bench.common import (
        environment,
        markdown_table,
        read_bandwidth_tbps,
        rows_tiles_arg,
        save_results,
        time_graph_us,
    )
    from specdraft.kernels import fused_linear

    fl = sys.modules["specdraft.kernels.fused_linear"]

    env = environment()
    read = read_bandwidth_tbps()
    d, layers = args.dim, args.phases
    floor_us = d * d * 2 / (read * 1e12) * 1e6
    print(f"{env['gpu']}: read {read:.2f} TB/s; torch {env['torch']}; D {d}, {layers} phases, "
          f"{layers * d * d * 2 / 1e6:.0f} MB of weights; weight floor {floor_us:.3f} µs a phase",
          flush=True)  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(layers, d, d, device="cuda", dtype=torch.bfloat16, generator=g) / d**0.5
    x = torch.empty(layers + 1, d, device="cuda", dtype=torch.bfloat16)
    x0 = torch.randn(d, device="cuda", dtype=torch.bfloat16, generator=g)
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for bn in (int(b) for b in args.bn.split(",")):
        cases = {
            "launches": lambda bn=bn: chain_launches(x, w, bn=bn, pdl=False),
            "launches + PDL": lambda bn=bn: chain_launches(x, w, bn=bn, pdl=True),
        }
        if triton.cdiv(d, bn) <= sms:  # the barrier chain needs every program resident
            x.fill_(float("nan"))
            x[0] = x0
            chain_launches(x, w, bn=bn, pdl=False)
            want = x.clone()
            x[1:].fill_(float("nan"))
            chain_barrier(x, w, counter, bn=bn)
            torch.cuda.synchronize()
            same = torch.equal(x, want) and int(counter.item()) == 0
            print(f"bn {bn}: barrier chain equals the launch chain: {same}", flush=True)
            if not same:
                return 1
            cases["barrier"] = lambda bn=bn: chain_barrier(x, w, counter, bn=bn)
        for name, fn in cases.items():
            us = time_graph_us([fn], min_launches=4) / layers
            rows.append({"variant": name, "bn": bn, "programs": triton.cdiv(d, bn), "us": us,
                         "x_floor": us / floor_us})  # fmt: skip
            print(f"  {name:16s} bn {bn:3d}: {us:7.3f} µs a phase", flush=True)
    # Boundaries alone: L empty launches against one launch of L barriers, a program an SM
    from specdraft.kernels.launch import pdl_launch

    for gdc_on in (False, True):
        gdc, options = pdl_launch(gdc_on)

        def empties(gdc=gdc, options=options):
            for _ in range(layers):
                _empty_kernel[(sms,)](counter, gdc, **options)

        us = time_graph_us([empties], min_launches=4) / layers
        name = "empty launches" + (" + PDL" if gdc_on else "")
        rows.append({"variant": name, "bn": "-", "programs": sms, "us": us, "x_floor": None})
        print(f"  {name}: {us:7.3f} µs a launch", flush=True)
    us = time_graph_us([lambda: _barriers_kernel[(sms,)](counter, layers)], min_launches=4)
    us /= layers
    rows.append({"variant": "barriers alone", "bn": "-", "programs": sms, "us": us,
                 "x_floor": None})  # fmt: skip
    print(f"  barriers alone: {us:7.3f} µs a barrier", flush=True)
    rows_fn = lambda: [fused_linear(x[i : i + 1], w[i], out=x[i + 1 : i + 2], pdl=True)  # noqa: E731
                       for i in range(layers)]  # fmt: skip
    tiles, saved = [None, *rows_tiles_arg(args.rows_tiles)], fl.ROWS_TILE
    try:
        for tile in tiles:
            fl.ROWS_TILE = tile
            _, _, _, bn, warps = fl._rows_tile(d, 2)
            us = time_graph_us([rows_fn], min_launches=4) / layers
            name = "rows kernel (fused_linear, PDL)" + (f", tile {tile[0]}" if tile else "")
            rows.append({"variant": name + f", {warps} warps", "bn": bn,
                         "programs": triton.cdiv(d, bn), "us": us,
                         "x_floor": us / floor_us})  # fmt: skip
            print(f"  {name} {bn} columns {warps} warps: {us:7.3f} µs a phase", flush=True)
    finally:
        fl.ROWS_TILE = saved
    table = markdown_table(rows, [("variant", "variant"), ("bn", "columns a program"),
                                  ("programs", "programs"), ("us", "µs a phase"),
                                  ("x_floor", "x weight floor")])  # fmt: skip
    print(table)
    save_results(args.out, "phase_barrier", {"env": env, "read_tbps": read, "rows": rows}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
