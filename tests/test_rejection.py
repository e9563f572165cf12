"""The rejection sampler (kernels/rejection.py, specdraft/rejection.py).

CPU: the kernels under the Triton interpreter (fp32 / fp16, small vocabularies, tiles
shrunk so that multi-block partials, the narrowing passes of the top-k / top-p search
and multi-block races all run). References, float64, in this file: `ref_filtered64`
(the sampling module's rules, written independently) and `ref_rejection` (the same
keyed draws from specdraft.sampling.keyed_uniform). GPU (marked): bf16 and 128k
vocabularies against the reference, CUDA-graph replay, no host sync, 200k-trial
losslessness.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specdraft.kernels import rejection as kr
from specdraft.rejection import RejectionSampler, rejection_sample_torch
from specdraft.sampling import (
    ACCEPT,
    BONUS,
    DRAFT_PROPOSAL,
    RESIDUAL,
    SamplingParams,
    SamplingTensors,
    filtered_probs,
    keyed_uniform,
    sample,
)

SP = SamplingParams
gpu = pytest.mark.gpu
interp = pytest.mark.interpreter
# The same checks through the interpreter (CPU) and compiled (GPU, tl.exp approximate).
DEVICES = [pytest.param("cpu", marks=interp), pytest.param("cuda", marks=gpu)]

# ------------------------------------------------------------------------ references


def ref_filtered64(logits, greedy, temp, top_k, top_p) -> torch.Tensor:
    """float64 probabilities from the definitions (z itself is float32 logits / T):
    top-k keeps z >= the k-th largest value; top-p keeps a survivor iff the mass of the
    strictly more probable survivors is < top_p; greedy rows are one-hot argmax."""
    n, v = logits.shape
    t = torch.where(greedy, torch.ones_like(temp), temp)
    z = (logits.float() / t[:, None]).double()
    k = top_k.long()
    use_k = (~greedy) & (k > 0) & (k < v)
    kth = z.sort(dim=1, descending=True).values.gather(1, (k.clamp(1, v) - 1)[:, None])
    keep = ~use_k[:, None] | (z >= kth)
    e = torch.where(keep, (z - z.amax(1, keepdim=True)).exp(), 0.0)
    probs = e / e.sum(1, keepdim=True)
    use_p = (~greedy) & (top_p.double() < 1)
    # Mass strictly before each value: the exclusive cumsum in descending order, read at
    # the first index of the value's tie group.
    s, order = z.sort(dim=1, descending=True, stable=True)
    ps = probs.gather(1, order)
    excl = ps.cumsum(1) - ps
    first = torch.searchsorted(-s, -s, side="left")
    before = torch.empty_like(probs).scatter_(1, order, excl.gather(1, first))
    keep &= ~use_p[:, None] | (before < top_p.double()[:, None])
    e = torch.where(keep, e, 0.0)
    probs = e / e.sum(1, keepdim=True)
    onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], onehot, probs)


def ref_rejection(logits, drafts, q, st, positions, *, p=None, accept_rule=None):
    """Tokens [B, K+1], num_accepted, num_emitted in float64 with the kernel's keyed
    draws. `p` [B, K+1, V] skips ref_filtered64 (context-free trials); `accept_rule(p, q,
    u)` replaces the acceptance test (to show the losslessness test can fail)."""
    b, k_max = drafts.shape
    v = logits.shape[-1]
    rep = lambda x: x.repeat_interleave(k_max + 1)  # noqa: E731
    if p is None:
        p = ref_filtered64(logits, rep(st.greedy), rep(st.temperature), rep(st.top_k),
                           rep(st.top_p)).view(b, k_max + 1, v)  # fmt: skip
    argmax = logits.view(b, k_max + 1, v).argmax(-1)
    k = (drafts != -1).int().cumprod(1).sum(1)  # ids before the first -1
    j = torch.arange(k_max)
    present = j[None, :] < k[:, None]
    x = drafts.clamp(min=0)
    px = p[:, :k_max].gather(2, x[..., None])[..., 0]
    qx = q.double().gather(2, x[..., None])[..., 0] if q is not None else torch.ones_like(px)
    u = keyed_uniform(st.seed[:, None], positions[:, None] + j, ACCEPT).double()
    if accept_rule is None:
        acc = (px > 0) & ((px >= qx) | (u * qx < px))
    else:
        acc = accept_rule(px, qx, u)
    acc = torch.where(st.greedy[:, None], drafts == argmax[:, :k_max], acc) & present
    r = torch.cat([torch.where(present & ~acc, j, k_max), k[:, None]], 1).amin(1)
    pr = p[torch.arange(b), r]
    qr = q[torch.arange(b), r.clamp(max=k_max - 1)].double() if q is not None and k_max else 0 * pr
    residual = (r < k)[:, None]
    w = torch.where(residual, (pr - qr).clamp(min=0), pr)
    e = {
        s: -torch.log1p(-keyed_uniform(st.seed, positions + r, s, v).double())
        for s in (RESIDUAL, BONUS)
    }
    race = (w / torch.where(residual, e[RESIDUAL], e[BONUS])).argmax(1)
    token = torch.where(st.greedy, argmax[torch.arange(b), r], race)
    out = torch.where(j[None, :] < r[:, None], drafts, -1)
    out = torch.cat([out, torch.full((b, 1), -1)], 1)
    out[torch.arange(b), r] = token
    return out, r.int(), (r + 1).int()


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic, bins expecting < 5 pooled; a draw of a zero-probability token
    gives inf."""
    n = counts.sum()
    exp = probs * n
    if counts[exp == 0].sum() > 0:
        return math.inf, 0
    small = (exp < 5) & (exp > 0)
    o, e = list(counts[exp >= 5].astype(float)), list(exp[exp >= 5])
    if small.any():
        o.append(counts[small].sum())
        e.append(exp[small].sum())
    o, e = np.array(o), np.array(e)
    if len(e) > 1 and e[-1] < 5:  # the pool of small bins is itself small: merge it
        o[-2] += o[-1]
        e[-2] += e[-1]
        o, e = o[:-1], e[:-1]
    return float(((o - e) ** 2 / e).sum()), len(e) - 1


def chi_limit(df: int) -> float:
    return df + 10 * math.sqrt(2 * df)


# --------------------------------------------------------------------------- helpers


class Batch:
    """Inputs and poisoned outputs of one rejection_sample call."""

    def __init__(self, logits, drafts, q, st, positions, config=None):
        b, k = drafts.shape
        v = logits.shape[-1]
        dev = logits.device
        self.args = (logits, drafts, q, st.greedy, st.temperature, st.top_k, st.top_p,
                     st.seed, positions)  # fmt: skip
        self.st, self.positions = st, positions
        self.tokens = torch.full((b, k + 1), -7, dtype=torch.int64, device=dev)
        self.nacc = torch.full((b,), -7, dtype=torch.int32, device=dev)
        self.nemit = torch.full((b,), -7, dtype=torch.int32, device=dev)
        self.prop = torch.zeros(k, dtype=torch.int64, device=dev)
        self.accd = torch.zeros(k, dtype=torch.int64, device=dev)
        cfg = config or kr.choose_rejection_config(v, b, k)
        self.ws = kr.RejectionWorkspace.allocate(b, k, v, dev, cfg)

    def outs(self):
        return (self.tokens, self.nacc, self.nemit, self.prop, self.accd)

    def run(self, **kw):
        kr.rejection_sample(*self.args, *self.outs(), self.ws, **kw)
        return self.tokens, self.nacc, self.nemit


def make_params(b, kinds, device="cpu", seed0=0) -> SamplingTensors:
    """kinds: a list of SamplingParams cycled over the b requests (seeds made distinct)."""
    ps = [SP(kinds[i % len(kinds)].temperature, kinds[i % len(kinds)].top_k,
             kinds[i % len(kinds)].top_p, seed=seed0 + 7919 * i + 1) for i in range(b)]  # fmt: skip
    return SamplingTensors.from_params(ps, device)


def random_case(b, k, v, kinds, *, dtype=torch.float32, ties=False, device="cpu", gen=None):
    """Random logits (quantized to force ties when asked), drafts with random k[b] that
    often copy the target's argmax or q's mode (so walks go deep), q rows normalized."""
    g = gen or torch.Generator().manual_seed(0)
    logits = torch.randn(b * (k + 1), v, generator=g) * 2
    if ties:
        logits = (logits * 2).round() / 2
    logits = logits.to(dtype)
    q = torch.softmax(torch.randn(b, k, v, generator=g) * 2, -1)
    am = logits.float().view(b, k + 1, v)[:, :k].argmax(-1)
    drafts = torch.where(
        torch.rand(b, k, generator=g) < 0.6, am, torch.randint(0, v, (b, k), generator=g)
    )
    kk = torch.randint(0, k + 1, (b,), generator=g)
    drafts[torch.arange(k)[None, :] >= kk[:, None]] = -1
    st = make_params(b, kinds, device)
    positions = torch.randint(0, 10**6, (b,), generator=g)
    return logits.to(device), drafts.to(device), q.to(device), st, positions.to(device)


SMALL_TILES = kr.RejectionConfig(
    block_v=4,
    rows_p=4,
    block_t=4,
    cap=2,
    nbin=2,
    block_r=4,
    sub_r=2,
    rows_w=2,
    rows_t=2,
    rows_r=2,
)
# Many narrowing passes over a wider vocabulary at a bearable interpreter cost.
NARROW_TILES = kr.RejectionConfig(
    block_v=64,
    rows_p=8,
    block_t=64,
    cap=4,
    nbin=4,
    block_r=64,
    sub_r=16,
    rows_w=4,
    rows_t=8,
    rows_r=4,
)
# A larger pairwise scratch (8) and 8 bins a pass: the windows fit it after a pass or two.
BAND_TILES = kr.RejectionConfig(
    block_v=32,
    rows_p=4,
    block_t=64,
    cap=8,
    nbin=8,
    block_r=64,
    sub_r=16,
    rows_w=4,
    rows_t=4,
    rows_r=4,
)
# BAND_TILES with one row per cut program and one request per race program (the GPU's
# layout at large vocabularies).
ROW_TILES = dataclasses.replace(BAND_TILES, rows_t=1, rows_r=1)
# ROW_TILES with the one-pass bracket first (the GPU's default at large vocabularies):
# a scratch that holds the bracket, and one so small (one slot a lane too) that most
# rows finish on the narrowing passes from whatever interval the bracket's pass left.
# Both without fuse_kp (each row's top-p cut its own), which FUSED_TILES turns on.
FAST_TILES = dataclasses.replace(ROW_TILES, cap_f=128, sample_f=32, fuse_kp=False)
FAST_SMALL_TILES = dataclasses.replace(ROW_TILES, cap_f=4, sample_f=16, lanes_f=1, fuse_kp=False)
# FAST_TILES with a row's top-p cut taken from its top-k cut's bracket (fuse_kp)
FUSED_TILES = dataclasses.replace(FAST_TILES, fuse_kp=True)
# FUSED_TILES with brackets of up to 32 values sorted 32 wide (small_f): v = 203 has both
SORT32_TILES = dataclasses.replace(FUSED_TILES, small_f=32)
# and the top-k cut's sample 8 values (sample_k): wider brackets, more tries and misses
SAMPLE8_TILES = dataclasses.replace(SORT32_TILES, sample_k=8)
# FUSED_TILES with the top-p bracket of rows without top-k split over programs of 64
# columns (split_f; four chunks of v = 203, the last one short), sorted in its full or
# its narrow width, in two 128-column chunks, and with a 4-value scratch (most brackets
# overflow it and go to the narrowing launch)
SPLIT_TILES = dataclasses.replace(FUSED_TILES, split_f=64, rows_s=2)  # programs loop over rows
SPLIT_VARIANTS = (SPLIT_TILES, dataclasses.replace(SPLIT_TILES, small_f=32, split_f=32),
                  dataclasses.replace(FUSED_TILES, split_f=128),
                  dataclasses.replace(FAST_SMALL_TILES, split_f=64))  # fmt: skip
# The brackets' cuts by bisection over their values (bisect_f): the one-row bracket (top-k
# and top-p, sorted where fuse_kp takes the top-p cut from the top-k bracket) and the
# split close; binary steps, or interpolated ones (interp_f)
BISECT_VARIANTS = (dataclasses.replace(FAST_TILES, bisect_f=True),
                   dataclasses.replace(FUSED_TILES, bisect_f=True),
                   dataclasses.replace(SPLIT_TILES, bisect_f=True),
                   dataclasses.replace(FAST_TILES, bisect_f=True, interp_f=True),
                   dataclasses.replace(SPLIT_TILES, bisect_f=True, interp_f=True))  # fmt: skip
# The bracket pass taking two chunks of 8 columns a lane an iteration (loads_f 16) over 8
# lanes, so that a row takes two iterations, the last one part past V: one-slot lanes that
# overflow, 16-slot lanes with the bisection, and the fused top-k / top-p bracket.
LOADS_VARIANTS = (dataclasses.replace(FAST_SMALL_TILES, loads_f=16, block_t=8),
                  dataclasses.replace(FAST_TILES, loads_f=16, block_t=8, lanes_f=16,
                                      bisect_f=True),
                  dataclasses.replace(FUSED_TILES, loads_f=16, block_t=8))  # fmt: skip
# The race drawn over lists of each block's kept columns (pack_r): lists that hold every
# filtered row's block, lists of 8 that the wider kept sets overflow (those blocks draw
# over every column), and 4-request race tiles (a tile with an unfiltered request draws
# over every column).
PACK_VARIANTS = (dataclasses.replace(ROW_TILES, pack_r=64),
                 dataclasses.replace(ROW_TILES, pack_r=8),
                 dataclasses.replace(BAND_TILES, pack_r=16, stages_r=2))  # fmt: skip
KINDS = [SP(0.0), SP(1.0), SP(0.7, top_k=5), SP(1.3, top_p=0.8), SP(0.5, top_k=9, top_p=0.6),
         SP(2.0, top_k=1), SP(1.0, top_p=0.05), SP(1.0, top_k=40)]  # fmt: skip


# ------------------------------------------------------------------------ keyed draws


@triton.jit
def _draws_kernel(
    seed_ptr, pos_ptr, u_ptr, e_ptr, V, STREAM_MUL: tl.constexpr, BLOCK: tl.constexpr
):
    i = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    h = kr._stream_key(tl.load(seed_ptr + i), tl.load(pos_ptr + i), STREAM_MUL)
    u = kr._uniform(h, offs.to(tl.uint64))
    tl.store(u_ptr + i * V + offs, u, mask=offs < V)
    tl.store(e_ptr + i * V + offs, kr._exponential(u), mask=offs < V)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stream", [ACCEPT, RESIDUAL, BONUS])
def test_uniforms_bit_equal_to_keyed_uniform(stream, device):
    seed = torch.tensor([0, 1, 2**63 - 1, 2**62 + 12345, 987654321], dtype=torch.int64)
    pos = torch.tensor([0, 2**40 + 3, 17, 2**31, 5], dtype=torch.int64)
    v = 37
    u = torch.empty(5, v, device=device)
    e = torch.empty(5, v, device=device)
    _draws_kernel[(5,)](seed.to(device), pos.to(device), u, e, v, kr._stream_mul(int(stream)), 64)
    u, e = u.cpu(), e.cpu()
    ref = keyed_uniform(seed[:, None], pos[:, None], stream, v)[:, 0]
    assert torch.equal(u.view(torch.int32), ref.view(torch.int32))
    # E = -log1p(-u) to float32 rounding, 2 ulps (libdevice log1pf: 1 ulp).
    ref_e = -torch.log1p(-ref.double())
    assert ((e.double() - ref_e).abs() / ref_e).max() < 2.5e-7
    # Counter 0 is the acceptance draw (one per key).
    one = keyed_uniform(seed, pos, stream)
    assert torch.equal(u[:, 0].view(torch.int32), one.view(torch.int32))


# ------------------------------------------------------------------ parity with reference


def _check_against_reference(logits, drafts, q, st, positions, config=None, **kw):
    batch = Batch(logits, drafts, q, st, positions, config)
    tokens, nacc, nemit = batch.run(**kw)
    rt, rn, re = ref_rejection(logits.cpu(), drafts.cpu(), q.cpu() if q is not None else None,
                               _cpu(st), positions.cpu())  # fmt: skip
    assert torch.equal(tokens.cpu(), rt), (tokens, rt)
    assert torch.equal(nacc.cpu(), rn) and torch.equal(nemit.cpu(), re)
    k = (drafts != -1).sum(1).cpu()
    j = torch.arange(drafts.shape[1])
    assert torch.equal(batch.prop.cpu(), (j[None, :] < k[:, None]).sum(0))
    assert torch.equal(batch.accd.cpu(), (j[None, :] < rn[:, None]).sum(0))
    return batch


def _cpu(st):
    out = SamplingTensors(0, "cpu")
    for name in SamplingTensors._FIELDS:
        setattr(out, name, getattr(st, name).cpu())
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b, k, v", [(6, 1, 16), (13, 3, 16), (5, 5, 42), (3, 0, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tiles", ["default", "small", "rows", "lazy"])
def test_greedy_matches_reference(b, k, v, dtype, tiles, device):
    g = torch.Generator().manual_seed(b * 100 + k)
    logits, drafts, _, _, pos = random_case(
        b, k, v, [SP(0.0)], dtype=dtype, ties=True, gen=g, device=device
    )
    st = make_params(b, [SP(0.0)], device)
    cfg = SMALL_TILES if tiles == "small" else None
    if tiles == "rows":  # one target row per program
        cfg = dataclasses.replace(kr.choose_rejection_config(v, b, k), row_g=True)
    if tiles == "lazy":  # groups of 8 columns keep the slice that raised their max
        cfg = dataclasses.replace(kr.choose_rejection_config(v, b, k), lazy_g=True, sub_g=8)
    _check_against_reference(logits, drafts, None, st, pos, cfg)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b, k, v", [(8, 3, 16), (9, 2, 23), (4, 5, 64)])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("tiles", ["default", "small"])
def test_probabilistic_matches_reference(b, k, v, ties, tiles, device):
    g = torch.Generator().manual_seed(b * 1000 + k * 10 + ties)
    logits, drafts, q, st, pos = random_case(b, k, v, KINDS, ties=ties, gen=g, device=device)
    cfg = SMALL_TILES if tiles == "small" else None
    _check_against_reference(logits, drafts, q, st, pos, cfg)


# ----------------------------------------------------------- the filter, as sampling's


def _kernel_probs(logits, st, config=None):
    """The kernel's p per row (K = 0: one row per request), from its workspace."""
    n, v = logits.shape
    dev = logits.device
    drafts = torch.empty(n, 0, dtype=torch.int64, device=dev)
    q = torch.empty(n, 0, v, device=dev)
    batch = Batch(logits, drafts, q, st, torch.arange(n, device=dev), config)
    batch.run()
    ws = batch.ws
    z = logits.float() / torch.where(st.greedy, 1.0, st.temperature)[:, None]
    keep = z >= ws.row_thr[:n, None]
    p = torch.where(keep, (z - ws.row_max[:n, None]).exp(), 0.0) / ws.row_sum[:n, None]
    return p, keep, z


def _filter_rows(v, g):
    ln = math.log
    rows, params = [], []
    # Exact boundary cases (from sampling's own tests) padded with -inf to width v.
    pad = lambda xs: xs + [-math.inf] * (v - len(xs))  # noqa: E731
    for lg, sp in [
        ([3.0, 1.0, 3.0, 3.0], SP(top_k=1)),
        ([ln(4), ln(2), 0.0, 0.0], SP(top_p=0.75 + 1e-4)),
        ([ln(4), ln(2), 0.0, 0.0], SP(top_p=0.75 - 1e-4)),
        ([ln(4), ln(2), 0.0, 0.0], SP(top_p=1e-6)),
        ([ln(4), ln(2), 0.0, 0.0], SP(top_k=2, top_p=0.7)),
    ]:
        rows.append(pad(lg))
        params.append(sp)
    kinds = [SP(1.0, top_k=1), SP(1.0, top_k=3), SP(0.5, top_k=v - 1), SP(1.0, top_k=v),
             SP(1.0, top_k=v + 5), SP(1.0, top_p=0.5), SP(2.0, top_p=0.9), SP(1.0, top_p=0.999999),
             SP(0.3, top_p=0.01), SP(1.0, top_k=7, top_p=0.7), SP(1.0, top_k=2, top_p=0.99),
             SP(1.0), SP(0.7)]  # fmt: skip
    for i, sp in enumerate(kinds * 3):
        x = torch.randn(v, generator=g) * 3
        if i % 3 == 1:
            x = (x * 1.5).round() / 1.5  # big tie groups
        if i % 3 == 2:
            x[torch.rand(v, generator=g) < 0.3] = -math.inf  # masked vocabulary
        rows.append(x.tolist())
        params.append(sp)
    for i, sp in enumerate([SP(1.0, top_p=0.9), SP(1.0, top_p=0.99), SP(0.8, top_k=9, top_p=0.9),
                            SP(1.0, top_p=0.5)] * 2):  # fmt: skip
        # Peaked: one lifted token per few positions over a flat background (the band
        # floor from the block partials rises to just under the lifted tokens).
        x = torch.randn(v, generator=g)
        lift = torch.arange(0, v, 5 + i)
        x[lift] += 6 + 3 * torch.rand(len(lift), generator=g)
        rows.append(x.tolist())
        params.append(sp)
    rows.append([2.0] * v)  # one tie group: every filter keeps all
    params.append(SP(1.0, top_k=3, top_p=0.2))
    return torch.tensor(rows), params


def _top_p_boundary(logits: torch.Tensor, sp: SP) -> torch.Tensor:
    """Tokens whose float64 mass strictly above them lies within 1e-5 of top_p."""
    z = logits.double() / sp.temperature
    probs = torch.softmax(z, dim=0)
    above = torch.stack([probs[probs > p].sum() for p in probs])
    return (above - sp.top_p).abs() < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "v, tiles",
    [(16, "default"), (16, "small"), (203, "narrow"), (203, "band"), (203, "fast"),
     (203, "fast_small"), (203, "fused"), (203, "sort32"), (203, "sample8")],
)  # fmt: skip
def test_threshold_matches_sampling(v, tiles, device):
    """Kept set exactly filtered_probs' (ties, boundaries, -inf, k >= V), probabilities
    equal to float32 rounding. Small scratch (2 or 4 candidates) makes the narrowing
    passes run, many times at v = 203, and tie groups larger than the scratch end
    them at a single key. Cut programs hold 2 (small), 4 (band), 8 (narrow) or many
    (default) rows, each tile mixing filters."""
    g = torch.Generator().manual_seed(v)
    logits, params = _filter_rows(v, g)
    st = SamplingTensors.from_params(
        [SP(p.temperature, p.top_k, p.top_p, seed=1) for p in params], device
    )
    cfg = {"default": None, "small": SMALL_TILES, "narrow": NARROW_TILES, "band": BAND_TILES,
           "fast": FAST_TILES, "fast_small": FAST_SMALL_TILES,
           "fused": FUSED_TILES, "sort32": SORT32_TILES,
           "sample8": SAMPLE8_TILES}[tiles]  # fmt: skip
    p, keep, z = (t.cpu() for t in _kernel_probs(logits.to(device), st, cfg))
    want = filtered_probs(logits, _cpu(st))
    ref = ref_filtered64(logits, *(getattr(_cpu(st), f) for f in SamplingTensors._FIELDS[:4]))
    for i in range(len(params)):
        kept = keep[i] & (z[i] > -math.inf)
        differ = kept != (want[i] > 0)
        # Only a token whose top-p decision rests on float32 rounding may differ: the
        # mass of the tokens strictly above it is within 1e-5 of top_p (top_p 0.999999
        # puts the whole tail there; the kernel and torch.cumsum sum in other orders).
        assert not (differ & ~_top_p_boundary(logits[i], params[i])).any(), (i, params[i])
        assert torch.equal(want[i] > 0, ref[i] > 0), (i, params[i])
    torch.testing.assert_close(p, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_bracket_placement_resolves_rows_in_one_try(device):
    """The one-pass bracket's placement from the sorted sample, alone and with the top-p
    rows' pass split over programs (split_f): on gaussian rows (two scales, T 1 and 0.7)
    with top-p 0.9, top-k 50 and both, every row's cut is found in the bracket launch or
    the split ones (none left to the narrowing launch in ws.todo) and the thresholds and
    kept masses are the same bit for bit. The answer does not depend on the bracket, so
    this is the test that a placement puts the cut inside it (an empty or misplaced
    bracket leaves rows to todo)."""
    n, v = 12, 2048
    g = torch.Generator().manual_seed(50)
    logits = torch.randn(n, v, generator=g) * torch.tensor([1.0, 3.0]).repeat(n // 2)[:, None]
    kinds = [SP(1.0, top_p=0.9), SP(0.7, top_k=50), SP(1.0, top_k=50, top_p=0.9)]
    st = SamplingTensors.from_params([SP(kinds[i % 3].temperature, kinds[i % 3].top_k,
                                         kinds[i % 3].top_p, seed=1) for i in range(n)],
                                     device)  # fmt: skip
    base = dataclasses.replace(ROW_TILES, block_t=512, cap_f=512, sample_f=256, tries_f=1,
                               screen=False)  # fmt: skip
    outs = []
    for split, rows_s in ((0, 64), (256, 64), (512, 1)):
        cfg = dataclasses.replace(base, split_f=split, rows_s=rows_s)
        drafts = torch.empty(n, 0, dtype=torch.int64, device=device)
        batch = Batch(logits.to(device), drafts, torch.empty(n, 0, v, device=device), st,
                      torch.arange(n, device=device), cfg)  # fmt: skip
        batch.ws.todo.fill_(-1)
        batch.ws.split_n.fill_(-1)
        batch.run()
        assert batch.ws.todo[:n].tolist() == [0] * n, (split, batch.ws.todo[:n].tolist())
        if split:  # the split launches took exactly the rows without top-k, bracket and all
            opened = [int(c) > 0 for c in batch.ws.split_n[:n].tolist()]
            assert opened == [i % 3 == 0 for i in range(n)], opened
        outs.append((batch.ws.row_thr[:n].cpu(), batch.ws.row_sum[:n].cpu()))
    assert all(torch.equal(a, b) for out in outs[1:] for a, b in zip(outs[0], out))


MIXED = [SP(0.0), SP(1.0), SP(1.0, top_p=0.9), SP(0.8, top_p=0.5), SP(1.0, top_k=9),
         SP(1.2, top_k=40, top_p=0.9), SP(1.0, top_k=3, top_p=0.2),
         SP(0.5, top_p=0.99)]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", ["band", "narrow", "default", "fast"])
@pytest.mark.parametrize("ties", [False, True])
def test_wide_band_mixed_modes_match_reference(tiles, ties, device):
    """Flat N(0, 3^2) rows (a top-p band of many tokens, the cut deep inside it: several
    narrowing passes over the compacted band, or over the row where it overflows the
    scratch) with every mode in one batch, tie groups at the boundary when quantized.
    The workspace's per-row outputs are poisoned first: every row must be written; the
    kept sets and the tokens are the references'."""
    b, k, v = 8, 2, 203
    g = torch.Generator().manual_seed(2000 + ties * 7 + len(tiles))
    logits = torch.randn(b * (k + 1), v, generator=g) * 3
    if ties:
        logits = (logits * 1.5).round() / 1.5
    q = torch.softmax(torch.randn(b, k, v, generator=g) * 2, -1)
    am = logits.view(b, k + 1, v)[:, :k].argmax(-1)
    drafts = torch.where(torch.rand(b, k, generator=g) < 0.5, am,
                         torch.randint(0, v, (b, k), generator=g))  # fmt: skip
    st = make_params(b, MIXED, seed0=int(torch.randint(0, 1000, (1,), generator=g)))
    pos = torch.randint(0, 10**6, (b,), generator=g)
    cfg = {"default": None, "narrow": NARROW_TILES, "band": BAND_TILES, "fast": FAST_TILES}[tiles]
    # Unscreened: every filtered row gets its cut (checked below); screening has its own tests.
    cfg = dataclasses.replace(cfg or kr.choose_rejection_config(v, b, k), screen=False)
    batch = Batch(logits.to(device), drafts.to(device), q.to(device), _on(st, device),
                  pos.to(device), cfg)  # fmt: skip
    for t in (batch.ws.row_thr, batch.ws.row_sum, batch.ws.row_max):
        t.fill_(float("nan"))
    batch.ws.cand.fill_(float("nan"))  # scratch left over from an earlier call
    tokens, nacc, nemit = (x.cpu() for x in batch.run())
    rt, rn, re = ref_rejection(logits, drafts, q, st, pos)
    assert torch.equal(tokens, rt) and torch.equal(nacc, rn) and torch.equal(nemit, re)
    ws = batch.ws
    n = b * (k + 1)
    assert bool(torch.isfinite(ws.row_sum[:n]).all()) and not bool(ws.row_thr[:n].isnan().any())
    rep = torch.arange(b).repeat_interleave(k + 1)
    stv = st.select(rep)
    want = filtered_probs(logits, stv) > 0
    z = logits / torch.where(stv.greedy, 1.0, stv.temperature)[:, None]
    keep = (z >= ws.row_thr[:n, None].cpu()) & (z > -math.inf)
    for i in torch.nonzero(~stv.greedy).flatten().tolist():
        sp = MIXED[int(rep[i]) % len(MIXED)]
        differ = keep[i] != want[i]
        assert not (differ & ~_top_p_boundary(logits[i], sp)).any(), (i, sp)
    # A second call with the same inputs: the same thresholds, bit for bit.
    thr, tot = ws.row_thr.clone(), ws.row_sum.clone()
    batch.run()
    assert torch.equal(ws.row_thr, thr) and torch.equal(ws.row_sum, tot)


def _filter_batch(seed: int, k: int, v: int, kinds: list, seed0: int) -> tuple:
    """_filter_rows' rows (padded to whole requests with rounded N(0, 3^2) rows) as a batch
    of requests cycling `kinds`: logits, drafts (half the target's argmax), q, params and
    positions."""
    g = torch.Generator().manual_seed(seed)
    rows, _ = _filter_rows(v, g)
    b = -(-rows.shape[0] // (k + 1))
    extra = b * (k + 1) - rows.shape[0]
    logits = torch.cat([rows, (torch.randn(extra, v, generator=g) * 3).round()])
    st = make_params(b, kinds, seed0=seed0)
    q = torch.softmax(torch.randn(b, k, v, generator=g) * 2, -1)
    am = logits.view(b, k + 1, v)[:, :k].argmax(-1)
    drafts = torch.where(torch.rand(b, k, generator=g) < 0.5, am,
                         torch.randint(0, v, (b, k), generator=g))  # fmt: skip
    pos = torch.randint(0, 10**6, (b,), generator=g)
    return logits, drafts, q, st, pos


def _tile_variants(device: str) -> list:
    """test_tiles_bit_equal_to_one_row_per_program's tiles, ROW_TILES (its reference)
    first."""
    tiles = (ROW_TILES, BAND_TILES, dataclasses.replace(BAND_TILES, rows_t=64, rows_r=64),
             FAST_TILES, FAST_SMALL_TILES, FUSED_TILES,
             dataclasses.replace(FAST_SMALL_TILES, fuse_kp=True), SORT32_TILES,
             dataclasses.replace(FAST_TILES, small_f=32), SAMPLE8_TILES, *SPLIT_VARIANTS,
             *BISECT_VARIANTS, *LOADS_VARIANTS, *PACK_VARIANTS)  # fmt: skip
    return [dataclasses.replace(c, screen=s) for s in (False, True) for c in tiles]


# On the GPU the variants run in this many groups, each its own test (a compile is ~10 s
# a variant: one test of all of them took 250 s, longer than any other process of the GPU
# suite); the interpreter, one process, takes them all in one (group None).
TILE_GROUPS = 6


@pytest.mark.parametrize(
    "device, group",
    [pytest.param("cpu", None, marks=interp)]
    + [pytest.param("cuda", g, marks=gpu) for g in range(TILE_GROUPS)],
)
def test_tiles_bit_equal_to_one_row_per_program(device, group):
    """Cut tiles of 4 and 64 rows and race tiles of 4 and 64 requests against one row
    and one request per program (ROW_TILES), on tiles that mix every mode: the rows of
    _filter_rows (boundary cases, tie groups, -inf, a single tie group) under requests
    with top-k, top-p, both, neither or greedy (top-k 1 and >= V among them), and padded
    requests; four race blocks per row, so each request's own ticket picks its last
    program; and races drawn over lists of the kept columns (PACK_VARIANTS).
    Thresholds, kept masses, race winners, tokens and counters are the same bit
    for bit; the kept sets are filtered_probs' and the tokens the reference's. The same
    tiles screened (only the rows a decision needs get a cut): the same race winners,
    tokens and counters. A GPU group takes every TILE_GROUPS-th variant after ROW_TILES."""
    k, v = 2, 203
    kinds = [*MIXED, SP(1.0, top_k=1), SP(0.7, top_k=v + 5, top_p=0.8), SP(0.9, top_k=v)]
    logits, drafts, q, st, pos = _filter_batch(31, k, v, kinds, 11)
    b = drafts.shape[0]
    pos[[2, 9]] = -1
    sampled = ~st.greedy & (pos >= 0)
    outs = []
    tiles = _tile_variants(device)
    if group is not None:
        tiles = tiles[:1] + tiles[1:][group::TILE_GROUPS]
    for cfg in tiles:
        batch = Batch(logits.to(device), drafts.to(device), q.to(device), _on(st, device),
                      pos.to(device), cfg)  # fmt: skip
        ws = batch.ws
        for t in (ws.row_thr, ws.row_sum, ws.race_val):
            t.fill_(float("nan"))
        ws.race_idx.fill_(-1)
        batch.run()
        assert int(ws.done.abs().sum()) == 0, cfg
        race = (ws.race_val[sampled.to(device)], ws.race_idx[sampled.to(device)])
        outs.append([t.cpu() for t in (*batch.outs(), ws.row_thr, ws.row_sum, *race)])
    for cfg, out in zip(tiles[1:], outs[1:]):
        same = [torch.equal(x, y) for x, y in zip(outs[0], out)]
        assert all(same[:5] + same[7:]) and (cfg.screen or all(same[5:7])), (cfg, same)
    tokens, nacc, nemit = outs[0][:3]
    rt, rn, re = ref_rejection(logits, drafts, q, st, pos)
    real = pos >= 0
    assert torch.equal(tokens[real], rt[real]) and torch.equal(nacc[real], rn[real])
    assert torch.equal(nemit[real], re[real])
    rep = torch.arange(b).repeat_interleave(k + 1)
    stv = st.select(rep)
    want = filtered_probs(logits, stv) > 0
    z = logits / torch.where(stv.greedy, 1.0, stv.temperature)[:, None]
    keep = (z >= outs[0][5][:, None]) & (z > -math.inf)
    for i in torch.nonzero(~stv.greedy).flatten().tolist():
        sp = kinds[int(rep[i]) % len(kinds)]
        differ = keep[i] != want[i]
        assert not (differ & ~_top_p_boundary(logits[i], sp)).any(), (i, sp)


# The top-p cut of 16-bit rows from counts of equal values (hist_p): 2048 bins, which hold
# most rows' cuts, and 64, which hold few (the rest go to the cut launches); programs of
# 64 columns (four, the last one short; read 16 at a time) and of 128, so a row's last
# program is picked by its ticket; before one-row cuts and before the bracket launch; and
# before a bracket launch whose tiny scratch misses most rows and narrows them itself
# (fold_n: no narrowing launch).
HIST_VARIANTS = (dataclasses.replace(ROW_TILES, hist_p=2048, chunk_h=64, sub_h=16),
                 dataclasses.replace(FAST_TILES, hist_p=2048, chunk_h=64),
                 dataclasses.replace(BAND_TILES, hist_p=64, chunk_h=128),
                 dataclasses.replace(FAST_SMALL_TILES, hist_p=64, chunk_h=64,
                                     fold_n=True))  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_hist_cut_bit_equal_to_the_cut_launches(device):
    """hist_p against the cut launches alone, fp16 logits (_filter_rows' boundary cases,
    tie groups and -inf, and N(0, 3^2) rows) under every mode, screened and not: the
    same thresholds, kept masses, tokens and counters bit for bit; the counts and tickets
    back at zero. One top-p row's cut falls on a tie of -0 and +0 (two keys, one z),
    which the counts must leave to the cut launches. The wide bins cut some rows
    themselves, the narrow ones fewer: both paths run."""
    k, v = 2, 203
    kinds = [*MIXED, SP(1.0, top_p=0.5), SP(1.0, top_p=0.9), SP(0.7, top_p=0.8)]
    logits, drafts, q, st, pos = _filter_batch(41, k, v, kinds, 5)
    tie = len(MIXED) * (k + 1)  # row 0 of the first SP(1.0, top_p=0.5) request
    logits[tie] = -math.inf
    # three values of about equal mass, the two zeros adjacent keys: half the mass is
    # reached at +0's count, but the kept set holds -0 too
    logits[tie, :3] = torch.tensor([5 * 2.0**-24, 0.0, -0.0])
    logits = logits.half().to(device)
    b = drafts.shape[0]
    dev = lambda t: t.to(device)  # noqa: E731
    done = {}
    for screen in (False, True):
        outs = []
        for cfg in (ROW_TILES, *HIST_VARIANTS):
            cfg = dataclasses.replace(cfg, screen=screen)
            batch = Batch(logits, dev(drafts), dev(q), _on(st, device), dev(pos), cfg)
            ws = batch.ws
            for t in (ws.row_thr, ws.row_sum, ws.race_val):
                t.fill_(float("nan"))
            batch.run()
            outs.append([t.cpu() for t in (*batch.outs(), ws.row_thr, ws.row_sum)])
            if cfg.hist_p:
                assert int(ws.hist.abs().sum()) == 0 and int(ws.hist_ticket.abs().sum()) == 0
                done[screen, cfg.hist_p] = ws.hist_done[: b * (k + 1)].cpu().bool()
                assert not done[screen, cfg.hist_p][tie]
        for cfg, out in zip(HIST_VARIANTS, outs[1:]):
            same = [torch.equal(x, y) for x, y in zip(outs[0], out)]
            assert all(same), (cfg, screen, same)
        assert int(done[screen, 64].sum()) < int(done[screen, 2048].sum())
        assert int(done[screen, 64].sum()) > 0
    assert int(done[False, 2048].sum()) >= 12


# One row a partials program, its block read in 4 slices of 8 columns (the GPU's layout at
# large vocabularies: per-lane running values, reduced once).
LOOP_TILES = dataclasses.replace(ROW_TILES, rows_p=1, sub_v=8, warps_v=2)
# The block read once (one_pass_v): one 8-column group a slice, one row a program; and
# two groups a slice over ROW_TILES' 4-row tiles.
ONE_PASS_TILES = [
    dataclasses.replace(LOOP_TILES, one_pass_v=True),
    dataclasses.replace(ROW_TILES, sub_v=16, one_pass_v=True),
    dataclasses.replace(LOOP_TILES, one_pass_v=True, ftz_v=True),  # subnormal exps to 0
    # the argmax and smallest finite value found after the loop (lazy_v)
    dataclasses.replace(LOOP_TILES, one_pass_v=True, lazy_v=True),
    dataclasses.replace(ROW_TILES, sub_v=16, one_pass_v=True, lazy_v=True, ftz_v=True),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("screen", [False, True])
@pytest.mark.parametrize("variant", range(1 + len(ONE_PASS_TILES)))
def test_partials_read_in_slices_match_whole_tiles(variant, screen, device):
    """The partials read a block in slices into per-lane values (LOOP_TILES), or once
    (ONE_PASS_TILES), against the whole 4-row tile reduced at once (ROW_TILES), on
    _filter_rows (tie groups, -inf rows and blocks, boundary cases) under every mode: the
    blocks' max, first argmax, smallest value and count above the draft are the same
    bits; their sums (another order of additions) agree to float32 rounding; the tokens
    are the reference's. Outputs are poisoned first, so every block must be written."""
    k, v = 2, 203
    logits, drafts, q, st, pos = _filter_batch(47, k, v, MIXED, 5)
    b = drafts.shape[0]
    logits[-1, 40:] = -math.inf  # whole blocks of -inf: their argmax is their first column
    got = []
    for cfg in (ROW_TILES, [LOOP_TILES, *ONE_PASS_TILES][variant]):
        cfg = dataclasses.replace(cfg, screen=screen)
        batch = Batch(logits.to(device), drafts.to(device), q.to(device), _on(st, device),
                      pos.to(device), cfg)  # fmt: skip
        ws = batch.ws
        parts = (ws.part_max, ws.part_arg, ws.part_min, ws.part_cnt, ws.part_sum, ws.part_above)
        for t in parts:
            t.fill_(-7)
        tokens, nacc, nemit = (x.cpu() for x in batch.run())
        rt, rn, re = ref_rejection(logits, drafts, q, st, pos)
        assert torch.equal(tokens, rt) and torch.equal(nacc, rn) and torch.equal(nemit, re)
        got.append([t.cpu().clone() for t in parts])
    whole, loop = got
    n = b * (k + 1)
    assert (loop[0][:n] != -7).all() and (loop[4][:n] != -7).all()
    for i in range(4 if screen else 3):  # count above the draft: screened calls only
        assert torch.equal(whole[i][:n], loop[i][:n]), i
    torch.testing.assert_close(loop[4][:n], whole[4][:n], rtol=2e-6, atol=0)
    if screen:
        drafted = (torch.arange(n) % (k + 1)) < k  # rows with a draft: the rest are garbage
        torch.testing.assert_close(loop[5][:n][drafted], whole[5][:n][drafted], rtol=2e-6,
                                   atol=1e-30)  # fmt: skip


def _block_max_first_arg(z: torch.Tensor, width: int) -> tuple:
    """PyTorch's max of each `width`-column block of z's rows (padded with -inf past the
    last column), the absolute column of its first occurrence (a block of -inf: its
    first column) and the padded blocks [rows, blocks, width]."""
    n, v = z.shape
    nb = -(-v // width)
    zb = torch.full((n, nb * width), -math.inf)
    zb[:, :v] = z.float()
    zb = zb.view(n, nb, width)
    best, arg = zb.max(-1)  # the first index of the max
    return best, torch.where(best > -math.inf, arg, 0) + torch.arange(nb) * width, zb


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lazy", [False, True])
def test_partials_blocks_a_multiple_of_their_slice(lazy, device):
    """Partials blocks of 24 columns read 8 at a time (block_v a multiple of sub_v, not a
    power of two; v = 203: the last block short), one pass, screened: every block's max,
    first argmax and smallest finite value equal PyTorch's over the same 24 columns, its
    sum of exp(z - max) the float64 one to float32 rounding, and the tokens the
    reference's."""
    k, v = 2, 203
    logits, drafts, q, st, pos = _filter_batch(53, k, v, MIXED, 7)
    b = drafts.shape[0]
    logits[-1, 40:] = -math.inf  # whole blocks of -inf: their argmax is their first column
    cfg = dataclasses.replace(LOOP_TILES, block_v=24, one_pass_v=True, lazy_v=lazy, ftz_v=lazy)
    batch = Batch(logits.to(device), drafts.to(device), q.to(device), _on(st, device),
                  pos.to(device), cfg)  # fmt: skip
    ws = batch.ws
    for t in (ws.part_max, ws.part_arg, ws.part_min, ws.part_sum):
        t.fill_(-7)
    tokens, nacc, nemit = (x.cpu() for x in batch.run())
    rt, rn, re = ref_rejection(logits, drafts, q, st, pos)
    assert torch.equal(tokens, rt) and torch.equal(nacc, rn) and torch.equal(nemit, re)
    n, nb = b * (k + 1), -(-v // 24)
    stv = st.select(torch.arange(b).repeat_interleave(k + 1))
    z = logits / torch.where(stv.greedy, 1.0, stv.temperature)[:, None]
    want_max, want_arg, zb = _block_max_first_arg(z, 24)
    want_min = torch.where(zb > -math.inf, zb, math.inf).min(-1).values
    ref = torch.where(want_max > -math.inf, want_max, 0.0).double()
    want_sum = (zb.double() - ref[:, :, None]).exp().sum(-1)
    assert ws.part_max.shape[1] == nb
    assert torch.equal(ws.part_max.cpu()[:n], want_max)
    assert torch.equal(ws.part_arg.cpu()[:n], want_arg.int())
    assert torch.equal(ws.part_min.cpu()[:n], want_min)
    torch.testing.assert_close(ws.part_sum.cpu()[:n].double(), want_sum, rtol=2e-6, atol=0)
    # an all-greedy batch on the same tiles: the greedy launch reads block_v's 24-column
    # blocks 8 at a time (no sub_g)
    greedy = make_params(b, [SP(0.0)])
    batch = Batch(logits.to(device), drafts.to(device), None, _on(greedy, device),
                  pos.to(device), cfg)  # fmt: skip
    tokens, nacc, nemit = (x.cpu() for x in batch.run())
    rt, rn, re = ref_rejection(logits, drafts, None, greedy, pos)
    assert torch.equal(tokens, rt) and torch.equal(nacc, rn) and torch.equal(nemit, re)


# ------------------------------------------------------------------------- screening

SCREEN_KINDS = [SP(1.0, top_p=0.9), SP(0.8, top_p=0.5), SP(1.3, top_p=0.99), SP(0.0),
                SP(1.0, top_k=9), SP(1.2, top_k=40, top_p=0.9), SP(1.0),
                SP(1.0, top_p=0.2)]  # fmt: skip


def _screen_case(b, k, v, g):
    """Rows of every shape the screen meets (flat N(0, 3^2), tie groups, a few lifted
    tokens, a third of the vocabulary at -inf), every mode, and drafts from a blurred
    target (often outside the kept set), the target's argmax (walks go deep), uniform or
    outside the vocabulary; random k and padded requests."""
    rows = b * (k + 1)
    logits = torch.randn(rows, v, generator=g) * 3
    shape = torch.arange(rows) % 4
    logits[shape == 1] = (logits[shape == 1] * 1.5).round() / 1.5
    lift = (torch.rand(rows, v, generator=g) < 0.05) & (shape == 2)[:, None]
    logits += torch.where(lift, 8.0, 0.0)
    logits[(torch.rand(rows, v, generator=g) < 0.3) & (shape == 3)[:, None]] = -math.inf
    view = logits.view(b, k + 1, v)[:, :k]
    q = torch.softmax(view.clamp(min=-30) + torch.randn(b, k, v, generator=g), -1)
    pick = torch.rand(b, k, generator=g)
    drafts = torch.where(
        pick < 0.5,
        torch.multinomial(q.view(-1, v), 1, generator=g).view(b, k),
        torch.where(pick < 0.85, view.argmax(-1), torch.randint(0, v, (b, k), generator=g)),
    )
    drafts[pick > 0.97] = v + 3
    kk = torch.randint(0, k + 1, (b,), generator=g)
    drafts[torch.arange(k)[None, :] >= kk[:, None]] = -1
    st = make_params(b, SCREEN_KINDS, seed0=int(torch.randint(0, 1000, (1,), generator=g)))
    pos = torch.randint(0, 10**6, (b,), generator=g)
    pos[3::7] = -1
    return logits, drafts, q, st, pos


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", ["default", "band", "fast", "fast_small"])
def test_screened_equals_unscreened(tiles, device, monkeypatch):
    """Screening is an optimisation only: with it, every output (tokens, counts,
    counters, race winners) is bit for bit the unscreened sampler's, and each row the
    screen sends to its cut gets the same threshold and kept mass. Fewer rows are cut.
    """
    monkeypatch.setenv("SPECDRAFT_VALIDATE", "0")  # drafts outside the vocabulary too
    b, k, v = 14, 3, 203
    base = {"default": None, "band": BAND_TILES, "fast": FAST_TILES,
            "fast_small": FAST_SMALL_TILES}[tiles]  # fmt: skip
    base = base or kr.choose_rejection_config(v, b, k)
    cut_rows = filtered = 0
    for case in range(2):
        g = torch.Generator().manual_seed(700 + case + 10 * len(tiles))
        logits, drafts, q, st, pos = _screen_case(b, k, v, g)
        args = [logits.to(device), drafts.to(device), q.to(device), _on(st, device), pos.to(device)]
        outs = []
        for screen in (False, True):
            batch = Batch(*args, dataclasses.replace(base, screen=screen))
            ws = batch.ws
            for t in (ws.row_thr, ws.row_sum, ws.race_val):
                t.fill_(float("nan"))
            ws.row_state.fill_(-9)
            batch.run()
            sampled = (~args[3].greedy & (args[4] >= 0)).cpu()
            race = (ws.race_val.cpu()[sampled], ws.race_idx.cpu()[sampled])
            outs.append(([t.cpu() for t in (*batch.outs(), *race)],
                         ws.row_thr.cpu(), ws.row_sum.cpu(), ws.row_state.cpu()))  # fmt: skip
        (plain, thr0, sum0, _), (screened, thr1, sum1, state) = outs
        assert all(torch.equal(x, y) for x, y in zip(plain, screened)), case
        n = b * (k + 1)
        assert bool((state[:n] >= 0).all()) and bool((state[:n] <= kr.NOTHING).all())
        need = kr.screened_cut_rows(ws, b, k)
        assert torch.equal(thr1[:n][need], thr0[:n][need])
        assert torch.equal(sum1[:n][need], sum0[:n][need])
        rep = torch.arange(b).repeat_interleave(k + 1)
        stv = _cpu(args[3]).select(rep)
        uses = ~stv.greedy & ((stv.top_p < 1) | ((stv.top_k > 0) & (stv.top_k < v)))
        uses &= args[4].cpu()[rep] >= 0
        filtered += int(uses.sum())
        cut_rows += int((need & uses).sum())
    assert cut_rows < 0.6 * filtered, (cut_rows, filtered)


@interp
def test_screen_states_are_sound():
    """Every SURE_ACCEPT / SURE_REJECT agrees with the float64 reference's acceptance of
    that draft (p from ref_filtered64, the keyed ACCEPT uniform), on flat, tied, peaked
    and masked rows with top-p from 0.2 to 0.99 and top-k; rows within 1e-6 of a
    decision boundary excepted. The screen also decides most of the rows it can."""
    b, k, v = 40, 5, 203
    g = torch.Generator().manual_seed(91)
    logits, drafts, q, st, pos = _screen_case(b, k, v, g)
    drafts = drafts.clamp(max=v - 1)  # ids outside the vocabulary are SURE_REJECT by rule
    drafts[drafts < -1] = 0
    batch = Batch(logits, drafts, q, st, pos)
    batch.run()
    state = batch.ws.row_state[: b * (k + 1)].view(b, k + 1)[:, :k]
    rep = torch.arange(b).repeat_interleave(k + 1)
    stv = st.select(rep)
    p = ref_filtered64(logits, stv.greedy, stv.temperature, stv.top_k, stv.top_p)
    p = p.view(b, k + 1, v)[:, :k]
    x = drafts.clamp(min=0)
    px = p.gather(2, x[..., None])[..., 0]
    qx = q.double().gather(2, x[..., None])[..., 0]
    u = keyed_uniform(st.seed[:, None], pos[:, None] + torch.arange(k), ACCEPT).double()
    accept = (px > 0) & ((px >= qx) | (u * qx < px))
    near = ((u * qx - px).abs() <= 1e-6 * px) | ((px - qx).abs() <= 1e-6 * px)
    # A kept token's top-p membership within float rounding of the boundary.
    for i, j in (state != kr.EXACT).nonzero().tolist():
        row = logits[i * (k + 1) + j]
        sp = SCREEN_KINDS[i % len(SCREEN_KINDS)]
        if sp.top_p < 1 and int(x[i, j]) < v and bool(_top_p_boundary(row, sp)[x[i, j]]):
            near[i, j] = True
    sure_a = state == kr.SURE_ACCEPT
    sure_r = state == kr.SURE_REJECT
    assert bool((accept | near)[sure_a].all())
    assert bool((~accept | near)[sure_r].all())
    present = drafts >= 0
    uses = (~st.greedy & ((st.top_p < 1) | (st.top_k > 0)) & (pos >= 0))[:, None] & present
    decided = int(((sure_a | sure_r) & uses).sum())
    assert int(sure_a.sum()) > 0 and int(sure_r.sum()) > 0
    assert decided > 0.6 * int(uses.sum()), (decided, int(uses.sum()))
    # Rows with nothing to decide, and rows past each request's drafts.
    nothing = (st.greedy | (pos < 0))[:, None].expand(b, k)
    assert bool((state[nothing] == kr.NOTHING).all())
    assert bool((state[~nothing & ~present] == kr.NO_DRAFT).all())


@interp
def test_screen_after_top_k_bounds_the_survivors_mass():
    """Top-k then top-p: drafts among each row's top-k tokens (ranks 1 to k), where the
    top-p cut over the survivors' mass (not the row's) decides; a flat q, so a kept draft
    is accepted. SURE_ACCEPT only where the float64 reference accepts, and the screened
    sampler's outputs are the unscreened one's."""
    b, k, v = 12, 5, 203
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(b * (k + 1), v, generator=g) * 2
    kinds = [SP(1.0, top_k=40, top_p=0.5), SP(1.0, top_k=9, top_p=0.7), SP(0.8, top_k=20)]
    st = make_params(b, kinds, seed0=3)
    rank = torch.randint(0, 40, (b, k), generator=g)
    order = logits.view(b, k + 1, v)[:, :k].argsort(-1, descending=True)
    topk = torch.tensor([kinds[i % len(kinds)].top_k for i in range(b)])
    drafts = order.gather(2, torch.minimum(rank, topk[:, None] - 1)[..., None])[..., 0]
    q = torch.full((b, k, v), 1.0 / v)
    pos = torch.randint(0, 10**6, (b,), generator=g)
    outs = []
    for screen in (False, True):
        cfg = dataclasses.replace(kr.choose_rejection_config(v, b, k), screen=screen)
        batch = Batch(logits, drafts, q, st, pos, cfg)
        batch.run()
        outs.append([t.clone() for t in batch.outs()])
    assert all(torch.equal(x, y) for x, y in zip(*outs))
    state = batch.ws.row_state[: b * (k + 1)].view(b, k + 1)[:, :k]
    rep = torch.arange(b).repeat_interleave(k + 1)
    stv = st.select(rep)
    p = ref_filtered64(logits, stv.greedy, stv.temperature, stv.top_k, stv.top_p)
    px = p.view(b, k + 1, v)[:, :k].gather(2, drafts[..., None])[..., 0]
    u = keyed_uniform(st.seed[:, None], pos[:, None] + torch.arange(k), ACCEPT).double()
    accept = (px > 0) & ((px >= 1.0 / v) | (u / v < px))
    sure_a, sure_r = state == kr.SURE_ACCEPT, state == kr.SURE_REJECT
    assert int(sure_a.sum()) > 0 and int(sure_r.sum()) > 0
    assert bool(accept[sure_a].all()) and not bool(accept[sure_r].any())


# ---------------------------------------------------------------------- losslessness


def lossless_trials(n, k_max, target, draft, pair, *, v=16, seed=0, device="cpu",
                    greedy_every=0, draft_stream=DRAFT_PROPOSAL, runner="kernel",
                    accept_rule=None):  # fmt: skip
    """n context-free requests: every target row is the logits `lt`, every draft row
    `ld` (-lt or an independent draw). Drafts come from specdraft.sampling.sample on
    the draft's stream, with per-request k in [0, k_max] (mostly k_max). Returns the
    outputs, k per request, the exact float64 target p and the draft's q."""
    g = torch.Generator().manual_seed(seed)
    lt = torch.randn(v, generator=g)
    ld = -lt if pair == "negated" else torch.randn(v, generator=g)
    seeds = torch.randint(0, 2**62, (n,), generator=g)
    pos = torch.randint(0, 2**40, (n,), generator=g)
    greedy = torch.zeros(n, dtype=torch.bool)
    if greedy_every:
        greedy[::greedy_every] = True
    st = SamplingTensors(n, "cpu")
    st.greedy.copy_(greedy)
    st.temperature.copy_(torch.where(greedy, 0.0, target.temperature))
    st.top_k.fill_(target.top_k)
    st.top_p.fill_(target.top_p)
    st.seed.copy_(seeds)
    st._host_greedy[:] = greedy.numpy()
    st._host_filter[:] = target.uses_filter
    # The draft's proposals: one request seed for all of its streams, as in the runtime.
    dst = SamplingTensors.from_params([SP(draft.temperature, draft.top_k, draft.top_p, 0)], "cpu")
    dst = dst.select(torch.zeros(n * k_max, dtype=torch.int64))
    dst.seed = seeds.repeat_interleave(k_max)
    dpos = (pos[:, None] + torch.arange(k_max)).reshape(-1)
    drafts = sample(ld.expand(n * k_max, v), dst, dpos, draft_stream).view(n, k_max)
    kk = torch.where(
        torch.rand(n, generator=g) < 0.6, k_max, torch.randint(0, k_max + 1, (n,), generator=g)
    )
    drafts[torch.arange(k_max)[None, :] >= kk[:, None]] = -1
    q = filtered_probs(ld[None], draft)[0]
    row = [torch.tensor([x], dtype=d) for x, d in ((False, torch.bool),
           (target.temperature, torch.float32), (target.top_k, torch.int32),
           (target.top_p, torch.float32))]  # fmt: skip
    p = ref_filtered64(lt[None], *row)[0]
    logits = lt.expand(n * (k_max + 1), v)
    qs = q.expand(n, k_max, v)
    if runner == "kernel":
        cfg = kr.choose_rejection_config(v, n, k_max)
        batch = Batch(logits.to(device), drafts.to(device), qs.to(device), _on(st, device),
                      pos.to(device), cfg)  # fmt: skip
        tokens, nacc, nemit = (t.cpu() for t in batch.run())
    else:
        pfull = torch.where(greedy[:, None], F.one_hot(lt.argmax(), v).double(), p)
        pfull = pfull[:, None, :].expand(n, k_max + 1, v)
        tokens, nacc, nemit = ref_rejection(logits, drafts, qs, st, pos, p=pfull,
                                            accept_rule=accept_rule)  # fmt: skip
    return tokens, nacc, nemit, kk, greedy, lt, p, q.double()


def _on(st, device):
    if torch.device(device).type == "cpu":
        return st
    out = SamplingTensors(0, device)
    for name in SamplingTensors._FIELDS:
        setattr(out, name, getattr(st, name).to(device))
    out._host_greedy, out._host_filter = st._host_greedy, st._host_filter
    return out


def lossless_stats(tokens, nacc, nemit, kk, greedy, lt, p, q):
    """Per output position: (chi-square, df, limit) of the sampled requests' tokens
    against p; the z-score of draft 0's acceptance rate against sum(min(p, q))."""
    v = p.shape[0]
    assert bool((tokens[greedy] == torch.where(tokens[greedy] >= 0, lt.argmax(), -1)).all())
    sampled = ~greedy
    rows = []
    for j in range(tokens.shape[1]):
        sel = sampled & (nemit > j)
        if int(sel.sum()) < 200:
            continue
        counts = np.bincount(tokens[sel, j].numpy(), minlength=v)
        stat, df = chi_square(counts, p.numpy())
        rows.append((j, stat, df, chi_limit(df)))
    alpha = float(torch.minimum(p, q).sum())
    had = sampled & (kk >= 1)
    m = int(had.sum())
    hits = int((nacc[had] >= 1).sum())
    z = (hits - m * alpha) / math.sqrt(max(m * alpha * (1 - alpha), 1e-12))
    return rows, z, alpha


LOSSLESS_CASES = [
    (pair, SP(t, **filt), draft)
    for pair in ("negated", "random")
    for t in (0.5, 1.0)
    for filt, draft in (({"top_k": 6}, SP(1.0)), ({"top_p": 0.9}, SP(0.8, top_k=10)))
]


def _assert_lossless(out, label):
    rows, z, alpha = lossless_stats(*out)
    assert rows, label
    for j, stat, df, limit in rows:
        # df 0: the whole support is one pooled bin (a draw off the support is inf)
        why = f"{label}: position {j} chi-square {stat:.1f} >= {limit:.1f} (df {df})"
        assert stat < limit or (df == 0 and stat == 0), why
    assert abs(z) < 5, f"{label}: acceptance of draft 0 z = {z:.2f} (alpha {alpha:.4f})"
    return rows, z


@interp
@pytest.mark.parametrize("pair, target, draft", LOSSLESS_CASES)
def test_lossless_cpu(pair, target, draft):
    """20k requests per case through the kernels (interpreter); the chi-square limit is
    the same as the GPU's 200k test, so the CPU test has less power, not a looser bar."""
    case = LOSSLESS_CASES.index((pair, target, draft))
    out = lossless_trials(20000, 3, target, draft, pair, seed=case)
    _assert_lossless(out, f"{pair} {target}")
    # The same requests through the float64 reference: the same tokens, but for float
    # rounding at a decision boundary (about 1e-7 per decision).
    ref = lossless_trials(20000, 3, target, draft, pair, seed=case, runner="reference")
    assert int((out[0] != ref[0]).any(1).sum()) <= 2


@interp
def test_lossless_mixed_modes_cpu():
    """A quarter greedy (they emit the argmax at every position), the rest sampled with
    both filters; the draft filters too, so q has zeros."""
    out = lossless_trials(12000, 4, SP(0.7, top_k=8, top_p=0.9), SP(1.2, top_k=5), "random",
                          seed=5, greedy_every=4)  # fmt: skip
    _assert_lossless(out, "mixed")


def test_lossless_test_detects_wrong_rules():
    """The same statistics reject, through the float64 reference with 20k requests, a
    sampler that accepts with min(1, sqrt(p/q)) and one whose draft proposals share the
    residual stream (coupled draws); the correct reference passes."""
    sqrt_rule = lambda px, qx, u: u < (px / qx).sqrt()  # noqa: E731
    worst = lambda rows: max(stat / limit for _, stat, _, limit in rows)  # noqa: E731
    wrong = lossless_trials(20000, 3, SP(1.0), SP(1.0), "random", runner="reference",
                            accept_rule=sqrt_rule)  # fmt: skip
    rows, z, _ = lossless_stats(*wrong)
    assert worst(rows) > 10 and abs(z) > 5, (rows, z)
    target = SP(1.0, top_k=6)
    coupled = lossless_trials(20000, 3, target, SP(1.0), "random", runner="reference",
                              draft_stream=RESIDUAL)  # fmt: skip
    assert worst(lossless_stats(*coupled)[0]) > 2
    for t in (SP(1.0), target):
        _assert_lossless(lossless_trials(20000, 3, t, SP(1.0), "random", runner="reference"), "ref")


# ------------------------------------------------- counters, padding, out-of-vocabulary


@pytest.mark.parametrize("device", DEVICES)
def test_counters_accumulate_and_padding_writes_nothing(device):
    b, k, v = 10, 4, 16
    logits, drafts, q, st, pos = random_case(b, k, v, KINDS, gen=torch.Generator().manual_seed(3))
    pos[[2, 7]] = -1  # padded requests
    batch = Batch(logits.to(device), drafts.to(device), q.to(device), _on(st, device),
                  pos.to(device))  # fmt: skip
    tokens, nacc, nemit = (t.cpu() for t in batch.run())
    real = pos >= 0
    assert bool((tokens[~real] == -1).all()) and bool((nacc[~real] == 0).all())
    assert bool((nemit[~real] == 0).all()) and bool((nemit[real] == nacc[real] + 1).all())
    rt, rn, _ = ref_rejection(logits, drafts, q, st, pos)
    assert torch.equal(tokens[real], rt[real])
    kk = (drafts != -1).sum(1)
    j = torch.arange(k)
    want_p = ((j[None, :] < kk[:, None]) & real[:, None]).sum(0)
    want_a = ((j[None, :] < rn[:, None]) & real[:, None]).sum(0)
    assert torch.equal(batch.prop.cpu(), want_p) and torch.equal(batch.accd.cpu(), want_a)
    batch.run()  # counters add up across calls, outputs are rewritten whole
    assert torch.equal(batch.prop.cpu(), 2 * want_p)
    assert torch.equal(batch.accd.cpu(), 2 * want_a)
    assert torch.equal(batch.tokens.cpu()[real], rt[real])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "block_g, sub_g, row_g, lazy_g",
    [(None, None, False, False), (16, None, False, False), (32, 8, False, False),
     (16, 4, False, False), (None, None, True, False), (16, 4, True, False),
     (32, 8, True, False), (32, 8, False, True), (32, 8, True, True), (64, 16, True, True),
     (None, None, True, True), (24, 8, True, True), (24, 8, False, False)],
)  # fmt: skip
def test_greedy_one_launch_resets_its_tickets(device, block_g, sub_g, row_g, lazy_g):
    """All-greedy batches take the one-launch kernel, whose last program per request
    finishes it: tickets are back to zero after every call, so fresh logits in a second
    call are decided from scratch (padded requests write -1 / 0 both times). sub_g
    below block_g: the block is read in a loop (ties across its lanes and iterations;
    the last block runs past V). row_g: one target row per program, (K + 1) x blocks
    tickets per request. lazy_g: groups of 8 columns keep the slice that raised their
    max, the column found after the loop (64 columns: one block, past V). 24 columns:
    a block that is a multiple of its slice, not a power of two."""
    b, k, v = 7, 3, 40
    g = torch.Generator().manual_seed(11)
    st = make_params(b, [SP(0.0)], device)
    # 5, 3, 2 (of 24 or 32 columns) or 1 blocks per row
    cfg = kr.RejectionConfig(
        8, 1, 16, 16, 8, 16, 16, 1, block_g=block_g, sub_g=sub_g, warps_g=2, row_g=row_g,
        lazy_g=lazy_g,
    )  # fmt: skip
    assert (cfg.block_g, cfg.sub_g) == (block_g, sub_g)
    batch = None
    for call in range(2):
        logits, drafts, _, _, pos = random_case(b, k, v, [SP(0.0)], ties=True, gen=g)
        pos[[1, 5]] = -1
        if batch is None:
            batch = Batch(logits.to(device), drafts.to(device), None, st, pos.to(device), cfg)
        else:
            for dst, src in zip(batch.args, (logits, drafts, None, *([None] * 5), pos)):
                if src is not None:
                    dst.copy_(src)
        batch.tokens.fill_(-7)
        tokens, nacc, nemit = (t.cpu() for t in batch.run())
        assert int(batch.ws.done.abs().sum()) == 0, call
        rt, rn, re = ref_rejection(logits, drafts, None, _cpu(st), pos)
        real = pos >= 0
        assert torch.equal(tokens[real], rt[real]) and torch.equal(nacc[real], rn[real])
        assert torch.equal(nemit[real], re[real])
        assert bool((tokens[~real] == -1).all()) and bool((nemit[~real] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_vocab_drafts_without_validation(monkeypatch, device):
    """With validation off nothing reads outside the tensors: an id outside the
    vocabulary is never accepted (the walk stops there) and the emitted token is valid."""
    monkeypatch.setenv("SPECDRAFT_VALIDATE", "0")
    b, k, v = 6, 3, 16
    logits, drafts, q, st, pos = random_case(b, k, v, KINDS, gen=torch.Generator().manual_seed(4))
    drafts[:, 0] = logits.view(b, k + 1, v)[:, 0].argmax(-1)  # greedy rows accept draft 0
    drafts[:, 1] = torch.tensor([v, -5, v + 1000, 2**40, v, -2])
    drafts[:, 2] = -1
    batch = Batch(logits.to(device), drafts.to(device), q.to(device), _on(st, device),
                  pos.to(device))  # fmt: skip
    tokens, nacc, nemit = (t.cpu() for t in batch.run())
    assert bool((nacc <= 1).all())
    emitted = tokens[torch.arange(b), nacc.long()]
    assert bool(((emitted >= 0) & (emitted < v)).all())


# ------------------------------------------------------------------------- bad input


def _bad_cases(b, k, v, device):
    """(label, function of the argument list that breaks it, exception, words)."""

    def put(i, value):
        def f(a):
            a[i] = value(a[i]) if callable(value) else value

        return f

    names = ["logits", "drafts", "q", "greedy", "temp", "topk", "topp", "seed", "pos", "tokens",
             "nacc", "nemit", "prop", "accd", "ws"]  # fmt: skip
    idx = {n: i for i, n in enumerate(names)}

    def at(name, value):
        return put(idx[name], value)

    def draft_val(j, val):
        def f(a):
            a[1] = a[1].clone()
            a[1][1, j] = val

        return f

    return [
        ("drafts float", at("drafts", lambda t: t.float()), TypeError, ["draft_tokens", "float32"]),
        ("k > K_max", at("drafts", lambda t: torch.cat([t, t[:, :1]], 1)), ValueError,
         ["target_logits", "rows", "K_max"]),
        ("q vocab", at("q", lambda t: t.new_zeros(b, k, v + 1)), ValueError,
         ["draft_probs", "vocabulary", str(v + 1)]),
        ("q K", at("q", lambda t: t[:, :-1]), ValueError, ["draft_probs", f"{(b, k, v)}"]),
        ("q dtype", at("q", lambda t: t.half()), TypeError, ["draft_probs", "float16"]),
        ("draft id = V", draft_val(0, v), ValueError, ["draft_tokens[1, 0]", str(v), "vocabulary"]),
        ("draft id < -1", draft_val(1, -3), ValueError, ["draft_tokens[1, 1]", "-3"]),
        ("hole in padding", lambda a: (draft_val(0, -1)(a), draft_val(1, 3)(a)), ValueError,
         ["draft_tokens[1, 1]", "follows a -1"]),
        ("logits int", at("logits", lambda t: t.long()), TypeError, ["target_logits", "int64"]),
        ("logits strided", at("logits", lambda t: t.t().contiguous().t()), ValueError,
         ["target_logits", "contiguous"]),
        ("positions int32", at("pos", lambda t: t.int()), TypeError, ["positions", "int32"]),
        ("greedy int", at("greedy", lambda t: t.long()), TypeError, ["greedy", "int64"]),
        ("seed short", at("seed", lambda t: t[:-1]), ValueError, ["seed", f"({b},)"]),
        ("temperature device", at("temp", lambda t: t.to("meta")), ValueError,
         ["temperature", "meta"]),
        ("tokens shape", at("tokens", lambda t: t[:, :-1]), ValueError, ["out_tokens", f"{k + 1}"]),
        ("counter shape", at("prop", lambda t: t.new_zeros(k + 1)), ValueError,
         ["proposed_counts"]),
        ("workspace vocab", at("ws", lambda w: kr.RejectionWorkspace.allocate(b, k, v + 3, device)),
         ValueError, ["workspace", str(v + 3)]),
        ("workspace type", at("ws", "nope"), TypeError, ["workspace", "str"]),
        ("bf16 interpreted", at("logits", lambda t: t.bfloat16()), TypeError, ["bfloat16"]),
    ]  # fmt: skip


def _state(batch):
    ws = batch.ws
    bufs = [*batch.outs(), ws.part_max, ws.part_arg, ws.part_sum, ws.row_thr, ws.race_idx]
    return [t.clone() for t in bufs]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(19))
def test_bad_input_raises_and_writes_nothing(case, device, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_VALIDATE", "1")  # draft-id values: on for CUDA too
    b, k, v = 4, 3, 16
    logits, drafts, q, st, pos = random_case(b, k, v, KINDS, gen=torch.Generator().manual_seed(6))
    drafts[1] = torch.tensor([1, 2, 3])
    batch = Batch(logits.to(device), drafts.to(device), q.to(device), _on(st, device),
                  pos.to(device))  # fmt: skip
    batch.run()  # every buffer holds a real result
    before = _state(batch)
    label, breaks, exc, words = _bad_cases(b, k, v, device)[case]
    if label == "bf16 interpreted" and device == "cuda":
        pytest.skip("bf16 runs on the GPU")
    args = [*batch.args, *batch.outs(), batch.ws]
    breaks(args)
    from specdraft import kernels

    with pytest.raises(exc) as info:
        kernels.rejection_sample(*args)
    for w in words:
        assert w in str(info.value), (label, w, str(info.value))
    assert all(torch.equal(x, y) for x, y in zip(before, _state(batch))), label


@interp
def test_bad_streams_and_sampler_limits():
    b, k, v = 3, 2, 16
    logits, drafts, q, st, pos = random_case(b, k, v, KINDS, gen=torch.Generator().manual_seed(7))
    batch = Batch(logits, drafts, q, st, pos)
    with pytest.raises(ValueError, match="streams"):
        batch.run(streams=(2, 2, 4))
    rs = RejectionSampler(b, k, v, "cpu")
    with pytest.raises(ValueError, match="k_max 2"):
        rs(torch.zeros(b * 4, v), torch.zeros(b, 3, dtype=torch.int64), None, st, pos)
    with pytest.raises(ValueError, match="max_num_reqs 3"):
        rs(torch.zeros(16, v), torch.zeros(4, 3, dtype=torch.int64)[:, :k], None, st, pos)
    with pytest.raises(ValueError, match="q.*None.*sampled"):
        rs(logits, drafts, None, st, pos)
    with pytest.raises(TypeError, match="SamplingTensors"):
        rs(logits, drafts, q, [SP()] * b, pos)
    for name, value in (("max_num_reqs", 0), ("k_max", -1), ("vocab_size", 2.5)):
        kw = {"max_num_reqs": 2, "k_max": 2, "vocab_size": 8, name: value}
        with pytest.raises((ValueError, TypeError), match=name):
            RejectionSampler(device="cpu", **kw)
    assert torch.equal(rs.proposed_counts, torch.zeros(k, dtype=torch.int64))


# ------------------------------------------------------------------ the runtime wrapper


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k_call", [0, 2, 4])
def test_sampler_triton_and_torch_paths_agree(k_call, device):
    """RejectionSampler sized for 9 requests x K 4 serves a smaller call (views of its
    buffers, params narrowed from a larger SamplingTensors); the PyTorch path gives the
    same tokens and counters."""
    from specdraft import ops

    b, v = 7, 16
    cpu = random_case(b, k_call, v, KINDS, gen=torch.Generator().manual_seed(8))
    logits, drafts, q, _, pos = (x.to(device) for x in cpu[:3] + (cpu[3].seed, cpu[4]))
    big = make_params(b + 3, KINDS, device)
    rs = RejectionSampler(9, 4, v, device)
    out = rs(logits, drafts, q, big, pos)
    rt, rn, re = ref_rejection(*cpu[:3], _cpu(big.narrow(0, b)), cpu[4])
    assert torch.equal(out.tokens.cpu(), rt) and torch.equal(out.num_accepted.cpu(), rn)
    assert torch.equal(out.num_emitted.cpu(), re)
    assert out.tokens.data_ptr() == rs.tokens.data_ptr()
    host = rs.counters_to_host()  # filled in stream order: wait before reading
    if device == "cuda":
        torch.cuda.synchronize()
    counts, tokens = host.clone(), out.tokens.clone()
    with ops.use_backend("torch"):
        rs2 = RejectionSampler(9, 4, v, device)
        out2 = rs2(logits, drafts, q, big, pos)
        assert torch.equal(out2.tokens, tokens)
        host2 = rs2.counters_to_host()
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(host2, counts)
    # Greedy-only: q None.
    gst = make_params(b, [SP(0.0)], device)
    out3 = rs(logits, drafts, None, gst, pos)
    want = ref_rejection(*cpu[:2], None, _cpu(gst), cpu[4])[0]
    assert torch.equal(out3.tokens.cpu(), want)


def test_torch_path_matches_reference():
    """rejection_sample_torch alone (no interpreter needed)."""
    b, k, v = 12, 3, 16
    logits, drafts, q, st, pos = random_case(b, k, v, KINDS, gen=torch.Generator().manual_seed(9))
    pos[4] = -1
    outs = (torch.empty(b, k + 1, dtype=torch.int64), torch.empty(b, dtype=torch.int32),
            torch.empty(b, dtype=torch.int32), torch.zeros(k, dtype=torch.int64),
            torch.zeros(k, dtype=torch.int64))  # fmt: skip
    rejection_sample_torch(logits, drafts, q, st.greedy, st.temperature, st.top_k, st.top_p,
                           st.seed, pos, *outs)  # fmt: skip
    rt, rn, re = ref_rejection(logits, drafts, q, st, pos)
    real = pos >= 0
    assert torch.equal(outs[0][real], rt[real]) and bool((outs[0][4] == -1).all())
    assert torch.equal(outs[1][real], rn[real]) and int(outs[2][4]) == 0


# ------------------------------------------------------------------------------- GPU


def _gpu_case(b, k, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b * (k + 1), v, generator=g) * 3).bfloat16()
    q = torch.softmax(torch.randn(b, k, v, generator=g) * 3, -1)
    am = logits.float().view(b, k + 1, v)[:, :k].argmax(-1)
    drafts = torch.where(
        torch.rand(b, k, generator=g) < 0.7,
        am,
        torch.multinomial(q.view(-1, v), 1, generator=g).view(b, k),
    )
    kk = torch.randint(0, k + 1, (b,), generator=g)
    drafts[torch.arange(k)[None, :] >= kk[:, None]] = -1
    kinds = [*KINDS, SP(1.0, top_p=0.95), SP(0.8, top_k=50, top_p=0.9), SP(1.0, top_k=2000)]
    st = make_params(b, kinds)
    pos = torch.randint(0, 2**40, (b,), generator=g)
    return logits, drafts, q, st, pos


@gpu
@pytest.mark.parametrize("v", [49152, 128256])
def test_gpu_bf16_large_vocab_matches_reference(v):
    """The default (screened) sampler's tokens against the reference; the same outputs
    unscreened, every filtered row then cut, its kept set filtered_probs'."""
    b, k = 16, 5
    logits, drafts, q, st, pos = _gpu_case(b, k, v, seed=v)
    args = (logits.cuda(), drafts.cuda(), q.cuda(), _on(st, "cuda"), pos.cuda())
    screened = Batch(*args)
    assert screened.ws.config.screen
    tokens, nacc, nemit = (t.cpu() for t in screened.run())
    rt, rn, re = ref_rejection(logits.float(), drafts, q, st, pos)
    # bf16 rows are full of exact ties (handled exactly); only a top-p cut within float
    # rounding of top_p * mass may differ: allow one request in 16.
    assert int((tokens != rt).any(1).sum()) <= 1
    cfg = dataclasses.replace(kr.choose_rejection_config(v, b, k), screen=False)
    batch = Batch(*args, cfg)
    batch.run()
    assert all(torch.equal(x, y) for x, y in zip(batch.outs(), screened.outs()))
    need = kr.screened_cut_rows(screened.ws, b, k).cuda()
    assert torch.equal(
        screened.ws.row_thr[: b * (k + 1)][need], batch.ws.row_thr[: b * (k + 1)][need]
    )
    # The kept sets against sampling.filtered_probs on the same device.
    rep = torch.arange(b).repeat_interleave(k + 1).cuda()
    want = filtered_probs(logits.cuda(), _on(st, "cuda").select(rep)) > 0
    stv = _on(st, "cuda").select(rep)
    z = logits.cuda().float() / torch.where(stv.greedy, 1.0, stv.temperature)[:, None]
    keep = (z >= batch.ws.row_thr[:, None]) & (z > -math.inf)
    sampled = ~stv.greedy
    assert int((keep != want)[sampled].any(1).sum()) <= 1


@gpu
@pytest.mark.parametrize(
    "spec",
    ["loads_f=1", "bisect_f=0", "loads_f=1+bisect_f=0", "interp_f=0", "sample_f=512",
     "sample_f=2048+cap_f=2048", "ftz_v=0", "lazy_v=0", "tries_f=0", "regs_v=40",
     "block_r=2048+sub_r=512+regs_r=40", "pack_r=0+regs_r=0", "pack_r=128", "stages_r=2",
     "hist_p=0", "chunk_h=8192", "hist_p=64+chunk_h=2048+sub_h=512", "fold_n=1",
     "hist_p=0+fold_n=1+sample_f=512"],
)  # fmt: skip
def test_gpu_large_vocab_variants_equal_the_default(spec):
    """The wide tiles' defaults at V 49152 turned back one at a time: the bracket pass's
    16 columns a lane in flight (loads_f), the bracket's cut by bisection (bisect_f) and
    its interpolated steps (interp_f), the 1024-value sample with its 4096-value brackets
    (sample_f, cap_f: 2048 and 2048, and a 512-value sample whose wider brackets overflow
    lanes and send rows to the narrowing launch), the partials' flushed exps (ftz_v) and
    their argmax and smallest value found after their loop (lazy_v); and no bracket
    tries (tries_f 0: every cut row narrows in the narrowing launch): the default's
    tokens, counts, thresholds, kept masses and the partials' max, argmax and smallest
    value, bit for bit. regs_v: the partials compiled to at most 40 registers a thread
    (the same arithmetic, allocated otherwise); regs_r: the race in 2048-column blocks
    drawn 512 at a time, in 40 registers (its winner does not depend on the blocks);
    pack_r: the race drawn over every column (pack_r 0, in the compiler's registers)
    and over lists of up to 128 kept columns (which wider kept sets overflow); stages_r:
    the list pass's loads pipelined (the same lists); hist_p: no top-p cuts from counts
    of equal values (0), and counts in 8192-column programs and in 64 bins (fewer rows;
    the rest to the bracket launch), each cutting some rows itself; fold_n: the bracket
    launch narrows its misses itself (a 512-value sample misses some, stop 70)."""
    b, k, v = 16, 5, 49152
    logits, drafts, q, st, pos = _gpu_case(b, k, v, seed=29)
    args = (logits.cuda(), drafts.cuda(), None if q is None else q.cuda(), _on(st, "cuda"),
            pos.cuda())  # fmt: skip
    fields = {n: int(x) for n, x in (f.split("=") for f in spec.split("+"))}
    cfg = dataclasses.replace(kr.choose_rejection_config(v, b, k), **fields)
    got = []
    for config in (None, cfg):
        batch = Batch(*args, config)
        ws = batch.ws
        for t in (ws.row_thr, ws.row_sum, ws.part_max, ws.part_min):
            t.fill_(float("nan"))  # what a call does not write stays NaN in both
        ws.part_arg.fill_(-7)
        batch.run()
        got.append([t.cpu() for t in (*batch.outs(), ws.row_thr, ws.row_sum, ws.part_max,
                                      ws.part_arg, ws.part_min)])  # fmt: skip
        if ws.config.hist_p:
            assert int(ws.hist_done.sum()) > 0 and int(ws.hist.abs().sum()) == 0
    assert (got[0][0] >= -1).all()  # every token written
    for x, y in zip(*got):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


@gpu
@pytest.mark.parametrize(
    "spec", ["lazy_g=0", "lazy_g=1", "lazy_g=1+sub_g=4096", "lazy_g=1+sub_g=8192",
             "lazy_g=1+block_g=32768+sub_g=4096", "lazy_g=1+block_g=24576+sub_g=4096",
             "lazy_g=1+row_g=0"],
)  # fmt: skip
def test_gpu_greedy_large_vocab_tiles(spec):
    """The all-greedy launch at B 64, K 5, V 49152 in bf16 with ties (logits in steps of
    0.5, rows of -inf blocks), its argmax found in the loop or after it (lazy_g) over
    tiles of several widths: every block's max and first argmax equal PyTorch's, and the
    tokens and counts the reference walk's."""
    b, k, v = 64, 5, 49152
    g = torch.Generator().manual_seed(37)
    logits, drafts, _, _, pos = random_case(b, k, v, [SP(0.0)], dtype=torch.bfloat16,
                                            ties=True, gen=g)  # fmt: skip
    logits[3, :20000] = float("-inf")  # whole blocks of -inf, and a max past them
    logits[10] = float("-inf")  # nothing but -inf: the first column
    logits[11, -1] = 40.0  # the max in the last column
    st = make_params(b, [SP(0.0)])
    fields = {n: int(x) for n, x in (f.split("=") for f in spec.split("+"))}
    cfg = dataclasses.replace(kr.choose_rejection_config(v, b, k), **fields)
    batch = Batch(logits.cuda(), drafts.cuda(), None, _on(st, "cuda"), pos.cuda(), cfg)
    batch.ws.part_max.fill_(float("nan"))
    batch.ws.part_arg.fill_(-7)
    tokens, nacc, nemit = (t.cpu() for t in batch.run())
    want_max, want_arg, _ = _block_max_first_arg(logits, max(cfg.block_g or cfg.block_v,
                                                              cfg.block_v))  # fmt: skip
    n, nbg = want_max.numel(), want_max.shape[1]  # the launch lays them out [rows, nbg]
    assert torch.equal(batch.ws.part_max.view(-1)[:n].view(-1, nbg).cpu(), want_max)
    assert torch.equal(batch.ws.part_arg.view(-1)[:n].view(-1, nbg).cpu(), want_arg.int())
    rt, rn, re = ref_rejection(logits.float(), drafts, None, st, pos)
    assert torch.equal(tokens, rt) and torch.equal(nacc, rn) and torch.equal(nemit, re)


def _graph_sampler(b, k, v, seed):
    logits, drafts, q, st, pos = _gpu_case(b, k, v, seed)
    return [t.cuda() for t in (logits, drafts, q)], _on(st, "cuda"), pos.cuda()


@gpu
def test_gpu_graph_replay_equals_eager_and_no_sync():
    b, k, v = 64, 5, 49152
    (logits, drafts, q), st, pos = _graph_sampler(b, k, v, 1)
    rs = RejectionSampler(b, k, v, "cuda")
    eager = RejectionSampler(b, k, v, "cuda")
    rs(logits, drafts, q, st, pos)  # compile outside the capture
    rs.counters_to_host()  # allocates its pinned buffer once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rs(logits, drafts, q, st, pos)  # no host sync on the hot path
        rs.counters_to_host()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    rs.reset_counters()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        out = rs(logits, drafts, q, st, pos)
    torch.cuda.current_stream().wait_stream(s)
    rs.reset_counters()
    for seed in (2, 3):
        (l2, d2, q2), st2, p2 = _graph_sampler(b, k, v, seed)
        for dst, src in ((logits, l2), (drafts, d2), (q, q2), (pos, p2)):
            dst.copy_(src)
        for name in SamplingTensors._FIELDS:
            getattr(st, name).copy_(getattr(st2, name))
        graph.replay()
        want = eager(logits, drafts, q, st, pos)
        torch.cuda.synchronize()
        assert torch.equal(out.tokens, want.tokens)
        assert torch.equal(out.num_accepted, want.num_accepted)
        assert torch.equal(out.num_emitted, want.num_emitted)
    assert torch.equal(rs.proposed_counts, eager.proposed_counts)
    assert torch.equal(rs.accepted_counts, eager.accepted_counts)


@gpu
@pytest.mark.parametrize("pair, target, draft", LOSSLESS_CASES)
def test_gpu_lossless_200k(pair, target, draft):
    case = LOSSLESS_CASES.index((pair, target, draft))
    out = lossless_trials(200000, 3, target, draft, pair, seed=100 + case, device="cuda")
    _assert_lossless(out, f"{pair} {target}")


@gpu
def test_gpu_lossless_mixed_modes_200k():
    out = lossless_trials(200000, 4, SP(0.7, top_k=8, top_p=0.9), SP(1.2, top_k=5), "random",
                          seed=105, greedy_every=4, device="cuda")  # fmt: skip
    _assert_lossless(out, "mixed")


@triton.jit
def _bisect_probe_kernel(vals_ptr, e_ptr, n_ptr, above_ptr, target_ptr, out_ptr, found_ptr,
                         SIZE: tl.constexpr, MASS: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    # one case a program: _bisect_keys over its first n of SIZE values
    i = tl.program_id(0)
    slots = tl.arange(0, SIZE)
    valid = slots < tl.load(n_ptr + i)
    vals = tl.load(vals_ptr + i * SIZE + slots, mask=valid, other=float("-inf"))
    e = tl.load(e_ptr + i * SIZE + slots, mask=valid, other=0)
    above = tl.load(above_ptr + i)
    target = tl.load(target_ptr + i)
    found, v = kr._bisect_keys(vals, valid, e, above.to(tl.int32), above, target.to(tl.int32),
                               target.to(tl.float64), MASS, INTERP)  # fmt: skip
    tl.store(out_ptr + i, v)
    tl.store(found_ptr + i, found.to(tl.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mass", [True, False])
@pytest.mark.parametrize("interp", [False, True])
def test_bisect_keys_finds_the_sorted_running_sums_crossing(interp, mass, device):
    """_bisect_keys (binary or interpolated steps) against the sort: the largest value
    whose measure at or above it (above + the masses, or the count, of the values >= it)
    reaches the target, over cases of 1-64 values with tie groups, negative and zero
    values, runs of adjacent float32s, masses spanning 2^0-2^40, and targets at, between
    and past the running sums (past the total: not found)."""
    g = torch.Generator().manual_seed(71 + interp + 10 * mass)
    cases, size = 96, 64
    n = torch.randint(1, size + 1, (cases,), generator=g)
    vals = torch.full((cases, size), -math.inf)
    e = torch.zeros(cases, size, dtype=torch.int64)
    above = torch.randint(0, 1000, (cases,), generator=g)
    target = torch.zeros(cases, dtype=torch.int64)
    want = torch.full((cases,), math.nan)
    for c in range(cases):
        k = int(n[c])
        pool = torch.randn(max(1, k // 3), generator=g) * 4  # tie groups
        v = torch.where(torch.rand(k, generator=g) < 0.5,
                        pool[torch.randint(0, len(pool), (k,), generator=g)],
                        torch.randn(k, generator=g) * 4)  # fmt: skip
        v[torch.rand(k, generator=g) < 0.1] = 0.0
        if c % 3 == 2:  # a few adjacent float32s: a step's point often lands on a key
            base = torch.randn(1, generator=g).abs() + 0.5
            ulps = torch.randint(0, max(2, k // 4), (k,), generator=g, dtype=torch.int32)
            v = (base.view(torch.int32) + ulps).view(torch.float32)
        w = (2.0 ** (torch.rand(k, generator=g) * 40)).long() if mass else torch.ones(k).long()
        vals[c, :k], e[c, :k] = v, w
        order = torch.argsort(v, descending=True, stable=True)
        run = int(above[c]) + torch.cumsum(w[order], 0)
        # at a running sum, just past one, or past the total
        pick = int(torch.randint(0, k + 1, (1,), generator=g))
        step = 1 if pick == k else int(torch.randint(0, 2, (1,), generator=g))
        t = int(run[min(pick, k - 1)]) + step
        target[c] = t
        hit = torch.nonzero(run >= t).flatten()
        if len(hit):
            want[c] = float(v[order][hit[0]])
    out = torch.full((cases,), math.nan, device=device)
    found = torch.full((cases,), -1, dtype=torch.int32, device=device)
    _bisect_probe_kernel[(cases,)](
        vals.to(device), e.to(device), n.to(device), above.to(device), target.to(device), out,
        found, size, mass, interp,
    )  # fmt: skip
    got_found = found.cpu() == 1
    assert torch.equal(got_found, ~want.isnan()), (got_found, want)
    assert torch.equal(out.cpu()[got_found], want[got_found])


@pytest.mark.parametrize(
    "field, value, match",
    [("small_f", 300, "small_f must be a power of two or 0, got 300"),
     ("sample_k", -8, "sample_k must be a power of two or 0, got -8"),
     ("block_r", 0, "block_r must be a power of two, got 0"),
     ("block_g", 24, "block_g must be a power of two or a multiple of sub_g, got 24"),
     ("block_v", 48, "block_v must be a power of two or a multiple of sub_v, got 48"),
     ("block_g", -8, "block_g must be a power of two or a multiple of sub_g, got -8"),
     ("sample_f", 1536, "sample_f must be a power of two, got 1536"),
     ("tries_f", 2.0, "tries_f must be an int >= 0, got 2.0"),
     ("stages_f", 0, "stages_f must be an int >= 1, got 0"),
     ("stages_g", True, "stages_g must be an int >= 1, got True"),
     ("split_f", 3000, "split_f must be a power of two or 0, got 3000"),
     ("rows_s", 0, "rows_s must be an int >= 1, got 0"),
     ("regs_v", -40, "regs_v must be an int >= 0, got -40"),
     ("regs_r", 40.0, "regs_r must be an int >= 0, got 40.0"),
     ("pack_r", -1, "pack_r must be an int >= 0, got -1"),
     ("stages_r", 0, "stages_r must be an int >= 1, got 0"),
     ("hist_p", 300, "hist_p must be a power of two or 0, got 300"),
     ("chunk_h", 0, "chunk_h must be a power of two, got 0"),
     ("sub_h", 1000, "sub_h must be a power of two, got 1000"),
     ("loads_f", 3, "loads_f must be a power of two, got 3"),
     ("loads_f", 4, "loads_f must be 1 or 16, got 4")],
)  # fmt: skip
def test_config_refuses_a_bad_tile_or_count(field, value, match):
    # a width the kernels would take to tl.arange, or a count below its floor: refused
    # when the config is made, not at a compile deep inside a launch; the config it was
    # replaced from is unchanged
    before = dataclasses.asdict(FAST_TILES)
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(FAST_TILES, **{field: value})
    assert dataclasses.asdict(FAST_TILES) == before
