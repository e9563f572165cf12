"""This checkout's paged-attention kernel against another copy of `kernels/` (a git
revision), in one process on the same inputs: the same bits, and the time a launch
takes in a chain of programmatic-dependent launches under CUDA-graph replay.

    git archive REV kernels | tar -x -C OTHER      # the other side, e.g. REV = main
    python -m bench.kernel_ab --other OTHER [--out results] [--repeats 3]

OTHER is a folder that holds a `kernels/` package. It is imported under another name,
so both copies live in one process. Decode and 4-token verification shapes for
SmolLM2's heads (9 / 3 x 64) and Llama's (32 / 8 x 128), batch 1 and 8, context 256
and 4096, and llama-68m's (12 / 12 x 64) at batch 1 and 64, context 256, all at a
4096-token length bound. Medians of `--repeats` timings, run
alternately. Writes kernel_ab.json and kernel_ab.md. Without a GPU, only the bit
comparison runs, under the Triton interpreter, on small shapes."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before any kernel is defined: the interpreter
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")

SHAPES = [  # (heads, batch, context, query tokens)
    ("smollm2", 1, 256, 1), ("smollm2", 1, 4096, 1), ("smollm2", 8, 256, 1),
    ("smollm2", 1, 256, 4), ("llama", 1, 256, 1), ("llama", 1, 4096, 1),
    ("llama", 8, 4096, 1), ("llama", 8, 4096, 4), ("llama68m", 1, 256, 1),
    ("llama68m", 64, 256, 1),
]  # fmt: skip
CPU_SHAPES = [("tiny", 2, 70, 1), ("tiny", 1, 130, 4), ("tiny", 3, 33, 2)]
HEADS = {"smollm2": (9, 3, 64), "llama": (32, 8, 128), "llama68m": (12, 12, 64),
         "tiny": (6, 2, 32)}  # fmt: skip
BOUND = 4096


_LOADED = itertools.count()


def load_other(folder: str | Path):
    """The `kernels` package under `folder`, imported under a name of its own (its
    relative imports stay inside it; each call a new one); returns its paged_attention
    module."""
    name = f"kernels_ab_other{next(_LOADED)}"
    src = Path(folder) / "kernels"
    if not (src / "paged_attention.py").is_file():
        raise ValueError(f"--other {str(folder)!r} has no kernels/paged_attention.py")
    tmp = Path(tempfile.mkdtemp(prefix="kernel_ab_"))
    shutil.copytree(src, tmp / name)
    spec = importlib.util.spec_from_file_location(
        name, tmp / name / "__init__.py", submodule_search_locations=[str(tmp / name)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return sys.modules[f"{name}.paged_attention"]


def _batch(heads: str, batch: int, context: int, q: int, device: str, dtype):
    from tests.batch import make_paged_batch

    hq, hkv, d = HEADS[heads]
    g = torch.Generator().manual_seed(batch * 7919 + context + q)
    return make_paged_batch([q] * batch, [context - q] * batch, num_q_heads=hq,
                            num_kv_heads=hkv, head_dim=d, dtype=dtype, device=device,
                            generator=g)  # fmt: skip


def _call(module, b, out, pdl: bool):
    d = b.q.shape[2]
    return module.paged_attention(
        b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_table, d**-0.5,
        out=out, max_query_len=b.max_query_len, max_seq_len=BOUND, pdl=pdl,
    )  # fmt: skip


def compare(shape, other, mine, *, device: str, dtype, repeats: int) -> dict:
    """One shape: bits equal, and (on a GPU) µs a launch for both, medians."""
    b = _batch(*shape, device, dtype)
    outs = {}
    for tag, mod in (("other", other), ("this", mine)):
        outs[tag] = torch.full_like(b.q, float("nan"))
        _call(mod, b, outs[tag], False)
    row = {"heads": shape[0], "batch": shape[1], "context": shape[2], "q": shape[3],
           "bit_equal": bool(torch.equal(outs["other"], outs["this"])),
           "all_written": not bool(outs["this"].isnan().any())}  # fmt: skip
    if device == "cuda":
        from bench.common import time_graph_us
        from specdraft.kernels import pdl_supported

        pdl = pdl_supported(device)
        times = {"other": [], "this": []}
        for _ in range(repeats):
            for tag, mod in (("other", other), ("this", mine)):
                out = outs[tag]
                times[tag].append(time_graph_us([lambda m=mod, o=out: _call(m, b, o, pdl)],
                                                min_launches=30))  # fmt: skip
        row["other_us"] = statistics.median(times["other"])
        row["this_us"] = statistics.median(times["this"])
        row["this_over_other"] = row["this_us"] / row["other_us"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", required=True, help="a folder holding a kernels/ package")
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    other = load_other(args.other)
    import kernels  # noqa: F401  (this checkout's package)

    mine = sys.modules["kernels.paged_attention"]
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    rows = [compare(s, other, mine, device=device, dtype=dtype, repeats=args.repeats)
            for s in (SHAPES if gpu else CPU_SHAPES)]  # fmt: skip
    cols = ["heads", "batch", "context", "q", "bit_equal", "all_written"]
    if gpu:
        cols += ["other_us", "this_us", "this_over_other"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    where = torch.cuda.get_device_name() if gpu else "CPU (interpreter: bits only)"
    text = f"{where}; other: {args.other}; bound {BOUND}\n\n" + "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_ab.json").write_text(json.dumps(rows, indent=1))
    (args.out / "kernel_ab.md").write_text(text)
    print(text)
    return 0 if all(r["bit_equal"] and r["all_written"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
