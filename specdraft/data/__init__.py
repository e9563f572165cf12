"""Prompt lists shipped with the package: `train_prompts.txt` (instructions the embedded
target answers to write a draft's training text) and `heldout_prompts.txt` (evaluation
only; no 8-gram in common with the training list, checked by tests/test_prompts.py)."""

from __future__ import annotations

from importlib import resources


def load_prompts(name: str) -> list[str]:
    """The prompts of `name` ("train" or "heldout"), one per line."""
    if name not in ("train", "heldout"):
        raise ValueError(f"name must be 'train' or 'heldout', got {name!r}")
    text = resources.files(__package__).joinpath(f"{name}_prompts.txt").read_text("utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]
