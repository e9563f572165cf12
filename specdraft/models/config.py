"""Model configurations read from (and written as) Hugging Face config.json dicts.

`DecoderConfig` describes a Llama-family decoder (Llama 2/3, Qwen2) and, with a few extra
fields, the EAGLE-1 and EAGLE-3 heads built from the same blocks. `from_hf` accepts the
transformers 4.x spelling (rope_theta, rope_scaling, torch_dtype) that public checkpoints
use and the 5.x one (rope_parameters, dtype); `to_hf` writes the 4.x spelling, which
both versions read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdraft.config import ModelConfig

# Causal LMs `load_causal_lm` builds, by the name in config.json "architectures".
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
MODEL_TYPES = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
ROPE_TYPES = ("default", "linear", "llama3")
_DTYPE_NAMES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


class UnsupportedModelError(ValueError):
    """config.json describes a model this runtime does not build."""


def supported_list() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES) + " (and EAGLE-1 / EAGLE-3 heads over them)"


def parse_dtype(value: str | torch.dtype | None, what: str = "dtype") -> torch.dtype | None:
    """A torch dtype from a dtype or its config.json spelling; None stays None."""
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and value not in _DTYPE_NAMES.values():
            raise TypeError(f"{what} must be bfloat16, float16 or float32, got {value}")
        return value
    if isinstance(value, str):
        name = value.removeprefix("torch.").lower()
        if name in _DTYPE_NAMES:
            return _DTYPE_NAMES[name]
    raise TypeError(f"{what} must be bfloat16, float16 or float32, got {value!r}")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base theta and an optional scaling ("linear" divides every
    frequency by factor; "llama3" divides the low frequencies by factor and blends the
    band between, as in Llama 3.1)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {self.type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
            )
        if not self.theta > 0 or not self.factor > 0:
            raise ValueError(f"rope theta and factor must be positive, got {self}")
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"llama3 rope needs high_freq_factor > low_freq_factor, got {self.high_freq_factor}"
                f" and {self.low_freq_factor}"
            )

    @classmethod
    def from_hf(cls, d: dict) -> RopeConfig:
        params = d.get("rope_parameters")
        if params is None:  # transformers 4.x: rope_theta + rope_scaling
            params = dict(d.get("rope_scaling") or {})
            params.setdefault("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        kw: dict = {"theta": float(params.get("rope_theta", 10000.0)), "type": rope_type}
        if rope_type in ("linear", "llama3"):
            kw["factor"] = float(params["factor"])
        if rope_type == "llama3":
            kw["low_freq_factor"] = float(params.get("low_freq_factor", 1.0))
            kw["high_freq_factor"] = float(params.get("high_freq_factor", 4.0))
            kw["original_max_position_embeddings"] = int(
                params.get("original_max_position_embeddings", 8192)
            )
        return cls(**kw)

    def to_hf(self) -> dict:
        out: dict = {"rope_theta": self.theta, "rope_scaling": None}
        if self.type == "linear":
            out["rope_scaling"] = {"rope_type": "linear", "factor": self.factor}
        elif self.type == "llama3":
            out["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": self.factor,
                "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
            }
        return out


@dataclass(frozen=True)
class DecoderConfig:
    """A Llama-family decoder. qkv_bias: q/k/v projections carry a bias (Qwen2, or Llama
    with attention_bias); o_bias: the output projection too (Llama attention_bias only).
    EAGLE-3 fields: draft_vocab_size (its lm_head's vocabulary), target_hidden_size (width
    of each of the three target hidden states its fc reads; default hidden_size) and
    norm_before_residual."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    model_type: str = "llama"
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    dtype: torch.dtype = torch.bfloat16
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.model_type not in MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported; supported: {supported_list()}"
            )
        # ModelConfig checks the shapes (positive ints, heads divisible, head_dim <= 256).
        self.runtime_config()
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, vocab_size {self.vocab_size}], got "
                f"{self.draft_vocab_size}"
            )

    @property
    def architecture(self) -> str:
        return MODEL_TYPES[self.model_type]

    @property
    def fc_input_size(self) -> int:
        """EAGLE-3: width of the concatenated target hidden states its fc reads."""
        return 3 * (self.target_hidden_size or self.hidden_size)

    def runtime_config(self, dtype: torch.dtype | None = None) -> ModelConfig:
        """The runtime's ModelConfig (sizes the KV cache)."""
        return ModelConfig(
            num_layers=self.num_layers,
            num_q_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            dtype=dtype or self.dtype,
            intermediate_size=self.intermediate_size,
        )

    @classmethod
    def from_hf(cls, d: dict, *, head: bool = False, source: str = "config.json") -> DecoderConfig:
        """From a config.json dict. head=False checks "architectures" against
        SUPPORTED_ARCHITECTURES; EAGLE heads name their own classes there, so for them
        only model_type is checked. vLLM's EAGLE-1 conversions nest the decoder config
        under "model" with model_type "eagle"; that inner config is read."""
        if head and d.get("model_type") == "eagle" and isinstance(d.get("model"), dict):
            d = d["model"]
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        if not head:
            known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
            if archs and not known:
                raise UnsupportedModelError(
                    f"{source}: architecture {archs} is not supported; supported: "
                    f"{supported_list()}"
                )
            if known:
                model_type = SUPPORTED_ARCHITECTURES[known[0]]
        model_type = model_type or "llama"
        if model_type not in MODEL_TYPES:
            raise UnsupportedModelError(
                f"{source}: model_type {model_type!r} (architectures {archs}) is not supported; "
                f"supported: {supported_list()}"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (silu)")
        if d.get("mlp_bias"):
            raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")
        if d.get("use_sliding_window"):
            raise UnsupportedModelError(f"{source}: use_sliding_window=true is not supported")
        if float(d.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedModelError(f"{source}: partial_rotary_factor is not supported")
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
            if k not in d
        ]
        if missing:
            raise ValueError(f"{source} lacks {', '.join(missing)}")
        heads = d.get("num_attention_heads")
        if heads is None:
            raise ValueError(f"{source} lacks num_attention_heads")
        bias = bool(d.get("attention_bias", False))
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim"),
            model_type=model_type,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            rope=RopeConfig.from_hf(d),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else bias,
            o_bias=False if model_type == "qwen2" else bias,
            dtype=parse_dtype(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            draft_vocab_size=d.get("draft_vocab_size"),
            target_hidden_size=d.get("target_hidden_size"),
            norm_before_residual=bool(d.get("norm_before_residual", False)),
        )

    def to_hf(self, architectures: list[str] | None = None) -> dict:
        """A config.json dict in the transformers 4.x spelling."""
        if self.model_type == "qwen2" and (not self.qkv_bias or self.o_bias):
            raise ValueError("Qwen2 has q/k/v biases and no o_proj bias")
        if self.qkv_bias != self.o_bias and self.model_type == "llama":
            raise ValueError("Llama's attention_bias sets both the q/k/v and o_proj biases")
        d = {
            "architectures": architectures or [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": str(self.dtype).removeprefix("torch."),
            **self.rope.to_hf(),
        }
        if self.model_type == "llama":
            d["attention_bias"] = self.qkv_bias
        for k in ("draft_vocab_size", "target_hidden_size"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.norm_before_residual:
            d["norm_before_residual"] = True
        return d
