"""How a process's CUDA-graph history changes what its graphs cost (GPU only).

Two graphs are captured at the start and kept: SmolLM2-135M's decode step (random
weights, batch 1, `--ctx` tokens cached), 20 steps a graph, and a chain of 1000 launches
of a one-element add. Both are timed (device events, median of 15 replays) after each
count in `--graphs` of extra one-launch graphs has been instantiated in the process
(dropped at once unless `--keep`), and before any, twice. A 1 GiB copy in a graph is timed
beside them: a change in bandwidth would show there.

On the H200 (driver 580.159, torch 2.11) both kept graphs slow down when the fifth graph
of the process is instantiated: 0.88 -> 1.06 µs a launch in the chain, 351-354 -> 388-391
µs a step, the copy unchanged; dropping the graphs does not undo it (bench/NOTES.md, stop
45). bench.common.settle_graph_state puts a benchmark in that state before it times.

    python -m bench.graph_state [--out results] [--graphs 1,2,4,8,16] [--keep] [--ctx 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch


def _graph_us(graph, launches: int) -> float:
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.graph_state", description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--graphs", default="1,2,4,8,16")
    ap.add_argument("--keep", action="store_true", help="keep the extra graphs alive")
    ap.add_argument("--ctx", type=int, default=256)
    args = ap.parse_args(argv)
    try:
        counts = [int(c) for c in args.graphs.split(",")]
    except ValueError:
        ap.error(f"--graphs: {args.graphs!r} is not a list of integers")
    if any(c < 0 for c in counts) or counts != sorted(counts):
        ap.error(f"--graphs: {args.graphs!r} must be non-negative and increasing")
    if not torch.cuda.is_available():
        print("bench.graph_state needs an NVIDIA GPU")
        return 2
    from bench.common import capture_graph, environment, save_results
    from bench.draft_round import smollm2_step

    env = environment()
    step = smollm2_step(args.ctx)
    step()
    torch.cuda.synchronize()
    # settle=False throughout: these captures are the experiment
    graphs = {"step": capture_graph(lambda: [step() for _ in range(20)], settle=False)}
    x = torch.randn(64, device="cuda")
    graphs["chain"] = capture_graph(lambda: [x.add_(1e-3) for _ in range(1000)], settle=False)
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    graphs["copy"] = capture_graph(lambda: dst.copy_(src), settle=False)
    made = len(graphs)
    rows = []

    def measure(label: str) -> None:
        step_us = _graph_us(graphs["step"], 20)
        chain_us = _graph_us(graphs["chain"], 1000)
        copy_tbps = 2 * src.numel() * 4 / (_graph_us(graphs["copy"], 1) * 1e6)
        rows.append({"after": label, "graphs_instantiated": made, "step_us": step_us,
                     "launch_us": chain_us, "copy_tbps": copy_tbps})  # fmt: skip
        say(f"| {label} | {made} | {step_us:.1f} | {chain_us:.3f} | {copy_tbps:.2f} |")

    lines = []

    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    say(f"{env['gpu']}, torch {env['torch']} (CUDA {env['cuda']}), {env['date']}")
    say("")
    say("| after | graphs instantiated | SmolLM2 step µs | µs a launch (chain) | copy TB/s |")
    say("|---|---|---|---|---|")
    measure("start")
    measure("start, again")
    y = torch.ones(64, device="cuda")
    kept = []
    extra = 0
    for count in counts:
        while extra < count:
            g = capture_graph(lambda: y.mul_(1.0), settle=False)
            if args.keep:
                kept.append(g)
            del g
            extra += 1
            made += 1
        measure(f"{extra} more graph(s){' (kept)' if args.keep else ''}")
    save_results(args.out, "graph_state", {"env": env, "rows": rows}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
