"""Triton kernels and their launchers; shipped as `specdraft.kernels`.

This package imports torch and triton only, never the runtime."""

from .kv_store import store_kv
from .paged_attention import (
    AttentionLaunchConfig,
    choose_launch_config,
    num_sms,
    paged_attention,
)
from .slot_mapping import compute_slot_mapping

__all__ = [
    "AttentionLaunchConfig",
    "choose_launch_config",
    "compute_slot_mapping",
    "num_sms",
    "paged_attention",
    "store_kv",
]
