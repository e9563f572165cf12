"""The bookkeeping after a speculative step's rejection sampling, in one launch.

Per request i of the batch (its target row rows[i]): committed[rows[i]] grows by
num_accepted[i] + 1; the emitted tokens and their count go into the host-readback stage
(stage[i, :W], stage[i, W]); the last emitted token (tokens[i, num_accepted[i]]) into
the target's next verify_first[i]; the verified block and accepted count into the
drafter's next-round inputs; and next_positions[i] = the new committed length + 1 (the
absolute position of the next step's draft 0, which the rejection sampler keys its
draws on). A row index outside committed writes no length and gives position -1 (the
sampler's mark of a padded request). Written in torch these are about fifteen small
kernels; in a CUDA graph at batch 1 each costs 2-4 µs of GPU time, most of it launch
gap.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import CachedLaunch, specialization_key
from .paged_attention import _check_tensor

_BLOCK_B = 32


# B is not specialized: a batch that shrinks one request at a time would otherwise compile
# new variants (B == 1, B % 16 == 0) in the middle of generation.
@triton.jit(do_not_specialize=["B"])
def _commit_kernel(
    tokens_ptr, stride_t, nacc_ptr, nemit_ptr, rows_ptr, committed_ptr,
    stage_ptr, stride_s, first_ptr, ver_ptr, stride_v, acc_ptr, pos_ptr,
    B, W, R, BLOCK_B: tl.constexpr, WP: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    im = i < B
    j = tl.arange(0, WP)
    jm = im[:, None] & (j < W)[None, :]
    toks = tl.load(tokens_ptr + i[:, None] * stride_t + j[None, :], mask=jm, other=-1)
    nacc = tl.load(nacc_ptr + i, mask=im, other=0)
    nemit = tl.load(nemit_ptr + i, mask=im, other=0)
    row = tl.load(rows_ptr + i, mask=im, other=0)
    ok = im & (row >= 0) & (row < R)  # a corrupt row index writes no length
    new_len = tl.load(committed_ptr + row, mask=ok, other=0) + nacc.to(tl.int64) + 1
    tl.store(committed_ptr + row, new_len, mask=ok)
    tl.store(pos_ptr + i, tl.where(ok, new_len + 1, -1), mask=im)
    tl.store(stage_ptr + i[:, None] * stride_s + j[None, :], toks, mask=jm)
    tl.store(stage_ptr + i * stride_s + W, nemit.to(tl.int64), mask=im)
    last = tl.sum(tl.where(j[None, :] == nacc[:, None], toks, 0), axis=1)
    tl.store(first_ptr + i, last, mask=im)
    tl.store(ver_ptr + i[:, None] * stride_v + j[None, :], toks, mask=jm)
    tl.store(acc_ptr + i, nacc.to(acc_ptr.dtype.element_ty), mask=im)


_LAUNCH = CachedLaunch(_commit_kernel)


def check_commit_args(
    tokens, num_accepted, num_emitted, rows, committed, stage, verify_first, next_verified,
    next_accepted, next_positions,
) -> None:  # fmt: skip
    """commit_step's argument checks (nothing launched)."""
    _check_tensor("tokens", tokens, 2, (torch.int64,))
    b, w = tokens.shape
    for name, t, dtypes in (
        ("num_accepted", num_accepted, (torch.int32,)),
        ("num_emitted", num_emitted, (torch.int32,)),
        ("rows", rows, (torch.int64,)),
        ("committed", committed, (torch.int64,)),
        ("verify_first", verify_first, (torch.int64,)),
        ("next_accepted", next_accepted, (torch.int32, torch.int64)),
        ("next_positions", next_positions, (torch.int64,)),
    ):
        _check_tensor(name, t, 1, dtypes)
        if name != "committed" and t.shape[0] < b:
            raise ValueError(f"{name} has {t.shape[0]} entries, the batch {b} requests")
        if t.device != tokens.device:
            raise ValueError(f"{name} is on {t.device}, tokens on {tokens.device}")
    for name, t, cols in (("stage", stage, w + 1), ("next_verified", next_verified, w)):
        _check_tensor(name, t, 2, (torch.int64,))
        if t.shape[0] < b or t.shape[1] < cols or t.stride(1) != 1:
            raise ValueError(
                f"{name} {tuple(t.shape)} (strides {t.stride()}) must hold [{b}, {cols}] with "
                "contiguous rows"
            )
        if t.device != tokens.device:
            raise ValueError(f"{name} is on {t.device}, tokens on {tokens.device}")
    if tokens.stride(1) != 1:
        raise ValueError(f"tokens rows must be contiguous, got strides {tokens.stride()}")


def commit_step(
    tokens, num_accepted, num_emitted, rows, committed, stage, verify_first, next_verified,
    next_accepted, next_positions,
) -> None:  # fmt: skip
    """The module docstring's bookkeeping for B = tokens.shape[0] requests, in place.
    No host read: capturable."""
    check_commit_args(tokens, num_accepted, num_emitted, rows, committed, stage,
                      verify_first, next_verified, next_accepted, next_positions)  # fmt: skip
    b, w = tokens.shape
    if b == 0:
        return
    args = (tokens, tokens.stride(0), num_accepted, num_emitted, rows, committed, stage,
            stage.stride(0), verify_first, next_verified, next_verified.stride(0),
            next_accepted, next_positions, b, w, committed.shape[0], _BLOCK_B,
            triton.next_power_of_2(w))  # fmt: skip
    key = specialization_key(args) + (tokens.device.index,)
    _LAUNCH(key, (triton.cdiv(b, _BLOCK_B),), args, {"num_warps": 1})


def commit_step_torch(
    tokens, num_accepted, num_emitted, rows, committed, stage, verify_first, next_verified,
    next_accepted, next_positions,
) -> None:  # fmt: skip
    """The same in torch ops (the CPU path without the interpreter; the reference)."""
    b, w = tokens.shape
    committed.index_add_(0, rows[:b], num_accepted[:b].long() + 1)
    next_positions[:b].copy_(committed.index_select(0, rows[:b]) + 1)
    stage[:b, :w].copy_(tokens)
    stage[:b, w].copy_(num_emitted[:b])
    verify_first[:b].copy_(tokens.gather(1, num_accepted[:b].long()[:, None])[:, 0])
    next_verified[:b, :w].copy_(tokens)
    next_accepted[:b].copy_(num_accepted[:b])
