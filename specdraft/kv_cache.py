"""Per-layer paged K/V caches, sized from the cache config or a memory budget."""

from __future__ import annotations

import logging

import torch

from .config import CacheConfig, ModelConfig, _check_int, check_device

logger = logging.getLogger(__name__)

NULL_BLOCK = 0  # reserved: padded block-table entries point here; never allocated


def num_blocks_for_budget(model: ModelConfig, cache: CacheConfig, free_bytes: int) -> int:
    """Blocks that fit in gpu_memory_fraction of `free_bytes`."""
    _check_configs(model, cache)
    if cache.gpu_memory_fraction is None:
        raise ValueError("cache.gpu_memory_fraction is None: this cache is sized by num_blocks")
    free_bytes = _check_int("free_bytes", free_bytes, 0)
    per_block = cache.block_size * model.kv_bytes_per_token
    budget = int(free_bytes * cache.gpu_memory_fraction)
    n = budget // per_block
    if n < 2:
        raise ValueError(
            f"gpu_memory_fraction {cache.gpu_memory_fraction} of {free_bytes} free bytes holds "
            f"{n} blocks of {per_block} bytes; at least 2 are needed (one is the null block)"
        )
    return n


def _check_configs(model: object, cache: object) -> None:
    if not isinstance(model, ModelConfig):
        raise TypeError(f"model must be a ModelConfig, got {type(model).__name__}")
    if not isinstance(cache, CacheConfig):
        raise TypeError(f"cache must be a CacheConfig, got {type(cache).__name__}")


class KVCache:
    """K and V for every layer in one allocation [num_layers, 2, num_blocks, block_size,
    num_kv_heads, head_dim]; `layer(i)` gives the (k_cache, v_cache) views the kernels
    take. Block 0 is the null block, kept at zero."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, device: torch.device | str):
        _check_configs(model, cache)
        device = check_device(device)
        if cache.num_blocks is not None:
            num_blocks = cache.num_blocks
        else:
            if device.type != "cuda":
                raise ValueError("gpu_memory_fraction needs a CUDA device; give num_blocks")
            free, _ = torch.cuda.mem_get_info(device)
            num_blocks = num_blocks_for_budget(model, cache, free)
        shape = (
            model.num_layers,
            2,
            num_blocks,
            cache.block_size,
            model.num_kv_heads,
            model.head_dim,
        )
        self.data = torch.empty(shape, dtype=model.dtype, device=device)
        self.data[:, :, NULL_BLOCK].zero_()
        self.num_blocks = num_blocks
        self.block_size = cache.block_size
        self.num_layers = model.num_layers
        logger.info(
            "KV cache: %d blocks of %d tokens, %.2f GiB on %s",
            num_blocks,
            cache.block_size,
            self.data.numel() * self.data.element_size() / 2**30,
            device,
        )

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer i, each [num_blocks, block_size, num_kv_heads,
        head_dim]."""
        i = _check_int("layer index", i, 0, self.num_layers - 1)
        return self.data[i, 0], self.data[i, 1]
