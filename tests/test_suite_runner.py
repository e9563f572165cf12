"""bench.suite's test runner (CPU): --files picks test files by stem, and a stem that
names no file is refused before anything runs."""

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
    # Without the filter the failing file runs too and the status says so.
    rc, summary = suite.run_tests(tmp_path / "out2")
    assert rc != 0 and "2 files" in summary, summary


def test_files_naming_no_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(_tree(tmp_path))
    monkeypatch.setattr(suite, "DURATIONS", tmp_path / "none.json")
    with pytest.raises(ValueError, match="--files: no test file named test_gamma"):
        suite.run_tests(tmp_path / "out", only_files={"test_alpha", "test_gamma"})
    assert not (tmp_path / "out").exists()
