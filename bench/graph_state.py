"""How the streams a process has used change what its CUDA graphs cost (GPU only).

Two graphs are captured on the runtime's capture stream at the start and kept:
SmolLM2-135M's decode step (random weights, batch 1, `--ctx` tokens cached), 20 steps a
graph, and a chain of 1000 launches of a one-element add. Both are timed (device events,
median of 15 replays) before anything else, then after each of `--counts` of: a one-launch
graph captured on a new stream (`--mode new-streams`), the same on the capture stream
(`one-stream`), or one eager launch on a new stream (`eager-streams`). A 1 GiB copy in a
graph is timed beside them: a change in bandwidth would show there.

On the H200 (driver 580.159, torch 2.11) both kept graphs slow down, for good, once
captures have gone to about five distinct streams (eager launches: about eight): 0.87 ->
1.05 µs a launch in the chain, 351 -> 389 µs a step, the copy unchanged. Streams created
and never used change nothing, and 40 more graphs on the one capture stream change
nothing (bench/NOTES.md, stop 45). So every graph specdraft captures goes on one stream
(specdraft.cuda_graph.capture_stream).

    python -m bench.graph_state [--out results] [--mode new-streams] [--counts 1,2,4,8]
        [--ctx 256]
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


MODES = ("new-streams", "one-stream", "eager-streams")


def _capture(fn, stream):
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.graph_state", description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--mode", choices=MODES, default="new-streams")
    ap.add_argument("--counts", default="1,2,4,8")
    ap.add_argument("--ctx", type=int, default=256)
    args = ap.parse_args(argv)
    try:
        counts = [int(c) for c in args.counts.split(",")]
    except ValueError:
        ap.error(f"--counts: {args.counts!r} is not a list of integers")
    if any(c < 0 for c in counts) or counts != sorted(counts):
        ap.error(f"--counts: {args.counts!r} must be non-negative and increasing")
    if not torch.cuda.is_available():
        print("bench.graph_state needs an NVIDIA GPU")
        return 2
    from bench.common import environment, save_results
    from bench.draft_round import smollm2_step
    from specdraft.cuda_graph import capture_stream

    env = environment()
    step = smollm2_step(args.ctx)
    step()
    torch.cuda.synchronize()
    side = capture_stream()
    graphs = {"step": _capture(lambda: [step() for _ in range(20)], side)}
    x = torch.randn(64, device="cuda")
    graphs["chain"] = _capture(lambda: [x.add_(1e-3) for _ in range(1000)], side)
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    graphs["copy"] = _capture(lambda: dst.copy_(src), side)
    rows = []

    def measure(label: str) -> None:
        step_us = _graph_us(graphs["step"], 20)
        chain_us = _graph_us(graphs["chain"], 1000)
        copy_tbps = 2 * src.numel() * 4 / (_graph_us(graphs["copy"], 1) * 1e6)
        rows.append({"after": label, "step_us": step_us, "launch_us": chain_us,
                     "copy_tbps": copy_tbps})  # fmt: skip
        say(f"| {label} | {step_us:.1f} | {chain_us:.3f} | {copy_tbps:.2f} |")

    lines = []

    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    say(f"{env['gpu']}, torch {env['torch']} (CUDA {env['cuda']}), {env['date']}")
    say("")
    say(f"`--mode {args.mode}`")
    say("")
    say("| after | SmolLM2 step µs | µs a launch (chain) | copy TB/s |")
    say("|---|---|---|---|")
    measure("start")
    measure("start, again")
    y = torch.ones(64, device="cuda")
    kept = []  # streams and graphs stay alive to the end
    done = 0
    for count in counts:
        while done < count:
            if args.mode == "eager-streams":
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    y.mul_(1.0)
                torch.cuda.synchronize()
                kept.append(stream)
            else:
                stream = side if args.mode == "one-stream" else torch.cuda.Stream()
                kept += [stream, _capture(lambda: y.mul_(1.0), stream)]
            done += 1
        measure(f"{done} x {args.mode}")
    save_results(args.out, f"graph_state_{args.mode}", {"env": env, "rows": rows}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
