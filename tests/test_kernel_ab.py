"""bench.kernel_ab: another copy of kernels/ imported beside this checkout's, and the bit
comparison of their paged attention (the CPU run: interpreter, small shapes). A copy with
a planted change fails it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import kernel_ab

ROOT = Path(__file__).resolve().parent.parent


def _copy(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(ROOT / "kernels", dst / "kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    return dst


@pytest.mark.interpreter
def test_identical_copy_is_bit_equal(tmp_path):
    other = _copy(tmp_path, "same")
    assert kernel_ab.main(["--other", str(other), "--out", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "kernel_ab.json").read_text())
    assert len(rows) == len(kernel_ab.CPU_SHAPES)
    assert all(r["bit_equal"] and r["all_written"] for r in rows)
    assert "| tiny | 2 | 70 | 1 | True | True |" in (tmp_path / "out" / "kernel_ab.md").read_text()


@pytest.mark.interpreter
def test_planted_change_is_seen(tmp_path):
    """The other copy scales scores by log2(e) rounded to 1.4427: not the same bits."""
    other = _copy(tmp_path, "changed")
    src = other / "kernels" / "paged_attention.py"
    text = src.read_text()
    assert text.count("qk_scale = scale * 1.4426950408889634") == 1
    old, new = "qk_scale = scale * 1.4426950408889634", "qk_scale = scale * 1.4427"
    src.write_text(text.replace(old, new))
    assert kernel_ab.main(["--other", str(other), "--out", str(tmp_path / "out")]) == 1
    rows = json.loads((tmp_path / "out" / "kernel_ab.json").read_text())
    assert not any(r["bit_equal"] for r in rows)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="has no kernels/paged_attention.py"):
        kernel_ab.load_other(tmp_path)
    with pytest.raises(SystemExit, match="--repeats"):
        kernel_ab.main(["--other", str(tmp_path), "--repeats", "0"])
