"""Checks of kernel arguments: host scalars always, device metadata in validation mode.

Host scalars (scale, softcap, eps) are checked on every call: they cost nothing and a
nonsense value (inf, NaN, <= 0, or a float that is 0 or inf once the launch passes it
as float32) silently turns a whole output into NaN.

Device metadata (query_start_loc, seq_lens, block tables, slot mappings) cannot be
checked for free: its values live on the device and reading them on the host is a
synchronisation. The kernels therefore clamp every index they read (they never touch
memory outside their tensors whatever the metadata says), and validation mode adds
host-side checks that turn inconsistent metadata into a ValueError naming the request
and the value, before anything is launched or written.

Validation mode, in order of precedence:
1. `set_validation(True | False)` or the context manager `use_validation(...)`;
2. the environment variable SPECDRAFT_VALIDATE=1 / 0, read at every call;
3. the default: on for CPU tensors (under the Triton interpreter an out-of-range index
   corrupts the process instead of faulting), off for CUDA tensors.
It is always skipped while the current CUDA stream is capturing a graph: the read would
synchronise (an error during capture), and the captured graph replays without the host.

Cost: the checks are about a dozen small PyTorch ops over the metadata of the rows in
use, then one read of six flags on the host. On CUDA that read synchronises with the
device (the host waits for all queued work), so it stays off the hot path: an eager
paged_attention of 8 decode requests took 91 us per call without it and 416 us with it
on the H200 (2026-11-30). On the CPU it is about 80 us per call for 8 requests and 16
block-table columns (tests/test_kernel_safety.py measures it; 2 shared cores), against
about 300 ms for the interpreted kernel on the same batch.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .paged_attention import AttentionLaunchConfig

ENV_VAR = "SPECDRAFT_VALIDATE"

# Python floats reach a kernel as float32: a value outside the normal float32 range
# becomes 0 or inf there (and a subnormal one is flushed to 0 on the GPU).
FP32_TINY = float(torch.finfo(torch.float32).tiny)
FP32_MAX = float(torch.finfo(torch.float32).max)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_NUM_SPLITS = 64
# Positions minus the window stay inside int32 in the attention kernel.
MAX_SLIDING_WINDOW = 1 << 30
LOG2E = 1.4426950408889634

_forced: bool | None = None


# ---- host scalars ---------------------------------------------------------------------


def check_positive_float(name: str, value: object, *, low: float = FP32_TINY) -> float:
    """`value` as a float, checked to be a real number in [low, FP32_MAX]: finite,
    positive, and still nonzero and finite once passed to a kernel as float32.

    TypeError for a non-number (bool included), ValueError naming `name`, the value and
    the limits otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if not low <= v <= FP32_MAX:
        raise ValueError(
            f"{name} = {value!r} is outside [{low:.3g}, {FP32_MAX:.3g}]: the kernel receives "
            "it as float32, where it would become 0 or inf"
        )
    return v


# ---- tensors ---------------------------------------------------------------------------


def _check_tensor(name: str, t, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension, got strides {t.stride()}"
        )


def validate_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """Check a K/V cache pair; return (block_size, num_kv_heads, head_dim)."""
    _check_tensor("k_cache", k_cache, 4, SUPPORTED_DTYPES)
    _check_tensor("v_cache", v_cache, 4, SUPPORTED_DTYPES)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match "
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype}"
        )
    if v_cache.device != k_cache.device:
        raise ValueError(f"v_cache is on {v_cache.device}, k_cache on {k_cache.device}")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size < 1 or block_size > 256 or block_size & (block_size - 1):
        raise ValueError(f"cache block_size must be a power of two in [1, 256], got {block_size}")
    if head_dim < 1 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    return block_size, num_kv_heads, head_dim


# ---- the switch -----------------------------------------------------------------------


def set_validation(enabled: bool | None) -> None:
    """Force validation mode on (True) or off (False) for every later call; None returns
    to the default (SPECDRAFT_VALIDATE if set, else on for CPU tensors only)."""
    global _forced
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool or None, got {type(enabled).__name__}")
    _forced = enabled


@contextlib.contextmanager
def use_validation(enabled: bool | None) -> Iterator[None]:
    """Context manager form of set_validation; the previous setting comes back on exit."""
    global _forced
    before = _forced
    set_validation(enabled)
    try:
        yield
    finally:
        _forced = before


def _from_env() -> bool | None:
    value = os.environ.get(ENV_VAR, "").strip()
    if value == "":
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_VAR} must be 0, 1 or unset, got {value!r}")
    return value == "1"


def validation_enabled(t: torch.Tensor | torch.device) -> bool:
    """Whether a launch on `t`'s device checks its device metadata first."""
    if isinstance(t, torch.Tensor):
        t = t.device
    cuda = (t if isinstance(t, torch.device) else torch.device(t)).type == "cuda"
    enabled = _forced if _forced is not None else _from_env()
    if enabled is None:
        return not cuda
    # Never inside a capture (a check reads device values). Asked only when validation
    # is on: the query costs host time on every steady round otherwise.
    if enabled and cuda and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return enabled


# ---- device metadata ------------------------------------------------------------------


def _first(mask: torch.Tensor) -> int:
    """Index of the first True of a 1-D mask that has one (host read; error path only)."""
    return int(torch.nonzero(mask)[0, 0])


def check_attention_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    sliding_window: int | None = None,
) -> None:
    """Raise ValueError, naming the request and the value, when paged_attention's
    metadata is inconsistent: query_start_loc must start at 0, never decrease and end at
    most at num_tokens (q's rows); each seq_lens[r] must be at least request r's query
    length and at most the table's width x block_size; the block ids a request reads
    (columns up to cdiv(seq_len, block_size), from its window's first key with a sliding
    window) must lie in [0, num_blocks).

    The checks run where the tensors are; the host reads one small flag tensor (a
    synchronisation on CUDA), and reads more only to word an error."""
    num_reqs = query_start_loc.numel() - 1
    width = block_table.shape[1]
    cap = width * block_size
    qsl = query_start_loc[: num_reqs + 1].to(torch.int64)
    lens = seq_lens[:num_reqs].to(torch.int64)
    table = block_table[:num_reqs]
    q_lens = qsl[1:] - qsl[:-1]
    # Columns [lo, hi) of each row are read by the kernel; a row past the checks above
    # is clamped first so that the mask below stays meaningful.
    clamped = lens.clamp(0, cap)
    hi = (clamped + block_size - 1) // block_size
    if sliding_window is not None:
        first_key = (clamped - q_lens.clamp(min=0) - sliding_window + 1).clamp(min=0)
        lo = first_key // block_size
    else:
        lo = torch.zeros_like(hi)
    cols = torch.arange(width, device=table.device)
    used = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
    bad_block = used & ((table < 0) | (table >= num_blocks))
    flags = torch.stack(
        [
            qsl[0] != 0,
            (q_lens < 0).any(),
            (qsl > num_tokens).any(),
            (lens < q_lens).any(),
            (lens > cap).any(),
            bad_block.any(),
        ]
    )
    if not flags.any():  # the one synchronising read on the success path
        return
    f_start, f_order, f_rows, f_short, f_long, f_block = flags.tolist()
    if f_start:
        raise ValueError(
            f"query_start_loc[0] = {int(qsl[0])}, expected 0: the first request starts at q's row 0"
        )
    if f_order:
        r = _first(q_lens < 0)
        raise ValueError(
            f"query_start_loc[{r + 1}] = {int(qsl[r + 1])} is below query_start_loc[{r}] = "
            f"{int(qsl[r])}: request {r} would have a negative query length"
        )
    if f_rows:
        i = _first(qsl > num_tokens)
        raise ValueError(
            f"query_start_loc[{i}] = {int(qsl[i])} is past q's {num_tokens} rows (num_tokens)"
        )
    if f_short:
        r = _first(lens < q_lens)
        what = "is negative" if lens[r] < 0 else f"is below its query length {int(q_lens[r])}"
        raise ValueError(f"seq_lens[{r}] = {int(lens[r])} {what} (request {r})")
    if f_long:
        r = _first(lens > cap)
        raise ValueError(
            f"seq_lens[{r}] = {int(lens[r])} (request {r}) is over the block table's capacity "
            f"{cap} ({width} columns x block_size {block_size})"
        )
    if f_block:
        r = _first(bad_block.any(dim=1))
        c = _first(bad_block[r])
        raise ValueError(
            f"block_table[{r}, {c}] = {int(table[r, c])} (request {r}, which reads columns "
            f"{int(lo[r])}..{int(hi[r]) - 1}) is outside the cache's blocks [0, {num_blocks})"
        )


def check_slot_mapping(slot_mapping: torch.Tensor, *, num_tokens: int, num_slots: int) -> None:
    """Raise ValueError naming the token and the value when slot_mapping[:num_tokens]
    holds a slot past the cache (>= num_slots) or a negative slot other than -1, the
    padding mark (the kernel writes nothing for either; the runtime never makes them)."""
    slots = slot_mapping[:num_tokens]
    bad = (slots < -1) | (slots >= num_slots)
    if not bad.any():  # the one synchronising read on the success path
        return
    t = _first(bad)
    value = int(slots[t])
    why = (
        f"is past the cache's {num_slots} slots (num_blocks x block_size)"
        if value >= num_slots
        else "is negative but not -1 (the padding mark)"
    )
    raise ValueError(f"slot_mapping[{t}] = {value} (token {t}) {why}")


def check_launch_config(config, qpk: int) -> None:
    """An explicit AttentionLaunchConfig for heads with qpk query heads a KV head: its
    tiles must be powers of two the kernel can lay out, its query tile must hold
    block_q tokens of qpk heads in block_m rows (a larger block_q would leave tokens of
    every tile unwritten), and prefetch runs 0, 1 or 2 tiles ahead."""
    from .paged_attention import AttentionLaunchConfig

    if not isinstance(config, AttentionLaunchConfig):
        raise TypeError(
            f"config must be an AttentionLaunchConfig or None, got {type(config).__name__}"
        )
    if not isinstance(config.per_token, bool):
        kind = type(config.per_token).__name__
        raise TypeError(f"config.per_token must be a bool, got {kind}")
    limits = (("block_m", 16, 256), ("block_n", 16, 1024), ("num_splits", 1, MAX_NUM_SPLITS),
              ("num_warps", 1, 32))  # fmt: skip
    for name, lo, hi in limits:
        v = getattr(config, name)
        # The token programs' chunk count is any count (their grid's third axis).
        pow2 = not (config.per_token and name == "num_splits")
        if (
            isinstance(v, bool)
            or not isinstance(v, int)
            or not lo <= v <= hi
            or (pow2 and v & (v - 1))
        ):
            what = "a power of two" if pow2 else "an int"
            raise ValueError(f"config.{name} must be {what} in [{lo}, {hi}], got {v!r}")
    most = config.block_m // qpk
    v = config.block_q
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= most:
        raise ValueError(
            f"config.block_q must be an int in [1, block_m // (q heads a KV head) = "
            f"{config.block_m} // {qpk} = {most}], got {v!r}"
        )
    v = config.num_stages
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 8:
        raise ValueError(f"config.num_stages must be an int in [1, 8], got {v!r}")
    v = config.prefetch
    if not isinstance(v, int):
        raise TypeError(f"config.prefetch must be an int (or bool), got {type(v).__name__}")
    if v not in (0, 1, 2):
        raise ValueError(f"config.prefetch must be 0, 1 or 2 (tiles ahead), got {v!r}")


def check_paged_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    config: AttentionLaunchConfig | None = None,
) -> None:
    """paged_attention's argument checks, nothing launched: shapes, dtypes, devices and
    host scalars always; the metadata's values too in validation mode (one host read,
    kernels/validation.py)."""
    block_size, num_kv_heads, head_dim = validate_kv_cache(k_cache, v_cache)
    _check_tensor("q", q, 3, SUPPORTED_DTYPES)
    num_tokens, num_q_heads, q_head_dim = q.shape
    if q.dtype != k_cache.dtype:
        raise TypeError(f"q dtype {q.dtype} must match the cache dtype {k_cache.dtype}")
    if q_head_dim != head_dim:
        raise ValueError(f"q head_dim {q_head_dim} must match the cache head_dim {head_dim}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    _check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    _check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    _check_tensor("block_table", block_table, 2, (torch.int32,))
    num_reqs = query_start_loc.numel() - 1
    if num_reqs < 1:
        raise ValueError(f"query_start_loc needs at least 2 entries, got {query_start_loc.numel()}")
    if seq_lens.numel() < num_reqs:
        raise ValueError(f"seq_lens has {seq_lens.numel()} entries, fewer than num_reqs {num_reqs}")
    if block_table.shape[0] < num_reqs:
        raise ValueError(
            f"block_table has {block_table.shape[0]} rows, fewer than num_reqs {num_reqs}"
        )
    for name, t in (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
        ("block_table", block_table),
    ):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    scale = check_positive_float("scale", scale)
    if softcap is not None:
        softcap = check_positive_float("softcap", softcap)
        # The kernel computes tanh(s * (scale / softcap)) and multiplies by softcap *
        # log2(e), in float32: both factors must stay finite and nonzero.
        ratio, cap2 = scale / softcap, softcap * LOG2E
        if not FP32_TINY <= ratio <= FP32_MAX or cap2 > FP32_MAX:
            raise ValueError(
                f"softcap = {softcap!r} with scale = {scale!r}: scale / softcap = {ratio:.3g} "
                f"and softcap * log2(e) = {cap2:.3g} must lie in [{FP32_TINY:.3g}, "
                f"{FP32_MAX:.3g}] (float32 in the kernel)"
            )
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or not 1 <= sliding_window <= MAX_SLIDING_WINDOW
    ):
        raise ValueError(
            f"sliding_window must be an int in [1, {MAX_SLIDING_WINDOW}] or None, got "
            f"{sliding_window!r}"
        )
    if max_query_len is not None and max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    if num_splits is not None and (
        num_splits < 1 or num_splits > MAX_NUM_SPLITS or num_splits & (num_splits - 1)
    ):
        raise ValueError(
            f"num_splits must be a power of two in [1, {MAX_NUM_SPLITS}], got {num_splits}"
        )
    if config is not None:
        check_launch_config(config, num_q_heads // num_kv_heads)
        if num_splits is not None and num_splits != config.num_splits:
            raise ValueError(
                f"num_splits {num_splits} conflicts with config.num_splits "
                f"{config.num_splits}: pass one of them"
            )
    if out is not None:
        _check_tensor("out", out, 3, SUPPORTED_DTYPES)
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(
                f"out {tuple(out.shape)} {out.dtype} {out.device} must match "
                f"q {tuple(q.shape)} {q.dtype} {q.device}"
            )
    if num_tokens > 0 and validation_enabled(q):
        check_attention_metadata(
            query_start_loc,
            seq_lens,
            block_table,
            num_tokens=num_tokens,
            num_blocks=k_cache.shape[0],
            block_size=block_size,
            sliding_window=sliding_window,
        )
