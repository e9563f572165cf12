"""Kernel safety: nonsense host scalars are refused; corrupt device metadata never makes a
kernel read or write outside its tensors (canary regions around every buffer stay
bit-identical, outputs stay finite); validation mode turns that metadata into errors
that name the request and the value, before anything is written.

The kernels' contract for corrupt metadata (kernels/paged_attention.py) is checked
against `clamped_reference`: query starts/ends clamped into [0, num_tokens] (end >=
start), seq_len into [0, table width x block_size], keys and values of block ids outside
the cache read as zero vectors.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

import specdraft.kernels.validation as validation
from specdraft.kernels import paged_attention, rms_norm, set_validation, store_kv, use_validation
from tests.batch import PagedBatch, make_paged_batch
from tests.reference import store_kv_ref

INT32_MAX = 2**31 - 1
BITS = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.int32: torch.int32,
    torch.int64: torch.int64,
}
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def _default_validation(monkeypatch):
    """Every test starts from the default switch and no SPECDRAFT_VALIDATE."""
    monkeypatch.delenv(validation.ENV_VAR, raising=False)
    set_validation(None)
    yield
    set_validation(None)


# ---- canaries ---------------------------------------------------------------------------


class Canaried:
    """`values` copied into the middle of a larger tensor `big` (PAD more elements on
    each side of every dimension) whose other elements, the canary, hold a random
    pattern: `view` has the strides of `big`, so any index past an edge of the view lands
    in the canary, where a write shows and a read returns a wrong value."""

    PAD = 3

    def __init__(self, values: torch.Tensor, gen: torch.Generator, int_high: int = 4):
        """gen: a generator on values' device."""
        shape = tuple(values.shape)
        big_shape = tuple(s + 2 * self.PAD for s in shape)
        dev = values.device
        if values.dtype.is_floating_point:
            big = torch.randn(big_shape, generator=gen, device=dev).to(values.dtype)
        else:
            # Small non-negative ints: a stray read of a block id or length from the
            # canary stays inside the canaried cache, so it shows as a wrong value.
            big = torch.randint(0, int_high, big_shape, generator=gen, device=dev)
            big = big.to(values.dtype)
        self.big = big
        self.inside = torch.zeros(big_shape, dtype=torch.bool, device=values.device)
        idx = tuple(slice(self.PAD, self.PAD + s) for s in shape)
        self.view = self.big[idx]
        self.view.copy_(values)
        self.inside[idx] = True
        self.before = self.big.clone()

    def _changed(self) -> torch.Tensor:
        bits = BITS[self.big.dtype]
        return self.big.view(bits) != self.before.view(bits)

    def canary_intact(self) -> bool:
        return not bool(self._changed()[~self.inside].any())

    def untouched(self) -> bool:
        return not bool(self._changed().any())


def canaried_batch(b: PagedBatch, gen: torch.Generator) -> dict[str, Canaried]:
    """b's tensors and a fresh random `out`, each canaried; gen: a CPU generator that
    seeds the one on b's device."""
    num_blocks = b.k_cache.shape[0]
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    gen = torch.Generator(device=b.q.device).manual_seed(seed)
    return {
        "q": Canaried(b.q, gen),
        "k_cache": Canaried(b.k_cache, gen),
        "v_cache": Canaried(b.v_cache, gen),
        "query_start_loc": Canaried(b.query_start_loc, gen),
        "seq_lens": Canaried(b.seq_lens, gen),
        "block_table": Canaried(b.block_table, gen, int_high=num_blocks),
        "out": Canaried(
            torch.randn(b.q.shape, generator=gen, device=b.q.device).to(b.q.dtype), gen
        ),
    }


def tensors_of(b: PagedBatch) -> tuple[torch.Tensor, ...]:
    """(q, k_cache, v_cache, query_start_loc, seq_lens, block_table) of a batch."""
    return (b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_table)


def views(c: dict[str, Canaried]) -> tuple[torch.Tensor, ...]:
    """(q, k_cache, v_cache, query_start_loc, seq_lens, block_table) of a canaried batch."""
    names = ("q", "k_cache", "v_cache", "query_start_loc", "seq_lens", "block_table")
    return tuple(c[n].view for n in names)


def run_canaried(c: dict[str, Canaried], **kw) -> torch.Tensor:
    """paged_attention on the canaried views; asserts that nothing outside `out`'s view
    changed and that `out` is finite; returns `out`."""
    q = c["q"].view
    paged_attention(*views(c), q.shape[-1] ** -0.5, out=c["out"].view, **kw)
    for name, t in c.items():
        if name == "out":
            assert t.canary_intact(), "a write landed outside out"
        else:
            assert t.untouched(), f"{name} (or the canary around it) was written"
    assert torch.isfinite(c["out"].view).all(), "out holds a non-finite value"
    return c["out"].view


# ---- the contract for corrupt metadata, in PyTorch --------------------------------------


def clamped_qsl(qsl: list[int], num_tokens: int) -> list[tuple[int, int]]:
    """(start, end) of each request as the kernels clamp them."""
    spans = []
    for r in range(len(qsl) - 1):
        start = min(max(qsl[r], 0), num_tokens)
        spans.append((start, min(max(qsl[r + 1], start), num_tokens)))
    return spans


def clamped_reference(q, k_cache, v_cache, qsl_t, seq_lens_t, table_t, scale, *, window=None):
    """float64 output of the kernels' contract and the rows it defines: the rows of each
    request, and zero rows from the clamped query_start_loc[num_reqs] on. Only meaningful
    where the clamped query_start_loc does not decrease (else requests overlap and race)."""
    num_tokens, hq, _ = q.shape
    num_blocks, bs, hkv, _ = k_cache.shape
    cap = table_t.shape[1] * bs
    qsl, lens = qsl_t.tolist(), seq_lens_t.tolist()
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    defined = torch.zeros(num_tokens, dtype=torch.bool, device=q.device)
    for r, (start, end) in enumerate(clamped_qsl(qsl, num_tokens)):
        q_len = end - start
        seq = min(max(lens[r], 0), cap)
        defined[start:end] = True
        if q_len == 0 or seq == 0:
            continue
        pos = torch.arange(seq, device=q.device)
        blocks = table_t[r, pos // bs].long()
        # A block id outside the cache: its keys and values are zero vectors.
        valid = ((blocks >= 0) & (blocks < num_blocks))[:, None, None]
        blocks = torch.where(valid[:, 0, 0], blocks, 0)
        k = (k_cache[blocks, pos % bs].double() * valid).repeat_interleave(hq // hkv, dim=1)
        v = (v_cache[blocks, pos % bs].double() * valid).repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[start:end].double(), k) * scale
        q_pos = torch.arange(seq - q_len, seq, device=q.device)[:, None]
        visible = pos[None, :] <= q_pos
        if window is not None:
            visible &= pos[None, :] > q_pos - window
        s = s.masked_fill(~visible, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no visible key: zeros
        out[start:end] = torch.einsum("hqk,khd->qhd", p, v)
    pad_from = min(max(qsl[-1], 0), num_tokens)
    defined[pad_from:] = True
    return out, defined


def assert_matches_contract(tensors: tuple[torch.Tensor, ...], out: torch.Tensor, **kw) -> bool:
    """Compare `out` with clamped_reference on `tensors` (q, caches, metadata) where the
    contract defines it, element by element; False (no comparison) where the clamped
    query_start_loc decreases (requests and padding overlap there and race)."""
    t = out.shape[0]
    clamped = [min(max(x, 0), t) for x in tensors[3].tolist()]
    if any(b < a for a, b in zip(clamped, clamped[1:])):
        return False
    ref, defined = clamped_reference(*tensors, tensors[0].shape[-1] ** -0.5, **kw)
    got, want = out[defined].double(), ref[defined]
    tol = TOL[out.dtype]
    bad = (got - want).abs() > tol + tol * want.abs()
    assert not bad.any(), (
        f"{int(bad.sum())} elements off the clamped reference, max error "
        f"{(got - want).abs().max().item():.3e}"
    )
    return True


def small_batch(gen, device, q_lens, ctx, *, dtype=torch.float32, spare_cols=2, **kw):
    width = max(-(-(c + q) // 8) for c, q in zip(ctx, q_lens)) + spare_cols
    return make_paged_batch(
        q_lens,
        ctx,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=8,
        dtype=dtype,
        device=device,
        max_blocks=width,
        generator=gen,
        **kw,
    )


# ---- 1. host scalars ------------------------------------------------------------------


def _good(device):
    gen = torch.Generator().manual_seed(7)
    return small_batch(gen, device, [1, 3], [6, 11])


POS = "must be a positive finite number, got"
NUM = "must be a real number, got"
SCALAR_CASES = [
    ("softcap_inf", {"softcap": float("inf")}, ValueError, f"softcap {POS} inf"),
    ("softcap_-inf", {"softcap": float("-inf")}, ValueError, f"softcap {POS} -inf"),
    ("softcap_nan", {"softcap": float("nan")}, ValueError, f"softcap {POS} nan"),
    ("softcap_0", {"softcap": 0.0}, ValueError, f"softcap {POS} 0.0"),
    ("softcap_neg", {"softcap": -30.0}, ValueError, f"softcap {POS} -30.0"),
    ("softcap_fp32_inf", {"softcap": 1e39}, ValueError, r"softcap = 1e\+39 is outside"),
    ("softcap_fp32_0", {"softcap": 1e-40}, ValueError, "softcap = 1e-40 is outside"),
    ("softcap_bool", {"softcap": True}, TypeError, f"softcap {NUM} bool"),
    ("softcap_str", {"softcap": "30"}, TypeError, f"softcap {NUM} str"),
    ("scale_inf", {"scale": float("inf")}, ValueError, f"scale {POS} inf"),
    ("scale_nan", {"scale": float("nan")}, ValueError, f"scale {POS} nan"),
    ("scale_0", {"scale": 0.0}, ValueError, f"scale {POS} 0.0"),
    ("scale_neg", {"scale": -0.125}, ValueError, f"scale {POS} -0.125"),
    ("scale_fp32_0", {"scale": 1e-50}, ValueError, "scale = 1e-50 is outside"),
    ("scale_fp32_inf", {"scale": 1e39}, ValueError, r"scale = 1e\+39 is outside"),
    ("scale_bool", {"scale": True}, TypeError, f"scale {NUM} bool"),
    ("ratio", {"scale": 1e30, "softcap": 1e-30}, ValueError, r"scale / softcap = 1e\+60"),
    ("window_bool", {"sliding_window": True}, ValueError, "sliding_window must be an int in"),
    ("window_huge", {"sliding_window": 2**40}, ValueError, "sliding_window must be an int in"),
]


@pytest.mark.parametrize(
    "kw, exc, words", [c[1:] for c in SCALAR_CASES], ids=[c[0] for c in SCALAR_CASES]
)
def test_paged_attention_refuses_nonsense_scalars(device, kw, exc, words):
    b = _good(device)
    out = torch.randn(b.q.shape).to(device)
    before = out.clone()
    kw = dict(kw)
    scale = kw.pop("scale", 0.125)
    with pytest.raises(exc, match=words):
        paged_attention(*tensors_of(b), scale, out=out, **kw)
    assert torch.equal(out, before), "out was written before the error"


@pytest.mark.parametrize(
    "eps, exc, words",
    [
        (1e-50, ValueError, "eps = 1e-50 is outside"),
        (1e39, ValueError, r"eps = 1e\+39 is outside"),
        (float("nan"), ValueError, f"eps {POS} nan"),
        (True, TypeError, f"eps {NUM} bool"),
    ],
    ids=["fp32_0", "fp32_inf", "nan", "bool"],
)
def test_rms_norm_refuses_nonsense_eps(device, eps, exc, words):
    x, w = torch.randn(3, 32).to(device), torch.randn(32).to(device)
    out = torch.randn(3, 32).to(device)
    before = out.clone()
    with pytest.raises(exc, match=words):
        rms_norm(x, w, eps, out=out)
    assert torch.equal(out, before)


def test_smallest_float32_eps_keeps_zero_rows_finite(device):
    # The lower limit is the smallest normal float32: even an all-zero row stays finite.
    x, w = torch.zeros(2, 32).to(device), torch.randn(32).to(device)
    assert torch.isfinite(rms_norm(x, w, validation.FP32_TINY)).all()


# ---- 2. corrupt metadata, validation off: clamped, inside the tensors ------------------


def _prefill_batch(gen, device):
    # 20 tokens x 2 query heads per KV head: 64-row tiles, which take the unmasked
    # (MASK False) path on the key tiles below the causal diagonal.
    return small_batch(gen, device, [1, 20, 3], [30, 75, 9], pad_reqs=1, pad_tokens=2)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("shape", ["decode_mix", "prefill"])
def test_block_ids_outside_the_cache_read_as_zero_keys(device, shape, num_splits):
    gen = torch.Generator().manual_seed(11 + num_splits)
    b = (
        _prefill_batch(gen, device)
        if shape == "prefill"
        else small_batch(gen, device, [1, 4, 2], [40, 13, 25], pad_reqs=1)
    )
    nb = b.k_cache.shape[0]
    # Inside the canary's reach (3 blocks either side): before the fix these read the
    # canary instead of faulting, so the comparison below is what fails.
    b.block_table[0, 1] = -1
    b.block_table[1, 0] = nb
    b.block_table[1, 2] = -3
    b.block_table[2, 0] = nb + 2
    c = canaried_batch(b, gen)
    with use_validation(False):
        out = run_canaried(c, num_splits=num_splits, max_query_len=b.max_query_len)
    assert assert_matches_contract(views(c), out)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_query_start_loc_past_q_rows_writes_inside_out(device, num_splits):
    gen = torch.Generator().manual_seed(21 + num_splits)
    b = small_batch(gen, device, [2, 3, 1], [7, 20, 4])
    t = b.q.shape[0]
    b.query_start_loc[2] = t + 2  # request 1 runs past q's last row, request 2 empty
    b.query_start_loc[3] = t + 3
    c = canaried_batch(b, gen)
    with use_validation(False):
        out = run_canaried(c, num_splits=num_splits)
    assert assert_matches_contract(views(c), out)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_negative_query_start_loc_writes_inside_out(device, num_splits):
    # The padded tail starts at the clamped last entry: before the fix the zeroing of
    # padded rows started at row -3, before out.
    gen = torch.Generator().manual_seed(31 + num_splits)
    b = small_batch(gen, device, [2, 3], [7, 20], pad_tokens=3)
    b.query_start_loc[2] = -3
    c = canaried_batch(b, gen)
    with use_validation(False):
        run_canaried(c, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_seq_lens_out_of_range_are_clamped(device, num_splits):
    gen = torch.Generator().manual_seed(41 + num_splits)
    b = small_batch(gen, device, [1, 5, 3, 2], [20, 9, 30, 0])
    cap = b.block_table.shape[1] * b.k_cache.shape[1]
    b.seq_lens[0] = cap + 37  # past the table: read the canary columns before the fix
    b.seq_lens[1] = 2  # below its query length: the first 3 queries see no key
    b.seq_lens[2] = -5  # negative: every query sees no key
    c = canaried_batch(b, gen)
    with use_validation(False):
        out = run_canaried(c, num_splits=num_splits)
    assert assert_matches_contract(views(c), out)
    qsl = b.query_start_loc.tolist()
    assert torch.equal(out[qsl[1] : qsl[1] + 3], torch.zeros_like(out[:3]))
    assert torch.equal(out[qsl[2] : qsl[3]], torch.zeros_like(out[qsl[2] : qsl[3]]))


def corrupt(b: PagedBatch, rng: random.Random) -> list[str]:
    """Apply one to three random corruptions to b's metadata in place; name them."""
    nb = b.k_cache.shape[0]
    num_reqs = b.query_start_loc.numel() - 1
    t = b.q.shape[0]
    cap = b.block_table.shape[1] * b.k_cache.shape[1]
    done = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(
            ["block_past", "block_negative", "qsl_past", "qsl_decrease", "qsl_negative"]
            + ["seq_negative", "seq_short", "seq_past"]
        )
        r = rng.randrange(num_reqs)
        if kind == "block_past":
            col = rng.randrange(b.block_table.shape[1])
            b.block_table[r, col] = rng.choice([nb, nb + 1, nb + 100, INT32_MAX])
        elif kind == "block_negative":
            col = rng.randrange(b.block_table.shape[1])
            b.block_table[r, col] = rng.choice([-1, -2, -1000, -(2**31)])
        elif kind == "qsl_past":
            b.query_start_loc[rng.randrange(1, num_reqs + 1)] = rng.choice(
                [t + 1, t + 9, INT32_MAX]
            )
        elif kind == "qsl_decrease":
            i = rng.randrange(1, num_reqs + 1)
            b.query_start_loc[i] = max(0, int(b.query_start_loc[i - 1]) - rng.randint(1, 4))
        elif kind == "qsl_negative":
            b.query_start_loc[rng.randrange(num_reqs + 1)] = rng.choice([-1, -7, -(2**31)])
        elif kind == "seq_negative":
            b.seq_lens[r] = rng.choice([-1, -50, -(2**31)])
        elif kind == "seq_short":
            q_len = int(b.query_start_loc[r + 1] - b.query_start_loc[r])
            b.seq_lens[r] = rng.randint(0, max(q_len - 1, 0))
        else:
            b.seq_lens[r] = rng.choice([cap + 1, cap + 100, INT32_MAX])
        done.append(kind)
    return done


@pytest.mark.interpreter
@pytest.mark.parametrize("num_splits", [1, 4])
def test_random_corrupt_metadata_stays_inside(num_splits):
    rng = random.Random(100 + num_splits)
    gen = torch.Generator().manual_seed(100 + num_splits)
    compared = 0
    for case in range(16):
        n = rng.randint(1, 4)
        q_lens = [rng.choice([1, 1, 2, 5, 18]) for _ in range(n)]
        ctx = [rng.randint(0, 40) for _ in range(n)]
        dtype = rng.choice([torch.float32, torch.float16])
        b = small_batch(
            gen,
            "cpu",
            q_lens,
            ctx,
            dtype=dtype,
            pad_reqs=rng.randint(0, 1),
            pad_tokens=rng.randint(0, 2),
        )
        kinds = corrupt(b, rng)
        c = canaried_batch(b, gen)
        try:
            with use_validation(False):
                out = run_canaried(c, num_splits=num_splits, max_query_len=b.max_query_len)
            compared += assert_matches_contract(views(c), out)
        except AssertionError as e:
            raise AssertionError(f"case {case} ({kinds}): {e}") from e
    assert compared >= 4, "too few cases compared with the reference: the test is weak"


def test_store_kv_slots_outside_the_cache_write_nothing(device):
    gen = torch.Generator().manual_seed(5)
    nb, bs, hkv, d = 4, 8, 2, 16
    num_slots = nb * bs
    k = torch.randn(12, hkv, d, generator=gen).to(device)
    v = torch.randn(12, hkv, d, generator=gen).to(device)
    slots = torch.randperm(num_slots, generator=gen)[:12]
    bad = [-1, -7, -(2**62), num_slots, num_slots + 3, 2**62]
    slots[torch.randperm(12, generator=gen)[: len(bad)]] = torch.tensor(bad)
    dev_gen = torch.Generator(device=device).manual_seed(6)
    kc = Canaried(torch.randn(nb, bs, hkv, d, generator=gen).to(device), dev_gen)
    vc = Canaried(torch.randn(nb, bs, hkv, d, generator=gen).to(device), dev_gen)
    kc_ref, vc_ref = kc.view.clone(), vc.view.clone()
    with use_validation(False):
        store_kv(k, v, kc.view, vc.view, slots.to(device))
    store_kv_ref(k, v, kc_ref, vc_ref, slots)
    assert kc.canary_intact() and vc.canary_intact(), "a write landed outside the cache"
    assert torch.equal(kc.view, kc_ref) and torch.equal(vc.view, vc_ref)
    assert not kc.untouched(), "nothing was written: the test is blind"


# ---- 3. validation mode --------------------------------------------------------------


def _validation_batch(device):
    gen = torch.Generator().manual_seed(3)
    # 3 requests: q_lens 1, 5, 3 over contexts 4, 9, 20; block_size 8, 4 + 2 columns.
    return small_batch(gen, device, [1, 5, 3], [4, 9, 20])


QSL, SEQ, TABLE = "query_start_loc", "seq_lens", "block_table"
CASES = [  # (id, metadata tensor, index, corrupt value, expected message)
    ("qsl_start", QSL, 0, 1, r"query_start_loc\[0\] = 1, expected 0"),
    ("qsl_decreasing", QSL, 2, 0, r"query_start_loc\[2\] = 0 is below query_start_loc\[1\] = 1"),
    ("qsl_past_rows", QSL, 3, 12, r"query_start_loc\[3\] = 12 is past q's 9 rows"),
    ("seq_short", SEQ, 1, 2, r"seq_lens\[1\] = 2 is below its query length 5 \(request 1\)"),
    ("seq_negative", SEQ, 0, -3, r"seq_lens\[0\] = -3 is negative"),
    ("seq_past_table", SEQ, 2, 999, r"seq_lens\[2\] = 999 \(request 2\) is over .* capacity 40"),
    ("block_past", TABLE, (1, 1), 10**6, r"block_table\[1, 1\] = 1000000 \(request 1, .*\) is out"),
    ("block_negative", TABLE, (2, 0), -1, r"block_table\[2, 0\] = -1 \(request 2, .*\) is out"),
]


@pytest.mark.parametrize(
    "name, index, value, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_validation_names_the_request_and_writes_nothing(device, name, index, value, words):
    b = _validation_batch(device)
    getattr(b, name)[index] = value
    out = torch.randn(b.q.shape).to(device)
    snapshot = (out.clone(), b.k_cache.clone(), b.v_cache.clone())
    with use_validation(True), pytest.raises(ValueError, match=words):
        paged_attention(*tensors_of(b), 0.25, out=out)
    assert torch.equal(out, snapshot[0]), "out was written before the error"
    assert torch.equal(b.k_cache, snapshot[1]) and torch.equal(b.v_cache, snapshot[2])


def test_validation_checks_only_the_block_ids_a_request_reads(device):
    b = _validation_batch(device)
    # Columns past cdiv(seq_len, block_size), and (with a sliding window) before the
    # window's first key, are never read: -1 there (a freed block) is fine.
    b.block_table[0, 1:] = -1
    # Request 2: seq_len 23, 3 queries; its first query (position 20) sees keys 13..20
    # with a window of 8, so its columns start at 1.
    b.block_table[2, 0] = -1
    tensors = tensors_of(b)
    with use_validation(True):
        out = paged_attention(*tensors, 16**-0.5, sliding_window=8, max_query_len=5)
    assert assert_matches_contract(tensors, out, window=8)


def test_store_kv_validation(device):
    k = torch.randn(5, 2, 16).to(device)
    v = torch.randn(5, 2, 16).to(device)
    kc, vc = torch.randn(3, 8, 2, 16).to(device), torch.randn(3, 8, 2, 16).to(device)
    snapshot = (kc.clone(), vc.clone())
    for bad, words in (
        (24, r"slot_mapping\[3\] = 24 \(token 3\) is past the cache's 24 slots"),
        (-7, r"slot_mapping\[3\] = -7 \(token 3\) is negative but not -1"),
    ):
        slots = torch.tensor([0, 5, -1, bad, 23], device=device)
        with use_validation(True), pytest.raises(ValueError, match=words):
            store_kv(k, v, kc, vc, slots)
        assert torch.equal(kc, snapshot[0]) and torch.equal(vc, snapshot[1])
    with use_validation(True):
        store_kv(k, v, kc, vc, torch.tensor([0, 5, -1, 9, 23], device=device))  # -1: padding


def _corrupt_call(device) -> None:
    b = _validation_batch(device)
    b.seq_lens[1] = 2
    paged_attention(b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_table, 0.25)


@pytest.mark.interpreter
def test_validation_default_is_on_for_cpu_tensors():
    assert validation.validation_enabled(torch.empty(1))
    assert not validation.validation_enabled(torch.device("cuda"))
    with pytest.raises(ValueError, match="seq_lens"):
        _corrupt_call("cpu")


@pytest.mark.interpreter
def test_validation_env_var_and_switch(monkeypatch):
    monkeypatch.setenv(validation.ENV_VAR, "0")
    assert not validation.validation_enabled(torch.empty(1))
    _corrupt_call("cpu")  # off: the kernel runs (clamped) and returns
    monkeypatch.setenv(validation.ENV_VAR, "1")
    assert validation.validation_enabled(torch.device("cuda"))
    with use_validation(False):  # the switch wins over the variable ...
        assert not validation.validation_enabled(torch.empty(1))
        with use_validation(None):  # ... and None hands back to it
            assert validation.validation_enabled(torch.empty(1))
        assert not validation.validation_enabled(torch.empty(1))
    assert validation.validation_enabled(torch.empty(1))  # restored on exit
    set_validation(False)
    assert not validation.validation_enabled(torch.empty(1))
    set_validation(None)
    monkeypatch.setenv(validation.ENV_VAR, "yes")
    with pytest.raises(ValueError, match="SPECDRAFT_VALIDATE must be 0, 1 or unset, got 'yes'"):
        validation.validation_enabled(torch.empty(1))
    with pytest.raises(TypeError, match="enabled must be a bool or None"):
        set_validation("on")


def test_validation_is_off_inside_a_capture_and_asks_only_when_on(monkeypatch):
    """Inside a stream capture validation is off even when switched on; with it off (the
    default for CUDA tensors) the capture state is not even queried (host time on every
    steady round)."""
    asked = []

    def capturing():
        asked.append(1)
        return True

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", capturing)
    monkeypatch.delenv(validation.ENV_VAR, raising=False)
    assert not validation.validation_enabled(torch.device("cuda"))
    assert validation.validation_enabled(torch.device("cpu")) and not asked
    with use_validation(False):
        assert not validation.validation_enabled("cuda") and not asked
    with use_validation(True):
        assert not validation.validation_enabled(torch.device("cuda")) and asked
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        assert validation.validation_enabled("cuda:0")


def test_validation_cost_on_cpu_small_batch():
    """The figure quoted in kernels/validation.py: checks of an 8-request batch with 16
    block-table columns, CPU tensors."""
    gen = torch.Generator().manual_seed(9)
    b = make_paged_batch(
        [1, 1, 4, 1, 2, 1, 8, 1],
        [30, 70, 10, 120, 5, 64, 40, 9],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=8,
        max_blocks=16,
        generator=gen,
    )
    args = (b.query_start_loc, b.seq_lens, b.block_table)
    kw = dict(num_tokens=b.q.shape[0], num_blocks=b.k_cache.shape[0], block_size=8)
    for _ in range(20):
        validation.check_attention_metadata(*args, **kw)
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        validation.check_attention_metadata(*args, **kw)
    per_call_us = (time.perf_counter() - t0) / n * 1e6
    print(f"validation of 8 requests x 16 columns on the CPU: {per_call_us:.0f} us per call")
    assert per_call_us < 5000, "validation got far slower than documented"


# ---- GPU: many corrupt cases, bf16, realistic shapes -----------------------------------


@pytest.mark.gpu
def test_gpu_random_corrupt_metadata_stays_inside():
    """520 corrupt cases in 20 batches (splits automatic, off and forced), each batch
    ending in a synchronize so that an illegal access surfaces; store_kv with corrupt
    slots in every case."""
    rng = random.Random(2024)
    gen = torch.Generator().manual_seed(2024)
    dev = "cuda"
    compared = 0
    for batch in range(20):
        for case in range(26):
            n = rng.randint(1, 12)
            q_lens = [rng.choice([1, 1, 1, 2, 4, 8, 64, 300]) for _ in range(n)]
            ctx = [rng.randint(0, 1500) for _ in range(n)]
            b = make_paged_batch(
                q_lens,
                ctx,
                num_q_heads=32,
                num_kv_heads=8,
                head_dim=128,
                block_size=16,
                dtype=torch.bfloat16,
                device=dev,
                pad_reqs=rng.randint(0, 2),
                pad_tokens=rng.randint(0, 5),
                spare_blocks=8,
                max_blocks=max(-(-(c + q) // 16) for c, q in zip(ctx, q_lens)) + 4,
                generator=gen,
            )
            num_splits = [None, 1, 8][case % 3]
            kinds = corrupt(b, rng)
            c = canaried_batch(b, gen)
            where = f"batch {batch} case {case} ({kinds}, num_splits={num_splits})"
            try:
                with use_validation(False):  # the kernels alone (also under SPECDRAFT_VALIDATE=1)
                    out = run_canaried(c, num_splits=num_splits, max_query_len=b.max_query_len)
                compared += assert_matches_contract(views(c), out)
                # store_kv on the same canaried caches, with corrupt slots.
                t = b.q.shape[0]
                k = torch.randn(t, 8, 128, generator=gen).to(dev, torch.bfloat16)
                v = torch.randn(t, 8, 128, generator=gen).to(dev, torch.bfloat16)
                num_slots = b.k_cache.shape[0] * 16
                slots = torch.randperm(num_slots, generator=gen)[:t]
                for i in rng.sample(range(t), min(t, 3)):
                    slots[i] = rng.choice([-1, -5, num_slots, num_slots + 17, 2**40, -(2**40)])
                slots = slots.to(dev)
                kc_ref, vc_ref = c["k_cache"].view.clone(), c["v_cache"].view.clone()
                with use_validation(False):
                    store_kv(k, v, c["k_cache"].view, c["v_cache"].view, slots)
                ok = (slots >= 0) & (slots < num_slots)  # distinct slots: a vectorized ref
                kc_ref[slots[ok] // 16, slots[ok] % 16] = k[ok]
                vc_ref[slots[ok] // 16, slots[ok] % 16] = v[ok]
                assert c["k_cache"].canary_intact() and c["v_cache"].canary_intact()
                assert torch.equal(c["k_cache"].view, kc_ref)
                assert torch.equal(c["v_cache"].view, vc_ref)
            except AssertionError as e:
                raise AssertionError(f"{where}: {e}") from e
        torch.cuda.synchronize()  # an illegal memory access of this batch raises here
    assert compared >= 100, f"only {compared} cases compared with the reference"


@pytest.mark.gpu
def test_gpu_validation_skipped_under_capture_and_raises_eagerly():
    gen = torch.Generator().manual_seed(77)
    b = make_paged_batch(
        [1, 4, 1],
        [300, 40, 1000],
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
        generator=gen,
    )
    args = (*tensors_of(b), 128**-0.5)
    out = torch.empty_like(b.q)
    with use_validation(True):
        paged_attention(*args, out=out, max_query_len=4)  # warm-up, validated
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a host read here would fail the capture
            paged_attention(*args, out=out, max_query_len=4)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        b.seq_lens[1] = 2
        with pytest.raises(ValueError, match=r"seq_lens\[1\] = 2 is below its query length 4"):
            paged_attention(*args, out=out, max_query_len=4)
