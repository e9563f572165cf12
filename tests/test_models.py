"""The Llama-family causal LM against Hugging Face transformers: same random weights,
saved with save_pretrained, loaded by specdraft's loader, run through the paged cache
(prefill then decode steps, padded batches)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdraft.loader import load_causal_lm
from specdraft.models.config import RopeConfig
from specdraft.models.tiny import random_causal_lm, random_weights, tiny_config
from tests.model_helpers import PagedRunner, hf_forward, rel_err

pytestmark = pytest.mark.no_overflow_check  # see conftest

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = RopeConfig(
    theta=10000.0,
    type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)


def hf_model(cfg, weights, path, *, dtype=torch.float32, max_shard_size=None):
    """A transformers model of cfg with `weights`, saved to `path` with save_pretrained."""
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    cls = getattr(transformers, cfg.architecture)
    model = cls(hf_cfg)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    model = model.to(dtype).eval()
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kw)
    return model


@torch.no_grad()
def hf_greedy(model, prompt, steps, device, feed=None):
    """Logits of the prompt's last token and of `steps` greedy steps (or of the tokens
    in `feed`), with transformers' own KV cache. Returns (logits [steps + 1, V], tokens)."""
    out, cache = hf_forward(model, torch.tensor([prompt], device=device))
    logits, tokens = [out.logits[0, -1].float()], []
    for i in range(steps):
        tok = int(logits[-1].argmax()) if feed is None else feed[i]
        tokens.append(tok)
        out, cache = hf_forward(model, torch.tensor([[tok]], device=device), cache)
        logits.append(out.logits[0, -1].float())
    return torch.stack(logits), tokens


def run_paged(model, cfg, prompts, steps, device, *, dtype=None, feed=None, **runner_kw):
    """Prefill all prompts in one padded batch, then `steps` decode steps (greedy, or the
    tokens in feed[i]); returns per-request logits [steps + 1, V] and tokens."""
    runner = PagedRunner(cfg, device, dtype=dtype, **runner_kw)
    ids = list(range(len(prompts)))
    meta = runner.step([(i, p) for i, p in zip(ids, prompts)], pad_reqs=1, pad_tokens=3)
    hidden, logits = model(meta.input_ids, meta, runner.cache)
    assert hidden.shape == (meta.num_tokens, cfg.hidden_size)
    assert logits.shape == (meta.num_reqs, cfg.vocab_size)
    assert torch.isfinite(hidden).all() and torch.isfinite(logits).all(), "padding stays finite"
    out = [[logits[i].float()] for i in ids]
    tokens = [[] for _ in ids]
    for s in range(steps):
        nxt = [int(out[i][-1].argmax()) if feed is None else feed[i][s] for i in ids]
        for i in ids:
            tokens[i].append(nxt[i])
        meta = runner.step([(i, [nxt[i]]) for i in ids], pad_reqs=1, pad_tokens=1)
        hidden, logits = model(meta.input_ids, meta, runner.cache)
        assert torch.isfinite(logits).all()
        for i in ids:
            out[i].append(logits[i].float())
    return [torch.stack(x) for x in out], tokens


CPU_CASES = {
    "llama3-rope-sharded": dict(model_type="llama", rope=LLAMA3_ROPE, rms_norm_eps=1e-5),
    "qwen2-tied-bias": dict(
        model_type="qwen2", tie_word_embeddings=True, rope=RopeConfig(theta=1e6), rms_norm_eps=1e-6
    ),
}


@pytest.mark.interpreter
@pytest.mark.parametrize("case", list(CPU_CASES))
def test_hf_parity_prefill_then_32_greedy_steps(tmp_path, case):
    cfg = tiny_config(**CPU_CASES[case])
    weights = random_weights(cfg, seed=11)
    shard = "40KB" if "sharded" in case else None
    hf = hf_model(cfg, weights, tmp_path, max_shard_size=shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_causal_lm(tmp_path)
    assert ours.dtype == torch.float32 and ours.cfg.architecture == cfg.architecture
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (11, 5)]
    steps = 32
    got, got_tokens = run_paged(ours, cfg, prompts, steps, "cpu")
    for i, prompt in enumerate(prompts):
        ref, ref_tokens = hf_greedy(hf, prompt, steps, "cpu")
        errs = [rel_err(got[i][s], ref[s]) for s in range(steps + 1)]
        assert max(errs) < 1e-4, f"request {i}: logits relative errors {errs}"
        assert got_tokens[i] == ref_tokens, f"request {i}: greedy continuations differ"


@pytest.mark.interpreter
def test_logits_selection_and_aux_hidden_states():
    cfg = tiny_config(num_layers=3)
    model = random_causal_lm(cfg, seed=3)
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    hf = transformers.LlamaForCausalLM(hf_cfg)
    hf.load_state_dict(random_weights(cfg, seed=3))
    prompts = [[5, 9, 2, 7], [1, 3, 3]]
    r1, r2 = PagedRunner(cfg, "cpu"), PagedRunner(cfg, "cpu")
    meta = r1.step([(0, prompts[0]), (1, prompts[1])], pad_reqs=1, pad_tokens=2)
    hidden, last = model(meta.input_ids, meta, r1.cache)
    meta2 = r2.step([(0, prompts[0]), (1, prompts[1])], pad_reqs=1, pad_tokens=2)
    h2, every, aux = model(meta2.input_ids, meta2, r2.cache, all_logits=True, aux_layers=(0, 2))
    assert every.shape == (9, cfg.vocab_size) and aux.shape == (9, 2 * cfg.hidden_size)
    torch.testing.assert_close(every[[3, 6]], last[:2])
    torch.testing.assert_close(h2, hidden)
    idx = torch.tensor([6, 0, 1])
    _, chosen = model(meta.input_ids, meta, r1.cache, logits_indices=idx)  # rewrites same K/V
    torch.testing.assert_close(chosen, every[idx])
    with torch.no_grad():
        ref = hf(torch.tensor([prompts[0]]), output_hidden_states=True).hidden_states
    for j, layer in enumerate((0, 2)):
        got = aux[:4, j * cfg.hidden_size : (j + 1) * cfg.hidden_size]
        assert rel_err(got, ref[layer][0]) < 1e-5, f"aux hidden state of layer {layer}"
    assert rel_err(hidden[:4], ref[-1][0]) < 1e-5, "final (normed) hidden states"


@pytest.mark.interpreter
def test_decode_step_logits_take_each_row_without_a_gather():
    """A decode step (one token a request, as many padded tokens as padded requests):
    the metadata says request r's token is row r (last_is_row), so the logits are the
    lm_head of every row as it is, padded requests' from their own padding rows, and the
    real requests' equal the gathered ones. A prefill, or padding that leaves more tokens
    than requests, keeps the gather."""
    cfg = tiny_config(num_layers=2)
    model = random_causal_lm(cfg, seed=5)
    runner = PagedRunner(cfg, "cpu")
    meta = runner.step([(0, [5, 9, 2]), (1, [1, 3])], pad_reqs=1, pad_tokens=1)
    assert not meta.last_is_row
    model(meta.input_ids, meta, runner.cache)
    meta = runner.step([(0, [4]), (1, [7])], pad_reqs=2, pad_tokens=2)
    assert meta.last_is_row and meta.num_tokens == meta.num_reqs == 4
    hidden, logits = model(meta.input_ids, meta, runner.cache)
    assert logits.shape == (4, cfg.vocab_size) and torch.isfinite(logits).all()
    torch.testing.assert_close(logits, model.lm_head(hidden), rtol=0, atol=0)
    assert not torch.equal(logits[2], logits[0]), "padded rows read their own rows"
    gathered = dataclasses.replace(meta, last_is_row=False)
    _, want = model(meta.input_ids, gathered, runner.cache)  # rewrites the same K/V
    torch.testing.assert_close(logits[:2], want[:2])
    torch.testing.assert_close(want[2:], want[:1].expand(2, -1))  # the gather: row 0
    uneven = runner.step([(0, [6]), (1, [8])], pad_reqs=1, pad_tokens=2)
    assert not uneven.last_is_row


# ---- GPU: bf16 on a mid-size config, and the forward under CUDA-graph replay ----------

GPU_CASES = {
    "llama3": dict(model_type="llama", rope=dataclasses.replace(LLAMA3_ROPE, theta=500000.0)),
    "qwen2": dict(model_type="qwen2", rope=RopeConfig(theta=1e6), rms_norm_eps=1e-6),
}


def mid_config(**kw):
    base = dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        # two layers: bf16 rounding alone moves transformers' logits by ~0.45% per layer
        # of this config (measured against float32 on the CPU), and the bar is 2%
        num_layers=2,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        dtype=torch.bfloat16,
    )
    return tiny_config(**{**base, **kw})


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_hf_parity_bf16(tmp_path, case):
    cfg = mid_config(**GPU_CASES[case])
    hf = hf_model(cfg, random_weights(cfg, seed=2), tmp_path, dtype=torch.bfloat16).cuda()
    ours = load_causal_lm(tmp_path, device="cuda")
    assert ours.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (300, 37)]
    steps = 8
    refs = [hf_greedy(hf, p, steps, "cuda") for p in prompts]
    # Teacher-forced with transformers' tokens: a bf16 near-tie must not fork the inputs.
    feed = [tokens for _, tokens in refs]
    got, _ = run_paged(
        ours, cfg, prompts, steps, "cuda", feed=feed, max_num_tokens=512, max_model_len=512
    )
    for i, (ref, _) in enumerate(refs):
        errs = [rel_err(got[i][s], ref[s]) for s in range(steps + 1)]
        assert max(errs) < 2e-2, f"request {i}: logits relative errors {errs}"


@pytest.mark.gpu
def test_gpu_decode_step_under_cuda_graph():
    cfg = mid_config(**GPU_CASES["llama3"])
    model = random_causal_lm(cfg, seed=4, device="cuda")
    runner = PagedRunner(cfg, "cuda", max_num_reqs=8, max_num_tokens=256, max_model_len=256)
    prompts = {i: torch.randint(0, cfg.vocab_size, (20 + 7 * i,)).tolist() for i in range(5)}
    meta = runner.step(list(prompts.items()))
    model(meta.input_ids, meta, runner.cache)
    # capture one decode step for the descriptor (8 requests, 8 tokens) on dummy inputs
    cap = runner.builder.prepare_inputs_to_capture(8, 8, 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            model(cap.input_ids, cap, runner.cache)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, graph_logits = model(cap.input_ids, cap, runner.cache)
    for _ in range(3):
        nxt = {i: [int(torch.randint(0, cfg.vocab_size, ()))] for i in prompts}
        meta = runner.step(list(nxt.items()), pad_reqs=3, pad_tokens=3)
        graph.replay()
        got = graph_logits[:5].float().clone()
        # the eager pass rewrites the same K/V rows with the same values
        _, eager = model(meta.input_ids, meta, runner.cache)
        assert rel_err(got, eager[:5]) < 1e-3
