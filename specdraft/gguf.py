"""Loading Llama-architecture models from GGUF files (llama.cpp's format), beside the
safetensors loader: the `gguf` package reads the file and dequantizes every tensor to
float32 at load; the tensors are renamed to the Hugging Face names and go through the
same weight-sources map and `load_weights` as a safetensors checkpoint.

Two things differ from a Hugging Face checkpoint:

- Names: token_embd, blk.N.{attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down,
  attn_norm,ffn_norm}, output_norm, output (absent with tied embeddings).
- Rotary layout: llama.cpp's converter (convert_hf_to_gguf.py, `permute`) reorders the
  rows of attn_q / attn_k within each head so that the two halves rotated together
  (Hugging Face's rotate_half pairs row i with row i + head_dim/2) become adjacent rows
  (llama.cpp rotates pairs 2i, 2i+1). `unpermute_rotary` restores the original order.

The config comes from the metadata keys llama.* (block_count, embedding_length,
feed_forward_length, attention.head_count(_kv), attention.layer_norm_rms_epsilon,
rope.freq_base, rope.scaling.*, context_length); errors are ValueErrors naming the file.
Requires the optional `gguf` package (pip install 'specdraft[demo]').
"""

from __future__ import annotations

import dataclasses
import logging
import re
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .loader import Checkpoint, CheckpointError, _dtype, load_weights
from .models.config import DecoderConfig, RopeConfig, UnsupportedModelError
from .models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# What gguf.GGUFReader raises on a corrupt or truncated file (UnicodeDecodeError is a
# ValueError; an empty file fails to map with ValueError, a short one to reshape).
_BAD_FILE = (ValueError, IndexError, KeyError, OverflowError, MemoryError, EOFError, struct.error)
# Llama 3.1-style rope scaling is stored as precomputed frequency factors, not as keys.
ROPE_FREQS = "rope_freqs.weight"


def _import_gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError(
            "reading GGUF files needs the gguf package: pip install 'specdraft[demo]' "
            "(or pip install 'gguf>=0.16')"
        ) from None
    if not hasattr(gguf.ReaderField, "contents"):  # added in gguf 0.16
        raise ImportError(
            f"reading GGUF files needs gguf>=0.16, found {_gguf_version(gguf)}: pip install -U gguf"
        )
    return gguf


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama GGUF tensor name, or None when unknown."""
    base, dot, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and kind in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rotary(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a q or k projection weight (or bias).

    Within each head the converter moves row i + d/2 (the partner of row i under
    rotate_half) next to row i: rows [0, d/2, 1, d/2 + 1, ...]. Viewing the head's rows
    as [d/2, 2] and transposing to [2, d/2] restores [0, 1, ..., d - 1]. num_heads is the
    number of heads the rows hold (query heads for q, KV heads for k)."""
    rows = w.shape[0]
    if num_heads < 1 or rows % (2 * num_heads):
        raise ValueError(
            f"a rotary projection of {rows} rows cannot be split into {num_heads} heads of "
            f"an even size"
        )
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _field_value(field, gguf) -> Any:
    value = field.contents()
    if field.types == [gguf.GGUFValueType.FLOAT32]:
        # float32 keys: keep the decimal the converter wrote (1e-05, not 9.99999974e-06)
        value = float(str(np.float32(value)))
    return value


class GGUFCheckpoint(Checkpoint):
    """A GGUF file as a Checkpoint in Hugging Face names: tensors are dequantized to
    float32 (and q / k rows un-permuted) one at a time, when `get` asks for them."""

    def __init__(self, path: str | Path):
        gguf = _import_gguf()
        path = Path(path)
        where = str(path)
        if not path.exists():
            raise CheckpointError(f"GGUF file {where!r} does not exist")
        if not path.is_file():
            raise CheckpointError(f"GGUF path {where!r} is not a file")
        try:
            reader = gguf.GGUFReader(path)
            metadata = {k: _field_value(f, gguf) for k, f in reader.fields.items()}
        except _BAD_FILE as e:  # what the reader raises on bad bytes
            raise CheckpointError(
                f"{where!r} is not a readable GGUF file (corrupt or truncated?): "
                f"{type(e).__name__}: {e}"
            ) from e
        size = path.stat().st_size
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise CheckpointError(
                    f"GGUF file {where!r} is truncated: tensor {t.name!r} needs bytes up to "
                    f"{t.data_offset + t.n_bytes}, the file has {size}"
                )
        super().__init__({}, None, where=where)
        self.gguf, self.reader, self.metadata, self.path = gguf, reader, metadata, path
        self.architecture = metadata.get("general.architecture")
        self._raw = {t.name: t for t in reader.tensors}
        self._hf: dict[str, str] = {}  # HF name -> GGUF name
        unknown = []
        for name in self._raw:
            hf = hf_name(name)
            if hf is not None:
                self._hf[hf] = name
            elif name != ROPE_FREQS:
                unknown.append(name)
        self.unknown = unknown
        self._heads: dict[str, int] = {}  # GGUF name prefix ("attn_q") -> heads to un-permute

    def set_rotary_heads(self, num_heads: int, num_kv_heads: int) -> None:
        self._heads = {"attn_q": num_heads, "attn_k": num_kv_heads}

    def names(self) -> set[str]:
        return set(self._hf)

    def gguf_name(self, name: str) -> str:
        return self._hf[name]

    def tensor_type(self, name: str) -> str:
        return self._raw[self._hf.get(name, name)].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        # GGUF lists dimensions fastest-first (ne0 = columns); torch lists rows first.
        return tuple(int(d) for d in reversed(self._raw[self._hf.get(name, name)].shape))

    def get(self, name: str) -> torch.Tensor:
        gname = self._hf.get(name, name)
        w = self.dequantize(gname)
        m = _LAYER_RE.fullmatch(gname)
        if m and m.group(2) in self._heads:
            w = unpermute_rotary(w, self._heads[m.group(2)])
        return w

    def dequantize(self, gguf_name: str) -> torch.Tensor:
        """One tensor as float32 in torch order, as stored (no un-permutation)."""
        t = self._raw[gguf_name]
        q = self.gguf.GGMLQuantizationType
        qtype = t.tensor_type
        if qtype in (q.I8, q.I16, q.I32, q.I64):
            raise CheckpointError(
                f"GGUF file {self.where!r}: tensor {gguf_name!r} has integer type "
                f"{qtype.name}; weights must be floating point or quantized"
            )
        try:
            if qtype == q.F64:
                arr = np.asarray(t.data, dtype=np.float32)
            else:
                arr = self.gguf.quants.dequantize(t.data, qtype)
        except NotImplementedError:
            raise CheckpointError(
                f"GGUF file {self.where!r}: tensor {gguf_name!r} has quantization type "
                f"{qtype.name}, which gguf {_gguf_version(self.gguf)} cannot dequantize"
            ) from None
        arr = np.asarray(arr, dtype=np.float32)
        if not arr.flags.writeable:  # F32 tensors come back as views of the read-only map
            arr = arr.copy()
        return torch.from_numpy(arr).reshape(self.shape(gguf_name))


def _gguf_version(gguf) -> str:
    try:
        from importlib.metadata import version

        return version("gguf")
    except Exception:  # pragma: no cover
        return getattr(gguf, "__version__", "(unknown version)")


def _key(md: dict, key: str, where: str, default: Any = ...) -> Any:
    if key in md:
        return md[key]
    if default is ...:
        raise CheckpointError(f"GGUF file {where!r} lacks metadata key {key!r}")
    return default


def _uniform(value, key: str, where: str) -> int:
    """An int, or a per-layer list whose entries must all be equal."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedModelError(
                f"GGUF file {where!r}: {key} varies per layer ({sorted(set(value))}); "
                f"only uniform layers are supported"
            )
        value = value[0]
    return int(value)


def _rope_config(ckpt: GGUFCheckpoint, arch: str, head_dim: int) -> RopeConfig:
    md, where = ckpt.metadata, ckpt.where
    theta = float(_key(md, f"{arch}.rope.freq_base", where, 10000.0))
    scaling = md.get(f"{arch}.rope.scaling.type", "none") or "none"
    if ROPE_FREQS in ckpt._raw:
        if scaling not in ("none", "linear") or md.get(f"{arch}.rope.scaling.factor", 1.0) != 1.0:
            raise UnsupportedModelError(
                f"GGUF file {where!r} holds both {ROPE_FREQS} and rope scaling {scaling!r}"
            )
        return _llama3_rope(ckpt, theta, head_dim)
    if scaling == "none":
        return RopeConfig(theta=theta)
    if scaling == "linear":
        factor = float(_key(md, f"{arch}.rope.scaling.factor", where))
        return RopeConfig(theta=theta, type="linear", factor=factor)
    raise UnsupportedModelError(
        f"GGUF file {where!r}: rope scaling type {scaling!r} is not supported "
        f"(supported: none, linear, and Llama 3.1's rope_freqs)"
    )


# (low_freq_factor, high_freq_factor, original_max_position_embeddings) of the published
# Llama 3.1 / 3.2 checkpoints; the factor itself is the largest stored frequency factor.
_LLAMA3_CANDIDATES = ((1.0, 4.0, 8192),)


def _llama3_rope(ckpt: GGUFCheckpoint, theta: float, head_dim: int) -> RopeConfig:
    """Llama 3.1-style scaling from the stored per-frequency divisors: accepted when a
    known (low, high, original length) triple reproduces them."""
    from .layers import rope_inv_freq

    stored = ckpt.dequantize(ROPE_FREQS).double()
    if stored.shape != (head_dim // 2,):
        raise CheckpointError(
            f"GGUF file {ckpt.where!r}: {ROPE_FREQS} has shape {tuple(stored.shape)}, "
            f"expected ({head_dim // 2},)"
        )
    base = rope_inv_freq(head_dim, RopeConfig(theta=theta)).double()
    factor = float(stored.max())
    for low, high, orig in _LLAMA3_CANDIDATES:
        rope = RopeConfig(
            theta=theta,
            type="llama3",
            factor=factor,
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=orig,
        )
        implied = base / rope_inv_freq(head_dim, rope).double()
        if torch.allclose(implied, stored, rtol=1e-4, atol=0):
            return rope
    raise UnsupportedModelError(
        f"GGUF file {ckpt.where!r}: {ROPE_FREQS} matches no supported Llama 3 rope scaling "
        f"(tried factor {factor} with (low, high, original length) in {_LLAMA3_CANDIDATES})"
    )


def _config(ckpt: GGUFCheckpoint) -> DecoderConfig:
    md, where = ckpt.metadata, ckpt.where
    arch = ckpt.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF file {where!r}: architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if int(md.get(f"{arch}.expert_count", 0) or 0) > 0:
        raise UnsupportedModelError(
            f"GGUF file {where!r}: mixture-of-experts models ({arch}.expert_count = "
            f"{md[f'{arch}.expert_count']}) are not supported"
        )
    if ckpt.unknown:
        raise UnsupportedModelError(
            f"GGUF file {where!r} holds tensors a {arch} model does not use: "
            f"{sorted(ckpt.unknown)[:6]}"
        )
    if "model.embed_tokens.weight" not in ckpt.names():
        raise CheckpointError(f"GGUF file {where!r} has no tensor 'token_embd.weight'")
    hidden = int(_key(md, f"{arch}.embedding_length", where))
    heads = _uniform(_key(md, f"{arch}.attention.head_count", where), "head_count", where)
    kv_heads = _uniform(
        _key(md, f"{arch}.attention.head_count_kv", where, heads), "head_count_kv", where
    )
    head_dim = int(md.get(f"{arch}.attention.key_length", hidden // heads))
    value_dim = int(md.get(f"{arch}.attention.value_length", head_dim))
    rot_dim = int(md.get(f"{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim or rot_dim != head_dim:
        raise UnsupportedModelError(
            f"GGUF file {where!r}: key_length {head_dim}, value_length {value_dim} and "
            f"rope.dimension_count {rot_dim} must be equal (partial rotary is not supported)"
        )
    vocab = ckpt.shape("model.embed_tokens.weight")[0]
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) != vocab:
        logger.warning(
            "%s: %d tokens in the tokenizer, %d embedding rows", where, len(tokens), vocab
        )
    names = ckpt.names()
    qkv_bias = "model.layers.0.self_attn.q_proj.bias" in names
    o_bias = "model.layers.0.self_attn.o_proj.bias" in names
    try:
        return DecoderConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_uniform(
                _key(md, f"{arch}.feed_forward_length", where), "feed_forward_length", where
            ),
            num_layers=int(_key(md, f"{arch}.block_count", where)),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            model_type="llama",
            rms_norm_eps=float(_key(md, f"{arch}.attention.layer_norm_rms_epsilon", where)),
            max_position_embeddings=int(_key(md, f"{arch}.context_length", where, 4096)),
            rope=_rope_config(ckpt, arch, head_dim),
            tie_word_embeddings="lm_head.weight" not in names,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            dtype=_default_dtype(ckpt),
        )
    except UnsupportedModelError:
        raise
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"GGUF file {where!r} describes an invalid model: {e}") from e


def _default_dtype(ckpt: GGUFCheckpoint) -> torch.dtype:
    """float32 / float16 / bfloat16 for files stored so; bfloat16 (the runtime's GPU
    dtype) for quantized files, whose weights are dequantized anyway."""
    t = ckpt.tensor_type("model.layers.0.self_attn.q_proj.weight")
    return {"F32": torch.float32, "F16": torch.float16}.get(t, torch.bfloat16)


def open_gguf(path: str | Path) -> tuple[DecoderConfig, GGUFCheckpoint]:
    """The config and a lazily dequantizing checkpoint of a llama GGUF file."""
    ckpt = GGUFCheckpoint(path)
    cfg = _config(ckpt)
    ckpt.set_rotary_heads(cfg.num_heads, cfg.num_kv_heads)
    ckpt.config = cfg.to_hf() if cfg.qkv_bias == cfg.o_bias else {}
    return cfg, ckpt


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata key of a GGUF file (tokenizer included), without its tensors."""
    return GGUFCheckpoint(path).metadata


def read_gguf(path: str | Path) -> tuple[DecoderConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, float32 tensors in Hugging Face names with q / k rows un-permuted,
    metadata) of a llama GGUF file."""
    cfg, ckpt = open_gguf(path)
    tensors = {name: ckpt.get(name) for name in sorted(ckpt.names())}
    return cfg, tensors, ckpt.metadata


def load_gguf_causal_lm(
    path: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
) -> LlamaForCausalLM:
    """A LlamaForCausalLM from a llama GGUF file, dequantized to `dtype` (None / "auto":
    the file's float type, bfloat16 for quantized files). max_positions: rows of the
    rotary table (default the file's context_length)."""
    return _load(open_gguf(path), dtype, device, max_positions)


def load_gguf(
    path: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
):
    """(LlamaForCausalLM, Tokenizer) from one read of a llama GGUF file."""
    from .tokenizer import Tokenizer

    opened = open_gguf(path)
    tokenizer = Tokenizer(opened[1].metadata, where=str(path))
    return _load(opened, dtype, device, max_positions), tokenizer


def _load(opened, dtype, device, max_positions) -> LlamaForCausalLM:
    start = time.perf_counter()
    cfg, ckpt = opened
    cfg = dataclasses.replace(cfg, dtype=_dtype(dtype, cfg))
    logger.info(
        "loading %s: %d layers, hidden %d, %d/%d heads, vocab %d, %s -> %s",
        ckpt.where,
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.vocab_size,
        ckpt.tensor_type("model.layers.0.self_attn.q_proj.weight"),
        cfg.dtype,
    )
    model = LlamaForCausalLM(cfg, device=device, max_positions=max_positions)
    load_weights(model, model.weight_sources(), ckpt)
    logger.info("loaded %s in %.1f s", ckpt.where, time.perf_counter() - start)
    return model.eval()
