"""The whole GPU suite: every test (gpu-marked ones included), then the benchmarks (host
preparation under pytest-benchmark, graph capture and replay, draft models, attention), then
short tables.

    python -m bench.suite [--out results] [--quick] [--sweep] [--no-flex]

Exit status is non-zero when a test or a benchmark fails."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch


def run_tests(out_dir: Path) -> tuple[int, str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "gpu_tests.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        f.write(proc.stdout)
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    for ln in failed[:20]:
        print(ln)
    return proc.returncode, lines[-1] if lines else "(no pytest output)"


def run_host_prep(out_dir: Path) -> tuple[int, str]:
    """bench/test_host_prep.py under pytest-benchmark; returns its summary line."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-s",
        "-p",
        "no:cacheprovider",
        "bench/test_host_prep.py",
        "--benchmark-only",
        f"--benchmark-json={out_dir / 'host_prep.json'}",
    ]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (out_dir / "host_prep.log").write_text(proc.stdout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("host prep")]
    if proc.returncode or not lines:
        print(proc.stdout[-3000:])
    return proc.returncode, lines[-1] if lines else "host prep: no result"


def main() -> int:
    ap = argparse.ArgumentParser(description="GPU tests, then benchmarks, then a table")
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--skip-tests", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench.suite needs an NVIDIA GPU; run `pytest` for the CPU tests")
        return 2
    rc, summary = (0, "tests skipped") if args.skip_tests else run_tests(args.out)
    print(f"tests: {summary}", flush=True)

    hrc, host_line = run_host_prep(args.out)
    print(host_line, flush=True)

    from bench import capture

    crc = capture.main(["--out", str(args.out)])

    from bench import models

    mrc = models.main(["--out", str(args.out)])

    from bench import attention

    bench_argv = ["--out", str(args.out)]
    bench_argv += ["--quick"] * args.quick + ["--sweep"] * args.sweep
    bench_argv += ["--no-flex"] * args.no_flex
    brc = attention.main(bench_argv)
    for name in ("models", "capture"):
        md = args.out / f"{name}.md"
        if md.exists():
            print("\n" + md.read_text().strip())
    print(f"\n{host_line}\ntests: {summary}")
    return rc or hrc or crc or mrc or brc


if __name__ == "__main__":
    sys.exit(main())
