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


def test_main_job_runs_alternate_and_parse_the_jobs_tables():
    calls = []

    def run(streams, batch):
        calls.append((streams, batch))
        if streams == "per-manager" and batch == 8:
            return "the job failed"  # no table: its rates are None
        rate = 100.0 if streams == "one" else 90.0
        return (f"| tokens/s | {rate + batch} |\n| speculative: tokens/s | {2 * rate} |\n"
                "| speculative: acceptance length | 1.96 |\n")  # fmt: skip

    rows = graph_state.main_job_rows([1, 8], 2, run)
    assert calls == [("one", 1), ("per-manager", 1), ("one", 8), ("per-manager", 8),
                     ("per-manager", 1), ("one", 1), ("per-manager", 8), ("one", 8)]  # fmt: skip
    first = rows[0]
    assert (first["batch"], first["streams"], first["tokens/s"]) == (1, "one", 101.0)
    assert first["speculative: tokens/s"] == 200.0
    assert first["speculative: acceptance length"] == 1.96
    failed = [r for r in rows if r["streams"] == "per-manager" and r["batch"] == 8]
    assert len(failed) == 2 and all(r["tokens/s"] is None for r in failed)
    table = graph_state.main_job_table(rows)
    assert "| 1 | one | 0 | 101.0 | 200.0 | 1.96 |" in table
    assert "| 8 | per-manager | 0 | - | - | - |" in table


def test_per_manager_streams_gives_each_backend_its_own(monkeypatch):
    import specdraft.cuda_graph as cg

    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda: made.append(object()) or made[-1])
    monkeypatch.setattr(cg.CudaGraphBackend, "capture", lambda self, fn, pool: cg.capture_stream())
    shared = object()
    monkeypatch.setattr(cg, "capture_stream", lambda: shared)
    graph_state.per_manager_streams()
    a, b = cg.CudaGraphBackend(), cg.CudaGraphBackend()
    got = [a.capture(None, None), a.capture(None, None), b.capture(None, None)]
    assert got == [made[0], made[0], made[1]] and len(made) == 2
    assert cg.capture_stream() is shared, "restored after each capture"


@pytest.mark.parametrize("flag", ["--batches=0", "--batches=1,x", "--repeats=0"])
def test_bad_main_job_arguments_are_refused_by_name(flag, capsys):
    with pytest.raises(SystemExit) as e:
        graph_state.main(["--main-job", flag])
    assert e.value.code == 2
    assert flag.split("=")[0] in capsys.readouterr().err
