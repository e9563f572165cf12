"""near_ties: the first differing token of a greedy speculative output is scored again in
float32 and in the model's dtype, and called a near-tie only when the float32 gap
between the two chosen tokens is within the model dtype's own error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdraft.dense import target_hidden
from specdraft.models.tiny import random_causal_lm, tiny_config
from specdraft.near_ties import explain_differences, first_difference, summary

CFG = tiny_config()


def top_two(model, ctx: list[int]) -> tuple[int, int, float]:
    ref = random_causal_lm(CFG, seed=0, dtype=torch.float32)
    ref.load_state_dict(model.state_dict())
    h = target_hidden(ref, torch.tensor([ctx]))[0, -1]
    logits = F.linear(h.float(), ref.lm_head.weight.float())
    v, i = logits.topk(2)
    return int(i[0]), int(i[1]), float(v[0] - v[1])


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], []) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_second_choice_is_scored_at_its_point(dtype):
    model = random_causal_lm(CFG, seed=0, dtype=dtype)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    first, second, gap = top_two(model, prompts[0] + [3, 4])
    # request 0: target-only took the float32 top token at output index 2, the
    # "speculative" run the second one; request 1 is the same in both runs
    want = [[3, 4, first, 1], [2, 2, 2]]
    got = [[3, 4, second, 7, 7], [2, 2, 2]]
    before = [p.clone() for p in model.parameters()]
    (d,) = explain_differences(model, prompts, want, got)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # unchanged
    assert model.embed_tokens.weight.dtype == dtype
    assert (d.request, d.index, d.target_token, d.spec_token) == (0, 2, first, second)
    assert d.top_two
    assert d.gap == pytest.approx(gap, rel=1e-4, abs=1e-5)
    if dtype == torch.float32:
        assert d.dtype_error == 0.0  # the reference itself: no error, so no near-tie
        assert not d.near_tie
    else:
        assert d.dtype_error > 0.0
        assert d.near_tie == (abs(gap) <= 2 * d.dtype_error)
    assert "request 0, token 2" in d.line()


def test_a_token_outside_the_top_two_is_not_a_near_tie():
    model = random_causal_lm(CFG, seed=0, dtype=torch.bfloat16)
    ctx = [5, 6, 7]
    first, second, _ = top_two(model, ctx)
    other = next(t for t in range(CFG.vocab_size) if t not in (first, second))
    (d,) = explain_differences(model, [ctx], [[first]], [[other]])
    assert not d.top_two and not d.near_tie


def test_no_difference_and_length_only_differences_score_nothing():
    model = random_causal_lm(CFG, seed=0, dtype=torch.float32)
    assert explain_differences(model, [[1, 2]], [[3, 4]], [[3, 4]]) == []
    assert explain_differences(model, [[1, 2]], [[3, 4]], [[3, 4, 5]]) == []


def test_bad_input_names_the_arguments():
    model = random_causal_lm(CFG, seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="prompts, target_only and speculative"):
        explain_differences(model, [[1]], [[2], [3]], [[2]])


def test_summary():
    model = random_causal_lm(CFG, seed=0, dtype=torch.bfloat16)
    assert summary([], 0) == "yes"
    first, second, _ = top_two(model, [5, 6])
    diffs = explain_differences(model, [[5, 6]], [[first]], [[second]])
    line = summary(diffs, 2)
    assert line.startswith("NO: 2 of the requests differ,")
    assert f"{abs(diffs[0].gap):.3f}" in line
    assert summary([], 1) == "NO: 1 of the requests differ, 0 at near-ties"
