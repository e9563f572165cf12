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
sum's shortfall from the step is then the time no kernel ran). The critical-path column
splits the replay's span instead: a kernel is charged the time by which its end passes
the latest end of the kernels that started before it (and an idle gap before a kernel
is charged to no one), so the column sums to the replay's span with PDL as without; it
says how much each kernel kind adds to the step, where its own time includes waits.

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


def critical_path(spans: list[tuple[str, float, float]]) -> tuple[dict[str, float], float]:
    """({name: µs it adds to the span}, idle µs) for kernel spans (name, start, end) in
    µs, in any order: taken by start, each kernel adds end - max(start, the latest end
    so far) when its end passes that latest end (0 otherwise), and a start past the
    latest end leaves an idle gap. The values plus the idle time sum to the whole span."""
    added: dict[str, float] = defaultdict(float)
    idle, last = 0.0, None
    for name, start, end in sorted(spans, key=lambda s: (s[1], s[2])):
        if last is None:
            last = start
        if start > last:
            idle += start - last
            last = start
        added[name] += max(0.0, end - last)
        last = max(last, end)
    return dict(added), idle


def profile_graph(graph, replays: int) -> dict[str, list[float]]:
    """{kernel name: [count a replay, µs a replay, critical-path µs a replay]} from
    `replays` replays of a captured graph under torch.profiler (which stays attached to
    the process: run it last)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    spans = []
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        entry = per[e.name[:90]]
        entry[0] += 1 / replays
        entry[1] += e.device_time / replays  # µs
        spans.append((e.name[:90], e.time_range.start, e.time_range.end))
    # Replays run back to back: the gaps between them are idle, charged to no kernel.
    for name, us in critical_path(spans)[0].items():
        per[name][2] += us / replays
    return dict(per)


def kernel_table(per: dict[str, list[float]], total_us: float) -> list[str]:
    """profile_graph's kernels as markdown rows, longest first, each with its share of
    total_us (the graph's event-timed µs) and the µs it adds to the critical path."""
    lines = ["| kernel | a replay | µs a replay | share | critical path µs | µs a launch |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, (n, t, c) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        each = c / n if n else 0.0
        share = t / total_us
        lines.append(f"| `{name}` | {n:.0f} | {t:.1f} | {share:.1%} | {c:.1f} | {each:.2f} |")
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
        busy = sum(v[1] for v in per.values())
        lines += ["", f"### {case}: step {step_us:.1f} µs (events), kernels {busy:.1f} µs, "
                  f"step - kernels {step_us - busy:.1f} µs, weight floor {floor:.1f} µs", "",
                  *kernel_table(per, step_us)]  # fmt: skip
        kern = {k: {"count": n, "us": t, "critical_us": c} for k, (n, t, c) in per.items()}
        row = {"case": case, "step_us": step_us, "kernels_us": busy, "floor_us": floor}
        results.append({**row, "kernels": kern})
    table = "\n".join(lines)
    print(table)
    save_results(args.out, "kernel_profile", {"env": env, "rows": results}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
