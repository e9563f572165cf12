"""Draft-round benchmark (GPU only): one graph replay per round against K separately
replayed step graphs and against the eager round.

Drafts (random bf16 weights, specdraft.models.tiny): a llama-68m-shaped causal LM, an
EAGLE-1 head for Llama-3-8B (hidden 4096, 32/8 heads, vocab 128256), an EAGLE-1 head
shaped for SmolLM2-135M (hidden 576, 9/3 heads, head_dim 64, vocab 49152); batch 1, 8,
64; K 1, 3, 5, 7; each request with --ctx tokens already in the draft's cache and a
verified block of K + 1 rows with random accepted counts.

Per (draft, batch, K): the round's graph replayed back to back (device time per round);
the same round as K graphs (prefill step, K - 1 decode steps, captured into the round
graphs' memory pool) replayed in sequence; each step graph alone (these four timed in
turns, medians of three); the eager round (propose(eager=True), host launches included).
Host µs, each call after a synchronize, on an idle GPU and behind a spin kernel that
keeps it busy (as in the engine), pooled over three turns: propose() with the bench's
own input tensors (median, p90, the share of rounds that took the steady path: same
batch and inputs as the round before), propose() as the engine calls it (inputs in
Drafter.input_views) and the bare cudaGraphLaunch of the round's graph; then the
engine's steady state, --iters rounds enqueued back to back behind one busy stretch (the
figure the 30 µs bar reads). Graph launches per round (the profiler's cudaGraphLaunch
count, taken last, on drafters built again after every other timing: the profiler slows
every later launch of its process); capture seconds per graph, the drafter's first capture
(Triton compiling or loading its kernels in this process) and a second one (kernels
cached: the bar); the floor (weights and K/V one round reads over the copy bandwidth
measured in the same run). The bars of issue 11 are checked at the end, against
SmolLM2-135M's own decode step (30 layers, batch 1, graph) measured in the same run; the
0.2 bar from the medians of --bar-repeats timings of that step and of the SmolLM2-shaped
head's b1 K3 greedy round, taken in turn.

    python -m bench.draft_round [--out results] [--ctx 256] [--batches 1,8,64]
        [--ks 1,3,5,7] [--cases ...] [--modes greedy] [--iters 30] [--lm-head bf16,int8]
        [--bar-repeats 5] [--merge-in-o] [--act-int8] [--kernels]

--merge-in-o: split attention merged by the O projection (specdraft.layers.MERGE_IN_O_PROJ)
for SmolLM2's step and the drafts alike; --act-int8: the int8 lm_heads quantize their
input rows too (kernels.linear_int8.ACT_INT8). Both are experiments, off by default.

--lm-head int8 gives every draft an int8 copy of its lm_head (per-row scales; bf16,int8:
both, one after the other in the same run): the floor counts its bytes, the bars name it.
A suffix :N (int8:16384) gives the EAGLE-1 heads a draft vocabulary of N ids
(EagleHead.reduce_vocab), as `specdraft generate --draft-vocab N` does for the shipped head.

--kernels: each round graph kernel by kernel as well (torch.profiler, after every other
timing), to show where a round's time goes.
"""

from __future__ import annotations

import argparse
import importlib
import re
import statistics
import sys
from pathlib import Path

import torch

CASES = ("llama-68m", "eagle-llama3-8b", "eagle-smollm2-135m")
DEVICE = "cuda"


def smollm2_config(**overrides):
    from specdraft.models.tiny import smollm2_135m_config

    return smollm2_135m_config(**overrides)


LM_HEAD = re.compile(r"(bf16|int8)(?::([1-9][0-9]*))?")


MAIN_JOB_HEAD = "int8"  # the lm_head the main job gives the shipped head (specdraft.demo)


def build(case: str, max_positions: int, lm_head: str = "bf16"):
    """The draft model (bf16, on the GPU) of a case; lm_head "int8": with an int8 copy of
    its lm_head (layers.quantize_lm_head); "<bf16|int8>:N": an EAGLE-1 head proposing
    from a draft vocabulary of N ids (EagleHead.reduce_vocab; the shipped ranking's top N
    for the SmolLM2 head where the install has it, else ids 0..N-1: the cost is the
    same)."""
    m = LM_HEAD.fullmatch(lm_head)
    if m is None:
        raise ValueError(f"lm_head must be bf16 or int8, optionally with :N, got {lm_head!r}")
    model = _build(case, max_positions)
    if m.group(2):
        n = int(m.group(2))
        if not hasattr(model, "reduce_vocab"):
            raise ValueError(f"lm_head {lm_head!r}: {case} cannot reduce its vocabulary")
        from specdraft.draft_vocab import shipped_vocab

        ids = shipped_vocab(n) if case == "eagle-smollm2-135m" else None
        model.reduce_vocab(torch.arange(n) if ids is None else ids)
    if m.group(1) == "int8":
        from specdraft.layers import quantize_lm_head

        quantize_lm_head(model)
    return model


def _build(case: str, max_positions: int):
    from specdraft.loader import Checkpoint, load_eagle_head
    from specdraft.models.tiny import (
        eagle_config,
        llama3_8b_config,
        llama_68m_config,
        random_causal_lm,
        random_eagle_weights,
    )

    if case == "llama-68m":
        return random_causal_lm(
            llama_68m_config(), seed=0, device=DEVICE, max_positions=max_positions
        )
    target = llama3_8b_config() if case == "eagle-llama3-8b" else smollm2_config()
    cfg = eagle_config(target)
    w = random_eagle_weights(cfg, seed=0, with_embed=True, device=DEVICE)
    w["lm_head.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size, device=DEVICE) * 0.05
    return load_eagle_head(
        Checkpoint.from_tensors(cfg.to_hf(), w), device=DEVICE, max_positions=max_positions
    )


TURNS, TURN_WARMUP = 3, 10


def events_us(fn, iters: int, warmup: int = 3) -> float:
    """Device time per call of fn(), calls issued back to back between two events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _noop() -> None:
    pass


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def capture(fn) -> torch.cuda.CUDAGraph:
    """fn captured after one warm-up pass, into the memory pool the drafter's round
    graphs share (cuda_graph.shared_graph_pool): the step graphs' activations then sit
    where the round's do. In pools of their own, the b64 K1 prefill-step graph (the
    round's exact kernels) measured 70.8 µs against the round's 74.5 after other
    drafters had run in the process, 73-75 otherwise (bench/NOTES.md, stop 41)."""
    from specdraft.cuda_graph import capture_stream, shared_graph_pool

    s = capture_stream()  # the runtime's: new streams would slow every graph (stop 45)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=shared_graph_pool(), stream=s):
        fn()
    return g


class Bench:
    """One drafter (batch B, every K) with its requests and inputs."""

    def __init__(self, model, batch: int, ks: list[int], ctx: int, modes, room: int):
        from specdraft.drafter import Drafter
        from specdraft.sampling import SamplingParams

        self.d = d = Drafter(
            model,
            max_num_reqs=batch,
            k_max_options=ks,
            capture_sizes=[batch],
            graph_modes=modes,
            max_model_len=ctx + room,
            seed=0,
        )
        self.batch, self.ctx = batch, ctx
        self.rids = [f"r{i}" for i in range(batch)]
        g = torch.Generator(device=DEVICE).manual_seed(0)
        params_of = {
            "greedy": lambda i: None,
            "sample": lambda i: SamplingParams(0.8, seed=i),
            "filter": lambda i: SamplingParams(0.8, top_k=50, top_p=0.9, seed=i),
        }[modes[0]]
        for i, r in enumerate(self.rids):
            hid = None
            if d.hidden_in:
                hid = torch.randn(ctx, d.hidden_in, device=DEVICE, dtype=d.dtype, generator=g)
            params = params_of(i)
            d.add_request(
                r,
                torch.randint(0, d.vocab_size, (ctx,), generator=g, device=DEVICE).tolist(),
                params,
                target_hidden=hid,
            )
            assert d.reserve(r, ctx + room)
        self.slots = torch.tensor([d.tables.row_of(r) for r in self.rids], device=DEVICE)
        w = d.width
        self.ver = torch.randint(0, d.vocab_size, (batch, w), device=DEVICE, generator=g)
        self.hid = None
        if d.hidden_in:
            self.hid = torch.randn(batch, w, d.hidden_in, device=DEVICE, dtype=d.dtype, generator=g)

    def inputs(self, k: int):
        acc = torch.randint(0, k + 1, (self.batch,), device=DEVICE)
        return self.ver[:, : k + 1], acc, None if self.hid is None else self.hid[:, : k + 1]

    def reset(self) -> None:
        """Every request back to ctx committed tokens (device and host), so that every
        variant is timed over the same context lengths."""
        d = self.d
        d.buffers.base.index_fill_(0, self.slots, self.ctx - d.loop.shift)
        for r in self.rids:
            d.lengths.set_exact(d.tables.row_of(r), self.ctx - d.loop.shift)

    def propose(self, k: int, **kw):
        ver, acc, hid = self._inp
        return self.d.propose(self.rids, ver, acc, target_hidden=hid, k_max=k, **kw)

    def round_graph(self, k: int, mode) -> torch.cuda.CUDAGraph:
        """The captured round of K = k for this batch, its inputs filled by one propose()."""
        d, b = self.d, self.batch
        self._inp = self.inputs(k)
        self.reset()
        self.propose(k)  # fills the round's input buffers
        manager = d._managers[(k, mode)]
        desc = manager.dispatch(b, b * d.width, uniform_token_count=d.width, max_query_len=d.width)
        return manager._graphs[desc]

    def measure(self, k: int, mode, iters: int) -> dict:
        from bench.common import host_burst_us, host_us, spin_cycles
        from specdraft.draft_loop import RoundState

        d, b = self.d, self.batch
        graph = self.round_graph(k, mode)

        # The same round as K graphs: prefill step, then one graph per decode step.
        loop, carry = d.loop, None
        if d.hidden_in:
            carry = torch.zeros(b, d.model.cfg.hidden_size, device=DEVICE, dtype=d.dtype)
        state = {}

        def prefill():
            st = loop.start(b, k, mode)
            if carry is not None and st.hidden is not None:  # None in a round of one draft
                rows = st.hidden_rows  # the prefill's rows that drew token 0
                carry.copy_(st.hidden if rows is None else st.hidden.index_select(0, rows))
            if k == 1:
                loop.finish(st)
            state["st"] = st

        def decode(step):
            st = state["st"]
            params = None if st.params is None else loop.sampling.select(d.buffers.param[:b])
            st2 = RoundState(b, k, mode, st.tokens, st.q, params, carry)
            loop.step(st2, step)
            if carry is not None:
                carry.copy_(st2.hidden)
            if step == k - 1:
                loop.finish(st2)

        self.reset()
        with torch.no_grad():
            graphs = [capture(prefill)] + [capture(lambda s=s: decode(s)) for s in range(1, k)]
        # The K graphs must compute the round: same tokens from the same state.
        tokens = d.buffers.tokens[: b * k]
        self.reset()
        graph.replay()
        one = tokens.clone()
        self.reset()
        for g in graphs:
            g.replay()
        steps_match = bool(torch.equal(one, tokens))
        # The round and its step graphs timed in turns, each after TURN_WARMUP replays,
        # medians of TURNS: timed once each, the round first, the b64 K1 round (exactly
        # the prefill step's kernels) read 1.05x its step; in turns, 1.00 (bench/NOTES.md,
        # stop 41).
        fns = {"round": graph.replay, "steps": lambda: [g.replay() for g in graphs],
               "prefill": graphs[0].replay}  # fmt: skip
        if k > 1:
            fns["decode"] = graphs[1].replay
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(TURNS):
            for name, fn in fns.items():
                self.reset()
                times[name].append(events_us(fn, iters, warmup=TURN_WARMUP))
        med = {name: statistics.median(t) for name, t in times.items()}
        round_us, steps_us, prefill_us = med["round"], med["steps"], med["prefill"]
        decode_us = med.get("decode", 0.0)
        graphs.clear()  # free their pools
        self.reset()
        eager_us = events_us(lambda: self.propose(k, eager=True), max(5, iters // 3))

        # Host time of propose(), each call enqueued on an idle GPU, and each call
        # enqueued behind a spin kernel that keeps the GPU busy (as in the engine, where
        # a round is launched while the previous verification runs). Timed back to back
        # instead, a host rounds ahead of the GPU is throttled by the driver's bounded
        # launch queue and the figure grows with the GPU's time per round. The bare
        # cudaGraphLaunch of the round's graph is timed the same two ways: the rest of
        # propose() is specdraft's own host work.
        spin = spin_cycles(3 * round_us + 100)
        # As the engine calls it: the inputs written where the round reads them
        # (Drafter.input_views), so that propose() copies nothing.
        views = d.input_views(b, k + 1)
        for dst, src in zip(views, self._inp):
            if dst is not None:
                dst.copy_(src)

        def own():
            d.propose(self.rids, views[0], views[1], target_hidden=views[2], k_max=k)

        # Each kind timed iters calls in a row, in TURNS turns, pooled. Taken sample by
        # sample in turn instead, every call read 1.5-3x slower (stop 42, call 6): a call
        # after a synchronize costs what the host's state makes it, which is why the bar
        # is the back-to-back figure below.
        kinds = {
            "host": lambda: self.propose(k), "launch": graph.replay, "noop": _noop,
            "host_own": own,
        }  # fmt: skip
        host: dict[str, list[float]] = {}
        steady_calls = 0
        for _ in range(TURNS):
            for suffix in ("", "_busy"):
                for name, fn in kinds.items():
                    d._leave_steady()
                    self.reset()
                    fn()  # the first call after the reset checks everything: not timed
                    steady0 = d.steady_rounds
                    got = host_us(fn, iters, spin if suffix else 0)
                    if name == "host":
                        steady_calls += d.steady_rounds - steady0
                    host.setdefault(name + suffix, []).extend(got)
        steady = steady_calls / (2 * TURNS * iters)
        d._leave_steady()
        self.reset()
        own()
        # The engine's steady state: rounds enqueued back to back behind a busy GPU.
        burst = host_burst_us(own, iters, spin_cycles((iters + 2) * round_us + 200))
        return dict(
            round_us=round_us,
            steps_us=steps_us,
            eager_us=eager_us,
            prefill_us=prefill_us,
            decode_us=decode_us,
            host_us=statistics.median(host["host"]),
            host_p90_us=p90(host["host"]),
            host_busy_us=statistics.median(host["host_busy"]),
            host_busy_p90_us=p90(host["host_busy"]),
            host_own_busy_us=statistics.median(host["host_own_busy"]),
            host_own_us=statistics.median(host["host_own"]),
            host_burst_us=statistics.median(burst),
            host_burst_p90_us=p90(burst),
            launch_idle_us=statistics.median(host["launch"]),
            launch_busy_us=statistics.median(host["launch_busy"]),
            noop_idle_us=statistics.median(host["noop"]),
            noop_busy_us=statistics.median(host["noop_busy"]),
            steady_share=steady,
            steps_match=steps_match,
        )

    def launches(self, k: int) -> dict:
        """Launches per steady round (graph_launches). Counted after every host time:
        the profiler leaves its CUDA callbacks installed for the rest of the process,
        which adds to every later launch (stop 23: a bare round graph launch 6-9 µs in
        a process the profiler never ran in, 15-50 µs after it had)."""
        self._inp = self.inputs(k)
        self.reset()
        self.propose(k)
        self.reset()
        return graph_launches(lambda: self.propose(k), 5)


def count_launches(rows: list[dict], args, ks: list[int], room: int, replays: int = 20):
    """Each row's launches per round (Bench.launches) on drafters built again once every
    host time of the run is measured; with --kernels also each round graph kernel by
    kernel (bench.kernel_profile.profile_graph). Returns the kernels' markdown lines and
    {row name: {kernel: [count, µs]}} (empty without --kernels)."""
    from bench.kernel_profile import kernel_table, profile_graph
    from specdraft.draft_buffers import MODE_NAMES

    by_key = {(r["model"], r["lm_head"], r["batch"], r["k"], r["mode"]): r for r in rows}
    lines, kernels = [], {}
    for case, lm_head in _variants(args):
        model = build(case, args.ctx + room, lm_head)
        for mode_name in args.modes.split(","):
            for batch in (int(x) for x in args.batches.split(",")):
                bench = Bench(model, batch, ks, args.ctx, (mode_name,), room)
                for k in ks:
                    per = bench.launches(k)
                    row = by_key[(case, lm_head, batch, k, mode_name)]
                    row["launches"], row["graph_launches"] = per, per["graph"]
                    if not args.kernels:
                        continue
                    bench.reset()
                    with torch.no_grad():
                        per = profile_graph(bench.round_graph(k, MODE_NAMES[mode_name]), replays)
                    busy = sum(v[1] for v in per.values())
                    name = f"{case} {lm_head} b{batch} K{k} {mode_name}"
                    kernels[name] = per
                    head = f"### {name}: round {row['round_us']:.1f} µs (events), kernels"
                    lines += ["", f"{head} {busy:.1f} µs", "", *kernel_table(per, row["round_us"])]
                bench.d.teardown()
                del bench
                torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    return lines, kernels


def _variants(args) -> list[tuple[str, str]]:
    """(case, lm_head) pairs in run order."""
    return [(c, h) for c in args.cases.split(",") for h in args.lm_head.split(",")]


def graph_launches(fn, rounds: int) -> dict:
    """cudaGraphLaunch calls per round, and other CUDA launches/copies the host issues."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    per = {
        "graph": sum(n == "cudaGraphLaunch" for n in names) / rounds,
        "kernel": sum(
            n in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx") for n in names
        )
        / rounds,
        "memcpy": sum(n.startswith("cudaMemcpy") for n in names) / rounds,
    }
    return per


def floor_us(model, batch: int, k: int, ctx: int, copy_bw: float, q_bytes: int) -> float:
    """Bytes one round must move at least: the weights once per forward (K forwards),
    the context's K/V once per forward, q if sampled; over the copy bandwidth."""
    from bench.models import weight_bytes

    cfg = model.cfg
    kv = batch * ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    return (k * (weight_bytes(model, batch) + kv) + q_bytes) / (copy_bw * 1e12) * 1e6


@torch.inference_mode()
def smollm2_step(ctx: int):
    """SmolLM2-135M's own decode step (random weights) at batch 1 as a callable, with the
    main job's length bound (1024, or ctx + 64 past it): the bound sets the attention's
    split count (bench.decode_step), and a tighter one makes the step slower (stop 26:
    489 µs at a bound of 320 against ~402 at 1024)."""
    from specdraft.models.tiny import random_causal_lm
    from tests.model_helpers import PagedRunner

    cfg = smollm2_config()
    bound = max(ctx + 64, 1024)
    model = random_causal_lm(cfg, seed=0, device=DEVICE, max_positions=bound)
    runner = PagedRunner(cfg, DEVICE, max_num_reqs=1, max_num_tokens=16, max_model_len=bound)
    runner.tables.add_request(0, ctx + 1)
    runner.lens[0] = ctx
    meta = runner.step([(0, [7])])
    return lambda: model(meta.input_ids, meta, runner.cache)


def alternated_ratio(args, step, lm_heads: list[str], repeats: int, room: int) -> dict:
    """Issue 11's ratio with both sides timed in turn, `repeats` times in one process:
    SmolLM2's step (`step`, smollm2_step's callable, under graph replay), then the
    SmolLM2-shaped head's b1 K3 greedy round of each lm_head. One step timing against
    one round timing moved the ratio 0.198-0.226 between runs (stop 39: the step took
    427-482 µs, the round 94-96), so the bar is read from the medians. Returns
    {"runs": [...], "median": {...}}."""
    from bench.common import time_graph_us
    from specdraft.draft_buffers import MODE_NAMES

    rounds = {}
    for lm_head in lm_heads:
        bench = Bench(build("eagle-smollm2-135m", args.ctx + room, lm_head), 1, [3], args.ctx,
                      ("greedy",), room)  # fmt: skip
        rounds[lm_head] = (bench, bench.round_graph(3, MODE_NAMES["greedy"]))
    runs = []
    for _ in range(repeats):
        run = {"step_us": time_graph_us([step])}
        for lm_head, (bench, graph) in rounds.items():
            bench.reset()
            run[f"{lm_head}_round_us"] = events_us(graph.replay, args.iters)
            run[f"{lm_head}_ratio"] = run[f"{lm_head}_round_us"] / run["step_us"]
        runs.append(run)
    for bench, _ in rounds.values():
        bench.d.teardown()
    median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    return {"runs": runs, "median": median}


COLUMNS = [
    ("model", "draft"),
    ("batch", "batch"),
    ("k", "K"),
    ("mode", "mode"),
    ("lm_head", "lm_head"),
    ("round_us", "round (1 replay) µs"),
    ("steps_us", "K step graphs µs"),
    ("eager_us", "eager µs"),
    ("prefill_us", "prefill step µs"),
    ("decode_us", "decode step µs"),
    ("round_over_steps_bar", "round / (prefill + (K-1) decode)"),
    ("host_busy_us", "host µs / round (GPU busy)"),
    ("host_busy_p90_us", "p90"),
    ("host_us", "host µs / round (GPU idle)"),
    ("host_p90_us", "p90"),
    ("host_own_busy_us", "host µs / round, inputs in input_views (GPU busy)"),
    ("host_own_us", "same (GPU idle)"),
    ("host_burst_us", "same, back to back (GPU busy)"),
    ("host_burst_p90_us", "p90"),
    ("launch_busy_us", "bare graph launch µs (busy)"),
    ("launch_idle_us", "bare graph launch µs (idle)"),
    ("noop_busy_us", "no-op call µs (busy)"),
    ("steady_share", "steady rounds"),
    ("graph_launches", "graph launches / round"),
    ("capture_s_per_graph", "capture s / graph (first)"),
    ("capture_again_s_per_graph", "capture s / graph (again)"),
    ("floor_us", "floor µs"),
    ("round_over_floor", "round / floor"),
    ("steps_match", "K graphs = round"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--ks", default="1,3,5,7")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--modes", default="greedy", help="greedy, sample or filter")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument(
        "--lm-head", default="bf16",
        help="bf16, int8 or several (bf16,int8): int8 quantizes the drafts' lm_heads per row "
        "(layers.quantize_lm_head); :N gives an EAGLE-1 head a draft vocabulary of N ids "
        "(e.g. int8:16384; specdraft generate --draft-vocab)",
    )  # fmt: skip
    ap.add_argument(
        "--bar-repeats", type=int, default=5,
        help="time SmolLM2's step and the SmolLM2-shaped head's b1 K3 greedy round this "
        "many times in turn for the 0.2 bar (medians); 0: one step timing",
    )  # fmt: skip
    ap.add_argument(
        "--merge-in-o", action="store_true",
        help="split attention merged by the O projection on its loads, no merge launch "
        "(specdraft.layers.MERGE_IN_O_PROJ), for the target's step and the drafts alike",
    )  # fmt: skip
    ap.add_argument(
        "--act-int8", action="store_true",
        help="int8 lm_heads quantize their input rows to int8 too: int8 tensor-core products "
        "(specdraft.kernels.linear_int8.ACT_INT8)",
    )  # fmt: skip
    ap.add_argument(
        "--attn", default="",
        help="attention's key tile / splits / warps / stages [/ tiles prefetched] forced for every "
        "launch of the run, the SmolLM2 step's too (an experiment), e.g. 128/1/4/2/1",
    )  # fmt: skip
    ap.add_argument(
        "--kernels", action="store_true",
        help="also each round graph's kernels, timed under torch.profiler (last: it slows "
        "later launches)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.bar_repeats < 0:
        ap.error(f"--bar-repeats must be >= 0, got {args.bar_repeats}")
    bad = [h for h in args.lm_head.split(",") if LM_HEAD.fullmatch(h) is None]
    if bad:
        ap.error(f"--lm-head: unknown {bad}; choose from bf16, int8, each optionally :N")
    if not torch.cuda.is_available():
        print(
            "bench.draft_round needs an NVIDIA GPU; tests/test_drafter.py checks the round "
            "on the CPU"
        )
        return 2
    from bench.common import copy_bandwidth_tbps, environment, markdown_table, save_results
    from specdraft import layers
    from specdraft.draft_buffers import MODE_NAMES

    layers.MERGE_IN_O_PROJ = layers.MERGE_IN_O_PROJ or args.merge_in_o
    li = importlib.import_module("specdraft.kernels.linear_int8")
    li.ACT_INT8 = li.ACT_INT8 or args.act_int8
    env = environment()
    copy_bw = copy_bandwidth_tbps()["best"]
    env["copy_tbps"] = copy_bw
    env["merge_in_o"], env["act_int8"] = layers.MERGE_IN_O_PROJ, li.ACT_INT8
    if args.attn:
        from bench.decode_step import _forced_attention

        pa = importlib.import_module("specdraft.kernels.paged_attention")
        forced = tuple(int(v) for v in args.attn.split("/"))
        pa.choose_launch_config = _forced_attention(pa.choose_launch_config, ("attn", forced))
        env["attn_forced"] = args.attn
    print(f"{env['gpu']}: copy {copy_bw:.2f} TB/s; torch {env['torch']}", flush=True)
    ks = [int(x) for x in args.ks.split(",")]
    room = (args.iters * 8 + 64) * (max(ks) + 1)
    from bench.common import time_graph_us

    # SmolLM2's step is timed first, before the matrix below, and again in turns with the
    # rounds after it, where it has read 432-477 µs while the round moved 84 -> 88
    # (bench/NOTES.md, stop 44). The 0.2 bar is judged against the faster step, so the
    # bench's own history cannot meet it.
    step = smollm2_step(args.ctx)  # one SmolLM2 model for both figures
    smol_first_us = time_graph_us([step])
    rows = []
    for case, lm_head in _variants(args):
        model = build(case, args.ctx + room, lm_head)
        for mode_name in args.modes.split(","):
            mode = MODE_NAMES[mode_name]
            for batch in (int(x) for x in args.batches.split(",")):
                bench = Bench(model, batch, ks, args.ctx, (mode_name,), room)
                n = max(bench.d.num_graphs, 1)
                cap = bench.d.capture_seconds / n  # first capture: compiles included
                bench.d.capture()  # again, every kernel compiled and loaded
                torch.cuda.synchronize()
                cap_again = bench.d.capture_seconds / n
                for k in ks:
                    r = bench.measure(k, mode, args.iters)
                    q_bytes = 0 if mode_name == "greedy" else batch * k * bench.d.loop.q_vocab * 4
                    fl = floor_us(model, batch, k, args.ctx, copy_bw, q_bytes)
                    bar = 1.05 * (r["prefill_us"] + (k - 1) * r["decode_us"])
                    row = dict(
                        model=case,
                        batch=batch,
                        k=k,
                        mode=mode_name,
                        lm_head=lm_head,
                        **r,
                        round_over_steps_bar=r["round_us"] / bar * 1.05,
                        capture_s_per_graph=cap,
                        capture_again_s_per_graph=cap_again,
                        floor_us=fl,
                        round_over_floor=r["round_us"] / fl,
                    )
                    rows.append(row)
                    print(
                        {k2: round(v, 2) if isinstance(v, float) else v for k2, v in row.items()},
                        flush=True,
                    )
                bench.d.teardown()
                del bench
                torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    smol_us = time_graph_us([step])
    alt = None
    if args.bar_repeats and any(
        r["model"] == "eagle-smollm2-135m" and r["batch"] == 1 and r["k"] == 3
        and r["mode"] == "greedy" for r in rows
    ):  # fmt: skip
        alt = alternated_ratio(args, step, args.lm_head.split(","), args.bar_repeats, room)
    # Last: the profiler stays attached to the process (Bench.launches). Run before the
    # ratio's timings, those read SmolLM2's step at 411-442 µs against 353.9 timed first
    # and the round at 87-88 against 84-86 elsewhere; the profiler is the likely cause,
    # not yet confirmed on the GPU (bench/NOTES.md, stop 45).
    kernel_lines, kernels = count_launches(rows, args, ks, room)
    bars = check_bars(rows, smol_us, alt, smol_first_us)
    table = markdown_table(rows, COLUMNS)
    head = (
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; "
        f"ctx {args.ctx}; copy {copy_bw:.2f} TB/s; SmolLM2-135M decode step (batch 1, "
        f"graph) {smol_us:.1f} µs ({smol_first_us:.1f} before the rounds were timed)."
    )
    text = head + "\n\n" + table + "\n\n"
    if alt is not None:
        text += alternated_table(alt) + "\n\n"
    text += "\n".join(f"- {b}" for b in bars)
    if kernel_lines:
        text += "\n\nEach round's kernels (torch.profiler over 20 replays; with PDL a "
        text += "kernel's time includes its wait for the one before):\n" + "\n".join(kernel_lines)
    print(text)
    save_results(
        args.out,
        "draft_round",
        {"env": env, "smollm2_decode_us": smol_us, "smollm2_first_us": smol_first_us,
         "rows": rows, "alternated": alt, "bars": bars, "kernels": kernels},
        text,
    )  # fmt: skip
    return 0


def alternated_table(alt: dict) -> str:
    """alternated_ratio's runs and medians as a markdown table."""
    keys = list(alt["median"])
    lines = ["| run | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for i, run in enumerate(alt["runs"] + [alt["median"]]):
        name = "median" if i == len(alt["runs"]) else str(i + 1)
        lines.append(f"| {name} | " + " | ".join(f"{run[k]:.3g}" for k in keys) + " |")
    return "\n".join(lines)


def check_bars(
    rows: list[dict], smol_us: float, alt: dict | None = None, first_us: float | None = None
) -> list[str]:
    """Issue 11's bars, each with its measured worst case; the SmolLM2 ratio from the
    medians of alternated_ratio's runs when given (`alt`), else from this run's one
    step timing; with `first_us` (the step timed first in the process, see main) the
    ratio against it too, and the bar judged by the larger of the two."""
    out = []
    worst = max(rows, key=lambda r: abs(r["graph_launches"] - 1))
    out.append(
        f"one graph launch per round: {'met' if worst['graph_launches'] == 1 else 'MISSED'}"
        f" (worst {worst['graph_launches']:.2f}: {worst['model']} b{worst['batch']} "
        f"K{worst['k']})"
    )
    worst = max(rows, key=lambda r: r["round_over_steps_bar"])
    ok = worst["round_over_steps_bar"] <= 1.05
    out.append(
        f"round <= 1.05 x (prefill + (K-1) decode step graphs): "
        f"{'met' if ok else 'MISSED'} (worst {worst['round_over_steps_bar']:.3f}: "
        f"{worst['model']} b{worst['batch']} K{worst['k']})"
    )
    smol = [
        r for r in rows if r["model"] == "eagle-smollm2-135m" and r["batch"] == 1 and r["k"] == 3
    ]
    for r in smol:
        ships = ""
        if r["lm_head"] == MAIN_JOB_HEAD:
            ships = " (as the main job runs the shipped head)"
        name = f"SmolLM2-shaped EAGLE round (b1, K3, {r['mode']}, {r['lm_head']} lm_head{ships})"
        key = f"{r['lm_head']}_ratio"
        if alt is not None and r["mode"] == "greedy" and key in alt["median"]:
            ratio = alt["median"][key]
            each = [run[key] for run in alt["runs"]]
            text = (f"{name} / SmolLM2 decode step, median of {len(each)} alternated "
                    f"timings: {ratio:.3f} (runs {min(each):.3f}-{max(each):.3f})")  # fmt: skip
            if first_us is not None:
                round_us = alt["median"][f"{r['lm_head']}_round_us"]
                first = round_us / first_us
                text += f"; against the step timed first ({first_us:.1f} µs) {first:.3f}"
                ratio = max(ratio, first)
            out.append(f"{text}: {'met' if ratio <= 0.2 else 'MISSED'} (bar 0.2)")
            continue
        ratio = r["round_us"] / min(smol_us, first_us or smol_us)
        out.append(
            f"{name} / SmolLM2 decode step: "
            f"{ratio:.3f} ({'met' if ratio <= 0.2 else 'MISSED'}; bar 0.2)"
        )
    # The bar: host µs per round as the engine spends them, rounds enqueued back to back
    # while the GPU works (the issue's own test is the same: 100 rounds enqueued in less
    # time than the GPU takes to run 10). The per-call figures, each call after a
    # synchronize, follow as information: they depend on the state the wait leaves the
    # host in (the same rows measured 13.5-31.6 µs in stop 42's call 1 and 14-65.6 in
    # call 6, a no-op call twice as slow in the slow runs).
    burst = max(rows, key=lambda r: r["host_burst_us"])
    out.append(
        f"host <= 30 µs per round, rounds enqueued back to back behind a busy GPU as the "
        f"engine's steady state runs them (inputs in Drafter.input_views; median): "
        f"{'met' if burst['host_burst_us'] <= 30 else 'MISSED'} (worst "
        f"{burst['host_burst_us']:.1f} µs, p90 {burst['host_burst_p90_us']:.1f}: "
        f"{burst['model']} b{burst['batch']} K{burst['k']})"
    )
    worst = max(rows, key=lambda r: r["host_busy_us"])
    idle = max(rows, key=lambda r: r["host_us"])
    own = max(rows, key=lambda r: r["host_own_busy_us"])
    out.append(
        f"  for information, each call after a synchronize: behind a busy GPU worst "
        f"{worst['host_busy_us']:.1f} µs ({worst['model']} b{worst['batch']} K{worst['k']}; "
        f"its bare cudaGraphLaunch {worst['launch_busy_us']:.1f} µs, a no-op call "
        f"{worst['noop_busy_us']:.2f} µs), inputs in input_views worst "
        f"{own['host_own_busy_us']:.1f} µs ({own['model']} b{own['batch']} K{own['k']}); "
        f"on an idle GPU worst {idle['host_us']:.1f} µs ({idle['model']} b{idle['batch']} "
        f"K{idle['k']}; its bare cudaGraphLaunch {idle['launch_idle_us']:.1f} µs)"
    )
    worst = max(rows, key=lambda r: r["capture_again_s_per_graph"])
    first = max(r["capture_s_per_graph"] for r in rows)
    out.append(
        f"capture <= 0.2 s per graph, compiled kernels cached: "
        f"{'met' if worst['capture_again_s_per_graph'] <= 0.2 else 'MISSED'} "
        f"(worst {worst['capture_again_s_per_graph']:.3f} s; the first capture of each "
        f"drafter, compiling its kernels in this process: worst {first:.3f} s)"
    )
    return out


if __name__ == "__main__":
    sys.exit(main())
