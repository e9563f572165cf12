"""Measure the goodput table (specdraft.goodput): the main job (`specdraft generate`) at
each batch size and k, greedy, on the held-out prompts with the shipped head. Writes
goodput.json in specdraft.goodput's format and goodput.md. To ship a new table, copy
goodput.json to specdraft/data/.

    python -m bench.goodput [--out results] [--batches 1,2,4,8,16,32] [--ks 1,2,3,5]
        [--max-new-tokens 128] [--timeout 300] [--per-process] [--device cuda]

In this process, batch after batch: the model is loaded and its graphs captured once a
batch size, target-only decoding is timed before and after that batch's k runs (k 0 is
the mean of the two), and each k builds its own drafter and speculative engine, as the
main job does. --per-process runs `specdraft generate --k K` once per (batch, k)
instead: each run's target-only rate counts towards k 0 (the median is kept), at ~15 s
of start-up a run on an H200.
bench.suite's mainjob part writes the same table from its greedy runs."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

from specdraft.goodput import GoodputPoint, GoodputTable

MODEL = "SmolLM2-135M-Instruct (GGUF Q4_1 -> bfloat16) with the shipped EAGLE-1 head"


def job_table(text: str) -> dict[str, str]:
    """The `| key | value |` rows of a `specdraft generate` run's table."""
    table = {}
    for line in text.splitlines():
        parts = [x.strip() for x in line.strip().strip("|").split("|")]
        if len(parts) == 2 and line.lstrip().startswith("|"):
            table[parts[0]] = parts[1]
    return table


def _rate(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def table_from_runs(runs: dict[tuple[int, int], str], *, source: str) -> GoodputTable:
    """A table from `specdraft generate` outputs keyed by (batch, k): each run gives its
    speculative rate as (batch, k) and its target-only rate towards (batch, 0). A run
    without both rates (it failed, or printed `speculative | off`) is left out; so is a
    batch left with no k > 0."""
    device = None
    target: dict[int, list[float]] = {}
    spec: dict[tuple[int, int], float] = {}
    for (batch, k), text in sorted(runs.items()):
        t = job_table(text)
        plain, fast = _rate(t.get("tokens/s")), _rate(t.get("speculative: tokens/s"))
        if plain is None or fast is None:
            continue
        device = device or t.get("device")
        target.setdefault(batch, []).append(plain)
        spec[batch, k] = fast
    points = []
    for batch, plains in sorted(target.items()):
        points.append(GoodputPoint(batch, 0, statistics.median(plains)))
        points += [GoodputPoint(b, k, r) for (b, k), r in sorted(spec.items()) if b == batch]
    if device is None:
        raise ValueError("no run printed both a target-only and a speculative tokens/s")
    return GoodputTable(points, device=device, model=MODEL, source=source)


def job_argv(batch: int, max_new: int, k: int | None = None) -> list[str]:
    """`specdraft generate`'s arguments for one greedy run of the table's prompts."""
    argv = ["generate", "--prompt-set", "heldout", "--batch", str(batch), "--temperature", "0",
            "--max-new-tokens", str(max_new), "--quiet"]  # fmt: skip
    return argv if k is None else argv + ["--k", str(k)]


def run_job(batch: int, k: int, max_new: int, timeout_s: float) -> tuple[str, int]:
    """One greedy `specdraft generate` run; (its output, its exit status)."""
    cmd = [sys.executable, "-m", "specdraft", *job_argv(batch, max_new, k)]
    try:
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s
        )
        return proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout or b""
        return (out.decode() if isinstance(out, bytes) else out), 124


def measure_batch(batch: int, ks: list[int], max_new: int, device: str | None = None):
    """One batch size in this process: (device name, [GoodputPoint]) with k 0 the mean
    of the target-only rate timed before and after the k runs."""
    from specdraft import demo
    from specdraft.cli import build_parser

    argv = job_argv(batch, max_new) + ([] if device is None else ["--device", device])
    args = build_parser().parse_args(argv)
    job = demo.prepare_job(args)
    if job.draft_path is None:
        raise ValueError("no shipped draft head for the embedded model")

    def target_rate():
        outs, secs, _, _ = demo.time_target(job)
        return outs, sum(len(o.token_ids) for o in outs) / secs

    outs, before = target_rate()
    target_out = [o.token_ids for o in outs]
    points = []
    for k in ks:
        rows = dict(demo.speculate(job, args, k, f"k {k}", before, target_out))
        rate = _rate(rows.get("speculative: tokens/s"))
        if rate is not None:
            points.append(GoodputPoint(batch, k, rate))
        print(f"batch {batch} k {k}: {rate} tok/s, AL "
              f"{rows.get('speculative: acceptance length')}", flush=True)  # fmt: skip
    _, after = target_rate()
    print(f"batch {batch} target-only: {before:.1f} / {after:.1f} tok/s", flush=True)
    import torch

    name = torch.cuda.get_device_name() if job.device == "cuda" else "CPU"
    return name, [GoodputPoint(batch, 0, round((before + after) / 2, 1))] + points


def markdown(table: GoodputTable) -> str:
    ks = sorted({p.k for p in table.points})
    lines = [f"{table.device}; {table.model}", "", table.source, ""]
    lines.append("| batch | " + " | ".join(f"k {k} tok/s" for k in ks) + " | best k |")
    lines.append("|---|" + "---|" * (len(ks) + 1))
    for b in table.batches:
        cells = [table.rate(b, k) for k in ks]
        text = [f"{c:.1f}" if c is not None else "-" for c in cells]
        lines.append(f"| {b} | " + " | ".join(text) + f" | {table.best_k(b)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--ks", default="1,2,3,5")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds a run (--per-process only)")  # fmt: skip
    ap.add_argument("--per-process", action="store_true",
                    help="one `specdraft generate` process per (batch, k)")  # fmt: skip
    ap.add_argument("--device", default=None, help="in-process runs: cuda or cpu")
    args = ap.parse_args(argv)
    try:
        batches = [int(x) for x in args.batches.split(",")]
        ks = [int(x) for x in args.ks.split(",")]
    except ValueError:
        msg = f"--batches {args.batches!r} / --ks {args.ks!r}: comma-separated ints"
        raise SystemExit(msg) from None
    if not batches or min(batches) < 1 or not ks or min(ks) < 1:
        raise SystemExit("--batches and --ks take integers >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    how = "--per-process, " if args.per_process else ""
    source = (
        f"python -m bench.goodput {how}--batches {args.batches} --ks {args.ks} "
        f"--max-new-tokens {args.max_new_tokens} (specdraft generate --prompt-set heldout, "
        f"greedy); torch {torch.__version__}"
    )
    rc = 0
    if args.per_process:
        runs = {}
        for b in batches:
            for k in ks:
                text, code = run_job(b, k, args.max_new_tokens, args.timeout)
                (args.out / f"goodput_b{b}_k{k}.txt").write_text(text)
                runs[b, k] = text
                rc = rc or code
                print(f"batch {b} k {k}: exit {code}", flush=True)
        table = table_from_runs(runs, source=source)
    else:
        points, name = [], None
        for b in batches:
            name, got = measure_batch(b, ks, args.max_new_tokens, args.device)
            points += got
        table = GoodputTable(points, device=name, model=MODEL, source=source)
    table.save(args.out / "goodput.json")
    text = markdown(table)
    (args.out / "goodput.md").write_text(text)
    print("\n" + text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
