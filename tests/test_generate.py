"""generate() over the target runner on a tiny random model: greedy equals transformers,
chunked prefill / preemption / continuous batching change nothing, seeded sampling is
reproducible, the PyTorch and Triton paths agree, and bad input changes nothing."""

from __future__ import annotations

import copy

import pytest
import torch

from specdraft import ops
from specdraft.generate import Engine
from specdraft.models.tiny import random_causal_lm, random_weights, tiny_config
from specdraft.runner import TargetRunner
from specdraft.sampling import SamplingParams

pytestmark = pytest.mark.no_overflow_check  # see conftest

transformers = pytest.importorskip("transformers")

CFG = tiny_config()
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 33)), [200]]
STEPS = 12


@pytest.fixture(scope="module")
def model():
    return random_causal_lm(CFG, seed=0, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_tokens():
    hf_cfg = transformers.AutoConfig.for_model(**CFG.to_hf())
    hf = getattr(transformers, CFG.architecture)(hf_cfg).float().eval()
    missing, unexpected = hf.load_state_dict(random_weights(CFG, seed=0), strict=False)
    assert not unexpected
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            g = hf.generate(
                torch.tensor([p]),
                max_new_tokens=STEPS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            out.append(g[0, len(p) :].tolist())
    return out


def poison(cache) -> None:
    """NaN in every block but the null one: nothing may read K/V it did not write."""
    cache.data[:, :, 1:].fill_(float("nan"))


def on_backend(model, backend: str):
    """The model where `backend` runs: Triton kernels need CUDA tensors on a GPU machine
    (the interpreter takes CPU tensors only where there is no GPU)."""
    if backend == "triton" and torch.cuda.is_available():
        return copy.deepcopy(model).to("cuda")
    return model


def engine(model, **kw) -> Engine:
    args = dict(max_num_reqs=4, max_num_tokens=64, max_model_len=64, num_blocks=40)
    args.update(kw)
    runner = TargetRunner(model, **args)
    poison(runner.cache)
    return Engine(runner)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_equals_transformers(model, hf_tokens, backend):
    with ops.use_backend(backend):
        out = engine(on_backend(model, backend)).generate(PROMPTS, max_new_tokens=STEPS)
    assert [o.token_ids for o in out] == hf_tokens
    assert all(o.finish_reason == "length" for o in out)


def test_chunked_prefill_preemption_and_batching_change_nothing(model, hf_tokens):
    # 8-token budget: the 23-token prompt is prefilled in chunks beside decode rows;
    # 2 rows for 4 prompts: requests join as others finish; 7 blocks of 16 tokens
    # cannot hold every request at once, so some are preempted and prefilled again.
    small = engine(model, max_num_reqs=2, max_num_tokens=8, num_blocks=4)
    out = small.generate(PROMPTS, max_new_tokens=STEPS)
    assert [o.token_ids for o in out] == hf_tokens
    tight = engine(model, max_num_reqs=4, max_num_tokens=16, num_blocks=5)
    out = tight.generate(PROMPTS, max_new_tokens=STEPS)
    assert [o.token_ids for o in out] == hf_tokens
    assert tight.preemptions > 0


def test_seeded_sampling_reproducible_and_paths_agree(model):
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=s) for s in range(4)]
    runs = []
    for backend in ("torch", "triton", "torch"):
        with ops.use_backend(backend):
            e = engine(on_backend(model, backend))
            runs.append(e.generate(PROMPTS, params=params, max_new_tokens=STEPS, logprobs=True))
    toks = [[o.token_ids for o in run] for run in runs]
    assert toks[0] == toks[1] == toks[2]
    assert len({tuple(t) for t in toks[0]}) == len(PROMPTS)
    for o in runs[0]:
        assert len(o.logprobs) == len(o.token_ids)
        assert all(lp <= 0 for lp in o.logprobs)
    # another seed draws other tokens
    other = engine(model).generate(
        PROMPTS, params=SamplingParams(temperature=0.8, seed=99), max_new_tokens=STEPS
    )
    assert [o.token_ids for o in other] != toks[0]


def test_stop_ids_and_max_new_tokens(model, hf_tokens):
    stop = hf_tokens[0][4]
    out = engine(model).generate(PROMPTS, max_new_tokens=STEPS, stop_token_ids=[stop])
    first = out[0].token_ids
    assert first == hf_tokens[0][: hf_tokens[0].index(stop) + 1]
    assert out[0].finish_reason == "stop"
    out = engine(model).generate(PROMPTS, max_new_tokens=3)
    assert [o.token_ids for o in out] == [t[:3] for t in hf_tokens]


class _CharTokenizer:
    """Token i is chr(65 + i % 26); enough to check the streaming plumbing."""

    stop_token_ids = ()

    def encode(self, text):
        return [ord(c) - 65 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)

    def stream_decoder(self):
        tok = self

        class D:
            def push(self, i):
                return tok.decode([i])

            def flush(self):
                return ""

        return D()


def test_streaming_callback_gets_the_text(model):
    e = Engine(
        TargetRunner(model, max_num_reqs=4, max_num_tokens=64, max_model_len=64, num_blocks=40),
        _CharTokenizer(),
    )
    pieces: dict[int, str] = {}
    out = e.generate(
        ["ABC", "HELLO"],
        max_new_tokens=6,
        stream=lambda i, t: pieces.__setitem__(i, pieces.get(i, "") + t),
    )
    assert [pieces[i] for i in range(2)] == [o.text for o in out]


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(prompts=[[]]), ValueError, "prompt is empty"),
        (dict(prompts=[list(range(60))], max_new_tokens=10), ValueError, "max_model_len"),
        (dict(prompts=[[1, 300]]), ValueError, "outside [0, 256)"),
        (dict(prompts=[[1, -2]]), ValueError, "token id -2"),
        (dict(prompts=[[1]], max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(prompts=[[1]], stop_token_ids=[999]), ValueError, "stop_token_ids"),
        (dict(prompts=["text"]), ValueError, "tokenizer"),
        (dict(prompts=[[1]], params=[SamplingParams()] * 3), ValueError, "params"),
        (dict(prompts="abc"), TypeError, "prompts"),
        (dict(prompts=[[1]], max_new_tokens=2.5), TypeError, "max_new_tokens"),
    ],
)
def test_bad_input_changes_nothing(model, kwargs, exc, words):
    e = engine(model)
    e.runner.cache.data.normal_()  # NaN-free contents to compare bit for bit
    before = (
        e.runner.cache.data.clone(),
        e.runner.tables.rows.clone(),
        e.runner.tables.num_free_blocks,
    )
    prompts = kwargs.pop("prompts")
    kwargs.setdefault("max_new_tokens", 8)
    good = [1, 2, 3]
    with pytest.raises(exc, match=None) as info:
        e.generate([good, *prompts] if isinstance(prompts, list) else prompts, **kwargs)
    assert words in str(info.value)
    assert torch.equal(before[0], e.runner.cache.data)
    assert torch.equal(before[1], e.runner.tables.rows)
    assert before[2] == e.runner.tables.num_free_blocks
    assert not e.has_work()
    # the engine still serves the good request afterwards
    assert len(e.generate([good], max_new_tokens=2)[0].token_ids) == 2


@pytest.mark.parametrize(
    "params, words",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
    ],
)
def test_bad_sampling_params(params, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**params)


@pytest.mark.gpu
def test_gpu_graphs_equal_eager_and_transformers(hf_tokens):
    """fp32 on the GPU: decode graphs replayed by generate() give transformers' greedy
    tokens, and the launch path of every step runs under sync-debug "error"."""
    # The CPU-seeded weights transformers got, moved to the GPU (a CUDA generator would
    # draw other weights).
    from specdraft.loader import Checkpoint, load_causal_lm

    ckpt = Checkpoint.from_tensors(CFG.to_hf(), random_weights(CFG, seed=0))
    model = load_causal_lm(ckpt, dtype=torch.float32, device="cuda")
    runner = TargetRunner(
        model,
        max_num_reqs=4,
        max_num_tokens=64,
        max_model_len=64,
        num_blocks=40,
        capture_sizes=[1, 2, 4],
    )
    runner.capture()
    e = Engine(runner)

    def strict(fn):
        def run(**kw):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(**kw)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return run

    e._launch = strict(e._launch)
    runner.decode_next = strict(runner.decode_next)  # the steady path's whole launch
    out = e.generate(PROMPTS, max_new_tokens=STEPS)
    assert [o.token_ids for o in out] == hf_tokens
    # the steady decode graphs (advance + step + readback copy) ran most steps
    assert runner.advanced_steps >= STEPS // 2 and runner.graph_steps >= runner.advanced_steps
    eager = Engine(
        TargetRunner(
            model,
            max_num_reqs=4,
            max_num_tokens=64,
            max_model_len=64,
            num_blocks=40,
            cuda_graphs=False,
        )
    )
    params = [SamplingParams(temperature=0.9, top_p=0.8, seed=s) for s in range(4)]
    a = e.generate(PROMPTS, params=params, max_new_tokens=STEPS, logprobs=True)
    b = eager.generate(PROMPTS, params=params, max_new_tokens=STEPS, logprobs=True)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    # log-probabilities come back through the steady graphs' own pinned copy
    for x, y in zip(a, b):
        assert len(x.logprobs) == len(x.token_ids)
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs))
    runner.teardown()


def _per_step(e: Engine) -> None:
    """Engine.step without the steady path: every step scheduled and reserved."""
    launched = e._launch()
    e._steady = None
    prev, e._prev = e._prev, launched
    if prev is not None:
        e._process(*prev)


def test_steady_decode_path_and_batched_block_growth(model):
    """A decode batch that repeats runs the steady path (runner.decode_next, nothing
    scheduled), its requests' counters come right when it ends (same tokens as the
    per-step path, with stop ids hit mid-run), and block growth comes for the whole batch
    at once: block-table uploads about once per block_size steps, not once per request
    boundary. (The torch backend: this is the engine's bookkeeping, not the kernels'.)"""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 33)), [200]]

    def run(steady: bool, **kw):
        e = engine(model, max_model_len=128, num_blocks=40)
        calls = {"next": 0, "uploads": 0}
        next_, commit = e.runner.decode_next, e.runner.tables.commit

        def counting_next(**a):
            calls["next"] += 1
            return next_(**a)

        def counting_commit():
            calls["uploads"] += bool(e.runner.tables._pending)
            return commit()

        e.runner.decode_next = counting_next
        e.runner.tables.commit = counting_commit
        if not steady:
            e.step = lambda: _per_step(e)
        with ops.use_backend("torch"):
            return e.generate(prompts, max_new_tokens=48, **kw), calls

    fast, calls = run(True)
    slow, slow_calls = run(False)
    assert [o.token_ids for o in fast] == [o.token_ids for o in slow]
    assert calls["next"] >= 40  # 48 tokens: all but the prefill and the growth steps
    # 4 requests cross 12 block boundaries in 48 steps; batched top-ups upload far less
    assert calls["uploads"] <= 5, calls
    stop = fast[1].token_ids[20]  # a stop id sampled mid-run ends the steady batch
    fast2, _ = run(True, stop_token_ids=[stop])
    slow2, _ = run(False, stop_token_ids=[stop])
    assert [o.token_ids for o in fast2] == [o.token_ids for o in slow2]
    assert any(o.finish_reason == "stop" for o in fast2)
    assert any(o.finish_reason == "length" for o in fast2)


def test_a_request_joins_a_steady_batch(model):
    """Continuous batching across the steady path: two requests decode on it, a third
    joins mid-run (the batch changes, the counters catch up, the new batch goes steady
    again), and every request's tokens equal its run alone."""
    prompts, lengths = [[1, 2, 3], [9, 8], [7, 7, 7, 7]], [40, 40, 20]
    with ops.use_backend("torch"):
        alone = [
            engine(model, max_model_len=128).generate([p], max_new_tokens=n)[0].token_ids
            for p, n in zip(prompts, lengths)
        ]
        e = engine(model, max_model_len=128)
        ids = [e.add_request(p, max_new_tokens=n) for p, n in zip(prompts[:2], lengths)]
        for _ in range(20):
            e.step()
        assert e._steady is not None and e._steady.lag > 0  # on the steady path now
        ids.append(e.add_request(prompts[2], max_new_tokens=lengths[2]))
        while e.has_work():
            e.step()
    assert [e.finished[i].output for i in ids] == alone
    assert not e.running and e._finishing == 0


def test_decode_next_needs_a_decode_step_before_it(model):
    """decode_next() on a runner whose last step was not a decode step: RuntimeError
    naming it, and no slot, step count or buffer changed."""
    runner = engine(model).runner
    before = (runner._next_host, runner.steps, runner.buffers.positions.clone())
    with pytest.raises(RuntimeError, match="decode_next"):
        runner.decode_next(greedy=True)
    assert (runner._next_host, runner.steps) == before[:2]
    assert torch.equal(runner.buffers.positions, before[2])
    runner.tables.add_request("a", 20)
    assert runner.tables.capacity_of("a") == 32  # two blocks of 16


def test_decode_graphs_cover_a_batch_of_every_request(model):
    """The default decode capture sizes end at max_num_reqs itself (a 5-request batch
    had no graph: sizes stopped at 4), and verification sizes follow them."""
    runner = TargetRunner(model, max_num_reqs=5, max_num_tokens=64, max_model_len=64,
                          num_blocks=40)  # fmt: skip
    assert runner._decode_sizes == [1, 2, 4, 5]
    runner = TargetRunner(model, max_num_reqs=8, max_num_tokens=64, max_model_len=64,
                          num_blocks=40)  # fmt: skip
    assert runner._decode_sizes == [1, 2, 4, 8]


def test_graph_set_follows_the_sampling_rows(model):
    """A step's graph set: greedy when the caller says every request is greedy, else
    sampled with or without top-k / top-p by the rows' host flags; a filtered request
    that leaves takes its row's filter with it."""
    from specdraft.runner import FILTER_SET, GREEDY_SET, SAMPLE_SET

    runner = TargetRunner(model, max_num_reqs=3, max_num_tokens=32, max_model_len=64)
    assert runner.graph_set(True) == GREEDY_SET
    assert runner.graph_set(False) == SAMPLE_SET  # unwritten rows: no filter
    runner.tables.add_request("a", 8)
    runner.tables.add_request("b", 8)
    runner.set_sampling(runner.tables.row_of("a"), SamplingParams(temperature=0.8, seed=1))
    assert runner.graph_set(False) == SAMPLE_SET and runner.graph_set(True) == GREEDY_SET
    row_b = runner.tables.row_of("b")
    runner.set_sampling(row_b, SamplingParams(temperature=0.8, top_p=0.9, seed=2))
    assert runner.graph_set(False) == FILTER_SET
    runner.remove_request("b")
    assert runner.graph_set(False) == SAMPLE_SET
    runner.set_sampling(runner.tables.row_of("a"), SamplingParams(temperature=1.0, top_k=5))
    assert runner.graph_set(False) == FILTER_SET


def test_small_m_linear_gives_transformers_greedy_tokens(model, hf_tokens):
    """With the small-M Triton linear switched on (decode rows and short prefill chunks
    through kernels.linear_small_m), greedy output is still transformers'."""
    try:
        ops.set_small_m_linear(True)
        with ops.use_backend("triton"):
            out = engine(on_backend(model, "triton"), max_num_tokens=16).generate(
                PROMPTS, max_new_tokens=STEPS
            )
    finally:
        ops.set_small_m_linear(False)
    assert [o.token_ids for o in out] == hf_tokens
