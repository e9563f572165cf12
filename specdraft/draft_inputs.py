"""Checks of the drafter's inputs, all before anything changes. Errors name the
argument, the value and the limit. Values that live on the device (verified token ids,
accepted counts) are read only in validation mode (kernels/validation.py: the default
for CPU tensors, SPECDRAFT_VALIDATE=1 elsewhere); otherwise the round's kernels clamp
them, so a bad value gives wrong drafts, never an out-of-bounds access."""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from specdraft import kernels

from .models.eagle import Eagle3Head, EagleHead
from .models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from .drafter import Drafter

_INT_DTYPES = (torch.int32, torch.int64)


class DraftKind(enum.Enum):
    LLAMA = "llama"  # a causal LM with its own KV cache
    EAGLE = "eagle"  # EAGLE-1 head over the target's final hidden states
    EAGLE3 = "eagle3"  # EAGLE-3 head over the target's auxiliary hidden states


class DraftInputTypeError(TypeError, ValueError):
    """A tensor of the wrong dtype (or a value of the wrong type): a TypeError, and a
    ValueError for callers that catch bad input as one."""


def draft_kind(model: object) -> DraftKind:
    if isinstance(model, Eagle3Head):
        return DraftKind.EAGLE3
    if isinstance(model, EagleHead):
        return DraftKind.EAGLE
    if isinstance(model, LlamaForCausalLM):
        return DraftKind.LLAMA
    raise DraftInputTypeError(
        f"model must be a LlamaForCausalLM, EagleHead or Eagle3Head, got {type(model).__name__}"
    )


def _tensor(name: str, t: object, device: torch.device, dtypes, shape: tuple) -> torch.Tensor:
    """t checked: a tensor on `device`, dtype in dtypes, shape matching (None = any)."""
    if not isinstance(t, torch.Tensor):
        raise DraftInputTypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the drafter on {device}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise DraftInputTypeError(f"{name} has dtype {t.dtype}, expected {want}")
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [{want}]")
    return t


def _hashable(req_id: object) -> None:
    try:
        hash(req_id)
    except TypeError:
        raise DraftInputTypeError(
            f"req_id must be hashable, got {type(req_id).__name__} {req_id!r:.80}"
        ) from None


def _host_ints(name: str, values: object) -> np.ndarray:
    """A 1-D int64 array from host ints (list, numpy, CPU tensor); device tensors are
    refused: reading them would make the host wait for the GPU."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(
                f"{name} is on {values.device}: pass host ints (the drafter needs them on the "
                "host before the round, and reading a device tensor would wait for the GPU)"
            )
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise DraftInputTypeError(f"{name} must hold integers, got dtype {values.dtype}")
        return values.reshape(-1).numpy().astype(np.int64)
    if isinstance(values, str | bytes):
        raise DraftInputTypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    arr = np.asarray(values)
    if arr.size and arr.dtype.kind not in "iu":
        raise DraftInputTypeError(f"{name} must hold integers, got {arr.dtype} {values!r:.80}")
    return arr.astype(np.int64).reshape(-1)


def check_prompt(
    d: Drafter, req_id: Hashable, prompt: Sequence[int], hidden: torch.Tensor | None
) -> tuple[list[int], torch.Tensor | None]:
    _hashable(req_id)
    if req_id in d.tables:
        raise ValueError(f"req_id {req_id!r} is already present ({len(d.tables)} requests)")
    ids = _host_ints("prompt_token_ids", prompt)
    n = len(ids)
    if n < 1:
        raise ValueError("prompt_token_ids is empty: it needs at least one token")
    if n >= d.max_model_len:
        raise ValueError(
            f"prompt_token_ids has {n} tokens: at most max_model_len - 1 = "
            f"{d.max_model_len - 1} (the first round adds one)"
        )
    bad = (ids < 0) | (ids >= d.vocab_size)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"prompt_token_ids[{i}] = {ids[i]} is outside the vocabulary [0, {d.vocab_size})"
        )
    if d.kind is DraftKind.LLAMA:
        if hidden is not None:
            raise ValueError("target_hidden is for EAGLE heads; a Llama draft takes None")
    else:
        if hidden is None:
            raise ValueError(
                f"target_hidden [{n}, {d.hidden_in}] is required for an {d.kind.value} head"
            )
        _tensor("target_hidden", hidden, d.device, (d.dtype,), (n, d.hidden_in))
    return ids.tolist(), hidden


@dataclass
class ProposeInputs:
    req_ids: list
    slots: np.ndarray  # int64 [B] request slot (block-table row)
    num_blocks: np.ndarray  # int64 [B] blocks each request holds
    width: int  # W_in
    k: np.ndarray  # int64 [B]
    k_max: int

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


def check_propose_inputs(d: Drafter, req_ids, verified, accepted, hidden, k, k_max):
    """Everything about a propose() call the host can check without reading the device;
    returns what the round needs. Per-round path: kept to a few numpy calls."""
    if type(req_ids) is not list:
        if isinstance(req_ids, str | bytes) or not isinstance(req_ids, Sequence):
            raise DraftInputTypeError(
                f"req_ids must be a sequence of request ids, got {type(req_ids).__name__}"
            )
        req_ids = list(req_ids)
    b = len(req_ids)
    if not 1 <= b <= d.max_num_reqs:
        raise ValueError(f"req_ids has {b} requests, must be in [1, max_num_reqs {d.max_num_reqs}]")
    slots, num_blocks = d.tables.rows_of(req_ids)  # names an unknown or unhashable id
    # Distinct requests hold distinct slots: mark each slot with its row, read it back.
    mark, rows = d._slot_mark, d._arange[:b]
    mark[slots] = rows
    if (mark[slots] != rows).any():
        seen: set = set()
        dup = next(r for r in req_ids if r in seen or seen.add(r))
        raise ValueError(f"req_ids holds {dup!r} twice")
    dev = d.device
    _tensor("verified_tokens", verified, dev, _INT_DTYPES, (b, None))
    w = verified.shape[1]
    if not 1 <= w <= d.width:
        raise ValueError(
            f"verified_tokens has width {w}, must be in [1, W = {d.width}] (largest K_max + 1)"
        )
    _tensor("num_accepted", accepted, dev, _INT_DTYPES, (b,))
    if d.hidden_in == 0:
        if hidden is not None:
            raise ValueError("target_hidden is for EAGLE heads; a Llama draft takes None")
    elif hidden is None:
        raise ValueError(
            f"target_hidden [{b}, {w}, {d.hidden_in}] is required for an {d.kind.value} head"
        )
    else:
        _tensor("target_hidden", hidden, dev, (d.dtype,), (b, w, d.hidden_in))

    ks = None if k is None else _check_k(k, b, req_ids)
    if k_max is not None:
        if isinstance(k_max, bool) or not isinstance(k_max, int | np.integer):
            raise DraftInputTypeError(f"k_max must be an int, got {k_max!r}")
        if int(k_max) not in d.k_options:
            raise ValueError(f"k_max {k_max} is not one of the captured options {d.k_options}")
        k_max = int(k_max)
    elif d.k_table is not None:
        k_max = d.k_max_for(b)
    else:  # the smallest captured K_max that covers every request's k
        want = int((d._slot_k[slots] if ks is None else ks).max())
        k_max = next((o for o in d.k_options if o >= want), d.k_options[-1])
    if ks is None:
        ks = np.minimum(d._slot_k[slots], k_max)
    elif ks.max() > k_max:
        i = int(np.argmax(ks > k_max))
        raise ValueError(
            f"k[{i}] = {ks[i]} for request {req_ids[i]!r} is over K_max {k_max} of this round "
            f"(options {d.k_options}" + (", table by batch size)" if d.k_table else ")")
        )
    if kernels.validation_enabled(verified):
        _check_values(d, req_ids, verified, accepted, w)
    return ProposeInputs(req_ids, slots, num_blocks, w, ks, k_max)


def _check_k(k, b: int, req_ids: list) -> np.ndarray:
    ks = _host_ints("k", k)
    if ks.size == 1 and b != 1 and np.ndim(k) == 0:
        ks = np.full(b, ks[0], dtype=np.int64)
    if ks.shape != (b,):
        raise ValueError(f"k has {ks.size} entries, expected one per request ({b})")
    if ks.min() < 0:
        i = int(np.argmax(ks < 0))
        raise ValueError(f"k[{i}] = {ks[i]} for request {req_ids[i]!r} must be >= 0")
    return ks


def _check_values(d: Drafter, req_ids, verified, accepted, w: int) -> None:
    """Device values, read on the host (validation mode only)."""
    acc = accepted.cpu().long()
    bad = (acc < 0) | (acc > w - 1)
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"num_accepted[{i}] = {int(acc[i])} for request {req_ids[i]!r} must be in "
            f"[0, {w - 1}] (verified_tokens has {w} rows)"
        )
    ver = verified.cpu().long()
    real = torch.arange(w)[None, :] <= acc[:, None]
    bad = real & ((ver < 0) | (ver >= d.vocab_size))
    if bad.any():
        i, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"verified_tokens[{i}, {j}] = {int(ver[i, j])} for request {req_ids[i]!r} is "
            f"outside the vocabulary [0, {d.vocab_size})"
        )
