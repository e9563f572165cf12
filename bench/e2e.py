"""End to end on the embedded SmolLM2-135M-Instruct: specdraft's target-only generate()
against transformers' plain greedy generate() on the same prompts, same run; batch 1, 8,
32. Also: the bare decode-graph step rate (what generate() can at most reach), host time
per decode step, kernel launches per step, startup (load + capture).

    python -m bench.e2e --out results [--gguf PATH] [--new-tokens 128] [--random]

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--random", action="store_true", help="random SmolLM2-shaped weights")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.e2e needs a GPU")
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
