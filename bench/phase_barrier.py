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
only), and SmolLM2-135M's four projections a layer x 30 (norm + QKV, O + residual, norm +
gate/up + SiLU-and-multiply, down + residual) as fused_linear launches against one
persistent launch running each phase through the rows kernel's own helpers.

Each barrier chain's output is checked bit for bit against its launch chain's (the same
tile code, so the same sums in the same order) before anything is timed.

Measured on an H100 (stop 52, bench/NOTES.md): a PDL boundary 0.61 µs, a grid barrier
1.0 µs; SmolLM2's projections 7.4 µs a layer as PDL launches, 16.4 in one persistent
launch. The barriers do not pay at these shapes; the persistent layer tail built on them
was reverted.

    python -m bench.phase_barrier --out results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from specdraft.kernels.fused_linear import _rows_gemv, _rows_tile
from specdraft.kernels.fused_mma import _epilogue
from specdraft.kernels.grid_sync import check_grid_resident, grid_arrive, grid_reset, grid_wait


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
    check_grid_resident(grid, x.device)
    _chain_barrier_kernel[(grid,)](x, w, counter, layers, n, k, bn, triton.next_power_of_2(k))


@triton.jit
def _proj_phase(x_ptr, w_ptr, g_ptr, out_ptr, N, K, eps, stride_x, bar_ptr, target, pid, nprog,
                KH1: tl.constexpr, KH2: tl.constexpr, KL: tl.constexpr, BLOCK_N: tl.constexpr,
                NORM: tl.constexpr, GLU: tl.constexpr, RES: tl.constexpr):  # fmt: skip
    """One projection of one row over this program's column tiles, as the rows kernel
    computes it (the same helpers, tiles and rounding); its x after the grid barrier."""
    for t in range(pid, tl.cdiv(N, BLOCK_N), nprog):
        rr = tl.arange(0, 1)[None, :, None, None]
        nn = t * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None, None]
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        omask = (tl.arange(0, 1)[None, :] < 1) & (cols < N)
        acc, acc_u = _rows_gemv(x_ptr, w_ptr, g_ptr, nn, rr, 1, N, K, eps, stride_x, K,
                                KH1, KH2, KL, NORM, GLU, False, x_ptr, x_ptr, x_ptr, 0, False,
                                1, 1, 1, 1.0, bar_ptr, target, True)  # fmt: skip
        res = 0.0
        if RES:  # out is the residual stream, written by this launch
            res = tl.load(out_ptr + cols, mask=omask, other=0.0, cache_modifier=".cg")
            res = res.to(tl.float32)
        acc = _epilogue(acc, acc_u, 0.0, 0.0, res, False, GLU, RES)
        tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _layers_barrier_kernel(x_ptr, qkv_ptr, act_ptr, wq_ptr, wo_ptr, wgu_ptr, wd_ptr, n1_ptr,
                           n2_ptr, bar_ptr, L, H, NQKV, F, eps,
                           KH1: tl.constexpr, KH2: tl.constexpr, KL: tl.constexpr,
                           BN: tl.constexpr, KH1F: tl.constexpr, KH2F: tl.constexpr,
                           KLF: tl.constexpr, BNF: tl.constexpr):  # fmt: skip
    """A Llama layer's four projections x L at one row, as the fused layer launches
    them (norm + QKV, O + residual, norm + gate/up + SiLU-and-multiply, down +
    residual), in one persistent launch: a grid barrier between phases. Weights stacked
    [L, N, K]; the O projection reads the first H of qkv."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    old = 0
    for i in range(L):
        p = 4 * i * nprog
        _proj_phase(x_ptr, wq_ptr + i * NQKV * H, n1_ptr + i * H, qkv_ptr, NQKV, H, eps, H,
                    bar_ptr, p, pid, nprog, KH1, KH2, KL, BN, True, False, False)  # fmt: skip
        old = grid_arrive(bar_ptr)
        _proj_phase(qkv_ptr, wo_ptr + i * H * H, n1_ptr, x_ptr, H, H, eps, NQKV, bar_ptr,
                    p + nprog, pid, nprog, KH1, KH2, KL, BN, False, False, True)  # fmt: skip
        old = grid_arrive(bar_ptr)
        _proj_phase(x_ptr, wgu_ptr + i * 2 * F * H, n2_ptr + i * H, act_ptr, F, H, eps, H,
                    bar_ptr, p + 2 * nprog, pid, nprog, KH1, KH2, KL, BN, True, True,
                    False)  # fmt: skip
        old = grid_arrive(bar_ptr)
        _proj_phase(act_ptr, wd_ptr + i * H * F, n2_ptr, x_ptr, H, F, eps, F, bar_ptr,
                    p + 3 * nprog, pid, nprog, KH1F, KH2F, KLF, BNF, False, False,
                    True)  # fmt: skip
        old = grid_arrive(bar_ptr)
    grid_reset(bar_ptr, old, 4 * L * nprog)


def layers_launches(x, qkv, act, w, *, pdl: bool) -> None:
    """The same projections through kernels.fused_linear, one launch each.
    w: (wq, wo, wgu, wd, n1, n2), each stacked over the layers."""
    from specdraft.kernels import fused_linear

    wq, wo, wgu, wd, n1, n2 = w
    h = x.shape[1]
    for i in range(wq.shape[0]):
        fused_linear(x, wq[i], norm_weight=n1[i], out=qkv, pdl=pdl)
        fused_linear(qkv[:, :h], wo[i], residual=x, out=x, pdl=pdl)
        fused_linear(x, wgu[i], norm_weight=n2[i], glu=True, out=act, pdl=pdl)
        fused_linear(act, wd[i], residual=x, out=x, pdl=pdl)


def layers_barrier(x, qkv, act, w, counter, *, programs: int, eps: float = 1e-6) -> None:
    """layers_launches in one persistent launch of `programs` programs (one row)."""
    wq, wo, wgu, wd, n1, n2 = w
    layers, nqkv, h = wq.shape
    f = wd.shape[2]
    if x.shape[0] != 1:
        raise ValueError(f"x has {x.shape[0]} rows: the barrier chain takes 1")
    check_grid_resident(programs, x.device)
    kh1, kh2, kl, bn, warps = _rows_tile(h, x.element_size())
    kh1f, kh2f, klf, bnf, _ = _rows_tile(f, x.element_size())
    if bnf != bn:
        raise ValueError(f"the tiles for K {h} and K {f} take {bn} and {bnf} columns")
    _layers_barrier_kernel[(programs,)](x, qkv, act, wq, wo, wgu, wd, n1, n2, counter, layers,
                                        h, nqkv, f, eps, kh1, kh2, kl, bn, kh1f, kh2f, klf,
                                        bnf, num_warps=warps)  # fmt: skip


def layer_weights(layers: int, h: int, nqkv: int, f: int, device, dtype, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, scale=0.04):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(dtype)

    norms = [1 + rand(layers, h, scale=0.1) for _ in range(2)]
    return (rand(layers, nqkv, h), rand(layers, h, h), rand(layers, 2 * f, h),
            rand(layers, h, f), *norms)  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--dim", type=int, default=576)
    ap.add_argument("--phases", type=int, default=240)
    ap.add_argument("--bn", default="8,16",
                    help="columns a program of the square chain; the barrier chain runs "
                    "where that leaves at most one program an SM")  # fmt: skip
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.phase_barrier needs an NVIDIA GPU (tests/test_phase_barrier.py: the CPU)")
        return 2
    from bench.common import (
        environment,
        markdown_table,
        read_bandwidth_tbps,
        save_results,
        time_graph_us,
    )
    from specdraft.kernels import fused_linear

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
    kw = {"device": "cuda", "dtype": torch.bfloat16}
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
    # SmolLM2-135M's four projections a layer x 30 at one row (decode_step's chain)
    h, nqkv, f, nl = 576, 960, 1536, 30
    lw = layer_weights(nl, h, nqkv, f, "cuda", torch.bfloat16)
    xs = torch.randn(1, h, device="cuda", dtype=torch.bfloat16, generator=g)
    lx, qkv, act = xs.clone(), torch.empty(1, nqkv, **kw), torch.empty(1, f, **kw)
    layers_launches(lx, qkv, act, lw, pdl=False)
    want = (lx.clone(), qkv.clone(), act.clone())
    lx.copy_(xs), qkv.fill_(float("nan")), act.fill_(float("nan"))
    layers_barrier(lx, qkv, act, lw, counter, programs=sms)
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip((lx, qkv, act), want))
    same = same and bool(want[0].isfinite().all()) and int(counter.item()) == 0
    print(f"SmolLM2 layers: barrier chain equals the launch chain: {same}", flush=True)
    if not same:
        return 1
    lfloor = sum(t[0].numel() for t in lw[:4]) * 2 / (read * 1e12) * 1e6
    cases = {
        "launches (fused_linear)": lambda: layers_launches(lx, qkv, act, lw, pdl=False),
        "launches + PDL (fused_linear)": lambda: layers_launches(lx, qkv, act, lw, pdl=True),
        "barrier": lambda: layers_barrier(lx, qkv, act, lw, counter, programs=sms),
    }
    for name, fn in cases.items():
        us = time_graph_us([fn], min_launches=2) / nl
        rows.append({"variant": f"SmolLM2 layer: {name}", "bn": 4, "programs": "-", "us": us,
                     "x_floor": us / lfloor})  # fmt: skip
        print(f"  SmolLM2 layer {name}: {us:7.2f} µs a layer (floor {lfloor:.2f})", flush=True)
    rows_fn = lambda: [fused_linear(x[i : i + 1], w[i], out=x[i + 1 : i + 2], pdl=True)  # noqa: E731
                       for i in range(layers)]  # fmt: skip
    us = time_graph_us([rows_fn], min_launches=4) / layers
    rows.append({"variant": "rows kernel (fused_linear, PDL)", "bn": "-", "programs": "-",
                 "us": us, "x_floor": us / floor_us})  # fmt: skip
    print(f"  rows kernel: {us:7.3f} µs a phase", flush=True)
    table = markdown_table(rows, [("variant", "variant"), ("bn", "columns a program"),
                                  ("programs", "programs"), ("us", "µs a phase"),
                                  ("x_floor", "x weight floor")])  # fmt: skip
    print(table)
    save_results(args.out, "phase_barrier", {"env": env, "read_tbps": read, "rows": rows}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
