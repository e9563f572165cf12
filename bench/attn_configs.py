"""Paged attention's launch configurations on decode and short verification shapes (GPU
only): every (key tile, splits, warps, pipeline stages) beside the one
`choose_launch_config` picks for the shape and the length bound, each timed as a chain
of programmatic-dependent launches under CUDA-graph replay (as a model step runs them),
with its largest difference from the chosen configuration's output. The bound, not the
context, sets the chosen configuration (a captured graph serves every length below it),
so a configuration only pays if it wins across the contexts a bound covers.

Shapes are heads:batch:context:query tokens, heads one of bench.kernel_ab's (smollm2
9 / 3 x 64, llama 32 / 8 x 128, llama68m 12 / 12 x 64). Writes attn_configs.json and
attn_configs.md (per shape: the chosen configuration's µs and the fastest six).

    python -m bench.attn_configs [--out results] [--bound 1024]
        [--shapes smollm2:1:256:1,llama68m:64:256:1] [--tiles 32,64,128]
        [--splits 1,2,4,8,16,32] [--warps 2,4] [--stages 2,3] [--prefetch 0,1,2]

`--prefetch 0,1,2` also times each configuration with its masked key tiles' loads run
one or two tiles ahead in registers (AttentionLaunchConfig.prefetch; keys end in "p1" /
"p2").
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

DEFAULT_SHAPES = (
    "smollm2:1:128:1,smollm2:1:256:1,smollm2:1:512:1,smollm2:1:1000:1,smollm2:1:256:2,"
    "smollm2:1:256:4,smollm2:8:256:1,llama68m:1:256:1,llama68m:64:256:1"
)


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise SystemExit(f"--{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"--{name} must hold integers >= 1, got {text!r}")
    return values


def parse_shapes(text: str) -> list[tuple[str, int, int, int]]:
    """[(heads, batch, context, query tokens)] from heads:batch:context:q, ..."""
    from bench.kernel_ab import HEADS

    shapes = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 4 or parts[0] not in HEADS:
            raise SystemExit(
                f"--shapes: {item!r} is not heads:batch:context:q with heads in {sorted(HEADS)}"
            )
        b, ctx, q = _ints(",".join(parts[1:]), "shapes")
        if q > ctx:
            raise SystemExit(f"--shapes: {item!r} has more query tokens than context")
        shapes.append((parts[0], b, ctx, q))
    return shapes


def sweep(shape, bound: int, grid) -> dict:
    """One shape: {config "tile/splits/warps/stages": (µs, max |diff|)} and the chosen one."""
    import importlib

    from bench.common import time_graph_us
    from bench.kernel_ab import HEADS, _batch
    from specdraft.kernels import pdl_supported

    pa = importlib.import_module("specdraft.kernels.paged_attention")
    heads, batch, ctx, q = shape
    hq, hkv, d = HEADS[heads]
    b = _batch(heads, batch, ctx, q, "cuda", torch.bfloat16)
    pdl = pdl_supported("cuda")
    chosen = pa.choose_launch_config(
        num_tokens=batch * q, num_reqs=batch, max_query_len=q, num_q_heads=hq,
        num_kv_heads=hkv, head_dim=d, max_seq_len=bound, num_sms_on_device=pa.num_sms(b.q.device),
    )  # fmt: skip

    def call(cfg, out):
        return pa.paged_attention(
            b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_table, d**-0.5,
            out=out, max_query_len=q, max_seq_len=bound, config=cfg, pdl=pdl,
        )  # fmt: skip

    ref = call(chosen, torch.full_like(b.q, float("nan")))
    times = {}
    for tile, splits, warps, stages, ahead in grid:
        if splits > max(1, bound // tile):
            continue
        cfg = pa.AttentionLaunchConfig(chosen.block_m, chosen.block_q, tile, splits, warps, stages,
                                       prefetch=ahead)  # fmt: skip
        out = torch.full_like(b.q, float("nan"))
        try:
            call(cfg, out)
            torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item()
            us = time_graph_us([lambda c=cfg, o=out: call(c, o)], min_launches=30, replays=15)
        except Exception as e:  # a tile that does not compile or fit: say so, go on
            print(f"{shape} {cfg}: {type(e).__name__}: {e}"[:300], flush=True)
            continue
        times[f"{tile}/{splits}/{warps}/{stages}{f'p{ahead}' if ahead else ''}"] = (us, err)
    key = f"{chosen.block_n}/{chosen.num_splits}/{chosen.num_warps}/{chosen.num_stages}"
    return {"chosen": key, "times": times}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--bound", type=int, default=1024, help="max_seq_len of the launches")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--tiles", default="32,64,128")
    ap.add_argument("--splits", default="1,2,4,8,16,32")
    ap.add_argument("--warps", default="2,4")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--prefetch", default="0", help="tiles ahead: 0, 1, 2 or a list (see above)")
    args = ap.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    axes = ("tiles", "splits", "warps", "stages")
    prefetch = [v for v in args.prefetch.split(",") if v]
    if not prefetch or set(prefetch) - {"0", "1", "2"}:
        raise SystemExit(f"--prefetch must list 0, 1 or 2, got {args.prefetch!r}")
    prefetch = [int(v) for v in prefetch]
    grid = list(itertools.product(*(_ints(getattr(args, n), n) for n in axes), prefetch))
    if args.bound < max(ctx for _, _, ctx, _ in shapes):
        raise SystemExit(f"--bound {args.bound} is below a shape's context")
    if not torch.cuda.is_available():
        print("bench.attn_configs needs an NVIDIA GPU")
        return 2
    from bench.common import environment, save_results

    env = environment()
    lines = [f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}; length bound "
             f"{args.bound}; µs a launch in a PDL chain under graph replay; config = key "
             "tile / splits / warps / stages"]  # fmt: skip
    results = {}
    for shape in shapes:
        got = sweep(shape, args.bound, grid)
        name = ":".join(map(str, shape))
        results[name] = got
        best = sorted(got["times"].items(), key=lambda kv: kv[1][0])[:6]
        us = got["times"].get(got["chosen"], (float("nan"), 0.0))[0]
        cells = ", ".join(f"{k} {t:.2f} (diff {e:.1e})" for k, (t, e) in best)
        lines.append(f"- {name}: chosen {got['chosen']} {us:.2f} µs; fastest: {cells}")
        print(lines[-1], flush=True)
    save_results(args.out, "attn_configs", {"env": env, "bound": args.bound, "shapes": results},
                 "\n".join(lines))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
