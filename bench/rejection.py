"""Rejection-sampler benchmark (GPU only): issue 12's bars.

B 64 requests x K 5 drafts (6 target rows each), bf16 logits, V 49152 (the bars) and
V 128256. Modes: greedy (no q) and probabilistic with top-p 0.9 (the bars: greedy <= 15
us, top-p <= 40 us), plus probabilistic without a filter and with top-k 50 + top-p 0.9.
Two logit shapes: "peaked" (a few dozen tokens hold most of the mass, like an LM's next
token) and "gaussian" (N(0, 3^2) logits: a top-p cut deep in a wide band, the
threshold search's hard case).

Times: RejectionSampler calls captured in a CUDA graph, median per call over replays
(device events), cycling through 3 input sets so that logits and q do not sit in L2.
Floors: bytes / the read bandwidth measured in the same run (a bf16 reduction):
the bf16 logits once, and logits plus the fp32 q the issue quotes (the sampler itself
reads q only at the draft ids and one row per request). Peer: the PyTorch path
(rejection_sample_torch: sampling.filtered_probs, keyed draws) under the same graph.
"rows cut": of the B * (K + 1) target rows, those the screen sent to their top-k / top-p
cut (kernels/rejection.py, "Screening"; a variant `screen=0` cuts every filtered row).
`--per-launch`: each case also gets its launches' times ("launches" column, kernel:µs):
the graph of the first i launches timed for every i, each launch's time the difference
(with programmatic dependent launch a launch's time includes its overlap with the one
before).

    python -m bench.rejection [--out results] [--vocabs 49152,128256] [--batch 64] [--k 5]
                              [--per-launch]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from bench.common import read_bandwidth_tbps, time_graph_us
from specdraft import ops
from specdraft.kernels import rejection as kr
from specdraft.rejection import RejectionSampler
from specdraft.sampling import SamplingParams, SamplingTensors

MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "top-p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "no filter": SamplingParams(temperature=1.0),
    "top-k 50": SamplingParams(temperature=1.0, top_k=50),
    "top-k 50 + top-p 0.9": SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
}
BARS_US = {("greedy", 49152): 15.0, ("top-p 0.9", 49152): 40.0}


def make_inputs(b: int, k: int, v: int, dist: str, sampled: bool, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = b * (k + 1)
    logits = torch.randn(rows, v, device="cuda", generator=g) * (3.0 if dist == "gaussian" else 2.0)
    if dist == "peaked":
        # ~40 tokens per row lifted 6-12 nats above the rest.
        top = torch.randint(0, v, (rows, 40), device="cuda", generator=g)
        lift = torch.rand(rows, 40, device="cuda", generator=g) * 6 + 6
        logits.scatter_add_(1, top, lift)
    logits = logits.bfloat16()
    view = logits.float().view(b, k + 1, v)[:, :k]
    if sampled:
        # The draft: the target's distribution blurred, drafts drawn from it.
        noise = torch.randn(b, k, v, device="cuda", generator=g)
        q = torch.softmax(view + noise, dim=-1)
        drafts = torch.multinomial(q.view(-1, v), 1, generator=g).view(b, k)
    else:
        q, drafts = None, view.argmax(-1)
    positions = torch.randint(0, 1 << 30, (b,), device="cuda", generator=g)
    return logits, drafts, q, positions


def config_variant(spec: str, v: int, b: int, k: int) -> kr.RejectionConfig:
    """The default config with fields replaced: "block_g=4096+sub_g=512+warps_g=4"."""
    cfg = kr.choose_rejection_config(v, b, k)
    fields = dict(x.split("=") for x in spec.split("+"))
    return dataclasses.replace(cfg, **{n: int(x) for n, x in fields.items()})


def per_launch_us(sampler: RejectionSampler, sets: list, st: SamplingTensors) -> str:
    """ "kernel:µs ..." for the sampler's launches on these input sets: the graph of the
    first i launches (cycling over the sets) timed for i = 1..n, differences taken."""
    kr._PLANS.clear()
    for s in sets:  # one plan per input set, built by the sampler's own call
        sampler(s[0], s[1], s[2], st, s[3])
    plans = list(kr._PLANS.values())
    if len(plans) != len(sets):
        return "n/a (plans not one per input set)"
    launches = [p[3] for p in plans]
    names = [c.jit_fn.__name__.strip("_").removesuffix("_kernel") for c, *_ in launches[0]]

    def prefix(i: int, plan: list):
        def fn():
            for cached, key, grid, args, options in plan[:i]:
                cached(key, grid, args, options)

        return fn

    times = [0.0]
    for i in range(1, len(names) + 1):
        times.append(time_graph_us([prefix(i, p) for p in launches], min_launches=30))
    return " ".join(f"{n}:{times[i + 1] - times[i]:.1f}" for i, n in enumerate(names))


def bench_case(
    v: int,
    mode: str,
    dist: str,
    b: int,
    k: int,
    read_bw: float,
    variant: str | None = None,
    per_launch: bool = False,
) -> dict:
    params = MODES[mode]
    sampled = not params.greedy
    sets = [make_inputs(b, k, v, dist, sampled, seed) for seed in range(3)]
    st = SamplingTensors.from_params(
        [SamplingParams(params.temperature, params.top_k, params.top_p, seed=i) for i in range(b)],
        "cuda",
    )
    row = {"vocab": v, "mode": mode, "logits": dist, "batch": b, "k": k}
    config = None
    if variant is not None:  # other tiles
        config = config_variant(variant, v, b, k)
        row["mode"] = f"{mode} ({variant})"
    for name, backend in (("specdraft_us", "triton"), ("torch_us", "torch")):
        if config is not None and backend == "torch":
            row[name] = None
            continue
        sampler = RejectionSampler(b, k, v, "cuda", config=config)

        def launches(sampler=sampler, backend=backend):
            def one(s):
                def fn():
                    with ops.use_backend(backend):
                        sampler(s[0], s[1], s[2], st, s[3])

                return fn

            return [one(s) for s in sets]

        try:
            row[name] = time_graph_us(launches(), min_launches=12 if backend == "torch" else 30)
        except Exception as exc:  # the peer may not capture; report instead of failing
            print(f"{name} failed: {type(exc).__name__}: {exc}", flush=True)
            row[name] = None
        if backend == "triton":
            out = sampler(sets[0][0], sets[0][1], sets[0][2], st, sets[0][3])
            row["mean_accepted"] = float(out.num_accepted.float().mean())
            ws = sampler.workspace
            if ws.config.screen and params.uses_filter:  # rows the screen left to the cut
                row["rows_cut"] = int(kr.screened_cut_rows(ws, b, k).sum())
            if per_launch:
                row["launches"] = per_launch_us(sampler, sets, st)
    logits_bytes = b * (k + 1) * v * 2
    q_bytes = b * k * v * 4
    row["floor_logits_us"] = logits_bytes / (read_bw * 1e12) * 1e6
    row["floor_logits_q_us"] = (logits_bytes + q_bytes) / (read_bw * 1e12) * 1e6
    row["bar_us"] = BARS_US.get((mode, v))
    us = row["specdraft_us"]
    row["over_floor"] = us / row["floor_logits_us"] if us else None
    if row["bar_us"] is not None:
        row["meets_bar"] = "yes" if us is not None and us <= row["bar_us"] else "NO"
    return row


COLUMNS = [
    ("vocab", "V"),
    ("mode", "mode"),
    ("logits", "logits"),
    ("specdraft_us", "specdraft us"),
    ("floor_logits_us", "floor: bf16 logits us"),
    ("floor_logits_q_us", "floor: + fp32 q us"),
    ("over_floor", "specdraft / logits floor"),
    ("bar_us", "bar us"),
    ("meets_bar", "meets bar"),
    ("torch_us", "PyTorch path us"),
    ("mean_accepted", "mean accepted"),
    ("rows_cut", "rows cut"),
    ("launches", "launches (kernel:us)"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--vocabs", default="49152,128256")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--k", type=int, default=5)
    # Comma-separated; mode names hold no comma (a "top-k 50, top-p 0.9" once split in two).
    ap.add_argument("--modes", default=",".join(MODES), help=f"any of {list(MODES)}")
    ap.add_argument("--dists", default="peaked,gaussian")
    ap.add_argument(
        "--variants",
        default="",
        help="also time these RejectionConfig variants, comma-separated, each "
        "field=value+field=value (e.g. block_g=8192+sub_g=1024), on gaussian logits",
    )
    ap.add_argument("--variant-modes", default="greedy", help="the modes the variants run")
    ap.add_argument("--per-launch", action="store_true", help="each launch's time too")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    if not torch.cuda.is_available():
        print("bench.rejection needs an NVIDIA GPU; tests/test_rejection.py covers correctness")
        return 2
    from bench.common import copy_bandwidth_tbps, environment, markdown_table, save_results

    env = environment()
    env["read_tbps"] = read_bandwidth_tbps()
    env["copy_tbps"] = copy_bandwidth_tbps()["best"]
    print(f"{env['gpu']}: read {env['read_tbps']:.2f} TB/s, copy {env['copy_tbps']:.2f} TB/s")
    rows = []
    for v in (int(x) for x in args.vocabs.split(",")):
        for mode in modes:
            for dist in args.dists.split(","):
                row = bench_case(
                    v, mode, dist, args.batch, args.k, env["read_tbps"], None, args.per_launch
                )
                rows.append(row)
                print({k: round(x, 2) if isinstance(x, float) else x for k, x in row.items()})
                torch.cuda.empty_cache()
        for spec in (x for x in args.variants.split(",") if x):
            for mode in args.variant_modes.split(","):
                row = bench_case(
                    v, mode, "gaussian", args.batch, args.k, env["read_tbps"], spec, args.per_launch
                )
                rows.append(row)
                print({k: round(x, 2) if isinstance(x, float) else x for k, x in row.items()})
    table = markdown_table(rows, COLUMNS)
    head = f"{env['gpu']}, read {env['read_tbps']:.2f} TB/s, {env['date']}\n\n"
    print(table)
    save_results(args.out, "rejection", {"env": env, "rows": rows}, head + table)
    missed = [r for r in rows if r.get("meets_bar") == "NO"]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
