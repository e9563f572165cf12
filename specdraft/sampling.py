"""Sampling shared by generate(), the draft round and the rejection sampler.

One definition of the distribution a token is drawn from (`filtered_probs`) and one way of
drawing from it (`sample`), both stateless and seeded (docs/architecture.md, invariant
8) and made of fixed-shape tensor ops only: no host sync, no data-dependent shapes,
capturable in a CUDA graph, the same tokens on CPU and CUDA tensors up to float
rounding.

The distribution, per row (`filtered_probs`):

- greedy (temperature 0): one-hot at argmax(logits); ties go to the lowest index.
- otherwise z = logits.float() / temperature, then
  - top-k (0 < k < V): keep z_i >= t_k, t_k the k-th largest value of z counted with
    multiplicity. Every token tied with t_k is kept, so a row may keep more than k
    tokens; no tie is ever broken by index.
  - top-p (top_p < 1), on p = softmax(z) over the top-k survivors: keep token i iff the
    mass of the tokens strictly more probable than i is < top_p. That is the smallest
    descending prefix whose mass reaches (>=) top_p, widened to the whole tie group of
    its last token; the most probable token is always kept (the mass before it is 0).
  - probs = softmax(z) over the survivors, float32.
  k = 0 or k >= V and top_p = 1 (as float32) switch the filter off.

Random draws (`keyed_uniform`) are keyed by (seed, absolute position, stream) and a
counter (the vocabulary index; 0 for one draw per key). With mix = the SplitMix64
finaliser (Steele, Lea, Flood 2014), G = 0x9E3779B97F4A7C15 and arithmetic mod 2^64:

    h = mix(seed + G);  h = mix(h + G*(position + 1));  h = mix(h + G*(stream + 1))
    x = mix(h + G*(counter + 1))            # SplitMix64's stream seeded with h
    u = min(float32(((x >> 11) | 1)) * 2^-53, 1 - 2^-24)   # in [2^-53, 1 - 2^-24]

u is never 0 or 1 and keeps full float32 relative precision near 0, so the exponential
E = -log1p(-u) is exact to float32 rounding where race winners live (small E); a
fixed-point u (23 bits) would quantize E at 1e-7, a 1% error for the winner of a flat
128k-token row. torch has no uint64 arithmetic: int64 ops wrap like uint64 and a logical
right shift is an arithmetic shift masked afterwards. A Triton port does the same steps
in uint64 and gets the same bits.

`position` is the absolute index in its sequence of the token being drawn. Streams keep
the draws of different decisions about the same position independent (sharing one
biases speculative decoding's output): see `Stream`.

Cost: this file is the definition in plain torch ops (~25 passes over [N, V], int64 for
the hash). Graph replay on the H200 with bf16 logits, top-k 50 + top-p 0.9 / no filter:
N=64, V=32000: 547 / 232 us; N=256, V=128256: 6.6 / 3.3 ms (pool peak 1.1 / 0.75 GiB).
The bytes floor is 1-15 us: a fused Triton kernel (kernels/) producing the same bits is
the way there, with this module as its reference. kernels/sampling.py is that kernel for
rows without top-k / top-p (temperature, greedy rows mixed in): `sample` takes it when
the caller promises any_filter=False and specdraft.ops picks the Triton backend; three
launches, the logits read twice and probs written once.
"""

from __future__ import annotations

import enum
import itertools
import math
import numbers
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from specdraft import kernels, ops

__all__ = [
    "ACCEPT",
    "BONUS",
    "DRAFT_PROPOSAL",
    "MIN_TEMPERATURE",
    "RESIDUAL",
    "TARGET_SAMPLE",
    "SamplingParams",
    "SamplingTensors",
    "SeedSource",
    "Stream",
    "exponential_race",
    "filtered_probs",
    "keyed_uniform",
    "logprobs",
    "sample",
]

# Below this, logits / T overflows float32 for logits near 1e33 and softmax gives NaN.
MIN_TEMPERATURE = 1e-5
_INT32_MAX = 2**31 - 1
_SEED_MAX = 2**63 - 1
_M64 = (1 << 64) - 1


def _s64(x: int) -> int:
    """The int64 with the bits of x mod 2^64 (torch scalars must fit int64)."""
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


_GOLDEN = _s64(0x9E3779B97F4A7C15)
_MIX1 = _s64(0xBF58476D1CE4E5B9)
_MIX2 = _s64(0x94D049BB133111EB)
_ONE_MINUS = 1.0 - 2.0**-24  # the largest float32 below 1


class Stream(enum.IntEnum):
    """Named random streams. A decision about the token at one position uses its own
    stream, so the draws of different decisions are independent.

    DRAFT_PROPOSAL: the draft model sampling its proposed token.
    ACCEPT: the rejection sampler's accept/reject draw (one uniform per draft token).
    RESIDUAL: the resample from the residual max(p - q, 0) after a rejection.
    BONUS: the target's extra token after all drafts of a request were accepted.
    TARGET_SAMPLE: plain target sampling outside speculation (prefill's first token,
    decode without a draft).
    """

    DRAFT_PROPOSAL = 1
    ACCEPT = 2
    RESIDUAL = 3
    BONUS = 4
    TARGET_SAMPLE = 5


DRAFT_PROPOSAL = Stream.DRAFT_PROPOSAL
ACCEPT = Stream.ACCEPT
RESIDUAL = Stream.RESIDUAL
BONUS = Stream.BONUS
TARGET_SAMPLE = Stream.TARGET_SAMPLE


# ---------------------------------------------------------------------------- parameters


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    v = int(value)
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def _check_real(name: str, value: object) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


@dataclass(frozen=True)
class SamplingParams:
    """How one request draws its tokens. temperature 0 is greedy (top_k, top_p and seed
    are then unused); top_k 0 and top_p 1 are off. seed None: a distinct seed is drawn
    when the request's parameters are first written (see SeedSource.resolve)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = _check_real("temperature", self.temperature)
        if t != 0 and not t >= MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {t}")
        k = _check_int("top_k", self.top_k, 0, _INT32_MAX)
        p = _check_real("top_p", self.top_p)
        if not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p}")
        seed = None if self.seed is None else _check_int("seed", self.seed, 0, _SEED_MAX)
        # Normalise numpy scalars to Python types so equal params hash equal.
        object.__setattr__(self, "temperature", t)
        object.__setattr__(self, "top_k", k)
        object.__setattr__(self, "top_p", p)
        object.__setattr__(self, "seed", seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_filter(self) -> bool:
        """Whether top-k or top-p may cut this row (top_p as the float32 it is stored as)."""
        return not self.greedy and (self.top_k > 0 or float(np.float32(self.top_p)) < 1)


class SeedSource:
    """Distinct seeds for requests that give none: base + i * odd constant mod 2^63 is a
    bijection in i, so no two of the first 2^63 coincide; the random base makes runs
    differ. Pass base for reproducible runs."""

    _STEP = (0x9E3779B97F4A7C15 & _SEED_MAX) | 1

    def __init__(self, base: int | None = None) -> None:
        self.base = secrets.randbits(63) if base is None else _check_int("base", base, 0, _SEED_MAX)
        self._counter = itertools.count()

    def next_seed(self) -> int:
        return (self.base + next(self._counter) * self._STEP) & _SEED_MAX

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """params with a concrete seed. Call once per request (at add time) so that the
        request keeps its seed, and its draws their keys, across steps."""
        return params if params.seed is not None else replace(params, seed=self.next_seed())


_DEFAULT_SEEDS = SeedSource()


class SamplingTensors:
    """Per-row sampling parameters on the device: greedy (bool), temperature (float32, 0
    on greedy rows), top_k (int32), top_p (float32), seed (int64), each [rows].

    Built once (`from_params`), or allocated once at a capacity and rewritten in place
    (`write_rows`) so that captured graphs keep reading the same addresses. Each write is
    one host-to-device copy (non-blocking from pinned memory). Host mirrors of the rows'
    modes give `any_filter` / `all_greedy` without reading the device."""

    _FIELDS = ("greedy", "temperature", "top_k", "top_p", "seed")

    def __init__(self, capacity: int, device: torch.device | str) -> None:
        capacity = _check_int("capacity", capacity, 0, _INT32_MAX)
        self.device = torch.device(device)
        kw = {"device": self.device}
        # Unwritten rows are greedy with no filter: finite output, no random draw used.
        self.greedy = torch.ones(capacity, dtype=torch.bool, **kw)
        self.temperature = torch.zeros(capacity, dtype=torch.float32, **kw)
        self.top_k = torch.zeros(capacity, dtype=torch.int32, **kw)
        self.top_p = torch.ones(capacity, dtype=torch.float32, **kw)
        self.seed = torch.zeros(capacity, dtype=torch.int64, **kw)
        self._host_greedy = np.ones(capacity, dtype=bool)
        self._host_filter = np.zeros(capacity, dtype=bool)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        device: torch.device | str,
        seeds: SeedSource | None = None,
    ) -> SamplingTensors:
        out = cls(len(params), device)
        out.write_rows(range(len(params)), params, seeds)
        return out

    def __len__(self) -> int:
        return self.seed.shape[0]

    @property
    def any_filter(self) -> bool:
        """False only if no row (of those this object can see) uses top-k or top-p."""
        return bool(self._host_filter.any())

    @property
    def all_greedy(self) -> bool:
        return bool(self._host_greedy.all())

    def write_rows(
        self,
        rows: Sequence[int],
        params: Sequence[SamplingParams],
        seeds: SeedSource | None = None,
    ) -> None:
        """Write params[i] into row rows[i], in place. Rows without a seed get a fresh one
        from `seeds` (default: a process-wide SeedSource); resolve seeds once per request
        beforehand to keep them stable across writes."""
        rows = [_check_int("rows[i]", r, 0, len(self) - 1) for r in rows]
        if len(rows) != len(params):
            raise ValueError(
                f"rows and params must have the same length, got {len(rows)} and {len(params)}"
            )
        if len(set(rows)) != len(rows):
            raise ValueError(f"rows must be distinct, got {rows}")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params must hold SamplingParams, got {type(p).__name__}")
        n = len(rows)
        if n == 0:
            return
        seeds = _DEFAULT_SEEDS if seeds is None else seeds
        resolved = [seeds.resolve(p) for p in params]
        start = rows[0]
        contiguous = rows == list(range(start, start + n))

        # One packed host buffer, 8-byte fields first so every view is aligned:
        # seed | row index (scattered only) | temperature | top_k | top_p | greedy.
        layout = [("seed", np.int64, torch.int64)]
        if not contiguous:
            layout.append(("row", np.int64, torch.int64))
        layout += [
            ("temperature", np.float32, torch.float32),
            ("top_k", np.int32, torch.int32),
            ("top_p", np.float32, torch.float32),
            ("greedy", np.bool_, torch.bool),
        ]
        values = {
            "seed": [p.seed for p in resolved],
            "row": rows,
            "temperature": [p.temperature for p in resolved],
            "top_k": [p.top_k for p in resolved],
            "top_p": [p.top_p for p in resolved],
            "greedy": [p.greedy for p in resolved],
        }
        nbytes = sum(n * np.dtype(nd).itemsize for _, nd, _ in layout)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        host_np = host.numpy()
        spans = {}
        off = 0
        for name, nd, td in layout:
            size = n * np.dtype(nd).itemsize
            host_np[off : off + size].view(nd)[:] = values[name]
            spans[name] = (off, off + size, td)
            off += size
        dev = host.to(self.device, non_blocking=True)
        fields = {name: dev[a:b].view(td) for name, (a, b, td) in spans.items()}
        for name in self._FIELDS:
            dst = getattr(self, name)
            if contiguous:
                dst[start : start + n].copy_(fields[name])
            else:
                dst.index_copy_(0, fields["row"], fields[name])
        self._host_greedy[rows] = [p.greedy for p in resolved]
        self._host_filter[rows] = [p.uses_filter for p in resolved]

    def narrow(self, start: int, length: int) -> SamplingTensors:
        """Rows [start, start + length) as views: later writes show through."""
        if start < 0 or length < 0 or start + length > len(self):
            raise ValueError(f"rows [{start}, {start + length}) must lie in [0, {len(self)})")
        out = object.__new__(SamplingTensors)
        out.device = self.device
        for name in self._FIELDS:
            setattr(out, name, getattr(self, name).narrow(0, start, length))
        out._host_greedy = self._host_greedy[start : start + length]
        out._host_filter = self._host_filter[start : start + length]
        return out

    def select(self, index: torch.Tensor) -> SamplingTensors:
        """Rows gathered by a device index (e.g. a request's row repeated K + 1 times for
        verification), in one launch on the Triton backend. Entries outside the table
        (padding: -1) read row 0 rather than trip a device assert inside a graph; their
        tokens are to be ignored. The host flags are those of
        all rows of self (conservative)."""
        if index.dtype not in (torch.int32, torch.int64) or index.dim() != 1:
            raise TypeError(
                f"index must be a 1-D int32/int64 tensor, got {index.dtype} "
                f"with shape {tuple(index.shape)}"
            )
        out = object.__new__(SamplingTensors)
        out.device = self.device
        if index.device == self.greedy.device and ops.backend_for(index) == "triton":
            # one launch for the five gathers (and the clamp)
            fields = kernels.gather_params(index, *(getattr(self, n) for n in self._FIELDS))
            for name, t in zip(self._FIELDS, fields):
                setattr(out, name, t)
        else:
            idx = index.to(self.device, torch.int64)
            idx = torch.where((idx >= 0) & (idx < self.greedy.shape[0]), idx, 0)
            for name in self._FIELDS:
                setattr(out, name, getattr(self, name).index_select(0, idx))
        out._host_greedy = self._host_greedy
        out._host_filter = self._host_filter
        return out


# --------------------------------------------------------------------------- random draws


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser, out of place: for [rows]-sized keys."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def _stream_key(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    h = _mix64(seed.to(torch.int64) + _GOLDEN)
    h = _mix64(h + (position.to(torch.int64) + 1) * _GOLDEN)
    return _mix64(h + _s64(_GOLDEN * (stream + 1)))


def _unit_from_hash_(x: torch.Tensor) -> torch.Tensor:
    """Finalise 64-bit counters x (destroyed) into float32 uniforms in (0, 1).

    In place over two int64 buffers: at [rows, V] every out-of-place op would allocate
    another [rows, V] tensor."""
    tmp = torch.empty_like(x)
    for shift, mul in ((30, _MIX1), (27, _MIX2), (31, None)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        tmp.bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(tmp)
        if mul is not None:
            x.mul_(mul)
    return _unit_from_bits(x, out=tmp)


def _unit_from_bits(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 in [2^-53, 1 - 2^-24] from the top 53 bits of x (out: int64 scratch)."""
    out = torch.empty_like(x) if out is None else out
    # Top 53 bits, made odd: < 2^53, so one exact step to double and a single rounding to
    # float32 on any backend; odd, so never 0.
    torch.bitwise_right_shift(x, 11, out=out)
    out.bitwise_and_((1 << 53) - 1).bitwise_or_(1)
    u = out.to(torch.float32)
    # The top 2^-25 of the range rounds to 1.0: clamp to the largest float32 below 1.
    return u.mul_(2.0**-53).clamp_max_(_ONE_MINUS)


def _check_stream(stream: int) -> int:
    try:
        return int(Stream(stream))
    except ValueError:
        raise ValueError(
            f"stream must be one of {[int(s) for s in Stream]} (Stream), got {stream!r}"
        ) from None


def keyed_uniform(
    seed: torch.Tensor, position: torch.Tensor, stream: int, num: int | None = None
) -> torch.Tensor:
    """Uniforms in (0, 1), float32, keyed by (seed, position, stream) (broadcast
    together). num None: one draw per key (counter 0), shape of the broadcast; num = V:
    shape [..., V], draw i independent per vocabulary index i."""
    stream = _check_stream(stream)
    for name, t in (("seed", seed), ("position", position)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32/int64 tensor, got {getattr(t, 'dtype', t)!r}")
    seed, position = torch.broadcast_tensors(seed, position)
    key = _stream_key(seed, position, stream)
    if num is None:
        return _unit_from_hash_(key + _GOLDEN)
    num = _check_int("num", num, 1, 2**40)
    ctr = torch.arange(1, num + 1, device=key.device, dtype=torch.int64).mul_(_GOLDEN)
    return _unit_from_hash_(key.unsqueeze(-1) + ctr)


def exponential_race(
    probs: torch.Tensor, seed: torch.Tensor, position: torch.Tensor, stream: int
) -> torch.Tensor:
    """One token per row drawn from probs [N, V] (need not be normalised): argmax of
    probs / E with E ~ Exp(1) i.i.d. per (row key, vocabulary index); P(i) = p_i / sum p.
    Zero-probability tokens never win (the row's best ratio is > 0). int64 [N]."""
    e = keyed_uniform(seed, position, stream, probs.shape[-1])
    e.neg_().log1p_().neg_()  # E = -log(1 - u): precise for small E, where winners are
    torch.div(probs, e, out=e)
    return e.argmax(dim=-1)


# -------------------------------------------------------------------------- distribution

_LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _as_tensors(
    params: SamplingTensors | SamplingParams | Sequence[SamplingParams], logits: torch.Tensor
) -> SamplingTensors:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a [N, V] tensor, got {getattr(logits, 'shape', logits)}")
    if logits.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"logits dtype must be one of {_LOGIT_DTYPES}, got {logits.dtype}")
    n = logits.shape[0]
    if isinstance(params, SamplingParams):
        params = [params] * n
    if not isinstance(params, SamplingTensors):
        # Convenience path (one copy to the device; not inside a graph).
        params = SamplingTensors.from_params(list(params), logits.device)
    if len(params) != n:
        raise ValueError(f"params must have one row per logits row ({n}), got {len(params)}")
    if params.seed.device != logits.device:
        raise ValueError(f"params are on {params.seed.device}, logits on {logits.device}")
    return params


def _filter_threshold(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest z value kept by top-k then top-p (-inf: keep all).

    Thresholds are values, compared with z in place afterwards: no scatter back through the
    sort permutation, and tie groups are kept or dropped whole by construction."""
    v = z.shape[-1]
    s = torch.sort(z, dim=-1, descending=True).values
    k = top_k.to(torch.int64)
    kth = s.gather(1, (k.clamp(1, v) - 1).unsqueeze(1)).squeeze(1)
    thr_k = torch.where((k > 0) & (k < v), kth, -math.inf)
    if v == 1:
        return thr_k
    # Unnormalised probabilities in descending order, zero past the top-k cut.
    e = s.sub(s[:, :1]).exp_()
    e.masked_fill_(s < thr_k.unsqueeze(1), 0.0)
    e.cumsum_(dim=-1)
    # Keep position j + 1 iff the mass before it (inclusive cumsum at j) < top_p * total.
    # amin instead of counting: a parallel cumsum need not be monotone in the last ulp.
    below = e[:, :-1] < (top_p * e[:, -1]).unsqueeze(1)
    thr_p = torch.where(below, s[:, 1:], math.inf).amin(dim=-1)
    thr_p = torch.minimum(thr_p, s[:, 0])  # the top token is always kept
    thr_p = torch.where(top_p < 1, thr_p, -math.inf)
    return torch.maximum(thr_k, thr_p)


def filtered_probs(
    logits: torch.Tensor,
    params: SamplingTensors | SamplingParams | Sequence[SamplingParams],
    *,
    any_filter: bool = True,
) -> torch.Tensor:
    """The exact distribution `sample` draws from: float32 [N, V], rows summing to 1 (see
    the module docstring for the rules). Rows need at least one finite logit.

    any_filter=False skips the sort and ignores top-k/top-p: a host-side promise by the
    caller, from the parameters it wrote (e.g. `params.any_filter`), that no row uses
    them; it is never decided from device values. Under graph capture the flag is baked
    into the graph."""
    params = _as_tensors(params, logits)
    greedy = params.greedy.unsqueeze(1)
    # Greedy rows divide by 1 (not 0) to stay finite; they are overwritten below.
    t = torch.where(params.greedy, 1.0, params.temperature).unsqueeze(1)
    z = torch.div(logits, t)  # a new float32 tensor: the in-place work below is ours
    if any_filter:
        thr = _filter_threshold(z, params.top_k, params.top_p)
        z.masked_fill_(z < thr.unsqueeze(1), -math.inf)
    z.sub_(z.amax(dim=-1, keepdim=True)).exp_()
    z.div_(z.sum(dim=-1, keepdim=True))
    # Greedy rows: one-hot at argmax(logits) (first index on ties, CPU and CUDA alike).
    top = logits.argmax(dim=-1, keepdim=True)
    at_top = torch.where(greedy, 1.0, z.gather(1, top))
    z.masked_fill_(greedy, 0.0)
    return z.scatter_(1, top, at_top)


def _fused(logits: torch.Tensor) -> bool:
    """Whether `sample` takes the Triton path (kernels/sampling.py) for these logits: the
    backend ops picks is Triton, and the kernels can run them (not bfloat16 under the
    interpreter, which computes it wrongly; the torch code is then the path)."""
    if logits.numel() == 0 or ops.backend_for(logits) != "triton":
        return False
    return logits.is_cuda or (kernels.INTERPRET and logits.dtype != torch.bfloat16)


def sample(
    logits: torch.Tensor,
    params: SamplingTensors | SamplingParams | Sequence[SamplingParams],
    positions: torch.Tensor,
    stream: int,
    *,
    any_filter: bool = True,
    all_greedy: bool = False,
    return_probs: bool = False,
    out_probs: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Tokens int64 [N] drawn from filtered_probs(logits, params) by an exponential race
    keyed by (params.seed, positions, stream); greedy rows take argmax(logits).

    positions [N]: absolute index of each drawn token in its sequence. any_filter and
    all_greedy are host-side promises from the caller (see filtered_probs): all_greedy
    skips the random draws. return_probs also returns the probs (e.g. the draft's q);
    out_probs (float32 [N, V], unit column stride, e.g. q[:, j]) receives them, written
    by the fused kernels directly (implies return_probs).

    With any_filter=False, where specdraft.ops picks the Triton backend for the logits'
    device, the fused kernels (kernels/sampling.py: three launches, logits read twice)
    compute the same: tokens equal up to float rounding of near-tied race ratios, probs
    to float32 rounding. Greedy-only calls without probs stay a plain argmax."""
    params = _as_tensors(params, logits)
    stream = _check_stream(stream)
    n = logits.shape[0]
    if not isinstance(positions, torch.Tensor) or positions.shape != (n,):
        raise ValueError(
            f"positions must be a [{n}] tensor, got {getattr(positions, 'shape', positions)}"
        )
    if positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"positions must be int32 or int64, got {positions.dtype}")
    return_probs = return_probs or out_probs is not None
    if all_greedy and not return_probs:
        return logits.argmax(dim=-1)
    if not any_filter and positions.device == logits.device and _fused(logits):
        tokens, probs = kernels.sample_tokens(
            logits,
            params.greedy,
            params.temperature,
            params.seed,
            positions,
            stream,
            return_probs=return_probs,
            all_greedy=all_greedy,
            out_probs=out_probs,
        )
        return (tokens, probs) if return_probs else tokens
    if out_probs is not None and (
        not isinstance(out_probs, torch.Tensor) or out_probs.shape != logits.shape
    ):
        raise ValueError(
            f"out_probs must be a [{n}, {logits.shape[-1]}] tensor, got "
            f"{getattr(out_probs, 'shape', out_probs)}"
        )
    probs = filtered_probs(logits, params, any_filter=any_filter)
    if all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        # Greedy rows are one-hot, so the race returns their argmax too.
        tokens = exponential_race(probs, params.seed, positions, stream)
    if out_probs is not None:
        probs = out_probs.copy_(probs)
    return (tokens, probs) if return_probs else tokens


def logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax of the raw logits, float32 (the model's log-probabilities, before
    temperature and filtering), for generate's optional per-token logprobs."""
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32)
