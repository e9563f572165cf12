"""Small-M linear (GPU only): kernels.linear_small_m against cuBLAS (F.linear) under
CUDA-graph replay, on the projections of the models specdraft runs at decode and draft
time, M = 1, 4, 8, 16 rows, bf16.

Each case rotates over copies of the weight whose total is over 200 MB, so that every
launch reads its weights from HBM as a decode step over many layers does (the H200's
L2 is 50 MB). Reported: µs per call for both, ours / cuBLAS, and the weight-read floor
at the read bandwidth measured in the same run. The decision this informs: whether
`ops.set_small_m_linear(True)` (SPECDRAFT_GEMV=1) should become the default.

    python -m bench.gemv --out results
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

SHAPES = {  # (name, N, K): out_features, in_features
    "SmolLM2-135M": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576),
                     ("down", 576, 1536), ("lm_head", 49152, 576)],
    "EAGLE head for SmolLM2": [("fc", 576, 1152)],
    "llama-68m": [("qkv", 2304, 768), ("gate_up", 6144, 768), ("down", 768, 3072)],
    "EAGLE head for Llama-3-8B": [("fc", 4096, 8192), ("qkv", 6144, 4096),
                                  ("gate_up", 28672, 4096), ("down", 4096, 14336)],
}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--rows", default="1,4,8,16")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gemv needs an NVIDIA GPU; tests/test_layers.py checks the kernel on the CPU")
        return 2
    from bench.common import environment, read_bandwidth_tbps, time_graph_us
    from specdraft.kernels import linear_small_m

    env = environment()
    read = read_bandwidth_tbps()
    print(f"{env['gpu']}: read {read:.2f} TB/s; torch {env['torch']}", flush=True)
    rows = []
    for model, shapes in SHAPES.items():
        for name, n, k in shapes:
            wbytes = n * k * 2
            copies = max(2, min(64, math.ceil(200e6 / wbytes)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
                  for _ in range(copies)]  # fmt: skip
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
                ours = time_graph_us(
                    [lambda w=w, o=o, x=x: linear_small_m(x, w, out=o) for w, o in zip(ws, outs)]
                )
                cublas = time_graph_us(
                    [lambda w=w, o=o, x=x: torch.matmul(x, w.T, out=o) for w, o in zip(ws, outs)]
                )
                floor = wbytes / (read * 1e12) * 1e6
                row = dict(model=model, proj=name, n=n, k=k, m=m, ours_us=round(ours, 2),
                           cublas_us=round(cublas, 2), ours_over_cublas=round(ours / cublas, 3),
                           floor_us=round(floor, 2))  # fmt: skip
                print(json.dumps(row), flush=True)
                rows.append(row)
            del ws
            torch.cuda.empty_cache()
    cols = ["model", "proj", "n", "k", "m", "ours_us", "cublas_us", "ours_over_cublas",
            "floor_us"]  # fmt: skip
    lines = [f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}; read {read:.2f} TB/s",
             "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]  # fmt: skip
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemv.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    (args.out / "gemv.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
