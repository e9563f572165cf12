"""generate(): prompts in, tokens and text out, over the target runner.

The engine loop (`Engine.step`) schedules decode rows and prefill chunks under a token
budget, allocates KV blocks for what it schedules before the step (preempting the newest
request when blocks run out: its blocks are freed and it is prefilled again later),
launches the step, and only then reads the tokens of the previous step through pinned
memory. Stop checks, streaming and bookkeeping therefore run one step late and the host
never waits for the step it has just launched. Requests join (`add_request`) and finish
at any step. While the decode batch repeats unchanged, a step is one call,
runner.decode_next (the steady path; see _Steady).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .batch import ScheduledBatch
from .runner import Readback, TargetRunner, device_token
from .sampling import SamplingParams, SeedSource

logger = logging.getLogger(__name__)

StreamCallback = Callable[[int, str], None]
GREEDY = SamplingParams(temperature=0.0)  # the default, as in transformers


@dataclass
class GenerationOutput:
    """One request's result. token_ids includes a stop token that ended it; text does
    not (special tokens are skipped)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" or "length"
    logprobs: list[float] | None = None


@dataclass
class _Request:
    index: int
    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int]
    want_logprobs: bool
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V the launched steps write
    launched: int = 0  # sampled tokens launched (read back or not)
    pending: int = 0  # sampled tokens launched and not read back yet
    finished: str | None = None
    capacity: int = 0  # tokens its KV blocks cover (0 while it holds none)
    decoder: object | None = None
    text: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class _Steady:
    """A decode batch that repeats unchanged: while it does, a step is one replay
    (runner.decode_next) and no per-request work. The requests' counters lag by `lag`
    steps (num_computed, launched and pending each lack `lag`) until _fold() adds it."""

    reqs: list[_Request]
    rows: list[tuple[_Request, bool]]  # what _process reads, the same every step
    greedy: bool
    room: int  # steps before a request's blocks or max_new_tokens run out
    lag: int = 0


class Engine:
    """A target model with its runner and tokenizer. `generate` runs a list of prompts
    to completion; `add_request` / `step` / `has_work` drive continuous batching."""

    def __init__(self, runner: TargetRunner, tokenizer=None, *, seed: int | None = None):
        self.runner = runner
        self.tokenizer = tokenizer
        self.seeds = SeedSource(seed)
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.finished: dict[int, _Request] = {}
        self._ids = itertools.count()
        self._prev: tuple[Readback, list[tuple[_Request, bool]]] | None = None
        self._stream: StreamCallback | None = None
        self.preemptions = 0
        self.vocab_size = runner.model.cfg.vocab_size
        # request ids of the last decode-only step, when it was one: an identical next
        # decode step takes the runner's no-upload path
        self._last_decode: tuple[int, ...] | None = None
        self._steady: _Steady | None = None  # the steady decode batch, while there is one
        self._finishing = 0  # finished requests not yet out of `running`

    # ---- requests -------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        *,
        params: SamplingParams | None = None,
        max_new_tokens: int = 64,
        stop_token_ids: Sequence[int] | None = None,
        logprobs: bool = False,
    ) -> int:
        """Queue one request; returns its index. Everything is checked (check_request)
        before the engine's state changes."""
        req = self.check_request(
            prompt,
            params=params,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            logprobs=logprobs,
        )
        req.index = next(self._ids)
        req.params = self.seeds.resolve(req.params)
        if self.tokenizer is not None:
            req.decoder = self.tokenizer.stream_decoder()
        self.waiting.append(req)
        return req.index

    def check_request(
        self,
        prompt: str | Sequence[int],
        *,
        params: SamplingParams | None = None,
        max_new_tokens: int = 64,
        stop_token_ids: Sequence[int] | None = None,
        logprobs: bool = False,
        headroom: int = 0,
    ) -> _Request:
        """A checked, unqueued request (index -1): ValueError / TypeError naming the bad
        argument, nothing changed. headroom: tokens past the output the caller needs
        room for (a speculative step in flight)."""
        ids = self._prompt_ids(prompt)
        params = params if params is not None else GREEDY
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
            raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
        limit = self.runner.limits.max_model_len
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(ids) + max_new_tokens + headroom > limit:
            extra = f" + {headroom} in flight" if headroom else ""
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_new_tokens {max_new_tokens}{extra} is over "
                f"max_model_len {limit}"
            )
        stops = self._stop_ids(stop_token_ids)
        return _Request(-1, ids, params, int(max_new_tokens), stops, bool(logprobs))

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but the engine has no tokenizer: pass token ids")
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(prompt)
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise TypeError(
                    f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}"
                ) from None
        if not ids:
            raise ValueError("prompt is empty: it needs at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt holds token id {bad[0]}, outside [0, {self.vocab_size})")
        return ids

    def _stop_ids(self, stop_token_ids) -> frozenset[int]:
        if stop_token_ids is None:
            eos = () if self.tokenizer is None else self.tokenizer.stop_token_ids
            return frozenset(eos)
        stops = []
        for t in stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise TypeError(f"stop_token_ids must hold ints, got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"stop_token_ids holds {t}, outside [0, {self.vocab_size})")
            stops.append(int(t))
        return frozenset(stops)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._prev)

    # ---- the loop -------------------------------------------------------------------

    def step(self) -> None:
        """Schedule and launch one step, then process the previous step's tokens."""
        st = self._steady
        if (
            st is not None
            and st.room > 0
            and (not self.waiting or len(self.running) >= self.runner.limits.max_num_reqs)
        ):
            # The steady path: the same batch one token on, nothing scheduled or uploaded.
            st.room -= 1
            st.lag += 1
            launched = (self.runner.decode_next(greedy=st.greedy), st.rows)
        else:
            self._fold()
            launched = self._launch()
        prev, self._prev = self._prev, launched
        if prev is not None:
            self._process(*prev)

    def _fold(self) -> None:
        """Leave the steady path: bring its requests' counters up to date."""
        st, self._steady = self._steady, None
        if st is not None and st.lag:
            for req in st.reqs:
                req.num_computed += st.lag
                req.launched += st.lag
                req.pending += st.lag

    def _schedule(self) -> list[tuple[_Request, int]]:
        """(request, tokens this step): decode rows first, then prefill chunks."""
        budget = self.runner.limits.max_num_tokens
        max_reqs = self.runner.limits.max_num_reqs
        sched: list[tuple[_Request, int]] = []
        for req in list(self.running):
            if len(sched) >= max_reqs or budget == 0:
                break
            if req.finished or req.launched >= req.max_new_tokens:
                continue
            todo = len(req.prompt) + len(req.output) + req.pending - req.num_computed
            n = min(todo, budget)
            if n > 0:
                sched.append((req, n))
                budget -= n
        rows, params = [], []
        while self.waiting and len(self.running) < max_reqs and budget > 0:
            req = self.waiting[0]
            if req.pending:  # preempted with a token still in flight: wait for it
                break
            if not self._admit(req):
                break
            rows.append(self.runner.tables.row_of(req.index))
            params.append(req.params)
            self.waiting.popleft()
            self.running.append(req)
            n = min(len(req.tokens), budget)
            sched.append((req, n))
            budget -= n
        if rows:  # every admitted request's sampling row in one copy
            self.runner.sampling.write_rows(rows, params)
        return sched

    def _admit(self, req: _Request) -> bool:
        tables = self.runner.tables
        need = -(-(len(req.tokens) + 1) // tables.block_size)
        if tables.num_free_blocks < need or len(tables) >= tables.max_num_reqs:
            return False
        tables.add_request(req.index, 1)
        req.capacity = tables.capacity_of(req.index)
        return True

    def _reserve(self, sched: list[tuple[_Request, int]]) -> list[tuple[_Request, int]]:
        """Grow every scheduled request to cover its step; while blocks run out, preempt
        the newest running request that is not already kept for this step. When any
        request grew, every kept one is topped up one block past its step where blocks
        are free (never preempting for it): growth and its block-table upload then come
        about once per block_size steps for the whole batch, not every few steps."""
        tables = self.runner.tables
        kept: list[tuple[_Request, int]] = []
        dropped: set[int] = set()
        grew = False
        for req, n in sched:
            need = req.num_computed + n
            if need <= req.capacity:  # the usual decode step: its blocks already cover it
                kept.append((req, n))
                continue
            if req.index in dropped:
                continue
            while not tables.grow(req.index, need):
                keep = {r.index for r, _ in kept} | {req.index}
                victim = next(
                    (r for r in reversed(self.running) if r.index not in keep and not r.finished),
                    None,
                )
                if victim is None:
                    raise RuntimeError(
                        f"the KV cache ({tables.allocator.num_blocks} blocks) cannot hold "
                        f"request {req.index} at {req.num_computed + n} tokens"
                    )
                self._preempt(victim)
                dropped.add(victim.index)
            req.capacity = tables.capacity_of(req.index)
            kept.append((req, n))
            grew = True
        if grew and not dropped:
            for req, n in kept:
                want = req.num_computed + n + tables.block_size
                want = min(want, len(req.prompt) + req.max_new_tokens)
                if want > req.capacity and tables.grow(req.index, want):
                    req.capacity = tables.capacity_of(req.index)
        return kept

    def _preempt(self, req: _Request) -> None:
        self.preemptions += 1
        self.runner.remove_request(req.index)
        self.running.remove(req)
        req.num_computed = req.capacity = 0
        self.waiting.appendleft(req)
        logger.info("preempted request %d (%d tokens)", req.index, len(req.tokens))

    def _launch(self) -> tuple[Readback, list[tuple[_Request, bool]]] | None:
        sched = self._reserve(self._schedule())
        if not sched:
            self._last_decode = None
            return None
        greedy = decode = True  # one pass over the batch (this runs every step)
        indices = []
        for req, n in sched:
            indices.append(req.index)
            if greedy and (req.want_logprobs or not req.params.greedy):
                greedy = False
            if decode and (n != 1 or req.num_computed < len(req.prompt) + len(req.output)):
                decode = False
        ids_now = tuple(indices)
        if decode and ids_now == self._last_decode:
            # The same decode batch one token on: nothing to upload.
            handle = self.runner.decode_next(greedy=greedy)
        else:
            r = self._execute(sched, greedy)
            handle = self.runner.readback(r, with_logprobs=not greedy)
        self._last_decode = ids_now if decode else None
        rows = []
        for req, n in sched:
            req.num_computed += n
            samples = req.num_computed >= len(req.prompt) + len(req.output) + req.pending
            if samples:
                req.launched += 1
                req.pending += 1
            rows.append((req, samples))
        if decode:
            # Steps this batch can repeat unchanged: until a request's blocks or its
            # max_new_tokens run out (a finished request or a new one ends it earlier).
            room = min(
                min(r.capacity - r.num_computed, r.max_new_tokens - r.launched) for r, _ in sched
            )
            reqs = [r for r, _ in sched]
            self._steady = _Steady(reqs, rows, greedy, room) if room > 0 else None
        return handle, rows

    def _execute(self, sched: list[tuple[_Request, int]], greedy: bool) -> int:
        tables = self.runner.tables
        ids: list[int] = []
        counts, starts = [], []
        for req, n in sched:
            start = req.num_computed
            known = len(req.prompt) + len(req.output)
            if start >= known:  # the input is the token the last step sampled
                chunk = [device_token(tables.row_of(req.index))]
            else:
                chunk = req.tokens[start : start + n]
                if len(chunk) < n:  # ends with the in-flight token
                    chunk.append(device_token(tables.row_of(req.index)))
            ids.extend(chunk)
            counts.append(n)
            starts.append(start)
        batch = ScheduledBatch(
            [req.index for req, _ in sched],
            np.asarray(ids, dtype=np.int64),
            np.asarray(counts, dtype=np.int64),
            np.asarray(starts, dtype=np.int64),
        )
        return self.runner.execute(batch, greedy=greedy)

    def _process(self, handle: Readback, rows: list[tuple[_Request, bool]]) -> None:
        toks, lps = handle.wait()
        for i, (req, samples) in enumerate(rows):
            if not samples:
                continue
            req.pending -= 1
            if req.finished:
                continue
            tok = toks[i]
            req.output.append(tok)
            if req.want_logprobs and lps is not None:
                req.logprobs.append(lps[i])
            if tok in req.stop_ids:
                self._finish(req, "stop")
            elif len(req.output) >= req.max_new_tokens:
                self._finish(req, "length")
            elif req.decoder is not None and self._stream is not None:
                piece = req.decoder.push(tok)
                if piece:
                    self._stream(req.index, piece)
        if not self._finishing:
            return
        self._fold()  # the batch changes: counters first, then the leaving check
        # A finished request leaves once nothing of it is in flight.
        for req in [r for r in self.running if r.finished and r.pending == 0]:
            self.running.remove(req)
            self.runner.remove_request(req.index)
            self.finished[req.index] = req
            self._finishing -= 1

    def _finish(self, req: _Request, reason: str) -> None:
        req.finished = reason
        self._finishing += 1  # finished requests still in `running`
        if req.decoder is not None and self._stream is not None:
            if reason == "length":
                piece = req.decoder.push(req.output[-1]) + req.decoder.flush()
            else:
                piece = req.decoder.flush()
            if piece:
                self._stream(req.index, piece)

    # ---- generate -------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        max_new_tokens: int = 64,
        stop_token_ids: Sequence[int] | None = None,
        logprobs: bool = False,
        stream: StreamCallback | None = None,
    ) -> list[GenerationOutput]:
        """Run `prompts` to completion (continuous batching over max_num_reqs rows).
        params: one SamplingParams for all, or one per prompt (default greedy).
        stream(prompt_index, new_text) receives detokenized text as it is read back."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a list of prompts (text or token-id lists)")
        if not prompts:
            raise ValueError("prompts is empty")
        if params is None or isinstance(params, SamplingParams):
            per = [params] * len(prompts)
        else:
            per = list(params)
            if len(per) != len(prompts):
                raise ValueError(f"params has {len(per)} entries for {len(prompts)} prompts")
        if self.has_work():
            raise RuntimeError("generate() needs an idle engine; finish the running requests")
        # Check every request before queueing any: a bad one leaves the engine idle.
        for p, sp in zip(prompts, per):
            self.check_request(
                p,
                params=sp,
                max_new_tokens=max_new_tokens,
                stop_token_ids=stop_token_ids,
                logprobs=logprobs,
            )
        first = None
        for p, sp in zip(prompts, per):
            idx = self.add_request(
                p,
                params=sp,
                max_new_tokens=max_new_tokens,
                stop_token_ids=stop_token_ids,
                logprobs=logprobs,
            )
            first = idx if first is None else first
        self._stream = None
        if stream is not None:
            self._stream = lambda idx, text: stream(idx - first, text)
        try:
            while self.has_work():
                self.step()
        finally:
            self._stream = None
        out = []
        for i in range(first, first + len(prompts)):
            req = self.finished.pop(i)
            text = None
            if self.tokenizer is not None:
                text = self.tokenizer.decode(req.output, skip_special_tokens=True)
            out.append(
                GenerationOutput(
                    req.prompt,
                    req.output,
                    text,
                    req.finished,
                    req.logprobs if req.want_logprobs else None,
                )
            )
        return out


def timed_generate(engine, prompts, **kw) -> tuple[list[GenerationOutput], float]:
    """engine.generate() (an Engine or a SpeculativeEngine) and its wall time in seconds,
    the device drained at both ends."""
    import torch

    cuda = engine.runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate(prompts, **kw)
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0
