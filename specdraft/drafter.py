"""The draft round: `Drafter.propose()` proposes up to K tokens per request in one CUDA
graph replay, engine-agnostic (device tensors in, device tensors out).

A round, all on the device (the bookkeeping kernels are kernels/draft_round.py, the
round's body specdraft/draft_loop.py):

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
- every request in a round passes all tokens committed since its previous round:
  verified_tokens[b, :a + 1] (the accepted drafts, then the target's correction or
  bonus token at row a = num_accepted[b]); rows past a are ignored. A request's first
  round passes the target's first sampled token (num_accepted 0);
- EAGLE: target_hidden[b, j] is the target's hidden state that predicted
  verified_tokens[b, j] (the state at the position before it; the pair sits at that
  position in the head's cache, as in vLLM); EAGLE-3: the auxiliary layers' states,
  concatenated;
- the drafter keeps each request's committed draft length on the device (advanced by
  num_accepted + 1 inside the round). Before a round it grows KV blocks to an upper
  bound (known length + W_in + K_max - 1); the exact new lengths come back through
  pinned memory a round or more later (draft_buffers.LengthBook: it only queries an
  event, never waits) and tighten the bound. Running out of blocks raises
  DraftOutOfBlocksError before anything is written: free a request and call again;
- outputs are views of persistent buffers, valid until the next propose(). Inputs are
  read where they are: the round's first kernel (prepare) takes their addresses and
  strides from a small device table uploaded with the round's host inputs and copies
  them into the round's buffers, inside the graph. Inputs written into
  `input_views(B, W_in)` are not copied at all. propose() keeps a reference to its
  input tensors until the next propose(), so the table never points at freed memory.
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

from . import kernels
from .block_table import OutOfBlocksError
from .config import CacheConfig, LimitsConfig, _check_int
from .cuda_graph import CudaGraphBackend, CUDAGraphMode, SpeculatorCudaGraphManager
from .draft_buffers import MODE_NAMES, LengthBook, SamplingMode
from .draft_inputs import (
    DraftInputTypeError,
    DraftKind,
    ProposeInputs,
    check_prompt,
    check_propose_inputs,
    draft_kind,
)
from .draft_loop import DraftLoop
from .kv_cache import KVCache, num_blocks_for_budget
from .sampling import SamplingParams, SeedSource

logger = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0)
_MODES = tuple(SamplingMode)
_DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
_PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)  # prompt-chunk graph sizes
_HEADROOM_ROUNDS = 16


class DraftOutOfBlocksError(OutOfBlocksError):
    """A round needs more KV blocks than are free. Raised before anything changed:
    remove (or preempt) a request and call propose() again. `needed` and `free` are
    block counts."""

    def __init__(self, message: str, needed: int, free: int):
        super().__init__(message)
        self.needed, self.free = needed, free


class Proposal(NamedTuple):
    """tokens: int64 [B, K_max] target ids, -1 where a request proposes nothing
    (j >= k[b]). q: float32 [B, K_max, V], the exact distribution each token was drawn
    from (V the target vocabulary; see Drafter.q_token_ids for q_vocab="draft"), or None
    when every row is greedy; meaningful only where tokens >= 0. Views valid until the
    next propose()."""

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
    """A draft model with its paged KV cache, block tables, persistent round buffers and
    one captured graph per (batch bucket, K_max, sampling mode).

    model: a LlamaForCausalLM (its own KV cache; the target's vocabulary), an EagleHead or
    an Eagle3Head. k_max_options: the K_max values captured for every batch bucket, or a
    table {max batch size: K_max} like vLLM's num_speculative_tokens_per_batch_size
    (batches past every key take the last entry); measure one with bench/draft_round.py.
    graph_modes: which of "greedy", "sample", "filter" to capture (a batch replays the
    cheapest captured mode that serves it, or runs eagerly). q_vocab, for an EAGLE-3 head
    with a reduced draft vocabulary (or an EAGLE-1 head after EagleHead.reduce_vocab,
    called before the Drafter is built): "target" gives q over the target vocabulary with
    zeros outside the draft's; "draft" gives q over the draft vocabulary, column d
    standing for target id q_token_ids[d]. cuda_graphs None: on for a CUDA model."""

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
        self.model, self.dtype = model, model.dtype
        self.device = model.embed_tokens.weight.device
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
        modes = sorted({self._mode(m) for m in graph_modes})
        max_prefill_tokens = _check_int("max_prefill_tokens", max_prefill_tokens, 1)
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        if use_graphs and self.device.type != "cuda" and graph_backend is None:
            raise ValueError("cuda_graphs=True needs the model on a CUDA device")
        self.max_num_reqs, self.max_model_len = max_num_reqs, max_model_len
        limits = LimitsConfig(max_num_reqs, max(max_prefill_tokens, max_num_reqs), max_model_len)
        mcfg = model.cfg.runtime_config(self.dtype)
        need = max_num_reqs * limits.max_blocks_per_req(block_size) + 1
        if num_blocks is None:  # never more than every request at full length needs
            num_blocks = need
            if self.device.type == "cuda":
                free = int(torch.cuda.mem_get_info(self.device)[0])
                cc = CacheConfig(block_size, gpu_memory_fraction=gpu_memory_fraction)
                num_blocks = min(need, num_blocks_for_budget(mcfg, cc, free))
        cache = KVCache(mcfg, CacheConfig(block_size, num_blocks=num_blocks), self.device)
        self.hidden_in = 0  # width of the target states a round reads
        if self.kind is DraftKind.EAGLE:
            self.hidden_in = model.cfg.hidden_size
        elif self.kind is DraftKind.EAGLE3:
            self.hidden_in = model.fc.in_features  # the auxiliary layers' states
        self.loop = DraftLoop(
            model,
            self.kind,
            limits=limits,
            width=self.width,
            k_cap=self.k_cap,
            cache=cache,
            hidden_in=self.hidden_in,
            q_vocab=q_vocab,
        )
        round_graphs = _round_graphs(use_graphs, cuda_graphs, graph_backend, self.loop.ops)
        self.cache, self.tables, self.buffers = cache, self.loop.tables, self.loop.buffers
        self.block_size, self.vocab_size = block_size, self.loop.vocab_size
        self.q_token_ids = self.loop.q_token_ids
        self.seeds = SeedSource(seed)
        self.lengths = LengthBook(max_num_reqs + 1, max_num_reqs, self.device)
        slots = max_num_reqs + 1
        self._slot_k = np.zeros(slots, dtype=np.int64)
        self._slot_greedy = np.ones(slots, dtype=bool)
        self._slot_filter = np.zeros(slots, dtype=bool)
        self._slot_mark = np.zeros(slots, dtype=np.int64)  # duplicate-id check
        self._arange = np.arange(max_num_reqs, dtype=np.int64)
        self.rounds = self.graph_rounds = self.steady_rounds = 0
        self._views: dict[tuple, Proposal] = {}
        self._steady: _Steady | None = None  # the last graph round, while it may repeat
        self._sources: tuple = ()  # the last round's input tensors (the device reads them)
        # (data pointer, strides) of input_views(): inputs written there are not copied
        self._own = [(t.data_ptr(), t.stride()) for t in self.input_views(1) if t is not None]
        self._own += [(0, ())] * (3 - len(self._own))

        sizes = sorted(
            {_check_int("capture_sizes[i]", s, 1) for s in (capture_sizes or _DEFAULT_BUCKETS)}
        )
        sizes = [s for s in sizes if s <= max_num_reqs]
        if capture_sizes is None and max_num_reqs not in sizes:
            sizes.append(max_num_reqs)
        self.capture_sizes, self.graph_modes = sizes, modes
        self._managers: dict[tuple[int, SamplingMode], SpeculatorCudaGraphManager] = {}
        for k in self.k_options if round_graphs else ():
            buckets = [b for b in sizes if k in self._ks_for_bucket(b, sizes)]
            for mode in modes if buckets else ():
                self._managers[(k, mode)] = SpeculatorCudaGraphManager(
                    max_num_reqs=max_num_reqs,
                    max_num_tokens=max_num_reqs * self.width,
                    cg_mode=CUDAGraphMode.FULL,
                    capture_sizes=[b * self.width for b in buckets],
                    uniform_token_counts=(self.width,),
                    mixed=False,
                    backend=graph_backend,
                )
        # The prompt prefill of add_request, by chunk size (one request, any length up
        # to the size): eager, it costs ~15 launches of host time per new request.
        if use_graphs:
            budget = limits.max_num_tokens
            prompt_sizes = [s for s in _PROMPT_BUCKETS if s < budget] + [budget]
            self.loop.prompt_graphs = SpeculatorCudaGraphManager(
                max_num_reqs=max_num_reqs,
                max_num_tokens=budget,
                cg_mode=CUDAGraphMode.FULL,
                capture_sizes=prompt_sizes,
                uniform_token_counts=(),
                mixed=True,
                backend=graph_backend,
            )
        self.capture_seconds = 0.0  # the round graphs'
        self.prompt_capture_seconds = 0.0
        if (self._managers or use_graphs) and capture_now:
            self.capture()

    # ---- configuration ----------------------------------------------------------------

    @staticmethod
    def _mode(m) -> SamplingMode:
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
        shuffled by order_seed, to show that order does not matter), each pass on fresh
        dummy inputs for exactly its descriptor (the capture rule); then the prompt
        graphs of add_request."""
        todo = [(d, key) for key, m in self._managers.items() for d in m.descriptors]
        todo.sort(key=lambda x: (-x[0].num_tokens, -x[1][0], -int(x[1][1])))
        if order_seed is not None:
            random.Random(order_seed).shuffle(todo)
        self._leave_steady()
        counters = self.buffers.counters.clone()
        start = time.perf_counter()
        with torch.no_grad():
            for desc, (k, mode) in todo:

                def forward(num_reqs, num_tokens, meta, slots, dp, cg_mode, k=k, mode=mode):
                    return self.loop.run(num_reqs, k, mode)

                self._managers[(k, mode)].capture(
                    forward, _CaptureInputs(self.loop, k), descriptors=[desc]
                )
            self.capture_seconds = time.perf_counter() - start  # the round graphs'
            prompt = self.loop.prompt_graphs
            if prompt is not None:

                def prompt_forward(num_reqs, num_tokens, meta, slots, dp, cg_mode):
                    self.loop.prompt_forward(meta)

                prompt.capture(prompt_forward, self.loop.builder, "Capturing draft prompt graphs")
                self.prompt_capture_seconds = prompt.capture_seconds
        self.buffers.counters.copy_(counters)  # warm-ups ran dummy rounds
        logger.info(
            "captured %d draft-round graphs in %.2f s and %d prompt graphs in %.2f s",
            len(todo),
            self.capture_seconds,
            self.num_prompt_graphs,
            self.prompt_capture_seconds,
        )

    @property
    def num_graphs(self) -> int:
        return sum(len(m.captured) for m in self._managers.values())

    @property
    def num_prompt_graphs(self) -> int:
        prompt = self.loop.prompt_graphs
        return 0 if prompt is None else len(prompt.captured)

    # ---- requests ---------------------------------------------------------------------

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.tables

    def __len__(self) -> int:
        return len(self.tables)

    def add_request(
        self,
        req_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        k: int | None = None,
        *,
        target_hidden: torch.Tensor | None = None,
    ) -> None:
        """Admit a request and run the draft's prefill over its prompt (a prompt graph
        replay per chunk when graphs are on).

        Llama draft: the prompt's KV. EAGLE heads: target_hidden [n, h_in] holds the
        target's hidden states (EAGLE-3: auxiliary states) at the n prompt positions;
        the pairs (prompt[i + 1], target_hidden[i]) for i < n - 1 are prefilled; row
        n - 1 goes with the target's first sampled token in the first propose().
        params: sampling parameters (default greedy; a missing seed gets a distinct one).
        k: the request's number of speculative tokens (default the largest K_max; a
        round uses min(k, K_max) unless propose() is given k).
        Raises before anything changes: ValueError / TypeError for bad input,
        OutOfBlocksError when the cache cannot hold the prompt."""
        ids, hidden = check_prompt(self, req_id, prompt_token_ids, target_hidden)
        self._leave_steady()
        params = GREEDY if params is None else params
        if not isinstance(params, SamplingParams):
            raise DraftInputTypeError(
                f"params must be a SamplingParams, got {type(params).__name__}"
            )
        k = self.k_cap if k is None else _check_int("k", k, 0, self.k_cap)
        length = len(ids) - self.loop.shift  # the draft's KV length after the prefill
        self.lengths.poll()
        self.tables.add_request(req_id, max(length, 1))  # raises with nothing changed
        slot = self.tables.row_of(req_id)
        params = self.seeds.resolve(params)
        self.loop.sampling.write_rows([slot], [params], self.seeds)
        self._slot_k[slot] = k
        self._slot_greedy[slot], self._slot_filter[slot] = params.greedy, params.uses_filter
        self.lengths.set_exact(slot, length)
        self.buffers.base[slot].fill_(length)
        with torch.no_grad():
            self.loop.prefill_prompt(req_id, ids, hidden)

    def reserve(self, req_id: Hashable, num_tokens: int) -> bool:
        """Grow the request's KV blocks to hold num_tokens draft tokens now (e.g. its
        whole budget at admission, so that later rounds allocate nothing). False, with
        nothing allocated, when the cache is short."""
        num_tokens = _check_int("num_tokens", num_tokens, 1, self.tables.max_tokens_per_req)
        self._leave_steady()
        return self.tables.grow(req_id, num_tokens)

    def remove_request(self, req_id: Hashable) -> None:
        """Free the request's blocks and slot. A later request in that slot starts from
        its own prompt, parameters, k and length: nothing of this one is read again."""
        slot = self.tables.row_of(req_id)  # ValueError for an unknown id
        self._leave_steady()
        self.tables.remove_request(req_id)
        self.lengths.set_exact(slot, 0)
        self._slot_k[slot] = 0
        self._slot_greedy[slot], self._slot_filter[slot] = True, False
        self.buffers.base[slot].fill_(0)

    # ---- the round --------------------------------------------------------------------

    def input_views(self, num_reqs: int, width: int | None = None):
        """(verified [B, W_in], num_accepted [B], target_hidden [B, W_in, h_in] or None):
        views of the round's own input buffers. An engine that writes its inputs there
        and passes these views to propose() saves the round's copy of them."""
        w = self.width if width is None else width
        b = self.buffers
        hid = None
        if self.loop.hidden is not None:
            hid = self.loop.hidden.view(-1, self.width, self.hidden_in)[:num_reqs, :w]
        return b.verified[:num_reqs, :w], b.accepted[:num_reqs], hid

    def token_table(self, k_max: int) -> torch.Tensor:
        """[max_num_reqs, k_max] int64: the persistent buffer every round with this K_max
        writes its draft tokens into (Proposal.tokens is its first rows), valid until the
        next round. An engine whose verification reads drafts from here needs no copy."""
        k_max = _check_int("k_max", k_max, 1, self.k_cap)
        return self.buffers.tokens[: self.max_num_reqs * k_max].view(self.max_num_reqs, k_max)

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
        Returns Proposal(tokens [B, K_max], q [B, K_max, V] or None).

        A round that repeats the previous graph round (the same req_ids, k and k_max,
        inputs at the same addresses and shapes, no request added, removed or grown
        since, and KV blocks known to suffice) skips the checks and the bookkeeping:
        it replays the graph, which reads the inputs where they are."""
        st = self._steady
        if (st is not None and not eager
                and st.repeats(req_ids, verified_tokens, num_accepted, target_hidden, k, k_max)
                and not kernels.validation_enabled(self.device)):  # fmt: skip
            return self._steady_round(st)
        self._leave_steady()
        self.lengths.poll()
        inp = check_propose_inputs(
            self, req_ids, verified_tokens, num_accepted, target_hidden, k, k_max
        )
        b, w, kk, slots = inp.num_reqs, inp.width, inp.k_max, inp.slots
        mode = SamplingMode.GREEDY
        if not self._slot_greedy[slots].all():
            mode = SamplingMode.FILTER if self._slot_filter[slots].any() else SamplingMode.SAMPLE
        desc, run_mode = None, mode
        for m in _MODES[mode:]:  # the cheapest captured mode that serves this batch
            manager = self._managers.get((kk, m))
            if manager is not None:
                desc = manager.dispatch(
                    b, b * self.width, uniform_token_count=self.width, max_query_len=self.width
                )
                if desc is not None:
                    run_mode = m
                    break
        self._reserve(inp)  # raises DraftOutOfBlocksError before anything is written

        # ---- from here on state changes; nothing below raises on valid input ----
        self.tables.commit()
        rows = desc.num_reqs if desc is not None else b
        own = self._own  # inputs written into input_views() are read in place
        src = self.loop.ops.sources(
            None if _is_view_of(verified_tokens, own[0]) else verified_tokens,
            None if _is_view_of(num_accepted, own[1]) else num_accepted,
            None if target_hidden is None or _is_view_of(target_hidden, own[2])
            else target_hidden,
            checked=True,  # by check_propose_inputs
        )  # fmt: skip
        # The round reads these tensors where they are: alive until the next upload.
        self._sources = (verified_tokens, num_accepted, target_hidden)
        self.loop.stage.upload(w, slots, inp.k, rows, src)
        if desc is not None and not eager:
            tokens, q = self._managers[(kk, run_mode)].replay(desc)
            self.graph_rounds += 1
        else:
            with torch.no_grad():
                tokens, q = self.loop.run(rows, kk, run_mode)
        self.rounds += 1
        self.lengths.launched(slots, w, self.buffers.p_seq)
        out = self._views.get((tokens.data_ptr(), tokens.shape[0], tokens.shape[1], q is None, b))
        if out is None:  # the same few (graph outputs, B) pairs recur: slice them once
            if len(self._views) > 4096:
                self._views.clear()
            out = Proposal(tokens[:b], None if q is None else q[:b])
            self._views[(tokens.data_ptr(), tokens.shape[0], tokens.shape[1], q is None, b)] = out
        if desc is not None and not eager and not kernels.validation_enabled(verified_tokens):
            budget = self._steady_budget(inp)
            if budget > 0:
                self._steady = _Steady(
                    inp, k, k_max, verified_tokens, num_accepted, target_hidden,
                    self._managers[(kk, run_mode)], desc, out, budget,
                )  # fmt: skip
        return out

    def _steady_budget(self, inp: ProposeInputs) -> int:
        """How many more rounds of this batch may run without a KV block or the length
        check: each adds at most W_in tokens to a request's upper bound and writes up to
        W_in + K_max - 1 positions past it."""
        upper = self.lengths.upper[inp.slots]  # after this round's launch
        _, blocks = self.tables.rows_of(inp.req_ids)
        cap = np.minimum(blocks * self.block_size, self.tables.max_tokens_per_req)
        w, reach = inp.width, inp.width + inp.k_max - 1
        fits = (cap - upper - reach) // w + 1
        in_len = (self.max_model_len - 1 - upper) // w + 1
        return int(max(0, min(fits.min(), in_len.min())))

    def _steady_round(self, st: _Steady) -> Proposal:
        st.manager.replay(st.desc)  # its inputs sit where the last round read them
        st.budget -= 1
        st.rounds += 1
        self.rounds += 1
        self.graph_rounds += 1
        self.steady_rounds += 1
        return st.out

    def _leave_steady(self) -> None:
        """Fold the steady rounds into the length bounds (each added between 1 and W_in
        tokens: lower + 1, upper + W_in per round) and drop the steady state."""
        st = self._steady
        if st is None:
            return
        self._steady = None
        if st.rounds:
            self.lengths.state[st.slots, 0] += st.rounds
            self.lengths.state[st.slots, 1] += st.rounds * st.w

    def _reserve(self, inp: ProposeInputs) -> None:
        """Grow every request's blocks to its upper bound for this round, all or none."""
        slots = inp.slots
        upper = self.lengths.upper[slots]
        if upper.max() >= self.max_model_len:  # only then can a lower bound be too long
            lower = self.lengths.lower[slots]
            if lower.max() >= self.max_model_len:
                i = int(np.argmax(lower >= self.max_model_len))
                raise ValueError(
                    f"request {inp.req_ids[i]!r} already holds {lower[i]} draft tokens: "
                    f"another round would pass max_model_len {self.max_model_len}"
                )
        # The round writes positions up to L + (W_in - 1) + (K_max - 1); positions past
        # the table's capacity write nothing (and are never committed).
        want = np.minimum(upper + (inp.width + inp.k_max - 1), self.tables.max_tokens_per_req)
        short = want > inp.num_blocks * self.block_size
        if not short.any():
            return
        t = self.tables
        blocks = np.where(short, -(-want // self.block_size) - inp.num_blocks, 0)
        needed = int(blocks.sum())
        # A request that grows gets room for _HEADROOM_ROUNDS more rounds too when that
        # takes at most half the free blocks, so that growth (and the slow path) comes
        # every few rounds without starving other requests of their next block.
        roomy = np.minimum(want + _HEADROOM_ROUNDS * inp.width, self.tables.max_tokens_per_req)
        more = np.where(short, -(-roomy // self.block_size) - inp.num_blocks, 0)
        if int(more.sum()) <= t.num_free_blocks // 2:  # never the last half of the pool
            want, needed = roomy, int(more.sum())
        if needed > t.num_free_blocks:
            worst = inp.req_ids[int(np.argmax(blocks))]
            raise DraftOutOfBlocksError(
                f"this round needs {needed} more KV blocks (request {worst!r} needs "
                f"{int(blocks.max())}) but {t.num_free_blocks} are free; nothing was changed: "
                "remove or preempt a request and call propose() again",
                needed,
                t.num_free_blocks,
            )
        for i in np.flatnonzero(short):
            assert t.grow(inp.req_ids[i], int(want[i]))

    # ---- statistics -------------------------------------------------------------------

    @property
    def counters(self) -> torch.Tensor:
        """Device int64 [2 + K_cap]: rounds, rows drafted, then draft tokens proposed at
        each position j (rows with k > j), advanced inside every round. Copy it
        asynchronously, or read it (a synchronising read) off the hot path."""
        return self.buffers.counters

    def read_counters(self) -> dict:
        c = self.buffers.counters.tolist()
        return {"rounds": c[0], "rows": c[1], "proposed_per_position": c[2:]}

    def teardown(self) -> None:
        self._leave_steady()
        for m in self._managers.values():
            m.teardown()
        if self.loop.prompt_graphs is not None:
            self.loop.prompt_graphs.teardown()


_NEVER = object()


def _geometry(t) -> tuple | None:
    if not isinstance(t, torch.Tensor):
        return None
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def _round_graphs(use_graphs: bool, cuda_graphs, graph_backend, ops) -> bool:
    """Whether the round runs as captured graphs. A real CUDA graph needs round ops that
    read the inputs inside it (the Triton kernels); on the PyTorch path
    (SPECDRAFT_BACKEND=torch) the rounds run eagerly, and an explicit cuda_graphs=True
    is refused. A stand-in graph backend runs the work anew at each replay."""
    if not use_graphs or graph_backend is not None or ops.reads_sources_in_graph:
        return use_graphs
    if cuda_graphs:
        raise ValueError(
            "cuda_graphs=True needs the Triton round kernels: on the PyTorch path "
            "(SPECDRAFT_BACKEND=torch) a captured round would not read its inputs"
        )
    return False


class _Steady:
    """The last graph round, kept so that an identical next round can skip to the
    replay: its arguments (copies of the host ones, the tensors' geometry), what it
    dispatched to and how many more rounds its KV blocks and max_model_len allow."""

    __slots__ = ("ids", "k", "k_max", "geo", "objs", "slots", "b", "w", "manager", "desc",
                 "out", "budget", "rounds")  # fmt: skip

    def __init__(self, inp, k, k_max, verified, accepted, hidden, manager, desc, out, budget):
        self.ids = list(inp.req_ids)
        # values that cannot change behind our back: None, an int, a copied list (an
        # array or tensor could be rewritten in place: such a k never matches)
        self.k = list(k) if type(k) is list else (k if k is None or type(k) is int else _NEVER)
        self.k_max = k_max
        self.geo = (_geometry(verified), _geometry(accepted), _geometry(hidden))
        self.objs = (verified, accepted, hidden)  # the same objects again: same geometry
        self.slots, self.b, self.w = inp.slots.copy(), inp.num_reqs, inp.width
        self.manager, self.desc, self.out = manager, desc, out
        self.budget, self.rounds = budget, 0

    def repeats(self, req_ids, verified, accepted, hidden, k, k_max) -> bool:
        if self.budget <= 0 or k_max != self.k_max or req_ids != self.ids:
            return False
        if k is not self.k and not (type(k) in (list, int) and k == self.k):
            return False  # None == None, an equal int or list; arrays and tensors never
        o = self.objs
        if verified is o[0] and accepted is o[1] and hidden is o[2]:
            g = self.geo[0]  # not moved or resized in place since
            return verified.data_ptr() == g[0] and verified.shape == g[1]
        return (_geometry(verified), _geometry(accepted), _geometry(hidden)) == self.geo


def _is_view_of(src: torch.Tensor, own: tuple[int, tuple[int, ...]]) -> bool:
    """Whether src starts at the (data pointer, strides) of one of input_views()' views,
    i.e. the engine wrote its input in place."""
    return src.data_ptr() == own[0] and src.stride() == own[1]


class _CaptureInputs:
    """The metadata builder the capture manager calls before each warm-up and capture
    pass: fresh dummy round inputs for exactly that descriptor and this K_max."""

    def __init__(self, loop: DraftLoop, k_max: int):
        self.loop, self.k_max = loop, k_max

    def prepare_inputs_to_capture(self, num_reqs: int, num_tokens: int, max_query_len: int):
        self.loop.write_dummy_inputs(num_reqs, self.k_max)
        return self.loop.metadata("prefill", num_reqs)
