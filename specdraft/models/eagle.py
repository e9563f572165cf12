"""EAGLE-1 and EAGLE-3 draft heads over the paged KV cache.

EAGLE-1 (SafeAILab/EAGLE, cnets.py; vLLM llama_eagle.py): x = fc([embed(token); h])
with fc 2h -> h, then the decoder layer(s) (layer 0 without its input RMSNorm), no
final norm; logits come from the target's lm_head (after reduce_vocab, from the head's
own rows of it, over a draft vocabulary) and the token embedding is the target's. The
output hidden state feeds the next draft step as h.

EAGLE-3 (SafeAILab/EAGLE eagle3; vLLM llama_eagle3.py, SGLang llama_eagle3.py): the
target's auxiliary hidden states (three layers, 3 x target_hidden) go through fc to h
once; one decoder layer whose attention reads [input_norm(embed(token));
hidden_norm(h)] (2h wide); a final norm and its own lm_head over a reduced draft
vocabulary; d2t maps a draft token id d to the target id d + d2t[d]. The pre-norm
output (the residual stream) feeds the next draft step as h.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from specdraft import kernels, ops
from specdraft.attn_metadata import AttentionMetadata
from specdraft.layers import (
    DecoderLayer,
    Embedding,
    Int8Linear,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    check_row_index,
    check_step_inputs,
    fused_row_limit,
    layer_caches,
    select_logits,
)

from .config import DecoderConfig
from .llama import WeightSources, decoder_layer_sources


def _check_hidden(
    hidden: torch.Tensor, num_tokens: int, width: int, what: str, dtype: torch.dtype
) -> None:
    if hidden.dtype != dtype:
        raise TypeError(f"hidden_states has dtype {hidden.dtype}, the head {dtype}")
    if hidden.dim() != 2 or hidden.shape[0] != num_tokens or hidden.shape[1] != width:
        raise ValueError(
            f"hidden_states has shape {tuple(hidden.shape)}, expected [{num_tokens}, {width}] "
            f"({what})"
        )


def _check_step(head, input_ids, meta, kv_caches, logits_indices, all_logits):
    """The checks of a head's forward, all before its first write; returns the caches."""
    cfg = head.cfg
    check_step_inputs(
        input_ids,
        meta,
        vocab_size=cfg.vocab_size,
        rotary=head.rotary,
        logits_indices=logits_indices,
        all_logits=all_logits,
    )
    return layer_caches(
        kv_caches,
        cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=head.dtype,
    )


def _shared_or_new(module, make, what: str, shape: tuple[int, int]):
    if module is None:
        return make(), True
    if tuple(module.weight.shape) != shape:
        raise ValueError(
            f"shared {what} has shape {tuple(module.weight.shape)}, the head's config needs {shape}"
        )
    return module, False


class _DraftVocab:
    """Draft token id d is target id d + d2t[d] (heads with a draft vocabulary)."""

    d2t: torch.Tensor
    draft_vocab_size: int
    cfg: DecoderConfig

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft token ids (any shape, int64), on the device; the
        ids themselves for a head without a draft vocabulary (no d2t)."""
        if not hasattr(self, "d2t"):
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def logits_to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [n, draft_vocab] scattered into the target vocabulary
        [n, vocab]; tokens outside the draft vocabulary get -inf. A head without a draft
        vocabulary returns its logits as they are."""
        if not hasattr(self, "d2t"):
            return logits
        full = logits.new_full((logits.shape[0], self.cfg.vocab_size), float("-inf"))
        ids = torch.arange(self.draft_vocab_size, device=logits.device)
        return full.index_copy_(1, self.draft_to_target(ids), logits)


def _vocab_ids(token_ids, vocab_size: int) -> torch.Tensor:
    """token_ids as a sorted int64 CPU tensor, checked: 1-D, integers, at least one,
    no repeats, each in [0, vocab_size)."""
    if isinstance(token_ids, torch.Tensor):
        dt = token_ids.dtype
        if dt.is_floating_point or dt.is_complex or dt == torch.bool:
            raise TypeError(f"token_ids must hold integers, got dtype {token_ids.dtype}")
        ids = token_ids.detach().to("cpu", torch.int64)
    else:
        try:
            seq = list(token_ids)
        except TypeError:
            raise TypeError(
                f"token_ids must be a sequence or tensor of ints, got {type(token_ids).__name__}"
            ) from None
        bad = [t for t in seq if isinstance(t, (bool, np.bool_))
               or not isinstance(t, (int, np.integer))]  # fmt: skip
        if bad:
            raise TypeError(f"token_ids must hold ints, got {type(bad[0]).__name__} {bad[0]!r}")
        ids = torch.tensor([int(t) for t in seq], dtype=torch.int64)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"token_ids must be 1-D and non-empty, got shape {tuple(ids.shape)}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token_ids must lie in [0, {vocab_size}), got {lo}..{hi}")
    ids = ids.sort().values
    if bool((ids[1:] == ids[:-1]).any()):
        dup = int(ids[1:][ids[1:] == ids[:-1]][0])
        raise ValueError(f"token_ids repeats token {dup}")
    return ids


class EagleHead(_DraftVocab, nn.Module):
    """EAGLE-1 head. embed_tokens / lm_head: the target's modules to share (the usual
    case); None makes the head own them (then the checkpoint must hold them).
    fc_bias: the public EAGLE-1 checkpoints have one. first_input_norm: keep layer 0's
    input RMSNorm (EAGLE-1 drops it; some conversions carry one)."""

    vocab_in_use = False  # set once a Drafter is built over the head (reduce_vocab refuses)

    def __init__(
        self,
        cfg: DecoderConfig,
        *,
        embed_tokens: Embedding | None = None,
        lm_head: Linear | None = None,
        fc_bias: bool = True,
        first_input_norm: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
    ):
        super().__init__()
        dtype = dtype or cfg.dtype
        self.cfg, self.dtype = cfg, dtype
        self.fc_bias, self.first_input_norm = fc_bias, first_input_norm
        h, kw = cfg.hidden_size, dict(dtype=dtype, device=device)
        self.embed_tokens, self.owns_embed = _shared_or_new(
            embed_tokens,
            lambda: Embedding(cfg.vocab_size, h, **kw),
            "embed_tokens",
            (cfg.vocab_size, h),
        )
        self.lm_head, self.owns_lm_head = _shared_or_new(
            lm_head,
            lambda: Linear(h, cfg.vocab_size, bias=False, **kw),
            "lm_head",
            (cfg.vocab_size, h),
        )
        self.fc = Linear(2 * h, h, bias=fc_bias, **kw)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope, max_positions or cfg.max_position_embeddings, device=device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rotary, input_norm=i > 0 or first_input_norm, **kw)
            for i in range(cfg.num_layers)
        )

    def weight_sources(self) -> WeightSources:
        """Our names -> EAGLE-1 checkpoint names: fc.weight [h, 2h] (+ fc.bias),
        layers.N.* in the HF decoder-layer names (layer 0 without input_layernorm),
        embed_tokens.weight / lm_head.weight only when not shared."""
        src: WeightSources = {"fc.weight": ["fc.weight"]}
        if self.fc_bias:
            src["fc.bias"] = ["fc.bias"]
        for i in range(self.cfg.num_layers):
            norm = i > 0 or self.first_input_norm
            name = f"layers.{i}"
            src.update(decoder_layer_sources(self.cfg, name, name, input_norm=norm))
        if self.owns_embed:
            src["embed_tokens.weight"] = ["embed_tokens.weight"]
        if self.owns_lm_head:
            src["lm_head.weight"] = ["lm_head.weight"]
        return src

    def fused_rows(self) -> int:
        """Rows up to which this model's forward takes the fused decode path."""
        return fused_row_limit(self, self.layers, self.fc.weight)

    @property
    def reduced(self) -> bool:
        """Whether the head proposes from a reduced draft vocabulary (reduce_vocab)."""
        return hasattr(self, "d2t")

    def reduce_vocab(self, token_ids) -> EagleHead:
        """Propose only `token_ids` (target ids): the head gets its own lm_head of those
        rows (a shared target lm_head is left as it is; an int8 one keeps its rows and
        scales) and, as an EAGLE-3 head, a draft vocabulary with d2t mapping draft id d
        (the d-th smallest of token_ids) to its target id. Its input embedding stays the
        target's. Drafts only propose: the output distribution stays the target's; what
        it costs is acceptance where the target's token lies outside. Returns self."""
        if self.reduced:
            raise ValueError(
                f"the head already has a draft vocabulary of {self.draft_vocab_size} tokens"
            )
        if self.vocab_in_use:
            raise ValueError(
                "reduce_vocab must come before a Drafter is built over the head: a "
                "Drafter fixes how it maps draft tokens when it is built"
            )
        head = self.lm_head
        if not isinstance(head, (Linear, Int8Linear)) or getattr(head, "bias", None) is not None:
            raise TypeError(
                f"lm_head must be a bias-free specdraft Linear or Int8Linear, got "
                f"{type(head).__name__}"
            )
        ids = _vocab_ids(token_ids, self.cfg.vocab_size)
        dev_ids = ids.to(head.weight.device)
        if isinstance(head, Int8Linear):
            new = Int8Linear(head.weight[dev_ids].contiguous(), head.scale[dev_ids].contiguous())
        else:
            w = head.weight
            new = Linear(w.shape[1], ids.numel(), bias=False, dtype=w.dtype, device=w.device)
            new.weight.data.copy_(w[dev_ids])
        self.lm_head, self.owns_lm_head = new, True
        self.draft_vocab_size = ids.numel()
        arange = torch.arange(ids.numel(), dtype=torch.int64)
        self.register_buffer("d2t", (ids - arange).to(head.weight.device))
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches,
        *,
        logits_indices: torch.Tensor | None = None,
        all_logits: bool = False,
        hidden_rows: torch.Tensor | None = None,
        head=None,
        advance=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [num_tokens]; hidden_states [num_tokens, h]: the target's final
        hidden states on the first draft step, the head's own output after; or, with
        hidden_rows (int64 [num_tokens]), any [n, h] table whose rows hidden_rows picks
        (a draft round's carried states, read by fc's prologue instead of a gather).
        Rows of padded tokens must be finite. Returns (hidden [num_tokens, h], logits
        over the target vocabulary for the chosen rows, see LlamaForCausalLM.forward;
        over the draft vocabulary after reduce_vocab, see logits_to_target);
        head: a callable that replaces the lm_head on those rows (its result is
        returned in place of the logits); advance: a draft round's advance for this
        step (kernels.draft_round.AdvanceFold, input_ids its d_ids), done inside fc's
        launch where the fused path takes the rows, else launched first."""
        h, n = self.cfg.hidden_size, meta.num_tokens
        rows = n if hidden_rows is None else hidden_states.shape[0]
        _check_hidden(hidden_states, rows, h, "hidden_size", self.dtype)
        if hidden_rows is not None:
            check_row_index("hidden_rows", hidden_rows, device=hidden_states.device,
                            bound=rows, length=n)  # fmt: skip
        caches = _check_step(self, input_ids, meta, kv_caches, logits_indices, all_logits)
        # A few rows take the fused decode path: fc's output is the residual stream,
        # updated in place by each layer; the last layer adds its residual inside its
        # down projection (no norm follows it).
        fused = ops.fused_decode(hidden_states, self.fused_rows(), rows=n)
        pdl = fused and kernels.pdl_supported(hidden_states.device)
        one_launch = fused and ops.embed_fc_takes(input_ids, self.fc.weight)
        # The advance inside fc's launch: the QKV launch after it then reads the positions
        # and slots it wrote after its own wait (late_meta).
        fold = advance is not None and one_launch and kernels.late_meta_supported(n)
        if advance is not None and not fold:
            advance.run()
        if one_launch:
            # fc([embed(token); hidden]) with its input formed on load: one launch
            x = ops.embed_fc(input_ids, self.embed_tokens.weight, hidden_states, self.fc.weight,
                             self.fc.bias, hidden_rows=hidden_rows, pdl=pdl,
                             advance=advance if fold else None)  # fmt: skip
        else:
            if hidden_rows is not None:
                hidden_states = hidden_states.index_select(0, hidden_rows)
            # [embed(token); hidden] in one launch
            x = ops.embed_concat(input_ids, self.embed_tokens.weight, hidden_states)
            if fused:
                x = ops.fused_linear(x, self.fc.weight, bias=self.fc.bias, pdl=pdl)
            else:
                x = self.fc(x)
        residual, last = None, len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if fused:
                layer.forward_fused(x, meta, caches[i], pdl=pdl, late_meta=fold and i == 0)
            else:
                x, residual = layer(x, residual, meta, caches[i], add_residual=i == last)
        return x, select_logits(x, head or self.lm_head, meta, logits_indices, all_logits)


class Eagle3DecoderLayer(DecoderLayer):
    """The EAGLE-3 "midlayer": attention over [input_norm(embeds); hidden_norm(h)]."""

    def __init__(self, cfg: DecoderConfig, rotary: RotaryEmbedding, *, dtype, device):
        super().__init__(
            cfg, rotary, dtype=dtype, device=device, attn_input_size=2 * cfg.hidden_size
        )
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds, hidden, meta, kv_cache):  # type: ignore[override]
        e = self.input_layernorm(embeds)
        h = self.hidden_norm(hidden)
        residual = h if self.norm_before_residual else hidden
        x = self.self_attn(torch.cat([e, h], dim=-1), meta, kv_cache)
        # A fresh residual_out: `hidden` belongs to the caller and is never written.
        x, residual = self.post_attention_layernorm(x, residual, residual_out=torch.empty_like(x))
        return self.mlp(x), residual


class Eagle3Head(_DraftVocab, nn.Module):
    """EAGLE-3 head. embed_tokens: the target's embedding to share, or None to own one
    (then the checkpoint must hold embed_tokens.weight). d2t [draft_vocab] int64."""

    def __init__(
        self,
        cfg: DecoderConfig,
        *,
        embed_tokens: Embedding | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
    ):
        super().__init__()
        if cfg.num_layers != 1:
            raise ValueError(f"EAGLE-3 heads have one decoder layer, config has {cfg.num_layers}")
        dtype = dtype or cfg.dtype
        self.cfg, self.dtype = cfg, dtype
        h, kw = cfg.hidden_size, dict(dtype=dtype, device=device)
        self.draft_vocab_size = cfg.draft_vocab_size or cfg.vocab_size
        self.embed_tokens, self.owns_embed = _shared_or_new(
            embed_tokens,
            lambda: Embedding(cfg.vocab_size, h, **kw),
            "embed_tokens",
            (cfg.vocab_size, h),
        )
        self.fc = Linear(cfg.fc_input_size, h, bias=False, **kw)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope, max_positions or cfg.max_position_embeddings, device=device
        )
        self.layers = nn.ModuleList([Eagle3DecoderLayer(cfg, self.rotary, **kw)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, **kw)
        self.lm_head = Linear(h, self.draft_vocab_size, bias=False, **kw)
        d2t = torch.zeros(self.draft_vocab_size, dtype=torch.int64, device=device)
        self.register_buffer("d2t", d2t)

    def weight_sources(self) -> WeightSources:
        """Our names -> EAGLE-3 checkpoint names: fc.weight [h, 3 h_target],
        midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
        midlayer.self_attn.{q,k,v,o}_proj.weight (q/k/v [*, 2h]), midlayer.mlp.*,
        norm.weight, lm_head.weight [draft_vocab, h], d2t [draft_vocab];
        embed_tokens.weight only when not shared."""
        src: WeightSources = {
            "fc.weight": ["fc.weight"],
            "norm.weight": ["norm.weight"],
            "lm_head.weight": ["lm_head.weight"],
            "d2t": ["d2t"],
            "layers.0.hidden_norm.weight": ["midlayer.hidden_norm.weight"],
        }
        src.update(decoder_layer_sources(self.cfg, "layers.0", "midlayer"))
        if self.owns_embed:
            src["embed_tokens.weight"] = ["embed_tokens.weight"]
        return src

    def combine_hidden_states(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """fc over the target's concatenated auxiliary hidden states: [T, 3 h_t] -> [T, h]."""
        return self.fc(aux_hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches,
        *,
        logits_indices: torch.Tensor | None = None,
        all_logits: bool = False,
        hidden_rows: torch.Tensor | None = None,
        head=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states: [num_tokens, 3 h_t] target auxiliary states (fc is applied) or
        [num_tokens, h] (the head's own output from the previous step); with
        hidden_rows (int64 [num_tokens]), a table of such rows that it picks. Returns
        (pre-norm hidden [num_tokens, h], logits [n, draft_vocab] over the draft
        vocabulary); map ids with draft_to_target or logits with logits_to_target.
        head: as EagleHead.forward's."""
        h = self.cfg.hidden_size
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a tensor, got {type(hidden_states).__name__}")
        if hidden_rows is not None:
            check_row_index("hidden_rows", hidden_rows, device=hidden_states.device,
                            bound=hidden_states.shape[0], length=meta.num_tokens)  # fmt: skip
            hidden_states = hidden_states.index_select(0, hidden_rows)
        if hidden_states.dim() == 2 and hidden_states.shape[-1] == self.fc.in_features != h:
            # the target's auxiliary states: checked, then fused by fc
            _check_hidden(
                hidden_states, meta.num_tokens, self.fc.in_features, "fc input", self.dtype
            )
            hidden_states = self.combine_hidden_states(hidden_states)
        _check_hidden(
            hidden_states,
            meta.num_tokens,
            h,
            f"hidden_size, or {self.fc.in_features} for fc",
            self.dtype,
        )
        (cache,) = _check_step(self, input_ids, meta, kv_caches, logits_indices, all_logits)
        embeds = self.embed_tokens(input_ids)
        x, residual = self.layers[0](embeds, hidden_states, meta, cache)
        normed, prenorm = self.norm(x, residual)
        return prenorm, select_logits(
            normed, head or self.lm_head, meta, logits_indices, all_logits
        )
