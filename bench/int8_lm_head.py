"""The draft's int8 lm_head (layers.quantize_lm_head): what it costs in acceptance and
what it saves in time.

- Flips (CPU or GPU; needs the embedded model): over every position of the chat-
  templated prompts (held-out and default sets), teacher-forced through SmolLM2-135M in
  float32, how often the int8 per-row lm_head changes the argmax of the model's own
  logits. A greedy draft token changes at most there. Also with the hidden states'
  rows quantized to int8 as well (kernels.linear_int8's act_int8, int8 tensor-core
  products), an experiment.
- Time (GPU; --flips-only skips it): kernels.linear_int8 against the bf16 lm_head
  through ops.linear (cuBLAS or the wide rows kernel at these shapes) at 1 / 4 / 8 / 64
  rows, SmolLM2's [49152, 576] and Llama-3-8B's [128256, 4096], under CUDA-graph replay
  (device events, median): cycling through weight copies that together exceed L2, with
  the read floor of each (the weight bytes over the read bandwidth measured in the same
  run), and again over one copy, as a round's later steps read it (SmolLM2's int8
  lm_head, 28 MB, can stay in the H200's L2; its bf16 one, 57 MB, cannot); and the
  int8 lm_head with act_int8.

    python -m bench.int8_lm_head [--out results] [--flips-only | --no-flips]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

SHAPES = {"smollm2-135m": (49152, 576), "llama3-8b": (128256, 4096)}
ROWS = (1, 4, 8, 64)


@torch.no_grad()
def argmax_flips(device: str) -> dict:
    """Positions, int8 argmax flips, and whether the float argmax stays in the int8 top 2."""
    from specdraft import embedded, kernels, ops
    from specdraft.cli import DEFAULT_PROMPTS
    from specdraft.data import load_prompts
    from specdraft.dense import target_hidden
    from specdraft.gguf import load_gguf

    path = embedded.smollm2_gguf_path()
    model, tok = load_gguf(path, device=device, dtype=torch.float32, max_positions=1024)
    w = model.lm_head.weight
    q, s = kernels.quantize_rows_int8(w)
    deq = q.float() * s[:, None]
    n = flips = in_top2 = flips_a8 = 0
    for p in list(load_prompts("heldout")) + list(DEFAULT_PROMPTS):
        chat = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        ids = torch.tensor([tok.encode(chat, add_special_tokens=False)], device=device)
        h = target_hidden(model, ids)[0]
        exact, rounded = (h @ w.t()).argmax(-1), h @ deq.t()
        n += exact.numel()
        flips += int((rounded.argmax(-1) != exact).sum())
        in_top2 += int((rounded.topk(2, dim=-1).indices == exact[:, None]).any(-1).sum())
        # act_int8: the hidden states' rows to int8 too (kernels.linear_int8's definition)
        a8 = ops.linear_int8(h.contiguous(), q, s, act_int8=True)
        flips_a8 += int((a8.argmax(-1) != exact).sum())
    return {"positions": n, "flips": flips, "flip_rate": flips / n, "in_int8_top2": in_top2 / n,
            "flips_act_int8": flips_a8, "flip_rate_act_int8": flips_a8 / n}  # fmt: skip


def time_rows(read_tbps: float) -> list[dict]:
    from bench.common import time_graph_us
    from specdraft import kernels, ops

    rows = []
    l2_bytes = 64 << 20
    pdl = kernels.pdl_supported(torch.device("cuda"))
    for name, (v, k) in SHAPES.items():
        copies = max(2, -(-4 * l2_bytes // (v * k)))  # together at least 4x L2 (int8)
        g = torch.Generator(device="cuda").manual_seed(v + k)
        ws = [
            (torch.randn(v, k, device="cuda", generator=g) * 0.02).bfloat16() for _ in range(copies)
        ]
        qs = [kernels.quantize_rows_int8(w) for w in ws]
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            bf = time_graph_us([lambda x=x, w=w: ops.linear(x, w, None) for w in ws])
            i8 = time_graph_us(
                [lambda x=x, q=q, s=s: kernels.linear_int8(x, q, s, pdl=pdl) for q, s in qs]
            )
            bf_one = time_graph_us([lambda x=x, w=ws[0]: ops.linear(x, w, None)])
            i8_one = time_graph_us([lambda x=x, qs0=qs[0]: kernels.linear_int8(x, *qs0, pdl=pdl)])
            a8 = time_graph_us([
                lambda x=x, q=q, s=s: kernels.linear_int8(x, q, s, pdl=pdl, act_int8=True)
                for q, s in qs
            ])  # fmt: skip
            floor = v * k / read_tbps / 1e6  # µs for one byte a weight
            rows.append({
                "shape": name, "rows": m, "bf16_us": bf, "bf16_floor_us": 2 * floor,
                "int8_us": i8, "int8_floor_us": floor * (1 + 4 / k),
                "int8_over_bf16": i8 / bf, "bf16_one_copy_us": bf_one,
                "int8_one_copy_us": i8_one, "act_int8_us": a8, "act_int8_over_int8": a8 / i8,
            })  # fmt: skip
            print({a: round(b, 3) if isinstance(b, float) else b for a, b in rows[-1].items()},
                  flush=True)  # fmt: skip
        del ws, qs
        torch.cuda.empty_cache()
    return rows


COLUMNS = [
    ("shape", "lm_head"),
    ("rows", "rows"),
    ("bf16_us", "bf16 (ops.linear) µs"),
    ("bf16_floor_us", "bf16 floor µs"),
    ("int8_us", "int8 µs"),
    ("int8_floor_us", "int8 floor µs"),
    ("int8_over_bf16", "int8 / bf16"),
    ("bf16_one_copy_us", "bf16 µs, one copy"),
    ("int8_one_copy_us", "int8 µs, one copy"),
    ("act_int8_us", "int8 x and W µs"),
    ("act_int8_over_int8", "int8 x and W / int8"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--flips-only", action="store_true", help="skip the GPU timings")
    ap.add_argument("--no-flips", action="store_true", help="skip the embedded-model flips")
    args = ap.parse_args(argv)
    from bench.common import environment, markdown_table, read_bandwidth_tbps, save_results

    cuda = torch.cuda.is_available()
    env = environment() if cuda else {"gpu": None, "torch": torch.__version__}
    flips, text = None, "int8 lm_head: argmax flips not measured (--no-flips)"
    if not args.no_flips:
        flips = argmax_flips("cuda" if cuda else "cpu")
        text = (
            f"int8 lm_head, SmolLM2-135M teacher-forced over {flips['positions']} prompt "
            f"positions (float32): argmax changed at {flips['flips']} "
            f"({flips['flip_rate']:.2%}); the float argmax in the int8 top 2 at "
            f"{flips['in_int8_top2']:.2%}; with x's rows in int8 too (act_int8) at "
            f"{flips['flips_act_int8']} ({flips['flip_rate_act_int8']:.2%})"
        )
    rows = []
    if cuda and not args.flips_only:
        env["read_tbps"] = read_bandwidth_tbps()
        rows = time_rows(env["read_tbps"])
        text += (
            f"\n\n{env['gpu']}, torch {env['torch']}, triton {env['triton']}, read "
            f"{env['read_tbps']:.2f} TB/s; graph replay, weights rotated out of L2\n\n"
            + markdown_table(rows, COLUMNS)
        )
    print(text)
    save_results(args.out, "int8_lm_head", {"env": env, "flips": flips, "rows": rows}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
