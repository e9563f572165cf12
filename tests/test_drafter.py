"""The draft round (specdraft/drafter.py): greedy rounds against transformers (Llama
draft) and a float64 reference (EAGLE heads), committed draft KV against a from-scratch
prefill over many rounds with requests joining and leaving, sampled rows' q and tokens,
padding, the padded (graph) path against the unpadded eager one, the PyTorch path of the
round kernels against Triton, bad input, running out of blocks, a transformers target
driving propose(); on the GPU: replay against eager for every graph, no
synchronisation, host time, memory over 10^4 replays, capture time, the 200k-draw
distribution."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specdraft.drafter import Drafter, DraftOutOfBlocksError
from specdraft.sampling import DRAFT_PROPOSAL, SamplingParams, filtered_probs, sample
from tests.drafter_helpers import (
    KINDS,
    EngineSim,
    fresh_kv,
    kv_rows,
    make_setup,
    same_state,
    snapshot,
)
from tests.test_cuda_graph import EagerBackend

pytest.importorskip("transformers")
pytestmark = pytest.mark.interpreter  # CPU tensors through the round's Triton kernels

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=KINDS)
def setup(request):
    return make_setup(request.param)


@pytest.fixture
def torch_layers(monkeypatch):
    """Model layers on their PyTorch path (fast on the CPU), the round's own kernels
    still through Triton (the interpreter): for the many-round tests."""
    from specdraft import draft_loop as loop_module
    from specdraft.kernels.draft_round import DraftRoundKernels
    from specdraft.ops import use_backend

    monkeypatch.setattr(loop_module, "draft_round_ops", lambda b, **kw: DraftRoundKernels(b, **kw))
    with use_backend("torch"):
        yield


def drafter(setup, **kw) -> Drafter:
    base = dict(max_num_reqs=4, k_max_options=(1, 3), max_model_len=160, max_prefill_tokens=16)
    return Drafter(setup.model, **{**base, **kw})


def check_round(sim: EngineSim, rids, tokens: torch.Tensor, ks) -> None:
    """Greedy drafts of each row equal the reference's greedy continuation."""
    for i, r in enumerate(rids):
        toks, hid = sim.context(r)
        ref = sim.s.ref_greedy(toks, hid, ks[i])
        got = tokens[i].tolist()
        assert got[: ks[i]] == ref, f"request {r}: drafts {got} vs reference {ref}"
        assert all(t == -1 for t in got[ks[i] :]), f"request {r}: {got} past k={ks[i]}"


def test_greedy_rounds_match_reference(setup):
    """Ragged batches: mixed accepted counts (0 .. W - 1, narrower verified blocks too),
    mixed k (0 .. K_max) in one round; K_max 3 and 1."""
    d = drafter(setup)
    sim = EngineSim(setup, d, seed=1)
    rids = [sim.join(n) for n in (7, 2, 5)]
    plan = [((3, 1, 0), 3, 4), ((2, 3, 3), 3, 3), ((1, 0, 1), 1, 4), ((3, 2, 1), None, 4)]
    for ks, k_max, width in plan:
        for r in rids:  # narrower blocks must still hold every accepted row
            q = sim.seqs[r]
            q.verified = q.verified[:width]
        ver, acc, hid = sim.inputs(rids, width)
        out = d.propose(rids, ver, acc, target_hidden=hid, k=list(ks), k_max=k_max)
        assert out.q is None and out.tokens.shape == (3, k_max or 3)
        check_round(sim, rids, out.tokens, ks)
        sim.commit(rids)
    assert d.read_counters()["rounds"] == len(plan)


def test_committed_kv_equals_fresh_prefill_over_32_rounds(setup, torch_layers):
    """Random accepted counts and k every round, requests joining and leaving (slots and
    blocks reused): after every round the committed draft KV of every request equals a
    from-scratch prefill of its committed context."""
    d = drafter(setup, k_max_options=(1, 2, 3))
    assert type(d.loop.ops).__name__ == "DraftRoundKernels"
    sim = EngineSim(setup, d, seed=2)
    rng = random.Random(3)
    live = [sim.join() for _ in range(3)]
    left = 0
    for rnd in range(32):
        if rnd % 5 == 4 and live:
            sim.leave(live.pop(rng.randrange(len(live))))
            left += 1
        if len(live) < 4 and rng.random() < 0.5:
            live.append(sim.join())
        rids = rng.sample(live, rng.randint(1, len(live)))
        ks = [rng.randint(0, 3) for _ in rids]
        ver, acc, hid = sim.inputs(rids, d.width)
        d.propose(rids, ver, acc, target_hidden=hid, k=ks)
        for r in rids:
            toks, hid_ctx = sim.context(r)
            length = len(toks) - setup.shift
            slot = d.tables.row_of(r)
            assert int(d.buffers.base[slot]) == length
            # the host's bounds hold the exact length; the readback then pins it
            assert d.lengths.lower[slot] <= length <= d.lengths.upper[slot]
            assert d.tables.num_blocks_of(r) * d.block_size >= d.lengths.upper[slot]
            ref = fresh_kv(setup, toks, hid_ctx, length)
            torch.testing.assert_close(kv_rows(d, r, length), ref, atol=2e-5, rtol=1e-5)
        sim.commit(rids)
        d.lengths.poll()  # CPU copies are complete at once
        for r in rids:
            slot = d.tables.row_of(r)
            assert d.lengths.lower[slot] == d.lengths.upper[slot] == int(d.buffers.base[slot])
    assert left >= 5


def test_padded_graph_path_equals_unpadded_eager(setup, torch_layers):
    """A drafter with (stand-in) graphs pads every batch to a bucket and runs the round
    captured on dummy inputs; one without graphs runs unpadded. Same drafts; padding
    rows and the capture's dummy rows write no KV; nothing is NaN."""
    g = drafter(setup, capture_sizes=[2, 4], graph_backend=EagerBackend(), cuda_graphs=True)
    e = drafter(setup)
    assert g.num_graphs == 2 * 2 * 3  # buckets x K_max options x sampling modes
    assert torch.count_nonzero(g.cache.data[:, :, 0]) == 0, "capture wrote the null block"
    for x in (g, e):  # poison: finite values that a stray write would change
        x.cache.data[:, :, 1:].normal_()
    sims = [EngineSim(setup, x, seed=4) for x in (g, e)]
    params = [GREEDY, SamplingParams(0.8, top_k=20, seed=5), SamplingParams(1.0, seed=6)]
    rids = [[s.join(params=p) for p in params] for s in sims]
    for rnd, (b, k_max) in enumerate([(3, 3), (1, 1), (3, 1), (2, 3), (3, 3)]):
        outs = []
        owned = set()
        for s, x, rr in zip(sims, (g, e), rids):
            ver, acc, hid = s.inputs(rr[:b], x.width)
            before = x.cache.data.clone()
            outs.append(x.propose(rr[:b], ver, acc, target_hidden=hid, k_max=k_max))
            if x is g:
                owned = {blk for r in rr[:b] for blk in x.tables.blocks_of(r)}
                others = [i for i in range(x.cache.num_blocks) if i not in owned]
                assert torch.equal(x.cache.data[:, :, others], before[:, :, others])
            s.commit(rr[:b])
        (tg, qg), (te, qe) = outs
        assert torch.equal(tg, te), f"round {rnd}"
        assert (qg is None) == (qe is None) == (b == 1)
        if qg is not None:
            assert torch.isfinite(g.loop.q).all()
            torch.testing.assert_close(qg, qe, atol=1e-6, rtol=1e-5)
    assert g.graph_rounds == 5 and e.graph_rounds == 0
    assert torch.count_nonzero(g.cache.data[:, :, 0]) == 0


def test_sampled_rows_q_and_tokens(setup):
    """Greedy and sampled rows (temperature, top-k, top-p) in one round: q is exactly
    filtered_probs of the reference logits, rows sum to 1, and each token is the draw
    keyed by (seed, absolute position, DRAFT_PROPOSAL) from it. Same seeds, same tokens."""
    params = [
        SamplingParams(0.7, seed=11),
        GREEDY,
        SamplingParams(1.0, top_k=5, seed=12),
        SamplingParams(1.3, top_p=0.8, seed=13),
    ]
    runs = []
    for _ in range(2):
        d = drafter(setup)
        sim = EngineSim(setup, d, seed=7)
        rids = [sim.join(6, params=p) for p in params]
        rounds = []
        for _ in range(2):
            ver, acc, hid = sim.inputs(rids, d.width)
            out = d.propose(rids, ver, acc, target_hidden=hid)
            rounds.append(out.tokens.clone())
            q = out.q
            assert q.shape == (4, 3, d.vocab_size)
            torch.testing.assert_close(q.sum(-1), torch.ones(4, 3), atol=1e-5, rtol=0)
            for i, r in enumerate(rids):
                toks, hid_ctx = sim.context(r)
                drafts = out.tokens[i].tolist()
                logits = setup.ref_logits(toks, hid_ctx, drafts[:-1]).float()
                p = params[i]
                want_q = filtered_probs(logits, [p] * 3)
                got_q = q[i]
                if setup.kind == "eagle3":  # q over the target vocabulary, zero elsewhere
                    outside = torch.ones(d.vocab_size, dtype=torch.bool)
                    outside[d.q_token_ids] = False
                    assert torch.count_nonzero(got_q[:, outside]) == 0
                    got_q = got_q[:, d.q_token_ids]
                torch.testing.assert_close(got_q, want_q, atol=2e-5, rtol=1e-4)
                pos = torch.arange(3) + len(toks)  # absolute position of each draft
                want = sample(logits, [p] * 3, pos, DRAFT_PROPOSAL)
                want = [setup.to_target(int(t)) for t in want]
                assert drafts == want, f"row {i} ({p}): {drafts} vs {want}"
            sim.commit(rids)
        runs.append(rounds)
    for a, b in zip(*runs):
        assert torch.equal(a, b), "same seeds, same tokens"


# ---- bad input, running out of blocks -------------------------------------------------


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


EAGLE_ONLY, LLAMA_ONLY = {"eagle", "eagle3"}, {"llama"}
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


# ---- the round kernels: PyTorch path against Triton -----------------------------------


def _random_buffers(seed: int, max_rows=6, width=4, k_cap=3, vocab=100):
    from specdraft.draft_buffers import make_round_buffers

    g = torch.Generator().manual_seed(seed)
    null = max_rows
    rows = torch.randint(0, 9, (null + 1, 5), generator=g, dtype=torch.int32)
    rows[null] = 0
    b, _ = make_round_buffers(
        max_rows=max_rows,
        width=width,
        k_cap=k_cap,
        null_row=null,
        rows=rows,
        table=torch.zeros(max_rows, 5, dtype=torch.int32),
        device=torch.device("cpu"),
    )
    n_real = int(torch.randint(1, max_rows + 1, (), generator=g))
    slots = torch.randperm(null, generator=g)[:max_rows]
    slots[n_real:] = -1
    if n_real > 1:
        slots[int(torch.randint(0, n_real, (), generator=g))] = null  # a capture dummy row
    b.slots.copy_(slots)
    b.width.fill_(int(torch.randint(1, width + 1, (), generator=g)))
    b.k.copy_(torch.randint(-1, k_cap + 2, (max_rows,), generator=g))
    b.accepted.copy_(torch.randint(-2, width + 2, (max_rows,), generator=g))
    b.verified.copy_(torch.randint(-5, vocab + 5, (max_rows, width), generator=g))
    b.base.copy_(torch.randint(0, 70, (null + 1,), generator=g, dtype=torch.int32))
    b.counters.copy_(torch.randint(0, 9, b.counters.shape, generator=g))
    b.tokens.copy_(torch.randint(-1, vocab + 3, b.tokens.shape, generator=g))
    b.cur_pos.copy_(torch.randint(0, 70, b.cur_pos.shape, generator=g))
    return b, dict(
        max_rows=max_rows, width=width, k_cap=k_cap, block_size=16, vocab_size=vocab, null_row=null
    )


@pytest.mark.parametrize("seed", range(6))
def test_torch_round_ops_equal_triton_kernels(seed):
    from specdraft.draft_round_ops import TorchDraftRound
    from specdraft.kernels.draft_round import DraftRoundKernels

    b1, kw = _random_buffers(seed)
    b2, _ = _random_buffers(seed)
    ops = [DraftRoundKernels(b1, **kw), TorchDraftRound(b2, **kw)]
    rows = int((b1.slots >= 0).sum()) + seed % 2  # padded or not
    rows = max(1, min(rows, kw["max_rows"]))

    def same(what):
        for name in vars(b1):
            assert torch.equal(getattr(b1, name), getattr(b2, name)), f"{what}: {name}"

    for o in ops:
        o.prepare(rows)
    same("prepare")
    for o in ops:
        for step in (1, 2):
            o.advance(rows, step, 3)
    same("advance")
    for o in ops:
        o.epilogue(rows, 3)
    same("epilogue")


# ---- an engine around it: transformers plays the target --------------------------------


def _hf_llama(cfg, weights):
    import transformers

    m = transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(**cfg.to_hf()))
    m.load_state_dict(weights, strict=False)
    return m.float().eval()


@torch.no_grad()
def _speculative_greedy(target, d, prompt, n_new, rng, aux=None):
    """An engine in a dozen lines: the transformers target verifies each round's drafts
    (full recompute, greedy) and feeds the verified block back to propose()."""

    def run_target(tokens):
        out = target(torch.tensor([tokens]), output_hidden_states=aux is not None)
        hid = None if aux is None else torch.cat([out.hidden_states[i][0] for i in aux], -1)
        return out.logits[0], hid

    logits, hid = run_target(prompt)
    block = [int(logits[-1].argmax())]
    block_h = None if hid is None else hid[-1:]  # the state that predicted block[0]
    d.add_request("r", prompt, target_hidden=hid)
    out_tokens, drafted, accepted = list(block), 0, 0
    committed = prompt + block
    while len(out_tokens) < n_new:
        w = d.width
        ver = torch.zeros(1, w, dtype=torch.int64)
        ver[0, : len(block)] = torch.tensor(block)
        th = None
        if block_h is not None:
            th = torch.zeros(1, w, block_h.shape[-1])
            th[0, : len(block)] = block_h
        prop = d.propose(
            ["r"],
            ver,
            torch.tensor([len(block) - 1]),
            target_hidden=th,
            k=[rng.randint(0, d.k_cap)],
        )
        drafts = [t for t in prop.tokens[0].tolist() if t >= 0]
        logits, hid = run_target(committed + drafts)
        m = len(committed)
        best = logits[m - 1 : m + len(drafts)].argmax(-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == best[a]:
            a += 1
        block = drafts[:a] + [best[a]]
        block_h = None if hid is None else hid[m - 1 : m + a]
        committed += block
        out_tokens += block
        drafted, accepted = drafted + len(drafts), accepted + a
    d.remove_request("r")
    return out_tokens[:n_new], accepted / max(drafted, 1)


@torch.no_grad()
def _plain_greedy(target, prompt, n_new):
    toks = list(prompt)
    for _ in range(n_new):
        toks.append(int(target(torch.tensor([toks])).logits[0, -1].argmax()))
    return toks[len(prompt) :]


@pytest.mark.parametrize("variant", ["llama-same-weights", "llama-other-weights", "eagle3"])
def test_transformers_target_drives_propose(variant, torch_layers):
    """The engine-agnostic claim: a transformers model is the target, an engine loop of a
    dozen lines calls propose() round after round, and the output equals the target's
    own greedy decoding (speculation is lossless); a draft with the target's weights gets
    nearly everything accepted."""
    from specdraft.models.tiny import eagle_config, random_eagle3_head, random_weights
    from tests.drafter_helpers import tiny

    rng = random.Random(5)
    prompt = [rng.randrange(128) for _ in range(9)]
    aux, same = None, variant == "llama-same-weights"
    if variant.startswith("llama"):
        s = make_setup("llama")
        target = _hf_llama(s.cfg, s.weights if same else random_weights(s.cfg, seed=9))
        d = drafter(s)
    else:
        tcfg = tiny(num_layers=3)
        target = _hf_llama(tcfg, random_weights(tcfg, seed=4))
        head = random_eagle3_head(eagle_config(tcfg, draft_vocab_size=80), seed=2)
        d = Drafter(head, max_num_reqs=2, k_max_options=(1, 3), max_model_len=160)
        aux = (0, 1, 2)  # the residual streams entering each layer, as vLLM's EAGLE-3
    got, rate = _speculative_greedy(target, d, prompt, 24, rng, aux)
    assert got == _plain_greedy(target, prompt, 24)
    if same:
        assert rate >= 0.9, f"acceptance {rate:.2f} with the target's own weights"
    assert len(d) == 0 and d.tables.num_free_blocks == d.tables.allocator.num_blocks - 1


# ---- counters, K_max table, the CPU version of the distribution check ------------------


def test_counters_and_k_max_table(torch_layers):
    """On-device counters advance inside each round; a K_max table picks K_max by batch
    size and only its (bucket, K_max) graphs are captured."""
    s = make_setup("llama")
    d = drafter(
        s,
        k_max_options={2: 3, 4: 1},
        capture_sizes=[1, 2, 4],
        graph_backend=EagerBackend(),
        cuda_graphs=True,
        graph_modes=("greedy",),
    )
    assert [d.k_max_for(n) for n in (1, 2, 3, 4, 9)] == [3, 3, 1, 1, 1]
    assert sorted(
        (k, desc.num_reqs) for (k, _), m in d._managers.items() for desc in m.captured
    ) == [(1, 4), (3, 1), (3, 2)]
    sim = EngineSim(s, d, seed=12)
    rids = [sim.join(4) for _ in range(3)]
    ver, acc, _ = sim.inputs(rids[:2], d.width)
    out = d.propose(rids[:2], ver, acc, k=[3, 1])
    assert out.tokens.shape == (2, 3) and out.tokens[1, 1:].eq(-1).all()
    sim.commit(rids[:2])
    ver, acc, _ = sim.inputs(rids, d.width)
    with pytest.raises(ValueError, match=r"k\[0\] = 2 .* over K_max 1 .*table by batch size"):
        d.propose(rids, ver, acc, k=[2, 0, 0])
    out = d.propose(rids, ver, acc, k=[1, 0, 1])
    assert out.tokens.shape == (3, 1) and out.tokens[1, 0] == -1
    c = d.read_counters()
    assert c == {"rounds": 2, "rows": 5, "proposed_per_position": [4, 1, 1]}
    assert d.graph_rounds == 2


def chi_limit(df: int) -> float:
    return df + 10 * (2 * df) ** 0.5


def chi_square(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic with bins of expected count < 5 merged into one."""
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def draw_counts(rows: int, rounds: int, params: SamplingParams, k_max: int = 2, device="cpu", **kw):
    """A Llama draft whose attention output is zeroed, so that each step's distribution
    depends on its input token only; `rows` requests with the same context and their own
    seeds, fed the same verified token every round. Returns per position the observed
    counts and the expected counts (the sum of the filtered distributions of the
    draws), plus the drafter for inspection."""
    from dataclasses import replace

    s = make_setup("llama")
    model = s.model.to(device)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
    d = Drafter(model, max_num_reqs=rows, k_max_options=(k_max,), max_model_len=rounds + 16, **kw)
    v = d.vocab_size
    for i in range(rows):
        d.add_request(i, [5, 6, 7], replace(params, seed=1000 + i))
    # the distribution after each token, from the model itself (attention contributes 0)
    with torch.no_grad():
        from tests.model_helpers import PagedRunner

        runner = PagedRunner(s.cfg, device, max_num_reqs=v, max_num_tokens=v, max_model_len=4)
        meta = runner.step([(t, [t]) for t in range(v)])
        _, logits = model(meta.input_ids, meta, runner.cache)
        dist = filtered_probs(logits.float(), params).double().cpu().numpy()
    counts = np.zeros((k_max, v))
    expected = np.zeros((k_max, v))
    ids = list(range(rows))
    ver = torch.full((rows, 1), 9, dtype=torch.int64, device=device)
    acc = torch.zeros(rows, dtype=torch.int64, device=device)
    for _ in range(rounds):
        toks = d.propose(ids, ver, acc).tokens.cpu().numpy()
        prev = np.full(rows, 9)
        for j in range(k_max):
            np.add.at(counts[j], toks[:, j], 1)
            expected[j] += dist[prev].sum(0)
            prev = toks[:, j]
    return counts, expected, d


@pytest.mark.parametrize(
    "params",
    [SamplingParams(1.0, top_k=5), SamplingParams(0.5, top_p=0.8)],
    ids=["T1-top5", "T0.5-top0.8"],
)
def test_cpu_draft_distribution(params, torch_layers):
    """A small version of the GPU's 200k-draw check: 640 draws per position."""
    counts, expected, _ = draw_counts(16, 40, params)
    for j in range(counts.shape[0]):
        stat, df = chi_square(counts[j], expected[j])
        assert stat <= chi_limit(df), f"position {j}: chi2 {stat:.1f} with {df} df"
