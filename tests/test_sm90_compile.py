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
    # Both paths (sampled with filters, all greedy) at two vocabularies: the small one in
    # both logits dtypes, the wide tiles in bf16 (their bracket launch's compile is slow)
    line = r"^ok   V (\d+) B \d+ K \d+ (\w+) (_\w+_kernel): "  # the default tiles only
    defaults = set(re.findall(line, proc.stdout, re.M))
    for v, dtypes in (("16", ("float32", "bfloat16")), ("49152", ("bfloat16",))):
        for dtype in dtypes:
            for name in ("_partials_kernel", "_cut_kernel", "_resample_kernel", "_greedy_kernel"):
                assert (v, dtype, name) in defaults, (v, dtype, name, out[-4000:])
    assert {"_partials_kernel", "_resample_kernel", "_greedy_kernel"} <= names, names
    # The partials' other read and exps (one_pass_v and ftz_v flipped from their
    # defaults) compile too, and the one-pass form with lazy_v flipped (bf16)
    flips = ("one_pass_v=1 ftz_v=1", "one_pass_v=0 ftz_v=0", "one_pass_v=1 lazy_v=1",
             "one_pass_v=1 lazy_v=0")  # fmt: skip
    for v, flip in (("16", flips[0]), ("49152", flips[1]), ("16", flips[2]), ("49152", flips[3])):
        variant = rf"^ok   V {v} B \d+ K \d+ bfloat16 {flip} _partials_kernel: "
        assert re.search(variant, proc.stdout, re.M), (v, flip, out[-4000:])
    # the narrow bracket's options, with the pass's loads and the bracket's cut the other
    # way from the default, where it runs
    variant = (r"^ok   V 49152 B \d+ K \d+ bfloat16 small_f=\d+ sample_k=512 loads_f=1"
               r" bisect_f=0 _cut_kernel: ")  # fmt: skip
    assert re.search(variant, proc.stdout, re.M), out[-4000:]
    # fuse_kp flipped, with binary bisection steps (at one request; with more, the
    # 2048-value sample and scratch: --cases 49152,64,5)
    variant = r"^ok   V 49152 B 1 K 3 bfloat16 fuse_kp=0 interp_f=0 _cut_kernel: "
    assert re.search(variant, proc.stdout, re.M), out[-4000:]
    # the race over lists of the kept columns (pack_r), at both vocabularies
    for v in ("16", "49152"):
        variant = rf"^ok   V {v} B \d+ K \d+ bfloat16 pack_r=\d+ _resample_kernel: "
        assert re.search(variant, proc.stdout, re.M), (v, out[-4000:])
    # the top-p cut from counts of equal values (hist_p), at both vocabularies
    for v in ("16", "49152"):
        variant = rf"^ok   V {v} B \d+ K \d+ bfloat16 hist_p=\d+ _hist_cut_kernel: "
        assert re.search(variant, proc.stdout, re.M), (v, out[-4000:])
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
    assert names.count("_embed_rows_kernel") == 2, out[-4000:]
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
    # the token programs: one and four tokens over one chunk, one and two over several
    # (with a window and a softcap)
    assert names.count("_token_attention_kernel") == 4, out[-4000:]
    ahead = re.findall(r"^ok   decode prefetch [12] _paged_attention_kernel", proc.stdout, re.M)
    assert len(ahead) == 2, out[-4000:]
    assert all(w == "True" for _, w in lines), lines


def test_sass_loops_counts_each_loop_body():
    """sass_loops on a listing in nvdisasm's form: a loop is a label a later branch jumps
    back to; forward branches, predicated back-branches and the closing self-branch are
    told apart."""
    from tests.sass import sass_loops  # not tests.sm90_compile: it sets TRITON_INTERPRET=0

    def ins(i, text):
        return f"        /*{i * 16:04x}*/                   {text} ;"

    lines = [
        ins(0, "MOV R1, c[0x0][0x28]"), ".L_x_1:", ins(1, "LDG.E R2, desc[UR4][R4.64]"),
        ins(2, "FADD R3, R3, R2"), ins(3, "@P0 BRA `(.L_x_2)"), ins(4, "IADD3 R4, R4, 0x4, RZ"),
        ".L_x_2:", ins(5, "ISETP.GE.AND P1, PT, R4, R5, PT"), ins(6, "@!P1 BRA `(.L_x_1)"),
        ".L_x_3:", ins(7, "EXIT"), ".L_x_4:", ins(8, "BRA `(.L_x_4)"),
    ]  # fmt: skip
    # the loop: .L_x_1 (instruction 1) to its back-branch (instruction 6) = 6; the forward
    # branch to .L_x_2 and the self-branch are not loops
    assert sass_loops("\n".join(lines)) == [6]
