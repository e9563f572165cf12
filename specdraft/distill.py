"""Self-distillation data for an EAGLE-1 draft head: the target writes its own answers
to the training prompts with specdraft's batched Engine (several samples per prompt at
a temperature, each with its own seed, plus the greedy answer), then a dense forward of
the target gives its features (final hidden states) at every position of prompt and
answer. Everything lives in flat tensors on the target's device."""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .dense import target_hidden
from .generate import Engine
from .models.llama import LlamaForCausalLM
from .sampling import SamplingParams

logger = logging.getLogger(__name__)

_SEED_LIMIT = 2**31 - 1


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
) -> list[Sample]:
    """The target's answers to every prompt, all queued at once (continuous batching):
    `samples_per_prompt` sampled at `temperature` with distinct seeds drawn from `seed`,
    plus the greedy answer when `greedy`. Stops at the tokenizer's stop ids."""
    rng = random.Random(seed)
    n = len(prompt_ids) * samples_per_prompt
    seeds = iter(rng.sample(range(_SEED_LIMIT), n))
    plan: list[tuple[int, int | None]] = []
    for i in range(len(prompt_ids)):
        if greedy:
            plan.append((i, None))
        plan.extend((i, next(seeds)) for _ in range(samples_per_prompt))
    if not plan:
        raise ValueError("no samples to write: samples_per_prompt is 0 and greedy is off")
    requests = []
    for i, s in plan:
        if s is None:
            params = SamplingParams(temperature=0.0)
        else:
            params = SamplingParams(temperature, seed=s)
        req = engine.check_request(prompt_ids[i], params=params, max_new_tokens=max_new_tokens)
        requests.append(req)
    if engine.has_work():
        raise RuntimeError("write_samples needs an idle engine; finish the running requests")
    first = None
    for req in requests:
        idx = engine.add_request(req.prompt, params=req.params, max_new_tokens=max_new_tokens)
        first = idx if first is None else first
    bar = _progress(len(plan), "target writes its answers", "answers")
    done = 0
    while engine.has_work():
        engine.step()
        if bar is not None and len(engine.finished) != done:
            bar.update(len(engine.finished) - done)
            done = len(engine.finished)
    if bar is not None:
        bar.close()
    out = []
    for j, (i, s) in enumerate(plan):
        req = engine.finished.pop(first + j)
        out.append(Sample(i, list(req.prompt) + list(req.output), len(req.prompt), s))
    return out


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
