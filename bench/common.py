"""Timing under CUDA-graph replay, device ceilings, and result tables."""

from __future__ import annotations

import datetime
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import triton
import triton.language as tl


def time_graph_us(
    launches: Sequence[Callable[[], object]], *, min_launches: int = 20, replays: int = 25
) -> float:
    """Median microseconds per launch under CUDA-graph replay.

    `launches` are equivalent calls over different input sets; the graph cycles through
    them so that consecutive launches read different memory (rotation keeps K/V out of
    L2 when the sets together are several times its size). Each launch runs once
    eagerly first, so compilation stays out of the capture."""
    for fn in launches:
        fn()
    torch.cuda.synchronize()
    n = max(min_launches, len(launches))
    graph = capture_graph(lambda: [launches[i % len(launches)]() for i in range(n)])
    us = replay_us(graph, n, replays=replays)
    del graph
    return us


def replay_us(graph: torch.cuda.CUDAGraph, launches: int, *, replays: int = 25) -> float:
    """Median microseconds per launch of a captured graph of `launches` launches, each
    replay between two events."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


def capture_graph(fn: Callable[[], object], *, stream=None) -> torch.cuda.CUDAGraph:
    """fn() captured into a CUDA graph on the runtime's one capture stream
    (specdraft.cuda_graph.capture_stream: a new stream per capture slows every graph of
    the process once a few have been used), or on `stream`; replayed once (warm)."""
    from specdraft.cuda_graph import capture_stream

    stream = capture_stream() if stream is None else stream
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def eager_us(fn, *, iters: int, warmup: int = 5, after=None) -> float:
    """Median device time of fn() between two events, one call at a time (the host
    waits for each, so launch overhead counts as it does in an eager draft loop)."""
    for _ in range(warmup):
        fn()
        if after:
            after()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if after:
            after()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_bandwidth_tbps(nbytes: int = 4 << 30) -> dict[str, float]:
    """Device-to-device copy rates, bytes read plus bytes written, in TB/s: a memcpy
    captured in a graph, the same memcpy issued eagerly, and an SM copy kernel (an
    elementwise op) in a graph. 'best' is the ceiling the benchmarks compare with."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    moved = 2 * nbytes
    rates = {"memcpy_graph": moved / (time_graph_us([lambda: dst.copy_(src)]) * 1e-6) / 1e12}
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    rates["memcpy_eager"] = moved / (statistics.median(times) * 1e-6) / 1e12
    rates["kernel_graph"] = moved / (time_graph_us([lambda: torch.neg(src, out=dst)]) * 1e-6)
    rates["kernel_graph"] /= 1e12
    rates["best"] = max(rates.values())
    return rates


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, per_prog, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Sums program pid's `per_prog` contiguous elements (UNROLL independent loads of
    BLOCK in flight per iteration) and writes one float32: reads only."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * per_prog
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for base in range(0, per_prog, BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            o = start + base + u * BLOCK + offs
            acc += tl.load(x_ptr + o, mask=o < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def read_bandwidth_tbps(nbytes: int = 2 << 30) -> float:
    """Bytes read per second by the fastest of a few read-only stream kernels (each
    program sums a contiguous slice and writes one float): what a kernel that only reads
    can reach, the floor for reading benchmarks. A copy's read-plus-write rate and
    torch's reductions (a bf16 amax read 3.5 TB/s on the H200 while attention kernels
    read 4.1-4.5) understate it."""
    x = torch.randn(nbytes // 2, device="cuda").bfloat16()
    n = x.numel()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    best = float("inf")
    for waves, block, unroll, warps in ((4, 2048, 4, 8), (8, 2048, 2, 8), (16, 1024, 4, 4),
                                        (32, 1024, 2, 4)):  # fmt: skip
        progs = sms * waves
        per = -(-n // progs)
        per = -(-per // (block * unroll)) * block * unroll
        out = torch.empty(progs, dtype=torch.float32, device="cuda")

        def run(per=per, progs=progs, out=out, block=block, unroll=unroll, warps=warps):
            _read_kernel[(progs,)](x, out, n, per, block, unroll, num_warps=warps)

        best = min(best, time_graph_us([run], min_launches=10))
    return nbytes / (best * 1e-6) / 1e12


def matmul_tflops(n: int = 8192) -> float:
    """bf16 n x n x n matrix product rate on random data, TFLOP/s."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
    us = time_graph_us([lambda: torch.matmul(a, b, out=c)], min_launches=10)
    return 2 * n**3 / (us * 1e-6) / 1e12


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


_CYCLES_PER_US: list[float] = []


def spin_cycles(us: float) -> int:
    """Clock cycles of torch.cuda._sleep that keep the GPU busy for about `us`
    (calibrated once per process with events)."""
    if not _CYCLES_PER_US:
        n = 2_000_000
        torch.cuda._sleep(n)  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(n)
        end.record()
        end.synchronize()
        _CYCLES_PER_US.append(n / (start.elapsed_time(end) * 1e3))
    return int(us * _CYCLES_PER_US[0])


def host_us(fn, iters: int, spin: int = 0, cuda: bool = True) -> list[float]:
    """Host µs of fn(), each call after a synchronize: on an idle GPU (spin 0) or
    behind a spin kernel of `spin` cycles (cuda False: plain CPU calls)."""
    out = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
            if spin:
                torch.cuda._sleep(spin)
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    if cuda:
        torch.cuda.synchronize()
    return out


def host_burst_us(fn, calls: int, spin: int) -> list[float]:
    """Host µs of each of `calls` calls of fn() made back to back, with no synchronize
    between them, all enqueued behind one spin kernel of `spin` cycles (long enough to
    outlast them): the engine's steady state, where each launch follows other launches
    while the GPU works, rather than the first launch after a synchronize."""
    torch.cuda.synchronize()
    torch.cuda._sleep(spin)
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return out


def rows_tiles_arg(text: str) -> list[tuple[str, int, int]]:
    """`--rows-tiles` (bench.decode_step, bench.phase_barrier): comma-separated
    layout/columns/warps items for kernels.fused_linear's ROWS_TILE, layout "runs" or
    "whole", columns >= 1, warps a power of two 1-16; SystemExit naming the item."""
    tiles = []
    for item in (t for t in text.split(",") if t):
        parts = item.split("/")
        ok = len(parts) == 3 and parts[0] in ("runs", "whole")
        ok = ok and all(p.isdigit() for p in parts[1:])
        if not ok or int(parts[1]) < 1 or int(parts[2]) not in (1, 2, 4, 8, 16):
            raise SystemExit(
                f"--rows-tiles: {item!r} must be layout/columns/warps, layout runs or whole, "
                "columns >= 1, warps 1, 2, 4, 8 or 16"
            )
        tiles.append((parts[0], int(parts[1]), int(parts[2])))
    return tiles


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """rows: dicts; columns: (key, header). Floats get 3 significant decimals."""

    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    lines = [
        "| " + " | ".join(h for _, h in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |")
    return "\n".join(lines)


def save_results(out_dir: Path, name: str, payload: dict, table: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=1))
    (out_dir / f"{name}.md").write_text(table + "\n")
