"""Self-distillation data for an EAGLE-1 draft head: the target writes its own answers
to the training prompts with specdraft's batched Engine (several samples per prompt at
a temperature, each with its own seed, plus the greedy answer), then a dense forward of
the target gives its features (final hidden states) at every position of prompt and
answer. Everything lives in flat tensors on the target's device.

Prompts come from the shipped list and, optionally, from the target itself: sampled at
temperature 1 from the chat template opened at the user turn (`user_turn_opener`,
`write_self_prompts`), kept when they end at the end-of-turn token and are new
(`keep_self_prompts`: no empty, unfinished or duplicate text, no word 8-gram shared with
the held-out prompts). Answer writing can stop at a time budget (`write_samples`)."""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from .dense import target_hidden
from .generate import Engine, GenerationOutput
from .models.llama import LlamaForCausalLM
from .sampling import SamplingParams

logger = logging.getLogger(__name__)

_SEED_LIMIT = 2**31 - 1
_USER_MARK = "\ue000specdraft-user-text\ue000"  # private-use characters: no template has them


@dataclass
class Sample:
    """One sequence the target wrote: prompt ids then its answer. seed None: greedy."""

    prompt_index: int
    tokens: list[int]
    prompt_len: int
    seed: int | None


def chat_ids(tokenizer, prompts: Sequence[str]) -> list[list[int]]:
    """Each prompt as one user turn of the tokenizer's chat template, ready for the
    assistant's answer, as token ids."""
    out = []
    for p in prompts:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True
        )
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def words(text: str) -> list[str]:
    """The lower-cased words of `text` (runs of \\w): the tokenization of the 8-gram check
    between training and held-out prompts (tests/test_prompts.py)."""
    return re.findall(r"\w+", text.lower())


def word_ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def user_turn_opener(tokenizer) -> list[int]:
    """The ids the chat template puts before a user's words when the user opens the
    chat: everything it renders ahead of the user's text (for SmolLM2 its default
    system turn, then the user header). The target continues it to write a user turn."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _USER_MARK}], add_generation_prompt=False
    )
    at = text.find(_USER_MARK)
    if at < 0:
        raise ValueError("the chat template does not write the user's text verbatim")
    ids = tokenizer.encode(text[:at], add_special_tokens=False)
    if not ids:
        raise ValueError("the chat template writes nothing before the user's text")
    return ids


def write_self_prompts(
    engine: Engine,
    opener: Sequence[int],
    n: int,
    *,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    max_seconds: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[GenerationOutput]:
    """Up to n user turns the target writes itself: `opener` (user_turn_opener)
    continued at `temperature` with distinct seeds drawn from `seed`, batched on the
    Engine, each stopped at the stop ids (the tokenizer's end of turn by default) or
    after max_new_tokens. With max_seconds, as write_samples: no new turn is started
    after that many seconds, the ones under way are finished (fewer than n come back)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    rng = random.Random(seed)
    groups = [
        [
            engine.check_request(
                opener,
                params=SamplingParams(temperature, seed=s),
                max_new_tokens=max_new_tokens,
                stop_token_ids=stop_token_ids,
            )
        ]
        for s in rng.sample(range(_SEED_LIMIT), n)
    ]
    t0 = clock()
    done = _run_groups(engine, groups, max_seconds, clock, "target writes user turns", "turns")
    secs = clock() - t0
    tok = engine.tokenizer
    outs = [
        GenerationOutput(
            list(r.prompt),
            list(r.output),
            None if tok is None else tok.decode(r.output, skip_special_tokens=True),
            r.finished,
        )
        for (r,) in done
    ]
    toks = sum(len(o.token_ids) for o in outs)
    logger.info(
        "target wrote %d of %d user turns: %d tokens in %.1f s (%.0f tokens/s)%s",
        len(outs),
        n,
        toks,
        secs,
        toks / max(secs, 1e-9),
        f"; time budget of {max_seconds:.0f} s reached" if len(outs) < n else "",
    )
    return outs


DROP_REASONS = ("unfinished", "special", "empty", "duplicate", "heldout")


def keep_self_prompts(
    outputs: Iterable[GenerationOutput],
    decode: Callable[[list[int]], str],
    *,
    stop_ids: Collection[int],
    special_ids: Collection[int] = (),
    known: Iterable[str] = (),
    heldout: Iterable[str] = (),
    n: int = 8,
) -> tuple[list[str], dict[str, int]]:
    """The self-written user turns worth answering, in order, and how many were dropped
    for each reason (DROP_REASONS): unfinished (no stop token at the end: cut at
    max_new_tokens), special (another special token inside the text), empty (no word
    once decoded and stripped), duplicate (the same words as an earlier one or as a
    `known` prompt), heldout (the same words as a held-out prompt, or a word n-gram
    shared with one). decode: token ids (the stop token removed) to text."""
    stop_ids, special_ids = frozenset(stop_ids), frozenset(special_ids)
    held = list(heldout)
    held_grams = set().union(*(word_ngrams(p, n) for p in held)) if held else set()
    held_words = {tuple(words(p)) for p in held}
    seen = {tuple(words(p)) for p in known}
    kept: list[str] = []
    dropped = dict.fromkeys(DROP_REASONS, 0)
    for o in outputs:
        ids = list(o.token_ids)
        if o.finish_reason != "stop" or not ids or ids[-1] not in stop_ids:
            dropped["unfinished"] += 1
            continue
        body = ids[:-1]
        if any(t in special_ids or t in stop_ids for t in body):
            dropped["special"] += 1
            continue
        text = decode(body).strip()
        key = tuple(words(text))
        if not key:
            dropped["empty"] += 1
            continue
        if key in held_words or word_ngrams(text, n) & held_grams:
            dropped["heldout"] += 1
            continue
        if key in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(key)
        kept.append(text)
    return kept, dropped


def _progress(total: int, desc: str, unit: str):
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are a convenience, not a requirement
        return None
    return tqdm(total=total, desc=desc, unit=unit, disable=not logger.isEnabledFor(logging.INFO))


def write_samples(
    engine: Engine,
    prompt_ids: Sequence[Sequence[int]],
    *,
    samples_per_prompt: int,
    greedy: bool = True,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    seed: int = 0,
    max_seconds: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[Sample]:
    """The target's answers to the prompts (continuous batching): the greedy answer
    when `greedy`, and `samples_per_prompt` answers sampled at `temperature` with
    distinct seeds drawn from `seed`. Stops at the tokenizer's stop ids; an answer that
    would not fit max_model_len gets fewer than max_new_tokens.

    The greedy answers to every prompt come first (in prompt order), then the sampled
    ones (prompt by prompt, a prompt's samples together): the text a greedy evaluation
    sees, for as many prompts as possible, before more of the same prompts. Requests are
    queued as rows free up. With max_seconds, nothing new is queued once that many
    seconds have passed since the call (the first fill of the rows is always queued);
    what was queued is finished and returned, in the order above."""
    rng = random.Random(seed)
    seeds = iter(rng.sample(range(_SEED_LIMIT), len(prompt_ids) * samples_per_prompt))
    plan: list[list[tuple[int, int | None]]] = []  # groups of (prompt, seed or None)
    sampled = [
        [(i, next(seeds)) for _ in range(samples_per_prompt)] for i in range(len(prompt_ids))
    ]
    if greedy:
        plan.extend([(i, None)] for i in range(len(prompt_ids)))
    if samples_per_prompt:
        plan.extend(sampled)
    if not plan:
        raise ValueError(
            "no samples to write: no prompts, or samples_per_prompt is 0 and greedy is off"
        )
    limit = engine.runner.limits.max_model_len
    requests = []  # per group: the checked requests of its answers
    for row in plan:
        reqs = []
        for i, s in row:
            params = (
                SamplingParams(temperature=0.0)
                if s is None
                else SamplingParams(temperature, seed=s)
            )
            room = min(max_new_tokens, limit - len(prompt_ids[i]))
            reqs.append(
                engine.check_request(prompt_ids[i], params=params, max_new_tokens=max(1, room))
            )
        requests.append(reqs)
    t0 = clock()
    done = _run_groups(engine, requests, max_seconds, clock, "target writes its answers", "answers")
    out = []
    for row, reqs in zip(plan, done):
        for (i, s), req in zip(row, reqs):
            out.append(Sample(i, list(req.prompt) + list(req.output), len(req.prompt), s))
    secs = clock() - t0
    new = sum(len(x.tokens) - x.prompt_len for x in out)
    n_greedy = sum(x.seed is None for x in out)
    logger.info(
        "target wrote %d greedy and %d sampled answers to %d prompts: %d new tokens in "
        "%.1f s (%.0f tokens/s)%s",
        n_greedy,
        len(out) - n_greedy,
        len({x.prompt_index for x in out}),
        new,
        secs,
        new / max(secs, 1e-9),
        f"; time budget of {max_seconds:.0f} s reached" if len(done) < len(plan) else "",
    )
    return out


def _run_groups(engine: Engine, groups, max_seconds, clock, desc: str, unit: str) -> list:
    """Run groups of checked requests (Engine.check_request) on an idle engine, each
    group queued at once, groups queued in order as rows free up (enough waiting to
    fill every row the next step may free). With max_seconds, no group is queued once
    that many seconds have passed (the first fill is always queued) and the queued ones
    are finished. Returns the finished requests of the groups queued, in order."""
    if max_seconds is not None and not max_seconds >= 0:
        raise ValueError(f"max_seconds must be >= 0 or None, got {max_seconds!r}")
    if engine.has_work():
        raise RuntimeError("the engine must be idle; finish the running requests")
    t0 = clock()
    rows = engine.runner.limits.max_num_reqs
    width = max(map(len, groups), default=0)
    queued: list[list[int]] = []  # engine indices per queued group
    bar = _progress(sum(map(len, groups)), desc, unit)
    done, steps, cut = 0, 0, False
    while True:
        while (
            not cut
            and len(queued) < len(groups)
            and len(engine.waiting) + len(engine.running) < rows + width
        ):
            if steps and max_seconds is not None and clock() - t0 >= max_seconds:
                cut = True
                break
            queued.append(
                [
                    engine.add_request(
                        r.prompt,
                        params=r.params,
                        max_new_tokens=r.max_new_tokens,
                        stop_token_ids=sorted(r.stop_ids),
                    )
                    for r in groups[len(queued)]
                ]
            )
        if not engine.has_work():
            break
        engine.step()
        steps += 1
        if bar is not None and len(engine.finished) != done:
            bar.update(len(engine.finished) - done)
            done = len(engine.finished)
    if bar is not None:
        bar.close()
    return [[engine.finished.pop(idx) for idx in idxs] for idxs in queued]


class DistillSet:
    """Token ids [N], features [N, h] (the target's final hidden states) and per
    sequence start, length and prompt length, on one device."""

    def __init__(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        starts: torch.Tensor,
        lengths: torch.Tensor,
        prompt_lens: torch.Tensor,
    ):
        self.tokens, self.features = tokens, features
        self.starts, self.lengths, self.prompt_lens = starts, lengths, prompt_lens

    @classmethod
    def from_samples(
        cls, model: LlamaForCausalLM, samples: Sequence[Sample], *, batch_tokens: int = 16384
    ) -> DistillSet:
        """Features of every sample from dense target forwards over length-sorted,
        right-padded batches of at most ~batch_tokens tokens."""
        dev = model.embed_tokens.weight.device
        lengths = [len(s.tokens) for s in samples]
        if not samples or min(lengths) < 2:
            raise ValueError("samples must be non-empty sequences of at least 2 tokens")
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        flat = torch.tensor([t for s in samples for t in s.tokens], dtype=torch.int64)
        feats = torch.empty(len(flat), model.cfg.hidden_size, dtype=model.dtype, device=dev)
        order = sorted(range(len(samples)), key=lambda i: -lengths[i])
        bar = _progress(len(flat), "target features", "tok")
        pos = 0
        while pos < len(order):
            width = lengths[order[pos]]
            take = order[pos : pos + max(1, batch_tokens // width)]
            ids = torch.zeros(len(take), width, dtype=torch.int64)
            for r, i in enumerate(take):
                ids[r, : lengths[i]] = torch.tensor(samples[i].tokens)
            hidden = target_hidden(model, ids.to(dev))
            for r, i in enumerate(take):
                feats[starts[i] : starts[i] + lengths[i]] = hidden[r, : lengths[i]]
            if bar is not None:
                bar.update(sum(lengths[i] for i in take))
            pos += len(take)
        if bar is not None:
            bar.close()
        as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)
        prompt_lens = [s.prompt_len for s in samples]
        return cls(flat.to(dev), feats, as_t(starts), as_t(lengths), as_t(prompt_lens))

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_answer_tokens(self) -> int:
        return int((self.lengths - self.prompt_lens).sum())

    def batch(self, index: torch.Tensor):
        """Sequences `index` right-padded: (ids [B, T] int64, features [B, T, h],
        lengths [B], prompt_lens [B]); padding rows hold token 0 and zero features."""
        lengths = self.lengths[index]
        width = int(lengths.max())
        cols = torch.arange(width, device=lengths.device)
        valid = cols[None, :] < lengths[:, None]
        at = torch.where(valid, self.starts[index][:, None] + cols[None, :], 0)
        ids = torch.where(valid, self.tokens[at], 0)
        feats = self.features[at] * valid[..., None].to(self.features.dtype)
        return ids, feats, lengths, self.prompt_lens[index]
