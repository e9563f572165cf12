"""Bad input to the drafter: every refused call names the argument, the value and the
limit, and leaves the drafter exactly as it was (host bookkeeping, device lengths,
counters, the KV cache); running out of KV blocks is reported before anything is
written."""

# ruff: noqa: F811 (fixtures imported from tests/drafter_helpers.py are test arguments)
from __future__ import annotations

import pytest
import torch

from specdraft.drafter import Drafter, DraftOutOfBlocksError

# The fixtures `setup` and `torch_layers` come from tests/drafter_helpers.py.
from tests.drafter_helpers import (  # noqa: F401
    EngineSim,
    drafter,
    make_setup,
    same_state,
    setup,
    snapshot,
    torch_layers,
)

pytest.importorskip("transformers")
pytestmark = pytest.mark.interpreter  # CPU tensors through the round's Triton kernels


def _good(sim, rids):
    ver, acc, hid = sim.inputs(rids, sim.d.width)
    return dict(req_ids=rids, verified_tokens=ver, num_accepted=acc, target_hidden=hid)


def _with(**over):
    """A propose() call with some arguments replaced (callables get the good value)."""

    def call(d, good):
        kw = dict(good)
        for name, v in over.items():
            kw[name] = v(kw[name]) if callable(v) else v
        rids = kw.pop("req_ids")
        ver, acc = kw.pop("verified_tokens"), kw.pop("num_accepted")
        d.propose(rids, ver, acc, **kw)

    return call


EAGLE_ONLY, LLAMA_ONLY = {"eagle", "eagle3", "eagle_vocab"}, {"llama"}
PROPOSE_CASES = [
    # (id, call, message, kinds it applies to)
    ("unknown-id", _with(req_ids=["r0", "nope"]), "unknown req_id 'nope'", None),
    ("duplicate-id", _with(req_ids=["r0", "r0"]), "'r0' twice", None),
    ("no-ids", _with(req_ids=[]), "req_ids has 0 requests", None),
    ("str-ids", _with(req_ids="r0"), "req_ids must be a sequence", None),
    ("k-over-kmax", _with(k=[1, 5]), r"k\[1\] = 5 for request 'r1' is over K_max 3", None),
    ("k-over-chosen-kmax", _with(k=[2, 1], k_max=1), r"k\[0\] = 2 .* over K_max 1", None),
    ("k-negative", _with(k=[0, -1]), r"k\[1\] = -1", None),
    ("k-length", _with(k=[1, 1, 1]), "k has 3 entries, expected one per request", None),
    ("k-float", _with(k=[1.5, 1.0]), "k must hold integers", None),
    (
        "kmax-not-captured",
        _with(k_max=2),
        r"k_max 2 is not one of the captured options \[1, 3\]",
        None,
    ),
    (
        "verified-device",
        _with(verified_tokens=lambda v: v.to("meta")),
        "verified_tokens is on meta",
        None,
    ),
    (
        "verified-float",
        _with(verified_tokens=lambda v: v.float()),
        "verified_tokens has dtype torch.float32",
        None,
    ),
    (
        "verified-rows",
        _with(verified_tokens=lambda v: v[:1]),
        r"verified_tokens has shape \(1, 4\), expected \[2, \*\]",
        None,
    ),
    (
        "verified-too-wide",
        _with(verified_tokens=lambda v: torch.cat([v, v], 1)),
        r"verified_tokens has width 8, must be in \[1, W = 4\]",
        None,
    ),
    (
        "verified-out-of-vocab",
        _with(verified_tokens=lambda v: v.index_fill(1, torch.tensor([0]), 999)),
        r"verified_tokens\[0, 0\] = 999 .* outside the vocabulary \[0, 128\)",
        None,
    ),
    (
        "accepted-dtype",
        _with(num_accepted=lambda a: a.float()),
        "num_accepted has dtype torch.float32",
        None,
    ),
    (
        "accepted-shape",
        _with(num_accepted=lambda a: a[:, None]),
        r"num_accepted has shape \(2, 1\)",
        None,
    ),
    (
        "accepted-over-width",
        _with(num_accepted=lambda a: a + 4),
        r"num_accepted\[0\] = \d+ for request 'r0' must be in \[0, 3\]",
        None,
    ),
    ("accepted-negative", _with(num_accepted=lambda a: a - 9), r"num_accepted\[0\] = -\d+", None),
    (
        "hidden-missing",
        _with(target_hidden=None),
        r"target_hidden \[2, 4, \d+\] is required",
        EAGLE_ONLY,
    ),
    (
        "hidden-width",
        _with(target_hidden=lambda h: h[..., :-1]),
        r"target_hidden has shape \(2, 4, \d+\), expected \[2, 4, \d+\]",
        EAGLE_ONLY,
    ),
    (
        "hidden-dtype",
        _with(target_hidden=lambda h: h.double()),
        "target_hidden has dtype torch.float64",
        EAGLE_ONLY,
    ),
    (
        "hidden-for-llama",
        _with(target_hidden=torch.zeros(2, 4, 8)),
        "target_hidden is for EAGLE heads",
        LLAMA_ONLY,
    ),
]


@pytest.mark.parametrize("case", PROPOSE_CASES, ids=[c[0] for c in PROPOSE_CASES])
def test_bad_propose_input_changes_nothing(setup, torch_layers, case):
    name, call, message, kinds = case
    if kinds is not None and setup.kind not in kinds:
        pytest.skip(f"{name} is for {sorted(kinds)}")
    d = drafter(setup)
    sim = EngineSim(setup, d, seed=8)
    rids = [sim.join(5), sim.join(3)]
    good = _good(sim, rids)
    before = snapshot(d)
    with pytest.raises(ValueError, match=message):
        call(d, good)
    assert same_state(before, snapshot(d)), f"{name}: state changed"
    d.propose(**{"req_ids": rids, **{k: v for k, v in good.items() if k != "req_ids"}})


def _hid(d, n):
    """Valid target states for an n-token prompt (None for a Llama draft)."""
    return None if d.hidden_in == 0 else torch.randn(n, d.hidden_in)


ADD_CASES = [
    ("duplicate", lambda d, s: d.add_request("r0", [1, 2]), "'r0' is already present"),
    ("unhashable", lambda d, s: d.add_request(["x"], [1, 2]), "req_id must be hashable"),
    ("empty", lambda d, s: d.add_request("x", []), "prompt_token_ids is empty"),
    ("too-long", lambda d, s: d.add_request("x", [1] * 160), "has 160 tokens: at most"),
    (
        "out-of-vocab",
        lambda d, s: d.add_request("x", [1, 128]),
        r"prompt_token_ids\[1\] = 128 is outside the vocabulary \[0, 128\)",
    ),
    ("float-tokens", lambda d, s: d.add_request("x", [1.0, 2.0]), "must hold integers"),
    (
        "params-type",
        lambda d, s: d.add_request("x", [1, 2], {"temperature": 0}, target_hidden=_hid(d, 2)),
        "params must be a SamplingParams",
    ),
    (
        "k-over",
        lambda d, s: d.add_request("x", [1, 2], None, 4, target_hidden=_hid(d, 2)),
        r"k must be in \[0, 3\]",
    ),
    (
        "hidden",
        lambda d, s: d.add_request("x", [1, 2], target_hidden=torch.zeros(3, 4)),
        "target_hidden",
    ),
    ("unknown-remove", lambda d, s: d.remove_request("nope"), "unknown req_id 'nope'"),
    ("reserve-over", lambda d, s: d.reserve("r0", 10**6), r"num_tokens must be in \[1, 160\]"),
]


@pytest.mark.parametrize("case", ADD_CASES, ids=[c[0] for c in ADD_CASES])
def test_bad_request_input_changes_nothing(setup, case):
    name, call, message = case
    d = drafter(setup)
    sim = EngineSim(setup, d, seed=9)
    sim.join(4)
    before = snapshot(d)
    with pytest.raises((ValueError, TypeError), match=message):
        call(d, sim)
    assert same_state(before, snapshot(d)), f"{name}: state changed"


def test_full_drafter_refuses_a_request(setup, torch_layers):
    d = drafter(setup)
    sim = EngineSim(setup, d, seed=9)
    for _ in range(4):
        sim.join(3)
    before = snapshot(d)
    with pytest.raises(ValueError, match="no free row slot for req_id 'x': 4 requests held"):
        d.add_request("x", [1, 2], target_hidden=_hid(d, 2))
    assert same_state(before, snapshot(d))


def test_bad_construction():
    s = make_setup("llama")
    with pytest.raises(TypeError, match="model must be a LlamaForCausalLM, EagleHead or"):
        Drafter(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="max_model_len 512 is over the model's rotary"):
        Drafter(s.model, max_model_len=512)
    with pytest.raises(ValueError, match="q_vocab must be 'target' or 'draft'"):
        Drafter(s.model, q_vocab="both")
    with pytest.raises(ValueError, match="graph_modes holds 'fast'"):
        Drafter(s.model, graph_modes=("fast",))
    with pytest.raises(ValueError, match=r"k_max_options\[i\] must be in \[1, 64\]"):
        Drafter(s.model, k_max_options=(0, 3))
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):
        Drafter(s.model, cuda_graphs=True)


def test_out_of_blocks_is_reported_before_any_write(setup, torch_layers):
    """Blocks are allocated by upper bound before the round; when the cache is short
    the round raises DraftOutOfBlocksError with nothing changed, and goes through once
    a request has left."""
    d = drafter(setup, num_blocks=4)  # the null block and 3 blocks of 16 tokens
    sim = EngineSim(setup, d, seed=10)
    rids = [sim.join(14), sim.join(14)]  # one block each; a round needs a second
    good = _good(sim, rids)
    before = snapshot(d)
    with pytest.raises(
        DraftOutOfBlocksError, match="needs 2 more KV blocks .* but 1 are free"
    ) as err:
        _with()(d, good)
    assert (err.value.needed, err.value.free) == (2, 1)
    assert same_state(before, snapshot(d))
    _with(
        req_ids=rids[:1],
        verified_tokens=lambda v: v[:1],
        num_accepted=lambda a: a[:1],
        target_hidden=lambda h: None if h is None else h[:1],
    )(d, good)
    assert d.tables.num_free_blocks == 0
    d.remove_request(rids[1])
    assert d.tables.num_free_blocks == 1
    assert not d.reserve(rids[0], 16 * 3 + 1)


def test_host_stage_uploads_only_what_changed():
    """A round's host inputs (width, slots, k, the input sources' fields) go to the
    device once per change: the same batch with the same k and sources again uploads
    nothing, any difference uploads it all."""
    import numpy as np

    from specdraft.draft_buffers import HostStage
    from specdraft.kernels.draft_round import SOURCE_FIELDS

    packed = torch.full((1 + 2 * 4 + SOURCE_FIELDS,), -7, dtype=torch.int64)
    stage = HostStage(packed, 4, depth=2)
    slots, k = np.array([3, 1], dtype=np.int64), np.array([2, 0], dtype=np.int64)
    src = np.arange(SOURCE_FIELDS, dtype=np.int64) + 40
    stage.upload(4, slots, k, 3, src)
    want = [4, 3, 1, -1]  # width, slots, padding row
    assert packed[:4].tolist() == want and packed[5:8].tolist() == [2, 0, 0]
    assert packed[9:].tolist() == src.tolist()
    packed[0] = 99  # a write the memo cannot see would stay: upload is the only writer
    stage.upload(4, slots.copy(), k.copy(), 3, src.copy())
    assert stage.skipped == 1 and packed[0] == 99
    other = src.copy()
    other[3] += 1
    for width, s, kk, pad, sf in [(4, slots, np.array([2, 1]), 3, src), (3, slots, k, 3, src),
                                  (4, slots[::-1].copy(), k, 3, src), (4, slots, k, 2, src),
                                  (4, slots, k, 3, other), (4, slots, k, 3, None)]:  # fmt: skip
        before = stage.skipped
        stage.upload(width, s, kk.astype(np.int64), pad, sf)
        assert stage.skipped == before
        assert packed[0] == width and packed[1 : 1 + len(s)].tolist() == s.tolist()
        assert packed[9:].tolist() == ([0] * SOURCE_FIELDS if sf is None else sf.tolist())
