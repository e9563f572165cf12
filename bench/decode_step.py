"""Decode step of a whole model under CUDA-graph replay: the fused decode path against
the unfused one (GPU only).

One step of `--rows` requests, one token each, `--ctx` tokens cached, random bf16
weights, for SmolLM2-135M (the embedded model's shapes), a llama-68m-shaped draft and an
EAGLE-1 head with SmolLM2's shapes. Columns: unfused (cuBLAS GEMMs with separate
RMSNorm / SiLU-and-multiply launches), fused (kernels.fused_linear's row loop with
programmatic dependent launch where the GPU has it) and, with `--rpp 1,2,4`, fused with
that many rows of x to a program, each with its ratio to the weight-read floor (weight
bytes / the read bandwidth measured in the same run). The fused columns force the path
for every row count timed up to fused_linear's 64 (tensor-core kernels past 8 rows; the
library takes it up to each model's kernels.max_fused_rows: 4 to 8, or 32). `--splits`
adds columns with the attention split count forced, `--stages` with its pipeline depth,
`--attn` with its key tile, splits, warps and stages;
`--alias-layers` adds the fused step with every decoder layer's weights aliasing layer
0's (layers_aliased: one layer's weights, L2-resident, where the step reads every layer's
own from DRAM), which says how much of the step its weight reads are;
`--chain` also times SmolLM2's projections alone (projection_chain.md), `--mma-tiles`
with tensor-core tile variants; `--merge-in-o` adds the fused path with split attention
merged by the O projection on its loads (specdraft.layers.MERGE_IN_O_PROJ) instead of a
merge launch; `--rows-tiles` with the rows kernel's tile set (kernels.fused_linear's
ROWS_TILE).

Launches per step come from the profiler, after every timing.

    python -m bench.decode_step [--out results] [--rows 1,2,4,8,32] [--ctx 256]
        [--max-model-len 1024] [--rpp 1,2,4] [--splits 1,8,16] [--stages 2,3]
        [--attn 256/1/8/2] [--chain] [--merge-in-o] [--rows-tiles whole/8/4,whole/2/1]
        [--alias-layers]
"""

from __future__ import annotations

import argparse
import importlib
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

MODELS = ("smollm2-135m", "llama-68m", "eagle-smollm2")
DEVICE = "cuda"


def _build(name: str, max_len: int, target):
    from specdraft.models.tiny import (
        eagle_config,
        llama_68m_config,
        random_causal_lm,
        random_eagle_head,
        smollm2_135m_config,
    )

    if name == "eagle-smollm2":  # the head shares SmolLM2's embedding and lm_head
        if target is None:
            target = _build("smollm2-135m", max_len, None)[1]
        cfg = eagle_config(smollm2_135m_config())
        return cfg, random_eagle_head(cfg, target, seed=1, max_positions=max_len).eval()
    cfg = smollm2_135m_config() if name == "smollm2-135m" else llama_68m_config()
    return cfg, random_causal_lm(cfg, seed=0, device=DEVICE, max_positions=max_len).eval()


def _step(model, cfg, rows: int, ctx: int, eagle: bool, max_len: int):
    """The step as a closure over a paged cache with `ctx` tokens a request."""
    from tests.model_helpers import PagedRunner

    runner = PagedRunner(
        cfg, DEVICE, max_num_reqs=rows, max_num_tokens=max(rows, 16), max_model_len=max_len
    )
    for r in range(rows):
        runner.tables.add_request(r, ctx + 1)
        runner.lens[r] = ctx
    toks = torch.randint(0, cfg.vocab_size, (rows,))
    meta = runner.step([(r, [int(toks[r])]) for r in range(rows)])
    if eagle:
        hid = torch.randn(rows, cfg.hidden_size, device=DEVICE, dtype=model.dtype)
        return lambda: model(meta.input_ids, hid, meta, runner.cache)
    return lambda: model(meta.input_ids, meta, runner.cache)


@contextmanager
def layers_aliased(model):
    """Inside, every decoder layer's parameters are layer 0's tensors (the same storage),
    so a step reads one layer's weights once a layer, from L2 after the first, instead of
    every layer's own from DRAM; on exit each parameter holds its own tensor again.
    Timing the step both ways shows how much of it the weight reads are (stop 59, H100:
    SmolLM2's one-row step moved by -1.5 to +6 µs of ~358; 4 rows by -17 to -19)."""
    layers = model.layers
    own = [[(p, p.data) for p in layer.parameters()] for layer in layers]
    first = [p.data for p in layers[0].parameters()]
    try:
        for params in own[1:]:
            if len(params) != len(first):
                raise ValueError("layers_aliased needs layers with the same parameters")
            for (_, mine), src in zip(params, first):
                if mine.shape != src.shape or mine.dtype != src.dtype:
                    raise ValueError(
                        f"layer parameter {tuple(mine.shape)} {mine.dtype} differs from "
                        f"layer 0's {tuple(src.shape)} {src.dtype}"
                    )
        for params in own[1:]:
            for (p, _), src in zip(params, first):
                p.data = src
        yield model
    finally:
        for params in own:
            for p, mine in params:
                p.data = mine


def _weight_bytes(model, rows: int) -> int:
    """Weights one step reads: every parameter once, `rows` rows of an embedding table
    that is not also the lm_head."""
    embed = getattr(model.embed_tokens, "weight", None)
    tied = embed is not None and model.lm_head.weight is embed
    total = 0
    for p in model.parameters():
        if p is embed and not tied:
            total += rows * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def _launches(step) -> int:
    """Kernels (and copies) one eager step launches: what its graph replays."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def _forced_attention(choose, what: tuple):
    """choose_launch_config with its split count ("splits": the launcher passes
    num_splits=None explicitly, so a partial's keyword would be overridden), its
    pipeline depth ("stages") or, for decode and verification tiles (BLOCK_M <= 32), its
    key tile, splits, warps, stages and optionally its prefetch ("attn", a 4- or 5-tuple)
    fixed."""
    from dataclasses import replace

    field, value = what

    def forced(**kw):
        if field == "splits":
            kw["num_splits"] = value
            return choose(**kw)
        if field == "attn":  # decode and verification tiles only (prefill keeps its own)
            n, s, w, st, *ahead = value
            cfg = choose(**kw)
            if cfg.block_m > 32:
                return cfg
            return replace(cfg, block_n=n, num_splits=s, num_warps=w, num_stages=st,
                           prefetch=ahead[0] if ahead else 0)  # fmt: skip
        return replace(choose(**kw), num_stages=value)

    return forced


def projection_chain(rows_list, rpp_list, layers: int = 30, mma_tiles=()) -> list[dict]:
    """SmolLM2's four projections a layer x `layers` under one graph, as the fused layer
    launches them (norm + QKV, O + residual, norm + gate/up + SiLU-and-multiply, down +
    residual), through fused_linear (PDL where supported): the library's choice (the
    rows kernel at SmolLM2's K up to 8 rows, the tensor-core kernel past it), the wide
    kernel for every projection (`wide`, and with rpp_list rows a program), the wide
    kernel with the SiLU-and-multiply as the down projection's prologue (`wide_silu`,
    the layer before stop 27), the tensor-core kernel at every row count with the tiles
    of `mma_tiles` ((BLOCK_M, BLOCK_N, BLOCK_K, stages, warps); `mma_nopf`: its default
    tile without the L2 prefetch), against cuBLAS GEMMs alone. µs per chain."""
    from bench.common import time_graph_us
    from specdraft import kernels
    from specdraft.models.tiny import smollm2_135m_config

    fl = importlib.import_module("specdraft.kernels.fused_linear")
    fm = importlib.import_module("specdraft.kernels.fused_mma")
    cfg = smollm2_135m_config()
    h, f = cfg.hidden_size, cfg.intermediate_size
    nqkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    pdl = kernels.pdl_supported(DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*shape, scale=0.04):
        return (torch.randn(*shape, device=DEVICE, generator=g) * scale).to(torch.bfloat16)

    w = [(rand(nqkv, h), rand(h, h), rand(2 * f, h), rand(h, f), 1 + rand(h, scale=0.1),
          1 + rand(h, scale=0.1)) for _ in range(layers)]  # fmt: skip
    out = []
    saved = (fl.ROWS_PER_PROGRAM, fl.ROWS_MAX_K, fl.MMA_FROM_ROWS, fm.MMA_TILE, fm.MMA_PREFETCH)

    def restore():
        fl.ROWS_PER_PROGRAM, fl.ROWS_MAX_K, fl.MMA_FROM_ROWS = saved[:3]
        fm.MMA_TILE, fm.MMA_PREFETCH = saved[3:]

    try:
        for m in rows_list:
            if m > fm.MMA_MAX_ROWS:
                continue
            x, qkv, gu = rand(m, h, scale=1.0), rand(m, nqkv), rand(m, 2 * f)
            act = rand(m, f)

            def fused(silu=False, x=x, qkv=qkv, gu=gu, act=act):
                for wq, wo, wgu, wd, n1, n2 in w:
                    fl.fused_linear(x, wq, norm_weight=n1, out=qkv, pdl=pdl)
                    fl.fused_linear(qkv[:, :h], wo, residual=x, out=x, pdl=pdl)
                    if silu:
                        fl.fused_linear(x, wgu, norm_weight=n2, out=gu, pdl=pdl)
                        fl.fused_linear(gu, wd, silu=True, residual=x, out=x, pdl=pdl)
                    else:
                        fl.fused_linear(x, wgu, norm_weight=n2, glu=True, out=act, pdl=pdl)
                        fl.fused_linear(act, wd, residual=x, out=x, pdl=pdl)

            def cublas(x=x, qkv=qkv, gu=gu):
                for wq, wo, wgu, wd, _, _ in w:
                    torch.mm(x, wq.t(), out=qkv)
                    torch.mm(qkv[:, :h], wo.t(), out=x)
                    torch.mm(x, wgu.t(), out=gu)
                    torch.mm(gu[:, :f], wd.t(), out=x)

            # (column, rows a program, rows kernel's K bound, SiLU prologue, mma from
            # rows, mma tile, prefetch)
            lib = (saved[1], saved[2], None, True)
            variants = [("fused", None, *lib[:1], False, *lib[1:])]
            if m <= fl.MAX_ROWS:
                variants += [("wide", None, 0, False, *lib[1:]),
                             ("wide_silu", None, 0, True, *lib[1:])]  # fmt: skip
                variants += [(f"rpp{r}", r, 0, False, *lib[1:]) for r in rpp_list if r <= m]
            variants += [(f"mma {t}", None, saved[1], False, 1, t, True) for t in mma_tiles]
            variants.append(("mma_nopf", None, saved[1], False, 1, None, False))
            row = {"rows": m}
            for name, rpp, max_k, silu, mma_from, tile, prefetch in variants:
                fl.ROWS_PER_PROGRAM, fl.ROWS_MAX_K, fl.MMA_FROM_ROWS = rpp, max_k, mma_from
                fm.MMA_TILE, fm.MMA_PREFETCH = tile, prefetch
                try:
                    with torch.inference_mode():
                        row[name] = time_graph_us(
                            [lambda silu=silu: fused(silu)], min_launches=1, replays=15
                        )
                except Exception as e:  # a tile that does not compile: say so, go on
                    print(f"projection chain {m} rows {name}: {type(e).__name__}: {e}"[:300])
                    row[name] = None
                restore()
            with torch.inference_mode():
                row["cublas"] = time_graph_us([cublas], min_launches=1, replays=15)
            print("projection chain:", {k: v if v is None else round(v, 1) for k, v in row.items()},
                  flush=True)  # fmt: skip
            out.append(row)
    finally:
        restore()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--rows", default="1,2,4,8,32")
    ap.add_argument("--ctx", type=int, default=256)
    # The attention launch's split count follows max_model_len (the metadata's length
    # bound); 1024 is the main job's. SmolLM2 at 1 row, context 256: 2 splits (bound 320)
    # 489 µs a step, 8 splits (bound 1024) ~408, 16 (2048) ~403-420 (H200, stop 26).
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rpp", default="", help="also fused, wide kernel, these rows a program")
    ap.add_argument("--wide", action="store_true",
                    help="also fused with the wide kernel for every projection")  # fmt: skip
    ap.add_argument("--splits", default="", help="also fused with these attention splits")
    ap.add_argument("--stages", default="",
                    help="also fused with attention's pipeline at these depths")  # fmt: skip
    ap.add_argument("--attn", default="",
                    help="also fused with attention's key tile / splits / warps / stages "
                    "[/ tiles prefetched: 1 or 2] forced, e.g. 128/1/4/3,128/1/4/2/2")  # fmt: skip
    ap.add_argument("--rows-tiles", default="",
                    help="also fused with the rows kernel's ROWS_TILE set: layout/columns/warps "
                    "items, e.g. whole/8/4,whole/2/1")  # fmt: skip
    ap.add_argument("--alias-layers", action="store_true",
                    help="also fused with every layer aliasing layer 0's weights")  # fmt: skip
    ap.add_argument("--merge-in-o", action="store_true",
                    help="also fused with the O projection merging split attention")  # fmt: skip
    ap.add_argument("--chain", action="store_true",
                    help="also SmolLM2's projections alone (projection_chain.md)")  # fmt: skip
    ap.add_argument("--mma-tiles", default="",
                    help="chain: also the tensor-core kernel at every row count with these "
                    "tiles, BLOCK_M/BLOCK_N/BLOCK_K/stages/warps, comma-separated")  # fmt: skip
    args = ap.parse_args(argv)
    max_len = max(args.max_model_len, args.ctx + 64)
    if not torch.cuda.is_available():
        print("bench.decode_step needs an NVIDIA GPU; the CPU tests cover the fused path")
        return 2
    from bench.common import (
        environment,
        markdown_table,
        read_bandwidth_tbps,
        rows_tiles_arg,
        save_results,
        time_graph_us,
    )
    from specdraft import kernels, layers, ops

    fl = importlib.import_module("specdraft.kernels.fused_linear")
    fm = importlib.import_module("specdraft.kernels.fused_mma")
    env = environment()
    bw = read_bandwidth_tbps()
    pdl = kernels.pdl_supported(DEVICE)
    print(f"{env['gpu']}: read {bw:.2f} TB/s; PDL {pdl}; torch {env['torch']}", flush=True)
    pa = importlib.import_module("specdraft.kernels.paged_attention")
    # (column, fused, rows a program, attention's forced ("splits" or "stages", value),
    # rows kernel's K bound, split attention merged in the O projection, the rows
    # kernel's ROWS_TILE); None: the library's choice
    lib, merge_o, tile0 = fl.ROWS_MAX_K, layers.MERGE_IN_O_PROJ, fl.ROWS_TILE
    modes = [("unfused", False, None, None, lib, merge_o, tile0),
             ("fused", True, None, None, lib, merge_o, tile0)]  # fmt: skip
    if args.wide:
        modes.append(("fused_wide", True, None, None, 0, merge_o, tile0))
    modes += [(f"fused_rpp{r}", True, int(r), None, 0, merge_o, tile0)
              for r in args.rpp.split(",") if r]  # fmt: skip
    modes += [(f"fused_splits{n}", True, None, ("splits", int(n)), lib, merge_o, tile0)
              for n in args.splits.split(",") if n]  # fmt: skip
    modes += [(f"fused_stages{n}", True, None, ("stages", int(n)), lib, merge_o, tile0)
              for n in args.stages.split(",") if n]  # fmt: skip
    modes += [(f"fused_attn{a.replace('/', '_')}", True, None,
               ("attn", tuple(int(v) for v in a.split("/"))), lib, merge_o, tile0)
              for a in args.attn.split(",") if a]  # fmt: skip
    modes += [(f"fused_tile_{t[0]}{t[1]}w{t[2]}", True, None, None, lib, merge_o, t)
              for t in rows_tiles_arg(args.rows_tiles)]  # fmt: skip
    if args.merge_in_o:
        modes.append(("fused_merge_o", True, None, None, lib, True, tile0))
    saved = (ops._fused_decode, ops._fused_rows, fl.ROWS_PER_PROGRAM, pa.choose_launch_config)
    rows_out, steps, target = [], [], None

    def use(fused: bool, rpp, splits, max_k, merge: bool, tile, rows: int) -> None:
        fl.ROWS_MAX_K = max_k
        fl.ROWS_TILE = tile
        layers.MERGE_IN_O_PROJ = merge
        ops.set_fused_decode(fused)
        ops._fused_rows = rows if fused else saved[1]
        fl.ROWS_PER_PROGRAM = rpp if rpp is not None else saved[2]
        pa.choose_launch_config = saved[3]
        if splits is not None:
            pa.choose_launch_config = _forced_attention(saved[3], splits)

    try:
        for name in args.models.split(","):
            cfg, model = _build(name, max_len, target)
            if name == "smollm2-135m":
                target = model
            for rows in (int(x) for x in args.rows.split(",")):
                step = _step(model, cfg, rows, args.ctx, name.startswith("eagle"), max_len)
                floor = _weight_bytes(model, rows) / (bw * 1e12) * 1e6
                row = {"model": name, "rows": rows, "floor_us": floor}
                for mode, fused, rpp, splits, max_k, merge, tile in modes:
                    if fused and rows > fm.MMA_MAX_ROWS:  # past what fused_linear takes
                        row[f"{mode}_us"] = row[f"{mode}_x_floor"] = None
                        continue
                    use(fused, rpp, splits, max_k, merge, tile, rows)
                    with torch.inference_mode():
                        row[f"{mode}_us"] = time_graph_us([step], min_launches=20)
                    row[f"{mode}_x_floor"] = row[f"{mode}_us"] / floor
                    steps.append((row, mode, (fused, rpp, splits, max_k, merge, tile, rows),
                                  step))  # fmt: skip
                if args.alias_layers and rows <= fm.MMA_MAX_ROWS:
                    use(True, None, None, lib, merge_o, tile0, rows)
                    with torch.inference_mode(), layers_aliased(model):
                        row["fused_l2_us"] = time_graph_us([step], min_launches=20)
                fused_us = row["fused_us"]
                row["fused_over_unfused"] = fused_us and fused_us / row["unfused_us"]
                rows_out.append(row)
                print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
        # Launches per step last: the profiler leaves callbacks installed in the process.
        for row, mode, how, step in steps:
            use(*how)
            row[f"{mode}_launches"] = _launches(step)
    finally:
        ops.set_fused_decode(saved[0])
        ops._fused_rows, fl.ROWS_PER_PROGRAM, pa.choose_launch_config = saved[1:]
        fl.ROWS_MAX_K, layers.MERGE_IN_O_PROJ, fl.ROWS_TILE = lib, merge_o, tile0
    cols = [("model", "model"), ("rows", "rows"), ("floor_us", "weight floor µs")]
    for mode, *_ in modes:
        cols += [(f"{mode}_us", f"{mode} µs"), (f"{mode}_x_floor", "x floor"),
                 (f"{mode}_launches", "launches")]  # fmt: skip
    if args.alias_layers:
        cols.append(("fused_l2_us", "fused, layers aliased (weights in L2) µs"))
    cols.append(("fused_over_unfused", "fused / unfused"))
    head = (
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; read "
        f"{bw:.2f} TB/s; context {args.ctx}, max_model_len {max_len}, random bf16 weights, "
        f"CUDA-graph replay; PDL {pdl}"
    )
    text = head + "\n\n" + markdown_table(rows_out, cols)
    save_results(args.out, "decode_step", {"env": env, "read_tbps": bw, "rows": rows_out}, text)
    print("\n" + text)
    if args.chain:
        rpps = [int(r) for r in args.rpp.split(",") if r]
        tiles = [tuple(int(v) for v in t.split("/")) for t in args.mma_tiles.split(",") if t]
        chain = projection_chain([int(x) for x in args.rows.split(",")], rpps, mma_tiles=tiles)
        ccols = [("rows", "rows"), ("fused", "fused_linear µs"), ("wide", "wide kernel µs"),
                 ("wide_silu", "wide kernel, SiLU in the down prologue µs")]  # fmt: skip
        ccols += [(f"rpp{r}", f"wide, rows a program: {r}") for r in rpps]
        ccols += [(f"mma {t}", f"tensor cores {'/'.join(map(str, t))}") for t in tiles]
        ccols += [("mma_nopf", "tensor cores, no L2 prefetch"),
                  ("cublas", "cuBLAS GEMMs alone µs")]  # fmt: skip
        ctext = (
            f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; "
            f"SmolLM2-135M's projections x 30 layers (120 launches) under one graph; PDL {pdl}"
            "\n\n" + markdown_table(chain, ccols)
        )
        save_results(args.out, "projection_chain", {"env": env, "rows": chain}, ctext)
        print("\n" + ctext)
    return 0


if __name__ == "__main__":
    sys.exit(main())
