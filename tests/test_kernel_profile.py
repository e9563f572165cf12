"""bench.kernel_profile off the GPU: its table lists the longest kernel first; unknown
cases are refused by name; without a GPU it says so and exits 2 (it measures on CUDA)."""

from __future__ import annotations

import pytest
import torch

from bench import kernel_profile


def test_unknown_case_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as e:
        kernel_profile.main(["--cases", "smollm2-135m,llama-7b"])
    assert e.value.code == 2
    assert "llama-7b" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU path measures")
def test_without_a_gpu_it_exits_2(capsys):
    assert kernel_profile.main(["--cases", "eagle-smollm2"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().out


def test_kernel_table_lists_the_longest_kernel_first_with_its_share():
    per = {"short": [2.0, 3.0], "long": [1.0, 12.0], "middle": [1.0, 5.0]}
    lines = kernel_profile.kernel_table(per, 40.0)
    assert lines[0] == "| kernel | a replay | µs a replay | share |"
    assert [line.split("`")[1] for line in lines[2:]] == ["long", "middle", "short"]
    assert lines[2] == "| `long` | 1 | 12.0 | 30.0% |"
    assert lines[4] == "| `short` | 2 | 3.0 | 7.5% |"
