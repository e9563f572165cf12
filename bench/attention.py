"""Paged-attention benchmark (the main job at this stage).

On a GPU: decode, verification and prefill shapes timed under CUDA-graph replay with
inputs rotated out of L2, next to the floor (bytes over the read-only bandwidth measured
in the same run, or flops over the matmul rate) and to peers measured in the same run
(torch SDPA on the same sizes laid out contiguously, torch FlexAttention where it
compiles, FlashInfer's paged kernels on the same paged cache when `flashinfer` is
importable; without it the table says so). The grid (batch 1 to 256, context 512 to
32768) is followed by shapes no launch configuration was tuned for (grid "off": batch 3,
24, 100; context 777, 6000). `--geometry smollm2` times the embedded model's heads (Hq
9, Hkv 3, D 64) instead of Llama-3-8B's (32, 8, 128). Writes JSON, a markdown table and
a PNG plot. Without a GPU: a small correctness self-check under the Triton interpreter.

    python -m bench.attention [--out results] [--quick] [--sweep] [--no-flex]
                              [--geometry llama|smollm2]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

L2_BYTES = 60 << 20
MAX_CASE_BYTES = 40 << 30
HQ, HKV, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
# Attention heads (Hq, Hkv, head_dim) by model: the module's HQ / HKV / HEAD_DIM.
GEOMETRIES = {"llama": (32, 8, 128), "smollm2": (9, 3, 64)}


def set_geometry(name: str) -> None:
    global HQ, HKV, HEAD_DIM
    HQ, HKV, HEAD_DIM = GEOMETRIES[name]


@dataclass(frozen=True)
class Shape:
    kind: str  # decode | verify | prefill
    batch: int
    context: int  # seq_len of every request, this step's tokens included
    q_len: int
    grid: str = "on"  # "off": a shape no launch configuration was tuned for

    @property
    def kv_bytes(self) -> int:
        return self.batch * self.context * HKV * HEAD_DIM * 2 * DTYPE.itemsize

    @property
    def io_bytes(self) -> int:
        # K/V read once, q read and out written once, block table entries read.
        qo = 2 * self.batch * self.q_len * HQ * HEAD_DIM * DTYPE.itemsize
        return self.kv_bytes + qo + self.batch * math.ceil(self.context / BLOCK_SIZE) * 4

    @property
    def flops(self) -> int:
        # QK^T and PV over the causal (bottom-right aligned) part only.
        ctx0 = self.context - self.q_len
        pairs = self.q_len * ctx0 + self.q_len * (self.q_len + 1) // 2
        return 4 * self.batch * pairs * HQ * HEAD_DIM


def default_shapes(quick: bool) -> list[Shape]:
    batches = [1, 8, 64] if quick else [1, 8, 32, 64, 256]
    contexts = [512, 4096, 32768]
    shapes = [Shape("decode", b, c, 1) for b in batches for c in contexts]
    shapes = [s for s in shapes if s.kv_bytes <= MAX_CASE_BYTES]
    shapes += [Shape("verify", b, 4096, q) for q in (4, 8) for b in (8, 64)]
    shapes.append(Shape("prefill", 2, 4096, 4096))
    shapes += [Shape("decode", b, c, 1, "off") for b in (3, 24, 100) for c in (777, 6000)]
    return shapes


def rotations(shape: Shape) -> int:
    """Input sets to cycle through so the sets together are about 3x the L2."""
    return max(1, min(64, math.ceil(3 * L2_BYTES / shape.kv_bytes)))


class PagedCase:
    """`rotations` independent input sets of one shape over one shared paged cache,
    each request's blocks at random (permuted) ids."""

    def __init__(self, shape: Shape, n_sets: int):
        nb = math.ceil(shape.context / BLOCK_SIZE)
        total_blocks = n_sets * shape.batch * nb
        self.k_cache = torch.randn(
            total_blocks, BLOCK_SIZE, HKV, HEAD_DIM, device="cuda", dtype=DTYPE
        )
        self.v_cache = torch.randn_like(self.k_cache)
        perm = torch.randperm(total_blocks, device="cuda", dtype=torch.int64).to(torch.int32)
        self.tables = list(perm.view(n_sets, shape.batch, nb).unbind(0))
        tokens = shape.batch * shape.q_len
        self.qs = [
            torch.randn(tokens, HQ, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(n_sets)
        ]
        self.outs = [torch.empty_like(q) for q in self.qs]
        self.qsl = (torch.arange(shape.batch + 1, device="cuda") * shape.q_len).to(torch.int32)
        self.seq_lens = torch.full((shape.batch,), shape.context, device="cuda", dtype=torch.int32)
        self.shape = shape

    def launches(self, config=None):
        from specdraft.kernels import paged_attention

        s = self.shape

        def make(i):
            return lambda: paged_attention(
                self.qs[i],
                self.k_cache,
                self.v_cache,
                self.qsl,
                self.seq_lens,
                self.tables[i],
                HEAD_DIM**-0.5,
                out=self.outs[i],
                max_query_len=s.q_len,
                config=config,
            )

        return [make(i) for i in range(len(self.qs))]


def sdpa_launches(shape: Shape, n_sets: int):
    """SDPA over [batch, heads, len, dim] contiguous tensors of the same sizes."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    sets = []
    for _ in range(n_sets):
        q = torch.randn(shape.batch, HQ, shape.q_len, HEAD_DIM, device="cuda", dtype=DTYPE)
        k = torch.randn(shape.batch, HKV, shape.context, HEAD_DIM, device="cuda", dtype=DTYPE)
        sets.append((q, k, torch.randn_like(k)))
    if shape.q_len == 1:
        kw = {}
    elif shape.q_len == shape.context:
        kw = {"is_causal": True}
    else:
        kw = {"attn_mask": causal_lower_right(shape.q_len, shape.context)}
    return [
        (lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw))
        for q, k, v in sets
    ]


FLASHINFER_WORKSPACE = 64 << 20  # bytes of split-k scratch a FlashInfer wrapper gets


def flashinfer_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("flashinfer") is not None


def flashinfer_note() -> str:
    """The table's line on the FlashInfer peer."""
    if not flashinfer_available():
        return "FlashInfer: not importable here, so not measured."
    import flashinfer

    return (f"FlashInfer {getattr(flashinfer, '__version__', '?')}: paged, on our cache "
            f"and tables (flashinfer_err: its largest difference from ours, set 0).")  # fmt: skip


def flashinfer_paging(table: torch.Tensor, context: int, page_size: int):
    """FlashInfer's CSR form of a block table [batch, pages] whose requests all hold
    `context` tokens: (indptr [batch + 1], indices [batch * pages], last_page_len
    [batch]), int32, on the table's device."""
    b, n = table.shape
    if n != math.ceil(context / page_size):
        raise ValueError(f"table has {n} pages a request, context {context} needs "
                         f"{math.ceil(context / page_size)}")  # fmt: skip
    dev = table.device
    indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * n
    indices = table.reshape(-1).to(torch.int32).contiguous()
    last = torch.full((b,), context - (n - 1) * page_size, dtype=torch.int32, device=dev)
    return indptr, indices, last


def flashinfer_launches(case: PagedCase) -> list:
    """FlashInfer over `case`'s own paged cache ([blocks, block, Hkv, D] is its NHD
    layout) and tables, one planned wrapper an input set (graph-capturable buffers):
    its decode wrapper for one query token, its causal paged prefill otherwise (the
    queries at the end of the context, as ours). Each launch writes the set's out."""
    import flashinfer

    s = case.shape
    launches = []
    for q, out, table in zip(case.qs, case.outs, case.tables):
        indptr, indices, last = flashinfer_paging(table, s.context, BLOCK_SIZE)
        ws = torch.zeros(FLASHINFER_WORKSPACE, dtype=torch.uint8, device=q.device)
        common = dict(q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=HEAD_DIM**-0.5)
        if s.q_len == 1:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_cuda_graph=True, use_tensor_cores=HQ // HKV >= 4,
                paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last,
            )  # fmt: skip
            w.plan(indptr, indices, last, HQ, HKV, HEAD_DIM, BLOCK_SIZE, **common)
        else:
            qo = case.qsl.to(torch.int32).clone()
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                ws, "NHD", use_cuda_graph=True, qo_indptr_buf=qo, paged_kv_indptr_buf=indptr,
                paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=last,
            )  # fmt: skip
            w.plan(qo, indptr, indices, last, HQ, HKV, HEAD_DIM, BLOCK_SIZE, causal=True,
                   **common)  # fmt: skip
        kv = (case.k_cache, case.v_cache)
        launches.append(lambda w=w, q=q, out=out, kv=kv: w.run(q, kv, out=out))
    return launches


def flex_launches(shape: Shape, n_sets: int):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    offset = shape.context - shape.q_len
    block_mask = None
    if shape.q_len > 1:

        def causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + offset

        block_mask = create_block_mask(
            causal, None, None, shape.q_len, shape.context, device="cuda"
        )
    import torch._dynamo

    # A fresh cache per shape: past dynamo's recompile limit a compiled function silently
    # falls back to the unfused eager path, which is not the peer we mean to time.
    torch._dynamo.reset()
    flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    sets = []
    for _ in range(n_sets):
        q = torch.randn(shape.batch, HQ, shape.q_len, HEAD_DIM, device="cuda", dtype=DTYPE)
        k = torch.randn(shape.batch, HKV, shape.context, HEAD_DIM, device="cuda", dtype=DTYPE)
        sets.append((q, k, torch.randn_like(k)))
    return [
        (lambda q=q, k=k, v=v: flex(q, k, v, block_mask=block_mask, enable_gqa=True))
        for q, k, v in sets
    ]


def bench_shape(
    shape: Shape, read_bw: float, copy_bw: float, mm_rate: float, flex_ok: bool
) -> dict:
    from bench.common import time_graph_us

    n_sets = rotations(shape)
    case = PagedCase(shape, n_sets)
    ours = case.launches()
    us = time_graph_us(ours)
    row = asdict(shape)
    row.update(
        rotations=n_sets,
        us=us,
        tbps=shape.io_bytes / (us * 1e-6) / 1e12,
        floor_us=max(shape.io_bytes / (read_bw * 1e12), shape.flops / (mm_rate * 1e12)) * 1e6,
    )
    row["frac_read_bw"] = row["tbps"] / read_bw
    row["frac_copy_bw"] = row["tbps"] / copy_bw
    row["tflops"] = shape.flops / (us * 1e-6) / 1e12
    row["flashinfer_us"] = None
    if flashinfer_available():
        try:  # same cache, same tables: the output of set 0 must match ours
            fi = flashinfer_launches(case)
            ours[0]()
            mine = case.outs[0].float().clone()
            fi[0]()
            row["flashinfer_err"] = (case.outs[0].float() - mine).abs().max().item()
            row["flashinfer_us"] = time_graph_us(fi)
            del fi
        except Exception as e:
            row["flashinfer_error"] = f"{type(e).__name__}: {e}"[:200]
    del case, ours
    torch.cuda.empty_cache()
    try:
        row["sdpa_us"] = time_graph_us(sdpa_launches(shape, n_sets))
    except Exception as e:  # a peer that cannot run this shape is reported, not fatal
        row["sdpa_us"], row["sdpa_error"] = None, f"{type(e).__name__}: {e}"[:200]
    torch.cuda.empty_cache()
    row["flex_us"] = None
    if flex_ok:
        try:
            row["flex_us"] = time_graph_us(flex_launches(shape, n_sets))
        except Exception as e:
            row["flex_error"] = f"{type(e).__name__}: {e}"[:200]
        torch.cuda.empty_cache()
    for peer in ("sdpa", "flex", "flashinfer"):
        t = row.get(f"{peer}_us")
        row[f"{peer}_x"] = t / us if t else None
    return row


def sweep(shapes: list[Shape]) -> list[dict]:
    """Time launch-config variants per shape, to tune choose_launch_config."""
    from bench.common import time_graph_us
    from specdraft.kernels.paged_attention import choose_launch_config, num_sms

    out = []
    for shape in shapes:
        n_sets = rotations(shape)
        case = PagedCase(shape, n_sets)
        base = choose_launch_config(
            num_tokens=shape.batch * shape.q_len,
            num_reqs=shape.batch,
            max_query_len=shape.q_len,
            num_q_heads=HQ,
            num_kv_heads=HKV,
            head_dim=HEAD_DIM,
            num_sms_on_device=num_sms(torch.device("cuda")),
        )
        variants = [base]
        for f in (0.5, 2):
            ns = int(base.num_splits * f)
            if 1 <= ns <= 64:
                variants.append(replace(base, num_splits=ns, num_stages=2 if ns > 1 else 3))
        variants += [replace(base, num_stages=st) for st in (2, 3, 4) if st != base.num_stages]
        variants += [replace(base, block_n=bn) for bn in (32, 128)]
        variants.append(replace(base, block_n=128, num_stages=2))
        for cfg in variants:
            try:
                us = time_graph_us(case.launches(cfg))
            except Exception as e:
                us = None
                print(f"  {cfg}: {type(e).__name__}: {str(e)[:120]}")
            tbps = shape.io_bytes / (us * 1e-6) / 1e12 if us else None
            out.append(
                {**asdict(shape), **asdict(cfg), "us": us, "tbps": tbps, "default": cfg == base}
            )
            print(
                f"sweep {shape.kind} b={shape.batch} ctx={shape.context} {cfg} -> "
                f"{us and round(us, 1)} us {tbps and round(tbps, 2)} TB/s",
                flush=True,
            )
        del case
        torch.cuda.empty_cache()
    return out


COLUMNS = [
    ("kind", "kind"),
    ("grid", "grid"),
    ("batch", "batch"),
    ("context", "ctx"),
    ("q_len", "q"),
    ("us", "µs"),
    ("floor_us", "floor µs"),
    ("tbps", "TB/s"),
    ("frac_read_bw", "of read bw"),
    ("sdpa_us", "SDPA µs"),
    ("sdpa_x", "SDPA/ours"),
    ("flex_us", "Flex µs"),
    ("flex_x", "Flex/ours"),
    ("flashinfer_us", "FlashInfer µs"),
    ("flashinfer_x", "FlashInfer/ours"),
    ("flashinfer_err", "FlashInfer err"),
]


def plot(rows: list[dict], read_bw: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    decode = [r for r in rows if r["kind"] == "decode" and r["grid"] == "on"]
    for i, b in enumerate(sorted({r["batch"] for r in decode})):
        pts = sorted((r["context"], r["tbps"]) for r in decode if r["batch"] == b)
        ax.plot(*zip(*pts), marker="o", color=f"C{i}", label=f"specdraft, batch {b}")
        sd = sorted(
            (r["context"], r["io_bytes"] / (r["sdpa_us"] * 1e-6) / 1e12)
            for r in decode
            if r["batch"] == b and r.get("sdpa_us")
        )
        if sd:
            ax.plot(
                *zip(*sd), ls="--", marker="x", color=f"C{i}", alpha=0.6, label=f"SDPA, batch {b}"
            )
    ax.axhline(read_bw, color="k", lw=0.8, label=f"read bandwidth {read_bw:.2f} TB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("effective bandwidth (TB/s)")
    ax.set_title(f"paged decode attention, Hq {HQ} / Hkv {HKV}, D {HEAD_DIM}, bf16, block 16")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def self_check() -> int:
    """No GPU: run the kernel under the Triton interpreter against the reference."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from specdraft.kernels import paged_attention
    from tests.batch import make_paged_batch
    from tests.reference import paged_attention_ref

    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for q_lens, ctx, splits in (([1, 1, 1], [40, 7, 90], None), ([1, 4, 9], [30, 64, 0], 4)):
        b = make_paged_batch(
            q_lens,
            ctx,
            num_q_heads=8,
            num_kv_heads=2,
            head_dim=64,
            dtype=torch.float32,
            pad_reqs=1,
            pad_tokens=2,
            generator=g,
        )
        out = torch.full_like(b.q, float("nan"))
        paged_attention(
            b.q,
            b.k_cache,
            b.v_cache,
            b.query_start_loc,
            b.seq_lens,
            b.block_table,
            0.125,
            out=out,
            max_query_len=max(q_lens),
            num_splits=splits,
        )
        ref = paged_attention_ref(
            b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_table, 0.125
        )
        if torch.isnan(out).any():
            print("self-check FAILED: unwritten output")
            return 1
        worst = max(worst, (out.double() - ref).abs().max().item())
    ok = worst < 1e-4
    print(
        f"no GPU: interpreter self-check {'passed' if ok else 'FAILED'} "
        f"(max abs error {worst:.2e} against the float64 reference)"
    )
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--sweep", action="store_true", help="also time launch-config variants")
    ap.add_argument("--no-flex", action="store_true", help="skip the FlexAttention peer")
    ap.add_argument(
        "--flex-budget-s",
        type=float,
        default=240.0,
        help="stop trying FlexAttention after this many seconds",
    )
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="llama",
                    help="attention heads: llama (32, 8, 128) or smollm2 (9, 3, 64)")  # fmt: skip
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        return self_check()
    set_geometry(args.geometry)

    from bench.common import (
        copy_bandwidth_tbps,
        environment,
        markdown_table,
        matmul_tflops,
        read_bandwidth_tbps,
        save_results,
    )

    env = environment()
    mm_rate = matmul_tflops()  # first: it also brings the clocks up
    copy_rates = copy_bandwidth_tbps()
    copy_bw = copy_rates["best"]
    read_bw = read_bandwidth_tbps()
    print("copy bandwidth (TB/s):", {k: round(v, 2) for k, v in copy_rates.items()})
    print(
        f"{env['gpu']}: read {read_bw:.2f} TB/s, copy {copy_bw:.2f} TB/s, bf16 matmul "
        f"{mm_rate:.0f} TFLOP/s; torch {env['torch']}, triton {env['triton']}",
        flush=True,
    )
    rows = []
    flex_spent = 0.0
    for shape in default_shapes(args.quick):
        t0 = time.time()
        flex_ok = not args.no_flex and flex_spent < args.flex_budget_s
        row = bench_shape(shape, read_bw, copy_bw, mm_rate, flex_ok)
        if flex_ok:
            flex_spent += time.time() - t0
        row["io_bytes"] = shape.io_bytes
        rows.append(row)
        print(
            f"{shape.kind:8s} {shape.grid:3s} b={shape.batch:<4d} ctx={shape.context:<6d} "
            f"q={shape.q_len:<5d}"
            f" {row['us']:9.1f} us  {row['tbps']:.2f} TB/s  floor {row['floor_us']:.1f} us"
            f"  sdpa x{row['sdpa_x'] or 0:.2f}  flex x{row['flex_x'] or 0:.2f}"
            f"  flashinfer x{row['flashinfer_x'] or 0:.2f}",
            flush=True,
        )
    payload = {
        "env": env,
        "geometry": args.geometry,
        "read_tbps": read_bw,
        "copy_tbps": copy_bw,
        "copy_rates": copy_rates,
        "matmul_tflops": mm_rate,
        "rows": rows,
    }
    if args.sweep:
        picks = [
            (1, 512),
            (1, 4096),
            (1, 32768),
            (8, 512),
            (8, 4096),
            (64, 512),
            (64, 4096),
            (256, 4096),
        ]
        shapes = [Shape("decode", b, c, 1) for b, c in picks]
        shapes += [
            Shape("verify", 64, 4096, 4),
            Shape("verify", 64, 4096, 8),
            Shape("prefill", 2, 4096, 4096),
        ]
        payload["sweep"] = sweep(shapes)
    head = (
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, "
        f"{env['date']}; read bandwidth {read_bw:.2f} TB/s (the floor's), copy "
        f"{copy_bw:.2f} TB/s, bf16 matmul {mm_rate:.0f} TFLOP/s. Hq {HQ}, Hkv {HKV}, D "
        f"{HEAD_DIM}, bf16, block {BLOCK_SIZE}; median of CUDA-graph replays, inputs rotated "
        f"out of L2. Grid off: shapes no launch configuration was tuned for. "
        f"{flashinfer_note()}\n\n"
    )
    table = head + markdown_table(rows, COLUMNS)
    save_results(args.out, "attention", payload, table)
    try:
        plot(rows, read_bw, args.out / "attention.png")
    except ImportError:
        print("matplotlib not installed: no plot")
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
