"""The fused rotary + K/V store (kernels.rotary_store_kv) against the two kernels it
replaces (apply_rotary then store_kv: bit for bit) and a float64 rotation; padding,
bad inputs, and the attention layer and a whole model that use it.

CPU runs use the Triton interpreter on small shapes in fp32 / fp16; tests marked gpu
run bf16, model shapes and a cache over 2^31 elements."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from specdraft import kernels, ops
from specdraft.kernels import apply_rotary, rotary_store_kv, store_kv, use_validation
from specdraft.layers import Attention
from specdraft.models.tiny import random_causal_lm, tiny_config
from tests.model_helpers import PagedRunner

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}

# (Hq, Hkv, head_dim, rotary dims R): Llama-style 4/2, SmolLM2's 9/3 of 64, partial
# rotary with R a power of two and with an odd half (5) over a head_dim of 24.
SHAPES = [(4, 2, 16, 16), (9, 3, 64, 64), (4, 2, 16, 8), (6, 1, 24, 10)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN poison compares equal to itself)."""
    bits = _BITS[a.dtype]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def make_cache(num_blocks, block_size, hkv, d, dtype, device, layout):
    """(k_cache, v_cache) [num_blocks, block_size, hkv, d] in one of the layouts store_kv
    takes, NaN-poisoned: "kvcache" as KVCache allocates them (one tensor, k and v views),
    "padded" with a head stride past head_dim, "transposed" with the block stride
    smaller than the token stride."""
    if layout == "kvcache":
        data = torch.empty(2, num_blocks, block_size, hkv, d, dtype=dtype, device=device)
        k_cache, v_cache = data[0], data[1]
    elif layout == "padded":
        data = torch.empty(2, num_blocks, block_size, hkv, d + 8, dtype=dtype, device=device)
        k_cache, v_cache = data[0, ..., :d], data[1, ..., :d]
    else:
        data = torch.empty(2, block_size, num_blocks, hkv, d, dtype=dtype, device=device)
        k_cache, v_cache = data[0].transpose(0, 1), data[1].transpose(0, 1)
    data.fill_(float("nan"))
    return k_cache, v_cache


@dataclass
class Case:
    qkv: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    table: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    n: int

    def args(self) -> dict:
        return dict(
            q=self.q,
            k=self.k,
            v=self.v,
            positions=self.positions,
            cos_sin_cache=self.table,
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            slot_mapping=self.slots,
        )

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in (self.qkv, self.k_cache, self.v_cache)]

    def unchanged(self, before: list[torch.Tensor]) -> bool:
        now = (self.qkv, self.k_cache, self.v_cache)
        return all(same_bits(a, b) for a, b in zip(now, before))


def make_case(
    device,
    dtype,
    hq,
    hkv,
    d,
    rot,
    *,
    n=7,
    num_blocks=5,
    block_size=4,
    num_padded=2,
    layout="kvcache",
) -> Case:
    """Fresh random q, k, v as views of one fused QKV row, a random float32 table of
    max_positions 40, and persistent-style positions / slot_mapping longer than n whose
    extra entries would write if read. Position 0 of the list is past the table and
    position 1 negative (both clamped)."""
    qkv = torch.randn(n, (hq + 2 * hkv) * d, device=device).to(dtype)
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
    max_pos = 40
    table = torch.randn(max_pos, rot, device=device)
    positions = torch.randint(0, max_pos, (n + 3,), device=device)
    positions[0], positions[1] = max_pos + 100, -3
    k_cache, v_cache = make_cache(num_blocks, block_size, hkv, d, dtype, device, layout)
    slots = torch.randperm(num_blocks * block_size, device=device)[: n + 3]
    slots[torch.randperm(n, device=device)[:num_padded]] = -1
    return Case(qkv, q, k, v, positions, table, k_cache, v_cache, slots, n)


def rotate_f64(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """float64 rotate-half of the first R dims of x [n, H, D] at clamped positions."""
    half = table.shape[1] // 2
    pos = positions[: x.shape[0]].clamp(0, table.shape[0] - 1)
    rows = table[pos].double()
    cos, sin = rows[:, None, :half], rows[:, None, half:]
    x = x.double()
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half :]], dim=-1)


def written(c: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens that write: a slot inside the cache; their block ids, their offsets)."""
    slots = c.slots[: c.n]
    block_size = c.k_cache.shape[1]
    keep = (slots >= 0) & (slots < c.k_cache.shape[0] * block_size)
    s = slots[keep]
    return keep, s // block_size, s % block_size


def check_against_references(c: Case, dtype) -> None:
    """Run the fused kernel on c and compare with apply_rotary + store_kv on copies (bit
    for bit, every cache element) and with the float64 rotation (within TOL)."""
    k_in, v_in = c.k.clone(), c.v.clone()
    q_ref, k_ref = c.q.clone(), c.k.clone()
    kc_ref, vc_ref = c.k_cache.clone(), c.v_cache.clone()
    apply_rotary(q_ref, k_ref, c.positions, c.table)
    store_kv(k_ref, c.v.clone(), kc_ref, vc_ref, c.slots)
    q64, k64 = rotate_f64(c.q, c.positions, c.table), rotate_f64(c.k, c.positions, c.table)
    before = [c.k_cache.clone(), c.v_cache.clone()]

    rotary_store_kv(**c.args())

    assert same_bits(c.q, q_ref), "q: rotated in place as apply_rotary rotates it"
    assert same_bits(c.k_cache, kc_ref) and same_bits(c.v_cache, vc_ref), "cache as unfused"
    assert same_bits(c.k, k_in) and same_bits(c.v, v_in), "k and v in the QKV buffer untouched"
    tol = dict(atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(c.q.double(), q64, **tol)
    keep, blk, off = written(c)
    # every element of every written row: finite (the NaN poison is gone) and right
    got_k, got_v = c.k_cache[blk, off], c.v_cache[blk, off]
    assert bool(torch.isfinite(got_k).all()) and bool(torch.isfinite(got_v).all())
    torch.testing.assert_close(got_k.double(), k64[keep], **tol)
    assert same_bits(got_v, c.v[keep])
    # and nothing else: the other slots keep their poison
    untouched = torch.ones(c.k_cache.shape[:2], dtype=torch.bool, device=c.k_cache.device)
    untouched[blk, off] = False
    assert same_bits(c.k_cache[untouched], before[0][untouched])
    assert same_bits(c.v_cache[untouched], before[1][untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq, hkv, d, rot", SHAPES)
def test_matches_unfused_and_float64(device, dtype, hq, hkv, d, rot):
    for _ in range(2):  # fresh inputs per check
        check_against_references(make_case(device, dtype, hq, hkv, d, rot), dtype)


@pytest.mark.parametrize("layout", ["padded", "transposed"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_cache_layouts_and_block_sizes(device, layout, block_size):
    num_blocks = 12 if block_size == 1 else 3  # room for the 10 slots make_case draws
    c = make_case(
        device,
        torch.float16,
        4,
        2,
        16,
        16,
        num_blocks=num_blocks,
        block_size=block_size,
        layout=layout,
    )
    check_against_references(c, torch.float16)


def test_padded_tokens_write_nothing(device):
    """All slots -1: the cache keeps every poisoned bit; q is rotated all the same."""
    c = make_case(device, torch.float32, 4, 2, 16, 16, num_padded=7)
    assert bool((c.slots[: c.n] == -1).all())
    before = [c.k_cache.clone(), c.v_cache.clone()]
    q_ref, k_ref = c.q.clone(), c.k.clone()
    apply_rotary(q_ref, k_ref, c.positions, c.table)
    rotary_store_kv(**c.args())
    assert same_bits(c.k_cache, before[0]) and same_bits(c.v_cache, before[1])
    assert same_bits(c.q, q_ref)


def test_slots_past_the_cache_are_dropped(device):
    """Below validation mode, a slot outside the cache writes nothing, as in store_kv."""
    c = make_case(device, torch.float32, 4, 2, 16, 16, num_padded=0)
    num_slots = c.k_cache.shape[0] * c.k_cache.shape[1]
    c.slots[2], c.slots[4] = num_slots, -5
    with use_validation(False):
        check_against_references(c, torch.float32)


def test_zero_tokens_is_a_no_op(device):
    c = make_case(device, torch.float32, 4, 2, 16, 16, n=0, num_padded=0)
    before = c.snapshot()
    rotary_store_kv(**c.args())
    assert c.unchanged(before)


def test_torch_path_matches_its_unfused_ops_and_the_kernel(device):
    """ops.rotary_store_kv on the PyTorch backend is torch_ops' rotary then store (bit for
    bit) and agrees with the kernel."""
    c = make_case(device, torch.float32, 9, 3, 64, 64)
    fused = make_case(device, torch.float32, 9, 3, 64, 64)
    for t_from, t_to in zip(
        (c.qkv, c.k_cache, c.v_cache, c.positions, c.table, c.slots),
        (fused.qkv, fused.k_cache, fused.v_cache, fused.positions, fused.table, fused.slots),
    ):
        t_to.copy_(t_from)
    k_in = c.k.clone()
    q_ref, k_ref = c.q.clone(), c.k.clone()
    kc_ref, vc_ref = c.k_cache.clone(), c.v_cache.clone()
    with ops.use_backend("torch"):
        ops.apply_rotary(q_ref, k_ref, c.positions, c.table)
        ops.store_kv(k_ref, c.v, kc_ref, vc_ref, c.slots)
        ops.rotary_store_kv(**c.args())
    assert same_bits(c.q, q_ref) and same_bits(c.k, k_in)
    assert same_bits(c.k_cache, kc_ref) and same_bits(c.v_cache, vc_ref)
    with ops.use_backend("triton"):
        ops.rotary_store_kv(**fused.args())
    tol = dict(atol=TOL[torch.float32], rtol=TOL[torch.float32], equal_nan=True)
    torch.testing.assert_close(fused.q, c.q, **tol)
    torch.testing.assert_close(fused.k_cache, c.k_cache, **tol)
    torch.testing.assert_close(fused.v_cache, c.v_cache, **tol)


# ---- bad inputs: an error naming the argument, nothing written ---------------------------


def _wrong_dtype_cache(a):
    k_cache, v_cache = a["k_cache"], a["v_cache"]
    return {"k_cache": k_cache.half(), "v_cache": v_cache.half()}


BAD = [
    ("positions-int32", lambda a: {"positions": a["positions"].int()}, TypeError, "positions"),
    ("positions-short", lambda a: {"positions": a["positions"][:3]}, ValueError, "positions"),
    ("table-fp16", lambda a: {"cos_sin_cache": a["cos_sin_cache"].half()}, TypeError, "cos_sin"),
    (
        "table-odd-columns",
        lambda a: {"cos_sin_cache": a["cos_sin_cache"][:, :7]},
        ValueError,
        "cos_sin_cache has 7 columns",
    ),
    (
        "table-wider-than-head",
        lambda a: {"cos_sin_cache": torch.zeros(40, 18, device=a["q"].device)},
        ValueError,
        "cos_sin_cache has 18 columns",
    ),
    ("q-2d", lambda a: {"q": a["q"][:, 0]}, ValueError, "q must have 3"),
    ("q-not-tensor", lambda a: {"q": a["q"].tolist()}, TypeError, "q must be a torch.Tensor"),
    ("k-tokens", lambda a: {"k": a["k"][:3]}, ValueError, "k has shape"),
    ("k-dtype", lambda a: {"k": a["k"].half()}, TypeError, "k must have dtype"),
    ("v-heads", lambda a: {"v": a["v"][:, :1]}, ValueError, "v has shape"),
    ("v-tokens", lambda a: {"v": a["v"][:4]}, ValueError, "v has 4 tokens"),
    ("cache-dtype", _wrong_dtype_cache, TypeError, "k must have dtype"),
    ("v-cache-shape", lambda a: {"v_cache": a["v_cache"][:2]}, ValueError, "v_cache"),
    ("k-cache-not-tensor", lambda a: {"k_cache": None}, TypeError, "k_cache"),
    (
        "slot-mapping-int32",
        lambda a: {"slot_mapping": a["slot_mapping"].int()},
        TypeError,
        "slot_mapping",
    ),
    ("slot-mapping-short", lambda a: {"slot_mapping": a["slot_mapping"][:3]}, ValueError, "slot"),
]


def _bad_slot(value_of):
    def change(a):
        slots = a["slot_mapping"].clone()
        slots[3] = value_of(a["k_cache"])
        return {"slot_mapping": slots}

    return change


BAD_VALUES = [  # validation mode: values of the slot mapping
    ("slot-past-cache", _bad_slot(lambda kc: kc.shape[0] * kc.shape[1]), "past the cache"),
    ("slot-minus-2", _bad_slot(lambda kc: -2), "not -1"),
]


@pytest.mark.parametrize("name, change, exc, words", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_bad_input_raises_and_changes_nothing(device, name, change, exc, words, path):
    c = make_case(device, torch.float32, 4, 2, 16, 16)
    c.k_cache.normal_()  # finite, so a stray write shows even as a changed bit
    c.v_cache.normal_()
    before = c.snapshot()
    args = c.args()
    args.update(change(args))
    with ops.use_backend(path), pytest.raises(exc, match=words):
        ops.rotary_store_kv(**args)
    assert c.unchanged(before), "q, k, v and the cache are bit-identical to before"


@pytest.mark.parametrize("name, change, words", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_slot_values_raise_in_validation_mode(device, name, change, words):
    c = make_case(device, torch.float32, 4, 2, 16, 16)
    before = c.snapshot()
    args = c.args()
    args.update(change(args))
    with use_validation(True), pytest.raises(ValueError, match=rf"slot_mapping\[3\].*{words}"):
        rotary_store_kv(**args)
    assert c.unchanged(before)


@pytest.mark.interpreter
def test_bf16_refused_under_the_interpreter():
    c = make_case("cpu", torch.bfloat16, 4, 2, 16, 16)
    before = c.snapshot()
    with pytest.raises(TypeError, match="bfloat16"):
        rotary_store_kv(**c.args())
    assert c.unchanged(before)


# ---- the attention layer and a whole model ------------------------------------------------


def unfused_attention_forward(self, x, meta, kv_cache):
    """Attention.forward as it was before the fusion: rotary, then store + attention."""
    t = x.shape[0]
    qkv = self.qkv_proj(x)
    q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
    k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
    v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
    self.rotary(q, k, meta.positions)
    out = self.attn(q, k, v, kv_cache, meta)
    return self.o_proj(out.view(t, self.q_size))


def run_model(model, cfg, device, *, dtype=None, steps=2):
    """Prefill two prompts (padded), then `steps` decode steps of fixed tokens; returns
    the outputs of every forward and the final cache."""
    g = torch.Generator().manual_seed(7)
    runner = PagedRunner(cfg, device, dtype=dtype, max_num_tokens=32, max_model_len=32)
    runner.cache.data.copy_(torch.randn(runner.cache.data.shape, generator=g))
    runner.cache.data[:, :, 0].zero_()
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 4)]
    meta = runner.step([(0, prompts[0]), (1, prompts[1])], pad_reqs=1, pad_tokens=3)
    outs = list(model(meta.input_ids, meta, runner.cache, all_logits=True))
    for _ in range(steps):
        toks = torch.randint(0, cfg.vocab_size, (2,), generator=g).tolist()
        meta = runner.step([(0, [toks[0]]), (1, [toks[1]])], pad_reqs=1, pad_tokens=1)
        outs += model(meta.input_ids, meta, runner.cache, all_logits=True)
    return outs, runner.cache.data.clone()


def assert_model_matches_unfused(cfg, device, monkeypatch, *, dtype=None):
    model = random_causal_lm(cfg, seed=3, dtype=dtype, device=device)
    got, got_cache = run_model(model, cfg, device, dtype=dtype)
    with monkeypatch.context() as m:
        m.setattr(Attention, "forward", unfused_attention_forward)
        ref, ref_cache = run_model(model, cfg, device, dtype=dtype)
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert same_bits(a, b), f"output {i} differs from the unfused forward"
    assert same_bits(got_cache, ref_cache), "KV cache differs from the unfused forward"


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_llama_forward_same_as_unfused(device, monkeypatch, backend):
    """A small Llama (4 / 2 heads of 16, two layers; and 9 / 3 of 64 through the
    PyTorch path): prefill and decode outputs and the cache, bit for bit."""
    cfg = tiny_config()
    with ops.use_backend(backend):
        assert_model_matches_unfused(cfg, device, monkeypatch)
        if backend == "torch":
            big = tiny_config(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64)
            assert_model_matches_unfused(big, device, monkeypatch)


@pytest.mark.parametrize("rows", [4, 12], ids=["fused-path", "unfused-path"])
def test_attention_layer_launches_no_separate_rotary_or_store(device, monkeypatch, rows):
    """A layer goes through one fused op a step: rotary_store_kv, or on the fused decode
    path (a few rows on the Triton backend) the QKV projection with rotary and the store
    (fused_qkv_rope); the separate rotary and store calls would raise here."""

    def refuse(*args, **kwargs):
        raise AssertionError("separate rotary / store launched")

    calls = []

    def counting(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return call

    import specdraft.attention as attention_mod
    import specdraft.layers as layers_mod

    monkeypatch.setattr(attention_mod, "store_kv", refuse)
    monkeypatch.setattr(layers_mod, "apply_rotary", refuse)
    monkeypatch.setattr(
        layers_mod, "rotary_store_kv", counting("rotary_store_kv", ops.rotary_store_kv)
    )
    monkeypatch.setattr(ops, "fused_qkv_rope", counting("fused_qkv_rope", ops.fused_qkv_rope))
    cfg = tiny_config()
    model = random_causal_lm(cfg, seed=1, device=device)
    runner = PagedRunner(cfg, device)
    meta = runner.step([(0, list(range(1, rows)))], pad_tokens=1)
    model(meta.input_ids, meta, runner.cache)
    assert len(calls) == cfg.num_layers, calls
    fused = ops.fused_decode(torch.zeros(rows, cfg.hidden_size, device=device), model.fused_rows())
    assert set(calls) == {"fused_qkv_rope" if fused else "rotary_store_kv"}, calls


def _layer_case(device):
    cfg = tiny_config()
    model = random_causal_lm(cfg, seed=2, device=device)
    runner = PagedRunner(cfg, device)
    meta = runner.step([(0, [5, 6, 7, 8, 9]), (1, [3, 4])], pad_reqs=1, pad_tokens=1)
    x = torch.randn(meta.num_tokens, cfg.hidden_size, device=device)
    return model.layers[0].self_attn, meta, runner.cache, x


def _with(meta, **fields):
    return dataclasses.replace(meta, **fields)


def _bad_block_table(meta):
    table = meta.block_table.clone()
    table[0, 0] = 10**6
    return _with(meta, block_table=table)


def _bad_seq_lens(meta):
    lens = meta.seq_lens.clone()
    lens[1] = 0  # below the request's query length
    return _with(meta, seq_lens=lens)


def _slot_past_cache(meta):
    slots = meta.slot_mapping.clone()
    slots[0] = 10**9
    return _with(meta, slot_mapping=slots)


LAYER_BAD = [
    ("positions-int32", lambda m: _with(m, positions=m.positions.int()), TypeError, "positions"),
    (
        "slot-mapping-int32",
        lambda m: _with(m, slot_mapping=m.slot_mapping.int()),
        TypeError,
        "slot",
    ),
    ("slot-past-cache", _slot_past_cache, ValueError, "slot_mapping"),
    ("block-table-entry", _bad_block_table, ValueError, "block_table"),
    ("seq-lens-short", _bad_seq_lens, ValueError, "seq_lens"),
    ("meta-not-metadata", lambda m: dataclasses.asdict(m), TypeError, "meta"),
]


@pytest.mark.parametrize("name, change, exc, words", LAYER_BAD, ids=[b[0] for b in LAYER_BAD])
def test_attention_layer_bad_input_changes_nothing(device, name, change, exc, words):
    """Every check (the layer's, rotary's, the store's and the attention kernel's, the
    metadata's values in validation mode) runs before the fused kernel writes."""
    attn, meta, cache, x = _layer_case(device)
    before = (cache.data.clone(), x.clone())
    with use_validation(True), pytest.raises(exc, match=words):
        attn(x, change(meta), cache.layer(0))
    assert same_bits(cache.data, before[0]) and same_bits(x, before[1])


@pytest.mark.parametrize("bad", ["dtype", "shape"])
def test_attention_layer_bad_cache_changes_nothing(device, bad):
    attn, meta, cache, x = _layer_case(device)
    k_cache, v_cache = cache.layer(0)
    before = cache.data.clone()
    pair = (k_cache.half(), v_cache.half()) if bad == "dtype" else (k_cache, v_cache[:, :8])
    with pytest.raises((TypeError, ValueError), match="cache"):
        attn(x, meta, pair)
    assert same_bits(cache.data, before)


# ---- GPU: bf16, model shapes, a large cache, a bf16 model ---------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "hq, hkv, d, rot", [(9, 3, 64, 64), (32, 8, 128, 128), (16, 4, 128, 64), (4, 2, 16, 8)]
)
@pytest.mark.parametrize("layout", ["kvcache", "padded", "transposed"])
def test_gpu_bf16_matches_unfused(hq, hkv, d, rot, layout):
    for n in (1, 5, 300):
        c = make_case(
            "cuda",
            torch.bfloat16,
            hq,
            hkv,
            d,
            rot,
            n=n,
            num_blocks=40,
            block_size=16,
            num_padded=n // 7,
            layout=layout,
        )
        check_against_references(c, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_large_cache_int64_addresses():
    """Slots past 2^31 cache elements (block ids above 2^17 with 16 x 8 x 128 per block)."""
    bs, hkv, d, hq, n = 16, 8, 128, 32, 300
    num_blocks = (1 << 31) // (bs * hkv * d) + 64
    k_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
    table = torch.randn(4096, d, device="cuda")
    positions = torch.randint(0, 4096, (n,), device="cuda")
    slots = torch.randperm(64 * bs, device="cuda")[:n] + (num_blocks - 64) * bs
    slots[::7] = -1
    q_ref, k_ref = q.clone(), k.clone()
    apply_rotary(q_ref, k_ref, positions, table)
    rotary_store_kv(q, k, v, positions, table, k_cache, v_cache, slots)
    keep = slots >= 0
    s = slots[keep]
    assert same_bits(q, q_ref)
    assert same_bits(k_cache[s // bs, s % bs], k_ref[keep])
    assert same_bits(v_cache[s // bs, s % bs], v[keep])
    expect_nonzero = int(keep.sum()) * hkv * d
    assert k_cache.count_nonzero().item() == expect_nonzero - (k_ref[keep] == 0).sum().item()


@pytest.mark.gpu
def test_gpu_bf16_llama_forward_same_as_unfused(monkeypatch):
    cfg = tiny_config(
        hidden_size=576,
        intermediate_size=1536,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        dtype=torch.bfloat16,
    )
    assert_model_matches_unfused(cfg, "cuda", monkeypatch, dtype=torch.bfloat16)


def test_exports():
    assert kernels.rotary_store_kv is rotary_store_kv
    assert "rotary_store_kv" in kernels.__all__ and "check_rotary_store_kv_args" in kernels.__all__
