"""The target runner: a causal LM served over the paged KV cache, one step at a time.

A step is a ScheduledBatch of prefill chunks and decode rows. The runner builds its
metadata, runs the model (a captured graph when one fits: decode-only steps by batch
size, steps with prefill chunks by token count; eagerly otherwise), samples one token
per request on the device and leaves it in persistent buffers; `readback` starts an
asynchronous copy of those tokens into pinned host memory and returns a handle the
caller reads one step later, so the host never waits for the step it has just launched.

Device-fed tokens: a decode row's input is the token the previous step sampled for the
same request, which the host has not seen yet. The host writes the id -(row + 1) for such
a token (row: the request's block-table row) and the step replaces it on the device with
the last token sampled for that row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from . import kernels, ops
from .attn_metadata import AttentionMetadata, MetadataBuilder
from .batch import ScheduledBatch
from .block_table import BlockTables
from .config import CacheConfig, LimitsConfig
from .cuda_graph import BatchExecutionDescriptor, CUDAGraphMode, SpeculatorCudaGraphManager
from .input_buffers import InputBuffers
from .kv_cache import KVCache, num_blocks_for_budget
from .models.llama import LlamaForCausalLM
from .sampling import TARGET_SAMPLE, SamplingParams, SamplingTensors, logprobs, sample
from .staging import CurrentStream, PinnedRing

logger = logging.getLogger(__name__)

# The step's graph sets: how its tokens are drawn.
GREEDY_SET, SAMPLE_SET, FILTER_SET = 0, 1, 2
_SETS = (GREEDY_SET, SAMPLE_SET, FILTER_SET)
_NAMES = {GREEDY_SET: "greedy", SAMPLE_SET: "sampled", FILTER_SET: "sampled, top-k / top-p"}

_GREEDY = SamplingParams(temperature=0.0)


def device_token(row: int) -> int:
    """The input id that stands for "the last token sampled for block-table row `row`"."""
    return -(row + 1)


@dataclass
class Readback:
    """Tokens (and log-probabilities) of one step, on their way to pinned host memory.
    `wait()` returns them once the copy has run: call it a step later."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None
    event: torch.cuda.Event | None
    num_reqs: int

    def wait(self) -> tuple[list[int], list[float] | None]:
        if self.event is not None:
            self.event.synchronize()
        toks = self.tokens[: self.num_reqs].tolist()
        lps = None if self.logprobs is None else self.logprobs[: self.num_reqs].tolist()
        return toks, lps


class TargetRunner:
    """Owns the KV cache, block tables, input buffers, per-request sampling rows and the
    decode graphs of one model.

    max_num_tokens is the token budget of one step (prefill chunks are cut to fit it);
    max_model_len bounds prompt + output per request and must fit the model's rotary
    table. Graphs are captured on CUDA unless cuda_graphs=False; on a CPU every step
    runs eagerly."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        max_num_reqs: int = 32,
        max_num_tokens: int = 512,
        max_model_len: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        gpu_memory_fraction: float = 0.5,
        cuda_graphs: bool | None = None,
        capture_sizes: list[int] | None = None,
        prefill_sizes: list[int] | None = None,
    ):
        if not isinstance(model, LlamaForCausalLM):
            raise TypeError(f"model must be a LlamaForCausalLM, got {type(model).__name__}")
        self.model = model
        self.device = model.embed_tokens.weight.device
        if max_model_len is None:
            max_model_len = model.rotary.max_positions
        self.limits = LimitsConfig(max_num_reqs, max_num_tokens, max_model_len)
        if max_model_len > model.rotary.max_positions:
            raise ValueError(
                f"max_model_len {max_model_len} is over the model's rotary table "
                f"({model.rotary.max_positions} positions): build the model with "
                f"max_positions >= {max_model_len}"
            )
        mcfg = model.cfg.runtime_config(model.dtype)
        if num_blocks is None:
            if self.device.type == "cuda":
                free = int(torch.cuda.mem_get_info(self.device)[0])
                budget = CacheConfig(block_size, gpu_memory_fraction=gpu_memory_fraction)
                num_blocks = num_blocks_for_budget(mcfg, budget, free)
            else:
                num_blocks = max_num_reqs * self.limits.max_blocks_per_req(block_size) + 1
            # Never more than every request at full length needs.
            need = max_num_reqs * self.limits.max_blocks_per_req(block_size) + 1
            num_blocks = max(2, min(num_blocks, need))
        self.cache = KVCache(mcfg, CacheConfig(block_size, num_blocks=num_blocks), self.device)
        self.tables = BlockTables(
            max_num_reqs,
            self.limits.max_blocks_per_req(block_size),
            block_size,
            self.cache.num_blocks,
            self.device,
        )
        self.buffers = InputBuffers(self.limits, self.device)
        self.builder = MetadataBuilder(self.limits, self.buffers, self.tables, self.cache)
        dev = self.device
        rows = max_num_reqs + 1  # + the null row that padded requests point at
        self.sampling = SamplingTensors(rows, dev)
        self.last_token = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.out_tokens = torch.zeros(max_num_reqs, dtype=torch.int64, device=dev)
        self._tickets = torch.zeros(max_num_reqs, dtype=torch.int32, device=dev)  # argmax
        self.out_logprobs = torch.zeros(max_num_reqs, dtype=torch.float32, device=dev)
        pin = dev.type == "cuda"
        # Two pinned readback slots, used in turn: a step's tokens are read (Readback.wait)
        # before the step after the next one is launched, which the engines' one-step-late
        # loop guarantees. The steady decode graphs copy into a slot themselves.
        self._host = [
            (
                torch.zeros(max_num_reqs, dtype=torch.int64, pin_memory=pin),
                torch.zeros(max_num_reqs, dtype=torch.float32, pin_memory=pin),
                torch.cuda.Event() if pin else None,
            )
            for _ in range(2)
        ]
        self._next_host = 0
        self._stream = CurrentStream(dev) if pin else None
        use_graphs = dev.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        if use_graphs and dev.type != "cuda":
            raise ValueError("cuda_graphs=True needs the model on a CUDA device")
        # Up to max_num_reqs itself: a batch of every request must find a graph (5 prompts
        # at batch 5 used to decode eagerly).
        sizes = capture_sizes or [
            s for s in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256) if s < max_num_reqs
        ] + [max_num_reqs]
        mode = CUDAGraphMode.FULL if use_graphs else CUDAGraphMode.NONE
        self._graph_mode = mode
        # Three graph sets (_SETS): greedy (argmax, no log-probs), sampled without top-k /
        # top-p (the fused sampler) and sampled with them; each with log-probs when sampled.
        self._graphs = {m: self._manager(sizes, uniform=1) for m in _SETS}
        # Steady decode steps (the same batch one token on): the advance launch, the step
        # and the readback copy into pinned slot `slot`, all in one graph per
        # (set, slot) and size, so such a step is one replay and one event record.
        self._next_graphs = {
            (m, slot): self._manager(sizes, uniform=1)
            for m in _SETS
            for slot in range(len(self._host))
        }
        # Mixed steps (prefill chunks beside decode rows) by token count: the kernels read
        # every length from the buffers, so one graph serves any mix that fits it.
        if prefill_sizes is None:
            prefill_sizes = [s for s in (16, 32, 64, 128, 256, 512, 1024, 2048)
                             if s < max_num_tokens] + [max_num_tokens]  # fmt: skip
        self._prefill_graphs = {m: self._manager(prefill_sizes) for m in _SETS}
        self._verify_graphs: dict[int, SpeculatorCudaGraphManager] = {}  # by rows/request
        # (rows a request, descriptor, tokens) -> the graph's outputs sliced to the tokens
        self._verify_views: dict[tuple, tuple] = {}
        # mixed steps that also return the target's features (after keep_features())
        self._feature_graphs: dict[int, SpeculatorCudaGraphManager] = {}
        self._prefill_sizes = prefill_sizes
        self._decode_sizes = sizes
        self.steps = 0
        self.graph_steps = 0
        self.advanced_steps = 0  # decode steps that uploaded nothing (execute_next)
        self._features: tuple[str, tuple[int, ...] | None] | None = None  # keep_features
        self._vk: int | None = None  # the k_max the verification buffers are sized for
        # bumped when the verification buffers or the kept features change: a graph that
        # another object captured over them (SpeculativeEngine's steps) keys on it
        self.generation = 0
        self._verify_rows_for: tuple[int, int] | None = None  # (requests, k) in verify_rows
        self._last: tuple[int, BatchExecutionDescriptor | None, bool] | None = None

    # ---- requests -------------------------------------------------------------------

    def set_sampling(self, row: int, params: SamplingParams) -> None:
        """Write a request's sampling parameters into its row (at admission)."""
        self.sampling.write_rows([row], [params])

    def remove_request(self, req_id) -> None:
        """Free a request's blocks and row; the row's sampling goes back to greedy, so
        that a sampled request that has left does not make later batches look sampled
        (the sampling tensors' host flags cover every row)."""
        row = self.tables.row_of(req_id)
        self.tables.remove_request(req_id)
        self.sampling.write_rows([row], [_GREEDY])
        self._verify_rows_for = None  # its row may come back as another request's

    # ---- capture --------------------------------------------------------------------

    def _manager(self, sizes: list[int], uniform: int | None = None):
        """A capture manager over this runner's limits: uniform descriptors of `uniform`
        tokens per request, or mixed ones by token count when uniform is None."""
        lim = self.limits
        return SpeculatorCudaGraphManager(
            max_num_reqs=lim.max_num_reqs,
            max_num_tokens=lim.max_num_tokens,
            cg_mode=self._graph_mode,
            capture_sizes=sizes,
            uniform_token_counts=() if uniform is None else (uniform,),
            mixed=uniform is None,
        )

    def capture(self) -> None:
        """Warm up and capture the decode and mixed-step graphs (no-op without graphs)."""
        for kind, managers in (("decode", self._graphs), ("mixed-step", self._prefill_graphs)):
            for m, manager in managers.items():
                if not manager.descriptors:
                    continue

                def forward(num_reqs, num_tokens, meta, slots, dp, mode, m=m):
                    return self._forward(meta, m)

                manager.capture(forward, self.builder, f"Capturing {kind} graphs ({_NAMES[m]})")
        for (m, slot), manager in self._next_graphs.items():
            if not manager.descriptors:
                continue

            def forward(num_reqs, num_tokens, meta, slots, dp, mode, m=m, slot=slot):
                # During capture the buffers hold dummy rows on the null block-table row:
                # the advance moves them on and their K/V goes to the reserved null block.
                self.builder.launch_advance(num_reqs, num_tokens)
                out = self._forward(meta, m)
                self._copy_out(slot, num_reqs, with_logprobs=m != GREEDY_SET)
                return out

            manager.capture(
                forward,
                self.builder,
                f"Capturing steady decode graphs ({_NAMES[m]}, slot {slot})",
            )
        self._last = None  # capture leaves dummy contents in the buffers

    def _all_managers(self) -> list[SpeculatorCudaGraphManager]:
        """Every graph family's managers: decode, mixed steps, feature steps, verification."""
        families = (
            self._graphs,
            self._next_graphs,
            self._prefill_graphs,
            self._feature_graphs,
            self._verify_graphs,
        )
        return [m for family in families for m in family.values()]

    @property
    def capture_seconds(self) -> float:
        return sum(getattr(m, "capture_seconds", 0.0) or 0.0 for m in self._all_managers())

    # ---- one step -------------------------------------------------------------------

    def graph_set(self, greedy: bool) -> int:
        """The graph set a step of this batch runs in: GREEDY_SET when every request is
        greedy (the caller's flag), else by the sampling table's host flags whether any
        row uses top-k / top-p."""
        if greedy:
            return GREEDY_SET
        return FILTER_SET if self.sampling.any_filter else SAMPLE_SET

    def _forward(self, meta: AttentionMetadata, m: int) -> torch.Tensor:
        """Model, sampling and the device-side bookkeeping of one step; fixed shapes
        only, so it can be captured per descriptor."""
        ids = ops.resolve_fed_ids(meta.input_ids, self.last_token)
        logits = self._model_call(ids, meta, all_logits=False)
        r = meta.num_reqs
        rows = self.buffers.row_slots[:r]
        if m == GREEDY_SET:  # one launch, into out_tokens
            tok = ops.argmax(logits, out=self.out_tokens[:r], tickets=self._tickets)
        else:
            pos = meta.positions.index_select(0, meta.last_token_idx) + 1  # the drawn token's
            params = self.sampling.select(rows)
            tok = sample(logits, params, pos, TARGET_SAMPLE, any_filter=m == FILTER_SET)
            lp = logprobs(logits).gather(1, tok[:, None]).squeeze(1)
            self.out_logprobs[:r].copy_(lp)
            self.out_tokens[:r].copy_(tok)
        self.last_token.index_copy_(0, rows, tok)
        return self.out_tokens[:r]

    def execute(self, batch: ScheduledBatch, *, greedy: bool, features: bool = False) -> int:
        """Run one step. Returns the number of batch rows whose sampled token sits in
        out_tokens[:num_reqs] (rows in batch order). greedy: every request in the batch
        is greedy and wants no log-probabilities (the argmax graph set). features: leave
        the step's target features [num_tokens, width] in `last_features` (the kind set
        by keep_features()); steps with prefill chunks then replay the feature-returning
        graphs that keep_features() captured, other such steps run eagerly."""
        r, t = batch.num_reqs, batch.num_tokens
        desc: BatchExecutionDescriptor | None = None
        if features and self._features is None:
            raise ValueError("features=True needs keep_features() first")
        m = self.graph_set(greedy)
        if features:
            manager = self._feature_graphs.get(m)
        else:
            manager = self._graphs[m] if t == r else self._prefill_graphs[m]
        # Sizes outside the graphs' range go to build(), which checks them.
        if manager is not None and 1 <= r <= t <= self.limits.max_num_tokens:
            if t == r and not features:
                desc = manager.dispatch(r, t, uniform_token_count=1, max_query_len=1)
            elif t > r and manager.captured and r <= self.limits.max_num_reqs:
                mq = int(batch.num_new_tokens.max())
                desc = manager.dispatch(r, t, max_query_len=mq)
        if desc is None:
            meta = self.builder.build(batch)
        else:
            meta = self.builder.build(
                batch,
                num_reqs_padded=desc.num_reqs,
                num_tokens_padded=desc.num_tokens,
                max_query_len=desc.max_query_len,
            )
        out = self._run(meta, desc, m, manager)
        if features and desc is not None:
            self.last_features = out[1][:t]
        self._last = (r, desc, t == r and not features)
        return r

    def execute_next(self, *, greedy: bool) -> int:
        """The last decode step's requests, one token further: positions, seq_lens and
        slots move on on the device (MetadataBuilder.advance) and the input ids stay the
        device-fed ones, so the host uploads nothing. The caller has grown the block
        tables and guarantees the batch is unchanged (Engine does)."""
        if self._last is None or not self._last[2]:
            raise RuntimeError("execute_next() needs a decode step executed just before")
        r, desc, _ = self._last
        m = self.graph_set(greedy)
        if desc is not None and desc not in self._graphs[m]._graphs:
            desc = self._graphs[m].dispatch(r, r, uniform_token_count=1, max_query_len=1)
        meta = self.builder.advance()
        self._run(meta, desc, m, self._graphs[m])
        self.advanced_steps += 1
        return r

    def decode_next(self, *, greedy: bool) -> Readback:
        """execute_next() and readback() in one: with graphs, the steady decode graph of
        the batch's size does the advance, the step and the copy of its tokens into the
        next pinned slot, so the host does one replay and one event record."""
        if self._last is None or not self._last[2]:
            raise RuntimeError("decode_next() needs a decode step executed just before")
        r, desc, _ = self._last
        slot = self._next_host
        manager = self._next_graphs[(self.graph_set(greedy), slot)]
        if desc is not None and desc not in manager._graphs and manager.captured:
            desc = manager.dispatch(r, r, uniform_token_count=1, max_query_len=1)
        if desc is None or not manager.captured:
            self.execute_next(greedy=greedy)
            return self.readback(r, with_logprobs=not greedy)
        self.tables.commit()  # block-table growth, which the graph's gather reads
        manager.replay(desc)
        self.graph_steps += 1
        self.steps += 1
        self.advanced_steps += 1
        toks, lps, event = self._host[slot]
        self._next_host = 1 - slot
        if event is not None:
            event.record(self._stream())
        return Readback(toks, None if greedy else lps, event, r)

    def _copy_out(self, slot: int, num_reqs: int, *, with_logprobs: bool) -> None:
        toks, lps, _ = self._host[slot]
        toks[:num_reqs].copy_(self.out_tokens[:num_reqs], non_blocking=True)
        if with_logprobs:
            lps[:num_reqs].copy_(self.out_logprobs[:num_reqs], non_blocking=True)

    def _run(self, meta: AttentionMetadata, desc, m: int, manager):
        if desc is None:
            out = self._forward(meta, m)
        else:
            out = manager.replay(desc)
            self.graph_steps += 1
        self.steps += 1
        return out

    # ---- target features for EAGLE drafts --------------------------------------------

    def keep_features(self, aux_layers: tuple[int, ...] | None = None) -> None:
        """Which target features steps leave in `last_features` when asked to
        (execute(features=True), and every verification): the final hidden states [T, h]
        (what an EAGLE-1 head reads), or with aux_layers the residual streams entering
        those layers, concatenated [T, len * h] (EAGLE-3). With graphs on, captures the
        mixed-step graphs that also return them."""
        features = ("aux", tuple(aux_layers)) if aux_layers else ("hidden", None)
        if features == self._features:
            return
        # graphs that return features return the kind they captured
        for manager in self._feature_graphs.values():
            manager.teardown()
        self._feature_graphs.clear()
        self._drop_verify_graphs()
        self._features = features
        if self._graph_mode is CUDAGraphMode.NONE:
            return
        for m in _SETS:
            manager = self._manager(self._prefill_sizes)

            def forward(num_reqs, num_tokens, meta, slots, dp, mode, m=m):
                return self._forward(meta, m), self.last_features

            manager.capture(forward, self.builder, f"Capturing feature graphs ({_NAMES[m]})")
            self._feature_graphs[m] = manager
        self._last = None

    def _model_call(self, ids: torch.Tensor, meta: AttentionMetadata, *, all_logits: bool):
        kind, layers = self._features or (None, None)
        if kind == "aux":
            _, logits, feats = self.model(
                ids, meta, self.cache, all_logits=all_logits, aux_layers=layers
            )
        else:
            feats, logits = self.model(ids, meta, self.cache, all_logits=all_logits)
        if kind is not None:
            self.last_features = feats
        return logits

    # ---- verification (speculative decoding) ----------------------------------------

    def _drop_verify_graphs(self) -> None:
        """The verification graphs read buffers or features about to change: drop them,
        and (a new generation) mark graphs captured elsewhere over them stale."""
        self.generation += 1
        for manager in self._verify_graphs.values():
            manager.teardown()
        self._verify_graphs.clear()
        self._verify_views.clear()
        self._verify_rows_for = None

    def _verify_buffers(self, k_max: int) -> None:
        """Persistent inputs of the verification step, sized once for k_max (never
        shrunk: captured verification graphs read them)."""
        if self._vk is not None and self._vk >= k_max:
            return
        dev, r = self.device, self.limits.max_num_reqs + 1
        self._vk = k_max
        self._drop_verify_graphs()  # they read the buffers replaced below
        self.committed = torch.zeros(r, dtype=torch.int64, device=dev)
        self.verify_rows = torch.full((r,), self.tables.null_row, dtype=torch.int64, device=dev)
        self.verify_first = torch.zeros(r, dtype=torch.int64, device=dev)
        self.verify_drafts = torch.full((r, k_max), -1, dtype=torch.int64, device=dev)
        self._arange_w = torch.arange(k_max + 1, device=dev)
        # query_start_loc and last-row indices of uniform (k + 1)-row batches, per k
        n = self.limits.max_num_reqs
        self._verify_index = {
            w: (
                torch.arange(0, n * w + 1, w, device=dev, dtype=torch.int32),
                torch.arange(w - 1, n * w, w, device=dev),
            )
            for w in range(1, k_max + 2)
        }
        self._rows_ring = PinnedRing(r, torch.int64, dev)

    def read_drafts_from(self, table: torch.Tensor) -> None:
        """Verification reads its drafts from `table` ([>= max_num_reqs, k] int64 on this
        device, e.g. Drafter.token_table(k)) instead of verify_drafts' own buffer: call
        before capture_verify(k); graphs captured before over the old buffer are
        dropped. Refused (ValueError, nothing changed) for a table of another shape."""
        k = self._vk
        r = self.limits.max_num_reqs
        if (
            not isinstance(table, torch.Tensor)
            or table.dtype != torch.int64
            or table.dim() != 2
            or table.shape[0] < r
            or table.shape[1] != k
            or table.stride(1) != 1
            or table.device != self.device
        ):
            raise ValueError(
                f"table must be an int64 [>= {r}, {k}] tensor with unit column stride on "
                f"{self.device}, got {getattr(table, 'shape', table)}"
            )
        self.verify_drafts = table
        self._drop_verify_graphs()

    def capture_verify(self, k: int) -> None:
        """Capture verification graphs for k drafts per request (k + 1 rows each), one
        per request count of the decode capture sizes that fits max_num_tokens; a no-op
        without graphs. Replays serve any committed lengths and any mix of padded
        drafts: everything per step is read from device buffers inside the graph."""
        self._verify_buffers(max(k, self._vk or 0))
        w = k + 1
        if self._graph_mode is CUDAGraphMode.NONE or w in self._verify_graphs:
            return
        lim = self.limits
        sizes = [n * w for n in self._decode_sizes if n * w <= lim.max_num_tokens]
        manager = self._manager(sizes, uniform=w)
        self._verify_graphs[w] = manager
        if not manager.descriptors:
            return
        self.verify_rows.fill_(self.tables.null_row)  # capture sees padding only
        self._verify_rows_for = None

        def forward(num_reqs, num_tokens, meta, slots, dp, mode):
            return self._verify_forward(num_reqs, w)

        manager.capture(forward, self.builder, f"Capturing verification graphs (k={k})")
        self._last = None

    def execute_verify(self, num_reqs: int, k: int, *, rows: list[int]) -> torch.Tensor:
        """The target over k + 1 rows per request: row 0 the request's last emitted token
        (verify_first), rows 1..k its drafts (verify_drafts; -1 drafts become token 0,
        their K/V written past what the step can commit: kernels/verify.py). Positions
        and lengths come from `committed` on the device: row j of request b sits at
        committed[row_b] + j. `rows`: the requests' block-table rows (host ints, uploaded
        here). Returns logits [num_reqs * (k + 1), V]; KV for the rejected rows is dropped
        later by length alone. Under a captured graph (capture_verify(k)) when one fits,
        padded requests write nothing."""
        w, r = k + 1, num_reqs
        t = r * w
        if t > self.limits.max_num_tokens:
            raise ValueError(
                f"verification needs {t} tokens ({r} requests x {w}), over max_num_tokens "
                f"{self.limits.max_num_tokens}"
            )
        desc = self._verify_descriptor(r, k)
        rp = r if desc is None else desc.num_reqs
        slot, host = self._rows_ring.acquire()
        host[:r] = torch.as_tensor(rows, dtype=torch.int64)
        host[r:rp] = self.tables.null_row
        self._rows_ring.copy_to(slot, self.verify_rows, rp)
        self._verify_rows_for = (r, k)
        return self._run_verify(r, k, desc)[0]

    def replay_verify(self, num_reqs: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Verification of the same requests as the last execute_verify (their rows, and
        the padded ones', still in verify_rows): no upload, one graph replay when one
        fits. Returns (logits [num_reqs * (k + 1), V], the kept features or None)."""
        if self._verify_rows_for != (num_reqs, k):
            raise ValueError(
                f"replay_verify({num_reqs}, {k}): the verify rows on the device are for "
                f"{self._verify_rows_for} (requests, k); call execute_verify first"
            )
        return self._run_verify(num_reqs, k, self._verify_descriptor(num_reqs, k))

    def _verify_descriptor(self, r: int, k: int):
        w = k + 1
        manager = self._verify_graphs.get(w)
        if manager is None or not manager.captured or r < 1:
            return None
        return manager.dispatch(r, r * w, uniform_token_count=w, max_query_len=w)

    def _run_verify(self, r: int, k: int, desc):
        w = k + 1
        t = r * w
        self.tables.commit()
        self.builder._last = None  # the buffers no longer hold a built batch
        if desc is None:
            logits, feats = self._verify_forward(r, w)
        else:
            outs = self._verify_graphs[w].replay(desc)
            views = self._verify_views.get((w, desc, t))
            if views is None:  # the outputs are persistent: slice them once (host time)
                logits, feats = outs
                views = (logits[:t], None if feats is None else feats[:t])
                self._verify_views[(w, desc, t)] = views
            logits, feats = views
            self.graph_steps += 1
        if feats is not None:
            self.last_features = feats
        self.steps += 1
        return logits, feats

    def _verify_forward(self, rp: int, w: int):
        """Verification of rp requests (padded ones on the null row) on the device: inputs,
        positions, lengths and slots from committed / verify_*; fixed shapes, capturable.
        Returns (logits [rp * w, V], the kept features or None)."""
        t = rp * w
        self._verify_inputs(rp, w)
        meta = self.builder._metadata(rp, t, w, t, rp)
        logits = self._model_call(self.buffers.input_ids[:t], meta, all_logits=True)
        return logits, (self.last_features if self._features is not None else None)

    def _verify_inputs(self, rp: int, w: int) -> None:
        """The verify batch's metadata buffers: one launch on the Triton backend
        (kernels.verify_prepare), the same in torch ops otherwise."""
        t, k, buf, tables = rp * w, w - 1, self.buffers, self.tables
        vrows = self.verify_rows[:rp]
        if ops.backend_for(vrows) == "triton":
            kernels.verify_prepare(
                rp, w, vrows, self.committed, self.verify_first, self.verify_drafts,
                tables.rows, tables.table, tables.block_size, tables.null_row,
                buf.input_ids, buf.positions, buf.seq_lens, buf.query_start_loc,
                buf.row_slots, buf.last_token_idx, buf.slot_mapping,
            )  # fmt: skip
            return
        base = self.committed.index_select(0, vrows)  # [rp]
        drafts = self.verify_drafts[:rp, :k]
        ids = torch.cat([self.verify_first[:rp, None], drafts.clamp(min=0)], dim=1)
        buf.input_ids[:t].copy_(ids.view(-1))
        buf.positions[:t].view(rp, w).copy_(base[:, None] + self._arange_w[:w])
        buf.seq_lens[:rp].copy_(base + w)
        qsl, last = self._verify_index[w]
        buf.query_start_loc[: rp + 1].copy_(qsl[: rp + 1])
        buf.row_slots[:rp].copy_(vrows)
        buf.last_token_idx[:rp].copy_(last[:rp])
        self.builder._slot_mapping(rp, t)
        # a padded request (null row) writes nothing, row 0 included; a -1 draft writes
        # its row (finite K/V where the request's real rows load them: kernels/verify.py)
        real = (vrows != tables.null_row)[:, None].expand(rp, w)
        slots = buf.slot_mapping[:t]
        slots.copy_(torch.where(real.reshape(-1), slots, -1))

    def readback(self, num_reqs: int, *, with_logprobs: bool) -> Readback:
        """Start copying this step's tokens to pinned host memory; read them a step
        later with Readback.wait()."""
        slot = self._next_host
        toks, lps, event = self._host[slot]
        self._next_host = 1 - slot
        self._copy_out(slot, num_reqs, with_logprobs=with_logprobs)
        if event is not None:
            event.record(self._stream())
        return Readback(toks, lps if with_logprobs else None, event, num_reqs)

    def teardown(self) -> None:
        for manager in self._all_managers():
            manager.teardown()
