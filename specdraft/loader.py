"""Checkpoint loading from a local directory: config.json plus *.safetensors (one file,
or shards listed in model.safetensors.index.json). Nothing is fetched from the network.

Accepted layouts (tensor names as the public checkpoints spell them):

- Causal LMs, Hugging Face LlamaForCausalLM / Qwen2ForCausalLM (e.g. meta-llama/Llama-2,
  Llama-3.x, JackFram/llama-68m, Qwen/Qwen2-*): model.embed_tokens.weight,
  model.layers.N.self_attn.{q,k,v,o}_proj.weight (+ q/k/v .bias for Qwen2, + all four
  with Llama attention_bias), model.layers.N.mlp.{gate,up,down}_proj.weight,
  model.layers.N.{input,post_attention}_layernorm.weight, model.norm.weight,
  lm_head.weight (absent when tie_word_embeddings).
- EAGLE-1 heads (yuhuili/EAGLE-* converted to safetensors; vLLM's llama_eagle.py layout):
  fc.weight [h, 2h] (+ fc.bias), layers.N.* decoder layer(s), layer 0 usually without
  input_layernorm, optional embed_tokens.weight; the lm_head is the target's.
- EAGLE-3 heads (yuhuili/EAGLE3-*, lmsys/sglang-EAGLE3-*; vLLM/SGLang llama_eagle3.py):
  fc.weight [h, 3h], midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}
  .weight, midlayer.self_attn.{q,k,v,o}_proj.weight (q/k/v over 2h inputs),
  midlayer.mlp.*, norm.weight, lm_head.weight [draft_vocab, h], d2t [draft_vocab]
  int64, t2d (ignored), optional embed_tokens.weight; config.json has draft_vocab_size.

Head tensor names may carry a leading "model." and "midlayer." may be spelled
"layers.0."; both are accepted. Errors (CheckpointError, a ValueError) name the path,
the tensor and the expected shape.

Only unquantized float16/bfloat16/float32 weights load. A quantized checkpoint (a
config.json quantization_config; GPTQ/AWQ qweight/qzeros/scales; fp8 weights with
weight_scale / input_scale; bitsandbytes; compressed-tensors; int8 weights) is refused
by name, never cast to float: the cast would keep the integer codes and drop the scales.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from .config import check_device
from .models.config import SUPPORTED_WEIGHTS, DecoderConfig, parse_dtype, quantization_of
from .models.eagle import Eagle3Head, EagleHead
from .models.llama import LlamaForCausalLM, WeightSources

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
IGNORED = ("t2d", "rotary_emb.inv_freq")
# Files AutoGPTQ and AutoAWQ write beside the weights instead of a quantization_config.
QUANT_CONFIG_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}
# The last component of a tensor name that only quantized checkpoints hold -> format.
QUANT_TENSORS = {
    **dict.fromkeys(("qweight", "qzeros", "scales"), "gptq/awq"),
    "g_idx": "gptq",
    **dict.fromkeys(
        ("weight_scale", "weight_scale_inv", "input_scale", "k_scale", "v_scale", "kv_scale"),
        "fp8",
    ),
    **dict.fromkeys(("weight_packed", "weight_zero_point", "weight_shape"), "compressed-tensors"),
    **dict.fromkeys(("weight_global_scale", "input_global_scale"), "nvfp4"),
    **dict.fromkeys(
        ("SCB", "weight_format", "absmax", "quant_map", "nested_absmax", "nested_quant_map"),
        "bitsandbytes",
    ),
    **dict.fromkeys(("bitsandbytes__nf4", "bitsandbytes__fp4"), "bitsandbytes"),
}
# safetensors header dtypes in torch's spelling, so messages read the same for files
# and in-memory tensors.
_ST_DTYPES = {
    **{f"F{n}": f"float{n}" for n in (16, 32, 64)},
    **{f"I{n}": f"int{n}" for n in (8, 16, 32, 64)},
    **{f"U{n}": f"uint{n}" for n in (8, 16, 32, 64)},
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",
    "BOOL": "bool",
}
# float64 is not quantized: it casts down like float32 does.
_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


class CheckpointError(ValueError):
    """A checkpoint directory, file or tensor is missing or does not fit the config."""


class Checkpoint:
    """Tensors by name, from safetensors files in a directory or from a dict."""

    def __init__(
        self,
        config: dict,
        files: dict[str, Path] | None,
        tensors=None,
        where=".",
        directory: Path | None = None,
    ):
        self.config, self.where, self.directory = config, where, directory
        self._files = files or {}  # tensor name -> file
        self._tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self._open: dict[Path, object] = {}

    @classmethod
    def from_tensors(cls, config: dict, tensors: dict[str, torch.Tensor]) -> Checkpoint:
        if not isinstance(config, dict):
            raise TypeError(f"config must be a config.json dict, got {type(config).__name__}")
        if not isinstance(tensors, dict):
            raise TypeError(
                f"tensors must be a dict of name -> Tensor, got {type(tensors).__name__}"
            )
        for name, t in tensors.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"tensors must map names to Tensors, got {name!r} -> {type(t).__name__}"
                )
        return cls(config, None, tensors, where="<in-memory tensors>")

    @classmethod
    def open(cls, path: str | os.PathLike) -> Checkpoint:
        if not isinstance(path, str | os.PathLike):
            raise TypeError(
                f"path must be a checkpoint directory (str or os.PathLike) or a Checkpoint, "
                f"got {type(path).__name__} {path!r:.80}"
            )
        if os.fspath(path) == "":  # Path("") is ".": do not load the working directory
            raise ValueError("path is empty: give the checkpoint directory")
        path = Path(path).expanduser()
        if not path.exists():
            raise CheckpointError(f"checkpoint path {str(path)!r} does not exist")
        if not path.is_dir():
            hint = ""
            if path.suffix in (".json", ".safetensors"):
                hint = f": pass the directory that holds it, {str(path.parent)!r}"
            raise CheckpointError(f"checkpoint path {str(path)!r} is not a directory{hint}")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{str(path)!r} has no config.json")
        config = _read_json(cfg_file)
        if not isinstance(config, dict):
            raise CheckpointError(
                f"{cfg_file} must hold a JSON object of config fields, got {type(config).__name__}"
            )
        return cls(config, _index_files(path), where=str(path), directory=path)

    def names(self) -> set[str]:
        return set(self._files) | set(self._tensors)

    def resolve(self, name: str) -> str | None:
        """The stored name of `name`, allowing a "model." prefix and, for EAGLE-3,
        "layers.0." for "midlayer."."""
        alts = [name, "model." + name]
        if name.startswith("midlayer."):
            alt = "layers.0." + name.removeprefix("midlayer.")
            alts += [alt, "model." + alt]
        have = self.names()
        return next((a for a in alts if a in have), None)

    def file_of(self, name: str) -> str:
        """Where tensor `name` is stored, for messages."""
        return str(self._files[name]) if name in self._files else self.where

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._tensors:
            return tuple(self._tensors[name].shape)
        return tuple(self._read(name, lambda h: h.get_slice(name).get_shape()))

    def dtype(self, name: str) -> str | None:
        """The stored tensor's dtype in torch's spelling ("bfloat16", "float8_e4m3fn",
        "int8") without reading its data; None where a subclass stores tensors in its
        own way (GGUF dequantizes in `get`): load_weights then checks what `get` gives."""
        if name in self._tensors:
            return str(self._tensors[name].dtype).removeprefix("torch.")
        if name not in self._files:
            return None
        st = self._read(name, lambda h: h.get_slice(name).get_dtype())
        return _ST_DTYPES.get(st, st.lower())

    def get(self, name: str) -> torch.Tensor:
        if name in self._tensors:
            return self._tensors[name]
        return self._read(name, lambda h: h.get_tensor(name))

    def _read(self, name: str, op):
        file = self._files[name]
        handle = self._handle(file)
        try:
            return op(handle)
        except Exception as e:  # safetensors' SafetensorError: no name, no file
            raise CheckpointError(
                f"cannot read tensor {name!r} from {file} ({e}); {INDEX_FILE} may list it in "
                f"the wrong shard, or the file is corrupt"
            ) from None

    def _handle(self, file: Path):
        if file not in self._open:
            self._open[file] = _safe_open(file)
        return self._open[file]


def _safe_open(file: Path):
    """safe_open with the file named in the error: safetensors reports a truncated,
    empty or foreign file as "header too small" and nothing else."""
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:
        size = file.stat().st_size if file.is_file() else "no"
        raise CheckpointError(
            f"{file} is not a readable safetensors file ({size} bytes: {e}); it may be "
            f"truncated or corrupt, download it again"
        ) from None


def _read_json(file: Path) -> object:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None


def _index_files(path: Path) -> dict[str, Path]:
    try:
        import safetensors  # noqa: F401
    except ImportError:  # pragma: no cover - the test extra installs it
        raise ImportError(
            "loading checkpoints needs safetensors (pip install safetensors)"
        ) from None
    index = path / INDEX_FILE
    if index.is_file():
        data = _read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map (an object of tensor -> file)")
        bad = [(k, v) for k, v in weight_map.items() if not isinstance(v, str)]
        if bad:
            raise CheckpointError(
                f"{index} weight_map must map tensor names to file names, got {bad[:3]}"
            )
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise CheckpointError(f"{index} lists shard(s) missing from {path}: {missing}")
        return {name: path / f for name, f in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for pat in ("*.bin", "*.pt", "*.pth") for p in path.glob(pat))
        hint = f" (found {other}: convert them to safetensors)" if other else ""
        raise CheckpointError(f"{str(path)!r} has no *.safetensors files{hint}")
    out: dict[str, Path] = {}
    for f in files:
        with _safe_open(f) as h:
            for name in h.keys():  # noqa: SIM118 (a safe_open handle)
                if name in out:  # without an index, which copy is meant is unknowable
                    raise CheckpointError(
                        f"tensor {name!r} is in both {out[name]} and {f}; add {INDEX_FILE} "
                        f"or remove one of the files"
                    )
                out[name] = f
    return out


def _refuse(ckpt: Checkpoint, fmt: str, evidence: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {ckpt.where} uses quantization {fmt!r} ({evidence}), which specdraft "
        f"does not load; supported: {SUPPORTED_WEIGHTS}"
    )


def check_unquantized(ckpt: Checkpoint) -> None:
    """Refuse a quantized checkpoint by its format, before any other check can blame a
    missing q_proj.weight (GPTQ stores q_proj.qweight) or a cast can hide it."""
    found = quantization_of(ckpt.config) if isinstance(ckpt.config, dict) else None
    if found is not None:
        raise _refuse(ckpt, found[0], f"config.json {found[1]}")
    if ckpt.directory is not None:
        for file, fmt in QUANT_CONFIG_FILES.items():
            if (ckpt.directory / file).is_file():
                raise _refuse(ckpt, fmt, f"{ckpt.directory / file}")
    for name in sorted(ckpt.names()):
        fmt = QUANT_TENSORS.get(name.rpartition(".")[2])
        if fmt is None:
            continue
        if fmt == "fp8":  # compressed-tensors' int8 (w8a8) uses the same scale names
            weight = name.rpartition(".")[0] + ".weight"
            dt = ckpt.dtype(weight) if weight in ckpt.names() else None
            if dt is not None and dt.startswith(("int", "uint")):
                fmt = dt
        raise _refuse(ckpt, fmt, f"tensor {name!r} in {ckpt.file_of(name)}")


def _check_dtype(
    ckpt: Checkpoint, name: str, ours: str, dest: torch.Tensor, dt: str | None = None
) -> None:
    dt = dt or ckpt.dtype(name)
    if dt is None:  # known only once read: checked again in the copy loop
        return
    where = f"tensor {name!r} in {ckpt.file_of(name)} has dtype {dt}"
    if not dest.is_floating_point():  # d2t: integer ids; a float would truncate
        if not dt.startswith(("int", "uint")):
            raise CheckpointError(f"{where}; {ours} needs an integer dtype ({dest.dtype})")
        return
    if dt in _FLOAT_DTYPES:
        return
    if dt.startswith("float8"):
        raise _refuse(ckpt, "fp8", where)
    if dt.startswith(("float4", "float6")):
        raise _refuse(ckpt, "fp4", where)
    if dt.startswith(("int", "uint")):
        raise _refuse(ckpt, dt, where)
    raise CheckpointError(f"{where}; {ours} needs float weights ({SUPPORTED_WEIGHTS})")


def _fused_parts(module: nn.Module, ours: str, n: int) -> list[tuple[int, str]] | None:
    """Rows of each checkpoint tensor fused into `ours`, with the config fields that set
    them, so that swapped q/k or gate/up shapes with the right total are caught."""
    owner, _, _ = ours.rpartition(".")  # "layers.0.self_attn.qkv_proj"
    parent_name, _, proj = owner.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    if proj == "qkv_proj" and n == 3 and hasattr(parent, "q_size"):
        hd = parent.head_dim
        q = f"num_attention_heads {parent.num_heads} x head_dim {hd}"
        kv = f"num_key_value_heads {parent.num_kv_heads} x head_dim {hd}"
        return [(parent.q_size, q), (parent.kv_size, kv), (parent.kv_size, kv)]
    if proj == "gate_up_proj" and n == 2:
        half = module.get_submodule(owner).weight.shape[0] // 2
        return [(half, f"intermediate_size {half}")] * 2
    return None


def load_weights(
    module: nn.Module,
    sources: WeightSources,
    ckpt: Checkpoint,
    *,
    optional: tuple[str, ...] = (),
) -> None:
    """Copy checkpoint tensors into `module`'s parameters and buffers: sources maps our
    name to checkpoint names concatenated along dim 0. Every tensor is checked (present,
    unquantized dtype, shape; each part of a fused q/k/v or gate/up on its own) before
    any is copied."""
    check_unquantized(ckpt)
    params = dict(module.named_parameters())
    params.update(dict(module.named_buffers()))
    advice = (
        "check hidden_size, num_attention_heads, num_key_value_heads, head_dim, "
        "intermediate_size and vocab_size"
    )
    plan = []
    for ours, theirs in sources.items():
        dest = params[ours]
        parts = []
        for want in theirs:
            name = ckpt.resolve(want)
            if name is None:
                if ours in optional:
                    break
                raise CheckpointError(
                    f"checkpoint {ckpt.where} has no tensor {want!r} (for {ours}); it holds "
                    f"{len(ckpt.names())} tensors, e.g. {sorted(ckpt.names())[:4]}"
                )
            _check_dtype(ckpt, name, ours, dest)
            parts.append((name, ckpt.shape(name)))
        else:
            expect = tuple(dest.shape)
            rows = [(expect[0] if expect else 0, "")] if len(parts) == 1 else None
            rows = rows or _fused_parts(module, ours, len(parts))
            if rows is not None:
                for (name, got), (n, why) in zip(parts, rows, strict=True):
                    want = (n, *expect[1:]) if expect else ()
                    if got != want:
                        why = f" ({why} rows, fused into {ours})" if why else ""
                        raise CheckpointError(
                            f"tensor {name!r} in {ckpt.file_of(name)} has shape {got}, "
                            f"expected {want} from config.json{why}; {advice}"
                        )
            else:  # a fusion without a known split: the total and the trailing dims
                got = [s for _, s in parts]
                total = sum(s[0] if s else 0 for s in got)
                if not all(s[1:] == expect[1:] for s in got) or total != (
                    expect[0] if expect else 0
                ):
                    raise CheckpointError(
                        f"tensors {[n for n, _ in parts]} in {ckpt.where} have shapes {got}, "
                        f"expected {expect} together (fused into {ours}); {advice}"
                    )
            plan.append((ours, dest, [n for n, _ in parts]))
    with torch.no_grad():
        for ours, dest, names in plan:
            start = 0
            for name in names:
                t = ckpt.get(name)
                _check_dtype(ckpt, name, ours, dest, str(t.dtype).removeprefix("torch."))
                dest[start : start + t.shape[0]].copy_(t.to(dest.dtype))
                start += t.shape[0]
    used = {n for _, _, names in plan for n in names}
    unused = sorted(n for n in ckpt.names() - used if not n.endswith(IGNORED))
    if unused:
        logger.warning("%d checkpoint tensors unused, e.g. %s", len(unused), unused[:5])


# ---- arguments ----------------------------------------------------------------------


def _open(path: str | os.PathLike | Checkpoint) -> Checkpoint:
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint.open(path)
    check_unquantized(ckpt)
    return ckpt


def _dtype(dtype, cfg: DecoderConfig) -> torch.dtype:
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return cfg.dtype
    return parse_dtype(dtype)


def _parse_device(device: torch.device | str | int) -> torch.device:
    """A torch.device from the `device` argument, refused here (ValueError naming it)
    rather than deep in a tensor constructor as a RuntimeError."""
    return check_device(device)


def _device(target, device) -> torch.device:
    if device is None:
        return target.embed_tokens.weight.device if target is not None else torch.device("cpu")
    dev = _parse_device(device)
    if target is not None:
        # A head shares the target's embedding (and EAGLE-1 its lm_head): on another
        # device the first forward fails far from here.
        have = target.embed_tokens.weight.device
        if dev.type != have.type or dev.index not in (None, have.index):
            raise ValueError(
                f"device {device!r} differs from the target's device {have}; the head shares "
                f"the target's modules, leave device=None"
            )
    return dev


def _check_max_positions(max_positions: int | None) -> None:
    if max_positions is None:
        return
    if isinstance(max_positions, bool) or not isinstance(max_positions, int):
        raise TypeError(
            f"max_positions must be an int or None, got {type(max_positions).__name__} "
            f"{max_positions!r}"
        )
    if max_positions < 1:
        raise ValueError(f"max_positions must be >= 1 or None, got {max_positions}")


def _check_target(target, cfg: DecoderConfig, what: str, ckpt: Checkpoint) -> None:
    if target is None:
        return
    if not isinstance(target, LlamaForCausalLM):
        raise TypeError(
            f"target must be a LlamaForCausalLM (from load_causal_lm) or None, got "
            f"{type(target).__name__}"
        )
    if target.cfg.vocab_size != cfg.vocab_size:
        raise CheckpointError(
            f"{what} vocab_size {cfg.vocab_size} differs from the target's "
            f"{target.cfg.vocab_size} ({ckpt.where}/config.json)"
        )


# ---- loaders --------------------------------------------------------------------------


def load_causal_lm(
    path: str | Path | Checkpoint,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = "cpu",
    max_positions: int | None = None,
) -> LlamaForCausalLM:
    """A LlamaForCausalLM from a Hugging Face Llama 2/3 or Qwen2 checkpoint directory.
    dtype: None / "auto" takes config.json's torch_dtype (bfloat16 when absent)."""
    device = _device(None, device)
    _check_max_positions(max_positions)
    ckpt = _open(path)
    cfg = DecoderConfig.from_hf(ckpt.config, source=f"{ckpt.where}/config.json")
    model = LlamaForCausalLM(
        cfg, dtype=_dtype(dtype, cfg), device=device, max_positions=max_positions
    )
    load_weights(model, model.weight_sources(), ckpt)
    return model.eval()


def _head_config(ckpt: Checkpoint, attn_prefix: str) -> DecoderConfig:
    cfg = DecoderConfig.from_hf(ckpt.config, head=True, source=f"{ckpt.where}/config.json")
    # Heads name their own classes in "architectures"; biases follow the tensors.
    qkv_bias = ckpt.resolve(f"{attn_prefix}.q_proj.bias") is not None
    o_bias = ckpt.resolve(f"{attn_prefix}.o_proj.bias") is not None
    return dataclasses.replace(cfg, qkv_bias=qkv_bias, o_bias=o_bias)


def load_eagle_head(
    path: str | Path | Checkpoint,
    *,
    target: LlamaForCausalLM | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    max_positions: int | None = None,
) -> EagleHead:
    """An EAGLE-1 head. With `target`, the head shares its embedding and lm_head (and
    defaults to its dtype and device); without, the checkpoint must hold
    embed_tokens.weight and lm_head.weight."""
    _check_max_positions(max_positions)
    ckpt = _open(path)
    if ckpt.resolve("fc.weight") is None:
        raise CheckpointError(f"{ckpt.where} has no fc.weight: not an EAGLE-1 checkpoint")
    if _is_eagle3(ckpt):
        raise CheckpointError(
            f"{ckpt.where} holds an EAGLE-3 head (midlayer.hidden_norm.weight): use "
            f"load_eagle3_head"
        )
    cfg = _head_config(ckpt, "layers.0.self_attn")
    _check_target(target, cfg, "EAGLE-1 head", ckpt)
    if target is not None and target.cfg.hidden_size != cfg.hidden_size:
        raise CheckpointError(
            f"EAGLE-1 head hidden_size {cfg.hidden_size} differs from the target's "
            f"{target.cfg.hidden_size} ({ckpt.where}/config.json)"
        )
    if target is None and ckpt.resolve("lm_head.weight") is None:
        raise CheckpointError(
            f"{ckpt.where} has no lm_head.weight: EAGLE-1 heads use the target's, pass target="
        )
    head = EagleHead(
        cfg,
        embed_tokens=target.embed_tokens if target is not None else None,
        lm_head=target.lm_head if target is not None else None,
        fc_bias=ckpt.resolve("fc.bias") is not None,
        first_input_norm=ckpt.resolve("layers.0.input_layernorm.weight") is not None,
        dtype=target.dtype if target is not None and dtype is None else _dtype(dtype, cfg),
        device=_device(target, device),
        max_positions=max_positions,
    )
    load_weights(head, head.weight_sources(), ckpt)
    return head.eval()


def load_eagle3_head(
    path: str | Path | Checkpoint,
    *,
    target: LlamaForCausalLM | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    max_positions: int | None = None,
) -> Eagle3Head:
    """An EAGLE-3 head. The checkpoint's embed_tokens.weight is used when present;
    otherwise the target's embedding is shared (then `target` is required)."""
    _check_max_positions(max_positions)
    ckpt = _open(path)
    if not _is_eagle3(ckpt):
        raise CheckpointError(
            f"{ckpt.where} has no midlayer.hidden_norm.weight: not an EAGLE-3 checkpoint"
        )
    cfg = _head_config(ckpt, "midlayer.self_attn")
    _check_target(target, cfg, "EAGLE-3 head", ckpt)
    width = cfg.target_hidden_size or cfg.hidden_size
    if target is not None and target.cfg.hidden_size != width:
        raise CheckpointError(
            f"EAGLE-3 head reads target hidden states {width} wide (target_hidden_size, else "
            f"hidden_size, in {ckpt.where}/config.json); the target's hidden_size is "
            f"{target.cfg.hidden_size}"
        )
    own_embed = ckpt.resolve("embed_tokens.weight") is not None
    if not own_embed and target is None:
        raise CheckpointError(
            f"{ckpt.where} has no embed_tokens.weight: pass target= to share its embedding"
        )
    if ckpt.resolve("d2t") is None and cfg.draft_vocab_size not in (None, cfg.vocab_size):
        raise CheckpointError(
            f"{ckpt.where} has no d2t tensor, needed to map draft_vocab_size "
            f"{cfg.draft_vocab_size} back to vocab_size {cfg.vocab_size}"
        )
    head = Eagle3Head(
        cfg,
        embed_tokens=None if own_embed else target.embed_tokens,
        dtype=target.dtype if target is not None and dtype is None else _dtype(dtype, cfg),
        device=_device(target, device),
        max_positions=max_positions,
    )
    load_weights(head, head.weight_sources(), ckpt, optional=("d2t",))
    _check_d2t(head, ckpt)
    return head.eval()


def _check_d2t(head: Eagle3Head, ckpt: Checkpoint) -> None:
    """Draft id d maps to target id d + d2t[d]; one outside the vocabulary would index
    out of bounds on the device (a CUDA assert far from the cause), so check it here."""
    ids = torch.arange(head.d2t.shape[0], device=head.d2t.device) + head.d2t
    bad = ((ids < 0) | (ids >= head.cfg.vocab_size)).nonzero()
    if bad.numel():
        d = int(bad[0, 0])
        name = ckpt.resolve("d2t")
        raise CheckpointError(
            f"tensor {name!r} in {ckpt.file_of(name)} maps draft id {d} to target id "
            f"{int(ids[d])}, outside [0, vocab_size {head.cfg.vocab_size})"
        )


def _is_eagle3(ckpt: Checkpoint) -> bool:
    return ckpt.resolve("midlayer.hidden_norm.weight") is not None


def load_draft(
    path: str | Path | Checkpoint,
    *,
    target: LlamaForCausalLM | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    max_positions: int | None = None,
) -> LlamaForCausalLM | EagleHead | Eagle3Head:
    """Any draft this runtime builds, by what the checkpoint holds: an EAGLE-3 head
    (midlayer.hidden_norm.weight), an EAGLE-1 head (fc.weight) or a causal LM."""
    if target is not None and not isinstance(target, LlamaForCausalLM):
        raise TypeError(f"target must be a LlamaForCausalLM or None, got {type(target).__name__}")
    ckpt = _open(path)
    kw = dict(dtype=dtype, max_positions=max_positions)
    if _is_eagle3(ckpt):
        return load_eagle3_head(ckpt, target=target, device=device, **kw)
    if ckpt.resolve("fc.weight") is not None:
        return load_eagle_head(ckpt, target=target, device=device, **kw)
    return load_causal_lm(ckpt, device=device or "cpu", **kw)
