"""The draft round: `Drafter.propose()` proposes up to K tokens per request in one CUDA
graph replay, engine-agnostic (device tensors in, device tensors out).

A round, all on the device (kernels/draft_round.py for the bookkeeping kernels):

1. prepare: from the verified block [B, W] and num_accepted [B], the draft prefill's
   ragged inputs (rows 0 .. num_accepted of each request at positions L .. L + a, L the
   draft's committed KV length), slot mappings, query_start_loc, seq_lens; L += a + 1;
2. draft prefill over those rows (an EAGLE head with the target's hidden states), then
   draft token 0 sampled from row num_accepted;
3. K_max - 1 times: advance (token -> input, position + 1, seq_len + 1, slot), forward
   (EAGLE: the head's own hidden state carried), sample;
4. epilogue: tokens at j >= k[b] and of padding rows become -1.
Draft KV written past the new committed length is speculative: the next round's
prefill overwrites it and nothing reads it as committed.

Shapes. W = max(K_max options) + 1 is fixed: verified blocks narrower than W (from a
step with a smaller K_max) are accepted as they are, so graphs are keyed by (batch
bucket, K_max, sampling mode) only, and the prefill of every graph runs over
bucket x W token rows (padding past the real ones).

Contract with the engine (the host never reads num_accepted):
- every request that takes part in a round passes all tokens committed since its
  previous round: verified_tokens[b, :a + 1] (the accepted drafts, then the target's
  correction or bonus token at row a = num_accepted[b]); rows past a are ignored;
- EAGLE: target_hidden[b, j] is the target's hidden state that predicted
  verified_tokens[b, j] (the state at the position before it; the pair sits at that
  position in the head's cache, as vLLM's EAGLE does); EAGLE-3: the concatenated
  auxiliary layers' states;
- the drafter keeps each request's committed draft length on the device (advanced by
  num_accepted + 1 inside the round). Before a round it grows KV blocks to an upper
  bound (known length + W_in + K_max - 1); the exact lengths of the round's rows come
  back through pinned memory one round late (`LengthBook.poll` only queries an event),
  which tightens the bound. Running out of blocks raises DraftOutOfBlocksError before
  anything is written; the caller frees a request and calls again.
- outputs are views of persistent buffers, valid until the next propose();
- a request's first round: the verified block is the target's first sampled token
  (num_accepted 0; EAGLE: with the hidden state of the prompt's last position).
"""

from __future__ import annotations

import bisect
import logging
import random
import time
from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from .attn_metadata import AttentionMetadata, MetadataBuilder
from .batch import ScheduledBatch
from .block_table import BlockTables, OutOfBlocksError
from .config import CacheConfig, LimitsConfig, _check_int
from .cuda_graph import CudaGraphBackend, CUDAGraphMode, SpeculatorCudaGraphManager
from .draft_buffers import MODE_NAMES, HostStage, LengthBook, SamplingMode, make_round_buffers
from .draft_inputs import DraftKind, check_prompt, check_propose_inputs, draft_kind
from .draft_round_ops import draft_round_ops
from .input_buffers import InputBuffers
from .kv_cache import KVCache, num_blocks_for_budget
from .sampling import DRAFT_PROPOSAL, SamplingParams, SamplingTensors, SeedSource, sample

logger = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0)
_DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DraftOutOfBlocksError(OutOfBlocksError):
    """A round needs more KV blocks than are free. Raised before anything changed:
    remove (or preempt) a request and call propose() again. `needed` and `free` are
    block counts."""

    def __init__(self, message: str, needed: int, free: int):
        super().__init__(message)
        self.needed, self.free = needed, free


class Proposal(NamedTuple):
    """tokens: int64 [B, K_max], -1 where a request proposes nothing (j >= k[b]).
    q: float32 [B, K_max, V] (V the target vocabulary, see Drafter.q_token_ids), the
    exact distribution each token was drawn from, or None when every row is greedy;
    meaningful only where tokens >= 0. Both are views valid until the next propose()."""

    tokens: torch.Tensor
    q: torch.Tensor | None


def _k_options(k_max_options) -> tuple[list[int], list[tuple[int, int]] | None]:
    """(sorted K_max values, table [(max batch size, K_max)] or None)."""
    if isinstance(k_max_options, Mapping):
        table = sorted(
            (_check_int("k_max_options key", b, 1), _check_int(f"k_max_options[{b}]", k, 1, 64))
            for b, k in k_max_options.items()
        )
        if not table:
            raise ValueError("k_max_options table is empty")
        return sorted({k for _, k in table}), table
    if isinstance(k_max_options, int | np.integer):
        k_max_options = [k_max_options]
    ks = sorted({_check_int("k_max_options[i]", k, 1, 64) for k in k_max_options})
    if not ks:
        raise ValueError("k_max_options is empty")
    return ks, None


class Drafter:
    """Draft model + its paged KV cache, block tables, persistent round buffers and one
    captured graph per (batch bucket, K_max, sampling mode).

    model: a LlamaForCausalLM (its own KV cache; same vocabulary as the target), an
    EagleHead or an Eagle3Head. k_max_options: K_max values to capture for every batch
    bucket, or a table {max batch size: K_max} (as vLLM's
    num_speculative_tokens_per_batch_size; batches larger than every key take the last
    entry). graph_modes: which of "greedy", "sample", "filter" to capture (a batch uses
    the cheapest captured mode that serves it). q_vocab (EAGLE-3 with a reduced draft
    vocabulary): "target" gives q over the target vocabulary with zeros outside the draft
    vocabulary; "draft" gives q over the draft vocabulary, column d standing for target
    id q_token_ids[d]. cuda_graphs None: on for CUDA models."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_num_reqs: int = 32,
        k_max_options: int | Sequence[int] | Mapping[int, int] = 3,
        max_model_len: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        gpu_memory_fraction: float = 0.1,
        cuda_graphs: bool | None = None,
        capture_sizes: Sequence[int] | None = None,
        graph_modes: Sequence[str] = ("greedy", "sample", "filter"),
        q_vocab: str = "target",
        max_prefill_tokens: int = 512,
        seed: int | None = None,
        capture_now: bool = True,
        graph_backend: CudaGraphBackend | None = None,
    ):
        self.kind = draft_kind(model)
        self.model = model
        self.device = model.embed_tokens.weight.device
        self.dtype = model.dtype
        cfg = model.cfg
        self.vocab_size = cfg.vocab_size  # input ids: the target's vocabulary
        self.draft_vocab = getattr(model, "draft_vocab_size", cfg.vocab_size)
        # Width of the target states a round reads: EAGLE-3 reads the auxiliary layers'.
        self.hidden_in = 0 if self.kind is DraftKind.LLAMA else model.fc.in_features
        if self.kind is DraftKind.EAGLE:
            self.hidden_in = cfg.hidden_size
        # The token a KV row stands for sits one position later in an EAGLE head's cache.
        self._shift = 0 if self.kind is DraftKind.LLAMA else 1
        max_num_reqs = _check_int("max_num_reqs", max_num_reqs, 1, 4096)
        self.k_options, self.k_table = _k_options(k_max_options)
        self.k_cap = self.k_options[-1]
        self.width = self.k_cap + 1
        if max_model_len is None:
            max_model_len = model.rotary.max_positions
        max_model_len = _check_int("max_model_len", max_model_len, 2)
        if max_model_len > model.rotary.max_positions:
            raise ValueError(
                f"max_model_len {max_model_len} is over the model's rotary table "
                f"({model.rotary.max_positions} positions): build the model with "
                f"max_positions >= {max_model_len}"
            )
        if q_vocab not in ("target", "draft"):
            raise ValueError(f"q_vocab must be 'target' or 'draft', got {q_vocab!r}")
        modes = sorted({self._mode_name(m) for m in graph_modes})
        max_prefill_tokens = _check_int("max_prefill_tokens", max_prefill_tokens, 1)
        self.max_num_reqs, self.max_model_len = max_num_reqs, max_model_len
        self.limits = LimitsConfig(
            max_num_reqs, max(max_prefill_tokens, max_num_reqs), max_model_len
        )
        blocks_per_req = self.limits.max_blocks_per_req(block_size)
        mcfg = cfg.runtime_config(self.dtype)
        need = max_num_reqs * blocks_per_req + 1
        if num_blocks is None:
            num_blocks = need
            if self.device.type == "cuda":
                free = int(torch.cuda.mem_get_info(self.device)[0])
                cc = CacheConfig(block_size, gpu_memory_fraction=gpu_memory_fraction)
                num_blocks = min(need, num_blocks_for_budget(mcfg, cc, free))
        self.cache = KVCache(mcfg, CacheConfig(block_size, num_blocks=num_blocks), self.device)
        self.tables = BlockTables(
            max_num_reqs, blocks_per_req, block_size, self.cache.num_blocks, self.device
        )
        self.block_size = block_size
        self.builder = MetadataBuilder(
            self.limits, InputBuffers(self.limits, self.device), self.tables, self.cache
        )
        self.null_row = self.tables.null_row
        self.sampling = SamplingTensors(max_num_reqs + 1, self.device)
        self.seeds = SeedSource(seed)
        self.buffers, packed = make_round_buffers(
            max_rows=max_num_reqs,
            width=self.width,
            k_cap=self.k_cap,
            null_row=self.null_row,
            rows=self.tables.rows,
            table=self.tables.table,
            device=self.device,
        )
        self._stage = HostStage(packed, max_num_reqs)
        self._ops = draft_round_ops(
            self.buffers,
            max_rows=max_num_reqs,
            width=self.width,
            k_cap=self.k_cap,
            block_size=block_size,
            vocab_size=self.vocab_size,
            null_row=self.null_row,
        )
        self.lengths = LengthBook(max_num_reqs + 1, max_num_reqs, self.device)
        if self.kind is not DraftKind.LLAMA:
            self._hidden = torch.zeros(
                max_num_reqs * self.width, self.hidden_in, dtype=self.dtype, device=self.device
            )
        # q: float32, flat, viewed as [R, K, V] per round. With q over the target
        # vocabulary of an EAGLE-3 head, columns outside the draft vocabulary are never
        # written (column = flat index mod V in every [R, K, V] view): zero once.
        reduced = self.kind is DraftKind.EAGLE3 and self.draft_vocab != self.vocab_size
        self._scatter_q = reduced and q_vocab == "target"
        self.q_vocab = self.vocab_size if (not reduced or self._scatter_q) else self.draft_vocab
        ids = torch.arange(self.draft_vocab, device=self.device)
        self.q_token_ids = model.draft_to_target(ids) if reduced else ids
        self._q = torch.zeros(
            max_num_reqs * self.k_cap * self.q_vocab, dtype=torch.float32, device=self.device
        )
        self._slot_k = np.zeros(max_num_reqs + 1, dtype=np.int64)
        self._slot_greedy = np.ones(max_num_reqs + 1, dtype=bool)
        self._slot_filter = np.zeros(max_num_reqs + 1, dtype=bool)
        self._meta: dict[tuple[str, int], AttentionMetadata] = {}
        self.rounds = 0
        self.graph_rounds = 0

        use_graphs = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        if use_graphs and self.device.type != "cuda" and graph_backend is None:
            raise ValueError("cuda_graphs=True needs the model on a CUDA device")
        sizes = sorted(
            {_check_int("capture_sizes[i]", s, 1) for s in (capture_sizes or _DEFAULT_BUCKETS)}
        )
        sizes = [s for s in sizes if s <= max_num_reqs]
        if capture_sizes is None and max_num_reqs not in sizes:
            sizes.append(max_num_reqs)
        self.capture_sizes = sizes
        self._managers: dict[tuple[int, SamplingMode], SpeculatorCudaGraphManager] = {}
        if use_graphs:
            cg = CUDAGraphMode.FULL
            for k in self.k_options:
                buckets = [b for b in sizes if k in self._ks_for_bucket(b, sizes)]
                for mode in modes:
                    if buckets:
                        self._managers[(k, mode)] = SpeculatorCudaGraphManager(
                            max_num_reqs=max_num_reqs,
                            max_num_tokens=max_num_reqs * self.width,
                            cg_mode=cg,
                            capture_sizes=[b * self.width for b in buckets],
                            uniform_token_counts=(self.width,),
                            mixed=False,
                            backend=graph_backend,
                        )
        self.graph_modes = modes
        self.capture_seconds = 0.0
        if self._managers and capture_now:
            self.capture()

    # ---- configuration helpers --------------------------------------------------------

    @staticmethod
    def _mode_name(m) -> SamplingMode:
        if isinstance(m, SamplingMode):
            return m
        if m not in MODE_NAMES:
            raise ValueError(f"graph_modes holds {m!r}; choose from {sorted(MODE_NAMES)}")
        return MODE_NAMES[m]

    def k_max_for(self, num_reqs: int) -> int:
        """The table's K_max for a batch of num_reqs requests (the largest option
        without a table)."""
        if self.k_table is None:
            return self.k_cap
        i = bisect.bisect_left([b for b, _ in self.k_table], num_reqs)
        return self.k_table[min(i, len(self.k_table) - 1)][1]

    def _ks_for_bucket(self, bucket: int, sizes: list[int]) -> set[int]:
        """K_max values a batch dispatched to `bucket` may use."""
        if self.k_table is None:
            return set(self.k_options)
        prev = max([s for s in sizes if s < bucket], default=0)
        return {self.k_max_for(n) for n in range(prev + 1, bucket + 1)}

    # ---- capture ----------------------------------------------------------------------

    def capture(self, order_seed: int | None = None) -> None:
        """Warm up and capture every round graph, largest first across all of them (or
        in an order shuffled by order_seed, to test that order does not matter), each
        pass on fresh dummy inputs for exactly its descriptor (the capture rule)."""
        todo = [(d, key) for key, m in self._managers.items() for d in m.descriptors]
        todo.sort(key=lambda x: (-x[0].num_tokens, -x[1][0], -int(x[1][1])))
        if order_seed is not None:
            random.Random(order_seed).shuffle(todo)
        counters = self.buffers.counters.clone()
        start = time.perf_counter()
        for desc, (k, mode) in todo:
            manager = self._managers[(k, mode)]

            def forward(num_reqs, num_tokens, meta, slots, dp, cg_mode, k=k, mode=mode):
                return self._round(num_reqs, k, mode)

            manager.capture(forward, _CaptureInputs(self, k), descriptors=[desc])
        self.buffers.counters.copy_(counters)  # warm-ups ran dummy rounds
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d draft-round graphs in %.2f s", len(todo), self.capture_seconds)

    @property
    def num_graphs(self) -> int:
        return sum(len(m.captured) for m in self._managers.values())

    def _write_dummy_inputs(self, num_rows: int, k_max: int) -> None:
        """Valid round inputs for a descriptor: num_rows dummy rows on the null row (all
        blocks null: no KV written), every verified row accepted, k = k_max."""
        b, w = self.buffers, self.width
        slots = np.full(num_rows, self.null_row, dtype=np.int64)
        self._stage.upload(w, slots, np.full(num_rows, k_max), num_rows)
        b.accepted[:num_rows].fill_(w - 1)
        pattern = torch.arange(num_rows * w, device=self.device).view(num_rows, w) % 7 + 1
        b.verified[:num_rows].copy_(pattern)
        b.base[self.null_row].fill_(0)
        if self.kind is not DraftKind.LLAMA:
            self._hidden[: num_rows * w].fill_(0.5)

    # ---- requests ---------------------------------------------------------------------

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.tables

    def __len__(self) -> int:
        return len(self.tables)

    @torch.no_grad()
    def add_request(
        self,
        req_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        k: int | None = None,
        *,
        target_hidden: torch.Tensor | None = None,
    ) -> None:
        """Admit a request and run the draft's prefill over its prompt (eagerly).

        Llama draft: the prompt's KV. EAGLE heads: target_hidden [n, h_in] holds the
        target's hidden states (EAGLE-3: auxiliary states) at the n prompt positions;
        the pairs (prompt[i + 1], target_hidden[i]) for i < n - 1 are prefilled; row
        n - 1 goes with the target's first sampled token in the first propose().
        params: the request's sampling parameters (default greedy; a missing seed gets a
        distinct one). k: its number of speculative tokens (default the largest
        K_max; each round uses min(k, K_max) unless propose() is given k).
        Raises before anything changes: ValueError / TypeError for bad input,
        OutOfBlocksError when the cache cannot hold the prompt."""
        ids, hidden = check_prompt(self, req_id, prompt_token_ids, target_hidden)
        params = GREEDY if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        k = self.k_cap if k is None else _check_int("k", k, 0, self.k_cap)
        length = len(ids) - self._shift  # the draft's KV length after the prefill
        self.lengths.poll()
        self.tables.add_request(req_id, max(length, 1))  # raises with nothing changed
        slot = self.tables.row_of(req_id)
        params = self.seeds.resolve(params)
        self.sampling.write_rows([slot], [params], self.seeds)
        self._slot_k[slot] = k
        self._slot_greedy[slot] = params.greedy
        self._slot_filter[slot] = params.uses_filter
        self.lengths.set_exact(slot, length)
        self.buffers.base[slot].fill_(length)
        toks = ids[self._shift :]
        step = self.limits.max_num_tokens
        for s in range(0, length, step):
            chunk = toks[s : s + step]
            meta = self.builder.build(ScheduledBatch.from_requests([(req_id, chunk, s)]))
            if self.kind is DraftKind.LLAMA:
                self.model(meta.input_ids, meta, self.cache)
            else:
                self.model(meta.input_ids, hidden[s : s + len(chunk)], meta, self.cache)

    def reserve(self, req_id: Hashable, num_tokens: int) -> bool:
        """Grow the request's KV blocks to hold num_tokens draft tokens now (e.g. its
        whole budget at admission, so later rounds allocate nothing). False, with
        nothing allocated, when the cache is short."""
        num_tokens = _check_int("num_tokens", num_tokens, 1, self.tables.max_tokens_per_req)
        return self.tables.grow(req_id, num_tokens)

    def remove_request(self, req_id: Hashable) -> None:
        """Free the request's blocks and slot. A later request in that slot starts from
        its own prompt, parameters, k and length: nothing of this one is read again."""
        slot = self.tables.row_of(req_id)  # ValueError for an unknown id
        self.tables.remove_request(req_id)
        self.lengths.set_exact(slot, 0)
        self._slot_k[slot] = 0
        self._slot_greedy[slot] = True
        self._slot_filter[slot] = False
        self.buffers.base[slot].fill_(0)

    # ---- the round --------------------------------------------------------------------

    @torch.no_grad()
    def propose(
        self,
        req_ids: Sequence[Hashable],
        verified_tokens: torch.Tensor,
        num_accepted: torch.Tensor,
        *,
        target_hidden: torch.Tensor | None = None,
        k: Sequence[int] | np.ndarray | torch.Tensor | int | None = None,
        k_max: int | None = None,
        eager: bool = False,
    ) -> Proposal:
        """One draft round over req_ids (see the module docstring for the contract).

        verified_tokens: int64/int32 [B, W_in] (1 <= W_in <= W) on the drafter's device;
        num_accepted: int [B] on the device (never read by the host); target_hidden
        (EAGLE heads only): [B, W_in, h_in]; k: host ints [B] in [0, K_max] (default:
        each request's own k, capped at K_max); k_max: one of the captured options
        (default: the table's value for B, or the smallest option covering max(k)).
        eager=True runs the round without its graph (same padding as the graph).
        Returns Proposal(tokens [B, K_max], q [B, K_max, V] or None)."""
        self.lengths.poll()
        inp = check_propose_inputs(
            self, req_ids, verified_tokens, num_accepted, target_hidden, k, k_max
        )
        b, w, kk, slots = inp.num_reqs, inp.width, inp.k_max, inp.slots
        mode = SamplingMode.GREEDY
        if not self._slot_greedy[slots].all():
            mode = SamplingMode.FILTER if self._slot_filter[slots].any() else SamplingMode.SAMPLE
        desc, run_mode = None, mode
        for m in SamplingMode:
            if m >= mode and (kk, m) in self._managers:
                desc = self._managers[(kk, m)].dispatch(
                    b, b * self.width, uniform_token_count=self.width, max_query_len=self.width
                )
                if desc is not None:
                    run_mode = m
                    break
        rows = desc.num_reqs if desc is not None else b
        self._reserve(inp, kk)  # raises DraftOutOfBlocksError before anything is written

        # ---- from here on state changes; nothing below raises on valid input ----
        self.tables.commit()
        self._stage.upload(w, slots, inp.k, rows)
        self.buffers.accepted[:b].copy_(num_accepted, non_blocking=True)
        self.buffers.verified[:b, :w].copy_(verified_tokens, non_blocking=True)
        if target_hidden is not None:
            self._hidden.view(-1, self.width, self.hidden_in)[:b, :w].copy_(
                target_hidden, non_blocking=True
            )
        if desc is not None and not eager:
            tokens, q = self._managers[(kk, run_mode)].replay(desc)
            self.graph_rounds += 1
        else:
            tokens, q = self._round(rows, kk, run_mode)
        self.rounds += 1
        self.lengths.launched(slots, w, self.buffers.p_seq)
        return Proposal(tokens[:b], None if q is None else q[:b])

    def _reserve(self, inp, k_max: int) -> None:
        """Grow every request's blocks to its upper bound for this round, all or none."""
        t = self.tables
        cap = t.max_tokens_per_req
        upper = self.lengths.upper[inp.slots]
        lower = self.lengths.lower[inp.slots]
        over = lower + 1 > self.max_model_len
        if over.any():
            i = int(np.argmax(over))
            raise ValueError(
                f"request {inp.req_ids[i]!r} already holds {lower[i]} draft tokens: another "
                f"round would pass max_model_len {self.max_model_len}"
            )
        # Positions past the table's capacity write nothing (and are never committed).
        want = np.minimum(upper + inp.width + k_max - 1, cap)
        have = inp.num_blocks
        short = np.maximum(-(-want // self.block_size) - have, 0)
        needed = int(short.sum())
        if needed > t.num_free_blocks:
            worst = inp.req_ids[int(np.argmax(short))]
            raise DraftOutOfBlocksError(
                f"this round needs {needed} more KV blocks (request {worst!r} needs "
                f"{int(short.max())}) but {t.num_free_blocks} are free; nothing was changed: "
                "remove or preempt a request and call propose() again",
                needed,
                t.num_free_blocks,
            )
        for i in np.nonzero(short)[0]:
            assert t.grow(inp.req_ids[i], int(want[i]))

    def _metadata(self, kind: str, num_rows: int) -> AttentionMetadata:
        meta = self._meta.get((kind, num_rows))
        if meta is None:
            b, r = self.buffers, num_rows
            table = self.tables.table[:r]
            if kind == "prefill":
                t = r * self.width
                meta = AttentionMetadata(
                    t,
                    r,
                    self.width,
                    self.max_model_len,
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
                    self.max_model_len,
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
            self._meta[(kind, num_rows)] = meta
        return meta

    def _forward(self, meta: AttentionMetadata, hidden: torch.Tensor | None):
        if self.kind is DraftKind.LLAMA:
            return self.model(meta.input_ids, meta, self.cache)
        return self.model(meta.input_ids, hidden, meta, self.cache)

    def _sample(self, logits, params, mode, num_rows, k_max, step, tokens, q) -> None:
        """Draft token `step` of every row into tokens[:, step] (target ids) and its
        distribution into q[:, step]."""
        if mode is SamplingMode.GREEDY:
            tok = logits.argmax(dim=-1)
        else:
            # The absolute position of the drawn token keys its draws (invariant 6).
            pos = self.buffers.cur_pos[:num_rows] + (1 + self._shift)
            tok, probs = sample(
                logits,
                params,
                pos,
                DRAFT_PROPOSAL,
                any_filter=mode is SamplingMode.FILTER,
                return_probs=True,
            )
            if self._scatter_q:
                q[:, step].index_copy_(1, self.q_token_ids, probs)
            else:
                q[:, step].copy_(probs)
        if self.kind is DraftKind.EAGLE3 and self.draft_vocab != self.vocab_size:
            tok = self.model.draft_to_target(tok)
        tokens[:, step].copy_(tok)

    def _round(self, num_rows: int, k_max: int, mode: SamplingMode):
        """The whole round over num_rows batch rows, from the persistent buffers only:
        what one graph captures. Returns views (tokens [R, K], q [R, K, V] or None)."""
        b, r, w = self.buffers, num_rows, self.width
        tokens = b.tokens[: r * k_max].view(r, k_max)
        self._ops.prepare(r)  # writes every buffer read below
        q = params = None
        if mode is not SamplingMode.GREEDY:
            q = self._q[: r * k_max * self.q_vocab].view(r, k_max, self.q_vocab)
            params = self.sampling.select(b.param[:r])
        meta = self._metadata("prefill", r)
        hidden = None
        if self.kind is not DraftKind.LLAMA:
            hidden = self._hidden.index_select(0, b.p_src[: r * w])
        out, logits = self._forward(meta, hidden)
        if hidden is not None:
            hidden = out.index_select(0, b.p_last[:r])  # the state that drew token 0
        self._sample(logits, params, mode, r, k_max, 0, tokens, q)
        meta = self._metadata("decode", r)
        for step in range(1, k_max):
            self._ops.advance(r, step, k_max)
            hidden, logits = self._forward(meta, hidden)
            self._sample(logits, params, mode, r, k_max, step, tokens, q)
        self._ops.epilogue(r, k_max)
        return tokens, q

    # ---- statistics -------------------------------------------------------------------

    @property
    def counters(self) -> torch.Tensor:
        """Device int64 [2 + K_cap]: rounds, rows drafted, then draft tokens proposed at
        each position j (rows with k > j), advanced inside every round. Read it (a
        synchronising copy) off the hot path, or copy it asynchronously."""
        return self.buffers.counters

    def read_counters(self) -> dict:
        c = self.buffers.counters.tolist()
        return {"rounds": c[0], "rows": c[1], "proposed_per_position": c[2:]}

    def teardown(self) -> None:
        for m in self._managers.values():
            m.teardown()


class _CaptureInputs:
    """The metadata builder the capture manager calls before each warm-up and capture
    pass: fresh dummy round inputs for exactly that descriptor and this K_max."""

    def __init__(self, drafter: Drafter, k_max: int):
        self.drafter, self.k_max = drafter, k_max

    def prepare_inputs_to_capture(self, num_reqs: int, num_tokens: int, max_query_len: int):
        self.drafter._write_dummy_inputs(num_reqs, self.k_max)
        return self.drafter._metadata("prefill", num_reqs)
