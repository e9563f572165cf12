"""bench.kernel_profile's command line off the GPU: unknown cases are refused by name,
and without a GPU it says so and exits 2 (its measurements need CUDA)."""

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
