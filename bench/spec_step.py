"""Anatomy of one speculative step: the target's decode step, the draft round, the
verification step and the rejection sampler each timed alone, then speculative
generate() as a whole, in the same run, with where the wall time goes (GPU busy time
from the profiler against the wall).

    python -m bench.spec_step --out results [--batch 1] [--k 3] [--random] [--gguf PATH]

Default: the embedded SmolLM2-135M-Instruct and the EAGLE-1 head shipped for it, on the
held-out chat prompts. --random: the same shapes with seeded random weights (no GGUF;
acceptance is then near zero, the step costs are the same).

Issue 12's bar: wall time per emitted token within 10% of (verify + draft round) / AL.

--hf (real model only): transformers' plain greedy generate() on the first five prompts,
same run. transformers' assisted generation cannot run an EAGLE head (its assistant is a
standalone causal LM; an EAGLE head reads the target's hidden states), so plain greedy
is the peer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.common import host_us
from specdraft.drafter import Drafter
from specdraft.generate import Engine, timed_generate
from specdraft.runner import TargetRunner
from specdraft.sampling import SamplingParams
from specdraft.speculative import SpeculativeEngine

MAX_LEN = 1024


def _models(random: bool, gguf: str | None, device: str):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if random:
        from specdraft.models.tiny import (
            eagle_config,
            random_causal_lm,
            random_eagle_head,
            smollm2_135m_config,
        )

        cfg = smollm2_135m_config()
        target = random_causal_lm(cfg, seed=0, dtype=dtype, device=device, max_positions=MAX_LEN)
        head = random_eagle_head(eagle_config(cfg), target, seed=1, max_positions=MAX_LEN)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(100, 40000, (40,), generator=g).tolist() for _ in range(21)]
        return target, head, None, prompts
    from specdraft.data import load_prompts
    from specdraft.embedded import shipped_draft_path, smollm2_gguf_path
    from specdraft.gguf import load_gguf
    from specdraft.loader import load_draft

    path = gguf or smollm2_gguf_path()
    target, tok = load_gguf(path, device=device, dtype=dtype, max_positions=MAX_LEN)
    head = load_draft(shipped_draft_path(), target=target, dtype=dtype, device=device,
                      max_positions=MAX_LEN)  # fmt: skip
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
            add_special_tokens=False,
        )
        for p in load_prompts("heldout")
    ]
    return target, head, tok, prompts


def _hf_greedy_tok_s(gguf: str | None, prompts: list[list[int]], new_tokens: int) -> float:
    """transformers loading the same GGUF, plain greedy, one prompt at a time."""
    import transformers

    from bench.e2e import hf_greedy_one_at_a_time_tok_s
    from specdraft.embedded import smollm2_gguf_path

    path = Path(gguf or smollm2_gguf_path())
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=torch.bfloat16
    )
    hf = hf.cuda().eval()
    return hf_greedy_one_at_a_time_tok_s(hf, prompts, new_tokens)


def _per_call_us(fn, iters: int, cuda: bool) -> tuple[float, float]:
    """(µs per call for `iters` back-to-back calls, device-timed: the larger of host and
    device time per call; median host µs of one call enqueued on an idle device)."""
    fn()
    host = host_us(fn, 10, cuda=cuda)
    if cuda:
        from bench.draft_round import events_us

        loop = events_us(fn, iters, warmup=0)
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        loop = 1e6 * (time.perf_counter() - t0) / iters
    return loop, statistics.median(host)


def components(se: SpeculativeEngine, batch: int, k: int, iters: int) -> dict[str, tuple]:
    """Each part of a step alone, on `batch` fresh requests of 256 tokens of context."""
    runner, drafter = se.runner, se.drafter
    cuda = runner.device.type == "cuda"
    dev, w, ctx = runner.device, k + 1, 256
    ids = list(range(900_000, 900_000 + batch))
    rows = []
    for rid in ids:
        runner.tables.add_request(rid, ctx + 8 * w)
        rows.append(runner.tables.row_of(rid))
    rows_t = torch.tensor(rows, device=dev)
    runner.committed.index_copy_(0, rows_t, torch.full((batch,), ctx, device=dev))
    runner.sampling.write_rows(rows, [SamplingParams(temperature=0)] * batch)
    vocab = runner.model.cfg.vocab_size
    runner.verify_first[:batch].copy_(torch.randint(100, vocab, (batch,), device=dev))
    runner.verify_drafts[:batch, :k].copy_(torch.randint(100, vocab, (batch, k), device=dev))
    out = {}
    out["verify"] = _per_call_us(lambda: runner.execute_verify(batch, k, rows=rows), iters, cuda)
    logits = runner.execute_verify(batch, k, rows=rows)
    drafts = torch.randint(100, vocab, (batch, k), device=dev)
    params = runner.sampling.select(runner.verify_rows[:batch])
    pos = runner.committed.index_select(0, runner.verify_rows[:batch]) + 1
    out["rejection"] = _per_call_us(lambda: se.rejection(logits, drafts, None, params, pos),
                                    iters, cuda)  # fmt: skip
    hid = None
    if se.eagle:
        h = drafter.hidden_in
        hid = torch.randn(batch, w, h, device=dev, dtype=runner.model.dtype)
    for rid in ids:
        feats = None if hid is None else torch.randn(ctx, drafter.hidden_in, device=dev,
                                                     dtype=runner.model.dtype)  # fmt: skip
        drafter.add_request(rid, list(range(100, 100 + ctx)), SamplingParams(temperature=0), k,
                            target_hidden=feats)  # fmt: skip
        assert drafter.reserve(rid, ctx + (iters + 40) * w)
    verified = torch.randint(100, vocab, (batch, w), device=dev)
    accepted = torch.zeros(batch, dtype=torch.int32, device=dev)
    out["draft round"] = _per_call_us(
        lambda: drafter.propose(
            ids, verified, accepted, k=[k] * batch, k_max=k, target_hidden=hid
        ),  # fmt: skip
        iters,
        cuda,
    )
    for rid in ids:
        drafter.remove_request(rid)
        runner.remove_request(rid)
    return out


def gpu_busy_fraction(se, prompts, new_tokens: int) -> float | None:
    """Sum of CUDA kernel durations over the wall time of a short generate()."""
    if se.runner.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        se.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[])
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    busy = sum(e.device_time_total for e in prof.key_averages()) / 1e6
    return busy / wall


def main(argv=None) -> int:
    from tests.hf_compat import hide_repo_kernels_from_transformers

    hide_repo_kernels_from_transformers()  # transformers >= 5.25 would import our kernels/
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--random", action="store_true")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--hf", action="store_true", help="transformers' plain greedy as a peer")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target, head, tok, prompts = _models(args.random, args.gguf, device)
    b, k = args.batch, args.k
    runner = TargetRunner(target, max_num_reqs=b, max_num_tokens=256, max_model_len=MAX_LEN)
    runner.capture()
    drafter = Drafter(head, max_num_reqs=b, k_max_options=(k,), max_model_len=MAX_LEN)
    se = SpeculativeEngine(runner, drafter, k=k, tokenizer=tok)
    engine = Engine(runner, tok)
    engine.generate(prompts[:b], max_new_tokens=4)  # compile and first-touch, untimed
    se.generate(prompts[:b], max_new_tokens=4)
    base, base_s = timed_generate(engine, prompts, max_new_tokens=args.new_tokens)
    n_base = sum(len(o.token_ids) for o in base)
    se.stats.proposed, se.stats.accepted, se.stats.steps = [0] * k, [0] * k, 0
    outs, secs = timed_generate(se, prompts, max_new_tokens=args.new_tokens)
    n = sum(len(o.token_ids) for o in outs)
    same = sum(o.token_ids == b_.token_ids for o, b_ in zip(outs, base))
    al, steps = se.stats.acceptance_length, se.stats.steps
    parts = components(se, b, k, args.iters)
    from bench.e2e import bare_step_us

    decode_us = bare_step_us(engine, b) if device == "cuda" else float("nan")
    busy = gpu_busy_fraction(se, prompts[:b], 32)
    hf_tok_s = None
    if args.hf and not args.random and device == "cuda":
        hf_tok_s = _hf_greedy_tok_s(args.gguf, prompts[:5], args.new_tokens)
    per_step = 1e6 * secs / max(1, steps)
    model_work = parts["verify"][0] + parts["draft round"][0]
    row = {
        "batch": b,
        "k": k,
        "weights": "random" if args.random else "SmolLM2-135M-Instruct + shipped EAGLE-1 head",
        "target_only_tok_s": round(n_base / base_s, 1),
        "spec_tok_s": round(n / secs, 1),
        "speedup": round(n / secs / (n_base / base_s), 3),
        "acceptance_length": round(al, 3),
        "per_position": [
            round(a / p, 3) if p else None for a, p in zip(se.stats.accepted, se.stats.proposed)
        ],  # fmt: skip
        "greedy_identical_requests": f"{same} of {len(outs)}",
        "steps": steps,
        "wall_us_per_step": round(per_step, 1),
        "decode_step_us": round(decode_us, 1),
        "parts_us_loop_and_host": {name: [round(x, 1) for x in v] for name, v in parts.items()},
        "wall_us_per_token": round(per_step * b / al, 1) if al == al else None,
        "bar_us_per_token": round(1.1 * model_work * b / al, 1) if al == al else None,
        "gpu_busy_fraction": None if busy is None else round(busy, 3),
        "hf_plain_greedy_tok_s_b1": None if hf_tok_s is None else round(hf_tok_s, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spec_step.json").write_text(json.dumps(row, indent=1))
    lines = [f"speculative step anatomy, batch {b}, K {k}, {row['weights']}", ""]
    lines += [
        "| part | µs per call (back to back) | host µs per call (idle GPU) |",
        "|---|---|---|",
    ]
    lines.append(f"| target decode step (graph) | {decode_us:.1f} | |")
    for name, (loop, host) in parts.items():
        lines.append(f"| {name} | {loop:.1f} | {host:.1f} |")
    lines += [
        "",
        f"speculative: {row['spec_tok_s']} tok/s vs target-only {row['target_only_tok_s']} "
        f"({row['speedup']}x); AL {row['acceptance_length']}, per position "
        f"{row['per_position']}; greedy output identical for {same} of {len(outs)} "
        f"requests; {steps} steps, {per_step:.1f} µs per step; wall per token "
        f"{row['wall_us_per_token']} µs against the bar 1.1 x (verify + round) / AL = "
        f"{row['bar_us_per_token']} µs; GPU busy {row['gpu_busy_fraction']} of the wall",
    ]
    if hf_tok_s is not None:
        lines.append(
            f"transformers plain greedy (batch 1, first five prompts): {hf_tok_s:.1f} tok/s; "
            f"speculative over it {row['spec_tok_s'] / hf_tok_s:.1f}x"
        )
    text = "\n".join(lines)
    (args.out / "spec_step.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
