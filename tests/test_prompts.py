"""The shipped prompt lists: sizes, no duplicates, and no 8-gram shared between the
training and held-out lists (so the held-out evaluation measures generalization)."""

from __future__ import annotations

import re

import pytest

from specdraft.data import load_prompts


def ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_sizes_and_no_duplicates():
    train, held = load_prompts("train"), load_prompts("heldout")
    assert len(train) >= 120 and len(held) >= 20
    assert len(set(train)) == len(train) and len(set(held)) == len(held)
    assert not set(train) & set(held)


def test_no_shared_8gram():
    train = set().union(*(ngrams(p) for p in load_prompts("train")))
    for p in load_prompts("heldout"):
        shared = ngrams(p) & train
        assert not shared, (p, shared)


def test_shared_8gram_is_detected():
    """The check can fail: a held-out prompt copied into training shares its 8-grams."""
    p = "Write a short poem about a lighthouse at night please."
    assert ngrams(p) & ngrams("Now: " + p)


def test_bad_name():
    with pytest.raises(ValueError, match="name"):
        load_prompts("test")
