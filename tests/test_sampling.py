"""specdraft.sampling: parameter validation, the filtered distribution against an
independent float64 reference, the keyed hash against a pure-Python SplitMix64, the
sampler's output distribution by chi-square (with a check that the test can fail), and
the fused Triton path (kernels/sampling.py) against the torch definition."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from specdraft import kernels, ops
from specdraft import sampling as sampling_mod
from specdraft.sampling import (
    ACCEPT,
    BONUS,
    DRAFT_PROPOSAL,
    RESIDUAL,
    TARGET_SAMPLE,
    SamplingParams,
    SamplingTensors,
    SeedSource,
    Stream,
    _unit_from_bits,
    filtered_probs,
    keyed_uniform,
    logprobs,
    sample,
)

SP = SamplingParams

# ------------------------------------------------------------------------ references

_M64 = (1 << 64) - 1
_G = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    z &= _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def ref_uniform(seed: int, position: int, stream: int, counter: int) -> np.float32:
    """The documented key and mapping, in unbounded Python ints masked to 64 bits."""
    h = _mix(seed + _G)
    h = _mix(h + _G * (position + 1))
    h = _mix(h + _G * (stream + 1))
    x = _mix(h + _G * (counter + 1))
    y = (x >> 11) | 1
    return min(np.float32(y) * np.float32(2.0**-53), np.float32(1.0 - 2.0**-24))


def ref_filtered(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """float64, straight from the definitions: top-k by the k-th largest value (ties
    kept), then top-p walking tie groups in descending probability."""
    v = logits.shape[0]
    if p.greedy:
        out = np.zeros(v)
        out[int(np.argmax(logits))] = 1.0  # numpy: first index of the maximum
        return out
    z = logits.astype(np.float64) / float(np.float32(p.temperature))
    keep = np.ones(v, dtype=bool)
    if 0 < p.top_k < v:
        kth = np.sort(z)[::-1][p.top_k - 1]
        keep = z >= kth
    e = np.where(keep, np.exp(z - z.max()), 0.0)
    probs = e / e.sum()
    top_p = float(np.float32(p.top_p))
    if top_p < 1:
        order = sorted(np.flatnonzero(keep), key=lambda i: -probs[i])
        kept = np.zeros(v, dtype=bool)
        mass_before, i = 0.0, 0
        while i < len(order) and mass_before < top_p:
            j = i
            while j < len(order) and probs[order[j]] == probs[order[i]]:
                j += 1
            group = order[i:j]
            kept[group] = True
            mass_before += probs[group].sum()
            i = j
        probs = np.where(kept, probs, 0.0)
        probs /= probs.sum()
    return probs


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; bins expecting < 5 are pooled (and the
    pool, if still < 5, merged into the smallest bin). A draw in a zero-probability bin
    gives inf."""
    n = counts.sum()
    expected = probs * n
    zero = expected == 0
    if counts[zero].sum() > 0:
        return math.inf, 0
    obs, exp = counts[~zero].astype(np.float64), expected[~zero]
    small = exp < 5
    bins_o, bins_e = list(obs[~small]), list(exp[~small])
    if small.any():
        po, pe = obs[small].sum(), exp[small].sum()
        if pe < 5 and bins_e:
            j = int(np.argmin(bins_e))
            bins_o[j] += po
            bins_e[j] += pe
        else:
            bins_o.append(po)
            bins_e.append(pe)
    o, e = np.array(bins_o), np.array(bins_e)
    return float(((o - e) ** 2 / e).sum()), len(e) - 1


def chi_limit(df: int) -> float:
    return df + 10 * math.sqrt(2 * df)


# ----------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"temperature": -0.5}, ValueError, ["temperature", "-0.5", ">="]),
        ({"temperature": float("nan")}, ValueError, ["temperature", "nan", "finite"]),
        ({"temperature": float("inf")}, ValueError, ["temperature", "inf"]),
        ({"temperature": 1e-7}, ValueError, ["temperature", "1e-07", "1e-05"]),
        ({"temperature": "1.0"}, TypeError, ["temperature", "str"]),
        ({"temperature": True}, TypeError, ["temperature", "bool"]),
        ({"top_k": -1}, ValueError, ["top_k", "-1", "[0, 2147483647]"]),
        ({"top_k": 2**31}, ValueError, ["top_k", "2147483648"]),
        ({"top_k": 5.0}, TypeError, ["top_k", "float"]),
        ({"top_k": np.float32(5)}, TypeError, ["top_k", "float32"]),
        ({"top_k": True}, TypeError, ["top_k", "bool"]),
        ({"top_p": 0.0}, ValueError, ["top_p", "0.0", "(0, 1]"]),
        ({"top_p": 1.5}, ValueError, ["top_p", "1.5", "(0, 1]"]),
        ({"top_p": float("nan")}, ValueError, ["top_p", "nan"]),
        ({"top_p": None}, TypeError, ["top_p", "NoneType"]),
        ({"seed": -1}, ValueError, ["seed", "-1", "9223372036854775807"]),
        ({"seed": 2**63}, ValueError, ["seed", "9223372036854775808"]),
        ({"seed": 1.5}, TypeError, ["seed", "float"]),
        ({"seed": False}, TypeError, ["seed", "bool"]),
    ],
)
def test_params_reject(kwargs, exc, words):
    with pytest.raises(exc) as info:
        SP(**kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_params_accept_and_normalise():
    p = SP(temperature=np.float32(0.5), top_k=np.int64(7), top_p=np.float64(0.9), seed=np.int32(3))
    assert (type(p.temperature), type(p.top_k), type(p.top_p), type(p.seed)) == (
        float,
        int,
        float,
        int,
    )
    assert p == SP(0.5, 7, 0.9, 3) and hash(p) == hash(SP(0.5, 7, 0.9, 3))
    assert SP(temperature=0).greedy and not SP(temperature=0, top_k=3).uses_filter
    assert SP(top_k=3).uses_filter and SP(top_p=0.5).uses_filter
    assert not SP(top_p=1 - 1e-9).uses_filter  # rounds to 1.0 as float32: off
    assert SP(temperature=2, top_k=0, top_p=1, seed=0).seed == 0
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # frozen


def test_seed_source_distinct_and_resolve():
    src = SeedSource(base=2**63 - 5)
    seeds = [src.next_seed() for _ in range(10000)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**63 for s in seeds)
    assert SeedSource(base=7).next_seed() == SeedSource(base=7).next_seed()
    assert src.resolve(SP(seed=5)).seed == 5
    assert src.resolve(SP()).seed is not None
    t = SamplingTensors.from_params([SP(), SP(), SP(seed=9)], "cpu")
    assert len(set(t.seed.tolist())) == 3 and t.seed[2].item() == 9


# ---------------------------------------------------------------- SamplingTensors


def test_tensors_from_params_and_write_rows():
    t = SamplingTensors(6, "cpu")
    assert t.all_greedy and not t.any_filter and bool(t.greedy.all())
    t.write_rows([4, 1], [SP(0.5, top_k=3, seed=11), SP(0.0, seed=12)])  # scattered
    t.write_rows(range(2, 4), [SP(1.5, top_p=0.25, seed=13), SP(2.0, seed=14)])  # contiguous
    assert t.greedy.tolist() == [True, True, False, False, False, True]
    assert t.temperature.tolist() == [0.0, 0.0, 1.5, 2.0, 0.5, 0.0]
    assert t.top_k.tolist() == [0, 0, 0, 0, 3, 0] and t.top_k.dtype == torch.int32
    assert t.top_p.tolist() == [1.0, 1.0, 0.25, 1.0, 1.0, 1.0]
    assert t.seed.tolist() == [0, 12, 13, 14, 11, 0] and t.seed.dtype == torch.int64
    assert t.any_filter and not t.all_greedy
    head = t.narrow(0, 2)
    assert len(head) == 2 and head.all_greedy and not head.any_filter
    ptr = t.seed.data_ptr()
    t.write_rows([0], [SP(1.0, seed=99)])
    assert t.seed.data_ptr() == ptr and head.seed[0].item() == 99 and not head.all_greedy
    sel = t.select(torch.tensor([4, 4, -1, 2]))
    assert sel.seed.tolist() == [11, 11, 99, 13] and sel.any_filter


@pytest.mark.parametrize("n", [1, 5, 300])
def test_select_one_launch_equals_index_select(device, n):
    """SamplingTensors.select through kernels.gather_params (one launch) equals the torch
    gathers field by field, fresh random rows; entries outside the table (-1, -5, the
    row count) read row 0 on both paths."""
    g = torch.Generator().manual_seed(n)
    rows = 7
    t = SamplingTensors(rows, device)
    params = []
    for i in range(rows):
        u = torch.rand(3, generator=g).tolist()
        seed = int(torch.randint(0, 2**40, (1,), generator=g))
        params.append(SP(2 * u[0] + 0.1, top_k=int(9 * u[1]), top_p=0.9 * u[2] + 0.1, seed=seed)
                      if i % 3 else SP(0.0, seed=i))  # fmt: skip
    t.write_rows(range(rows), params)
    index = torch.randint(0, rows, (n,), generator=g)
    index[0] = -1
    if n > 2:
        index[1], index[2] = -5, rows
    index = index.to(device)
    got = t.select(index)
    with ops.use_backend("torch"):
        want = t.select(index)
    for name in SamplingTensors._FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert torch.equal(got.seed[:1], t.seed[:1])
    assert got.any_filter == t.any_filter and got.all_greedy == t.all_greedy
    fields = [getattr(t, name) for name in SamplingTensors._FIELDS]
    with pytest.raises(TypeError, match="index"):
        kernels.gather_params(index.float(), *fields)
    with pytest.raises(ValueError, match="temperature"):
        kernels.gather_params(index, fields[0], fields[1][:-1], *fields[2:])


@pytest.mark.parametrize(
    "rows, params, exc, word",
    [
        ([0, 9], [SP(), SP()], ValueError, "rows"),
        ([1, 1], [SP(), SP()], ValueError, "distinct"),
        ([0], [SP(), SP()], ValueError, "same length"),
        ([0], [{"temperature": 1.0}], TypeError, "SamplingParams"),
        ([1.0], [SP()], TypeError, "rows"),
    ],
)
def test_write_rows_rejects(rows, params, exc, word):
    with pytest.raises(exc, match=word):
        SamplingTensors(4, "cpu").write_rows(rows, params)


# --------------------------------------------------------------------------- uniforms


def test_uniform_matches_python_splitmix():
    seeds = [0, 1, 12345, 2**63 - 1, 2**62 + 3]
    positions = [0, 1, 7, 2**31 + 5, 2**40 + 1]
    for seed, pos, stream in zip(seeds, positions, [1, 2, 3, 4, 5]):
        got = keyed_uniform(torch.tensor([seed]), torch.tensor([pos]), stream, num=9)[0]
        want = [ref_uniform(seed, pos, stream, c) for c in range(9)]
        assert got.tolist() == [float(w) for w in want]
        one = keyed_uniform(torch.tensor([seed]), torch.tensor([pos]), stream)
        assert one.tolist() == [float(want[0])]  # one draw per key is counter 0


def test_uniform_extremes_never_0_or_1():
    x = torch.tensor([0, -1, 2**63 - 1, -(2**63), 2**11 - 1, -(2**11)], dtype=torch.int64)
    u = _unit_from_bits(x)
    assert bool(((u > 0) & (u < 1)).all())
    assert u.min().item() == 2.0**-53 and u.max().item() == 1.0 - 2.0**-24


def test_uniform_moments_and_independence():
    g = torch.Generator().manual_seed(5)
    seeds = torch.randint(0, 2**62, (64,), generator=g)
    pos = torch.randint(0, 4096, (64,), generator=g)
    u = keyed_uniform(seeds, pos, RESIDUAL, num=4096).double()
    n = u.numel()
    assert bool(((u > 0) & (u < 1)).all())
    assert abs(u.mean().item() - 0.5) < 6 * math.sqrt(1 / 12 / n)
    assert abs(u.var().item() - 1 / 12) < 6 * math.sqrt((1 / 80 - 1 / 144) / n)
    # Neighbouring counters, and the same keys on other streams / positions, uncorrelated.
    others = [
        u[:, 1:].flatten(),
        keyed_uniform(seeds, pos, BONUS, num=4096).double().flatten(),
        keyed_uniform(seeds, pos + 1, RESIDUAL, num=4096).double().flatten(),
        keyed_uniform(seeds + 1, pos, RESIDUAL, num=4096).double().flatten(),
    ]
    base = [u[:, :-1].flatten()] + [u.flatten()] * 3
    for a, b in zip(base, others):
        r = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
        assert abs(r) < 6 / math.sqrt(a.numel()), r


def test_uniform_broadcast_and_checks():
    u = keyed_uniform(torch.tensor([[3], [4]]), torch.arange(5), ACCEPT)
    assert u.shape == (2, 5)
    assert u[1, 2].item() == keyed_uniform(torch.tensor([4]), torch.tensor([2]), ACCEPT).item()
    with pytest.raises(ValueError, match="stream"):
        keyed_uniform(torch.tensor([1]), torch.tensor([1]), 99)
    with pytest.raises(TypeError, match="seed"):
        keyed_uniform(torch.tensor([1.0]), torch.tensor([1]), ACCEPT)
    assert [int(s) for s in Stream] == [1, 2, 3, 4, 5]
    assert {DRAFT_PROPOSAL, ACCEPT, RESIDUAL, BONUS, TARGET_SAMPLE} == set(Stream)


# ---------------------------------------------------------------------- distribution


def _tied_logits(n: int, v: int, gen: torch.Generator) -> torch.Tensor:
    """Half the rows on a 0.25 grid (many exact ties, top-k boundaries inside tie
    groups), half continuous."""
    cont = torch.randn(n, v, generator=gen) * 2
    grid = torch.randint(-8, 9, (n, v), generator=gen).float() * 0.25
    return torch.where(torch.arange(n).unsqueeze(1) % 2 == 0, grid, cont)


GRID = [
    SP(temperature=t, top_k=k, top_p=p)
    for t, k, p in itertools.product([0.0, 0.5, 1.0], [0, 1, 5], [1.0, 0.8])
]


@pytest.mark.parametrize("v", [1, 6, 37])
def test_filtered_probs_matches_reference(v):
    g = torch.Generator().manual_seed(v)
    params = GRID * 6
    logits = _tied_logits(len(params), v, g)
    probs = filtered_probs(logits, params)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    torch.testing.assert_close(probs.sum(-1).double(), torch.ones(len(params), dtype=torch.float64))
    for i, p in enumerate(params):
        want = ref_filtered(logits[i].double().numpy(), p)
        got = probs[i].double().numpy()
        assert np.array_equal(got > 0, want > 0), (i, p)
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5, err_msg=str(p))
    # any_filter=False is the same where no row filters.
    plain = [p for p in params if not p.uses_filter]
    lg = logits[: len(plain)]
    torch.testing.assert_close(
        filtered_probs(lg, plain, any_filter=False), filtered_probs(lg, plain), atol=0, rtol=0
    )


def test_filtered_probs_tie_and_boundary_rules():
    ln = math.log
    # top-k keeps everything tied with the k-th largest.
    got = filtered_probs(torch.tensor([[3.0, 1.0, 3.0, 3.0]]), SP(top_k=1))
    torch.testing.assert_close(got, torch.tensor([[1 / 3, 0, 1 / 3, 1 / 3]]))
    # top-p: p = [1/2, 1/4, 1/8, 1/8]; the 1/8 pair is one tie group with 3/4 before it.
    logits = torch.tensor([[ln(4), ln(2), 0.0, 0.0]])
    keep_pair = filtered_probs(logits, SP(top_p=0.75 + 1e-4))
    torch.testing.assert_close(keep_pair, torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    drop_pair = filtered_probs(logits, SP(top_p=0.75 - 1e-4))
    torch.testing.assert_close(drop_pair, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    # The top token survives any top_p; top-p acts after top-k.
    assert filtered_probs(logits, SP(top_p=1e-6))[0].tolist() == [1.0, 0, 0, 0]
    after_k = filtered_probs(logits, SP(top_k=2, top_p=0.7))  # [2/3, 1/3] -> keep both
    torch.testing.assert_close(after_k, torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    # Greedy: first index of the maximum; -inf logits are fine.
    g = filtered_probs(torch.tensor([[1.0, 5.0, 5.0, -math.inf]]), SP(temperature=0))
    assert g.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_sample_deterministic_and_keyed():
    g = torch.Generator().manual_seed(1)
    n, v = 512, 1000
    logits = torch.randn(n, v, generator=g) * 0.1  # nearly flat: equal tokens ~ 1/v by chance
    params = SamplingTensors.from_params([SP(1.0, seed=1000 + i) for i in range(n)], "cpu")
    pos = torch.arange(n) + 100
    a = sample(logits, params, pos, DRAFT_PROPOSAL)
    assert a.dtype == torch.int64 and a.shape == (n,)
    again = SamplingTensors.from_params([SP(1.0, seed=1000 + i) for i in range(n)], "cpu")
    assert torch.equal(a, sample(logits.clone(), again, pos.clone(), DRAFT_PROPOSAL))
    reseeded = SamplingTensors.from_params([SP(1.0, seed=2000 + i) for i in range(n)], "cpu")
    for other in (
        sample(logits, params, pos, TARGET_SAMPLE),
        sample(logits, params, pos + 1, DRAFT_PROPOSAL),
        sample(logits, reseeded, pos, DRAFT_PROPOSAL),
    ):
        assert (other == a).float().mean().item() < 0.02


def test_sample_modes_and_api():
    g = torch.Generator().manual_seed(2)
    params = GRID * 3
    logits = _tied_logits(len(params), 29, g).to(torch.bfloat16)
    pos = torch.arange(len(params), dtype=torch.int32)
    tokens, probs = sample(logits, params, pos, BONUS, return_probs=True)
    torch.testing.assert_close(probs, filtered_probs(logits, params), atol=0, rtol=0)
    assert bool((probs.gather(1, tokens[:, None]) > 0).all())
    greedy = torch.tensor([p.greedy for p in params])
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
    greedy_params = [SP(0.0)] * len(params)
    assert torch.equal(
        sample(logits, greedy_params, pos, BONUS, all_greedy=True), logits.argmax(-1)
    )
    t, q = sample(logits, SP(0.0), pos, BONUS, all_greedy=True, return_probs=True)
    assert torch.equal(t, logits.argmax(-1)) and torch.equal(q.argmax(-1), t)
    lp = logprobs(logits)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, torch.log_softmax(logits.float(), -1))
    with pytest.raises(ValueError, match="positions"):
        sample(logits, params, pos[:-1], BONUS)
    with pytest.raises(ValueError, match="logits"):
        sample(logits[0], params, pos, BONUS)
    with pytest.raises(TypeError, match="logits"):
        sample(logits.double(), params, pos, BONUS)
    with pytest.raises(ValueError, match="one row per logits row"):
        sample(logits, params[:-1], pos, BONUS)
    with pytest.raises(ValueError, match="stream"):
        sample(logits, params, pos, 0)


CONFIGS = [
    SP(1.0),
    SP(0.5, top_k=5),
    SP(1.0, top_p=0.8),
    SP(0.7, top_k=10, top_p=0.9),
    SP(1.3, top_k=3),
]


def _draw(configs, logits_rows, draws, vary, device="cpu", stream=DRAFT_PROPOSAL, any_filter=True):
    """`draws` tokens per config, all configs mixed in one batch; keys differ by seed
    (one position) or by position (one seed). any_filter=False (no config filters) takes
    the fused Triton path where ops picks Triton."""
    src = SeedSource(base=12345)
    params, positions = [], []
    for c in configs:
        if vary == "seed":
            params += [replace(c, seed=src.next_seed()) for _ in range(draws)]
            positions.append(torch.full((draws,), 11))
        else:
            params += [replace(c, seed=src.next_seed())] * draws
            positions.append(torch.arange(draws) + 3)
    logits = logits_rows.repeat_interleave(draws, 0).to(device)
    tensors = SamplingTensors.from_params(params, device)
    tokens = sample(logits, tensors, torch.cat(positions).to(device), stream, any_filter=any_filter)
    v = logits_rows.shape[1]
    return [
        np.bincount(tokens[i * draws : (i + 1) * draws].cpu().numpy(), minlength=v)
        for i in range(len(configs))
    ]


def _config_logits(n: int, v: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    rows = torch.randn(n, v, generator=g) * 1.5
    rows[:, 3] = rows[:, 5]  # a tie in every row
    return rows


@pytest.mark.parametrize("vary", ["seed", "position"])
def test_sample_distribution_chi_square(vary):
    v, draws = 24, 20_000
    configs = CONFIGS + [SP(0.0)]
    rows = _config_logits(len(configs), v)
    counts = _draw(configs, rows, draws, vary)
    for c, row, cnt in zip(configs, rows, counts):
        want = ref_filtered(row.double().numpy(), c)
        stat, df = chi_square(cnt, want)
        assert stat <= chi_limit(df), (c, stat, df)
    assert counts[-1][int(rows[-1].argmax())] == draws  # greedy


def test_chi_square_detects_wrong_distribution():
    v, draws = 24, 20_000
    rows = _config_logits(2, v)
    cnt_t, cnt_k = _draw([SP(0.5), SP(1.0, top_k=5)], rows, draws, "seed")
    stat, df = chi_square(cnt_t, ref_filtered(rows[0].double().numpy(), SP(1.0)))
    assert stat > chi_limit(df), "temperature ignored went unnoticed"
    stat, df = chi_square(cnt_k, ref_filtered(rows[1].double().numpy(), SP(1.0)))
    assert stat > chi_limit(df), "top-k ignored went unnoticed"


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_matches_cpu_and_captures():
    g = torch.Generator().manual_seed(7)
    n, v = 1024, 32000
    params = (GRID * (n // len(GRID) + 1))[:n]
    params = [replace(p, seed=i * 7919) for i, p in enumerate(params)]
    logits = (torch.randn(n, v, generator=g) * 3).to(torch.bfloat16)
    pos = torch.randint(0, 8192, (n,), generator=g)

    # The hash is integer arithmetic: bit-identical on both devices.
    seeds = torch.tensor([p.seed for p in params])
    u_cpu = keyed_uniform(seeds[:64], pos[:64], RESIDUAL, num=v)
    assert torch.equal(
        keyed_uniform(seeds[:64].cuda(), pos[:64].cuda(), RESIDUAL, num=v).cpu(), u_cpu
    )

    t_cpu, p_cpu = sample(logits, params, pos, DRAFT_PROPOSAL, return_probs=True)
    dev = SamplingTensors.from_params(params, "cuda")
    t_gpu, p_gpu = sample(logits.cuda(), dev, pos.cuda(), DRAFT_PROPOSAL, return_probs=True)
    torch.testing.assert_close(p_gpu.cpu(), p_cpu, atol=1e-5, rtol=1e-4)
    greedy = torch.tensor([p.greedy for p in params])
    assert torch.equal(t_gpu.cpu()[greedy], t_cpu[greedy])
    assert (t_gpu.cpu() == t_cpu).float().mean().item() >= 0.998  # float rounding only

    # Capture into a CUDA graph over persistent buffers; replay on new contents equals eager.
    s_logits, s_pos = logits.cuda(), pos.cuda()
    s_params = SamplingTensors(n, "cuda")
    s_params.write_rows(range(n), params)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            sample(s_logits, s_params, s_pos, DRAFT_PROPOSAL)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s_tokens = sample(s_logits, s_params, s_pos, DRAFT_PROPOSAL)
    s_logits.copy_(torch.randn(n, v, device="cuda").to(torch.bfloat16))
    s_pos.add_(1)
    s_params.write_rows(range(0, n, 2), [replace(p, top_k=3) for p in params[::2]])
    graph.replay()
    torch.cuda.set_sync_debug_mode("error")  # eager sample must not synchronise either
    try:
        eager = sample(s_logits, s_params, s_pos, DRAFT_PROPOSAL)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(s_tokens, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("vary", ["seed", "position"])
def test_gpu_distribution_200k(vary):
    v, draws = 64, 200_000
    configs = [SP(1.0), SP(0.5, top_k=5), SP(0.7, top_k=10, top_p=0.9)]
    rows = _config_logits(len(configs), v)
    for c, row, cnt in zip(configs, rows, _draw(configs, rows, draws, vary, "cuda")):
        stat, df = chi_square(cnt, ref_filtered(row.double().numpy(), c))
        assert stat <= chi_limit(df), (c, stat, df)


# ------------------------------------------------------------ fused path (kernels/sampling)

TEMPS = [0.0, 0.5, 0.7, 1.0, 1.3, 2.0]


def _fresh_case(n: int, v: int, dtype: torch.dtype, gen: torch.Generator, device: str):
    """Fresh logits (half the rows on a tie grid, some -inf entries, random scale), mixed
    greedy / temperature rows with fresh seeds, positions int32 or int64."""
    logits = _tied_logits(n, v, gen) * (0.5 + 3 * torch.rand(n, 1, generator=gen))
    if v > 2:
        logits[torch.rand(n, v, generator=gen) < 0.05] = -math.inf
        logits[:, 0] = logits[:, 0].clamp(min=-30.0)  # a finite logit in every row
    temps = torch.randint(0, len(TEMPS), (n,), generator=gen).tolist()
    seeds = torch.randint(0, 2**62, (n,), generator=gen).tolist()
    params = [SP(TEMPS[t], seed=s) for t, s in zip(temps, seeds)]
    pdtype = torch.int32 if int(torch.randint(0, 2, (), generator=gen)) else torch.int64
    pos = torch.randint(0, 2**20, (n,), generator=gen, dtype=pdtype)
    tensors = SamplingTensors.from_params(params, device)
    return logits.to(device, dtype), tensors, pos.to(device), params


def _torch_sample(*args, **kw):
    with ops.use_backend("torch"):
        return sample(*args, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, v, checks", [(6, 1, 2), (123, 37, 3), (50, 1000, 8)])
def test_fused_matches_torch(device, dtype, n, v, checks):
    """Tokens equal to the torch definition's (several hundred draws), probs to rtol
    1e-5, rows summing to 1, greedy rows exact; every output element written (poisoned
    outputs through the launcher give the same bits as sample())."""
    g = torch.Generator().manual_seed(1000 * n + v)
    draws = 0
    for _ in range(checks):
        logits, st, pos, params = _fresh_case(n, v, dtype, g, device)
        assert sampling_mod._fused(logits)
        want_t, want_p = _torch_sample(logits, st, pos, DRAFT_PROPOSAL, return_probs=True)
        got_t, got_p = sample(logits, st, pos, DRAFT_PROPOSAL, any_filter=False, return_probs=True)
        assert got_t.dtype == torch.int64 and got_p.dtype == torch.float32
        assert torch.equal(got_t, want_t)
        torch.testing.assert_close(got_p, want_p, rtol=1e-5, atol=1e-12)
        ones = torch.ones(n, dtype=torch.float64, device=device)
        torch.testing.assert_close(got_p.double().sum(-1), ones, atol=1e-5, rtol=0)
        greedy = st.greedy
        assert torch.equal(got_p[greedy], want_p[greedy])  # exactly one-hot
        assert torch.equal(got_t[greedy], logits.argmax(-1)[greedy])
        # Tokens alone (no probs written) are the same tokens.
        assert torch.equal(sample(logits, st, pos, DRAFT_PROPOSAL, any_filter=False), got_t)
        # Poisoned outputs: every element is written, with the same bits.
        out_t = torch.full((n,), -7, dtype=torch.int64, device=device)
        out_p = torch.full((n, v), math.nan, dtype=torch.float32, device=device)
        kernels.sample_tokens(
            logits, st.greedy, st.temperature, st.seed, pos, DRAFT_PROPOSAL,
            out_tokens=out_t, out_probs=out_p,
        )  # fmt: skip
        assert torch.equal(out_t, got_t) and torch.equal(out_p, got_p)
        draws += sum(not p.greedy for p in params)
    assert draws >= min(300, n * checks // 2)


def test_fused_strided_logits_and_all_greedy(device):
    g = torch.Generator().manual_seed(3)
    n, v = 9, 300
    logits, st, pos, _ = _fresh_case(n, v, torch.float32, g, device)
    wide = torch.full((n, v + 13), 99.0, device=device)
    wide[:, :v] = logits
    view = wide[:, :v]  # row stride v + 13: the padding columns are never read
    got = sample(view, st, pos, TARGET_SAMPLE, any_filter=False, return_probs=True)
    want = _torch_sample(logits, st, pos, TARGET_SAMPLE, return_probs=True)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-12)
    # One logits row broadcast to every request (row stride 0).
    row = logits[1:2].expand(n, v)
    got = sample(row, st, pos, TARGET_SAMPLE, any_filter=False)
    assert torch.equal(got, _torch_sample(row.contiguous(), st, pos, TARGET_SAMPLE))
    # probs written straight into a draft round's q[:, j] (row stride K * V); the other
    # draft slots stay untouched.
    q = torch.full((n, 3, v), math.nan, device=device)
    kernels.sample_tokens(
        logits, st.greedy, st.temperature, st.seed, pos, TARGET_SAMPLE, out_probs=q[:, 1]
    )
    fused = sample(logits, st, pos, TARGET_SAMPLE, any_filter=False, return_probs=True)
    assert torch.equal(q[:, 1], fused[1])
    assert bool(q[:, 0].isnan().all()) and bool(q[:, 2].isnan().all())
    # The same through sample(out_probs=...), on the fused path and on the torch path
    # (filters on), where the definition's probs are copied in; a wrong shape is refused
    # before anything is written.
    t = sample(logits, st, pos, TARGET_SAMPLE, any_filter=False, out_probs=q[:, 2])
    assert torch.equal(t[0], fused[0]) and t[1] is not None and torch.equal(q[:, 2], fused[1])
    q[:, 2] = math.nan
    t = sample(logits, st, pos, TARGET_SAMPLE, any_filter=True, out_probs=q[:, 2])
    want = _torch_sample(logits, st, pos, TARGET_SAMPLE, return_probs=True)
    assert torch.equal(t[0], want[0]) and torch.equal(q[:, 2], want[1])
    q[:, 2] = math.nan
    with pytest.raises(ValueError, match="out_probs"):
        sample(logits, st, pos, TARGET_SAMPLE, out_probs=q[:, 2, :-1])
    assert bool(q[:, 2].isnan().all())
    # all_greedy with probs: argmax tokens and one-hot rows, exactly as the definition.
    gp = SamplingTensors.from_params([SP(0.0)] * n, device)
    t, q = sample(logits, gp, pos, BONUS, any_filter=False, all_greedy=True, return_probs=True)
    wt, wq = _torch_sample(logits, gp, pos, BONUS, all_greedy=True, return_probs=True)
    assert torch.equal(t, wt) and torch.equal(q, wq)


def test_fused_dispatch(monkeypatch):
    """The fused path runs only for any_filter=False on the Triton backend (and not for
    greedy-only calls without probs); the torch code stays the rest."""
    calls = []
    real = kernels.sample_tokens
    monkeypatch.setattr(kernels, "sample_tokens", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(4)
    logits, st, pos, _ = _fresh_case(4, 20, torch.float32, g, "cpu")
    with ops.use_backend("triton" if kernels.INTERPRET else "torch"):
        sample(logits, st, pos, BONUS, any_filter=False)
        expected = 1 if kernels.INTERPRET else 0
        assert len(calls) == expected
        sample(logits, st, pos, BONUS)  # any_filter=True: torch
        sample(logits, st, pos, BONUS, any_filter=False, all_greedy=True)  # argmax only
        sample(logits.to(torch.bfloat16), st, pos, BONUS, any_filter=False)  # interpreter: no bf16
        assert len(calls) == expected
    with ops.use_backend("torch"):
        sample(logits, st, pos, BONUS, any_filter=False)
    assert len(calls) == expected


def test_fused_bad_inputs_same_errors():
    """any_filter=False raises what the torch path raises, before any launch."""
    g = torch.Generator().manual_seed(5)
    logits, st, pos, params = _fresh_case(5, 16, torch.float32, g, "cpu")
    cases = [
        ((logits, st, pos[:-1], BONUS), ValueError, "positions"),
        ((logits, st, pos.float(), BONUS), TypeError, "positions"),
        ((logits[0], st, pos, BONUS), ValueError, "logits"),
        ((logits.double(), st, pos, BONUS), TypeError, "logits"),
        ((logits.long(), st, pos, BONUS), TypeError, "logits"),
        ((logits, params[:-1], pos, BONUS), ValueError, "one row per logits row"),
        ((logits, st, pos, 0), ValueError, "stream"),
    ]
    for args, exc, word in cases:
        for backend in ("torch", None):
            with ops.use_backend(backend), pytest.raises(exc, match=word):
                sample(*args, any_filter=False)


def test_fused_launcher_checks_and_workspace(device):
    n, v = 3, 40
    logits = torch.randn(n, v, device=device)
    st = SamplingTensors.from_params([SP(1.0, seed=i) for i in range(n)], device)
    pos = torch.arange(n, device=device)
    args = [logits, st.greedy, st.temperature, st.seed, pos]
    bad = [
        (1, st.greedy.int(), TypeError, "greedy"),
        (2, st.temperature.double(), TypeError, "temperature"),
        (3, st.seed[:2], ValueError, "seed"),
        (4, pos.float(), TypeError, "positions"),
    ]
    for i, value, exc, word in bad:
        call = list(args)
        call[i] = value
        with pytest.raises(exc, match=word):
            kernels.sample_tokens(*call, BONUS)
    with pytest.raises(ValueError, match="stream"):
        kernels.sample_tokens(*args, 9)
    with pytest.raises(ValueError, match="out_probs"):
        kernels.sample_tokens(*args, BONUS, out_probs=torch.empty(v, n, device=device).t())
    # Scratch is allocated once per (N, V, device, config) and keeps its addresses.
    cfg = kernels.choose_sample_config(n, v)
    ws = kernels.sample_workspace(n, v, torch.device(device), cfg)
    ptr = ws.part_max.data_ptr()
    t1 = kernels.sample_tokens(*args, BONUS)[0]
    t2 = kernels.sample_tokens(*[a.clone() for a in args], BONUS)[0]
    assert torch.equal(t1, t2)
    again = kernels.sample_workspace(n, v, torch.device(device), cfg)
    assert again is ws and again.part_max.data_ptr() == ptr
    assert kernels.sample_workspace(n + 1, v, torch.device(device), cfg) is not ws


@pytest.mark.parametrize("temperature", [0.5, 1.0])
@pytest.mark.parametrize("vary", ["seed", "position"])
def test_fused_distribution_chi_square(device, temperature, vary):
    v, draws = 24, 20_000
    rows = _config_logits(1, v)
    (cnt,) = _draw([SP(temperature)], rows, draws, vary, device, any_filter=False)
    stat, df = chi_square(cnt, ref_filtered(rows[0].double().numpy(), SP(temperature)))
    assert stat <= chi_limit(df), (temperature, stat, df)
    # The same counts against the other temperature's softmax: the check can fail.
    other = SP(1.5 - temperature)
    stat, df = chi_square(cnt, ref_filtered(rows[0].double().numpy(), other))
    assert stat > chi_limit(df)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_gpu_fused_distribution_and_match(temperature):
    """bf16 logits at V 49152: the fused draws against softmax(logits / T) by chi-square
    (200k draws), and tokens equal to the torch definition's on the GPU."""
    v, draws, chunk = 49152, 200_000, 8192
    g = torch.Generator().manual_seed(11)
    row = (torch.randn(1, v, generator=g) * 2).to(torch.bfloat16)
    want = torch.softmax(row.double() / float(np.float32(temperature)), -1)[0].numpy()
    src = SeedSource(base=77)
    counts = np.zeros(v, dtype=np.int64)
    for start in range(0, draws, chunk):
        n = min(chunk, draws - start)
        st = SamplingTensors.from_params(
            [SP(temperature, seed=src.next_seed()) for _ in range(n)], "cuda"
        )
        pos = torch.arange(start, start + n, device="cuda")
        tok = sample(row.cuda().expand(n, v), st, pos, DRAFT_PROPOSAL, any_filter=False)
        counts += np.bincount(tok.cpu().numpy(), minlength=v)
    stat, df = chi_square(counts, want)
    assert stat <= chi_limit(df), (temperature, stat, df)

    n = 64
    for _ in range(8):
        logits = (torch.randn(n, v, generator=g) * 3).to(torch.bfloat16).cuda()
        params = [SP(0.0 if i % 5 == 0 else temperature, seed=src.next_seed()) for i in range(n)]
        st = SamplingTensors.from_params(params, "cuda")
        pos = torch.randint(0, 2**20, (n,), generator=g).cuda()
        want_t, want_p = _torch_sample(logits, st, pos, DRAFT_PROPOSAL, return_probs=True)
        got_t, got_p = sample(logits, st, pos, DRAFT_PROPOSAL, any_filter=False, return_probs=True)
        assert torch.equal(got_t, want_t)
        torch.testing.assert_close(got_p, want_p, rtol=1e-5, atol=1e-12)


@pytest.mark.gpu
def test_gpu_fused_captures():
    """Captured in a CUDA graph over persistent buffers: replay on new contents equals
    eager, and eager calls do not synchronise."""
    n, v = 64, 49152
    s_logits = torch.randn(n, v, device="cuda").to(torch.bfloat16)
    s_pos = torch.arange(n, device="cuda")
    params = [SP(0.0 if i % 3 == 0 else 0.8, seed=i) for i in range(n)]
    s_params = SamplingTensors(n, "cuda")
    s_params.write_rows(range(n), params)
    kw = {"any_filter": False, "return_probs": True}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            sample(s_logits, s_params, s_pos, DRAFT_PROPOSAL, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s_tokens, s_probs = sample(s_logits, s_params, s_pos, DRAFT_PROPOSAL, **kw)
    s_logits.copy_(torch.randn(n, v, device="cuda").to(torch.bfloat16))
    s_pos.add_(1)
    s_params.write_rows(range(0, n, 2), [replace(p, temperature=1.2) for p in params[::2]])
    graph.replay()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager_t, eager_p = sample(s_logits, s_params, s_pos, DRAFT_PROPOSAL, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(s_tokens, eager_t) and torch.equal(s_probs, eager_p)
    want_t, _ = _torch_sample(s_logits, s_params, s_pos, DRAFT_PROPOSAL, return_probs=True)
    assert torch.equal(s_tokens, want_t)
