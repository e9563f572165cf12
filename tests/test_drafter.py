"""The draft round (specdraft/drafter.py) on the CPU: greedy rounds against transformers
(Llama draft) and a float64 reference (EAGLE heads), committed draft KV against a
from-scratch prefill over 32 rounds with requests joining and leaving, sampled rows' q
and tokens, padding, the padded (graph) path against the unpadded eager one, the PyTorch
path of the round kernels against Triton, a transformers target driving propose(),
counters and the K_max table, a small chi-square of the draws. Bad input:
tests/test_drafter_inputs.py; the GPU: tests/test_drafter_gpu.py."""

# ruff: noqa: F811 (fixtures imported from tests/drafter_helpers.py are test arguments)
from __future__ import annotations

import random

import pytest
import torch

from specdraft.drafter import Drafter
from specdraft.sampling import DRAFT_PROPOSAL, SamplingParams, filtered_probs, sample

# The fixtures `setup` and `torch_layers` come from tests/drafter_helpers.py.
from tests.drafter_helpers import (  # noqa: F401
    MAPPED,
    EngineSim,
    chi_limit,
    chi_square,
    drafter,
    draw_counts,
    fresh_kv,
    kv_rows,
    make_setup,
    setup,
    torch_layers,
)
from tests.test_cuda_graph import EagerBackend

pytest.importorskip("transformers")
# CPU tensors through the round's Triton kernels; no overflow check: see conftest
pytestmark = [pytest.mark.interpreter, pytest.mark.no_overflow_check]

GREEDY = SamplingParams(temperature=0.0)


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


def test_prompt_graphs_equal_the_eager_prefill(setup, torch_layers):
    """add_request through (stand-in) prompt graphs: each chunk of the 16-token budget
    replays the 16-token graph, padded (a 37-token prompt is three replays). The K/V
    equals an unpadded eager prefill's, and no other block changes (padding rows and
    the capture's dummy rows write nothing)."""
    g = drafter(setup, capture_sizes=[2], graph_backend=EagerBackend(), cuda_graphs=True)
    e = drafter(setup)
    assert g.num_prompt_graphs == 1 and e.num_prompt_graphs == 0
    assert torch.count_nonzero(g.cache.data[:, :, 0]) == 0, "capture wrote the null block"
    replays = []
    replay = g.loop.prompt_graphs.replay
    g.loop.prompt_graphs.replay = lambda desc: replays.append(desc.num_tokens) or replay(desc)
    gen = torch.Generator().manual_seed(3)
    g.cache.data[:, :, 1:].normal_(generator=gen)
    for rid, n in enumerate((37, 5)):
        ids = torch.randint(0, g.vocab_size, (n,), generator=gen).tolist()
        hid = None
        if g.hidden_in:
            hid = torch.randn(n, g.hidden_in, generator=gen, dtype=g.dtype)
        before = g.cache.data.clone()
        g.add_request(rid, ids, target_hidden=hid)
        e.add_request(rid, ids, target_hidden=hid)
        length = n - g.loop.shift
        torch.testing.assert_close(kv_rows(g, rid, length), kv_rows(e, rid, length))
        others = [i for i in range(g.cache.num_blocks) if i not in g.tables.blocks_of(rid)]
        assert torch.equal(g.cache.data[:, :, others], before[:, :, others]), f"prompt of {n}"
    assert replays == [16, 16, 16, 16]


def test_steady_rounds_equal_the_full_path(setup, torch_layers):
    """Rounds that repeat the previous graph round (same ids, k, k_max and input
    addresses) take the steady path: the same drafts as an unpadded eager drafter, the
    length bounds still hold the exact lengths and the blocks cover them, and a join, a
    leave, a different k or new input tensors send the next round down the full path."""
    from specdraft.kernels import use_validation

    g = drafter(
        setup, capture_sizes=[2, 4], graph_backend=EagerBackend(), cuda_graphs=True,
        max_model_len=256,
    )  # fmt: skip
    e = drafter(setup, max_model_len=256)
    sims = [EngineSim(setup, x, seed=9) for x in (g, e)]
    rids = [[s.join(n=5) for _ in range(3)] for s in sims]
    plan = [3] * 12 + ["join"] + [3] * 6 + ["k"] * 3 + ["new"] + [3] * 20 + ["leave"] + [3] * 5
    own = [x.input_views(4) for x in (g, e)]  # inputs written in place: fixed addresses
    with use_validation(False):
        for step in plan:
            if step == "join":
                for s, rr in zip(sims, rids):
                    rr.append(s.join(n=4))
            if step == "leave":
                for s, rr in zip(sims, rids):
                    s.leave(rr.pop(0))
            before = g.steady_rounds
            outs = []
            for s, x, rr, (v, a, h) in zip(sims, (g, e), rids, own):
                ver, acc, hid = s.inputs(rr, x.width)
                b = len(rr)
                if step == "new":  # fresh tensors: another address, the full path
                    v, a, h = ver, acc, hid
                else:
                    v[:b].copy_(ver), a[:b].copy_(acc)
                    v, a = v[:b], a[:b]
                    if hid is not None:
                        h[:b].copy_(hid)
                        h = h[:b]
                k = [2] * b if step == "k" else None
                outs.append(x.propose(rr, v, a, target_hidden=hid if h is None else h, k=k))
            assert torch.equal(outs[0].tokens, outs[1].tokens), step
            steady = g.steady_rounds > before
            if step in ("join", "leave", "new"):
                assert not steady, step
            for s, x, rr in zip(sims, (g, e), rids):
                for r in rr:
                    length = len(s.context(r)[0]) - setup.shift
                    slot = x.tables.row_of(r)
                    assert int(x.buffers.base[slot]) == length
                s.commit(rr)
            st = g._steady  # steady rounds are folded into the bounds when it ends
            n, w = (st.rounds, st.w) if st is not None else (0, 0)
            for r in rids[0]:
                slot = g.tables.row_of(r)
                length = int(g.buffers.base[slot])
                lo, hi = g.lengths.lower[slot] + n, g.lengths.upper[slot] + n * w
                assert lo <= length <= hi
                assert g.tables.num_blocks_of(r) * g.block_size >= hi
    assert e.steady_rounds == 0
    assert g.steady_rounds >= 20, g.steady_rounds


def test_a_k_array_rewritten_in_place_is_read_again(setup, torch_layers):
    """k passed as one numpy array that the caller rewrites between rounds: the steady
    path must not replay the old k (an array never takes the steady path)."""
    import numpy as np

    from specdraft.kernels import use_validation

    g = drafter(setup, capture_sizes=[2], graph_backend=EagerBackend(), cuda_graphs=True)
    sim = EngineSim(setup, g, seed=3)
    rids = [sim.join(n=5) for _ in range(2)]
    ver, acc, hid = g.input_views(2)
    k = np.array([3, 3])
    with use_validation(False):
        for rnd in range(6):
            if rnd == 4:
                k[:] = 1
            v, a, h = sim.inputs(rids, g.width)
            ver.copy_(v), acc.copy_(a)
            if hid is not None:
                hid.copy_(h)
            out = g.propose(rids, ver, acc, target_hidden=hid, k=k, k_max=3)
            want = 3 if rnd < 4 else 1
            assert (out.tokens >= 0).sum(dim=1).tolist() == [want, want], rnd
            sim.commit(rids)
    assert g.steady_rounds == 0


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
                if setup.kind in MAPPED:  # q over the target vocabulary, zero elsewhere
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


# ---- the round kernels: PyTorch path against Triton -----------------------------------


def _random_buffers(seed: int, max_rows=6, width=4, k_cap=3, vocab=100, device="cpu"):
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
        rows=rows.to(device),
        table=torch.zeros(max_rows, 5, dtype=torch.int32, device=device),
        device=torch.device(device),
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


@pytest.mark.parametrize("seed", range(8))
def test_torch_round_ops_equal_triton_kernels(seed):
    """Random contents, out-of-range counts, ids and k included (both clamp alike);
    seeds 6 and 7 use 70 rows (several epilogue programs, 128-wide reductions)."""
    from specdraft.draft_round_ops import TorchDraftRound
    from specdraft.kernels.draft_round import DraftRoundKernels

    rows = 70 if seed >= 6 else 6
    b1, kw = _random_buffers(seed, max_rows=rows)
    b2, _ = _random_buffers(seed, max_rows=rows)
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


def _random_parts(seed: int, rows: int, blocks: int, vocab: int, mapped: bool):
    """Greedy-argmax partials as linear_int8_partials leaves them (block b's column in
    [b * w, (b + 1) * w)), with maxima repeated across blocks (ties: the first block's
    column wins), and their tokens by a plain loop."""
    from specdraft.kernels.draft_round import ArgmaxParts

    g = torch.Generator().manual_seed(100 + seed)
    w = -(-vocab // blocks)
    val = torch.randint(-3, 4, (rows, blocks + 2), generator=g).float()  # few values: ties
    val[:, blocks:] = 99.0  # past the blocks: never read
    idx = (torch.arange(blocks + 2) * w)[None, :] + torch.randint(0, w, (rows, blocks + 2),
                                                                   generator=g)  # fmt: skip
    idx = idx.clamp(max=vocab - 1).int()
    offsets = torch.randint(0, 50, (vocab,), generator=g) if mapped else None
    want = []
    for r in range(rows):
        best = max(val[r, :blocks].tolist())
        col = int(idx[r, val[r, :blocks].tolist().index(best)])
        want.append(col + (int(offsets[col]) if mapped else 0))
    return ArgmaxParts(val, idx, blocks, offsets), torch.tensor(want)


@pytest.mark.parametrize("seed", range(4))
def test_round_ops_finish_the_argmax_from_parts(seed):
    """advance / epilogue given a step's argmax partials: the token column they write is
    the first block's column of each row's largest maximum (mapped with an id map), and
    the rest is what the same kernels do after an argmax wrote those tokens; both paths
    alike. The kernels take PARTS_ROWS rows a program (70 rows: a partial last program)
    and read a row's blocks in chunks of up to 1024: 1100 blocks take two, with ties
    across them."""
    from specdraft.draft_round_ops import TorchDraftRound
    from specdraft.kernels.draft_round import DraftRoundKernels

    max_rows = 70 if seed >= 2 else 6
    blocks = (5, 300, 7, 1100)[seed]
    runs = []
    for path in ("parts", "tokens"):
        for impl in (DraftRoundKernels, TorchDraftRound):
            b, kw = _random_buffers(seed, max_rows=max_rows)
            o = impl(b, **kw)
            rows = max(1, min(int((b.slots >= 0).sum()) + seed % 2, max_rows))
            parts, want = _random_parts(seed, max_rows, blocks, kw["vocab_size"], seed % 3 == 0)
            o.prepare(rows)
            tok = b.tokens[: rows * 3].view(rows, 3)
            for step in (1, 2):
                if path == "parts":
                    o.advance(rows, step, 3, parts)
                    assert torch.equal(tok[:, step - 1], want[:rows]), (impl, step)
                else:
                    tok[:, step - 1] = want[:rows]
                    o.advance(rows, step, 3)
            if path == "parts":
                o.epilogue(rows, 3, parts)
            else:
                tok[:, 2] = want[:rows]
                o.epilogue(rows, 3)
            runs.append(b)
    for b in runs[1:]:
        for name in vars(b):
            assert torch.equal(getattr(b, name), getattr(runs[0], name)), name


def _fc_case(seed: int, rows: int, vocab: int):
    """An EAGLE-1 fc's operands: table [vocab, 8], hidden [rows, 8], weight [150, 16]
    (several programs of the rows kernel), bias."""
    g = torch.Generator().manual_seed(300 + seed)
    return (torch.randn(vocab, 8, generator=g), torch.randn(rows, 8, generator=g),
            torch.randn(150, 16, generator=g) / 4, torch.randn(150, generator=g))  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_embed_fc_takes_the_advance_bit_for_bit(seed):
    """embed_fc with a round's advance folded in (DraftRoundKernels.advance_fold): fc's
    output and every round buffer (the step's inputs, cur_pos, the token table filled
    from partials) equal the advance kernel followed by embed_fc, steps 1 and 2, from
    partials (odd seeds) or from the token table; padding and capture rows included."""
    from specdraft import kernels
    from specdraft.kernels.draft_round import DraftRoundKernels

    outs, bufs = [], []
    for fold in (False, True):
        b, kw = _random_buffers(seed, max_rows=6)
        o = DraftRoundKernels(b, **kw)
        rows = max(1, min(int((b.slots >= 0).sum()) + seed % 2, 6))
        parts = None
        if seed % 2:
            parts, _ = _random_parts(seed, 6, 300, kw["vocab_size"], seed == 1)
        table, hidden, w, bias = _fc_case(seed, rows, kw["vocab_size"])
        o.prepare(rows)
        ys = []
        for step in (1, 2):
            ids = b.d_ids[:rows]
            if fold:
                adv = o.advance_fold(rows, step, 3, parts)
                ys.append(kernels.embed_fc(ids, table, hidden, w, bias, advance=adv))
            else:
                o.advance(rows, step, 3, parts)
                ys.append(kernels.embed_fc(ids, table, hidden, w, bias))
        outs.append(ys)
        bufs.append(b)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    for name in vars(bufs[0]):
        assert torch.equal(getattr(bufs[0], name), getattr(bufs[1], name)), name


def test_embed_fc_refuses_a_bad_advance_before_any_write():
    """An advance that is not an AdvanceFold, or ids that are not its own d_ids: the
    exception naming the argument, every round buffer as it was."""
    from specdraft import kernels
    from specdraft.kernels.draft_round import DraftRoundKernels

    b, kw = _random_buffers(0, max_rows=6)
    o = DraftRoundKernels(b, **kw)
    o.prepare(6)
    table, hidden, w, bias = _fc_case(0, 6, kw["vocab_size"])
    adv = o.advance_fold(6, 1, 3)
    before = {name: t.clone() for name, t in vars(b).items() if isinstance(t, torch.Tensor)}
    with pytest.raises(TypeError, match="advance must be an AdvanceFold"):
        kernels.embed_fc(b.d_ids[:6], table, hidden, w, bias, advance=(6, 1, 3))
    with pytest.raises(ValueError, match="ids must be the advance's own d_ids"):
        kernels.embed_fc(b.d_ids[:6].clone(), table, hidden, w, bias, advance=adv)
    with pytest.raises(ValueError, match="ids must be the advance's own d_ids"):
        kernels.embed_fc(b.d_ids[:5], table, hidden[:5], w, bias, advance=adv)
    with pytest.raises(ValueError, match="step 3 must be in"):
        o.advance_fold(6, 3, 3)
    for name, t in before.items():
        assert torch.equal(getattr(b, name), t), name


def _bad_parts(case: str, parts):
    """`parts` (6 rows, 5 blocks, an id map) with one field broken as `case` says."""
    from dataclasses import replace

    from specdraft.kernels.draft_round import ArgmaxParts

    v, i = parts.val, parts.idx
    return {
        "a tuple": lambda: (v, i, parts.blocks),
        "val float64": lambda: replace(parts, val=v.double()),
        "val 1-D": lambda: replace(parts, val=v[:, 0].contiguous()),
        "val rows": lambda: replace(parts, val=v[:2]),
        "val strided": lambda: replace(parts, val=v.t().contiguous().t()),
        "idx int64": lambda: replace(parts, idx=i.long()),
        "idx blocks": lambda: replace(parts, idx=i[:, :3].contiguous()),
        "idx row stride": lambda: replace(parts, idx=torch.zeros(6, 40, dtype=torch.int32)),
        "blocks 0": lambda: ArgmaxParts(v, i, 0, parts.offsets),
        "blocks bool": lambda: ArgmaxParts(v, i, True, parts.offsets),
        "blocks str": lambda: ArgmaxParts(v, i, "5", parts.offsets),
        "offsets int32": lambda: replace(parts, offsets=parts.offsets.int()),
    }[case]()


BAD_PARTS = [
    ("a tuple", TypeError, r"\bparts must"), ("val float64", TypeError, r"parts\.val"),
    ("val 1-D", TypeError, r"parts\.val"), ("val rows", ValueError, r"parts\.val"),
    ("val strided", ValueError, r"parts\.val"), ("idx int64", TypeError, r"parts\.idx"),
    ("idx blocks", ValueError, r"parts\.idx"), ("idx row stride", ValueError, r"parts\.idx"),
    ("blocks 0", ValueError, r"parts\.blocks"), ("blocks bool", ValueError, r"parts\.blocks"),
    ("blocks str", ValueError, r"parts\.blocks"), ("offsets int32", ValueError, r"parts\.offsets"),
]  # fmt: skip


@pytest.mark.parametrize("impl", ["kernels", "torch"])
@pytest.mark.parametrize("case, exc, match", BAD_PARTS, ids=[c[0] for c in BAD_PARTS])
def test_bad_argmax_parts_are_refused_before_any_write(case, exc, match, impl):
    """advance / epilogue given broken partials: the exception type, a message naming the
    field, and every round buffer as it was."""
    from specdraft.draft_round_ops import TorchDraftRound
    from specdraft.kernels.draft_round import DraftRoundKernels

    b, kw = _random_buffers(0, max_rows=6)
    o = (DraftRoundKernels if impl == "kernels" else TorchDraftRound)(b, **kw)
    parts, _ = _random_parts(0, 6, 5, kw["vocab_size"], True)
    o.prepare(6)
    before = {name: t.clone() for name, t in vars(b).items() if isinstance(t, torch.Tensor)}
    bad = _bad_parts(case, parts)
    with pytest.raises(exc, match=match):
        o.advance(6, 1, 3, bad)
    with pytest.raises(exc, match=match):
        o.epilogue(6, 3, bad)
    for name, t in before.items():
        assert torch.equal(getattr(b, name), t), name


def _sources(seed: int, n: int, w: int, h: int, in_place: tuple, device="cpu", dtype=None):
    """Round inputs in awkward layouts (int32 with a row stride, int64 with stride 2,
    hidden states permuted), None where in place."""
    g = torch.Generator(device=device).manual_seed(200 + seed)
    ver = torch.randint(-3, 105, (n, w + 3), generator=g, device=device, dtype=torch.int32)
    ver = ver[:, 1 : w + 1]
    acc = torch.randint(-1, w + 1, (2 * n,), generator=g, device=device)[::2]
    hid = torch.randn(w, h, n, generator=g, device=device).to(dtype or torch.float32)
    hid = hid.permute(2, 0, 1)  # strides (1, h * n, n)
    return tuple(None if skip else t for t, skip in zip((ver, acc, hid), in_place))


def check_prepare_reads_sources(seed: int, device="cpu", dtype=torch.float32, h=24):
    """prepare given the inputs' addresses (sources(), uploaded into buffers.src) against
    prepare after the same inputs were copied into the buffers by hand: every buffer and
    the hidden buffer equal, on both paths, twice (new contents in the same tensors the
    second time; for seeds 1 and 5 sources one column narrower than buffers.width).
    Returns the number of rows read from sources."""
    from specdraft.draft_round_ops import TorchDraftRound
    from specdraft.kernels.draft_round import DraftRoundKernels

    max_rows = 70 if seed >= 6 else 6
    in_place = [(False,) * 3, (True, False, False), (False, True, True), (False, False, True)]
    in_place = in_place[seed % 4]
    runs = []
    for impl in (DraftRoundKernels, TorchDraftRound):
        for by_hand in (False, True):
            b, kw = _random_buffers(seed, max_rows=max_rows, device=device)
            w = int(b.width[0])
            if seed in (1, 5) and w > 1:  # sources narrower than the round's width: the
                w -= 1  # rest of each row is what the buffer held
            n = int((b.slots >= 0).sum())  # the real rows (padding rows sit at the tail)
            rows = max(1, min(n + seed % 2, max_rows))  # padded or not
            hid_buf = torch.full((max_rows * kw["width"], h), -7.0, device=device).to(dtype)
            o = impl(b, hidden=hid_buf, **kw)
            src = _sources(seed, n, w, h, in_place, device, dtype)
            for again in range(2):
                if by_hand:
                    if src[0] is not None:
                        b.verified[:n, :w] = src[0]
                    if src[1] is not None:
                        b.accepted[:n] = src[1]
                    if src[2] is not None:
                        hid_buf.view(max_rows, kw["width"], h)[:n, :w] = src[2]
                    b.src.copy_(torch.from_numpy(o.sources(None, None)))
                elif again == 0:  # the fields are the same whether checked here or not
                    f = o.sources(*src, checked=True)
                    assert (f == o.sources(*src)).all()
                    b.src.copy_(torch.from_numpy(f))
                o.prepare(rows)
                runs.append([t.clone() for t in vars(b).values()] + [hid_buf.clone()])
                for t in src:  # new contents, same tensors
                    if t is not None:
                        t.copy_((t.double() * 3 + 1).to(t.dtype))
            if not by_hand and impl is DraftRoundKernels:
                assert int(b.src[0]) == n  # the rows read from their sources
    names = [*vars(b), "hidden"]
    # runs: kernels from sources (calls 0, 1), kernels by hand (2, 3), then the same two
    # on the PyTorch path (4 .. 7): every call against the kernels' by-hand twin
    for k in range(2):
        want = runs[2 + k]
        for got in (runs[k], runs[4 + k], runs[6 + k]):
            for name, x, y in zip(names, want, got):
                if name != "src":
                    assert torch.equal(x, y), (seed, k, name)
    return n


@pytest.mark.parametrize("seed", range(8))
def test_prepare_reads_the_inputs_where_they_are(seed):
    """The round's inputs taken from the engine's tensors (int32 / int64, strided,
    permuted hidden states; some in place), copied into the buffers by prepare: the same
    buffers as copying them by hand first, on both paths; 70 rows for seeds 6 and 7."""
    check_prepare_reads_sources(seed)


BAD_SOURCES = [
    ("verified float", TypeError, "verified"), ("verified 1-D", TypeError, "verified"),
    ("verified wide", ValueError, "verified has width 5"),
    ("verified rows", ValueError, "accepted has 3 rows, verified 2"),
    ("accepted 2-D", TypeError, "accepted"), ("accepted rows", ValueError, "accepted"),
    ("hidden width", ValueError, "hidden has width 1"), ("hidden list", TypeError, "hidden"),
    ("hidden dtype", TypeError, "hidden"), ("hidden features", ValueError, "hidden has 9"),
    ("too many rows", ValueError, "verified has 7 rows"),
]  # fmt: skip


@pytest.mark.parametrize("impl", ["kernels", "torch"])
@pytest.mark.parametrize("case, exc, match", BAD_SOURCES, ids=[c[0] for c in BAD_SOURCES])
def test_bad_round_sources_are_refused_before_any_change(case, exc, match, impl):
    """sources() given a broken input: the exception type, a message naming it, every
    round buffer and the hidden buffer as they were, and the sources kept before."""
    from specdraft.draft_round_ops import TorchDraftRound
    from specdraft.kernels.draft_round import DraftRoundKernels

    b, kw = _random_buffers(1, max_rows=6, width=4)
    hid_buf = torch.randn(24, 8)
    o = (DraftRoundKernels if impl == "kernels" else TorchDraftRound)(b, hidden=hid_buf, **kw)
    ver, acc, hid = _sources(1, 2, 2, 8, (False,) * 3)
    o.sources(ver, acc, hid)
    kept = getattr(o, "_src", None)
    ver, acc, hid = _sources(1, 3, 2, 8, (False,) * 3)
    args = {
        "verified float": (ver.float(), acc, hid),
        "verified 1-D": (ver[:, 0], acc, hid),
        "verified wide": (torch.zeros(3, 5, dtype=torch.long), acc, None),
        "verified rows": (ver[:2], acc, hid),
        "accepted 2-D": (ver, acc[:, None], hid),
        "accepted rows": (ver, acc[:2], hid),
        "hidden width": (ver, acc, hid[:, :1]),
        "hidden list": (ver, acc, hid.tolist()),
        "hidden dtype": (ver, acc, hid.double()),
        "hidden features": (ver, acc, torch.zeros(3, 2, 9)),
        "too many rows": (torch.zeros(7, 2, dtype=torch.long), None, None),
    }[case]
    before = {k: t.clone() for k, t in vars(b).items()}
    hid_before = hid_buf.clone()
    with pytest.raises(exc, match=match):
        o.sources(*args)
    for k, t in before.items():
        assert torch.equal(getattr(b, k), t), k
    assert torch.equal(hid_buf, hid_before)
    assert getattr(o, "_src", None) is kept


@pytest.mark.parametrize("impl", ["kernels", "torch"])
def test_bad_hidden_buffers_are_refused(impl):
    """The round ops' hidden buffer: a list, 1-D, transposed (not contiguous) or too few
    rows is refused naming hidden; a round built without one refuses hidden sources."""
    from specdraft.draft_round_ops import TorchDraftRound
    from specdraft.kernels.draft_round import DraftRoundKernels

    cls = DraftRoundKernels if impl == "kernels" else TorchDraftRound
    b, kw = _random_buffers(2, max_rows=6, width=4)
    for bad, exc in (
        ([[0.0] * 8] * 24, TypeError),
        (torch.zeros(24 * 8), TypeError),
        (torch.zeros(8, 24).t(), TypeError),
        (torch.zeros(23, 8), ValueError),
    ):
        with pytest.raises(exc, match="hidden"):
            cls(b, hidden=bad, **kw)
    o = cls(b, **kw)
    before = {k: t.clone() for k, t in vars(b).items()}
    with pytest.raises(ValueError, match="hidden is for EAGLE heads"):
        o.sources(None, None, torch.zeros(2, 2, 8))
    for k, t in before.items():
        assert torch.equal(getattr(b, k), t), k


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


@pytest.mark.parametrize(
    "params",
    [SamplingParams(1.0, top_k=5), SamplingParams(0.5, top_p=0.8)],
    ids=["T1-top5", "T0.5-top0.8"],
)
def test_cpu_draft_distribution(params, torch_layers):
    """A small version of the GPU's 200k-draw check: 640 draws per position."""
    counts, expected, dist, d = draw_counts(16, 40, params)
    q = d.propose(list(range(16)), torch.full((16, 1), 9), torch.zeros(16, dtype=torch.int64)).q
    torch.testing.assert_close(
        q[:, 0], torch.from_numpy(dist[9]).float().expand(16, -1), atol=1e-6, rtol=1e-5
    )
    for j in range(counts.shape[0]):
        stat, df = chi_square(counts[j], expected[j])
        assert stat <= chi_limit(df), f"position {j}: chi2 {stat:.1f} with {df} df"


def test_reused_slot_carries_nothing_over(setup, torch_layers):
    """With one slot, a request that follows another in it (different parameters, k,
    length) drafts exactly what it drafts in a fresh drafter; zero-copy inputs written
    into input_views() give the same round as copied ones."""
    old = SamplingParams(1.2, top_k=7, seed=3)
    new = SamplingParams(0.7, seed=4)
    used = drafter(setup, max_num_reqs=1)
    sim = EngineSim(setup, used, seed=13)
    r = sim.join(11, old, 1)
    for _ in range(3):
        ver, acc, hid = sim.inputs([r], used.width)
        used.propose([r], ver, acc, target_hidden=hid)
        sim.commit([r])
    sim.leave(r)
    fresh = drafter(setup, max_num_reqs=1)
    sims = [EngineSim(setup, x, seed=14) for x in (used, fresh)]
    outs = []
    for s, x in zip(sims, (used, fresh)):
        rid = s.join(5, new, 3)
        assert x.tables.row_of(rid) == 0
        ver, acc, hid = s.inputs([rid], x.width)
        if x is used:  # the engine writes straight into the drafter's input buffers
            v, a, h = x.input_views(1, x.width)
            v.copy_(ver), a.copy_(acc)
            if h is not None:
                h.copy_(hid)
            ver, acc, hid = v, a, h
        outs.append(x.propose([rid], ver, acc, target_hidden=hid))
    assert torch.equal(outs[0].tokens, outs[1].tokens) and (outs[0].tokens >= 0).all()
    assert torch.equal(outs[0].q, outs[1].q)


@torch.no_grad()
def test_sampled_rounds_through_the_rejection_sampler(torch_layers):
    """propose()'s outputs feed specdraft.rejection as they are, and its outputs feed the
    next propose(): with a draft that has the target's weights, q equals the verifier's
    p for every draft, so nearly every sampled draft is accepted."""
    from specdraft.rejection import RejectionSampler
    from specdraft.sampling import TARGET_SAMPLE, SamplingTensors

    s = make_setup("llama")
    target = _hf_llama(s.cfg, s.weights)
    d = drafter(s, k_max_options=(3,))
    params = [
        SamplingParams(0.8, seed=1),
        SamplingParams(1.0, top_k=20, seed=2),
        SamplingParams(0.7, top_p=0.9, seed=3),
    ]
    rows = SamplingTensors.from_params(params, "cpu")
    rej = RejectionSampler(3, 3, d.vocab_size, "cpu")
    rng = random.Random(6)
    seqs = []
    for i, p in enumerate(params):
        prompt = [rng.randrange(d.vocab_size) for _ in range(5 + 3 * i)]
        d.add_request(i, prompt, p)
        logits = target(torch.tensor([prompt])).logits[0, -1:]
        first = sample(logits, [p], torch.tensor([len(prompt)]), TARGET_SAMPLE)
        seqs.append(prompt + first.tolist())
    ver = torch.tensor([[q[-1], -1, -1, -1] for q in seqs])
    acc = torch.zeros(3, dtype=torch.int32)
    drafted = accepted = 0
    for _ in range(8):
        prop = d.propose([0, 1, 2], ver, acc)
        logits = []
        for b, q in enumerate(seqs):
            drafts = prop.tokens[b].clamp(min=0).tolist()
            full = target(torch.tensor([q + drafts])).logits[0]
            logits.append(full[len(q) - 1 : len(q) + 3])
        pos = torch.tensor([len(q) for q in seqs])
        out = rej(torch.cat(logits), prop.tokens, prop.q, rows, pos)
        for b in range(3):
            seqs[b] += out.tokens[b, : int(out.num_emitted[b])].tolist()
        drafted, accepted = drafted + 9, accepted + int(out.num_accepted.sum())
        ver, acc = out.tokens, out.num_accepted
    assert accepted / drafted >= 0.9, f"acceptance {accepted}/{drafted}"


def test_eagle3_q_over_draft_or_target_vocabulary(torch_layers):
    """q_vocab="draft" gives q over the draft vocabulary, column d standing for target id
    q_token_ids[d]; "target" the same numbers scattered there, zeros elsewhere."""
    s = make_setup("eagle3")
    outs = []
    for q_vocab in ("target", "draft"):
        d = drafter(s, q_vocab=q_vocab)
        sim = EngineSim(s, d, seed=15)
        rids = [sim.join(6, SamplingParams(0.9, top_k=30, seed=i)) for i in range(2)]
        ver, acc, hid = sim.inputs(rids, d.width)
        outs.append((d, d.propose(rids, ver, acc, target_hidden=hid)))
    (dt, pt), (dd, pd) = outs
    assert pt.q.shape[-1] == dt.vocab_size == 128 and pd.q.shape[-1] == 80
    assert torch.equal(pt.tokens, pd.tokens)
    assert torch.equal(pt.q[:, :, dd.q_token_ids], pd.q)
    assert torch.isin(pt.tokens, dd.q_token_ids).all(), "drafts are target ids of the draft vocab"


def test_round_graphs_need_ops_that_read_their_inputs_in_the_graph():
    """A real CUDA graph of the round needs prepare to read the inputs through their
    addresses (the Triton kernels). The PyTorch path copies tensors it holds as Python
    objects, which a graph would replay from its capture: its rounds run eagerly, and
    cuda_graphs=True is refused naming it. A stand-in backend (runs the work anew) and
    cuda_graphs off are left as asked."""
    from specdraft.draft_round_ops import TorchDraftRound
    from specdraft.drafter import _round_graphs
    from specdraft.kernels.draft_round import DraftRoundKernels

    assert _round_graphs(True, None, None, DraftRoundKernels) is True
    assert _round_graphs(True, True, None, DraftRoundKernels) is True
    assert _round_graphs(True, None, None, TorchDraftRound) is False
    with pytest.raises(ValueError, match="cuda_graphs=True needs the Triton round kernels"):
        _round_graphs(True, True, None, TorchDraftRound)
    assert _round_graphs(True, True, EagerBackend(), TorchDraftRound) is True
    assert _round_graphs(False, False, None, TorchDraftRound) is False
