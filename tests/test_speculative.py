"""Speculative generate(): greedy output equals target-only decoding, and sampled output
is distributed exactly as the target's own sampling (a joint distribution of three
tokens enumerated in float64), which a planted rollback bug breaks."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from specdraft import kernels, ops
from specdraft.drafter import Drafter
from specdraft.generate import Engine
from specdraft.kernels import INTERPRET
from specdraft.models.tiny import random_causal_lm, random_weights, tiny_config
from specdraft.runner import TargetRunner
from specdraft.sampling import SamplingParams
from specdraft.speculative import SpeculativeEngine

pytestmark = pytest.mark.no_overflow_check  # see conftest

CFG = tiny_config()
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 33))]


def spec_engine(target, draft, *, k=3, max_num_reqs=4, step_graphs=None, graph_backend=None,
                **kw):  # fmt: skip
    args = dict(
        max_num_reqs=max_num_reqs,
        max_num_tokens=256,
        max_model_len=128,
        num_blocks=max_num_reqs * 8 + 1,
    )
    args.update(kw)
    runner = TargetRunner(target, **args)
    drafter = Drafter(
        draft,
        max_num_reqs=max_num_reqs,
        k_max_options=(k,),
        max_model_len=128,
        num_blocks=max_num_reqs * 8 + 1,
    )
    # NaN in every block but the null one: nothing may read K/V it did not write.
    for cache in (runner.cache, drafter.loop.cache):
        cache.data[:, :, 1:].fill_(float("nan"))
    return SpeculativeEngine(
        runner, drafter, k=k, step_graphs=step_graphs, graph_backend=graph_backend
    )


@pytest.fixture(scope="module")
def models():
    target = random_causal_lm(CFG, seed=0, dtype=torch.float32)
    same = random_causal_lm(CFG, seed=0, dtype=torch.float32)
    other = random_causal_lm(tiny_config(num_layers=1), seed=3, dtype=torch.float32)
    return target, same, other


def target_only(target, prompts, max_new_tokens: int) -> list[list[int]]:
    """The target's own greedy tokens (target-only Engine)."""
    runner = TargetRunner(
        target, max_num_reqs=4, max_num_tokens=64, max_model_len=128, num_blocks=40
    )
    return [o.token_ids for o in Engine(runner).generate(prompts, max_new_tokens=max_new_tokens)]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equals_target_only(models, k):
    target, same, other = models
    with ops.use_backend("torch"):
        want = target_only(target, PROMPTS, 12)
        for draft, accepts in ((same, True), (other, False)):
            se = spec_engine(target, draft, k=k)
            out = se.generate(PROMPTS, max_new_tokens=12)
            assert [o.token_ids for o in out] == want
            rate = sum(se.stats.accepted) / max(1, sum(se.stats.proposed))
            assert (rate == 1.0) if accepts else (rate < 0.5)


def test_greedy_with_per_request_k_equals_target_only(models):
    """Each request its own k (0 to the engine's 3) in one batch, with the full path and
    with steady step graphs: the target's greedy tokens; requests with k 0 propose
    nothing, so the later positions count fewer drafts."""
    from tests.test_cuda_graph import EagerBackend

    target, same, other = models
    with ops.use_backend("torch"):
        want = target_only(target, PROMPTS, 12)
        for draft in (same, other):
            for graphs in (False, True):
                kw = dict(step_graphs=True, graph_backend=EagerBackend()) if graphs else {}
                for ks in ([0, 2, 3], [3, 0, 1], [0, 0, 0]):
                    se = spec_engine(target, draft, k=3, **kw)
                    out = se.generate(PROMPTS, max_new_tokens=12, k=ks)
                    assert [o.token_ids for o in out] == want, (ks, graphs)
                    se.rejection_counters()
                    st = se.stats
                    # no request drafts past its own k
                    assert sum(st.proposed[max(ks) :]) == 0, (ks, st.proposed)
                    assert st.proposed[0] >= st.proposed[1] >= st.proposed[2]
                    assert (st.proposed[0] > 0) == (max(ks) > 0)
                    if draft is same:
                        assert st.accepted == st.proposed


def test_eagle_heads_greedy_equals_target_only():
    """EAGLE-1 and EAGLE-3 heads fed the target's features (final hidden states;
    auxiliary layers 2, 2, 1 of a 4-layer target) through prefill and verification; an
    EAGLE-1 head proposing from half the vocabulary (reduce_vocab) too."""
    from specdraft.models.tiny import eagle_config, random_eagle3_head, random_eagle_head

    cfg = tiny_config(num_layers=4)
    target = random_causal_lm(cfg, seed=0, dtype=torch.float32)
    with ops.use_backend("torch"):
        ref = Engine(
            TargetRunner(
                target, max_num_reqs=4, max_num_tokens=64, max_model_len=128, num_blocks=40
            )
        ).generate(PROMPTS, max_new_tokens=10)
        heads = [
            random_eagle_head(eagle_config(cfg), target, seed=1),
            random_eagle3_head(
                eagle_config(cfg, draft_vocab_size=64), target=target, seed=2, dtype=torch.float32
            ),
            random_eagle_head(eagle_config(cfg), target, seed=3).reduce_vocab(
                range(0, cfg.vocab_size, 2)
            ),
        ]
        for head in heads:
            out = spec_engine(target, head, k=2).generate(PROMPTS, max_new_tokens=10)
            assert [o.token_ids for o in out] == [o.token_ids for o in ref], type(head)


def test_step_graphs_equal_the_full_path(models):
    """Steady steps (verification, rejection sampling and bookkeeping as one captured
    step, stood in for by an eager backend on the CPU) give the same tokens as the full
    path: greedy, and sampled with top-k / top-p under the same seeds; requests finish
    at different lengths, so the batch shrinks and new keys are captured."""
    from specdraft.models.tiny import eagle_config, random_eagle_head
    from tests.test_cuda_graph import EagerBackend

    target, same, other = models
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=20, seed=3),
        SamplingParams(temperature=1.1, top_p=0.8, seed=4),
    ]
    with ops.use_backend("torch"):
        for draft in (other, random_eagle_head(eagle_config(CFG), target, seed=1)):
            for p in (None, params):
                runs = []
                for steady in (False, True):
                    se = spec_engine(
                        target, draft, k=3, step_graphs=steady, graph_backend=EagerBackend()
                    )
                    out = se.generate(PROMPTS, params=p, max_new_tokens=14, stop_token_ids=[])
                    runs.append([o.token_ids for o in out])
                    assert (se.graph_steps > 0) == steady
                    if steady:
                        assert len(se._steps) >= 1
                assert runs[0] == runs[1], (type(draft).__name__, p is None)


def test_replay_verify_needs_the_rows_of_execute_verify(models):
    """replay_verify reuses the verify rows on the device: without an execute_verify for
    the same (requests, k), or after a request left, it refuses and changes nothing."""
    target, _, other = models
    se = spec_engine(target, other, k=3, step_graphs=False)
    runner = se.runner
    for rid in (1, 2):
        runner.tables.add_request(rid, 16)
    rows = [runner.tables.row_of(1), runner.tables.row_of(2)]
    snap = [t.clone() for t in (runner.committed, runner.verify_rows, runner.cache.data)]
    with pytest.raises(ValueError, match=r"replay_verify\(2, 3\).*execute_verify"):
        runner.replay_verify(2, 3)
    for a, t in zip(snap, (runner.committed, runner.verify_rows, runner.cache.data)):
        assert torch.allclose(a, t, rtol=0, atol=0, equal_nan=True)
    runner.verify_drafts[:2, :3].fill_(5)
    want = runner.execute_verify(2, 3, rows=rows).clone()
    assert torch.equal(runner.replay_verify(2, 3)[0], want)  # same inputs, same logits
    with pytest.raises(ValueError, match="replay_verify"):
        runner.replay_verify(1, 3)  # another request count
    runner.remove_request(2)
    with pytest.raises(ValueError, match="replay_verify"):
        runner.replay_verify(2, 3)


def test_verification_reads_the_drafters_table(models):
    """The engine points verification at the drafter's token table (no copy per step);
    a table of the wrong shape, dtype or device is refused and changes nothing."""
    target, _, other = models
    se = spec_engine(target, other, k=3, step_graphs=False)
    runner, table = se.runner, se.drafter.token_table(3)
    assert runner.verify_drafts.data_ptr() == table.data_ptr()
    assert runner.verify_drafts.stride() == table.stride()
    before = runner.verify_drafts
    for bad_k in (0, se.drafter.k_cap + 1, 2.0):
        with pytest.raises((TypeError, ValueError), match="k_max"):
            se.drafter.token_table(bad_k)
    for bad in (table[:, :2], table.int(), table[:1], torch.zeros(8, 3), "x"):
        with pytest.raises(ValueError, match="table"):
            runner.read_drafts_from(bad)
        assert runner.verify_drafts is before
    out = se.generate(PROMPTS[:2], max_new_tokens=6)  # still the target's greedy tokens
    ref = Engine(TargetRunner(target, max_num_reqs=4, max_num_tokens=256, max_model_len=128,
                              num_blocks=33)).generate(PROMPTS[:2], max_new_tokens=6)  # fmt: skip
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


def test_step_graphs_need_a_gpu_or_a_backend(models):
    target, _, other = models
    with pytest.raises(ValueError, match="step_graphs=True needs the target on a CUDA device"):
        spec_engine(target, other, step_graphs=True)


@pytest.mark.gpu
def test_gpu_verification_graphs_equal_target_only():
    """fp32 on the GPU: verification replayed from captured graphs (3 requests run in
    the 4-request graph, so one padded request rides along and must write nothing, row
    0 included) gives target-only greedy tokens, for a Llama draft and EAGLE-1 / EAGLE-3
    heads fed the features the graphs return; and it is the graph that ran."""
    from specdraft.loader import Checkpoint, load_causal_lm
    from specdraft.models.tiny import eagle_config, random_eagle3_head, random_eagle_head

    cfg = tiny_config(num_layers=4)
    ckpt = Checkpoint.from_tensors(cfg.to_hf(), random_weights(cfg, seed=0))
    target = load_causal_lm(ckpt, dtype=torch.float32, device="cuda", max_positions=128)
    ref = Engine(
        TargetRunner(
            target,
            max_num_reqs=4,
            max_num_tokens=64,
            max_model_len=128,
            num_blocks=40,
            cuda_graphs=False,
        )  # fmt: skip
    ).generate(PROMPTS, max_new_tokens=12)
    want = [o.token_ids for o in ref]
    drafts = [
        load_causal_lm(ckpt, dtype=torch.float32, device="cuda", max_positions=128),
        random_eagle_head(eagle_config(cfg), target, seed=1),
        random_eagle3_head(
            eagle_config(cfg, draft_vocab_size=64),
            target=target,
            seed=2,
            dtype=torch.float32,
            device="cuda",
        ),
    ]
    for draft in drafts:
        se = spec_engine(target, draft, k=3, capture_sizes=[1, 2, 4])
        runner = se.runner
        assert runner._verify_graphs[4].captured
        before = runner.graph_steps
        out = se.generate(PROMPTS, max_new_tokens=12)
        assert [o.token_ids for o in out] == want, type(draft).__name__
        assert runner.graph_steps > before  # verification ran from its graphs
        assert se.graph_steps > 0  # and steady steps from their own
        # the null block (padded requests' block) holds no NaN written by a padded row
        assert torch.isfinite(runner.cache.data[:, :, 0]).all()


def test_target_blocks_grow_every_few_steps_not_every_step(models):
    """Blocks by upper bound, a block ahead: the target's block tables grow a few times
    per request over a run, not once per request and step; output unchanged (the cache
    is NaN outside what was written)."""
    target, same, _ = models
    se = spec_engine(target, same, k=3)
    calls = []
    grow = se.runner.tables.grow
    se.runner.tables.grow = lambda rid, n: calls.append(n) or grow(rid, n)
    with ops.use_backend("torch"):
        want = Engine(se.runner).generate(PROMPTS, max_new_tokens=40)
        calls.clear()  # the speculative run's growth only
        got = se.generate(PROMPTS, max_new_tokens=40)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    steps = se.stats.steps
    assert steps >= 10
    # 3 requests of up to 23 + 40 + 8 tokens in 16-token blocks: at most 4 growths each
    assert len(calls) <= 3 * 4, (len(calls), steps)


@pytest.mark.parametrize("max_new", [5, 12, 13])
def test_no_step_is_launched_past_max_new_tokens(models, max_new):
    """The readback is one step late; when every running request may reach
    max_new_tokens in the step in flight, generate() waits for it instead of launching
    one more. With the same-weights draft (every draft accepted, k + 1 tokens a step)
    each request runs exactly ceil((max_new - 1) / (k + 1)) rounds after its first
    token, and the output is target-only's."""
    target, same, _ = models
    k = 3
    se = spec_engine(target, same, k=k, max_num_reqs=1)
    with ops.use_backend("torch"):
        want = Engine(se.runner).generate(PROMPTS, max_new_tokens=max_new)
        rounds0 = se.drafter.rounds
        got = se.generate(PROMPTS, max_new_tokens=max_new)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(len(o.token_ids) == max_new for o in got)
    per_request = -(-(max_new - 1) // (k + 1))
    assert se.drafter.rounds - rounds0 == len(PROMPTS) * per_request


def test_requests_ending_at_different_steps_near_the_end(models):
    """Requests that stop (stop ids) or reach max_new_tokens at different steps, with a
    draft whose acceptance varies per request and step, so that the end-of-generation
    wait sees some requests finish and others run on right after other requests left
    the batch (these stop sets and lengths do; the wait once gathered the survivors'
    rows by their places in the shrunk batch from a step of the larger one). Every
    output equals target-only's."""
    target, _, other = models
    prompts = PROMPTS + [[5, 6, 7, 8], [30, 2], list(range(40, 52))]
    with ops.use_backend("torch"):
        ref = Engine(
            TargetRunner(
                target, max_num_reqs=6, max_num_tokens=128, max_model_len=128, num_blocks=60
            )
        )
        free = [o.token_ids for o in ref.generate(prompts, max_new_tokens=24)]
        for trial in (11, 31, 57, 82, 87, 113):
            rng = random.Random(trial)
            max_new = rng.randint(6, 24)
            picks = rng.sample(range(6), rng.randint(1, 4))
            stops = sorted({rng.choice(free[i][1:max_new]) for i in picks})
            want = ref.generate(prompts, max_new_tokens=max_new, stop_token_ids=stops)
            se = spec_engine(target, other, k=3, max_num_reqs=6)
            got = se.generate(prompts, max_new_tokens=max_new, stop_token_ids=stops)
            assert [o.token_ids for o in got] == [o.token_ids for o in want], (trial, stops)


def test_rows_of_finished_sampled_requests_go_back_to_greedy(models):
    """A runner that served sampled requests, then greedy speculation on it: the rows
    the sampled requests left are greedy again (they used to keep the runner's host
    flags "sampled", and the greedy rejection path refused the batch)."""
    target, same, _ = models
    with ops.use_backend("torch"):
        se = spec_engine(target, same, k=2)
        Engine(se.runner).generate(
            PROMPTS, params=SamplingParams(temperature=0.9, seed=3), max_new_tokens=4
        )
        assert se.runner.sampling.all_greedy
        want = Engine(
            TargetRunner(
                target, max_num_reqs=4, max_num_tokens=64, max_model_len=128, num_blocks=40
            )  # fmt: skip
        ).generate(PROMPTS, max_new_tokens=8)
        out = se.generate(PROMPTS, max_new_tokens=8)
        assert [o.token_ids for o in out] == [o.token_ids for o in want]


def test_stop_id_inside_an_accepted_block_truncates(models):
    target, same, _ = models
    with ops.use_backend("torch"):
        ref = Engine(
            TargetRunner(
                target, max_num_reqs=4, max_num_tokens=64, max_model_len=128, num_blocks=40
            )
        ).generate(PROMPTS, max_new_tokens=12)
        stop = ref[0].token_ids[5]
        out = spec_engine(target, same, k=3).generate(
            PROMPTS, max_new_tokens=12, stop_token_ids=[stop]
        )
    first = ref[0].token_ids
    assert out[0].token_ids == first[: first.index(stop) + 1]
    assert out[0].finish_reason == "stop"


# ---- losslessness over a joint distribution -------------------------------------------

SMALL = tiny_config(
    vocab_size=6,
    num_layers=1,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
)
PROMPT = [1, 4, 2]
TEMP = 1.0


def exact_joint(weights) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3 | PROMPT) of the target at TEMP, in float64 through transformers."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(**SMALL.to_hf()))
    hf.load_state_dict(weights, strict=False)
    hf = hf.double().eval()
    v = SMALL.vocab_size
    seqs = torch.tensor([PROMPT + list(t) for t in itertools.product(range(v), repeat=2)])
    with torch.no_grad():
        logp = torch.log_softmax(hf(seqs).logits / TEMP, dim=-1)  # [v*v, L, v]
    n = len(PROMPT)
    joint = {}
    for i, (a, b) in enumerate(itertools.product(range(v), repeat=2)):
        base = logp[i, n - 1, a] + logp[i, n, b]
        for c in range(v):
            joint[(a, b, c)] = math.exp(float(base + logp[i, n + 1, c]))
    return joint


def chi_square(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Chi-square with bins of expected count < 5 merged into one."""
    stat, df, rest_obs, rest_exp = 0.0, -1, 0, 0.0
    for key, p in probs.items():
        e, o = n * p, counts.get(key, 0)
        if e < 5:
            rest_obs, rest_exp = rest_obs + o, rest_exp + e
            continue
        stat += (o - e) ** 2 / e
        df += 1
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        df += 1
    return stat, df


def sample_joint(target, draft, n: int, *, planted_bug: bool = False, ks=(1,)):
    """n draws of the first three tokens; request i speculates ks[i % len(ks)] tokens a
    step (an engine of k max(ks))."""
    k = max(max(ks), 1)
    se = spec_engine(target, draft, k=k, max_num_reqs=64, max_num_tokens=64 * (k + 1))
    if planted_bug:  # one KV row too many kept after every verification
        inner = se.rejection

        class Buggy:
            def __call__(self, *a, **kw):
                out = inner(*a, **kw)
                rows = se.runner.verify_rows[: out.tokens.shape[0]]
                se.runner.committed.index_add_(0, rows, torch.ones_like(rows))
                return out

            def __getattr__(self, name):
                return getattr(inner, name)

        se.rejection = Buggy()
    params = [SamplingParams(temperature=TEMP, seed=1000 + i) for i in range(n)]
    per = [ks[i % len(ks)] for i in range(n)]
    out = se.generate([PROMPT] * n, params=params, max_new_tokens=3, k=per)
    counts: dict = {}
    for o in out:
        key = tuple(o.token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.fixture(scope="module")
def small_pair():
    wt, wd = random_weights(SMALL, seed=7), random_weights(SMALL, seed=8)
    # Sharp attention, so that one stale KV row changes the next token's distribution
    # enough for the planted-bug test to see it.
    for name in list(wt):
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            wt[name] = wt[name] * 4
    from specdraft.loader import Checkpoint, load_causal_lm

    target = load_causal_lm(Checkpoint.from_tensors(SMALL.to_hf(), wt), dtype=torch.float32)
    draft = load_causal_lm(Checkpoint.from_tensors(SMALL.to_hf(), wd), dtype=torch.float32)
    return target, draft, exact_joint(wt)


N = 3000


# k 1 for every request, and k 0 / 1 / 3 / 5 mixed in one batch (an engine of k 5)
KS = [(1,), (0, 1, 3, 5)]


@pytest.mark.parametrize("ks", KS, ids=["k1", "mixed"])
def test_sampled_output_is_the_targets_distribution(small_pair, ks):
    target, draft, joint = small_pair
    with ops.use_backend("torch"):
        counts = sample_joint(target, draft, N, ks=ks)
    stat, df = chi_square(counts, joint, N)
    assert stat < df + 10 * math.sqrt(2 * df), (stat, df)


def test_sampled_output_with_a_reduced_vocabulary_head_is_the_targets(small_pair):
    """An EAGLE-1 head proposing from 3 of the 6 ids (reduce_vocab: q over the target
    vocabulary, zero outside) through the rejection sampler: the joint of the first
    three tokens is still the target's."""
    from specdraft.models.tiny import eagle_config, random_eagle_head

    target, _, joint = small_pair
    head = random_eagle_head(eagle_config(SMALL), target, seed=9).reduce_vocab([0, 2, 5])
    with ops.use_backend("torch"):
        counts = sample_joint(target, head, N, ks=(0, 1, 3))
    stat, df = chi_square(counts, joint, N)
    assert stat < df + 10 * math.sqrt(2 * df), (stat, df)


@pytest.mark.parametrize("ks", KS, ids=["k1", "mixed"])
def test_planted_rollback_bug_is_caught(small_pair, ks):
    target, draft, joint = small_pair
    with ops.use_backend("torch"):
        counts = sample_joint(target, draft, N, planted_bug=True, ks=ks)
    stat, df = chi_square(counts, joint, N)
    assert stat > df + 10 * math.sqrt(2 * df), (stat, df)


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda se: se.generate([[]]), ValueError, "prompt is empty"),
        (lambda se: se.generate([[1, 999]]), ValueError, "outside [0, 256)"),
        (
            lambda se: se.generate([list(range(110))], max_new_tokens=20),
            ValueError,
            "max_model_len",
        ),
        (lambda se: se.generate([[1]], stop_token_ids=[-3]), ValueError, "stop_token_ids"),
        (lambda se: se.generate([[1]], params=[SamplingParams()] * 2), ValueError, "params"),
        (lambda se: se.generate("abc"), TypeError, "prompts"),
        (lambda se: se.generate([[1]], max_new_tokens=0), ValueError, "max_new_tokens"),
        (lambda se: se.generate([[1]], k=3), ValueError, "k must be an int in [0, 2]"),
        (lambda se: se.generate([[1], [2]], k=[1]), ValueError, "k has 1 entries for 2"),
        (lambda se: se.generate([[1], [2]], k=[1, -1]), ValueError, "k[1] must be"),
        (lambda se: se.generate([[1], [2]], k=[1, True]), ValueError, "k[1] must be"),
        (lambda se: se.generate([[1]], k="2"), TypeError, "k must be an int or a list"),
    ],
)
def test_bad_input_changes_nothing(models, call, exc, words):
    target, same, _ = models
    with ops.use_backend("torch"):
        se = spec_engine(target, same, k=2)
        se.runner.cache.data.normal_()
        se.drafter.loop.cache.data.normal_()
        before = [
            t.clone()
            for t in (
                se.runner.cache.data,
                se.drafter.loop.cache.data,
                se.runner.tables.rows,
                se.runner.committed,
            )
        ]
        free = (se.runner.tables.num_free_blocks, se.drafter.tables.num_free_blocks)
        with pytest.raises(exc) as info:
            call(se)
        assert words in str(info.value)
        after = (
            se.runner.cache.data,
            se.drafter.loop.cache.data,
            se.runner.tables.rows,
            se.runner.committed,
        )
        assert all(torch.equal(a, b) for a, b in zip(before, after))
        assert free == (se.runner.tables.num_free_blocks, se.drafter.tables.num_free_blocks)
        assert len(se.generate([[1, 2]], max_new_tokens=3)[0].token_ids) == 3


@pytest.mark.parametrize(
    "kw, exc, words",
    [
        (dict(k=0), ValueError, "k must be"),
        (dict(k=9), ValueError, "k must be"),
        (dict(k=True), ValueError, "k must be"),
    ],
)
def test_bad_engine_arguments(models, kw, exc, words):
    target, same, _ = models
    runner = TargetRunner(
        target, max_num_reqs=2, max_num_tokens=64, max_model_len=128, num_blocks=20
    )
    drafter = Drafter(same, max_num_reqs=2, k_max_options=(3,), max_model_len=128, num_blocks=20)
    with pytest.raises(exc, match=words):
        SpeculativeEngine(runner, drafter, **kw)
    with pytest.raises(TypeError, match="runner"):
        SpeculativeEngine(object(), drafter)


# the interpreter on the CPU, the compiled kernel on a GPU
COMMIT_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]),
]  # fmt: skip


@pytest.mark.parametrize("device", COMMIT_DEVICES)
@pytest.mark.parametrize("b, w", [(1, 4), (5, 2), (37, 6)])
def test_commit_step_matches_torch(b, w, device):
    """The one-launch bookkeeping equals its torch definition on fresh random inputs,
    every output poisoned first (and rows beyond the batch left alone)."""
    g = torch.Generator().manual_seed(b * 10 + w)
    r = b + 3
    rows = torch.randperm(r, generator=g)[:b]
    nacc = torch.randint(0, w, (b,), generator=g, dtype=torch.int32)
    tokens = torch.randint(0, 1000, (b, w), generator=g)
    j = torch.arange(w)
    tokens = torch.where(j[None, :] <= nacc[:, None].long(), tokens, -1)
    nemit = nacc + 1
    committed = torch.randint(5, 500, (r,), generator=g)
    outs = []
    for fn in (kernels.commit_step, kernels.commit_step_torch):
        state = (committed.clone(), torch.full((r, w + 1), -7), torch.full((r,), -7),
                 torch.full((r, w), -7), torch.full((r,), -7, dtype=torch.int32),
                 torch.full((r,), -7))  # fmt: skip
        state = tuple(t.to(device) for t in state)
        fn(*(t.to(device) for t in (tokens, nacc, nemit, rows)), *state)
        outs.append(tuple(t.cpu() for t in state))
    for a, t in zip(*outs):
        assert torch.equal(a, t)
    c, stage, first, ver, acc, pos = outs[0]
    assert torch.equal(c[rows], committed[rows] + nacc.long() + 1)
    assert torch.equal(pos[:b], c[rows] + 1) and bool((pos[b:] == -7).all())
    assert torch.equal(first[:b], tokens.gather(1, nacc.long()[:, None])[:, 0])
    assert bool((stage[b:] == -7).all()) and torch.equal(stage[:b, w], nemit.long())


@pytest.mark.parametrize("device", COMMIT_DEVICES)
def test_commit_step_bad_inputs(device):
    b, w = 3, 4
    ok = dict(
        tokens=torch.zeros(b, w, dtype=torch.int64),
        num_accepted=torch.zeros(b, dtype=torch.int32),
        num_emitted=torch.ones(b, dtype=torch.int32),
        rows=torch.arange(b),
        committed=torch.zeros(b + 1, dtype=torch.int64),
        stage=torch.zeros(b, w + 1, dtype=torch.int64),
        verify_first=torch.zeros(b, dtype=torch.int64),
        next_verified=torch.zeros(b, w, dtype=torch.int64),
        next_accepted=torch.zeros(b, dtype=torch.int32),
        next_positions=torch.zeros(b, dtype=torch.int64),
    )
    for name, bad in (
        ("num_accepted", torch.zeros(b, dtype=torch.int64)),
        ("rows", torch.arange(b - 1)),
        ("stage", torch.zeros(b, w, dtype=torch.int64)),
        ("next_verified", torch.zeros(b, w, dtype=torch.int32)),
    ):
        args = {k: v.to(device) for k, v in dict(ok, **{name: bad}).items()}
        snap = {k: v.clone() for k, v in args.items()}
        with pytest.raises((ValueError, TypeError), match=name):
            kernels.commit_step(**args)
        assert all(torch.equal(snap[k], args[k]) for k in args)


@pytest.mark.parametrize("device", COMMIT_DEVICES)
def test_commit_step_corrupt_row_writes_no_length(device):
    """A row index outside `committed` (corrupt metadata) writes nothing there and gives
    position -1; the other requests are committed as usual."""
    b, w = 3, 4
    rows = torch.tensor([0, 99, -5, 2])[:b].to(device)
    committed = torch.tensor([10, 20, 30], device=device)
    nacc = torch.tensor([1, 2, 0], dtype=torch.int32, device=device)
    tokens = torch.arange(b * w, device=device).view(b, w)
    pos = torch.full((b,), -7, device=device)
    kernels.commit_step(tokens, nacc, nacc + 1, rows, committed,
                        torch.zeros(b, w + 1, dtype=torch.int64, device=device),
                        torch.zeros(b, dtype=torch.int64, device=device),
                        torch.zeros(b, w, dtype=torch.int64, device=device),
                        torch.zeros(b, dtype=torch.int32, device=device), pos)  # fmt: skip
    assert committed.tolist() == [12, 20, 30] and pos.tolist() == [13, -1, -1]
