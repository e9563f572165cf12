"""bench.graph_state's command line off the GPU: a bad --counts is refused by name, and
without a GPU it says so and exits 2 (its measurements need CUDA)."""

from __future__ import annotations

import pytest
import torch

from bench import graph_state


@pytest.mark.parametrize("graphs", ["1,x", "4,2", "-1,2"])
def test_bad_graph_counts_are_refused_by_name(graphs, capsys):
    with pytest.raises(SystemExit) as e:
        graph_state.main([f"--counts={graphs}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--counts" in err and graphs in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU path measures")
def test_without_a_gpu_it_exits_2(capsys, tmp_path):
    assert graph_state.main(["--out", str(tmp_path)]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().out
    assert not any(tmp_path.iterdir()), "nothing written"
