"""Configurations: small frozen dataclasses, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    # numpy integers are ints here too; the frozen field keeps what was given.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < lo or (hi is not None and value > hi):
        limit = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {limit}, got {value}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only model as far as the runtime needs it."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype = torch.bfloat16
    intermediate_size: int | None = None
    sliding_window: int | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_q_heads", "num_kv_heads", "hidden_size", "vocab_size"):
            _check_int(name, getattr(self, name), 1)
        _check_int("head_dim", self.head_dim, 1, 256)
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads {self.num_q_heads} must be a multiple of num_kv_heads "
                f"{self.num_kv_heads}"
            )
        if self.dtype not in _DTYPES:
            raise TypeError(f"dtype must be one of {_DTYPES}, got {self.dtype}")
        if self.intermediate_size is not None:
            _check_int("intermediate_size", self.intermediate_size, 1)
        if self.sliding_window is not None:
            _check_int("sliding_window", self.sliding_window, 1)
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be positive or None, got {self.softcap!r}")

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. Give num_blocks, or gpu_memory_fraction to size it from free
    device memory at allocation time. Block 0 is reserved as the null block."""

    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.block_size not in (16, 32, 64):
            raise ValueError(f"block_size must be 16, 32 or 64, got {self.block_size!r}")
        if (self.num_blocks is None) == (self.gpu_memory_fraction is None):
            raise ValueError("give exactly one of num_blocks and gpu_memory_fraction")
        if self.num_blocks is not None:
            _check_int("num_blocks", self.num_blocks, 2)
        if self.gpu_memory_fraction is not None and not 0 < self.gpu_memory_fraction <= 0.95:
            raise ValueError(
                f"gpu_memory_fraction must be in (0, 0.95], got {self.gpu_memory_fraction!r}"
            )


@dataclass(frozen=True)
class LimitsConfig:
    """Per-step and per-request limits; every persistent buffer is sized from these."""

    max_num_reqs: int
    max_num_tokens: int
    max_model_len: int

    def __post_init__(self) -> None:
        _check_int("max_num_reqs", self.max_num_reqs, 1)
        _check_int("max_num_tokens", self.max_num_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 1)
        if self.max_num_tokens < self.max_num_reqs:
            raise ValueError(
                f"max_num_tokens {self.max_num_tokens} must be >= max_num_reqs "
                f"{self.max_num_reqs} (every scheduled request has a token)"
            )

    def max_blocks_per_req(self, block_size: int) -> int:
        """Blocks that hold max_model_len tokens at block_size tokens a block."""
        _check_int("block_size", block_size, 1)
        return -(-self.max_model_len // block_size)
