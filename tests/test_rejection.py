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

import math

import numpy as np
import pytest
import torch

from specdraft.kernels import rejection as kr
from specdraft.sampling import (
    ACCEPT,
    BONUS,
    RESIDUAL,
    SamplingParams,
    SamplingTensors,
    filtered_probs,
    keyed_uniform,
)

SP = SamplingParams
gpu = pytest.mark.gpu
interp = pytest.mark.interpreter

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
    before = (probs[:, None, :] * (z[:, None, :] > z[:, :, None])).sum(-1)
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
    block_v=4, rows_p=4, block_t=4, rows_t=2, cap=2, nsplit=2, block_r=4, rows_r=2, rows_w=2
)
# Many narrowing passes over a wider vocabulary at a bearable interpreter cost.
NARROW_TILES = kr.RejectionConfig(
    block_v=64, rows_p=8, block_t=64, rows_t=8, cap=4, nsplit=4, block_r=64, rows_r=4, rows_w=4
)
KINDS = [SP(0.0), SP(1.0), SP(0.7, top_k=5), SP(1.3, top_p=0.8), SP(0.5, top_k=9, top_p=0.6),
         SP(2.0, top_k=1), SP(1.0, top_p=0.05), SP(1.0, top_k=40)]  # fmt: skip


# ------------------------------------------------------------------------ keyed draws

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


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


@interp
@pytest.mark.parametrize("stream", [ACCEPT, RESIDUAL, BONUS])
def test_uniforms_bit_equal_to_keyed_uniform(stream):
    seed = torch.tensor([0, 1, 2**63 - 1, 2**62 + 12345, 987654321], dtype=torch.int64)
    pos = torch.tensor([0, 2**40 + 3, 17, 2**31, 5], dtype=torch.int64)
    v = 37
    u = torch.empty(5, v)
    e = torch.empty(5, v)
    _draws_kernel[(5,)](seed, pos, u, e, v, kr._stream_mul(int(stream)), 64)
    ref = keyed_uniform(seed[:, None], pos[:, None], stream, v)[:, 0]
    assert torch.equal(u.view(torch.int32), ref.view(torch.int32))
    # E = -log1p(-u) to float32 rounding (the race's winners depend on it).
    ref_e = -torch.log1p(-ref.double())
    assert ((e.double() - ref_e).abs() / ref_e).max() < 1.2e-7
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


@interp
@pytest.mark.parametrize("b, k, v", [(6, 1, 16), (13, 3, 16), (5, 5, 42), (3, 0, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tiles", ["default", "small"])
def test_greedy_matches_reference(b, k, v, dtype, tiles):
    g = torch.Generator().manual_seed(b * 100 + k)
    logits, drafts, _, _, pos = random_case(b, k, v, [SP(0.0)], dtype=dtype, ties=True, gen=g)
    st = make_params(b, [SP(0.0)])
    cfg = SMALL_TILES if tiles == "small" else None
    _check_against_reference(logits, drafts, None, st, pos, cfg)


@interp
@pytest.mark.parametrize("b, k, v", [(8, 3, 16), (9, 2, 23), (4, 5, 64)])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("tiles", ["default", "small"])
def test_probabilistic_matches_reference(b, k, v, ties, tiles):
    g = torch.Generator().manual_seed(b * 1000 + k * 10 + ties)
    logits, drafts, q, st, pos = random_case(b, k, v, KINDS, ties=ties, gen=g)
    cfg = SMALL_TILES if tiles == "small" else None
    _check_against_reference(logits, drafts, q, st, pos, cfg)


# ----------------------------------------------------------- the filter, as sampling's


def _kernel_probs(logits, st, config=None):
    """The kernel's p per row (K = 0: one row per request), from its workspace."""
    n, v = logits.shape
    drafts = torch.empty(n, 0, dtype=torch.int64)
    q = torch.empty(n, 0, v)
    batch = Batch(logits, drafts, q, st, torch.arange(n), config)
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
    rows.append([2.0] * v)  # one tie group: every filter keeps all
    params.append(SP(1.0, top_k=3, top_p=0.2))
    return torch.tensor(rows), params


@interp
@pytest.mark.parametrize("v, tiles", [(16, "default"), (16, "small"), (203, "narrow")])
def test_threshold_matches_sampling(v, tiles):
    """Kept set exactly filtered_probs' (ties, boundaries, -inf, k >= V), probabilities
    equal to float32 rounding. Small scratch (2 or 4 candidates) makes the narrowing
    passes run, many times at v = 203, and tie groups larger than the scratch end
    them at a single key."""
    g = torch.Generator().manual_seed(v)
    logits, params = _filter_rows(v, g)
    st = SamplingTensors.from_params(
        [SP(p.temperature, p.top_k, p.top_p, seed=1) for p in params], "cpu"
    )
    cfg = {"default": None, "small": SMALL_TILES, "narrow": NARROW_TILES}[tiles]
    p, keep, z = _kernel_probs(logits, st, cfg)
    want = filtered_probs(logits, st)
    ref = ref_filtered64(logits, st.greedy, st.temperature, st.top_k, st.top_p)
    for i in range(len(params)):
        assert torch.equal(keep[i] & (z[i] > -math.inf), want[i] > 0), (i, params[i])
        assert torch.equal(want[i] > 0, ref[i] > 0), (i, params[i])
    torch.testing.assert_close(p, want, atol=1e-6, rtol=1e-5)
