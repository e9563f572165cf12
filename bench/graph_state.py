"""How the streams a process has used change what its CUDA graphs cost (GPU only).

Two graphs are captured on the runtime's capture stream at the start and kept:
SmolLM2-135M's decode step (random weights, batch 1, `--ctx` tokens cached), 20 steps a
graph, and a chain of 1000 launches of a one-element add. Both are timed (device events,
median of 25 replays) before anything else, then after each of `--counts` of: a one-launch
graph captured on a new stream (`--mode new-streams`), the same on the capture stream
(`one-stream`), or one eager launch on a new stream (`eager-streams`). A 1 GiB copy in a
graph is timed beside them: a change in bandwidth would show there.

On the H200 (driver 580.159, torch 2.11) both kept graphs slow down, for good, once
captures have gone to three to six distinct streams (eager launches alone: eight): 0.87 ->
1.05 µs a launch in the chain, 351 -> 389 µs a step, the copy unchanged. Streams created
and never used change nothing, and 40 more graphs on the one capture stream change
nothing (bench/NOTES.md, stop 45). So every graph specdraft captures goes on one stream
(specdraft.cuda_graph.capture_stream).

    python -m bench.graph_state [--out results] [--mode new-streams] [--counts 1,2,4,8]
        [--ctx 256]

`--main-job` instead runs `specdraft generate` (held-out prompts, k 3, greedy, the
shipped head; `--batches`, `--repeats`) in a process of its own per run, in turns: as
the library captures (one stream) and with each graph manager given a stream of its own
as before stop 45 (`per-manager`, patched in by the run's bootstrap: per_manager_streams),
and tabulates the job's own target-only and speculative tokens/s. Run it from the
repository's root (the bootstrap imports bench).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

MODES = ("new-streams", "one-stream", "eager-streams")


def per_manager_streams() -> None:
    """Patch specdraft so that each graph backend (one per manager) captures on a stream
    of its own, as before stop 45 (the shared pool's keeper stays on capture_stream)."""
    import specdraft.cuda_graph as cg

    one, orig = cg.capture_stream, cg.CudaGraphBackend.capture

    def capture(self, fn, pool):
        if "_own_stream" not in self.__dict__:
            self._own_stream = torch.cuda.Stream()
        cg.capture_stream = lambda: self._own_stream
        try:
            return orig(self, fn, pool)
        finally:
            cg.capture_stream = one

    cg.CudaGraphBackend.capture = capture


# A run's bootstrap: argv[1] is "one" or "per-manager"; the rest is `specdraft`'s argv.
_BOOT = """
import sys
from bench.graph_state import per_manager_streams
from specdraft.cli import main
if sys.argv[1] == "per-manager":
    per_manager_streams()
sys.exit(main(sys.argv[2:]))
"""
JOB_KEYS = ("tokens/s", "speculative: tokens/s", "speculative: acceptance length")
STREAMS = ("one", "per-manager")


def main_job_rows(batches: list[int], repeats: int, run) -> list[dict]:
    """Runs in turns: for each repeat, each batch, each of STREAMS, `run(streams, batch)`
    gives the job's output; its table's rates become a row (None where it printed none)."""
    from bench.goodput import job_table

    rows = []
    for rep in range(repeats):
        for batch in batches:
            for streams in STREAMS if rep % 2 == 0 else STREAMS[::-1]:
                table = job_table(run(streams, batch))
                row = {"repeat": rep, "batch": batch, "streams": streams}
                for key in JOB_KEYS:
                    try:
                        row[key] = float(table[key])
                    except (KeyError, ValueError):
                        row[key] = None
                rows.append(row)
    return rows


def _run_job(streams: str, batch: int, timeout_s: float = 300.0) -> str:
    import subprocess

    cmd = [sys.executable, "-c", _BOOT, streams, "generate", "--prompt-set", "heldout",
           "--batch", str(batch), "--k", "3", "--temperature", "0", "--seed", "0",
           "--quiet"]  # fmt: skip
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout_s)  # fmt: skip
        return proc.stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout or b""
        return out.decode() if isinstance(out, bytes) else out


def main_job_table(rows: list[dict]) -> str:
    lines = ["| batch | streams | repeat | target-only tok/s | speculative tok/s | AL |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        vals = [r[k] for k in JOB_KEYS]
        cells = ["-" if v is None else f"{v:.1f}" if v >= 10 else f"{v:.2f}" for v in vals]
        head = f"| {r['batch']} | {r['streams']} | {r['repeat']} | "
        lines.append(head + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.graph_state", description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--mode", choices=MODES, default="new-streams")
    ap.add_argument("--counts", default="1,2,4,8")
    ap.add_argument("--ctx", type=int, default=256)
    job_help = "specdraft generate on one capture stream and on one per manager"
    ap.add_argument("--main-job", action="store_true", help=job_help)
    ap.add_argument("--batches", default="1", help="--main-job: batch sizes")
    ap.add_argument("--repeats", type=int, default=2, help="--main-job: runs of each, in turns")
    args = ap.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches: {args.batches!r} is not a list of integers")
    if any(b < 1 for b in batches):
        ap.error(f"--batches: {args.batches!r} must be >= 1 each")
    if args.repeats < 1:
        ap.error(f"--repeats: {args.repeats} must be >= 1")
    try:
        counts = [int(c) for c in args.counts.split(",")]
    except ValueError:
        ap.error(f"--counts: {args.counts!r} is not a list of integers")
    if any(c < 0 for c in counts) or counts != sorted(counts):
        ap.error(f"--counts: {args.counts!r} must be non-negative and increasing")
    if not torch.cuda.is_available():
        print("bench.graph_state needs an NVIDIA GPU")
        return 2
    from bench.common import capture_graph, environment, replay_us, save_results
    from bench.draft_round import smollm2_step

    env = environment()
    if args.main_job:
        rows = main_job_rows(batches, args.repeats, _run_job)
        head = f"{env['gpu']}, torch {env['torch']} (CUDA {env['cuda']}), {env['date']}"
        text = (f"{head}\n\n`specdraft generate --prompt-set heldout --k 3 --temperature 0`, "
                f"each run a process of its own, in turns\n\n{main_job_table(rows)}")  # fmt: skip
        print(text)
        save_results(args.out, "graph_state_main_job", {"env": env, "rows": rows}, text)
        return 0 if all(r["tokens/s"] is not None for r in rows) else 1
    step = smollm2_step(args.ctx)
    step()
    torch.cuda.synchronize()
    graphs = {"step": capture_graph(lambda: [step() for _ in range(20)])}
    x = torch.randn(64, device="cuda")
    graphs["chain"] = capture_graph(lambda: [x.add_(1e-3) for _ in range(1000)])
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    graphs["copy"] = capture_graph(lambda: dst.copy_(src))
    rows = []

    def measure(label: str) -> None:
        step_us = replay_us(graphs["step"], 20)
        chain_us = replay_us(graphs["chain"], 1000)
        copy_tbps = 2 * src.numel() * 4 / (replay_us(graphs["copy"], 1) * 1e6)
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
                # one-stream: None, the capture stream the kept graphs are on
                stream = None if args.mode == "one-stream" else torch.cuda.Stream()
                kept += [stream, capture_graph(lambda: y.mul_(1.0), stream=stream)]
            done += 1
        measure(f"{done} x {args.mode}")
    save_results(args.out, f"graph_state_{args.mode}", {"env": env, "rows": rows}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
