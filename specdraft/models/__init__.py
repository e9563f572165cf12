"""Draft models on the Triton kernels: a Llama-family causal LM (Llama 2/3, Qwen2) and
the EAGLE-1 / EAGLE-3 heads; configurations and seeded random builders. Checkpoints
load through specdraft.loader."""

from .config import (
    SUPPORTED_ARCHITECTURES,
    DecoderConfig,
    RopeConfig,
    UnsupportedModelError,
)
from .eagle import Eagle3Head, EagleHead
from .llama import LlamaForCausalLM

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "DecoderConfig",
    "Eagle3Head",
    "EagleHead",
    "LlamaForCausalLM",
    "RopeConfig",
    "UnsupportedModelError",
]
