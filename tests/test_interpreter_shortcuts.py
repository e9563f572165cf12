"""conftest's shortcuts in the Triton interpreter (CPU only) give the interpreter's own
results: tl.xor_sum and tl.sort (whose network reduces with xor_sum) against torch, with
a helper called inside the launch; the int overflow check is off only in tests marked
no_overflow_check."""

from __future__ import annotations

import functools
import operator

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.interpreter


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _xor_sort_kernel(x_ptr, xor_ptr, sorted_ptr, R: tl.constexpr, C: tl.constexpr):
    rows = tl.arange(0, R)[:, None]
    cols = tl.arange(0, C)[None, :]
    x = tl.load(x_ptr + rows * C + cols)
    tl.store(xor_ptr + tl.arange(0, R), tl.xor_sum(x, axis=1))
    tl.store(sorted_ptr + rows * C + cols, _twice(tl.sort(x, dim=1, descending=True)))


def test_xor_sum_and_sort_match_torch():
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "_specdraft_shim", False)  # the shortcut is on
    for trial in range(3):
        x = torch.randint(-(2**31), 2**31 - 1, (4, 64), dtype=torch.int32)
        x[0, :8] = x[0, 8]  # ties
        xor = torch.full((4,), 7, dtype=torch.int32)
        out = torch.full_like(x, 7)
        _xor_sort_kernel[(1,)](x, xor, out, R=4, C=64)
        want = [functools.reduce(operator.xor, row.tolist()) for row in x]
        assert xor.tolist() == want, trial
        assert torch.equal(out, x.sort(dim=1, descending=True).values * 2), trial


def test_overflow_check_stays_on_in_unmarked_tests():
    from triton.runtime import interpreter

    assert interpreter.interpreter_builder.options.sanitize_overflow


@pytest.mark.no_overflow_check
def test_overflow_check_off_only_where_marked():
    from triton.runtime import interpreter

    assert not interpreter.interpreter_builder.options.sanitize_overflow
