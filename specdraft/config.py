"""Configurations: small frozen dataclasses, validated once at construction."""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

import torch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    """`value` as a Python int in [lo, hi]: ints, numpy integers and 0-d integer tensors
    pass (anything with __index__); bool, floats and the rest raise TypeError naming
    `name`, an out-of-range value a ValueError naming `name`, the value and the limit."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an int, got {type(value).__name__} {value!r:.80}"
        ) from None
    if value < lo or (hi is not None and value > hi):
        limit = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {limit}, got {value}")
    return value


def _check_real(name: str, value: object) -> float:
    """`value` as a finite float; TypeError for a non-number (bool included)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r:.80}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _set_int(obj: object, name: str, lo: int, hi: int | None = None) -> None:
    """Check an int field of a frozen dataclass and store it as a Python int (a numpy
    integer given there would otherwise leak into shapes, hashes and messages)."""
    object.__setattr__(obj, name, _check_int(name, getattr(obj, name), lo, hi))


def check_device(device: object, name: str = "device") -> torch.device:
    """A torch.device from `device`, refused here with a ValueError naming it (rather than
    deep in a tensor constructor): an unknown device string, or CUDA where there is none."""
    if isinstance(device, bool) or not isinstance(device, torch.device | str | int):
        raise TypeError(
            f"{name} must be a torch.device, a string such as 'cuda:0' or a CUDA index, got "
            f"{type(device).__name__} {device!r:.80}"
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{name} {device!r} is not a valid torch device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name} {device!r}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"{name} {device!r}: CUDA index {dev.index} out of range, this machine has "
                f"{torch.cuda.device_count()} GPU(s)"
            )
    return dev


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
            _set_int(self, name, 1)
        _set_int(self, "head_dim", 1, 256)
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads {self.num_q_heads} must be a multiple of num_kv_heads "
                f"{self.num_kv_heads}"
            )
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in _DTYPES:
            raise TypeError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.intermediate_size is not None:
            _set_int(self, "intermediate_size", 1)
        if self.sliding_window is not None:
            _set_int(self, "sliding_window", 1)
        if self.softcap is not None:
            softcap = _check_real("softcap", self.softcap)
            if not softcap > 0:
                raise ValueError(f"softcap must be positive or None, got {self.softcap!r}")
            object.__setattr__(self, "softcap", softcap)

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
        _set_int(self, "block_size", 1)
        if self.block_size not in (16, 32, 64):
            raise ValueError(f"block_size must be 16, 32 or 64, got {self.block_size!r}")
        if (self.num_blocks is None) == (self.gpu_memory_fraction is None):
            raise ValueError(
                "give exactly one of num_blocks and gpu_memory_fraction, got num_blocks="
                f"{self.num_blocks!r}, gpu_memory_fraction={self.gpu_memory_fraction!r}"
            )
        if self.num_blocks is not None:
            _set_int(self, "num_blocks", 2, 2**31 - 1)  # block ids are int32
        if self.gpu_memory_fraction is not None:
            fraction = _check_real("gpu_memory_fraction", self.gpu_memory_fraction)
            if not 0 < fraction <= 0.95:
                raise ValueError(
                    f"gpu_memory_fraction must be in (0, 0.95], got {self.gpu_memory_fraction!r}"
                )
            object.__setattr__(self, "gpu_memory_fraction", fraction)


@dataclass(frozen=True)
class LimitsConfig:
    """Per-step and per-request limits; every persistent buffer is sized from these."""

    max_num_reqs: int
    max_num_tokens: int
    max_model_len: int

    def __post_init__(self) -> None:
        _set_int(self, "max_num_reqs", 1)
        _set_int(self, "max_num_tokens", 1)
        _set_int(self, "max_model_len", 1)
        if self.max_num_tokens < self.max_num_reqs:
            raise ValueError(
                f"max_num_tokens {self.max_num_tokens} must be >= max_num_reqs "
                f"{self.max_num_reqs} (every scheduled request has a token)"
            )

    def max_blocks_per_req(self, block_size: int) -> int:
        """Blocks that hold max_model_len tokens at block_size tokens a block."""
        block_size = _check_int("block_size", block_size, 1)
        return -(-self.max_model_len // block_size)
