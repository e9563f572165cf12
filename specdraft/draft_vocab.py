"""A reduced draft vocabulary for an EAGLE-1 head (EagleHead.reduce_vocab).

A draft's lm_head is most of what its step reads (the SmolLM2 head: 49152 rows of 576).
A head that proposes only the target's most frequent output tokens reads a fraction of
it, as EAGLE-3 heads do with their d2t map; the cost is acceptance wherever the target's
token lies outside. The ranking comes from counting the target's greedy answers to the
training prompts (`bench/draft_vocab.py` measures the counts and the coverage of the
held-out answers). Ids the counts never saw follow, ascending.

The shipped counts (`specdraft/data/smollm2_eagle/token_counts.json`) are SmolLM2's
greedy answers to the 1235 training prompts (129643 tokens, 15511 distinct); `specdraft
generate --draft-vocab N` gives the shipped head the top N. On the H200 it does not pay
there (bench/NOTES.md, stop 42): the head's int8 lm_head is a small part of a batch-1
speculative step, and 16384 ids cover 93.9% of the held-out answers' tokens."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

SHIPPED_COUNTS = Path(__file__).parent / "data" / "smollm2_eagle" / "token_counts.json"


def count_tokens(sequences: Iterable[Iterable[int]]) -> dict[int, int]:
    """Occurrences of each token id over the sequences."""
    counts: dict[int, int] = {}
    for seq in sequences:
        for t in seq:
            counts[int(t)] = counts.get(int(t), 0) + 1
    return counts


def ranked_ids(counts: Mapping[int, int], vocab_size: int) -> list[int]:
    """Every id in [0, vocab_size): the counted ones by count (most first, ties by id),
    then the rest ascending. Counts of ids outside the vocabulary are an error."""
    bad = [t for t in counts if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"counts has token id {bad[0]} outside [0, {vocab_size})")
    seen = sorted((t for t, c in counts.items() if c > 0), key=lambda t: (-counts[t], t))
    rest = sorted(set(range(vocab_size)) - set(seen))
    return seen + rest


def top_ids(counts: Mapping[int, int], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` highest-ranked ids (ranked_ids), ascending: a draft vocabulary."""
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= vocab_size:
        raise ValueError(f"size must be an int in [1, {vocab_size}], got {size!r}")
    return torch.tensor(sorted(ranked_ids(counts, vocab_size)[:size]), dtype=torch.int64)


def coverage(counts: Mapping[int, int], ids: torch.Tensor) -> float:
    """The share of the counted tokens that lie in `ids`."""
    total = sum(counts.values())
    keep = set(ids.tolist())
    return sum(c for t, c in counts.items() if t in keep) / total if total else 0.0


def save_counts(path: Path, counts: Mapping[int, int], vocab_size: int, source: str) -> None:
    """Write {token id: count} (ids in [0, vocab_size), counts >= 0) for load_counts;
    a bad entry raises before the file is touched."""
    bad = [(t, c) for t, c in counts.items() if not 0 <= t < vocab_size or c < 0]
    if bad:
        raise ValueError(f"counts must map ids in [0, {vocab_size}) to counts >= 0, got "
                         f"{bad[0][0]}: {bad[0][1]}")  # fmt: skip
    rows = sorted(counts.items(), key=lambda tc: (-tc[1], tc[0]))
    body = ",\n".join(f"  [{t}, {c}]" for t, c in rows)
    head = json.dumps({"source": source, "vocab_size": vocab_size})[:-1]
    Path(path).write_text(f'{head}, "counts": [\n{body}\n]}}\n')


def load_counts(path: Path = SHIPPED_COUNTS) -> tuple[dict[int, int], int]:
    """(counts, vocab_size) from a file save_counts wrote."""
    data = json.loads(Path(path).read_text())
    return {int(t): int(c) for t, c in data["counts"]}, int(data["vocab_size"])


def shipped_vocab(size: int) -> torch.Tensor | None:
    """The shipped head's draft vocabulary of `size` ids, or None where this install
    has no shipped counts."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an int >= 1, got {size!r}")
    if not SHIPPED_COUNTS.is_file():
        return None
    counts, vocab = load_counts()
    return top_ids(counts, vocab, size)
