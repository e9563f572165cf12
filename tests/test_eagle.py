"""EAGLE-1 and EAGLE-3 heads against a float64 PyTorch reference of the same math, run
through the paged cache (a padded prefill, then steps that feed back the head's own
hidden state), loaded from checkpoint directories written in their layouts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdraft.loader import Checkpoint, load_eagle3_head, load_eagle_head
from specdraft.models.tiny import (
    eagle_config,
    random_causal_lm,
    random_eagle3_weights,
    random_eagle_weights,
    tiny_config,
    write_checkpoint,
)
from tests.model_helpers import PagedRunner, RefEagle, rel_err

pytestmark = pytest.mark.no_overflow_check  # see conftest

TOL = 1e-4


def run_head_steps(
    head, ref, cfg, first_width: int, *, steps=3, to_target=None, device="cpu", tol=TOL
):
    """A padded prefill of two requests with random input hidden states of width
    first_width, then `steps` one-token steps feeding back each request's last output
    hidden state and greedy token. Every output row is checked against `ref`."""
    g = torch.Generator().manual_seed(7)
    runner = PagedRunner(cfg, device, max_num_reqs=4, max_num_tokens=32, max_model_len=64)
    prompts = {"a": [3, 17, 5, 250, 9, 1], "b": [42, 7, 100]}
    feats = {
        r: torch.randn(len(p), first_width, generator=g).to(device, head.dtype)
        for r, p in prompts.items()
    }
    reqs, width, pad_tokens = list(prompts.items()), first_width, 2
    for step in range(steps + 1):
        meta = runner.step(reqs, pad_reqs=1, pad_tokens=pad_tokens)
        hidden_in = torch.zeros(meta.num_tokens, width, device=device, dtype=head.dtype)
        hidden_in[: meta.num_real_tokens] = torch.cat([feats[r] for r, _ in reqs])
        out, logits = head(meta.input_ids, hidden_in, meta, runner.cache)
        assert out.shape == (meta.num_tokens, cfg.hidden_size)
        assert torch.isfinite(out).all() and torch.isfinite(logits).all(), "padding is finite"
        start, nxt = 0, []
        for i, (rid, toks) in enumerate(reqs):
            n = len(toks)
            pos = torch.arange(runner.lens[rid] - n, runner.lens[rid])
            ref_out, ref_logits = ref(rid, torch.tensor(toks), feats[rid], pos)
            assert rel_err(out[start : start + n], ref_out) < tol, f"step {step} {rid} hidden"
            assert rel_err(logits[i], ref_logits) < tol, f"step {step} {rid} logits"
            tok = logits[i].argmax()
            nxt.append((rid, [int(tok if to_target is None else to_target(tok))]))
            feats[rid] = out[start + n - 1 : start + n]
            start += n
        reqs, width, pad_tokens = nxt, cfg.hidden_size, 1


@pytest.mark.interpreter
@pytest.mark.parametrize("fc_bias", [True, False])
def test_eagle1_head_matches_reference(tmp_path, fc_bias):
    tcfg = tiny_config()
    target = random_causal_lm(tcfg, seed=1)
    hcfg = eagle_config(tcfg)
    w = random_eagle_weights(hcfg, seed=2, fc_bias=fc_bias)
    head = load_eagle_head(write_checkpoint(tmp_path, hcfg, w), target=target)
    assert head.embed_tokens is target.embed_tokens and head.lm_head is target.lm_head
    assert head.layers[0].input_layernorm is None and (head.fc.bias is not None) == fc_bias
    ref = RefEagle(w, hcfg, target.embed_tokens.weight, target.lm_head.weight, eagle3=False)
    run_head_steps(head, ref, hcfg, hcfg.hidden_size)


@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(norm_before_residual=True),
        dict(target_hidden_size=48, model_type="qwen2", qkv_bias=True),
    ],
    ids=["default", "norm-before-residual", "narrow-target-qwen2"],
)
@pytest.mark.interpreter
def test_eagle3_head_matches_reference(tmp_path, variant):
    hcfg = eagle_config(tiny_config(), draft_vocab_size=100, **variant)
    w = random_eagle3_weights(hcfg, seed=3)
    path = write_checkpoint(tmp_path, hcfg, w, architectures=["LlamaForCausalLMEagle3"])
    head = load_eagle3_head(path)
    assert head.fc.in_features == hcfg.fc_input_size and head.lm_head.out_features == 100
    assert torch.equal(head.d2t, w["d2t"])
    ref = RefEagle(w, hcfg, w["embed_tokens.weight"], w["lm_head.weight"], eagle3=True)
    run_head_steps(head, ref, hcfg, hcfg.fc_input_size, to_target=head.draft_to_target)


@pytest.mark.interpreter
@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle1", "eagle3"])
def test_hidden_rows_reads_the_rows_it_names(eagle3):
    """A head's forward with hidden_rows over a state table (how a draft round feeds the
    states it carries) equals the forward over the gathered rows, bit for bit, on the
    fused decode path (EAGLE-1: fc forms its input on load) and with many rows; bad
    hidden_rows get an error naming them with the cache unchanged."""
    tcfg = tiny_config()
    target = random_causal_lm(tcfg, seed=1)
    hcfg = eagle_config(tcfg, **(dict(draft_vocab_size=100) if eagle3 else {}))
    if eagle3:
        head = load_eagle3_head(
            Checkpoint.from_tensors(hcfg.to_hf(), random_eagle3_weights(hcfg, seed=3))
        )
    else:
        w = random_eagle_weights(hcfg, seed=2)
        head = load_eagle_head(Checkpoint.from_tensors(hcfg.to_hf(), w), target=target)
    h = hcfg.hidden_size
    for n in (3, 12):  # fused decode path / past it
        runner = PagedRunner(hcfg, "cpu", max_num_reqs=4, max_num_tokens=32, max_model_len=64)
        meta = runner.step([(0, list(range(1, n + 1)))])
        table = torch.randn(n + 5, h).to(head.dtype)
        rows = torch.randint(0, n + 5, (n,))
        before = runner.cache.data.clone()
        for bad, exc in ((rows.int(), TypeError), (rows[:-1], ValueError),
                         (rows.clone().fill_(n + 5), ValueError)):  # fmt: skip
            with pytest.raises(exc, match="hidden_rows"):
                head(meta.input_ids, table, meta, runner.cache, hidden_rows=bad)
            assert torch.equal(runner.cache.data, before)
        out, logits = head(meta.input_ids, table, meta, runner.cache, hidden_rows=rows)
        runner.cache.data.copy_(before)
        ref_out, ref_logits = head(meta.input_ids, table[rows], meta, runner.cache)
        assert torch.equal(out, ref_out) and torch.equal(logits, ref_logits), n


def test_eagle3_d2t_mapping():
    hcfg = eagle_config(tiny_config(), draft_vocab_size=60)
    w = random_eagle3_weights(hcfg, seed=4)
    head = load_eagle3_head(Checkpoint.from_tensors(hcfg.to_hf(), w))
    draft = torch.arange(60)
    target_ids = head.draft_to_target(draft)
    assert torch.equal(target_ids, w["t2d"].nonzero().flatten()), "draft ids map onto t2d"
    assert torch.equal(head.draft_to_target(draft.view(6, 10)), target_ids.view(6, 10))
    logits = torch.randn(5, 60)
    full = head.logits_to_target(logits)
    assert full.shape == (5, hcfg.vocab_size)
    assert torch.equal(full[:, target_ids], logits)
    assert torch.isneginf(full[:, ~w["t2d"]]).all()
    assert torch.equal(full.argmax(-1), head.draft_to_target(logits.argmax(-1)))


def _eagle1(seed=5):
    tcfg = tiny_config()
    target = random_causal_lm(tcfg, seed=seed + 100)
    hcfg = eagle_config(tcfg)
    head = load_eagle_head(
        Checkpoint.from_tensors(hcfg.to_hf(), random_eagle_weights(hcfg, seed=seed)),
        target=target,
    )
    return head, target, tcfg


@pytest.mark.parametrize("int8", [False, True])
def test_reduce_vocab_gives_the_head_its_rows_and_d2t(int8):
    """reduce_vocab(ids): the head's own lm_head of those rows (an int8 one keeps its
    rows and scales), draft id d -> the d-th smallest id, the target's lm_head left as
    it was, and the head's logits the full head's logits at those ids."""
    from specdraft.layers import Int8Linear, quantize_lm_head

    head, target, tcfg = _eagle1()
    before = target.lm_head.weight.clone()
    if int8:
        quantize_lm_head(head)
    full = head.lm_head
    ids = torch.randperm(tcfg.vocab_size, generator=torch.Generator().manual_seed(1))[:90]
    assert not head.reduced and head.reduce_vocab(ids) is head and head.reduced
    keep = ids.sort().values
    assert head.draft_vocab_size == 90
    assert torch.equal(head.draft_to_target(torch.arange(90)), keep)
    lm = head.lm_head
    if int8:
        assert isinstance(lm, Int8Linear)
        assert torch.equal(lm.weight, full.weight[keep]) and torch.equal(lm.scale, full.scale[keep])
    else:
        assert torch.equal(lm.weight, full.weight[keep]) and lm.weight is not full.weight
    assert torch.equal(target.lm_head.weight, before) and target.lm_head is not lm
    x = torch.randn(4, tcfg.hidden_size)
    from specdraft import ops

    with ops.use_backend("torch"):
        want, got = full(x), lm(x)
    torch.testing.assert_close(got, want[:, keep], rtol=0, atol=0)
    scattered = head.logits_to_target(got)
    assert torch.equal(scattered[:, keep], got)
    outside = torch.ones(tcfg.vocab_size, dtype=torch.bool)
    outside[keep] = False
    assert torch.isneginf(scattered[:, outside]).all()


@pytest.mark.parametrize(
    "token_ids, exc, match",
    [
        ([], ValueError, "token_ids must be 1-D and non-empty"),
        ([3, 5, 3], ValueError, "token_ids repeats token 3"),
        ([0, -1], ValueError, r"token_ids must lie in \[0, 256\), got -1\.\.0"),
        ([1, 256], ValueError, r"token_ids must lie in \[0, 256\), got 1\.\.256"),
        (torch.tensor([[1, 2]]), ValueError, "token_ids must be 1-D"),
        (torch.tensor([1.0, 2.0]), TypeError, "must hold integers, got dtype torch.float32"),
        ([1, 2.0], TypeError, "token_ids must hold ints, got float 2.0"),
        ([True, 2], TypeError, "token_ids must hold ints, got bool True"),
        (7, TypeError, "token_ids must be a sequence or tensor of ints, got int"),
    ],
)
def test_reduce_vocab_bad_input_changes_nothing(token_ids, exc, match):
    head, target, tcfg = _eagle1()
    assert tcfg.vocab_size == 256
    lm = head.lm_head
    w = lm.weight.clone()
    with pytest.raises(exc, match=match):
        head.reduce_vocab(token_ids)
    assert head.lm_head is lm and torch.equal(lm.weight, w) and not head.reduced
    assert not hasattr(head, "d2t") and not hasattr(head, "draft_vocab_size")


def test_reduce_vocab_refuses_a_second_reduction_and_a_biased_head():
    head, target, tcfg = _eagle1()
    head.reduce_vocab([1, 2, 3])
    lm, d2t = head.lm_head, head.d2t.clone()
    with pytest.raises(ValueError, match="already has a draft vocabulary of 3 tokens"):
        head.reduce_vocab([4, 5])
    assert head.lm_head is lm and torch.equal(head.d2t, d2t)
    other, _, _ = _eagle1()
    from specdraft.layers import Linear

    biased = Linear(tcfg.hidden_size, tcfg.vocab_size, bias=True, dtype=torch.float32, device="cpu")
    other.lm_head = biased
    with pytest.raises(TypeError, match="lm_head must be a bias-free"):
        other.reduce_vocab([1, 2])
    assert other.lm_head is biased and not other.reduced


def test_reduce_vocab_after_a_drafter_is_built_is_refused():
    """A Drafter fixes at build whether it maps draft ids (stop 43's review: reducing the
    head afterwards made greedy rounds propose draft ids as target ids, silently)."""
    from specdraft.drafter import Drafter

    head, target, tcfg = _eagle1()
    Drafter(head, max_num_reqs=2, k_max_options=(1,), max_model_len=64, cuda_graphs=False)
    lm = head.lm_head
    with pytest.raises(ValueError, match="reduce_vocab must come before a Drafter is built"):
        head.reduce_vocab([1, 2, 3])
    assert head.lm_head is lm and not head.reduced and not hasattr(head, "d2t")
    other, _, _ = _eagle1()  # the usual order still works
    Drafter(other.reduce_vocab([1, 2, 3]), max_num_reqs=2, k_max_options=(1,),
            max_model_len=64, cuda_graphs=False)  # fmt: skip
    assert other.reduced


def test_vocabulary_maps_of_a_head_without_a_draft_vocabulary_are_the_identity():
    head, target, tcfg = _eagle1()
    ids = torch.tensor([[0, 7], [255, 3]])
    logits = torch.randn(2, tcfg.vocab_size)
    assert torch.equal(head.draft_to_target(ids), ids)
    assert head.logits_to_target(logits) is logits


@pytest.mark.parametrize("as_numpy", ["array", "list"])
def test_reduce_vocab_takes_numpy_integers(as_numpy):
    import numpy as np

    head, target, tcfg = _eagle1()
    ids = np.array([9, 2, 40], dtype=np.int64)
    head.reduce_vocab(ids if as_numpy == "array" else list(ids))
    assert torch.equal(head.draft_to_target(torch.arange(3)), torch.tensor([2, 9, 40]))


def test_head_checkpoint_layout_variants(tmp_path):
    """EAGLE-1 with "model."-prefixed names in shards and its own embedding and lm_head;
    EAGLE-3 spelled with layers.0 instead of midlayer and no embedding (the target's)."""
    tcfg = tiny_config()
    target = random_causal_lm(tcfg, seed=1)
    hcfg = eagle_config(tcfg)
    w = random_eagle_weights(hcfg, seed=5, with_embed=True)
    w["lm_head.weight"] = torch.randn(tcfg.vocab_size, tcfg.hidden_size)
    prefixed = {"model." + k if k != "lm_head.weight" else k: v for k, v in w.items()}
    head = load_eagle_head(write_checkpoint(tmp_path / "e1", hcfg, prefixed, num_shards=3))
    assert head.owns_embed and head.owns_lm_head
    assert torch.equal(head.embed_tokens.weight, w["embed_tokens.weight"])
    assert torch.equal(
        head.layers[0].self_attn.o_proj.weight, w["layers.0.self_attn.o_proj.weight"]
    )
    q, k, v = (w[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(head.layers[0].self_attn.qkv_proj.weight, torch.cat([q, k, v]))

    h3 = eagle_config(tcfg, draft_vocab_size=64)
    w3 = random_eagle3_weights(h3, seed=6, with_embed=False)
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in w3.items()}
    path = write_checkpoint(tmp_path / "e3", h3, renamed, dtype=torch.float16)
    head3 = load_eagle3_head(path, target=target)
    assert head3.embed_tokens is target.embed_tokens and head3.dtype == torch.float32
    gate, up = w3["midlayer.mlp.gate_proj.weight"], w3["midlayer.mlp.up_proj.weight"]
    expect = torch.cat([gate, up]).half().float()
    assert torch.equal(head3.layers[0].mlp.gate_up_proj.weight, expect)
    assert torch.equal(
        head3.layers[0].hidden_norm.weight, w3["midlayer.hidden_norm.weight"].half().float()
    )
    half = load_eagle3_head(path, target=target, dtype="float16")
    assert half.fc.weight.dtype == torch.float16 and half.d2t.dtype == torch.int64


def test_head_config_mismatch_with_target(tmp_path):
    target = random_causal_lm(tiny_config(), seed=1)
    hcfg = eagle_config(tiny_config(vocab_size=300))
    path = write_checkpoint(tmp_path, hcfg, random_eagle_weights(hcfg, seed=2))
    with pytest.raises(ValueError, match="vocab_size 300 differs from the target's 256"):
        load_eagle_head(path, target=target)
    small = dataclasses.replace(hcfg, vocab_size=256, hidden_size=32, intermediate_size=40)
    path = write_checkpoint(tmp_path / "s", small, random_eagle_weights(small, seed=2))
    with pytest.raises(ValueError, match="hidden_size 32 differs"):
        load_eagle_head(path, target=target)


@pytest.mark.gpu
@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle1", "eagle3"])
def test_gpu_heads_bf16(eagle3):
    """Both heads in bf16 at a mid-size shape against the float64 reference (over the
    bf16-rounded weights and inputs): the CUDA kernels at 2h-wide attention inputs."""
    tcfg = tiny_config(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        dtype=torch.bfloat16,
    )
    hcfg = eagle_config(tcfg, draft_vocab_size=8000 if eagle3 else None)
    if eagle3:
        w = random_eagle3_weights(hcfg, seed=3)
        head = load_eagle3_head(Checkpoint.from_tensors(hcfg.to_hf(), w), device="cuda")
        embed, lm_head, first = w["embed_tokens.weight"], w["lm_head.weight"], hcfg.fc_input_size
    else:
        target = random_causal_lm(tcfg, seed=1, device="cuda")
        w = random_eagle_weights(hcfg, seed=2)
        head = load_eagle_head(Checkpoint.from_tensors(hcfg.to_hf(), w), target=target)
        embed, lm_head = target.embed_tokens.weight, target.lm_head.weight
        first = hcfg.hidden_size
    assert head.dtype == torch.bfloat16
    rounded = {k: v.bfloat16() if v.is_floating_point() else v for k, v in w.items()}
    ref = RefEagle(rounded, hcfg, embed.bfloat16(), lm_head.bfloat16(), eagle3=eagle3)
    to_target = head.draft_to_target if eagle3 else None
    run_head_steps(head, ref, hcfg, first, to_target=to_target, device="cuda", tol=2e-2)
