"""Built-in configurations, seeded random weights in the real checkpoint layouts, and a
writer of checkpoint directories, so the demo, tests and benchmarks run without a
downloaded checkpoint (and the tests can exercise the loader on real file layouts)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from .config import DecoderConfig, RopeConfig


def tiny_config(model_type: str = "llama", **overrides) -> DecoderConfig:
    """A few-hundred-KB model for CPU tests under the Triton interpreter (fp32)."""
    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        model_type=model_type,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        qkv_bias=model_type == "qwen2",
        dtype=torch.float32,
    )
    base.update(overrides)
    return DecoderConfig(**base)


def llama_68m_config(**overrides) -> DecoderConfig:
    """The shape of JackFram/llama-68m, a common small draft model."""
    base = dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=3072,
        num_layers=2,
        num_heads=12,
        num_kv_heads=12,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        dtype=torch.bfloat16,
    )
    base.update(overrides)
    return DecoderConfig(**base)


def smollm2_135m_config(**overrides) -> DecoderConfig:
    """SmolLM2-135M-Instruct's shapes, as its GGUF metadata gives them (bf16)."""
    base = dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        rope=RopeConfig(theta=100000.0),
        tie_word_embeddings=True,
        dtype=torch.bfloat16,
    )
    base.update(overrides)
    return DecoderConfig(**base)


def llama3_8b_config(**overrides) -> DecoderConfig:
    """Llama-3.1-8B's shape; with num_layers=1 the shape of its EAGLE heads (add
    draft_vocab_size=32000 for EAGLE-3)."""
    base = dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope=RopeConfig(
            theta=500000.0,
            type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        dtype=torch.bfloat16,
    )
    base.update(overrides)
    return DecoderConfig(**base)


class _Init:
    """Seeded random tensors: linear weights ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1^2),
    biases ~ N(0, 0.1^2), embeddings ~ N(0, 1): activations stay O(1) through the
    layers and logits spread by a few units, so greedy decoding is not a coin toss."""

    def __init__(self, seed: int, device):
        self.device = torch.device(device)
        self.g = torch.Generator(self.device).manual_seed(seed)

    def randn(self, *shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        t = torch.randn(shape, generator=self.g, device=self.device, dtype=torch.float32)
        return t.mul_(std).add_(mean)

    def linear(self, out: dict, name: str, n_out: int, n_in: int, bias: bool = False) -> None:
        out[f"{name}.weight"] = self.randn(n_out, n_in, std=1 / math.sqrt(n_in))
        if bias:
            out[f"{name}.bias"] = self.randn(n_out, std=0.1)

    def norm(self, out: dict, name: str, n: int) -> None:
        out[f"{name}.weight"] = self.randn(n, std=0.1, mean=1.0)

    def layer(
        self, out: dict, prefix: str, cfg: DecoderConfig, *, in_size=None, input_norm=True
    ) -> None:
        h, d = cfg.hidden_size, cfg.head_dim
        in_size = in_size or h
        a = f"{prefix}.self_attn"
        self.linear(out, f"{a}.q_proj", cfg.num_heads * d, in_size, cfg.qkv_bias)
        self.linear(out, f"{a}.k_proj", cfg.num_kv_heads * d, in_size, cfg.qkv_bias)
        self.linear(out, f"{a}.v_proj", cfg.num_kv_heads * d, in_size, cfg.qkv_bias)
        self.linear(out, f"{a}.o_proj", h, cfg.num_heads * d, cfg.o_bias)
        for p in ("gate", "up"):
            self.linear(out, f"{prefix}.mlp.{p}_proj", cfg.intermediate_size, h)
        self.linear(out, f"{prefix}.mlp.down_proj", h, cfg.intermediate_size)
        if input_norm:
            self.norm(out, f"{prefix}.input_layernorm", h)
        self.norm(out, f"{prefix}.post_attention_layernorm", h)


def random_weights(cfg: DecoderConfig, *, seed: int = 0, device="cpu") -> dict:
    """float32 tensors of a causal LM, named as in a Hugging Face checkpoint."""
    init, out = _Init(seed, device), {}
    h = cfg.hidden_size
    out["model.embed_tokens.weight"] = init.randn(cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        init.layer(out, f"model.layers.{i}", cfg)
    init.norm(out, "model.norm", h)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = init.randn(cfg.vocab_size, h, std=2 / math.sqrt(h))
    return out


def random_eagle_weights(
    cfg: DecoderConfig,
    *,
    seed: int = 0,
    fc_bias: bool = True,
    with_embed: bool = False,
    device="cpu",
) -> dict:
    """float32 tensors of an EAGLE-1 head in the EAGLE-1 checkpoint layout."""
    init, out = _Init(seed, device), {}
    h = cfg.hidden_size
    init.linear(out, "fc", h, 2 * h, fc_bias)
    for i in range(cfg.num_layers):
        init.layer(out, f"layers.{i}", cfg, input_norm=i > 0)
    if with_embed:
        out["embed_tokens.weight"] = init.randn(cfg.vocab_size, h)
    return out


def random_d2t(vocab_size: int, draft_vocab_size: int, seed: int = 0):
    """(d2t, t2d) for a random draft vocabulary: draft id i maps to target id
    i + d2t[i] (increasing); t2d[v] marks target ids in the draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab_size, generator=g)[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(draft_vocab_size), t2d


def random_eagle3_weights(
    cfg: DecoderConfig, *, seed: int = 0, with_embed: bool = True, device="cpu"
) -> dict:
    """float32 tensors (d2t int64, t2d bool) of an EAGLE-3 head in its checkpoint layout."""
    init, out = _Init(seed, device), {}
    h, dv = cfg.hidden_size, cfg.draft_vocab_size or cfg.vocab_size
    init.linear(out, "fc", h, cfg.fc_input_size)
    init.layer(out, "midlayer", cfg, in_size=2 * h)
    init.norm(out, "midlayer.hidden_norm", h)
    init.norm(out, "norm", h)
    out["lm_head.weight"] = init.randn(dv, h, std=2 / math.sqrt(h))
    d2t, t2d = random_d2t(cfg.vocab_size, dv, seed)
    out["d2t"], out["t2d"] = d2t.to(device), t2d.to(device)
    if with_embed:
        out["embed_tokens.weight"] = init.randn(cfg.vocab_size, h)
    return out


def write_checkpoint(
    path: str | Path,
    config: DecoderConfig | dict,
    tensors: dict[str, torch.Tensor],
    *,
    num_shards: int = 1,
    dtype: torch.dtype | None = None,
    architectures: list[str] | None = None,
) -> Path:
    """A checkpoint directory as the hubs hold them: config.json and model.safetensors,
    or model-0000i-of-0000n.safetensors shards with model.safetensors.index.json.
    Floating tensors are cast to `dtype` (default: the config's)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if isinstance(config, DecoderConfig):
        dtype = dtype or config.dtype
        config = config.to_hf(architectures)
    config = dict(config)
    if dtype is not None:
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    cast = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
        .detach()
        .cpu()
        .contiguous()
        for k, v in tensors.items()
    }
    names = sorted(cast)
    if num_shards <= 1:
        save_file(cast, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    weight_map = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: cast[n] for n in names[i::num_shards]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in cast.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


def eagle_config(target: DecoderConfig, **overrides) -> DecoderConfig:
    """A one-layer head config over `target`'s shapes (EAGLE-1; add draft_vocab_size
    for EAGLE-3)."""
    return dataclasses.replace(target, num_layers=1, tie_word_embeddings=False, **overrides)


def random_causal_lm(
    cfg: DecoderConfig, *, seed: int = 0, dtype=None, device="cpu", max_positions=None
):
    """A LlamaForCausalLM with seeded random weights (through the loader's name map)."""
    from specdraft.loader import Checkpoint, load_causal_lm

    ckpt = Checkpoint.from_tensors(cfg.to_hf(), random_weights(cfg, seed=seed, device=device))
    return load_causal_lm(ckpt, dtype=dtype, device=device, max_positions=max_positions)


def random_eagle_head(cfg: DecoderConfig, target, *, seed: int = 0, max_positions=None):
    """An EAGLE-1 head with seeded random weights sharing `target`'s embedding and lm_head."""
    from specdraft.loader import Checkpoint, load_eagle_head

    dev = target.embed_tokens.weight.device
    ckpt = Checkpoint.from_tensors(cfg.to_hf(), random_eagle_weights(cfg, seed=seed, device=dev))
    return load_eagle_head(ckpt, target=target, max_positions=max_positions)


def random_eagle3_head(
    cfg: DecoderConfig,
    *,
    seed: int = 0,
    dtype=None,
    device="cpu",
    target=None,
    max_positions=None,
):
    """An EAGLE-3 head with seeded random weights (its own embedding unless `target`)."""
    from specdraft.loader import Checkpoint, load_eagle3_head

    w = random_eagle3_weights(cfg, seed=seed, with_embed=target is None, device=device)
    ckpt = Checkpoint.from_tensors(cfg.to_hf(["LlamaForCausalLMEagle3"]), w)
    return load_eagle3_head(
        ckpt, target=target, dtype=dtype, device=device, max_positions=max_positions
    )
