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
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from torch import nn

from .models.config import DecoderConfig, parse_dtype
from .models.eagle import Eagle3Head, EagleHead
from .models.llama import LlamaForCausalLM, WeightSources

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
IGNORED = ("t2d", "rotary_emb.inv_freq")


class CheckpointError(ValueError):
    """A checkpoint directory, file or tensor is missing or does not fit the config."""


class Checkpoint:
    """Tensors by name, from safetensors files in a directory or from a dict."""

    def __init__(self, config: dict, files: dict[str, Path] | None, tensors=None, where="."):
        self.config, self.where = config, where
        self._files = files or {}  # tensor name -> file
        self._tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self._open: dict[Path, object] = {}

    @classmethod
    def from_tensors(cls, config: dict, tensors: dict[str, torch.Tensor]) -> Checkpoint:
        return cls(config, None, tensors, where="<in-memory tensors>")

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        path = Path(path)
        if not path.exists():
            raise CheckpointError(f"checkpoint path {str(path)!r} does not exist")
        if not path.is_dir():
            raise CheckpointError(f"checkpoint path {str(path)!r} is not a directory")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{str(path)!r} has no config.json")
        try:
            config = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
        return cls(config, _index_files(path), where=str(path))

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

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._tensors:
            return tuple(self._tensors[name].shape)
        return tuple(self._handle(self._files[name]).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        if name in self._tensors:
            return self._tensors[name]
        return self._handle(self._files[name]).get_tensor(name)

    def _handle(self, file: Path):
        if file not in self._open:
            from safetensors import safe_open

            self._open[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._open[file]


def _index_files(path: Path) -> dict[str, Path]:
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover - the test extra installs it
        raise ImportError(
            "loading checkpoints needs safetensors (pip install safetensors)"
        ) from None
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
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
        with safe_open(str(f), framework="pt", device="cpu") as h:
            for name in h.keys():  # noqa: SIM118 (a safe_open handle)
                out[name] = f
    return out


def load_weights(
    module: nn.Module,
    sources: WeightSources,
    ckpt: Checkpoint,
    *,
    optional: tuple[str, ...] = (),
) -> None:
    """Copy checkpoint tensors into `module`'s parameters and buffers: sources maps our
    name to checkpoint names concatenated along dim 0. Every tensor is checked (present,
    shape) before any is copied."""
    params = dict(module.named_parameters())
    params.update(dict(module.named_buffers()))
    plan = []
    for ours, theirs in sources.items():
        dest = params[ours]
        parts, rows = [], 0
        for want in theirs:
            name = ckpt.resolve(want)
            if name is None:
                if ours in optional:
                    break
                raise CheckpointError(
                    f"checkpoint {ckpt.where} has no tensor {want!r} (for {ours}); it holds "
                    f"{len(ckpt.names())} tensors, e.g. {sorted(ckpt.names())[:4]}"
                )
            parts.append((name, ckpt.shape(name)))
            rows += parts[-1][1][0] if parts[-1][1] else 0
        else:
            expect = tuple(dest.shape)
            got = [s for _, s in parts]
            fits = all(s[1:] == expect[1:] for s in got) and rows == (expect[0] if expect else 0)
            if not fits:
                names = [n for n, _ in parts]
                split = f" (concatenated into {expect})" if len(parts) > 1 else ""
                raise CheckpointError(
                    f"tensor(s) {names} in {ckpt.where} have shape(s) {got}, expected "
                    f"{expect}{split} from config.json; check hidden_size, heads, "
                    f"intermediate_size and vocab_size"
                )
            plan.append((dest, [n for n, _ in parts]))
    with torch.no_grad():
        for dest, names in plan:
            start = 0
            for name in names:
                t = ckpt.get(name)
                dest[start : start + t.shape[0]].copy_(t.to(dest.dtype))
                start += t.shape[0]
    used = {n for _, names in plan for n in names}
    unused = sorted(n for n in ckpt.names() - used if not n.endswith(IGNORED))
    if unused:
        logger.warning("%d checkpoint tensors unused, e.g. %s", len(unused), unused[:5])


def _dtype(dtype, cfg: DecoderConfig) -> torch.dtype:
    if dtype in (None, "auto"):
        return cfg.dtype
    return parse_dtype(dtype)


def load_causal_lm(
    path: str | Path | Checkpoint,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
) -> LlamaForCausalLM:
    """A LlamaForCausalLM from a Hugging Face Llama 2/3 or Qwen2 checkpoint directory.
    dtype: None / "auto" takes config.json's torch_dtype (bfloat16 when absent)."""
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint.open(path)
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


def _check_target(target, cfg: DecoderConfig, what: str) -> None:
    if target is None:
        return
    if target.cfg.vocab_size != cfg.vocab_size:
        raise CheckpointError(
            f"{what} vocab_size {cfg.vocab_size} differs from the target's {target.cfg.vocab_size}"
        )


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
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint.open(path)
    if ckpt.resolve("fc.weight") is None:
        raise CheckpointError(f"{ckpt.where} has no fc.weight: not an EAGLE-1 checkpoint")
    if _is_eagle3(ckpt):
        raise CheckpointError(
            f"{ckpt.where} holds an EAGLE-3 head (midlayer.hidden_norm.weight): use "
            f"load_eagle3_head"
        )
    cfg = _head_config(ckpt, "layers.0.self_attn")
    _check_target(target, cfg, "EAGLE-1 head")
    if target is not None and target.cfg.hidden_size != cfg.hidden_size:
        raise CheckpointError(
            f"EAGLE-1 head hidden_size {cfg.hidden_size} differs from the target's "
            f"{target.cfg.hidden_size}"
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
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint.open(path)
    if not _is_eagle3(ckpt):
        raise CheckpointError(
            f"{ckpt.where} has no midlayer.hidden_norm.weight: not an EAGLE-3 checkpoint"
        )
    cfg = _head_config(ckpt, "midlayer.self_attn")
    _check_target(target, cfg, "EAGLE-3 head")
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
    return head.eval()


def _is_eagle3(ckpt: Checkpoint) -> bool:
    return ckpt.resolve("midlayer.hidden_norm.weight") is not None


def _device(target, device) -> torch.device | str:
    if device is not None:
        return device
    return target.embed_tokens.weight.device if target is not None else "cpu"


def load_draft(
    path: str | Path,
    *,
    target: LlamaForCausalLM | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    max_positions: int | None = None,
) -> LlamaForCausalLM | EagleHead | Eagle3Head:
    """Any draft this runtime builds, by what the checkpoint holds: an EAGLE-3 head
    (midlayer.hidden_norm.weight), an EAGLE-1 head (fc.weight) or a causal LM."""
    ckpt = Checkpoint.open(path)
    kw = dict(dtype=dtype, max_positions=max_positions)
    if _is_eagle3(ckpt):
        return load_eagle3_head(ckpt, target=target, device=device, **kw)
    if ckpt.resolve("fc.weight") is not None:
        return load_eagle_head(ckpt, target=target, device=device, **kw)
    return load_causal_lm(ckpt, device=device or "cpu", **kw)
