"""Measure the goodput table (specdraft.goodput): `specdraft generate` at each batch size
and k, greedy, on the held-out prompts with the shipped head. Each run's target-only
rate becomes a k 0 point; with several k a batch has several such rates, and the
median is the one kept. Writes goodput.json in specdraft.goodput's format and
goodput.md. To ship a new table, copy goodput.json to specdraft/data/.

    python -m bench.goodput [--out results] [--batches 1,2,4,8,16,32] [--ks 1,2,3,5]
        [--max-new-tokens 128] [--timeout 300]

One process a run: the first on a fresh machine compiles every kernel. bench.suite's
mainjob part writes the same table from its greedy runs (k 3 at batch 1, 8 and 32)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

from specdraft.goodput import GoodputPoint, GoodputTable


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
    model = "SmolLM2-135M-Instruct (GGUF Q4_1 -> bfloat16) with the shipped EAGLE-1 head"
    return GoodputTable(points, device=device, model=model, source=source)


def run_job(batch: int, k: int, max_new: int, timeout_s: float) -> tuple[str, int]:
    """One greedy `specdraft generate` run; (its output, its exit status)."""
    cmd = [sys.executable, "-m", "specdraft", "generate", "--prompt-set", "heldout",
           "--batch", str(batch), "--k", str(k), "--temperature", "0",
           "--max-new-tokens", str(max_new), "--quiet"]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s
        )
        return proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout or b""
        return (out.decode() if isinstance(out, bytes) else out), 124


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
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a run")
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
    runs, rc = {}, 0
    for b in batches:
        for k in ks:
            text, code = run_job(b, k, args.max_new_tokens, args.timeout)
            (args.out / f"goodput_b{b}_k{k}.txt").write_text(text)
            runs[b, k] = text
            rc = rc or code
            print(f"batch {b} k {k}: exit {code}", flush=True)
    import torch

    source = (
        f"python -m bench.goodput --batches {args.batches} --ks {args.ks} --max-new-tokens "
        f"{args.max_new_tokens} (specdraft generate --prompt-set heldout, greedy); torch "
        f"{torch.__version__}"
    )
    table = table_from_runs(runs, source=source)
    table.save(args.out / "goodput.json")
    text = markdown(table)
    (args.out / "goodput.md").write_text(text)
    print("\n" + text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
