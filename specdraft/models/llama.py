"""A Llama-family causal LM (Llama 2/3, Qwen2) over the paged KV cache, usable as a
draft model and, later, as a target (it can also return the auxiliary hidden states an
EAGLE-3 head reads)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from specdraft import kernels, ops
from specdraft.attn_metadata import AttentionMetadata
from specdraft.kernels import as_int
from specdraft.layers import (
    DecoderLayer,
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    check_step_inputs,
    fused_row_limit,
    layer_caches,
    select_logits,
)

from .config import DecoderConfig

# our parameter name -> checkpoint tensor names, concatenated along dim 0 (fused GEMMs)
WeightSources = dict[str, list[str]]


def decoder_layer_sources(
    cfg: DecoderConfig, ours: str, theirs: str, *, input_norm: bool = True
) -> WeightSources:
    """Sources of one DecoderLayer's parameters named `ours`.* from HF-style names
    `theirs`.* (self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, the two norms)."""
    a, m = f"{theirs}.self_attn", f"{theirs}.mlp"
    src: WeightSources = {
        f"{ours}.self_attn.qkv_proj.weight": [f"{a}.{p}_proj.weight" for p in "qkv"],
        f"{ours}.self_attn.o_proj.weight": [f"{a}.o_proj.weight"],
        f"{ours}.mlp.gate_up_proj.weight": [f"{m}.gate_proj.weight", f"{m}.up_proj.weight"],
        f"{ours}.mlp.down_proj.weight": [f"{m}.down_proj.weight"],
        f"{ours}.post_attention_layernorm.weight": [f"{theirs}.post_attention_layernorm.weight"],
    }
    if input_norm:
        src[f"{ours}.input_layernorm.weight"] = [f"{theirs}.input_layernorm.weight"]
    if cfg.qkv_bias:
        src[f"{ours}.self_attn.qkv_proj.bias"] = [f"{a}.{p}_proj.bias" for p in "qkv"]
    if cfg.o_bias:
        src[f"{ours}.self_attn.o_proj.bias"] = [f"{a}.o_proj.bias"]
    return src


class LlamaForCausalLM(nn.Module):
    """Embedding, decoder layers, final RMSNorm, lm_head (tied to the embedding when the
    config says so). Build it empty and fill it with `specdraft.loader.load_causal_lm`
    or `specdraft.models.tiny.random_causal_lm`.

    max_positions: rows of the rotary table (default max_position_embeddings)."""

    def __init__(
        self,
        cfg: DecoderConfig,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
    ):
        super().__init__()
        dtype = dtype or cfg.dtype
        self.cfg, self.dtype = cfg, dtype
        kw = dict(dtype=dtype, device=device)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, **kw)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope, max_positions or cfg.max_position_embeddings, device=device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rotary, **kw) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, **kw)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def weight_sources(self) -> WeightSources:
        """Our parameter names -> tensor names in a Hugging Face Llama / Qwen2 checkpoint."""
        src: WeightSources = {
            "embed_tokens.weight": ["model.embed_tokens.weight"],
            "norm.weight": ["model.norm.weight"],
        }
        for i in range(self.cfg.num_layers):
            src.update(decoder_layer_sources(self.cfg, f"layers.{i}", f"model.layers.{i}"))
        if not self.cfg.tie_word_embeddings:
            src["lm_head.weight"] = ["lm_head.weight"]
        return src

    def fused_rows(self) -> int:
        """Rows up to which this model's forward takes the fused decode path."""
        return fused_row_limit(self, self.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches,
        *,
        logits_indices: torch.Tensor | None = None,
        all_logits: bool = False,
        aux_layers: Sequence[int] | None = None,
        head=None,
    ):
        """input_ids int64 [num_tokens] (usually meta.input_ids); positions come from
        meta.positions; kv_caches: a KVCache or one (k_cache, v_cache) pair per layer.

        Returns (hidden [num_tokens, hidden_size] after the final norm, logits) where
        logits are for each request's last token [num_reqs, vocab], or for
        `logits_indices`, or for every token with all_logits=True. With aux_layers,
        returns a third tensor [num_tokens, len(aux_layers) * hidden_size]: the
        residual stream entering each of those layers (what an EAGLE-3 head reads; vLLM
        uses layers (2, L // 2, L - 3)). head: a callable that replaces the lm_head on
        the chosen rows (its result is returned in place of the logits)."""
        # Every check before the first write: a bad argument leaves every cache as it was.
        cfg = self.cfg
        check_step_inputs(
            input_ids,
            meta,
            vocab_size=cfg.vocab_size,
            rotary=self.rotary,
            logits_indices=logits_indices,
            all_logits=all_logits,
        )
        caches = layer_caches(
            kv_caches,
            cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
        )
        aux_at = [as_int("aux_layers[i]", i) for i in (aux_layers or ())]
        for i in aux_at:
            if not 0 <= i < cfg.num_layers:
                raise ValueError(f"aux_layers holds {i}, outside [0, {cfg.num_layers})")
        aux: list[torch.Tensor | None] = [None] * len(aux_at)
        # A few rows take the fused decode path: one residual stream (`hidden`, the
        # embedding's fresh output, gathered by a PDL launch) updated in place, so
        # `residual` stays None.
        table = self.embed_tokens.weight
        fused = ops.fused_decode(table, self.fused_rows(), rows=input_ids.shape[0])
        pdl = fused and kernels.pdl_supported(table.device)
        if fused:
            hidden = ops.embed_rows(input_ids, table, pdl=pdl)
        else:
            hidden = self.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            for j, at in enumerate(aux_at):
                if at == i:
                    # clone at layer 0 / on the fused path: that tensor is updated in place
                    aux[j] = hidden.clone() if residual is None else hidden + residual
            if fused:
                layer.forward_fused(hidden, meta, caches[i], pdl=pdl)
            else:
                hidden, residual = layer(hidden, residual, meta, caches[i])
        hidden = self.norm(hidden) if fused else self.norm(hidden, residual)[0]
        logits = select_logits(hidden, head or self.lm_head, meta, logits_indices, all_logits)
        if aux_layers is None:
            return hidden, logits
        return hidden, logits, torch.cat(aux, dim=-1)


def layer_truncated(model: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """A draft made of `model`'s first num_layers decoder layers, its embedding, final
    norm and lm_head, sharing every weight (self-speculation without training; useful as
    plumbing, rarely as a good draft)."""
    import dataclasses

    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise TypeError(f"num_layers must be an int, got {num_layers!r}")
    if not 1 <= num_layers <= model.cfg.num_layers:
        raise ValueError(f"num_layers must be in [1, {model.cfg.num_layers}], got {num_layers}")
    cfg = dataclasses.replace(model.cfg, num_layers=num_layers)
    draft = LlamaForCausalLM.__new__(LlamaForCausalLM)
    nn.Module.__init__(draft)
    draft.cfg, draft.dtype = cfg, model.dtype
    draft.embed_tokens, draft.rotary, draft.norm = model.embed_tokens, model.rotary, model.norm
    draft.layers = nn.ModuleList(list(model.layers)[:num_layers])
    draft.lm_head = model.lm_head
    return draft.eval()
