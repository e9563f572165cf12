"""Training an EAGLE-1 draft head for a target LlamaForCausalLM by self-distillation.

The head (fc over [embed(token); feature], one decoder layer without its input norm, no
final norm; the target's embedding and lm_head, frozen) is trained in plain PyTorch on
dense causal batches (specdraft.dense). At position i it reads token i + 1 and the
target's feature at i (the pair the runtime prefills at position i) and is asked for the
target's feature at i + 1: smooth-L1 on the feature plus `cls_weight` x cross-entropy
against the target's whole next-token distribution softmax(lm_head(feature)). With
ttt_steps > 1 the head is also unrolled on its own outputs as a draft round runs it
(specdraft.dense.unrolled_attention), each later step's loss weighted by step_decay.
Losses count only rows whose first input token belongs to the answer.

AdamW, warm-up then cosine decay (progress = the larger of steps done and time spent
over their budgets, so a time-capped run still anneals), bf16 autocast on CUDA and
float32 on the CPU, seeded batches, a resumable state file, and the weights saved in
the EAGLE-1 checkpoint layout that specdraft.loader.load_draft reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .dense import layer_forward
from .distill import DistillSet, _progress
from .layers import cos_sin_table
from .models.config import DecoderConfig
from .models.eagle import EagleHead
from .models.llama import LlamaForCausalLM
from .models.tiny import eagle_config, write_checkpoint

logger = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
LOG_FILE = "train_log.json"
ARCHITECTURE = "EagleLlamaForCausalLM"


@dataclass(frozen=True)
class TrainConfig:
    """steps: optimizer steps (None: `epochs` passes over the sequences). batch_size:
    sequences per step. max_seconds: a wall-clock cap on the loop (None: none)."""

    steps: int | None = None
    epochs: float = 1.0
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    grad_clip: float = 0.5
    cls_weight: float = 0.1
    ttt_steps: int = 2
    step_decay: float = 0.8
    noise: float = 0.0
    seed: int = 0
    max_seconds: float | None = None
    save_every: int = 200
    save_dtype: str = "bfloat16"
    head_layers: int = 1  # decoder layers in the head (EAGLE-1 uses one)

    def __post_init__(self) -> None:
        ints = dict(batch_size=1, warmup_steps=0, ttt_steps=1, seed=0, save_every=1, head_layers=1)
        for name, lo in ints.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
            if v < lo:
                raise ValueError(f"{name} must be >= {lo}, got {v}")
        if self.steps is not None:
            if isinstance(self.steps, bool) or not isinstance(self.steps, int):
                raise TypeError(f"steps must be an int or None, got {self.steps!r}")
            if self.steps < 1:
                raise ValueError(f"steps must be >= 1 or None, got {self.steps}")
        reals = dict(
            epochs=(0, False),
            lr=(0, False),
            min_lr_ratio=(0, True),
            weight_decay=(0, True),
            grad_clip=(0, False),
            cls_weight=(0, True),
            step_decay=(0, False),
            noise=(0, True),
        )
        for name, (lo, inclusive) in reals.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise TypeError(f"{name} must be a finite number, got {v!r}")
            if v < lo or (v == lo and not inclusive):
                raise ValueError(f"{name} must be {'>=' if inclusive else '>'} {lo}, got {v}")
        if self.min_lr_ratio > 1:
            raise ValueError(f"min_lr_ratio must be <= 1, got {self.min_lr_ratio}")
        if self.max_seconds is not None and not (
            isinstance(self.max_seconds, (int, float)) and self.max_seconds > 0
        ):
            raise ValueError(f"max_seconds must be > 0 or None, got {self.max_seconds!r}")
        if self.save_dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(
                f"save_dtype must be bfloat16, float16 or float32, got {self.save_dtype!r}"
            )


# ---- the head -------------------------------------------------------------------------


class _Norm(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))


class _Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=cfg.o_bias)


class _MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class _Layer(nn.Module):
    """The parameters of a DecoderLayer under the same names, as trainable nn modules."""

    def __init__(self, cfg: DecoderConfig, *, input_norm: bool):
        super().__init__()
        self.input_layernorm = _Norm(cfg.hidden_size) if input_norm else None
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = _Norm(cfg.hidden_size)
        self.mlp = _MLP(cfg)


class EagleTrainHead(nn.Module):
    """The EAGLE-1 head for training: parameters named as specdraft's EagleHead (fc.*,
    layers.N.*), the target's embedding and lm_head held frozen outside the state
    dict. forward(ids_next, features) -> one output [B, T, h] per unrolled step."""

    def __init__(self, target: LlamaForCausalLM, *, fc_bias: bool = True, num_layers: int = 1):
        super().__init__()
        cfg = eagle_config(target.cfg, dtype=torch.float32)
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
        self.cfg, h = cfg, cfg.hidden_size
        dev = target.embed_tokens.weight.device
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(_Layer(cfg, input_norm=i > 0) for i in range(num_layers))
        self.to(dev)
        # frozen and shared, never copied: plain attributes, not parameters or buffers
        self.embed_weight = target.embed_tokens.weight.detach()
        self.lm_head_weight = target.lm_head.weight.detach()
        self.register_buffer(
            "cos_sin",
            cos_sin_table(cfg.head_dim, cfg.rope, target.rotary.max_positions, dev),
            persistent=False,
        )

    def forward(self, ids_next: torch.Tensor, features: torch.Tensor, steps: int = 1):
        e = F.embedding(ids_next, self.embed_weight)
        kv: list[list] = [[] for _ in self.layers]
        outs: list[torch.Tensor] = []
        feats = features
        for s in range(steps):
            if s:  # position i reads the previous step's output at i - 1
                feats = F.pad(outs[-1], (0, 0, 1, 0))[:, :-1]
            x = self.fc(torch.cat([e.to(feats.dtype), feats], dim=-1))
            for layer, cache in zip(self.layers, kv):
                x = layer_forward(layer, x, self.cos_sin, self.cfg.rms_norm_eps, cache)
            outs.append(x)
        return outs

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight.to(hidden.dtype))


def checkpoint_tensors(head: EagleTrainHead) -> dict[str, torch.Tensor]:
    """The head's tensors under EAGLE-1 checkpoint names (q/k/v and gate/up split),
    the inverse of EagleHead.weight_sources."""
    cfg = head.cfg
    probe = EagleHead.__new__(EagleHead)  # weight_sources reads only these fields
    probe.cfg, probe.fc_bias, probe.first_input_norm = cfg, head.fc.bias is not None, False
    probe.owns_embed = probe.owns_lm_head = False
    state = head.state_dict()
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {}
    for ours, theirs in EagleHead.weight_sources(probe).items():
        t = state[ours].detach()
        if len(theirs) == 1:
            out[theirs[0]] = t
            continue
        sizes = [q, kv, kv] if "qkv_proj" in ours else [cfg.intermediate_size] * 2
        out.update(zip(theirs, t.split(sizes, dim=0)))
    return out


def save_head(head: EagleTrainHead, out_dir: str | Path, dtype: torch.dtype) -> Path:
    """config.json and model.safetensors in the EAGLE-1 layout load_draft reads."""
    cfg = dataclasses.replace(head.cfg, dtype=dtype)
    return write_checkpoint(out_dir, cfg, checkpoint_tensors(head), architectures=[ARCHITECTURE])


# ---- the loss -------------------------------------------------------------------------


@dataclass
class LossParts:
    loss: torch.Tensor
    feature: list[float]
    cls: list[float]
    accuracy: list[float]  # top-1 agreement with the target, per unrolled step


def eagle_loss(
    head: EagleTrainHead,
    outs: list[torch.Tensor],
    features: torch.Tensor,
    lengths: torch.Tensor,
    prompt_lens: torch.Tensor,
    *,
    cls_weight: float,
    step_decay: float,
) -> LossParts:
    """Output of step s at row i against the target's feature at i + 1, on rows
    i - s >= prompt_len - 1 (the round started in the answer) and i + 1 < length."""
    t = features.shape[1] - 1
    rows = torch.arange(t, device=features.device)[None, :]
    target = features[:, 1:].float()
    inside = rows + 1 < lengths[:, None]
    base = inside & (rows >= prompt_lens[:, None] - 1)
    with torch.no_grad():
        tgt_rows = target[base]
        p = torch.softmax(head.logits(tgt_rows.to(features.dtype)).float(), dim=-1)
        tgt_tok = p.argmax(-1)
    where = torch.full_like(rows.expand_as(base), -1)
    where[base] = torch.arange(int(base.sum()), device=features.device)
    total = features.new_zeros((), dtype=torch.float32)
    norm = 0.0
    stats = []  # per step: feature loss, cross-entropy, top-1 agreement (one readback)
    for s, out in enumerate(outs):
        mask = base & (rows - s >= prompt_lens[:, None] - 1)
        idx = where[mask]
        if idx.numel() == 0:
            continue
        o = out[:, :t][mask].float()
        reg = F.smooth_l1_loss(o, tgt_rows[idx])
        logp = torch.log_softmax(head.logits(o).float(), dim=-1)
        ce = -(p[idx] * logp).sum(-1).mean()
        w = step_decay**s
        total = total + w * (reg + cls_weight * ce)
        norm += w
        agree = (logp.argmax(-1) == tgt_tok[idx]).float().mean()
        stats.append(torch.stack([reg.detach(), ce.detach(), agree]))
    cols = torch.stack(stats).T.tolist() if stats else [[], [], []]
    return LossParts(total / max(norm, 1e-12), *cols)


# ---- the loop -------------------------------------------------------------------------


@dataclass
class TrainResult:
    out_dir: Path
    steps: int
    seconds: float
    history: list[dict] = field(default_factory=list)

    @property
    def final(self) -> dict:
        return self.history[-1] if self.history else {}


def _lr_factor(step: int, progress: float, cfg: TrainConfig) -> float:
    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def _check_args(target, data, out_dir, config) -> Path:
    if not isinstance(target, LlamaForCausalLM):
        raise TypeError(f"target must be a LlamaForCausalLM, got {type(target).__name__}")
    if not isinstance(data, DistillSet):
        raise TypeError(f"data must be a DistillSet, got {type(data).__name__}")
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if not isinstance(out_dir, (str, Path)) or str(out_dir) == "":
        raise TypeError(f"out_dir must be a non-empty str or Path, got {out_dir!r}")
    if data.features.shape[1] != target.cfg.hidden_size:
        raise ValueError(
            f"data has features {data.features.shape[1]} wide, the target's hidden_size is "
            f"{target.cfg.hidden_size}"
        )
    if data.features.device != target.embed_tokens.weight.device:
        raise ValueError(
            f"data is on {data.features.device}, the target on {target.embed_tokens.weight.device}"
        )
    if int(data.lengths.max()) > target.rotary.max_positions:
        raise ValueError(
            f"data holds a sequence of {int(data.lengths.max())} tokens, over the target's "
            f"rotary table ({target.rotary.max_positions})"
        )
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} exists and is not a directory")
    return out


def train_eagle_head(
    target: LlamaForCausalLM,
    data: DistillSet,
    out_dir: str | Path,
    config: TrainConfig | None = None,
    *,
    resume: bool = True,
) -> TrainResult:
    """Train an EAGLE-1 head on `data` and save it (config.json, model.safetensors) in
    out_dir, with train_state.pt (resumed from when present and resume=True) and
    train_log.json (the per-step losses). Every argument is checked before anything is
    written."""
    config = TrainConfig() if config is None else config
    out = _check_args(target, data, out_dir, config)
    dev = target.embed_tokens.weight.device
    torch.manual_seed(config.seed)
    head = EagleTrainHead(target, num_layers=config.head_layers)
    decay = [p for p in head.parameters() if p.dim() >= 2]
    rest = [p for p in head.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ],
        lr=config.lr,
        betas=(0.9, 0.95),
    )
    per_epoch = math.ceil(len(data) / config.batch_size)
    total = config.steps or max(1, math.ceil(config.epochs * per_epoch))
    step, spent, history = 0, 0.0, []
    out.mkdir(parents=True, exist_ok=True)
    state_file = out / STATE_FILE
    if resume and state_file.is_file():
        state = torch.load(state_file, map_location=dev, weights_only=False)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        step, spent, history = state["step"], state["seconds"], state["history"]
        logger.info("resumed from %s at step %d (%.0f s)", state_file, step, spent)
    autocast = torch.autocast("cuda", torch.bfloat16) if dev.type == "cuda" else None
    gen = torch.Generator().manual_seed(config.seed)
    start = time.perf_counter() - spent
    bar = _progress(total, "training the draft head", "step")
    if bar is not None:
        bar.update(step)
    order = None
    while step < total:
        elapsed = time.perf_counter() - start
        if config.max_seconds is not None and elapsed >= config.max_seconds:
            logger.info("time budget of %.0f s reached at step %d", config.max_seconds, step)
            break
        epoch, at = divmod(step, per_epoch)
        if order is None or at == 0:
            gen.manual_seed(config.seed * 1_000_003 + epoch)
            order = torch.randperm(len(data), generator=gen)
        index = order[at * config.batch_size : (at + 1) * config.batch_size].to(dev)
        progress = step / total
        if config.max_seconds is not None:
            progress = max(progress, elapsed / config.max_seconds)
        lr = config.lr * _lr_factor(step, progress, config)
        for g in opt.param_groups:
            g["lr"] = lr
        parts = _train_step(head, data, index, config, opt, autocast)
        step += 1
        row = {
            "step": step,
            "lr": lr,
            "loss": float(parts.loss.detach()),
            "feature": parts.feature,
            "cls": parts.cls,
            "accuracy": parts.accuracy,
            "seconds": time.perf_counter() - start,
        }
        history.append(row)
        if bar is not None:
            acc = "/".join(f"{a:.2f}" for a in parts.accuracy)
            bar.set_postfix_str(f"loss {row['loss']:.3f} acc {acc}", refresh=False)
            bar.update(1)
        if step % config.save_every == 0:
            _save_state(state_file, head, opt, step, row["seconds"], history)
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - start
    _save_state(state_file, head, opt, step, seconds, history)
    save_head(head, out, getattr(torch, config.save_dtype))
    (out / LOG_FILE).write_text(
        json.dumps({"config": dataclasses.asdict(config), "history": history})
    )
    return TrainResult(out, step, seconds, history)


def _train_step(head, data, index, config, opt, autocast) -> LossParts:
    ids, feats, lengths, prompt_lens = data.batch(index)
    inputs = feats[:, :-1]
    if config.noise:
        inputs = inputs + (torch.rand_like(inputs, dtype=torch.float32) * 2 - 1).mul_(
            config.noise
        ).to(inputs.dtype)
    ctx = autocast if autocast is not None else contextlib.nullcontext()
    with ctx:
        outs = head(ids[:, 1:], inputs.float() if autocast is None else inputs, config.ttt_steps)
        parts = eagle_loss(
            head,
            outs,
            feats,
            lengths,
            prompt_lens,
            cls_weight=config.cls_weight,
            step_decay=config.step_decay,
        )
    opt.zero_grad(set_to_none=True)
    parts.loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), config.grad_clip)
    opt.step()
    return parts


def _save_state(path: Path, head, opt, step: int, seconds: float, history: list) -> None:
    tmp = path.with_name(path.name + ".tmp")
    state = {
        "head": head.state_dict(),
        "optimizer": opt.state_dict(),
        "step": step,
        "seconds": seconds,
        "history": history,
    }
    torch.save(state, tmp)
    tmp.replace(path)
