"""The draft round on the GPU (bf16, CUDA graphs): every captured graph against the eager
round, bit for bit (captured largest first and shuffled; A, B, then A again); no host
synchronisation in 100 rounds; the host enqueues 100 rounds before the GPU has run 10;
10^4 rounds without memory growth; capture time; the 200k-draw distribution."""

from __future__ import annotations

import random
import statistics
import time

import pytest
import torch

from specdraft.draft_buffers import SamplingMode
from specdraft.drafter import Drafter
from specdraft.models.tiny import (
    eagle_config,
    llama_68m_config,
    random_causal_lm,
    random_eagle3_head,
    random_eagle_head,
)
from specdraft.sampling import SamplingParams
from tests.drafter_helpers import (
    KINDS,
    DraftSetup,
    EngineSim,
    chi_limit,
    chi_square,
    draw_counts,
    kv_rows,
)
from tests.drafter_helpers import tiny as tiny_cfg

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0)
MODE_PARAMS = {
    SamplingMode.GREEDY: lambda i: GREEDY,
    SamplingMode.SAMPLE: lambda i: SamplingParams(0.9, seed=100 + i),
    SamplingMode.FILTER: lambda i: SamplingParams(0.8, top_k=40, top_p=0.9, seed=200 + i),
}


def gpu_setup(kind: str, dtype=torch.bfloat16) -> DraftSetup:
    cfg = tiny_cfg(
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        vocab_size=1000,
        max_position_embeddings=2048,
        dtype=dtype,
    )
    if kind == "llama":
        return DraftSetup(kind, random_causal_lm(cfg, seed=1, device="cuda"), cfg, {})
    if kind in ("eagle", "eagle_vocab"):
        target = random_causal_lm(cfg, seed=2, device="cuda")
        head_cfg = eagle_config(cfg)
        head = random_eagle_head(head_cfg, target, seed=3)
        if kind == "eagle_vocab":
            g = torch.Generator().manual_seed(4)
            head.reduce_vocab(torch.randperm(cfg.vocab_size, generator=g)[:500])
        return DraftSetup(kind, head, head_cfg, {}, target)
    head_cfg = eagle_config(cfg, draft_vocab_size=500)
    return DraftSetup(kind, random_eagle3_head(head_cfg, seed=3, device="cuda"), head_cfg, {})


def _poison(d: Drafter, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    d.cache.data[:, :, 1:].normal_(generator=g)


@pytest.mark.parametrize(
    "order_seed, unfold",
    [(None, False), (5, False), (None, True)],
    ids=["largest_first", "shuffled", "eager_unfolded"],
)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_replay_equals_eager_for_every_graph(kind, order_seed, unfold, monkeypatch):
    """Two drafters with the same history; one replays each round's graph, the other
    runs the same round eagerly at the same padding. Tokens, q and the whole KV cache
    agree bit for bit, for every (bucket, K_max, mode) graph, in shuffled order and once
    more for the first graph after all the others. unfold (EAGLE-1 heads with an int8
    lm_head, whose greedy steps leave partials): the eager rounds launch each decode
    step's advance alone, where the graphs have it inside fc's launch
    (EagleHead.forward), so the fold and the PDL reads it moves are checked."""
    from specdraft import kernels
    from specdraft.layers import quantize_lm_head

    if unfold and kind not in ("eagle", "eagle_vocab"):
        pytest.skip("the advance folds into EAGLE-1's fc only")
    s = gpu_setup(kind)
    if unfold:
        quantize_lm_head(s.model)
    kw = dict(
        max_num_reqs=8,
        k_max_options=(1, 3),
        capture_sizes=[1, 2, 4, 8],
        max_model_len=1024,
        seed=0,
        capture_now=False,
    )
    g, e = Drafter(s.model, **kw), Drafter(s.model, **kw)
    g.capture(order_seed)
    e.capture()
    assert g.num_graphs == 4 * 2 * 3
    assert torch.count_nonzero(g.cache.data[:, :, 0]) == 0, "capture wrote the null block"
    for x in (g, e):
        _poison(x, 7)
    rng = random.Random(3)
    descs = [(r, k, m) for r in (1, 2, 4, 8) for k in (1, 3) for m in SamplingMode]
    rng.shuffle(descs)
    sims = [EngineSim(s, x, seed=11) for x in (g, e)]
    for n, (rows, k_max, mode) in enumerate(descs + descs[:1]):
        b = rows - (rows > 1 and rng.random() < 0.5)  # padded half of the time
        lens = [rng.randint(3, 40) for _ in range(b)]
        rids = []
        for sim in sims:  # the same requests for both drafters
            for r in list(sim.seqs):
                sim.leave(r)
            rids.append([sim.join(n, MODE_PARAMS[mode](i)) for i, n in enumerate(lens)])
        for _ in range(2):
            before = g.graph_rounds
            outs = []
            for sim, x, rr, eager in zip(sims, (g, e), rids, (False, True)):
                ver, acc, hid = sim.inputs(rr, x.width)
                with monkeypatch.context() as mp:
                    if eager and unfold:
                        mp.setattr(kernels, "late_meta_supported", lambda rows: False)
                    outs.append(
                        x.propose(rr, ver, acc, target_hidden=hid, k_max=k_max, eager=eager)
                    )
                sim.commit(rr)
            assert g.graph_rounds == before + 1, f"({rows}, {k_max}, {mode}) was not replayed"
            (tg, qg), (te, qe) = outs
            assert torch.equal(tg, te), f"graph {n} ({rows}, {k_max}, {mode.name}): tokens"
            assert (qg is None) == (qe is None) == (mode is SamplingMode.GREEDY)
            if qg is not None:
                assert torch.equal(qg, qe), f"graph {n} ({rows}, {k_max}, {mode.name}): q"
                assert torch.isfinite(qg).all()
            assert torch.equal(g.cache.data, e.cache.data), f"graph {n}: KV cache"
    assert torch.count_nonzero(g.cache.data[:, :, 0]) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_gpu_prompt_prefill_replays_a_graph_per_chunk(kind):
    """add_request's prompt prefill replays the smallest prompt graph that holds each
    chunk (a 700-token prompt is two chunks of the 512-token budget). The K/V it writes
    equals the eager prefill's up to the bf16 rounding of a differently padded GEMM (a
    few units in the last place; a wrong row, position or state is off by O(1)), and
    every other block of the cache keeps its bits (padding rows write nothing). Units
    are those of each head's largest element: the eager prefill of a short prompt takes
    the fused path, which rotates k in float32 before its one rounding, the graph's
    unfused path rounds the projection first, and the rotation's cancellations leave
    small elements off by a unit of their head's larger ones."""
    s = gpu_setup(kind)
    kw = dict(max_num_reqs=4, k_max_options=(3,), capture_sizes=[1, 4], max_model_len=2048)
    g, e = Drafter(s.model, seed=0, **kw), Drafter(s.model, seed=0, cuda_graphs=False, **kw)
    assert g.num_prompt_graphs == 6 and e.num_prompt_graphs == 0  # 16 ... 512 tokens
    replays = []
    replay = g.loop.prompt_graphs.replay
    g.loop.prompt_graphs.replay = lambda desc: replays.append(desc.num_tokens) or replay(desc)
    for x in (g, e):
        _poison(x, 7)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for rid, n in enumerate((5, 40, 700)):
        ids = torch.randint(0, s.cfg.vocab_size, (n,), generator=gen, device="cuda").tolist()
        hid = None
        if g.hidden_in:
            hid = torch.randn(n, g.hidden_in, device="cuda", dtype=g.dtype, generator=gen)
        before = g.cache.data.clone()
        g.add_request(rid, ids, target_hidden=hid)
        e.add_request(rid, ids, target_hidden=hid)
        length = n - g.loop.shift
        kg, ke = kv_rows(g, rid, length).float(), kv_rows(e, rid, length).float()
        assert torch.isfinite(kg).all()
        ulp = 2.0**-8 * ke.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-6)
        worst = ((kg - ke).abs() / ulp).max().item()
        assert worst <= 8, f"prompt of {n}: graph K/V off the eager one by {worst:.1f} ulp"
        others = torch.ones(g.cache.data.shape[2], dtype=torch.bool)
        others[g.tables.blocks_of(rid)] = False
        a, b = before[:, :, others], g.cache.data[:, :, others]
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"prompt of {n}"
    assert replays == [16, 64, 512, 256]


def _busy_drafter(kind: str, rows: int, k_max: int, rounds: int, **kw):
    s = gpu_setup(kind)
    d = Drafter(
        s.model,
        max_num_reqs=rows,
        k_max_options=(k_max,),
        capture_sizes=[rows],
        max_model_len=2048,
        **kw,
    )
    sim = EngineSim(s, d, seed=5)
    modes = list(MODE_PARAMS.values())
    rids = [sim.join(12, modes[i % 3](i)) for i in range(rows)]
    for r in rids:
        assert d.reserve(r, 12 + (rounds + 8) * d.width)  # no block growth in the loop
    g = torch.Generator(device="cuda").manual_seed(0)
    w = d.width
    ins = [
        (
            torch.randint(0, d.vocab_size, (rows, w), device="cuda", generator=g),
            torch.randint(0, w, (rows,), device="cuda", generator=g),
            None
            if d.hidden_in == 0
            else torch.randn(rows, w, d.hidden_in, device="cuda", dtype=d.dtype, generator=g),
        )
        for _ in range(rounds)
    ]
    return d, rids, ins


@pytest.mark.parametrize("eager", [False, True], ids=["graph", "eager"])
@pytest.mark.parametrize("kind", ["llama", "eagle3"])
def test_gpu_100_rounds_never_synchronise(kind, eager):
    d, rids, ins = _busy_drafter(kind, 6, 3, 102)
    for ver, acc, hid in ins[:2]:  # warm-up
        d.propose(rids, ver, acc, target_hidden=hid, eager=eager)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for ver, acc, hid in ins[2:]:
            out = d.propose(rids, ver, acc, target_hidden=hid, eager=eager)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(out.q).all() and out.tokens.min() >= 0
    assert d.loop.stage.ring.waits == 0


@pytest.mark.parametrize("kind", ["llama", "eagle"])
def test_gpu_steady_rounds_equal_the_full_path_and_never_synchronise(kind):
    """Rounds that repeat the last one (the same input tensors, rewritten in place) take
    the steady path: no host sync over 60 rounds, and the same tokens and q, round for
    round, as a twin drafter given a fresh copy of the inputs every round (full path)."""
    a, rids, ins = _busy_drafter(kind, 6, 3, 70)
    b, _, _ = _busy_drafter(kind, 6, 3, 70)
    src = [tuple(None if t is None else t.clone() for t in x) for x in ins[:60]]
    fixed = tuple(None if t is None else t.clone() for t in src[0])
    outs_a, outs_b, kept = [], [], []
    for i, (ver, acc, hid) in enumerate(src):
        if i == 2:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            for t, s_ in zip(fixed, (ver, acc, hid)):
                if t is not None:
                    t.copy_(s_)
            out = a.propose(rids, fixed[0], fixed[1], target_hidden=fixed[2])
            outs_a.append((out.tokens.clone(), out.q.clone()))
        finally:
            if i == len(src) - 1:
                torch.cuda.set_sync_debug_mode("default")
        fresh = [None if t is None else t.clone() for t in (ver, acc, hid)]
        kept.append(fresh)  # alive: a freed copy's address could come back next round
        out = b.propose(rids, fresh[0], fresh[1], target_hidden=fresh[2])
        outs_b.append((out.tokens.clone(), out.q.clone()))
    torch.cuda.synchronize()
    assert a.steady_rounds >= 50 and b.steady_rounds == 0, (a.steady_rounds, b.steady_rounds)
    for i, ((ta, qa), (tb, qb)) in enumerate(zip(outs_a, outs_b)):
        assert torch.equal(ta, tb) and torch.equal(qa, qb), f"round {i}"


def test_gpu_host_time_per_round_is_a_fraction_of_the_gpu_time():
    """Nothing in a round waits for the GPU: with a llama-68m-shaped draft at batch 64
    and K = 7 (sampled with top-k), the host's time to enqueue a round, measured with the
    GPU idle (so that the driver's bounded launch queue cannot stall it: a host 100
    rounds ahead is throttled by it, whatever the runtime does), is under a quarter of
    the GPU's time per round."""
    model = random_causal_lm(llama_68m_config(), seed=0, device="cuda", max_positions=2048)
    rows, rounds = 64, 115
    d = Drafter(
        model,
        max_num_reqs=rows,
        k_max_options=(7,),
        capture_sizes=[rows],
        graph_modes=("filter",),
        max_model_len=2048,
    )
    rids = [f"r{i}" for i in range(rows)]
    for i, r in enumerate(rids):
        d.add_request(r, list(range(1, 65)), SamplingParams(0.8, top_k=50, seed=i))
        assert d.reserve(r, 64 + (rounds + 2) * d.width)
    ver = torch.randint(0, 32000, (rows, d.width), device="cuda")
    acc = torch.randint(0, d.width, (rows,), device="cuda")
    for _ in range(3):
        d.propose(rids, ver, acc)
    host = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        d.propose(rids, ver, acc)
        host.append(time.perf_counter() - t0)
    host_s = statistics.median(host)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        d.propose(rids, ver, acc)
    end.record()
    end.synchronize()
    gpu10_s = start.elapsed_time(end) / 1e3
    print(f"host: {host_s * 1e6:.1f} us per round (median); GPU: {gpu10_s * 1e5:.1f} us")
    assert host_s < gpu10_s / 10 / 4
    assert d.loop.stage.ring.waits == 0


def test_gpu_10k_rounds_without_memory_growth():
    d, rids, ins = _busy_drafter("eagle3", 4, 3, 4)

    def cycle(n: int) -> None:
        nonlocal rids
        for i in range(n):
            if i % 100 == 99:  # requests leave and new ones take their slots
                for j, r in enumerate(rids):
                    d.remove_request(r)
                    hid = None if d.hidden_in == 0 else ins[0][2][j]
                    d.add_request(
                        r,
                        list(range(1, d.width + 1)),
                        MODE_PARAMS[SamplingMode(j % 3)](j),
                        target_hidden=hid,
                    )
            ver, acc, hid = ins[i % len(ins)]
            d.propose(rids, ver, acc, target_hidden=hid)

    cycle(300)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    cycle(10_000)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.memory_reserved() == reserved
    assert len(d.lengths._pending) <= 2 and len(d._views) <= 8


def test_gpu_capture_time():
    """Every round graph of a llama-68m-shaped draft for 64 requests with a K_max table
    (9 buckets x 3 sampling modes) in at most 5 s, at most 0.2 s each, compile cache warm;
    and every K_max in {1, 3, 5, 7} for every bucket at most 0.2 s per graph."""
    model = random_causal_lm(llama_68m_config(), seed=0, device="cuda", max_positions=4096)
    table = {1: 7, 8: 5, 32: 3, 64: 1}
    kw = dict(max_num_reqs=64, max_model_len=4096)
    Drafter(model, k_max_options=(1, 3, 5, 7), **kw).teardown()  # compiles every kernel
    d = Drafter(model, k_max_options=table, **kw)
    n = d.num_graphs
    print(f"K_max table: {n} graphs in {d.capture_seconds:.2f} s")
    assert n == 9 * 3
    assert d.capture_seconds <= 5.0 and d.capture_seconds / n <= 0.2
    d.teardown()
    d = Drafter(model, k_max_options=(1, 3, 5, 7), **kw)
    print(f"every K_max: {d.num_graphs} graphs in {d.capture_seconds:.2f} s")
    assert d.capture_seconds / d.num_graphs <= 0.2
    d.teardown()


DIST_CASES = [
    SamplingParams(0.5, top_k=1),
    SamplingParams(0.5, top_k=5),
    SamplingParams(1.0, top_k=1),
    SamplingParams(1.0, top_k=5),
    SamplingParams(1.0, top_p=0.8),
    SamplingParams(0.5, top_p=0.8),
]


@pytest.mark.parametrize(
    "params", DIST_CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}"
)
def test_gpu_draft_distribution_200k(params):
    """Per draft position, 204,800 draws (256 requests x 800 rounds) against the exact
    filtered softmax: chi-square below df + 10 sqrt(2 df) with low-count bins merged;
    q of position 0 equals that distribution."""
    counts, expected, dist, d = draw_counts(
        256, 800, params, k_max=3, device="cuda", capture_sizes=[256]
    )
    assert counts.sum(1).tolist() == [204_800] * 3
    for j in range(3):
        stat, df = chi_square(counts[j], expected[j])
        assert stat <= chi_limit(df), f"position {j}: chi2 {stat:.1f} with {df} df"
    ids = list(range(256))
    q = d.propose(
        ids,
        torch.full((256, 1), 9, device="cuda"),
        torch.zeros(256, dtype=torch.int64, device="cuda"),
    ).q
    ref = torch.from_numpy(dist[9]).float().cuda().expand(256, -1)
    torch.testing.assert_close(q[:, 0], ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("seed", [0, 2, 5, 7])
def test_gpu_prepare_reads_the_inputs_where_they_are(seed):
    """prepare on the GPU reading the round's inputs from the engine's tensors (int32
    with a row stride, int64 with stride 2, EAGLE-3-wide bf16 hidden states permuted;
    some in place) writes the same buffers as copying them in by hand first, and as the
    PyTorch path; twice, new contents in the same tensors the second time."""
    from tests.test_drafter import check_prepare_reads_sources

    assert check_prepare_reads_sources(seed, "cuda", torch.bfloat16, 3 * 576) >= 1
