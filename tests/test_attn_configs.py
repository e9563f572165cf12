"""bench.attn_configs's command line off the GPU: malformed shapes and grids are refused
by name, and without a GPU it says so and exits 2 (its measurements need CUDA)."""

from __future__ import annotations

import pytest
import torch

from bench import attn_configs


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--shapes", "mistral:1:256:1"], ["mistral"]),
        (["--shapes", "smollm2:1:256"], ["smollm2:1:256"]),
        (["--shapes", "smollm2:1:4:8"], ["more query tokens"]),
        (["--shapes", "smollm2:0:256:1"], ["--shapes"]),
        (["--tiles", "64,x"], ["--tiles"]),
        (["--stages", "0"], ["--stages"]),
        (["--prefetch", "3"], ["--prefetch", "'3'"]),
        (["--prefetch", "x,1"], ["--prefetch"]),
        (["--bound", "128", "--shapes", "smollm2:1:256:1"], ["--bound 128"]),
    ],
)
def test_bad_arguments_are_refused_by_name(argv, words):
    with pytest.raises(SystemExit) as e:
        attn_configs.main(argv)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_shapes_parse():
    assert attn_configs.parse_shapes("smollm2:1:256:4,llama68m:64:256:1") == [
        ("smollm2", 1, 256, 4),
        ("llama68m", 64, 256, 1),
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU path measures")
def test_without_a_gpu_it_exits_2(capsys):
    assert attn_configs.main(["--shapes", "smollm2:1:256:1"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().out
