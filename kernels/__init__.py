"""Triton kernels and their launchers; shipped as `specdraft.kernels`.

This package imports torch and triton only, never the runtime."""

from .activation import silu_and_mul
from .kv_store import store_kv
from .paged_attention import (
    AttentionLaunchConfig,
    choose_launch_config,
    num_sms,
    paged_attention,
)
from .rmsnorm import rms_norm
from .rotary import apply_rotary
from .slot_mapping import compute_slot_mapping, prepare_slot_mapping

__all__ = [
    "AttentionLaunchConfig",
    "apply_rotary",
    "choose_launch_config",
    "compute_slot_mapping",
    "num_sms",
    "paged_attention",
    "prepare_slot_mapping",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
]
