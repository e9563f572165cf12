"""Where a model step's device time goes, kernel by kernel (GPU only).

The step (one decode token a request, `--ctx` tokens cached, random bf16 weights) is
captured in a CUDA graph and replayed under torch.profiler; each kernel's device time is
summed by name and divided by the replays. Next to it: the step's time by events (the
same graph; every case is timed before the profiler first runs, since it leaves
callbacks behind that slow later launches), the sum of its kernels' times and the
weight-read floor at the read-only bandwidth measured in the same run. With
programmatic dependent launch (the default on Hopper) a kernel starts while the one
before it still runs and waits inside, so kernel times overlap: their sum can exceed the
step, and a kernel's time includes its wait. SPECDRAFT_PDL=0 gives disjoint times (the
sum's shortfall from the step is then the time no kernel ran).

    python -m bench.kernel_profile [--out results] [--cases eagle-llama3-8b,smollm2-135m]
                                   [--rows 1] [--ctx 256] [--replays 20]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

CASES = ("eagle-llama3-8b", "llama-68m", "smollm2-135m", "eagle-smollm2")


def _case_step(case: str, rows: int, ctx: int, max_len: int):
    """(the step closure, its model) for a bench.models or bench.decode_step case."""
    from bench.decode_step import _build, _step

    if case == "eagle-llama3-8b":
        from bench import models

        cfg, model, _ = models.build(case, ctx, hf=False)
        return _step(model, cfg, rows, ctx, True, ctx + 64), model

    cfg, model = _build(case, max_len, None)
    return _step(model, cfg, rows, ctx, case.startswith("eagle"), max_len), model


def step_time_us(step) -> float:
    """Event-timed µs of one step under graph replay (a graph a step, as generate()
    replays it)."""
    from bench.common import time_graph_us

    with torch.inference_mode():
        return time_graph_us([step], min_launches=1, replays=25)


def profile_graph(graph, replays: int) -> dict[str, list[float]]:
    """{kernel name: [count a replay, µs a replay]} from `replays` replays of a captured
    graph under torch.profiler (which stays attached to the process: run it last)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        entry = per[e.name[:90]]
        entry[0] += 1 / replays
        entry[1] += e.device_time / replays  # µs
    return dict(per)


def kernel_table(per: dict[str, list[float]], total_us: float) -> list[str]:
    """profile_graph's kernels as markdown rows, longest first, each with its share of
    total_us (the graph's event-timed µs)."""
    lines = ["| kernel | a replay | µs a replay | share |", "|---|---|---|---|"]
    for name, (n, t) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| `{name}` | {n:.0f} | {t:.1f} | {t / total_us:.1%} |")
    return lines


def profile_step(step, replays: int) -> dict[str, list[float]]:
    """profile_graph over one captured step."""
    from bench.common import capture_graph

    with torch.inference_mode():
        return profile_graph(capture_graph(step), replays)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--cases", default="eagle-llama3-8b,smollm2-135m")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    if not torch.cuda.is_available():
        print("bench.kernel_profile needs an NVIDIA GPU")
        return 2
    from bench.common import environment, read_bandwidth_tbps, save_results
    from bench.decode_step import _weight_bytes
    from tests.hf_compat import hide_repo_kernels_from_transformers

    hide_repo_kernels_from_transformers()
    env = environment()
    read_bw = read_bandwidth_tbps()
    head = f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}; read {read_bw:.2f} TB/s"
    lines = [f"{head}; {args.rows} row(s), context {args.ctx}; µs a step under graph replay"]
    results = []
    built = {
        c: _case_step(c, args.rows, args.ctx, args.max_model_len) for c in args.cases.split(",")
    }
    timed = {c: step_time_us(step) for c, (step, _) in built.items()}  # before any profiler
    for case, (step, model) in built.items():
        step_us, per = timed[case], profile_step(step, args.replays)
        floor = _weight_bytes(model, args.rows) / (read_bw * 1e12) * 1e6
        busy = sum(t for _, t in per.values())
        lines += ["", f"### {case}: step {step_us:.1f} µs (events), kernels {busy:.1f} µs, "
                  f"step - kernels {step_us - busy:.1f} µs, weight floor {floor:.1f} µs", "",
                  *kernel_table(per, step_us)]  # fmt: skip
        kern = {k: {"count": n, "us": t} for k, (n, t) in per.items()}
        row = {"case": case, "step_us": step_us, "kernels_us": busy, "floor_us": floor}
        results.append({**row, "kernels": kern})
    table = "\n".join(lines)
    print(table)
    save_results(args.out, "kernel_profile", {"env": env, "rows": results}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
