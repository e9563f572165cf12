"""specdraft.draft_vocab: ranking ids by the target's answers, the draft vocabulary of a
size, coverage, the counts file, and the shipped counts."""

from __future__ import annotations

import pytest
import torch

from specdraft.draft_vocab import (
    SHIPPED_COUNTS,
    count_tokens,
    coverage,
    load_counts,
    ranked_ids,
    save_counts,
    shipped_vocab,
    top_ids,
)


def test_ranking_counts_first_then_unseen_ids_ascending():
    counts = count_tokens([[5, 3, 5], [9, 5, 3], [7]])
    assert counts == {5: 3, 3: 2, 9: 1, 7: 1}
    # by count, ties by id (7 before 9), then the ids never seen, ascending
    assert ranked_ids(counts, 11) == [5, 3, 7, 9, 0, 1, 2, 4, 6, 8, 10]
    assert top_ids(counts, 11, 3).tolist() == [3, 5, 7]  # ascending: draft id order
    assert top_ids(counts, 11, 6).tolist() == [0, 1, 3, 5, 7, 9]
    assert coverage(counts, top_ids(counts, 11, 2)) == pytest.approx(5 / 7)
    assert coverage({}, torch.tensor([1])) == 0.0


@pytest.mark.parametrize("size", [0, 12, -1, 2.0, True, None])
def test_top_ids_refuses_a_bad_size(size):
    with pytest.raises(ValueError, match=r"size must be an int in \[1, 11\]"):
        top_ids({1: 1}, 11, size)


def test_counts_outside_the_vocabulary_are_refused():
    with pytest.raises(ValueError, match=r"counts has token id 11 outside \[0, 11\)"):
        ranked_ids({11: 2}, 11)


def test_counts_file_round_trip(tmp_path):
    counts = {4: 10, 2: 10, 8: 1}
    path = tmp_path / "c.json"
    save_counts(path, counts, 16, "a test")
    assert load_counts(path) == (counts, 16)
    assert '"source": "a test"' in path.read_text()


def test_counts_file_refuses_bad_counts_and_writes_nothing(tmp_path):
    path = tmp_path / "c.json"
    for counts in ({-1: 3, 4: 2}, {16: 1}, {3: -2}):
        with pytest.raises(ValueError, match=r"counts must map ids in \[0, 16\) to counts >= 0"):
            save_counts(path, counts, 16, "a test")
        assert not path.exists()


@pytest.mark.parametrize("size", [-5, 0, "x", 2.0, True])
def test_shipped_vocab_refuses_a_bad_size_with_or_without_the_counts(size, monkeypatch, tmp_path):
    """A bad size is refused whether or not this install ships the counts (stop 43's
    review: without the file, shipped_vocab(-5) returned None)."""
    import specdraft.draft_vocab as dv

    for where in (SHIPPED_COUNTS, tmp_path / "missing.json"):
        monkeypatch.setattr(dv, "SHIPPED_COUNTS", where)
        with pytest.raises(ValueError, match="size must be an int"):
            dv.shipped_vocab(size)


def test_shipped_counts_rank_the_embedded_vocabulary():
    """The shipped file: SmolLM2's 49152 ids, counts from its answers to the training
    prompts; its draft vocabularies are ascending, unique and in range."""
    if not SHIPPED_COUNTS.is_file():
        pytest.skip("this install has no shipped counts")
    counts, vocab = load_counts()
    assert vocab == 49152 and sum(counts.values()) > 100_000
    ids = shipped_vocab(4096)
    assert ids.shape == (4096,) and bool((ids[1:] > ids[:-1]).all())
    assert int(ids[0]) >= 0 and int(ids[-1]) < vocab
    assert coverage(counts, ids) > 0.8  # most of the answers' tokens


def test_bench_coverage_table_reads_the_counts():
    """bench.draft_vocab's table: token totals, and per size the share of the held-out
    answers' tokens the top ids of the training answers cover."""
    from bench.draft_vocab import coverage_table

    train = [[5, 5, 5, 3, 3, 9]]
    held = [[5, 3, 7, 0]]  # 5 and 3 are the top two; 0 is the first unseen id
    text = coverage_table(train, held, 11, [2, 3, 11])
    assert "train answers: 6 tokens, 3 distinct; held-out answers: 4 tokens, 4 distinct" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert rows == [
        "| 2 | 0.182 | 0.5000 |",  # {3, 5}
        "| 3 | 0.273 | 0.5000 |",  # {3, 5, 9}
        "| 11 | 1.000 | 1.0000 |",
    ]
