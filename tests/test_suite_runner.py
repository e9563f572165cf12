"""bench.suite's test runner (CPU): --files picks test files by stem or one process of a
split file by its name, and a name that matches nothing is refused before anything runs;
--test-deadline-s interrupts the processes still running and keeps what they counted;
failures.txt gathers the failing processes' tracebacks."""

from __future__ import annotations

import pytest

from bench import suite


def _tree(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_alpha.py").write_text("def test_a():\n    assert True\n")
    (tests / "test_beta.py").write_text("def test_b():\n    assert False\n")
    return tmp_path


def test_files_runs_only_the_named_files(tmp_path, monkeypatch):
    monkeypatch.chdir(_tree(tmp_path))
    monkeypatch.setattr(suite, "DURATIONS", tmp_path / "none.json")
    rc, summary = suite.run_tests(tmp_path / "out", only_files={"test_alpha"})
    assert rc == 0, summary
    assert "1 files" in summary, summary
    logs = sorted(p.name for p in (tmp_path / "out" / "gpu_tests").glob("*.log"))
    assert logs == ["test_alpha.log"], logs
    assert (tmp_path / "out" / "gpu_tests" / "failures.txt").read_text() == ""
    # Without the filter the failing file runs too and the status says so.
    rc, summary = suite.run_tests(tmp_path / "out2")
    assert rc != 0 and "2 files" in summary, summary
    # failures.txt holds the failing file's traceback, and nothing of the passing one
    failures = (tmp_path / "out2" / "gpu_tests" / "failures.txt").read_text()
    assert "##### test_beta (exit 1)" in failures and "assert False" in failures, failures
    assert "test_alpha" not in failures and "short test summary" not in failures, failures


def test_files_naming_no_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(_tree(tmp_path))
    monkeypatch.setattr(suite, "DURATIONS", tmp_path / "none.json")
    with pytest.raises(ValueError, match="--files: no test file named test_gamma"):
        suite.run_tests(tmp_path / "out", only_files={"test_alpha", "test_gamma"})
    assert not (tmp_path / "out").exists()


# Long enough for a pytest process to start and pass a test on a loaded 2-core machine.
# CI runs these tests with SIGINT ignored (inherited from a background start): the
# runner's children must turn it back on, or the deadline's interrupt does nothing.
DEADLINE_S = 10.0


def test_deadline_interrupts_running_files_and_keeps_their_counts(tmp_path, monkeypatch):
    import time

    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_fast.py").write_text("def test_f():\n    assert True\n")
    (tests / "test_slow.py").write_text(
        "import time\n\ndef test_first():\n    assert True\n\n"
        "def test_sleeps():\n    time.sleep(600)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(suite, "DURATIONS", tmp_path / "none.json")
    t0 = time.perf_counter()
    rc, summary = suite.run_tests(tmp_path / "out", jobs=2, deadline_s=DEADLINE_S)
    wall = time.perf_counter() - t0
    assert wall < 3 * DEADLINE_S, (wall, summary)  # not the 600 s sleep
    assert rc != 0, summary
    assert "cut at the deadline: test_slow" in summary, summary
    # the fast file's test and the slow file's first test are counted
    assert "2 passed" in summary, summary
    log = (tmp_path / "out" / "gpu_tests" / "test_slow.log").read_text()
    assert "1 passed" in log, log
    # One at a time, the larger file first: the other one never starts.
    rc, summary = suite.run_tests(tmp_path / "out1", jobs=1, deadline_s=DEADLINE_S)
    assert rc != 0 and "cut at the deadline: test_slow" in summary, summary
    assert "not run, past the budget or the deadline: test_fast" in summary, summary


def test_files_runs_one_part_of_a_split_file(tmp_path, monkeypatch):
    import json

    tests = tmp_path / "tests"
    tests.mkdir()
    body = "".join(f"def test_{i}():\n    assert True\n\n" for i in range(6))
    (tests / "test_multi.py").write_text(body)
    (tests / "test_other.py").write_text("def test_o():\n    assert True\n")
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({"test_multi.py": 250.0}))  # 3 parts of 90 s
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(suite, "DURATIONS", durations)
    rc, summary = suite.run_tests(tmp_path / "out", only_files={"test_multi.2of3"})
    assert rc == 0, summary
    assert "2 passed" in summary and "1 processes" in summary, summary
    logs = sorted(p.name for p in (tmp_path / "out" / "gpu_tests").glob("*.log"))
    assert logs == ["test_multi.2of3.log"], logs
    # a part that the split does not make is refused before anything runs
    with pytest.raises(ValueError, match="test_multi.4of3 names no process"):
        suite.run_tests(tmp_path / "out2", only_files={"test_multi.4of3"})
    assert not (tmp_path / "out2").exists()


def test_model_tests_note_names_what_is_missing(tmp_path, monkeypatch):
    from specdraft import embedded

    monkeypatch.setenv(embedded.CACHE_ENV, str(tmp_path))
    note = suite.model_tests_note()
    assert note is not None and embedded.GGUF_NAME in note and str(tmp_path) in note, note
    (tmp_path / embedded.GGUF_NAME).write_bytes(b"x")
    note = suite.model_tests_note()
    import importlib.util

    if all(importlib.util.find_spec(n) for n in ("gguf", "tokenizers")):
        assert note is None, note
    else:
        assert note is not None and "package" in note and embedded.GGUF_NAME not in note, note


def test_processes_share_the_cores(tmp_path, monkeypatch):
    """Each test process gets cores // (processes at once) threads, at least 1; a count
    already set in the environment is passed through unchanged."""
    import os

    tests = tmp_path / "tests"
    tests.mkdir()
    for i in range(4):
        (tests / f"test_threads{i}.py").write_text(
            "import os\n\ndef test_t():\n"
            "    assert os.environ['OMP_NUM_THREADS'] == os.environ['EXPECT_THREADS']\n"
            "    assert os.environ['MKL_NUM_THREADS'] == os.environ['EXPECT_THREADS']\n"
        )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(suite, "DURATIONS", tmp_path / "none.json")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    # 4 files: at most 4 processes at once, however many jobs are allowed.
    for cores, jobs, want in ((16, 12, "4"), (16, 2, "8"), (3, 4, "1")):
        monkeypatch.setattr(os, "cpu_count", lambda c=cores: c)
        monkeypatch.setenv("EXPECT_THREADS", want)
        rc, summary = suite.run_tests(tmp_path / f"out{cores}_{jobs}", jobs=jobs)
        assert rc == 0 and "4 passed" in summary, (cores, jobs, summary)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("MKL_NUM_THREADS", "3")
    monkeypatch.setenv("EXPECT_THREADS", "3")
    rc, summary = suite.run_tests(tmp_path / "out_set", jobs=2)
    assert rc == 0 and "4 passed" in summary, summary


def test_xdist_workers_share_the_cores(monkeypatch):
    """The README's `pytest -n 2`: each xdist worker takes cores // workers torch
    threads, at least 1; OMP_NUM_THREADS set by the user, or no xdist, leaves torch's own
    count."""
    import os

    import torch

    from tests import conftest

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        for cores, workers, want in ((8, 2, 4), (2, 2, 1), (3, 4, 1), (16, 3, 5)):
            torch.set_num_threads(7)
            monkeypatch.setattr(
                os, "sched_getaffinity", lambda _pid, c=cores: set(range(c)), raising=False
            )
            monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
            conftest._share_cores_between_workers()
            assert torch.get_num_threads() == want, (cores, workers)
        # without os.sched_getaffinity (macOS): all of os.cpu_count()
        monkeypatch.delattr(os, "sched_getaffinity", raising=False)
        monkeypatch.setattr(os, "cpu_count", lambda: 6)
        conftest._share_cores_between_workers()
        assert torch.get_num_threads() == 2  # 6 cores, the last case's 3 workers
        torch.set_num_threads(7)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        conftest._share_cores_between_workers()
        assert torch.get_num_threads() == 7
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
        conftest._share_cores_between_workers()
        assert torch.get_num_threads() == 7
    finally:
        torch.set_num_threads(before)
