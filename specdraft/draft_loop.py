"""The body of one draft round, as one CUDA graph captures it, and the draft's prompt
prefill. `DraftLoop.run(rows, k_max, mode)` reads only persistent buffers (filled by
Drafter.propose before the replay) and writes its results into persistent buffers, so
a graph captured for (rows, k_max, mode) replays any round of that shape.

Per round: prepare kernel -> draft prefill over the verified rows -> sample draft token
0 -> (k_max - 1) x (advance kernel -> decode step -> sample) -> epilogue kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import kernels, ops
from .attn_metadata import AttentionMetadata, MetadataBuilder
from .batch import ScheduledBatch
from .block_table import BlockTables
from .config import LimitsConfig
from .draft_buffers import HostStage, SamplingMode, make_round_buffers
from .draft_inputs import DraftKind
from .draft_round_ops import draft_round_ops
from .input_buffers import InputBuffers
from .kernels.draft_round import ArgmaxParts
from .kv_cache import KVCache
from .layers import Int8Linear
from .sampling import DRAFT_PROPOSAL, SamplingTensors, sample


@dataclass
class RoundState:
    """What passes from one step of a round to the next."""

    rows: int
    k_max: int
    mode: SamplingMode
    tokens: torch.Tensor  # int64 [rows, k_max], target ids
    q: torch.Tensor | None  # float32 [rows, k_max, V]
    params: SamplingTensors | None
    hidden: torch.Tensor | None  # EAGLE: the head's state carried to the next step
    hidden_rows: torch.Tensor | None = None  # its rows, when hidden holds others too
    parts: ArgmaxParts | None = None  # the last step's unfinished greedy argmax


class DraftLoop:
    """Owns the draft model's cache, block tables and every buffer a round touches."""

    def __init__(
        self,
        model: torch.nn.Module,
        kind: DraftKind,
        *,
        limits: LimitsConfig,
        width: int,
        k_cap: int,
        cache: KVCache,
        hidden_in: int,
        q_vocab: str,
    ):
        self.model, self.kind, self.cache = model, kind, cache
        self.width, self.k_cap, self.hidden_in = width, k_cap, hidden_in
        self.device, self.dtype = cache.data.device, model.dtype
        self.max_model_len = limits.max_model_len
        r = limits.max_num_reqs
        bs = cache.block_size
        self.tables = BlockTables(
            r, limits.max_blocks_per_req(bs), bs, cache.num_blocks, self.device
        )
        self.builder = MetadataBuilder(
            limits, InputBuffers(limits, self.device), self.tables, cache
        )
        self.null_row = self.tables.null_row
        self.vocab_size = model.cfg.vocab_size  # input ids: the target's vocabulary
        self.draft_vocab = getattr(model, "draft_vocab_size", self.vocab_size)
        # The token a KV row stands for sits one position later in an EAGLE head's cache:
        # its row p holds (token p + 1, the target's state at p), as vLLM's EAGLE does.
        self.shift = 0 if kind is DraftKind.LLAMA else 1
        self.sampling = SamplingTensors(r + 1, self.device)
        self.buffers, packed = make_round_buffers(
            max_rows=r,
            width=width,
            k_cap=k_cap,
            null_row=self.null_row,
            rows=self.tables.rows,
            table=self.tables.table,
            device=self.device,
        )
        self.stage = HostStage(packed, r)
        self.hidden = None
        if kind is not DraftKind.LLAMA:
            self.hidden = torch.zeros(r * width, hidden_in, dtype=self.dtype, device=self.device)
        self.ops = draft_round_ops(
            self.buffers,
            max_rows=r,
            width=width,
            k_cap=k_cap,
            block_size=bs,
            vocab_size=self.vocab_size,
            null_row=self.null_row,
            hidden=self.hidden,
        )
        # An EAGLE-3 head, or an EAGLE-1 head after reduce_vocab, samples in its own
        # vocabulary; d2t maps to target ids. q is flat, viewed as [rows, k_max, V] per
        # round; over the target vocabulary, the columns outside the draft vocabulary
        # are never written (column = flat index mod V in every view): zero once.
        mapped = kind is DraftKind.EAGLE3 or getattr(model, "reduced", False)
        if kind is DraftKind.EAGLE:
            # The vocabulary is fixed from here on: reduce_vocab refuses the head.
            model.vocab_in_use = True
        self.scatter_q = mapped and q_vocab == "target"
        self.q_vocab = self.draft_vocab if mapped and not self.scatter_q else self.vocab_size
        ids = torch.arange(self.draft_vocab, device=self.device)
        self.q_token_ids = model.draft_to_target(ids) if mapped else ids
        self.map_tokens = mapped
        self.q = torch.zeros(r * k_cap * self.q_vocab, dtype=torch.float32, device=self.device)
        self._tickets = torch.zeros(r, dtype=torch.int32, device=self.device)  # the argmax's
        # A greedy step over an int8 lm_head leaves its argmax as partials (_partials_head)
        self._part_val = self._part_idx = None
        lm_head = getattr(model, "lm_head", None)
        if isinstance(lm_head, Int8Linear):
            n, k = lm_head.out_features, lm_head.in_features
            blocks = max(kernels.argmax_blocks(m, n, k) for m in (1, r))
            self._part_val = torch.empty(r, blocks, dtype=torch.float32, device=self.device)
            self._part_idx = torch.empty(r, blocks, dtype=torch.int32, device=self.device)
        # Prompt prefill graphs (Drafter sets the manager up); the target states of a
        # prompt chunk go to prompt_hidden first, graph or not.
        self.prompt_graphs = None
        self.prompt_hidden = None
        if kind is not DraftKind.LLAMA:
            self.prompt_hidden = torch.zeros(
                limits.max_num_tokens, hidden_in, dtype=self.dtype, device=self.device
            )
        self._meta: dict[tuple[str, int], AttentionMetadata] = {}

    # ---- the round -------------------------------------------------------------------

    def run(self, rows: int, k_max: int, mode: SamplingMode):
        """The whole round over `rows` batch rows; what one graph captures. Returns
        views (tokens [rows, k_max], q [rows, k_max, V] or None)."""
        state = self.start(rows, k_max, mode)
        for step in range(1, k_max):
            self.step(state, step)
        return self.finish(state)

    def start(self, rows: int, k_max: int, mode: SamplingMode) -> RoundState:
        """prepare, the draft prefill over the verified rows, draft token 0."""
        b, w = self.buffers, self.width
        self.ops.prepare(rows)  # writes every buffer read below
        state = RoundState(
            rows, k_max, mode, b.tokens[: rows * k_max].view(rows, k_max), None, None, None
        )
        if mode is not SamplingMode.GREEDY:
            state.q = self.q[: rows * k_max * self.q_vocab].view(rows, k_max, self.q_vocab)
            state.params = self.sampling.select(b.param[:rows])
        meta = self.metadata("prefill", rows)
        # The model gathers its input states (hidden_rows): no gather launch here.
        rows_src = None if self.hidden is None else b.p_src[: rows * w]
        head = self._partials_head(state)
        out, logits = self._forward(meta, self.hidden, rows_src, head=head)
        if self.hidden is not None and k_max > 1:  # a round of one draft carries nothing on
            # the state that drew token 0: the next step reads row p_last of out
            state.hidden, state.hidden_rows = out, b.p_last[:rows]
        if head is None:
            self._sample(state, logits, 0)
        return state

    def step(self, state: RoundState, step: int) -> None:
        """advance, one decode step, draft token `step`. After a step that left its
        argmax as partials, an EAGLE-1 head on the Triton kernels takes the advance into
        its fc launch where it can (EagleHead.forward). H200, SmolLM2-shaped head, K 3
        (bench/NOTES.md, stop 44): the int8 greedy round 89.1 -> 84.7 µs at batch 1; with
        the bf16 lm_head (its argmax launch before) 123.0 -> 124.3, so that one stays."""
        advance = None
        if self.kind is DraftKind.EAGLE and state.parts is not None:
            advance = self.ops.advance_fold(state.rows, step, state.k_max, state.parts)
        if advance is None:
            self.ops.advance(state.rows, step, state.k_max, state.parts)
        meta = self.metadata("decode", state.rows)  # one row per request: every row's logits
        head = self._partials_head(state)
        state.hidden, logits = self._forward(
            meta, state.hidden, state.hidden_rows, all_logits=True, head=head, advance=advance
        )
        state.hidden_rows = None  # the step's own output: one row per request
        if head is None:
            self._sample(state, logits, step)

    def finish(self, state: RoundState):
        self.ops.epilogue(state.rows, state.k_max, state.parts)
        return state.tokens, state.q

    def _forward(
        self,
        meta: AttentionMetadata,
        hidden,
        hidden_rows=None,
        *,
        all_logits=False,
        head=None,
        advance=None,
    ):
        if self.kind is DraftKind.LLAMA:
            return self.model(meta.input_ids, meta, self.cache, all_logits=all_logits, head=head)
        kw = {} if advance is None else {"advance": advance}  # EAGLE-1 only
        return self.model(
            meta.input_ids, hidden, meta, self.cache, all_logits=all_logits,
            hidden_rows=hidden_rows, head=head, **kw,
        )  # fmt: skip

    def _partials_head(self, state: RoundState):
        """A greedy round over an int8 lm_head (layers.quantize_lm_head) leaves each
        step's argmax as per-block partials (ops.linear_int8_partials: no logits, no
        argmax launch) and finishes it in the kernel that needs the token anyway: the
        next step's advance, or the epilogue after the last step (state.parts). Returns
        the lm_head's replacement for the model's forward, or None (the model's lm_head,
        then _sample)."""
        if state.mode is not SamplingMode.GREEDY or self._part_val is None:
            return None
        head = self.model.lm_head
        offsets = self.model.d2t if self.map_tokens else None

        def partials(x: torch.Tensor, *, x_rows: torch.Tensor | None = None) -> None:
            blocks = ops.linear_int8_partials(
                x, head.weight, head.scale, self._part_val, self._part_idx, x_rows=x_rows,
                pdl=kernels.pdl_supported(x.device),
            )  # fmt: skip
            state.parts = ArgmaxParts(self._part_val, self._part_idx, blocks, offsets)

        partials.takes_x_rows = True  # the prefill's last rows read in place (select_logits)
        return partials

    def _sample(self, state: RoundState, logits: torch.Tensor, step: int) -> None:
        """Draft token `step` of every row into tokens[:, step] (target ids) and the
        distribution it was drawn from into q[:, step]."""
        if state.mode is SamplingMode.GREEDY:
            # One launch: the argmax's last block per row writes the (mapped) id into
            # the token table's column.
            offsets = self.model.d2t if self.map_tokens else None
            ops.argmax(logits, out=state.tokens[:, step], tickets=self._tickets, offsets=offsets,
                       pdl=kernels.pdl_supported(logits.device))  # fmt: skip
            return
        # The absolute position of the drawn token keys its draws (invariant 6).
        pos = self.buffers.cur_pos[: state.rows] + (1 + self.shift)
        tok, probs = sample(
            logits,
            state.params,
            pos,
            DRAFT_PROPOSAL,
            any_filter=state.mode is SamplingMode.FILTER,
            return_probs=True,
            # q's columns are the logits' own: the sampler writes q[:, step] directly
            out_probs=None if self.scatter_q else state.q[:, step],
        )
        if self.scatter_q:
            state.q[:, step].index_copy_(1, self.q_token_ids, probs)
        if self.map_tokens:
            tok = self.model.draft_to_target(tok)
        state.tokens[:, step].copy_(tok)

    def metadata(self, kind: str, rows: int) -> AttentionMetadata:
        """Views of the round's persistent buffers: the prefill over rows x W token rows
        (ragged, padding at the tail) or a decode step (one token per row)."""
        meta = self._meta.get((kind, rows))
        if meta is None:
            b, r, n = self.buffers, rows, self.max_model_len
            table = self.tables.table[:r]
            if kind == "prefill":
                t = r * self.width
                meta = AttentionMetadata(
                    t,
                    r,
                    self.width,
                    n,
                    t,
                    r,
                    b.p_qsl[: r + 1],
                    b.p_seq[:r],
                    table,
                    b.p_slot[:t],
                    b.p_pos[:t],
                    b.p_ids[:t],
                    b.p_last[:r],
                )
            else:
                meta = AttentionMetadata(
                    r,
                    r,
                    1,
                    n,
                    r,
                    r,
                    b.d_qsl[: r + 1],
                    b.d_seq[:r],
                    table,
                    b.d_slot[:r],
                    b.d_pos[:r],
                    b.d_ids[:r],
                    b.d_last[:r],
                )
            self._meta[(kind, rows)] = meta
        return meta

    def write_dummy_inputs(self, rows: int, k_max: int) -> None:
        """Valid round inputs for a graph's warm-up or capture: `rows` dummy rows on the
        null row (whose blocks are all the null block, so no KV is written and no length
        is advanced), every verified row accepted, k = k_max."""
        b, w = self.buffers, self.width
        slots = np.full(rows, self.null_row, dtype=np.int64)
        self.stage.upload(w, slots, np.full(rows, k_max), rows, self.ops.sources(None, None))
        b.accepted[:rows].fill_(w - 1)
        pattern = torch.arange(rows * w, device=self.device).view(rows, w) % 7 + 1
        b.verified[:rows].copy_(pattern)
        b.base[self.null_row].fill_(0)
        if self.hidden is not None:
            self.hidden[: rows * w].fill_(0.5)

    # ---- the prompt ------------------------------------------------------------------

    def prefill_prompt(self, req_id, ids: list[int], hidden: torch.Tensor | None) -> int:
        """The draft's KV for a new request's prompt, in chunks of the builder's token
        budget: each chunk a replay of the smallest prompt graph that holds it (padding
        rows write no KV), eagerly when none does; returns the draft's KV length (EAGLE:
        one pair per prompt token but the last)."""
        toks = ids[self.shift :]
        length = len(toks)
        step = self.builder.limits.max_num_tokens
        graphs = self.prompt_graphs
        for s in range(0, length, step):
            chunk = toks[s : s + step]
            n = len(chunk)
            batch = ScheduledBatch.from_requests([(req_id, chunk, s)])
            desc = None
            if graphs is not None and graphs.captured:
                desc = graphs.dispatch(1, n, max_query_len=n)
            if self.prompt_hidden is not None:
                self.prompt_hidden[:n].copy_(hidden[s : s + n])
            if desc is None:
                self.prompt_forward(self.builder.build(batch))
                continue
            self.builder.build(
                batch,
                num_reqs_padded=desc.num_reqs,
                num_tokens_padded=desc.num_tokens,
                max_query_len=desc.max_query_len,
            )
            graphs.replay(desc)
        return length

    def prompt_forward(self, meta: AttentionMetadata) -> None:
        """The draft's forward over a prompt chunk the builder laid out (an EAGLE head
        reads its target states from prompt_hidden's first rows; rows past the chunk
        hold earlier prompts' finite states, and padding rows write no KV): what a
        prompt graph captures, and the eager path."""
        if self.kind is DraftKind.LLAMA:
            self.model(meta.input_ids, meta, self.cache)
        else:
            self.model(meta.input_ids, self.prompt_hidden[: meta.num_tokens], meta, self.cache)
