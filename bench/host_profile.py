"""Where a step's host time goes: each piece of a target-only decode step (Engine) and of
a speculative step (SpeculativeEngine: draft round, verification, rejection sampler,
bookkeeping) wrapped with a timer, over one generate() on SmolLM2-135M-shaped random
weights (and a random EAGLE-1 head). Each batch runs in a process of its own: in a
process where another engine ran first, launches measured about 70 µs slower.

    python -m bench.host_profile --out results [--batches 1,8,32] [--k 3] [--new-tokens 96]

Prints one table per (part, batch): calls per step and median µs per call of each
piece, and the whole step's host time without the waits (busy). Writes
host_profile.json and host_profile.md. On a CPU it runs too (everything eager), which
shows the harness works, not GPU host costs.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


class Timers:
    def __init__(self):
        self.samples: dict[str, list[float]] = {}

    def wrap(self, obj, name: str, key: str | None = None) -> None:
        fn = getattr(obj, name)
        key = key or f"{type(obj).__name__}.{name}"
        store = self.samples.setdefault(key, [])

        @functools.wraps(fn)
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                store.append(time.perf_counter() - t0)

        setattr(obj, name, timed)

    def table(self, steps: int) -> list[dict]:
        return [
            {
                "piece": k,
                "calls_per_step": round(len(v) / max(1, steps), 2),
                "p50_us": round(1e6 * statistics.median(v), 1),
            }
            for k, v in self.samples.items()
            if v
        ]


def _waits(t: Timers) -> None:
    """Time spent blocked on events (the wait for the previous step's tokens)."""
    if torch.cuda.is_available():
        t.wrap(torch.cuda.Event, "synchronize", "(wait) Event.synchronize")


def profile_target(batch: int, new_tokens: int) -> dict:
    from bench.e2e import RandomSetup

    setup = RandomSetup()
    engine, _, _ = setup.engine(batch, "cuda" if torch.cuda.is_available() else "cpu")
    ids = setup.prompts(batch)
    engine.generate(ids, max_new_tokens=8, stop_token_ids=[])  # warm-up
    t, runner = Timers(), engine.runner
    t.wrap(engine, "step", "Engine.step (whole)")
    t.wrap(engine, "_launch", "Engine._launch (per-step path)")
    t.wrap(engine, "_process", "Engine._process")
    t.wrap(runner, "decode_next", "TargetRunner.decode_next")
    t.wrap(runner, "execute", "TargetRunner.execute")
    t.wrap(runner.tables, "commit", "BlockTables.commit")
    _waits(t)
    engine.generate(ids, max_new_tokens=new_tokens, stop_token_ids=[])
    steps = len(t.samples["Engine.step (whole)"])
    return {"part": "target", "batch": batch, "steps": steps, "rows": t.table(steps),
            "busy_us": _busy(t, "Engine.step (whole)")}  # fmt: skip


def profile_spec(batch: int, k: int, new_tokens: int) -> dict:
    from bench.spec_step import _models
    from specdraft import drafter as drafter_mod
    from specdraft.drafter import Drafter
    from specdraft.speculative import SpeculativeEngine

    cuda = torch.cuda.is_available()
    target, head, _, prompts = _models(True, None, "cuda" if cuda else "cpu")
    from specdraft.runner import TargetRunner

    runner = TargetRunner(target, max_num_reqs=batch, max_num_tokens=512, max_model_len=1024)
    runner.capture()
    drafter = Drafter(head, max_num_reqs=batch, k_max_options=(k,), max_model_len=1024)
    se = SpeculativeEngine(runner, drafter, k=k)
    ids = (prompts * (batch // len(prompts) + 1))[:batch]
    se.generate(ids, max_new_tokens=8, stop_token_ids=[])  # warm-up
    # The step's host time with no timer inside it (each wrapped piece below adds its
    # timer's own cost to the step): twice, the second reported (the first run on a
    # freshly started machine read 2-2.5x slower, stop 23).
    for _ in range(2):
        bare, undo = _step_marks(drafter)
        se.generate(ids, max_new_tokens=new_tokens, stop_token_ids=[])
        undo()
    bare_per = bare.busy_us()
    t = Timers()
    t.wrap(se, "_run_group", "SpeculativeEngine._run_group (whole)")
    t.wrap(drafter, "propose", "Drafter.propose")
    t.wrap(drafter_mod, "check_propose_inputs", "  check_propose_inputs")
    t.wrap(drafter.lengths, "poll", "  LengthBook.poll")
    t.wrap(drafter.lengths, "launched", "  LengthBook.launched")
    t.wrap(drafter, "_reserve", "  Drafter._reserve")
    t.wrap(drafter.loop.stage, "upload", "  HostStage.upload")
    for m in drafter._managers.values():
        t.wrap(m, "replay", "  draft graph replay")
    t.wrap(runner, "execute_verify", "TargetRunner.execute_verify")
    t.wrap(se, "_steady_step", "SpeculativeEngine._steady_step (graph)")
    t.wrap(se, "_readback_stage", "SpeculativeEngine._readback_stage")
    t.wrap(runner.tables, "grow", "BlockTables.grow")
    t.wrap(runner, "replay_verify", "TargetRunner.replay_verify")
    t.wrap(se, "_process", "SpeculativeEngine._process")
    _waits(t)
    rejection = se.rejection
    store = t.samples.setdefault("RejectionSampler.__call__", [])

    class Timed:
        def __call__(self, *a, **kw):
            t0 = time.perf_counter()
            try:
                return rejection(*a, **kw)
            finally:
                store.append(time.perf_counter() - t0)

        def __getattr__(self, name):
            return getattr(rejection, name)

    se.rejection = Timed()
    marks, _ = _step_marks(drafter)
    steps0 = se.stats.steps
    se.generate(ids, max_new_tokens=new_tokens, stop_token_ids=[])
    steps = se.stats.steps - steps0
    whole = t.samples.pop("SpeculativeEngine._run_group (whole)")
    waits = sum(t.samples.get("(wait) Event.synchronize", []))
    busy = 1e6 * (sum(whole) - waits) / max(1, steps)
    per = marks.busy_us()
    return {"part": "spec", "batch": batch, "k": k, "steps": steps, "rows": t.table(steps),
            "busy_us": round(busy, 1), "step_busy_p50_us": per[0],
            "step_busy_p90_us": per[1], "graph_steps": se.graph_steps,
            "bare_step_busy_p50_us": bare_per[0], "bare_step_busy_p90_us": bare_per[1]}  # fmt: skip


class _StepMarks:
    """Per-step host time of a speculative step: from one draft round's start to the
    next, minus the time spent waiting on events in between (the one-step-late read)."""

    def __init__(self):
        self.starts: list[float] = []
        self.waits: list[tuple[float, float]] = []  # (start, duration)

    def busy_us(self) -> tuple[float, float]:
        busy = []
        for a, b in zip(self.starts, self.starts[1:]):
            wait = sum(d for t0, d in self.waits if a <= t0 < b)
            busy.append(1e6 * (b - a - wait))
        if not busy:
            return float("nan"), float("nan")
        busy.sort()
        return round(statistics.median(busy), 1), round(busy[int(0.9 * (len(busy) - 1))], 1)


def _step_marks(drafter):
    """(marks, undo): draft rounds' starts and event waits recorded until undo()."""
    marks = _StepMarks()
    had = "propose" in vars(drafter)  # an instance attribute (another wrapper) or not
    propose = drafter.propose

    def marked(*a, **kw):
        marks.starts.append(time.perf_counter())
        return propose(*a, **kw)

    drafter.propose = marked
    sync = torch.cuda.Event.synchronize
    if torch.cuda.is_available():

        def timed_sync(ev):
            t0 = time.perf_counter()
            try:
                return sync(ev)
            finally:
                marks.waits.append((t0, time.perf_counter() - t0))

        torch.cuda.Event.synchronize = timed_sync

    def undo():
        torch.cuda.Event.synchronize = sync
        if had:
            drafter.propose = propose
        else:
            del drafter.propose

    return marks, undo


def _busy(t: Timers, whole: str) -> float:
    """Median host time of a step minus what it spent waiting on events (per step)."""
    steps = t.samples[whole]
    waits = t.samples.get("(wait) Event.synchronize", [])
    if len(waits) >= len(steps):  # one wait per step: subtract them pairwise
        return round(1e6 * statistics.median(s - w for s, w in zip(steps, waits)), 1)
    return round(1e6 * (sum(steps) - sum(waits)) / max(1, len(steps)), 1)


def _markdown(results: list[dict]) -> str:
    env = f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}, torch "
    env += f"{torch.__version__}, triton {__import__('triton').__version__}"
    out = [f"Host time per piece, median µs per call ({env})", ""]
    for r in results:
        head = f"{r['part']} batch {r['batch']}" + (f" k {r['k']}" if "k" in r else "")
        out += [f"### {head}: {r['steps']} steps, busy {r['busy_us']} µs per step", ""]
        if "step_busy_p50_us" in r:
            out += [
                f"Per step (round start to round start, waits removed), no timer inside "
                f"the step: p50 {r['bare_step_busy_p50_us']} µs, p90 "
                f"{r['bare_step_busy_p90_us']} µs; with the pieces' timers below: p50 "
                f"{r['step_busy_p50_us']} µs, p90 {r['step_busy_p90_us']} µs; "
                f"{r['graph_steps']} steps ran as one verification graph.",
                "",
            ]
        out += ["| piece | calls / step | p50 µs |", "|---|---|---|"]
        out += [f"| {x['piece']} | {x['calls_per_step']} | {x['p50_us']} |" for x in r["rows"]]
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--parts", default="target,spec")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # part:batch, in-process
    args = ap.parse_args(argv)
    if args.one:
        part, batch = args.one.split(":")
        res = (
            profile_target(int(batch), args.new_tokens)
            if part == "target"
            else profile_spec(int(batch), args.k, args.new_tokens)
        )
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    results = []
    for part in args.parts.split(","):
        for batch in args.batches.split(","):
            cmd = [sys.executable, "-m", "bench.host_profile", "--one", f"{part}:{batch}",
                   "--k", str(args.k), "--new-tokens", str(args.new_tokens)]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                print(proc.stdout[-2000:] + proc.stderr[-3000:])
                return 1
            results.append(json.loads(line[len("RESULT ") :]))
            print(_markdown(results[-1:]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_profile.json").write_text(json.dumps(results, indent=1))
    (args.out / "host_profile.md").write_text(_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
