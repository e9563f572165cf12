"""A decode step's MLP as one launch without a dependent phase inside (GPU timing).

A Llama MLP at batch 1 is two dependent projections: norm + gate/up + SiLU-and-multiply,
then down + residual. As two PDL launches (the rows kernel) each pays its own boundary,
x load and reductions. Split along the intermediate dimension instead: a program takes S
of the I intermediate units, forms their gate and up values from the whole x (its slice
of W_gate and W_up), their SiLU-and-multiply, and multiplies those S values by its S
rows of W_down^T: a partial of the whole output that no other program's result feeds.
The partials meet in an int64 fixed-point accumulator (value * 2^32) through relaxed
atomic adds, so their sum does not depend on the order the programs arrive in. The next
launch, after its PDL wait, reads the residual and the accumulator and forms x = round(
residual + acc * 2^-32); its program 0 stores that x as the next residual.

The chain here is L layers of MLP (SmolLM2-135M's shapes by default), each layer's
weights its own (the chain's weights several times L2), timed under CUDA-graph replay:
- two launches a layer (kernels.fused_linear: glu=True with the norm, then the down
  projection with the residual), PDL;
- one launch a layer, split-K with fixed-point atomics (a memset of the accumulators
  first, in the graph);
- the same launch storing its partials with plain stores (a wrong sum: the atomics'
  cost).
The split chain's output is checked against the two-launch chain's (bf16 rounding) and
a float64 reference before anything is timed.

    python -m bench.mlp_splitk --out results [--s 8,16] [--warps 4,8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

SCALE_BITS = 32


@triton.jit
def _mlp_splitk_kernel(res_ptr, acc_in_ptr, h_out_ptr, g_ptr, wgu_ptr, wdt_ptr, acc_out_ptr,
                       H, NI, eps, S: tl.constexpr, KA: tl.constexpr, KB: tl.constexpr,
                       ACC_IN: tl.constexpr, ATOMIC: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
    """One program: S intermediate units of one row. x = residual (+ acc_in * 2^-32,
    rounded to the residual's dtype; program 0 stores it to h_out); RMSNorm; gate and up
    for the units; act = silu(gate) * up rounded as the two-launch chain rounds it; act
    times the units' rows of W_down^T added to acc_out in fixed point. H = KA + KB (KA a
    power of two, KB the rest padded to one)."""
    pid = tl.program_id(0)
    s = pid * S + tl.arange(0, S)[:, None]
    sm = s < NI
    ka = tl.arange(0, KA)[None, :]
    kb = KA + tl.arange(0, KB)[None, :]
    kbm = kb < H
    row = s.to(tl.int64) * H
    wga = tl.load(wgu_ptr + row + ka, mask=sm, other=0.0)
    wgb = tl.load(wgu_ptr + row + kb, mask=sm & kbm, other=0.0)
    wua = tl.load(wgu_ptr + NI * H + row + ka, mask=sm, other=0.0)
    wub = tl.load(wgu_ptr + NI * H + row + kb, mask=sm & kbm, other=0.0)
    wda = tl.load(wdt_ptr + row + ka, mask=sm, other=0.0)
    wdb = tl.load(wdt_ptr + row + kb, mask=sm & kbm, other=0.0)
    ga = tl.load(g_ptr + ka).to(tl.float32)
    gb = tl.load(g_ptr + kb, mask=kbm, other=0.0).to(tl.float32)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    xa = tl.load(res_ptr + ka).to(tl.float32)
    xb = tl.load(res_ptr + kb, mask=kbm, other=0.0).to(tl.float32)
    if ACC_IN:
        inv = 2.3283064365386963e-10  # 2^-32
        xa = (xa + tl.load(acc_in_ptr + ka).to(tl.float32) * inv)
        xb = (xb + tl.load(acc_in_ptr + kb, mask=kbm, other=0).to(tl.float32) * inv)
        xa = xa.to(h_out_ptr.dtype.element_ty).to(tl.float32)
        xb = xb.to(h_out_ptr.dtype.element_ty).to(tl.float32)
    if pid == 0:
        tl.store(h_out_ptr + ka, xa.to(h_out_ptr.dtype.element_ty))
        tl.store(h_out_ptr + kb, xb.to(h_out_ptr.dtype.element_ty), mask=kbm)
    rstd = tl.rsqrt((tl.sum(xa * xa, axis=1) + tl.sum(xb * xb, axis=1)) / H + eps)  # [1]
    xga = xa * ga
    xgb = xb * gb
    gate = (tl.sum(wga.to(tl.float32) * xga, axis=1) + tl.sum(wgb.to(tl.float32) * xgb, axis=1))
    up = (tl.sum(wua.to(tl.float32) * xga, axis=1) + tl.sum(wub.to(tl.float32) * xgb, axis=1))
    gate = gate * rstd
    up = up * rstd
    act = gate / (1.0 + tl.exp(tl.minimum(-gate, 80.0))) * up
    act = act.to(res_ptr.dtype.element_ty).to(tl.float32)[:, None]  # [S, 1]
    pa = tl.sum(act * wda.to(tl.float32), axis=0) * 4294967296.0
    pb = tl.sum(act * wdb.to(tl.float32), axis=0) * 4294967296.0
    oa = tl.arange(0, KA)
    ob = KA + tl.arange(0, KB)
    if ATOMIC:
        tl.atomic_add(acc_out_ptr + oa, pa.to(tl.int64), sem="relaxed")
        tl.atomic_add(acc_out_ptr + ob, pb.to(tl.int64), mask=ob < H, sem="relaxed")
    else:
        tl.store(acc_out_ptr + oa, pa.to(tl.int64))
        tl.store(acc_out_ptr + ob, pb.to(tl.int64), mask=ob < H)


def _split(h: int) -> tuple[int, int]:
    ka = 1 << (h.bit_length() - 1)
    return ka, (triton.next_power_of_2(h - ka) if h > ka else 1)


def mlp_splitk_chain(h0, hs, acc, g, wgu, wdt, *, s: int, warps: int, atomic: bool = True,
                     pdl: bool = True, eps: float = 1e-5) -> None:  # fmt: skip
    """L layers: hs[l + 1] gets layer l's input x_l (x_0 = h0), acc[l] its MLP output in
    fixed point (acc must be zero). x_L = round(hs[L] + acc[L - 1] * 2^-32)."""
    from specdraft.kernels.launch import pdl_launch

    layers, two_i, h = wgu.shape
    i = two_i // 2
    ka, kb = _split(h)
    gdc, options = pdl_launch(pdl)
    for lay in range(layers):
        res = h0 if lay == 0 else hs[lay]
        acc_in = acc[lay - 1] if lay else acc[0]
        _mlp_splitk_kernel[(triton.cdiv(i, s),)](
            res, acc_in, hs[lay + 1], g[lay], wgu[lay], wdt[lay], acc[lay], h, i, eps,
            s, ka, kb, lay > 0, atomic, gdc, num_warps=warps, **options,
        )  # fmt: skip


def two_launch_chain(h, act, g, wgu, wd, *, eps: float = 1e-5) -> None:
    """The same L layers through kernels.fused_linear: h is updated in place."""
    from specdraft.kernels import fused_linear

    for lay in range(wgu.shape[0]):
        fused_linear(h, wgu[lay], norm_weight=g[lay], glu=True, out=act, eps=eps, pdl=True)
        fused_linear(act, wd[lay], residual=h, out=h, pdl=True)


def reference(h0, g, wgu, wd, eps: float = 1e-5) -> torch.Tensor:
    """float64 chain (no intermediate rounding)."""
    x = h0.double()
    for lay in range(wgu.shape[0]):
        n = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * g[lay].double()
        gu = n @ wgu[lay].double().T
        i = gu.shape[-1] // 2
        a = torch.nn.functional.silu(gu[..., :i]) * gu[..., i:]
        x = x + a @ wd[lay].double().T
    return x


def make(layers: int, h: int, i: int, device, dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen, device=device) * scale)  # noqa: E731
    g = (1 + 0.1 * r(layers, h)).to(dtype)
    wgu = r(layers, 2 * i, h, scale=h**-0.5).to(dtype)
    wd = r(layers, h, i, scale=i**-0.5).to(dtype)
    h0 = r(1, h).to(dtype)
    return h0, g, wgu, wd


def finish(hs, acc) -> torch.Tensor:
    return (hs[-1].float() + acc[-1].double().float() * 2.0**-SCALE_BITS).to(hs.dtype)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--inter", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--s", default="8,16", help="intermediate units a program")
    ap.add_argument("--warps", default="4,8")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.mlp_splitk needs an NVIDIA GPU (tests/test_mlp_splitk.py: the CPU)")
        return 2
    from bench.common import (
        environment,
        markdown_table,
        read_bandwidth_tbps,
        save_results,
        time_graph_us,
    )

    env = environment()
    read = read_bandwidth_tbps()
    h, i, layers = args.hidden, args.inter, args.layers
    h0, g, wgu, wd = make(layers, h, i, "cuda")
    wdt = wd.transpose(1, 2).contiguous()
    floor_us = 3 * h * i * 2 / (read * 1e12) * 1e6
    print(f"{env['gpu']}: read {read:.2f} TB/s; torch {env['torch']}; H {h}, I {i}, {layers} "
          f"layers; weight floor {floor_us:.3f} µs a layer", flush=True)  # fmt: skip
    want = reference(h0, g, wgu, wd).float()
    hbuf = h0.clone()
    act = torch.empty(1, i, device="cuda", dtype=h0.dtype)
    two_launch_chain(hbuf, act, g, wgu, wd)
    hs = torch.empty(layers + 1, 1, h, device="cuda", dtype=h0.dtype)
    acc = torch.zeros(layers, 1, h, device="cuda", dtype=torch.int64)
    err_two = (hbuf.float() - want).abs().max().item()
    rows = []

    def two():
        hbuf.copy_(h0)
        two_launch_chain(hbuf, act, g, wgu, wd)

    us = time_graph_us([two], min_launches=4) / layers
    rows.append({"variant": "two launches (fused_linear, PDL)", "s": "-", "warps": "-",
                 "us": us, "x_floor": us / floor_us, "err": err_two})  # fmt: skip
    print(f"  two launches: {us:.3f} µs a layer; max err vs float64 {err_two:.3g}", flush=True)
    for s in (int(v) for v in args.s.split(",")):
        for warps in (int(v) for v in args.warps.split(",")):
            acc.zero_()
            hs.fill_(float("nan"))
            mlp_splitk_chain(h0, hs, acc, g, wgu, wdt, s=s, warps=warps)
            got = finish(hs, acc)
            err = (got.float() - want).abs().max().item()
            ok = err <= 2 * err_two + 1e-2 and bool(torch.isfinite(got).all())
            print(f"  split s {s} warps {warps}: max err vs float64 {err:.3g} "
                  f"(two launches {err_two:.3g}) {'ok' if ok else 'WRONG'}", flush=True)  # fmt: skip
            if not ok:
                return 1
            for atomic in (True, False):

                def one(s=s, warps=warps, atomic=atomic):
                    acc.zero_()
                    mlp_splitk_chain(h0, hs, acc, g, wgu, wdt, s=s, warps=warps, atomic=atomic)

                us = time_graph_us([one], min_launches=4) / layers
                name = "split-K, one launch" + ("" if atomic else ", plain stores (wrong sum)")
                rows.append({"variant": name, "s": s, "warps": warps, "us": us,
                             "x_floor": us / floor_us, "err": err if atomic else None})  # fmt: skip
                print(f"  {name} s {s} warps {warps}: {us:.3f} µs a layer", flush=True)
    table = markdown_table(rows, [("variant", "variant"), ("s", "units a program"),
                                  ("warps", "warps"), ("us", "µs a layer"),
                                  ("x_floor", "x weight floor"), ("err", "max err vs float64")])  # fmt: skip
    print(table)
    save_results(args.out, "mlp_splitk", {"env": env, "read_tbps": read, "rows": rows}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
