"""Decode step of a whole model under CUDA-graph replay: the fused decode path against
the unfused one (GPU only).

One step of `--rows` requests, one token each, `--ctx` tokens cached, random bf16
weights, for SmolLM2-135M (the embedded model's shapes), a llama-68m-shaped draft and an
EAGLE-1 head with SmolLM2's shapes. Columns: unfused (cuBLAS GEMMs with separate
RMSNorm / SiLU-and-multiply launches), fused (kernels.fused_linear's row loop with
programmatic dependent launch where the GPU has it) and, with `--rpp 1,2,4`, fused with
that many rows of x to a program, each with its ratio to the weight-read floor (weight
bytes / the read bandwidth measured in the same run). The fused columns force the path
for every row count timed up to fused_linear's 8 (the library takes it up to each model's kernels.max_fused_rows: 4 or 8).

Launches per step come from the profiler, after every timing.

    python -m bench.decode_step [--out results] [--rows 1,2,4,8,32] [--ctx 256]
        [--max-model-len 1024] [--rpp 1,2,4]
"""

from __future__ import annotations

import argparse
import importlib
import sys
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
    ap.add_argument("--rpp", default="", help="also fused with these rows a program")
    args = ap.parse_args(argv)
    max_len = max(args.max_model_len, args.ctx + 64)
    if not torch.cuda.is_available():
        print("bench.decode_step needs an NVIDIA GPU; the CPU tests cover the fused path")
        return 2
    from bench.common import (
        environment,
        markdown_table,
        read_bandwidth_tbps,
        save_results,
        time_graph_us,
    )
    from specdraft import kernels, ops

    fl = importlib.import_module("specdraft.kernels.fused_linear")
    env = environment()
    bw = read_bandwidth_tbps()
    pdl = kernels.pdl_supported(DEVICE)
    print(f"{env['gpu']}: read {bw:.2f} TB/s; PDL {pdl}; torch {env['torch']}", flush=True)
    modes = [("unfused", False, None), ("fused", True, None)]
    modes += [(f"fused_rpp{r}", True, int(r)) for r in args.rpp.split(",") if r]
    saved = (ops._fused_decode, ops._fused_rows, fl.ROWS_PER_PROGRAM)
    rows_out, steps, target = [], [], None

    def use(fused: bool, rpp, rows: int) -> None:
        ops.set_fused_decode(fused)
        ops._fused_rows = rows if fused else saved[1]
        fl.ROWS_PER_PROGRAM = rpp if rpp is not None else saved[2]

    try:
        for name in args.models.split(","):
            cfg, model = _build(name, max_len, target)
            if name == "smollm2-135m":
                target = model
            for rows in (int(x) for x in args.rows.split(",")):
                step = _step(model, cfg, rows, args.ctx, name.startswith("eagle"), max_len)
                floor = _weight_bytes(model, rows) / (bw * 1e12) * 1e6
                row = {"model": name, "rows": rows, "floor_us": floor}
                for mode, fused, rpp in modes:
                    if fused and rows > fl.MAX_ROWS:  # past what fused_linear takes
                        row[f"{mode}_us"] = row[f"{mode}_x_floor"] = None
                        continue
                    use(fused, rpp, rows)
                    with torch.inference_mode():
                        row[f"{mode}_us"] = time_graph_us([step], min_launches=20)
                    row[f"{mode}_x_floor"] = row[f"{mode}_us"] / floor
                    steps.append((row, mode, fused, rpp, rows, step))
                fused_us = row["fused_us"]
                row["fused_over_unfused"] = fused_us and fused_us / row["unfused_us"]
                rows_out.append(row)
                print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
        # Launches per step last: the profiler leaves callbacks installed in the process.
        for row, mode, fused, rpp, rows, step in steps:
            use(fused, rpp, rows)
            row[f"{mode}_launches"] = _launches(step)
    finally:
        ops.set_fused_decode(saved[0])
        ops._fused_rows, fl.ROWS_PER_PROGRAM = saved[1], saved[2]
    cols = [("model", "model"), ("rows", "rows"), ("floor_us", "weight floor µs")]
    for mode, _, _ in modes:
        cols += [(f"{mode}_us", f"{mode} µs"), (f"{mode}_x_floor", "x floor"),
                 (f"{mode}_launches", "launches")]  # fmt: skip
    cols.append(("fused_over_unfused", "fused / unfused"))
    head = (
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; read "
        f"{bw:.2f} TB/s; context {args.ctx}, max_model_len {max_len}, random bf16 weights, "
        f"CUDA-graph replay; PDL {pdl}"
    )
    text = head + "\n\n" + markdown_table(rows_out, cols)
    save_results(args.out, "decode_step", {"env": env, "read_tbps": bw, "rows": rows_out}, text)
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
