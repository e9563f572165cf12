"""Why a greedy speculative output differs from target-only greedy decoding.

Speculative decoding is greedy-exact in exact arithmetic, but the target scores a draft
block in a verification step (k + 1 rows per request) and a target-only run scores one
row per step: in bf16 the two round differently, and where the target's top two logits
are closer than that rounding, the two runs may pick different tokens and then go on
from different texts. `explain_differences` finds each request's first differing token
and scores that point again in float32 (the reference) and in the model's own dtype
(the same weights, a dense forward): the difference is a near-tie when both chosen
tokens' float32 logits lie within twice the model dtype's own error there (the largest
over those two logits and the float32 top 16) of the float32 best. For the float32 top
two that is their gap; a three-way tie (neither run took the float32 best, both within
the error of it) counts too.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .dense import target_hidden
from .models.llama import LlamaForCausalLM


@dataclass
class Difference:
    request: int
    index: int  # first output position where the runs differ
    target_token: int  # what target-only decoding chose there
    spec_token: int  # what speculative decoding chose there
    gap: float  # float32 logit(target_token) - logit(spec_token) at that point
    dtype_error: float  # max |model-dtype logit - float32 logit|, two tokens and top 16
    top_two: bool  # the two tokens are the float32 top two
    behind: float  # float32 best logit - the lower of the two tokens' logits (>= |gap|)

    @property
    def near_tie(self) -> bool:
        return self.behind <= 2 * self.dtype_error

    def line(self) -> str:
        kind = "near-tie" if self.near_tie else "NOT a near-tie"
        return (
            f"request {self.request}, token {self.index}: target-only {self.target_token}, "
            f"speculative {self.spec_token}; float32 gap {self.gap:.4f}, model-dtype error "
            f"{self.dtype_error:.4f}, below the float32 best {self.behind:.4f} ({kind})"
        )


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where a and b differ (a shorter one differs at its
    end), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def explain_differences(
    model: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    target_only: Sequence[Sequence[int]],
    speculative: Sequence[Sequence[int]],
) -> list[Difference]:
    """One Difference per request whose speculative output differs from its target-only
    output before either ends (a run that only stopped earlier is not scored)."""
    if not len(prompts) == len(target_only) == len(speculative):
        raise ValueError(
            f"prompts, target_only and speculative must have one entry per request, got "
            f"{len(prompts)}, {len(target_only)} and {len(speculative)}"
        )
    found = []
    for i, (a, b) in enumerate(zip(target_only, speculative)):
        j = first_difference(a, b)
        if j is not None and j < min(len(a), len(b)):
            found.append((i, j))
    if not found:
        return []
    ref = copy.deepcopy(model).float()
    out = []
    for i, j in found:
        ctx = list(prompts[i]) + list(target_only[i][:j])
        ids = torch.tensor([ctx], dtype=torch.int64, device=model.embed_tokens.weight.device)
        exact = F.linear(target_hidden(ref, ids)[0, -1], ref.lm_head.weight)
        own = F.linear(target_hidden(model, ids)[0, -1], model.lm_head.weight).float()
        a, b = int(target_only[i][j]), int(speculative[i][j])
        # the dtype's error scale at this point: over the two tokens and the float32 top
        # 16 (one pair's error alone can be small by chance)
        top16 = exact.topk(min(16, exact.numel())).indices
        near = torch.cat([top16, torch.tensor([a, b], device=exact.device)])
        err = float((own[near] - exact[near]).abs().max())
        top = set(exact.topk(2).indices.tolist())
        behind = float(exact.max() - torch.minimum(exact[a], exact[b]))
        out.append(Difference(i, j, a, b, float(exact[a] - exact[b]), err, top == {a, b}, behind))
    del ref
    return out


def summary(diffs: Sequence[Difference], num_differ: int) -> str:
    """One line for a table: "yes" when no request differs, else how many differ and how
    many of those at near-ties (num_differ counts requests whose outputs are unequal,
    including any that only ended at another length)."""
    if not num_differ:
        return "yes"
    ties = sum(d.near_tie for d in diffs)
    gaps = ", ".join(f"{abs(d.gap):.3f}" for d in diffs[:4]) + (", ..." if len(diffs) > 4 else "")
    text = f"NO: {num_differ} of the requests differ, {ties} at near-ties"
    return text + (f" (float32 gaps between the two choices {gaps})" if diffs else "")
