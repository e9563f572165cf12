"""Speculative generate(): a draft proposes, the target verifies, a rejection sampler
decides, and the output is distributed exactly as the target's own sampling.

One step of a group of requests, all on the device:

1. `Drafter.propose` over the tokens verified by the previous step (the rejection
   sampler's tokens [B, K + 1] and num_accepted, passed straight back; in the first
   step the target's first sampled token with num_accepted 0);
2. the target runs K + 1 rows per request (`TargetRunner.execute_verify`): the last
   emitted token, then the drafts; positions come from the target's committed length
   held on the device;
3. `RejectionSampler`: accepted drafts, then the correction or bonus token;
4. committed length += num_accepted + 1 (on the device); the rejected rows' KV is left
   where it is and overwritten later: rollback is by length alone.

The host reads each step's tokens through pinned memory one step later (stop ids,
max_new_tokens, streaming) and allocates KV blocks by an upper bound before each step
(known length + 2 (K + 1): one step in flight, one being launched), so it never waits for
the step it has just launched. Requests run in groups of at most max_num_reqs; a finished
request leaves the batch at the next step (its outputs in flight are discarded).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from . import kernels, ops
from .batch import ScheduledBatch
from .cuda_graph import CudaGraphBackend
from .draft_inputs import DraftKind
from .drafter import Drafter
from .generate import Engine, GenerationOutput
from .rejection import RejectionSampler
from .runner import TargetRunner
from .sampling import SamplingParams, SeedSource
from .staging import CurrentStream, PinnedRing

logger = logging.getLogger(__name__)


@dataclass
class _Req:
    index: int
    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int]
    output: list[int] = field(default_factory=list)
    finished: str | None = None
    capacity: int = 0  # tokens its target KV blocks cover
    k: int = 0  # speculative tokens a step (0: the target's token only)


_MAX_STEP_GRAPHS = 96  # small graphs (the sampler and bookkeeping): cheap to keep


class _StepGraph:
    __slots__ = ("graph", "out")

    def __init__(self, graph, out):
        self.graph, self.out = graph, out


@dataclass
class SpecStats:
    """What the host read back: steps, drafts proposed and accepted per position."""

    steps: int = 0
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    captures: int = 0  # step graphs captured while generating
    capture_seconds: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """1 + accepted drafts per verification step and request."""
        rounds = self.proposed[0] if self.proposed else 0
        return 1.0 + sum(self.accepted) / rounds if rounds else float("nan")


class SpeculativeEngine:
    """A target runner, a drafter over the same vocabulary and a rejection sampler."""

    def __init__(
        self,
        runner: TargetRunner,
        drafter: Drafter,
        *,
        k: int = 3,
        tokenizer=None,
        seed: int | None = None,
        aux_layers: Sequence[int] | None = None,
        step_graphs: bool | None = None,
        graph_backend: CudaGraphBackend | None = None,
    ):
        if not isinstance(runner, TargetRunner):
            raise TypeError(f"runner must be a TargetRunner, got {type(runner).__name__}")
        if not isinstance(drafter, Drafter):
            raise TypeError(f"drafter must be a Drafter, got {type(drafter).__name__}")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= drafter.k_cap:
            raise ValueError(
                f"k must be an int in [1, {drafter.k_cap}] (the drafter's K_max), got {k!r}"
            )
        vocab = runner.model.cfg.vocab_size
        if drafter.vocab_size != vocab:
            raise ValueError(
                f"the drafter proposes over {drafter.vocab_size} tokens, the target has {vocab}"
            )
        self.runner, self.drafter, self.k, self.tokenizer = runner, drafter, k, tokenizer
        self.vocab_size = vocab
        self.seeds = SeedSource(seed)
        self.rejection = RejectionSampler(runner.limits.max_num_reqs, k, vocab, runner.device)
        runner._verify_buffers(k)
        # EAGLE heads read the target's features of every verified token.
        self.eagle = drafter.kind is not DraftKind.LLAMA
        if self.eagle:
            n = runner.model.cfg.num_layers
            aux = None
            if drafter.kind is DraftKind.EAGLE3:
                aux = (2, n // 2, n - 3) if aux_layers is None else tuple(aux_layers)
                if drafter.hidden_in != len(aux) * runner.model.cfg.hidden_size:
                    raise ValueError(
                        f"the EAGLE-3 head reads {drafter.hidden_in} features, aux_layers "
                        f"{aux} give {len(aux) * runner.model.cfg.hidden_size}"
                    )
            runner.keep_features(aux)
        # Verification reads the drafts where the round writes them (no copy per step)
        # when the drafter's table covers the runner's requests.
        table = drafter.token_table(k)
        self._drafts_shared = table.shape[0] >= runner.limits.max_num_reqs and runner._vk == k
        if self._drafts_shared and runner.verify_drafts.data_ptr() != table.data_ptr():
            runner.read_drafts_from(table)
        runner.capture_verify(k)  # after keep_features: the graphs return the features
        self.stats = SpecStats(proposed=[0] * k, accepted=[0] * k)
        self._checker = Engine(runner, tokenizer)  # request checks only; never run
        r = runner.limits.max_num_reqs
        self._index_ring = PinnedRing(r, torch.int64, runner.device)
        pin = runner.device.type == "cuda"
        self._stream = CurrentStream(runner.device) if pin else None
        self._next_host = 0
        self._count = 0
        # Steady steps: verification, rejection sampling and the bookkeeping of a batch
        # that repeats, captured into one graph per (batch, mode, input addresses).
        cuda = runner.device.type == "cuda"
        self.step_graphs = cuda if step_graphs is None else bool(step_graphs)
        if self.step_graphs and not cuda and graph_backend is None:
            raise ValueError("step_graphs=True needs the target on a CUDA device")
        self._backend = graph_backend or CudaGraphBackend()
        self._steps: OrderedDict[tuple, _StepGraph] = OrderedDict()
        self._d_views: dict[int, tuple] = {}
        # a step's tokens and counts, staged on the device, then one copy into one of
        # three pinned slots (reused round robin: one step in flight, one being read)
        self._stage = torch.zeros((r, k + 2), dtype=torch.int64, device=runner.device)
        self._positions = torch.zeros(r, dtype=torch.int64, device=runner.device)
        self._host_stage = [torch.zeros((r, k + 2), dtype=torch.int64, pin_memory=pin)
                            for _ in range(3)]  # fmt: skip
        self.graph_steps = 0
        self._stage_views: dict[tuple, tuple] = {}
        self._stage_events = [torch.cuda.Event() if pin else None for _ in range(3)]

    # ---- generate -------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        *,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        max_new_tokens: int = 64,
        stop_token_ids: Sequence[int] | None = None,
        stream: Callable[[int, str], None] | None = None,
        k: int | Sequence[int] | None = None,
    ) -> list[GenerationOutput]:
        """Like Engine.generate, speculating up to the engine's k tokens per step. Greedy
        output equals the target's own greedy decoding; sampled output is distributed as
        the target's. k: a request's own number of speculative tokens, one int for all
        or one per prompt, each in [0, the engine's k] (default the engine's k); a
        request with k 0 takes the target's token only, in the same steps as the rest."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a list of prompts (text or token-id lists)")
        if not prompts:
            raise ValueError("prompts is empty")
        ks = self._request_ks(k, len(prompts))
        if params is None or isinstance(params, SamplingParams):
            per = [params] * len(prompts)
        else:
            per = list(params)
            if len(per) != len(prompts):
                raise ValueError(f"params has {len(per)} entries for {len(prompts)} prompts")
        # Target-only generate's checks, with room for the two steps past the last token.
        reqs = []
        for p, sp in zip(prompts, per):
            c = self._checker.check_request(
                p,
                params=sp,
                max_new_tokens=max_new_tokens,
                stop_token_ids=stop_token_ids,
                headroom=2 * (self.k + 1),
            )
            reqs.append(
                _Req(len(reqs), c.prompt, c.params, c.max_new_tokens, c.stop_ids, k=ks[len(reqs)])
            )
        size = self.runner.limits.max_num_reqs
        for i in range(0, len(reqs), size):
            self._run_group(reqs[i : i + size], stream)
        out = []
        for r in reqs:
            text = (
                None
                if self.tokenizer is None
                else self.tokenizer.decode(r.output, skip_special_tokens=True)
            )
            out.append(GenerationOutput(r.prompt, r.output, text, r.finished or "length"))
        return out

    def _request_ks(self, k, n: int) -> list[int]:
        """generate()'s k as one int per prompt, each checked against the engine's k."""
        if k is None:
            return [self.k] * n
        one = isinstance(k, int) and not isinstance(k, bool)
        ks = [k] * n if one else k
        if isinstance(ks, (str, bytes)) or not isinstance(ks, Sequence):
            raise TypeError(f"k must be an int or a list of ints, got {type(k).__name__}")
        if len(ks) != n:
            raise ValueError(f"k has {len(ks)} entries for {n} prompts")
        for i, v in enumerate(ks):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= self.k:
                what = "k" if one else f"k[{i}]"
                raise ValueError(
                    f"{what} must be an int in [0, {self.k}] (the engine's k), got {v!r}"
                )
        return list(ks)

    # ---- one group ------------------------------------------------------------------

    def _run_group(self, group: list[_Req], stream) -> None:
        runner, drafter, k, w = self.runner, self.drafter, self.k, self.k + 1
        tables = runner.tables
        ids = [self._new_id() for _ in group]
        rows = []
        for req, rid in zip(group, ids):
            req.params = self.seeds.resolve(req.params)
            tables.add_request(rid, len(req.prompt) + 2 * w)
            req.capacity = tables.capacity_of(rid)
            rows.append(tables.row_of(rid))
        runner.sampling.write_rows(rows, [r.params for r in group])
        greedy = all(r.params.greedy for r in group)
        feats = self._prefill(group, ids, greedy)
        for i, (req, rid) in enumerate(zip(group, ids)):
            hidden = None if feats is None else torch.cat(feats[i])
            drafter.add_request(rid, req.prompt, req.params, req.k, target_hidden=hidden)
        hidden_in = None
        if feats is not None:  # the last prompt row predicted the first token
            hidden_in = torch.stack([f[-1][-1:] for f in feats])  # [B, 1, h]
        dev = runner.device
        rows_t = self._upload_index(rows)
        first = runner.last_token.index_select(0, rows_t)  # the target's first tokens
        runner.committed.index_copy_(0, rows_t, self._upload_index([len(r.prompt) for r in group]))
        verified = first[:, None].clone()  # a one-row verified block: the first token
        accepted = torch.zeros(len(group), dtype=torch.int32, device=dev)
        pending = self._readback_first(first)
        active = list(range(len(group)))  # positions in `group` of the batch rows
        unchecked = 0  # steps that may run before a request can need another block
        # the batch as in the step before: its verify rows are on the device and the last
        # step wrote this round's inputs where the drafter reads them
        settled = False
        batch = None
        while active:
            # Every running request may reach max_new_tokens in the step in flight: wait
            # for its readback instead of launching a step that would most likely be
            # thrown away (the readback is one step late). Only on a settled batch, whose
            # rows are the in-flight step's rows (the gather below indexes both alike),
            # and once per step in flight.
            tail = (
                settled
                and pending is not None
                and all(len(group[i].output) + w >= group[i].max_new_tokens for i in active)
            )
            if tail:
                self._process(group, *pending, stream)
                pending = None
            else:
                if batch is None:  # the batch changed: its lists once, not every step
                    batch = [group[i] for i in active]
                    batch_ids = [ids[i] for i in active]
                    batch_rows = [rows[i] for i in active]
                    ks = [r.k for r in batch]
                if unchecked <= 0:
                    unchecked = self._grow(batch, batch_ids)
                unchecked -= 1
                b = len(batch)
                d_in = self._drafter_views(b) if settled else (verified, accepted, hidden_in)
                proposal = drafter.propose(
                    batch_ids, d_in[0], d_in[1], k=ks, k_max=k, target_hidden=d_in[2]
                )
                slot = self._next_host  # the pinned slot this step's tokens go to
                if settled and self.step_graphs:  # its graph copies them there itself
                    out, copied = self._steady_step(b, greedy, proposal, slot), True
                else:
                    out = self._step_body(b, proposal, verified, accepted, rows=batch_rows)
                    copied = False
                prev, pending = pending, (*self._readback_stage(b, copied), list(active))
                if prev is not None:
                    self._process(group, *prev, stream)
            # next step: the requests still running, their verified rows gathered
            keep = [j for j, i in enumerate(active) if not group[i].finished]
            if len(keep) != len(active):
                verified, accepted, hidden_in = self._keep(group, ids, active, keep, out, b)
                active = [active[j] for j in keep]
                settled = False
                batch = None
            else:
                settled = True
                # Views, no copies: the next propose() and verify_first read them before
                # the rejection sampler and the verification overwrite their buffers.
                verified, accepted = out.tokens, out.num_accepted
        if pending is not None:
            self._process(group, *pending, stream)
        self.rejection_counters()

    def _keep(self, group, ids, active, keep, out, b: int):
        """Drop the finished requests; the verified rows, accepted counts and (EAGLE)
        target states of the kept ones, gathered from the last step's outputs."""
        for i in active:
            if group[i].finished:
                self._drop(ids[i])
        if not keep:
            return None, None, None
        idx = self._upload_index(keep)
        verified = out.tokens.index_select(0, idx)  # index_select makes copies
        accepted = out.num_accepted.index_select(0, idx)
        hidden_in = None
        if self.eagle:  # the state at verify row j predicted the token after it
            w = self.k + 1
            hidden_in = self.runner.last_features.view(b, w, -1).index_select(0, idx)
        return verified, accepted, hidden_in

    def _grow(self, batch: list[_Req], batch_ids: list[int]) -> int:
        """Blocks by upper bound before a step: a request's committed length is at most
        its read-back tokens plus one step in flight (w each), and this step adds w more.
        A request that needs blocks gets one block more than that (up to its longest
        possible length), so growth comes every few steps, not every step. Returns how
        many steps may run before any request can need a block again (each step adds at
        most w tokens)."""
        tables, w = self.runner.tables, self.k + 1
        steps = None
        for req, rid in zip(batch, batch_ids):
            need = len(req.prompt) + len(req.output) + 2 * w
            if need > req.capacity:  # need <= the longest length, so want >= need
                want = min(need + tables.block_size, len(req.prompt) + req.max_new_tokens + 2 * w)
                if not tables.grow(rid, want):
                    raise RuntimeError(
                        f"the target's KV cache is out of blocks for request {req.index}"
                    )
                req.capacity = tables.capacity_of(rid)
            margin = (req.capacity - need) // w + 1  # this step, then `margin - 1` more
            steps = margin if steps is None else min(steps, margin)
        return steps or 1

    def _prefill(self, group: list[_Req], ids: list[int], greedy: bool):
        """The prompts through the target in chunks under the token budget; the last
        chunk of each prompt samples the request's first token (runner.last_token). For
        EAGLE drafts returns each request's target features, chunk by chunk."""
        budget = self.runner.limits.max_num_tokens
        done = [0] * len(group)
        feats = [[] for _ in group] if self.eagle else None
        while any(d < len(r.prompt) for d, r in zip(done, group)):
            sched, spans, used = [], [], 0
            for i, r in enumerate(group):
                n = min(len(r.prompt) - done[i], budget - used)
                if n > 0:
                    sched.append((ids[i], r.prompt[done[i] : done[i] + n], done[i]))
                    spans.append((i, used, n))
                    done[i] += n
                    used += n
            batch = ScheduledBatch.from_requests(sched)
            self.runner.execute(batch, greedy=greedy, features=feats is not None)
            if feats is not None:
                for i, start, n in spans:
                    feats[i].append(self.runner.last_features[start : start + n].clone())
        return feats

    # ---- steady steps -----------------------------------------------------------------

    def _step_body(self, b: int, proposal, verified, accepted, rows: list[int]):
        """A step of a batch that changed (or the first): the last emitted token and the
        drafts into the target's verify inputs, verification through execute_verify
        (which uploads the requests' rows and replays its graph when one fits), the
        positions of draft 0, then `_after_verify`. Returns the sampler's output."""
        runner, k = self.runner, self.k
        runner.verify_first[:b].copy_(verified.gather(1, accepted.long()[:, None])[:, 0])
        self._drafts_in(b, proposal)
        logits = runner.execute_verify(b, k, rows=rows)
        feats = runner.last_features if self.eagle else None
        vrows = runner.verify_rows[:b]
        self._positions[:b].copy_(runner.committed.index_select(0, vrows) + 1)
        return self._after_verify(b, proposal, logits, feats)

    def _drafts_in(self, b: int, proposal) -> None:
        """The drafts into the verification's inputs: already there when verification
        reads the drafter's own table (the proposal is its first rows)."""
        drafts = self.runner.verify_drafts
        if not (
            self._drafts_shared
            and proposal.tokens.data_ptr() == drafts.data_ptr()
            and proposal.tokens.stride() == drafts.stride()
        ):
            drafts[:b, : self.k].copy_(proposal.tokens)

    def _after_verify(self, b: int, proposal, logits, feats, slot: int | None = None):
        """Rejection sampling, then the bookkeeping in one launch (kernels/commit.py):
        committed lengths, the emitted tokens and counts into the stage, and the next
        step's inputs where their readers find them (the drafter's verified block and
        accepted counts, the target's verify_first, the positions of the next draft 0),
        plus the features into the drafter's hidden-state input. Fixed shapes and no
        host reads: what a step graph captures. With `slot`, the stage is also copied
        into that pinned readback slot (inside the graph: an eager copy after it costs
        ~15 µs of host time and a gap on the GPU). Returns the sampler's output."""
        runner, w = self.runner, self.k + 1
        vrows = runner.verify_rows[:b]
        table = runner.sampling
        # An all-greedy table: the greedy sampler reads no per-request parameter, so the
        # gather of the batch's rows (five launches) is skipped.
        greedy_only = proposal.q is None and table.all_greedy
        params = table if greedy_only else table.select(vrows)
        out = self.rejection(logits, proposal.tokens, proposal.q, params, self._positions[:b])
        ver, acc, hid = self._drafter_views(b)
        commit = kernels.commit_step
        if ops.backend_for(out.tokens) != "triton":
            commit = kernels.commit_step_torch
        commit(out.tokens, out.num_accepted, out.num_emitted, vrows, runner.committed,
               self._stage, runner.verify_first, ver, acc, self._positions)  # fmt: skip
        if hid is not None:
            hid.copy_(feats.view(b, w, -1))
        if slot is not None:
            host, dev, _ = self._stage_view(slot, b)
            host.copy_(dev, non_blocking=True)
        return out

    def _drafter_views(self, b: int):
        views = self._d_views.get(b)
        if views is None:
            views = self._d_views[b] = self.drafter.input_views(b, self.k + 1)
        return views

    def _steady_step(self, b: int, greedy: bool, proposal, slot: int):
        """A step of the batch of the step before: its verify rows, verify_first and
        the drafter's inputs are on the device already. The drafts go into the verify
        inputs, verification replays the target's graph for this size (captured at
        start-up, padded requests writing nothing), and everything after it is one
        small graph replay. The first step for a key (batch size, sampling flags, the
        addresses read) runs that part eagerly and captures it for the next; the cache
        keeps the last few keys. The graph also copies the step's tokens into pinned
        readback slot `slot` (one graph per slot). (A single graph over the whole step
        would be captured per batch size while the batch runs, at the price of a full
        verification capture each time a request leaves.)"""
        runner, k = self.runner, self.k
        self._drafts_in(b, proposal)
        logits, feats = runner.replay_verify(b, k)
        q = proposal.q
        table = runner.sampling  # its host flags pick the sampler's launches
        key = (
            (b, greedy, table.any_filter, table.all_greedy, runner.generation, slot),
            (proposal.tokens.data_ptr(), 0 if q is None else q.data_ptr()),
            (logits.data_ptr(), 0 if feats is None else feats.data_ptr()),
        )
        g = self._steps.get(key)
        if g is not None:
            self._steps.move_to_end(key)
            fresh = self._backend.replay(g.graph)  # a stand-in's own outputs, or None
            out = g.out if fresh is None else fresh
        else:
            eager = not self._backend.executes_on_capture
            if eager:  # this step's work; a capture then only records
                out = self._after_verify(b, proposal, logits, feats, slot)
            if len(self._steps) >= _MAX_STEP_GRAPHS:
                self._steps.popitem(last=False)
            t0 = time.perf_counter()
            with torch.no_grad():
                graph, g_out = self._backend.capture(
                    lambda: self._after_verify(b, proposal, logits, feats, slot), self._pool()
                )
            self.stats.captures += 1
            self.stats.capture_seconds += time.perf_counter() - t0
            self._steps[key] = _StepGraph(graph, g_out)
            if not eager:
                out = g_out
        self.graph_steps += 1
        return out

    def _pool(self):
        if self.runner.device.type != "cuda":
            return None
        from .cuda_graph import shared_graph_pool

        return shared_graph_pool()

    def _stage_view(self, i: int, b: int):
        """(pinned slot i's first b rows, the device stage's, their (tokens, counts))."""
        views = self._stage_views.get((i, b))
        if views is None:
            host = self._host_stage[i][:b]
            views = (host, self._stage[:b], (host[:, : self.k + 1], host[:, self.k + 1]))
            self._stage_views[(i, b)] = views
        return views

    def _readback_stage(self, b: int, copied: bool = False):
        """The step's staged tokens and counts into pinned memory (one copy; `copied`:
        the step graph made it) and a reusable event after it; the slot is read (and
        waited for) two steps before it comes round again."""
        i = self._next_host
        self._next_host = (i + 1) % len(self._host_stage)
        host, dev, payload = self._stage_view(i, b)
        if not copied:
            host.copy_(dev, non_blocking=True)
        event = self._stage_events[i]
        if event is not None:
            event.record(self._stream())
        return event, payload

    def _readback_first(self, first: torch.Tensor):
        toks = torch.empty((first.shape[0], 1), dtype=torch.int64, pin_memory=first.is_cuda)
        toks.copy_(first[:, None], non_blocking=True)
        counts = torch.ones(first.shape[0], dtype=torch.int32)
        return self._event(), (toks, counts), list(range(first.shape[0]))

    def _upload_index(self, values: list[int]) -> torch.Tensor:
        """A device int64 index from host ints through pinned memory (no sync)."""
        slot, host = self._index_ring.acquire()
        host[: len(values)] = torch.as_tensor(values, dtype=torch.int64)
        dst = torch.empty(len(values), dtype=torch.int64, device=self.runner.device)
        self._index_ring.copy_to(slot, dst, len(values))
        return dst

    def _event(self):
        if self.runner.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record(self._stream())
        return ev

    def _process(self, group, event, payload, active, stream) -> None:
        """Tokens of a step read one step late: append, stop at a stop id or at
        max_new_tokens (truncating inside the accepted block)."""
        if event is not None:
            event.synchronize()
        toks, counts = payload
        toks, counts = toks.tolist(), counts.tolist()
        self.stats.steps += 1
        for j, i in enumerate(active):
            req = group[i]
            if req.finished:
                continue
            for t in toks[j][: counts[j]]:
                req.output.append(t)
                piece = str(t) if stream is not None and self.tokenizer is None else None
                if t in req.stop_ids:
                    req.finished = "stop"
                elif len(req.output) >= req.max_new_tokens:
                    req.finished = "length"
                if stream is not None and self.tokenizer is not None:
                    piece = self.tokenizer.decode([t], skip_special_tokens=True)
                if stream is not None and piece:
                    stream(req.index, piece)
                if req.finished:
                    break

    def rejection_counters(self) -> None:
        """Fold the sampler's device counters into stats (a sync: call between groups)."""
        host = self.rejection.counters_to_host()
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()
        for j in range(self.k):
            self.stats.proposed[j] += int(host[0, j])
            self.stats.accepted[j] += int(host[1, j])
        self.rejection.reset_counters()

    def _drop(self, rid: int) -> None:
        self.runner.remove_request(rid)
        self.drafter.remove_request(rid)

    def _new_id(self) -> int:
        self._count += 1
        return self._count
