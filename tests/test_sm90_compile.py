"""The rejection sampler's and the fused decode path's kernels compile for sm_90 on a
CPU-only machine (tests/sm90_compile.py, in a process of its own): the interpreter runs
programs that the GPU compiler may reject."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.interpreter
def test_sampler_kernels_compile_for_sm90():
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sm90_compile"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    compiled = re.findall(r"^ok   (.+ (_\w+_kernel)): cubin (\d+) bytes$", proc.stdout, re.M)
    names = {name for _, name, _ in compiled}
    # Both paths (sampled with filters, all greedy), two vocabularies, two logits dtypes.
    assert len(compiled) >= 2 * 2 * 2 * 2, out[-4000:]
    assert {"_partials_kernel", "_resample_kernel", "_greedy_kernel"} <= names, names
    assert all(int(size) > 0 for _, _, size in compiled), compiled


@pytest.mark.interpreter
def test_decode_path_compiles_for_sm90_with_pdl():
    """The fused decode path's kernels compile with programmatic dependent launch, and
    each waits (griddepcontrol.wait) before reading another kernel's output: the
    interpreter never runs that branch."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sm90_compile", "--cases", "--decode"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    pattern = r"^ok   decode (?:.* )?(_\w+_kernel): cubin \d+ bytes, griddepcontrol.wait (\w+)"
    lines = re.findall(pattern, proc.stdout, re.M)
    names = [name for name, _ in lines]
    # 7 projections at 1 and 4 rows: silu=True and K 4096 take the wide kernel; and the
    # O projection merging split attention's partials at 1 and 4 rows
    assert names.count("_fused_rows_kernel") == 10 + 2, out[-4000:]
    assert names.count("_fused_linear_kernel") == 4, out[-4000:]
    assert names.count("_fused_qkv_rope_kernel") == 2, out[-4000:]
    # the int8 lm_head: 5 shapes, then its greedy argmax partials at 1 / 8 / 64 rows ...
    # (and with act_int8 at 1 / 8 / 64 rows: int8 activations as well)
    assert names.count("_linear_int8_kernel") == 8 + 3, out[-4000:]
    # ... that the round's bookkeeping kernels finish (each waiting first, as on the GPU);
    # prepare twice: its inputs in its buffers, then from sources with a hidden buffer
    done = re.findall(
        r"^ok   round M \d+ .*(_draft_\w+_kernel): cubin \d+ bytes, griddepcontrol.wait (\w+)",
        proc.stdout, re.M,
    )  # fmt: skip
    kinds = ("_draft_advance_kernel", "_draft_epilogue_kernel", "_draft_prepare_kernel")
    want = [(kind, "True") for kind in kinds for _ in range(6 if "prepare" in kind else 3)]
    assert sorted(done) == sorted(want), done
    assert {"_rotary_store_kv_kernel", "_paged_attention_kernel", "_combine_splits_kernel"} <= set(
        names
    ), names
    assert all(w == "True" for _, w in lines), lines
