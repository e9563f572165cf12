"""End to end on the embedded SmolLM2-135M-Instruct: specdraft's target-only generate()
against transformers' plain greedy generate() on the same prompts, same run; batch 1, 8,
32. Also: the bare decode-graph step rate (what generate() can at most reach), host time
per decode step, kernel launches per step, startup (load + capture).

    python -m bench.e2e --out results [--gguf PATH] [--new-tokens 128] [--random]
    python -m bench.e2e --spec --out results [--gguf PATH] [--spec-prompts 3] [--k 3]

--spec (the real model, batch 1): speculative decoding, same prompts, same run:
specdraft target-only; specdraft with the shipped EAGLE-1 head and with the target's
first --self-layers (29) layers as the draft; transformers' plain greedy and its
assisted generation with the same 29-layer self-draft as the assistant (transformers
cannot run an EAGLE head: its assistant is a standalone causal LM). Acceptance length
for specdraft from the rejection sampler's counters.

--random: SmolLM2-135M's shapes with seeded random weights (no GGUF needed), prompts of
random token ids as long as the chat prompts; the same weights go into transformers.
Speed does not depend on the weights' values; the text does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from specdraft.batch import ScheduledBatch
from specdraft.cli import DEFAULT_PROMPTS
from specdraft.demo import load_engine
from specdraft.generate import timed_generate
from specdraft.runner import GREEDY_SET


class RandomSetup:
    """Engine and transformers model over the same seeded random SmolLM2-shaped weights."""

    def __init__(self):
        from specdraft.models.tiny import random_weights, smollm2_135m_config

        self.cfg = smollm2_135m_config()
        self.weights = random_weights(self.cfg, seed=0)

    def engine(self, batch: int, device: str = "cuda"):
        """(Engine, load s, capture s); bf16 with graphs on CUDA, float32 eager on a CPU."""
        from specdraft.generate import Engine
        from specdraft.loader import Checkpoint, load_causal_lm
        from specdraft.runner import TargetRunner

        cuda = device == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        t0 = time.perf_counter()
        ckpt = Checkpoint.from_tensors(self.cfg.to_hf(), self.weights)
        dtype = torch.bfloat16 if cuda else torch.float32
        model = load_causal_lm(ckpt, dtype=dtype, device=device, max_positions=1024)
        runner = TargetRunner(
            model, max_num_reqs=batch, max_num_tokens=max(512, batch), max_model_len=1024
        )
        sync()
        t1 = time.perf_counter()
        runner.capture()
        sync()
        return Engine(runner), t1 - t0, time.perf_counter() - t1

    def prompts(self, batch: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(batch)
        return [
            torch.randint(100, 40000, (28 + i % 9,), generator=g).tolist() for i in range(batch)
        ]

    def hf_model(self):
        import transformers

        hf_cfg = transformers.AutoConfig.for_model(**self.cfg.to_hf())
        model = transformers.LlamaForCausalLM(hf_cfg)
        model.load_state_dict(self.weights, strict=False)
        return model.to(torch.bfloat16).cuda().eval()


def prompts_for(tokenizer, batch: int) -> list[list[int]]:
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in DEFAULT_PROMPTS
    ]
    ids = [tokenizer.encode(c, add_special_tokens=False) for c in chats]
    return [ids[i % len(ids)] for i in range(batch)]


def bare_step_us(engine, batch: int, context: int = 256, iters: int = 200) -> float:
    """Median device time of the captured greedy decode graph at `batch` requests of
    `context` tokens (fresh requests, random-ish ids), replayed alone."""
    runner = engine.runner
    manager = runner._graphs[GREEDY_SET]
    desc = manager.dispatch(batch, batch, uniform_token_count=1, max_query_len=1)
    if desc is None:
        return float("nan")
    tables = runner.tables
    ids = list(range(10_000, 10_000 + batch))
    for rid in ids:
        tables.add_request(rid, context)
    sched = ScheduledBatch(
        ids,
        np.arange(batch, dtype=np.int64) + 100,
        np.ones(batch, dtype=np.int64),
        np.full(batch, context - 1, dtype=np.int64),
    )
    runner.builder.build(
        sched,
        num_reqs_padded=desc.num_reqs,
        num_tokens_padded=desc.num_tokens,
        max_query_len=desc.max_query_len,
    )
    for _ in range(10):
        manager.replay(desc)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters // 5):
            manager.replay(desc)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / (iters // 5))
    for rid in ids:
        tables.remove_request(rid)
    return statistics.median(times)


def launches_per_step(engine, batch: int) -> int:
    """CUDA kernels in one eager decode step (what a graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    runner = engine.runner
    tables = runner.tables
    ids = list(range(20_000, 20_000 + batch))
    for rid in ids:
        tables.add_request(rid, 64)
    sched = ScheduledBatch(
        ids,
        np.arange(batch, dtype=np.int64) + 5,
        np.ones(batch, dtype=np.int64),
        np.full(batch, 63, dtype=np.int64),
    )
    meta = runner.builder.build(sched)
    runner._forward(meta, greedy=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner._forward(meta, greedy=True)
        torch.cuda.synchronize()
    for rid in ids:
        tables.remove_request(rid)
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def host_us_per_step(engine, ids: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """Host time per step over the decode steps of one generate() call, as medians:
    (launch, busy). launch: from Engine.step's start until the step is enqueued
    (schedule, build, dispatch, replay, readback enqueue; on the steady path one
    decode_next); busy: the whole step minus the time blocked waiting for the previous
    step's tokens (launch plus reading, stop checks and bookkeeping)."""
    from specdraft import runner as runner_mod

    launch: list[float] = []
    busy: list[float] = []
    t = {"start": 0.0, "wait": 0.0, "launched": 0.0}
    step, launch_slow, decode_next = engine.step, engine._launch, engine.runner.decode_next
    wait = runner_mod.Readback.wait

    def mark(fn):
        def run(*a, **kw):
            out = fn(*a, **kw)
            t["launched"] = time.perf_counter()
            return out

        return run

    def timed_wait(self):
        t0 = time.perf_counter()
        out = wait(self)
        t["wait"] += time.perf_counter() - t0
        return out

    def timed_step():
        t["start"], t["wait"] = time.perf_counter(), 0.0
        step()
        end = time.perf_counter()
        launch.append(t["launched"] - t["start"])
        busy.append(end - t["start"] - t["wait"])

    engine.step, engine._launch = timed_step, mark(launch_slow)
    engine.runner.decode_next = mark(decode_next)
    runner_mod.Readback.wait = timed_wait
    try:
        engine.generate(ids, max_new_tokens=new_tokens, stop_token_ids=[])
    finally:
        engine.step, engine._launch, engine.runner.decode_next = step, launch_slow, decode_next
        runner_mod.Readback.wait = wait
    out = []
    for name, xs in (("launch", launch), ("busy", busy)):
        q = statistics.quantiles([1e6 * x for x in xs[2:]], n=10)
        print(f"host us per step, {name}: p10 {q[0]:.1f} p50 {q[4]:.1f} p90 {q[8]:.1f}")
        out.append(1e6 * statistics.median(xs[2:]))
    return out[0], out[1]


def hf_greedy_tok_s(model, ids: list[list[int]], new_tokens: int) -> float:
    """transformers' plain greedy generate() on the same prompts, left-padded batch;
    every row runs new_tokens steps (no EOS)."""
    width = max(len(x) for x in ids)
    inp = torch.tensor([[0] * (width - len(x)) + x for x in ids], device="cuda")
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device="cuda")
    kw = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    model.generate(inp[:, :], attention_mask=mask, **dict(kw, max_new_tokens=4))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(inp, attention_mask=mask, **kw)
    torch.cuda.synchronize()
    return (out.shape[1] - width) * len(ids) / (time.perf_counter() - t0)


def hf_greedy_one_at_a_time_tok_s(model, ids: list[list[int]], new_tokens: int) -> float:
    """hf_greedy_tok_s at batch 1 over each prompt in turn: tokens over the total time."""
    rates = [hf_greedy_tok_s(model, [x], new_tokens) for x in ids]
    return len(rates) / sum(1 / r for r in rates)


def spec_comparison(path: str, n_prompts: int, new_tokens: int, k: int, layers: int) -> list:
    """Rows (system, tok/s, speedup over specdraft target-only, AL) at batch 1."""
    import copy

    import transformers

    from specdraft.drafter import Drafter
    from specdraft.embedded import shipped_draft_path
    from specdraft.loader import load_draft
    from specdraft.models.llama import layer_truncated
    from specdraft.speculative import SpeculativeEngine

    engine, _, _ = load_engine(path, device="cuda", dtype=torch.bfloat16, max_num_reqs=1,
                               max_model_len=1024, graphs=True)  # fmt: skip
    runner, tok = engine.runner, engine.tokenizer
    ids = prompts_for(tok, n_prompts)
    kw = dict(max_new_tokens=new_tokens, stop_token_ids=[])
    engine.generate(ids[:1], max_new_tokens=4, stop_token_ids=[])
    outs, secs = timed_generate(engine, ids, **kw)
    base = sum(len(o.token_ids) for o in outs) / secs
    rows = [{"system": "specdraft target-only", "tok_s": round(base, 1), "speedup": 1.0}]
    drafts = [
        ("specdraft + shipped EAGLE-1 head", load_draft(
            shipped_draft_path(), target=runner.model, dtype=torch.bfloat16, device="cuda",
            max_positions=1024)),
        (f"specdraft + first {layers} layers", layer_truncated(runner.model, layers)),
    ]  # fmt: skip
    for name, draft in drafts:
        drafter = Drafter(draft, max_num_reqs=1, k_max_options=(k,), max_model_len=1024)
        se = SpeculativeEngine(runner, drafter, k=k, tokenizer=tok)
        se.generate(ids[:1], max_new_tokens=4, stop_token_ids=[])
        se.stats.proposed, se.stats.accepted = [0] * k, [0] * k
        outs, secs = timed_generate(se, ids, **kw)
        rate = sum(len(o.token_ids) for o in outs) / secs
        rows.append({"system": f"{name}, k {k}", "tok_s": round(rate, 1),
                     "speedup": round(rate / base, 3),
                     "al": round(se.stats.acceptance_length, 3)})  # fmt: skip
        drafter.teardown()
    p = Path(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        p.parent, gguf_file=p.name, torch_dtype=torch.bfloat16
    )
    hf = hf.cuda().eval()
    plain = hf_greedy_one_at_a_time_tok_s(hf, ids, new_tokens)
    rows.append({"system": "transformers greedy", "tok_s": round(plain, 1),
                 "speedup": round(plain / base, 3)})  # fmt: skip
    assistant = copy.deepcopy(hf)
    assistant.model.layers = assistant.model.layers[:layers]
    assistant.config.num_hidden_layers = layers
    n_tok, t_all = 0, 0.0
    for x in ids:
        inp = torch.tensor([x], device="cuda")
        gen = dict(
            do_sample=False,
            assistant_model=assistant,
            num_assistant_tokens=k,
            num_assistant_tokens_schedule="constant",
            pad_token_id=0,
            eos_token_id=None,
        )
        hf.generate(inp, max_new_tokens=4, **gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf.generate(inp, max_new_tokens=new_tokens, **gen)
        torch.cuda.synchronize()
        t_all += time.perf_counter() - t0
        n_tok += out.shape[1] - inp.shape[1]
    rows.append({"system": f"transformers assisted (first {layers} layers), k {k}",
                 "tok_s": round(n_tok / t_all, 1),
                 "speedup": round(n_tok / t_all / base, 3)})  # fmt: skip
    runner.teardown()
    return rows


def main(argv=None) -> int:
    from tests.hf_compat import hide_repo_kernels_from_transformers

    hide_repo_kernels_from_transformers()  # transformers >= 5.25 would import our kernels/
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--random", action="store_true", help="random SmolLM2-shaped weights")
    ap.add_argument("--spec", action="store_true", help="speculative decoding, batch 1")
    ap.add_argument("--spec-prompts", type=int, default=3)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--self-layers", type=int, default=29)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.e2e needs a GPU")
        return 0
    if args.spec:
        from specdraft.embedded import smollm2_gguf_path

        path = str(args.gguf or smollm2_gguf_path())
        rows = spec_comparison(path, args.spec_prompts, args.new_tokens, args.k, args.self_layers)
        head = f"batch 1, {args.spec_prompts} chat prompts x {args.new_tokens} tokens, bf16; "
        head += f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
        lines = [head, "", "| system | tok/s | over specdraft target-only | AL |",
                 "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['system']} | {r['tok_s']} | {r['speedup']} | {r.get('al', '-')} |"
                  for r in rows]  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "e2e_spec.json").write_text(json.dumps(rows, indent=1))
        (args.out / "e2e_spec.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0
    hf_model = None
    if args.random:
        setup = RandomSetup()
        if not args.no_hf:
            hf_model = setup.hf_model()
    else:
        from specdraft.embedded import smollm2_gguf_path

        path = str(
            smollm2_gguf_path(wheel=args.gguf)
            if args.gguf is None or args.gguf.endswith(".whl")
            else args.gguf
        )
        if not args.no_hf:
            import transformers

            p = Path(path)
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(
                p.parent, gguf_file=p.name, torch_dtype=torch.bfloat16
            )
            hf_model = hf_model.cuda().eval()
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        if args.random:
            engine, load_s, capture_s = setup.engine(batch)
            ids = setup.prompts(batch)
        else:
            engine, load_s, capture_s = load_engine(
                path,
                device="cuda",
                dtype=torch.bfloat16,
                max_num_reqs=batch,
                max_model_len=1024,
                graphs=True,
            )
            ids = prompts_for(engine.tokenizer, batch)
        # warm-up: the same batch, so the prefill's kernel variants compile untimed
        engine.generate(ids, max_new_tokens=4, stop_token_ids=[])
        runner = engine.runner
        counts0 = (runner.steps, runner.graph_steps, runner.advanced_steps)
        # Every request runs new_tokens steps: stop ids off, so all rows stay busy.
        outs, secs = timed_generate(engine, ids, max_new_tokens=args.new_tokens, stop_token_ids=[])
        n = sum(len(o.token_ids) for o in outs)
        counts = [
            a - b
            for a, b in zip((runner.steps, runner.graph_steps, runner.advanced_steps), counts0)
        ]
        tok_s = n / secs
        step_us = bare_step_us(engine, batch)
        host_us, busy_us = host_us_per_step(engine, ids, 64)
        hf = None if hf_model is None else hf_greedy_tok_s(hf_model, ids, args.new_tokens)
        row = {
            "batch": batch,
            "tokens": n,
            "generate_tok_s": round(tok_s, 1),
            "bare_step_us": round(step_us, 1),
            "bare_tok_s": round(batch * 1e6 / step_us, 1),
            "generate_over_bare": round(tok_s / (batch * 1e6 / step_us), 3),
            "host_us_per_step": round(host_us, 1),
            "host_busy_us_per_step": round(busy_us, 1),
            "launches_per_step": None,  # counted after every batch's timings (below)
            "load_s": round(load_s, 2),
            "capture_s": round(capture_s, 2),
            "hf_greedy_tok_s": None if hf is None else round(hf, 1),
            "ours_over_hf": None if hf is None else round(tok_s / hf, 2),
            "steps_graph_advanced": counts,
            "weights": "random" if args.random else "GGUF",
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
        engine.runner.teardown()
        del engine
        torch.cuda.empty_cache()
    # Kernel launches per step come from the profiler, which leaves its CUDA callbacks
    # installed for the rest of the process (tens of µs on every later launch): so they
    # are counted last, on engines built again, after every host time is measured.
    for row in rows:
        batch = row["batch"]
        engine = setup.engine(batch)[0] if args.random else load_engine(
            path, device="cuda", dtype=torch.bfloat16, max_num_reqs=batch,
            max_model_len=1024, graphs=True,
        )[0]  # fmt: skip
        row["launches_per_step"] = launches_per_step(engine, batch)
        engine.runner.teardown()
        del engine
        torch.cuda.empty_cache()
    env = {
        "model": "SmolLM2-135M shapes, " + ("random weights" if args.random else "GGUF Q4_1"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "e2e.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    cols = [
        "batch",
        "generate_tok_s",
        "bare_tok_s",
        "generate_over_bare",
        "bare_step_us",
        "host_us_per_step",
        "host_busy_us_per_step",
        "launches_per_step",
        "load_s",
        "capture_s",
        "hf_greedy_tok_s",
        "ours_over_hf",
    ]
    lines = [
        f"{env['model']}, bf16; {env['gpu']}, torch {env['torch']}, triton "
        f"{env['triton']}, {env['date']}",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    (args.out / "e2e.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
