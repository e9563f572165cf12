"""The rejection sampler: the target's verdict on a draft round.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): draft j of a request is
accepted with probability min(1, p_j(x_j) / q_j(x_j)); the first rejection emits a
token drawn from max(p - q, 0), and a request whose drafts all pass emits a bonus token
from p. The emitted sequence is distributed exactly as the target's own sampling, where
p is `sampling.filtered_probs` of the target's logits (temperature, top-k, top-p, ties)
and q is the distribution each draft token was drawn from. Greedy requests accept while
the draft equals the target's argmax. Every draw is keyed (seed, absolute position,
stream) with its own stream (ACCEPT, RESIDUAL, BONUS), none shared with the draft's
DRAFT_PROPOSAL draws (docs/architecture.md, invariant 8).

`RejectionSampler` owns persistent outputs, the kernels' workspace and the per-position
acceptance counters, so a call is graph-capturable and never waits for the GPU. CUDA
tensors (or the interpreter) run the Triton kernels (kernels/rejection.py); other CPU
tensors run `rejection_sample_torch`, the same contract in PyTorch ops.

Padded requests: positions[b] < 0. They emit nothing (tokens -1, counts 0) and leave the
counters alone.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdraft import kernels, ops
from specdraft.kernels import rejection as _kr
from specdraft.sampling import (
    ACCEPT,
    BONUS,
    RESIDUAL,
    SamplingTensors,
    exponential_race,
    filtered_probs,
    keyed_uniform,
)

__all__ = ["RejectionOutput", "RejectionSampler", "rejection_sample_torch"]

_STREAMS = (int(ACCEPT), int(RESIDUAL), int(BONUS))
if _STREAMS != (_kr.ACCEPT, _kr.RESIDUAL, _kr.BONUS):  # pragma: no cover - a code change
    raise ImportError(f"kernels/rejection.py streams differ from specdraft.sampling's {_STREAMS}")


class RejectionOutput(NamedTuple):
    """Views of the sampler's persistent buffers (overwritten by the next call)."""

    tokens: torch.Tensor  # [B, K + 1] int64: accepted drafts, correction / bonus, then -1
    num_accepted: torch.Tensor  # [B] int32
    num_emitted: torch.Tensor  # [B] int32: num_accepted + 1 (0 for a padded request)


def _check_int(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return v


class RejectionSampler:
    """Verifies up to max_num_reqs requests with up to k_max drafts each over a
    vocabulary of vocab_size.

    Counters (device int64 [k_max], advanced inside the kernel): proposed_counts[j] counts
    requests that proposed a draft at position j, accepted_counts[j] those whose draft j
    was accepted; their ratio is the per-position acceptance rate. `counters_to_host`
    copies them without waiting."""

    def __init__(
        self,
        max_num_reqs: int,
        k_max: int,
        vocab_size: int,
        device: torch.device | str,
        *,
        config: _kr.RejectionConfig | None = None,
    ) -> None:
        self.max_num_reqs = _check_int("max_num_reqs", max_num_reqs, 1)
        self.k_max = _check_int("k_max", k_max, 0)
        self.vocab_size = _check_int("vocab_size", vocab_size, 1)
        self.device = torch.device(device)
        b, k = self.max_num_reqs, self.k_max
        kw = {"device": self.device}
        self.tokens = torch.full((b, k + 1), -1, dtype=torch.int64, **kw)
        self.num_accepted = torch.zeros(b, dtype=torch.int32, **kw)
        self.num_emitted = torch.zeros(b, dtype=torch.int32, **kw)
        self.proposed_counts = torch.zeros(k, dtype=torch.int64, **kw)
        self.accepted_counts = torch.zeros(k, dtype=torch.int64, **kw)
        self.workspace = _kr.RejectionWorkspace.allocate(b, k, vocab_size, self.device, config)
        self._host_counters: torch.Tensor | None = None
        # Each launch overlaps its start with the previous kernel's tail (H200: greedy
        # B 64, K 5, V 49152 in a graph, bench/NOTES.md stop 34).
        self._pdl = kernels.pdl_supported(self.device)

    def __call__(
        self,
        target_logits: torch.Tensor,
        draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor | None,
        params: SamplingTensors,
        positions: torch.Tensor,
    ) -> RejectionOutput:
        """target_logits [B * (K + 1), V]; draft_tokens [B, K] int64 (-1 padded, K <=
        k_max); draft_probs q [B, K, V] float32 or None (only if every request is greedy,
        from params' host flags); params: the requests' SamplingTensors (rows [0, B) are
        used; when its host flags say every row is greedy, nothing per request is read,
        so a whole table may stand in without gathering the batch's rows); positions [B]
        int64: absolute position of draft 0."""
        if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 2:
            got = getattr(draft_tokens, "shape", draft_tokens)
            raise ValueError(f"draft_tokens must be a [B, K] tensor, got {got}")
        b, k = draft_tokens.shape
        if k > self.k_max:
            raise ValueError(
                f"draft_tokens has K = {k} columns, over this sampler's k_max {self.k_max}"
            )
        if b > self.max_num_reqs:
            raise ValueError(
                f"draft_tokens has B = {b} requests, over max_num_reqs {self.max_num_reqs}"
            )
        if not isinstance(params, SamplingTensors):
            raise TypeError(f"params must be SamplingTensors, got {type(params).__name__}")
        if len(params) < b:
            raise ValueError(f"params has {len(params)} rows, the batch {b} requests")
        rows = params.narrow(0, b) if len(params) != b else params
        if draft_probs is None and not rows.all_greedy:
            raise ValueError("draft_probs (q) is None but params has sampled (non-greedy) requests")
        out = RejectionOutput(self.tokens[:b, : k + 1], self.num_accepted[:b], self.num_emitted[:b])
        args = (target_logits, draft_tokens, draft_probs, rows.greedy, rows.temperature,
                rows.top_k, rows.top_p, rows.seed, positions, *out,
                self.proposed_counts[:k], self.accepted_counts[:k])  # fmt: skip
        if ops.backend_for(draft_tokens) == "triton":
            kernels.rejection_sample(
                *args, self.workspace, any_filter=rows.any_filter, streams=_STREAMS,
                pdl=self._pdl,
            )  # fmt: skip
        else:
            rejection_sample_torch(*args, any_filter=rows.any_filter)
        return out

    def reset_counters(self) -> None:
        self.proposed_counts.zero_()
        self.accepted_counts.zero_()

    def counters_to_host(self) -> torch.Tensor:
        """A [2, k_max] int64 host tensor (pinned on CUDA) that a non-blocking copy fills
        with (proposed, accepted) in stream order: read it after a later sync point
        (e.g. the one-step-late readback), not right away."""
        if self._host_counters is None:
            pin = self.device.type == "cuda"
            self._host_counters = torch.zeros(2, self.k_max, dtype=torch.int64, pin_memory=pin)
        self._host_counters[0].copy_(self.proposed_counts, non_blocking=True)
        self._host_counters[1].copy_(self.accepted_counts, non_blocking=True)
        return self._host_counters


def rejection_sample_torch(
    target_logits, draft_tokens, draft_probs, greedy, temperature, top_k, top_p, seed,
    positions, out_tokens, out_num_accepted, out_num_emitted, proposed_counts,
    accepted_counts, *, any_filter: bool = True,
) -> None:  # fmt: skip
    """kernels.rejection_sample's contract in PyTorch ops (float32 like the kernels;
    [B, K + 1, V] probabilities materialized): the path for CPU tensors without the
    interpreter. Same checks, same keyed draws; tokens equal the kernel's except where
    float rounding differs at a boundary."""
    b, k, v = _kr.check_rejection_args(
        target_logits, draft_tokens, draft_probs, greedy, temperature, top_k, top_p, seed,
        positions, out_tokens, out_num_accepted, out_num_emitted, proposed_counts,
        accepted_counts,
    )  # fmt: skip
    if _kr.validation_enabled(draft_tokens):
        _kr.validate_draft_tokens(draft_tokens, v)
    if b == 0:
        return
    dev = draft_tokens.device
    st = SamplingTensors(0, dev)
    rep = torch.arange(b, device=dev).repeat_interleave(k + 1)
    for name, t in (("greedy", greedy), ("temperature", temperature), ("top_k", top_k),
                    ("top_p", top_p), ("seed", seed)):  # fmt: skip
        setattr(st, name, t.index_select(0, rep))
    if draft_probs is None:
        st.greedy = torch.ones_like(st.greedy)
    logits3 = target_logits.view(b, k + 1, v)
    argmax = logits3.argmax(-1)
    p = filtered_probs(target_logits, st, any_filter=any_filter).view(b, k + 1, v)
    j = torch.arange(k, device=dev)
    kk = (draft_tokens != -1).int().cumprod(1).sum(1)  # ids before the first -1
    live = (j[None, :] < kk[:, None]) & (draft_tokens >= 0) & (draft_tokens < v)
    x = torch.where(live, draft_tokens, 0)
    is_greedy = greedy if draft_probs is not None else torch.ones_like(greedy)
    acc = x == argmax[:, :k]
    if draft_probs is not None and k:
        px = p[:, :k].gather(2, x[..., None])[..., 0]
        qx = draft_probs.gather(2, x[..., None])[..., 0]
        u = keyed_uniform(seed[:, None], positions[:, None] + j, ACCEPT)
        acc_s = (px > 0) & ((px >= qx) | (u * qx < px))
        acc = torch.where(is_greedy[:, None], acc, acc_s)
    present = j[None, :] < kk[:, None]
    r = torch.cat([torch.where(present & ~(acc & live), j, k), kk[:, None]], 1).amin(1)
    ar = torch.arange(b, device=dev)
    token = argmax[ar, r]
    if draft_probs is not None:
        pr = p[ar, r]
        residual = r < kk
        qr = draft_probs[ar, r.clamp(max=max(k - 1, 0))] if k else torch.zeros_like(pr)
        w = torch.where(residual[:, None], (pr - qr).clamp(min=0), pr)
        race = torch.where(
            residual,
            exponential_race(w, seed, positions + r, RESIDUAL),
            exponential_race(w, seed, positions + r, BONUS),
        )
        # An all-zero residual (p <= q everywhere after rounding): the argmax stands in.
        race = torch.where(w.amax(1) > 0, race, token)
        token = torch.where(is_greedy, token, race)
    real = positions >= 0
    cols = torch.arange(k + 1, device=dev)
    out = torch.full((b, k + 1), -1, dtype=torch.int64, device=dev)
    out[:, :k] = torch.where(j[None, :] < r[:, None], draft_tokens, -1)
    out = torch.where(cols[None, :] == r[:, None], token[:, None], out)
    out_tokens.copy_(torch.where(real[:, None], out, -1))
    out_num_accepted.copy_(torch.where(real, r, 0))
    out_num_emitted.copy_(torch.where(real, r + 1, 0))
    proposed_counts.add_(((j[None, :] < kk[:, None]) & real[:, None]).sum(0))
    accepted_counts.add_(((j[None, :] < r[:, None]) & real[:, None]).sum(0))
