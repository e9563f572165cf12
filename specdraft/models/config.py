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


# What the loader reads; named in every refusal of a quantized checkpoint.
SUPPORTED_WEIGHTS = "unquantized float16/bfloat16/float32 safetensors"
# config.json keys under which quantization libraries record their format:
# transformers (gptq, awq, fp8, bitsandbytes, compressed-tensors, ...), the older
# compressed-tensors spelling, and MLX.
QUANTIZATION_KEYS = ("quantization_config", "compression_config", "quantization")


class UnsupportedModelError(ValueError):
    """config.json describes a model this runtime does not build."""


def quantization_of(d: dict) -> tuple[str, str] | None:
    """(format, config key) when config.json `d` declares quantized weights, else None.
    Only the declaration is read here; the loader also checks tensor names and dtypes,
    since some converted checkpoints keep quantized tensors and drop the config entry."""
    for key in QUANTIZATION_KEYS:
        q = d.get(key)
        if q is None or q == {} or q is False:
            continue
        if isinstance(q, dict):
            method = q.get("quant_method") or q.get("format")
            if not method and (q.get("load_in_4bit") or q.get("load_in_8bit")):
                method = "bitsandbytes"  # transformers < 4.30 wrote no quant_method
            if not method and "bits" in q:
                method = f"{q['bits']}-bit"
            return str(method or "unknown"), key
        return str(q), key
    inner = d.get("model")  # vLLM's EAGLE-1 conversions nest the decoder config
    if d.get("model_type") == "eagle" and isinstance(inner, dict):
        found = quantization_of(inner)
        if found is not None:
            return found[0], f"model.{found[1]}"
    return None


_REQUIRED = object()


class _Fields:
    """Typed reads of config.json fields. JSON lets "576", true or -2 stand where a
    count belongs; each read names the file and the field instead of failing later
    with a bare TypeError or a silently truncated shape."""

    def __init__(self, d: dict, source: str, prefix: str = ""):
        self.d, self.source, self.prefix = d, source, prefix

    def bad(self, key: str, value: object, want: str) -> ValueError:
        return ValueError(
            f"{self.source}: {self.prefix}{key} must be {want}, got {value!r} "
            f"({type(value).__name__})"
        )

    def _get(self, key: str, default: object) -> object:
        value = self.d.get(key)
        if value is None:  # absent, or null as some converters write
            if default is _REQUIRED:
                raise ValueError(f"{self.source} lacks {self.prefix}{key}")
            return default
        return value

    def integer(self, key: str, default: object = _REQUIRED, lo: int = 1) -> int | None:
        value = self._get(key, default)
        if value is None:  # an optional field left out
            return None
        # bool is an int subclass: true would read as 1.
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise self.bad(key, value, f"an integer >= {lo}")
        return value

    def number(self, key: str, default: object, *, positive: bool = True) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.bad(key, value, "a number")
        if positive and not value > 0:
            raise self.bad(key, value, "a positive number")
        return float(value)

    def flag(self, key: str, default: bool = False) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):  # "false" is truthy: refuse it, do not guess
            raise self.bad(key, value, "true or false")
        return value

    def text(self, key: str, default: object = None) -> str | None:
        value = self._get(key, default)
        if value is not None and not isinstance(value, str):
            raise self.bad(key, value, "a string")
        return value


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
    def from_hf(cls, d: dict, *, source: str = "config.json") -> RopeConfig:
        """From a config.json dict (4.x rope_theta + rope_scaling, or 5.x
        rope_parameters). Errors name `source` and the field."""
        top = _Fields(d, source)
        params = d.get("rope_parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise top.bad("rope_parameters", params, "an object")
            f = _Fields(params, source, "rope_parameters.")
            theta = f.number("rope_theta", 10000.0)
        else:  # transformers 4.x: rope_theta + rope_scaling
            params = d.get("rope_scaling") or {}
            if not isinstance(params, dict):
                raise top.bad("rope_scaling", params, "an object or null")
            f = _Fields(params, source, "rope_scaling.")
            theta = top.number("rope_theta", 10000.0)
        rope_type = f.text("rope_type") or f.text("type") or "default"
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"{source}: rope type {rope_type!r} is not supported (supported: "
                f"{', '.join(ROPE_TYPES)})"
            )
        kw: dict = {"theta": theta, "type": rope_type}
        if rope_type in ("linear", "llama3"):
            kw["factor"] = f.number("factor", _REQUIRED)
        if rope_type == "llama3":
            kw["low_freq_factor"] = f.number("low_freq_factor", 1.0)
            kw["high_freq_factor"] = f.number("high_freq_factor", 4.0)
            kw["original_max_position_embeddings"] = f.integer(
                "original_max_position_embeddings", 8192
            )
        try:
            return cls(**kw)
        except ValueError as e:  # the cross-field checks of __post_init__
            raise ValueError(f"{source}: {e}") from None

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
            h, n = self.hidden_size, self.num_heads
            # Only when both are positive ints: otherwise runtime_config names the bad
            # one (a division here would raise ZeroDivisionError or truncate silently).
            if isinstance(h, int) and isinstance(n, int) and h > 0 and n > 0:
                if h % n:
                    raise ValueError(
                        f"hidden_size {h} is not a multiple of num_heads {n}; give head_dim"
                    )
                object.__setattr__(self, "head_dim", h // n)
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
        under "model" with model_type "eagle"; that inner config is read.

        Every error is a ValueError (UnsupportedModelError for a model this runtime does
        not build) that names `source` and the field."""
        if not isinstance(d, dict):
            raise ValueError(
                f"{source} must hold a JSON object of config fields, got {type(d).__name__}"
            )
        quant = quantization_of(d)
        if quant is not None:
            raise UnsupportedModelError(
                f"{source} declares quantization {quant[0]!r} ({quant[1]}), which specdraft "
                f"does not load; supported: {SUPPORTED_WEIGHTS}"
            )
        prefix = ""
        if head and d.get("model_type") == "eagle" and isinstance(d.get("model"), dict):
            d, prefix = d["model"], "model."
        f = _Fields(d, source, prefix)
        archs = d.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise f.bad("architectures", archs, "a list of class names")
        model_type = f.text("model_type")
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
        if f.flag("mlp_bias"):
            raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")
        if f.flag("use_sliding_window"):
            raise UnsupportedModelError(f"{source}: use_sliding_window=true is not supported")
        if f.number("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError(f"{source}: partial_rotary_factor is not supported")
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [prefix + k for k in required if d.get(k) is None]
        if missing:
            raise ValueError(f"{source} lacks {', '.join(missing)}")
        vocab, hidden = f.integer("vocab_size"), f.integer("hidden_size")
        heads = f.integer("num_attention_heads")
        kv_heads = f.integer("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ValueError(
                f"{source}: {prefix}num_attention_heads {heads} must be a multiple of "
                f"{prefix}num_key_value_heads {kv_heads}"
            )
        head_dim = f.integer("head_dim", None)
        if head_dim is None:
            if hidden % heads:
                raise ValueError(
                    f"{source}: {prefix}hidden_size {hidden} is not a multiple of "
                    f"{prefix}num_attention_heads {heads}, and there is no head_dim field"
                )
            what = f"head_dim (hidden_size {hidden} / num_attention_heads {heads})"
            head_dim = hidden // heads
        else:
            what = "head_dim"
        # Rotary embeddings rotate pairs; the attention kernels tile at most 256.
        if head_dim % 2 or head_dim > 256:
            raise ValueError(
                f"{source}: {prefix}{what} must be even and at most 256, got {head_dim}"
            )
        draft_vocab = f.integer("draft_vocab_size", None)
        if draft_vocab is not None and draft_vocab > vocab:
            raise ValueError(
                f"{source}: {prefix}draft_vocab_size must be in [1, vocab_size {vocab}], got "
                f"{draft_vocab}"
            )
        dtype_key = "torch_dtype" if d.get("torch_dtype") is not None else "dtype"
        dtype_name = f.text(dtype_key, "bfloat16")
        try:
            dtype = parse_dtype(dtype_name)
        except TypeError:
            raise ValueError(
                f"{source}: {prefix}{dtype_key} {dtype_name!r} is not a dtype specdraft builds "
                f"models in (bfloat16, float16, float32)"
            ) from None
        bias = f.flag("attention_bias")
        kw = dict(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=f.integer("intermediate_size"),
            num_layers=f.integer("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            model_type=model_type,
            rms_norm_eps=f.number("rms_norm_eps", 1e-6),
            max_position_embeddings=f.integer("max_position_embeddings", 4096),
            rope=RopeConfig.from_hf(d, source=source),
            tie_word_embeddings=f.flag("tie_word_embeddings"),
            qkv_bias=True if model_type == "qwen2" else bias,
            o_bias=False if model_type == "qwen2" else bias,
            dtype=dtype,
            draft_vocab_size=draft_vocab,
            target_hidden_size=f.integer("target_hidden_size", None),
            norm_before_residual=f.flag("norm_before_residual"),
        )
        try:
            return cls(**kw)
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"{source}: {e}") from None
        except (ValueError, TypeError) as e:  # a check the reads above do not repeat
            raise ValueError(f"{source}: {e}") from None

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
