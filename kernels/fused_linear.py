"""One decode-step projection in one launch: y = prologue(x) W^T (+ bias) (+ residual).

At decode sizes (a few rows) a projection is latency-bound: the H200 runs a 576 x 960
cuBLAS GEMM in ~3.5 µs where its weights take 0.25 µs to read, and the RMSNorm before it
and the SiLU-and-multiply or residual add around it are launches of their own. Here each
program holds a [BLOCK_N, K] slice of W in registers (K padded to a power of two, up to
16384) and runs its rows of x through it, with the work around the GEMM folded in:

- NORM: x is RMS-normalized on load (each program recomputes its rows' norms; the
  rounding matches kernels.rms_norm: x * rstd rounded to the dtype, times the weight,
  rounded again);
- SILU: x is [M, 2K] = [gate | up] and the product silu(gate) * up is formed on load
  (rounded as kernels.silu_and_mul rounds it);
- RES: the residual row is added to the float32 accumulator before the single rounding
  (out may be the residual itself: each program reads and writes only its own columns).

Rows: a program takes ROWS of x's rows, one after another (the grid's second axis covers
the rest). A row costs a program about 0.5 µs on the H200 (its reductions run one after
another), a launch about 1.9 µs, so several rows go to several programs, which read the
same W slice (from L2 after the first). A tensor-core variant (x padded to 16 rows, K in
pipelined chunks) measured 2.6x slower than this at 4 rows and 1.6x at 8; it waited
before loading its weights and ran its K loop chunk after chunk.

GDC (programmatic dependent launch, Hopper and later): the program loads its weights,
which no kernel writes, then waits for the previous kernel in the stream to finish
(griddepcontrol.wait) and lets the next one start launching. Every kernel launched with
PDL in specdraft waits before its first read of another kernel's output and before its
first write, so the chain stays ordered while each launch and its weight loads overlap
the kernel before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .guard import INTERPRET
from .launch import CachedLaunch, pdl_launch, specialization_key
from .validation import _check_tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROWS = 8  # rows of x a launch takes (past that, tensor-core GEMMs win)
# Rows a program takes (None: rows_per_program's table); bench and tests set it.
ROWS_PER_PROGRAM: int | None = None
MAX_K = 16384  # the padded reduction width a program holds in registers


@triton.jit
def _fused_linear_kernel(
    x_ptr, w_ptr, b_ptr, g_ptr, r_ptr, out_ptr, M, N, K, eps,
    stride_x, stride_w, stride_r, stride_o,
    KP: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
    SILU: tl.constexpr, RES: tl.constexpr, GDC: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m0 = tl.program_id(1) * ROWS
    end = tl.minimum(m0 + ROWS, M)
    ks = tl.arange(0, KP)
    kmask = ks < K
    cmask = cols < N
    w = tl.load(
        w_ptr + cols[:, None].to(tl.int64) * stride_w + ks[None, :],
        mask=cmask[:, None] & kmask[None, :],
        other=0.0,
    ).to(tl.float32)
    if NORM:
        g = tl.load(g_ptr + ks, mask=kmask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if GDC:  # weights are in flight; now wait for the kernel that wrote x
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    dt = out_ptr.dtype.element_ty
    # Row m + 1's loads are issued before row m's product (software pipelining): with
    # several rows the loop waits on one load latency, not one a row.
    xa, xb, res = _load_row(x_ptr, r_ptr, m0, end, stride_x, stride_r, ks, kmask, cols, cmask,
                            K, SILU, RES)  # fmt: skip
    for m in range(m0, end):
        a, b, r = xa, xb, res
        xa, xb, res = _load_row(x_ptr, r_ptr, m + 1, end, stride_x, stride_r, ks, kmask, cols,
                                cmask, K, SILU, RES)  # fmt: skip
        if SILU:
            s = (a / (1.0 + tl.exp(tl.minimum(-a, 80.0)))).to(dt).to(tl.float32)
            x = (s * b).to(dt).to(tl.float32)
        else:
            x = a
        if NORM:
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
            x = (x * rstd).to(dt).to(tl.float32) * g
            x = x.to(dt).to(tl.float32)
        acc = tl.sum(w * x[None, :], axis=1)
        if HAS_BIAS:
            acc += bias
        if RES:
            acc += r
        tl.store(out_ptr + m * stride_o + cols, acc.to(dt), mask=cmask)


@triton.jit
def _load_row(x_ptr, r_ptr, m, M, stride_x, stride_r, ks, kmask, cols, cmask, K,
              SILU: tl.constexpr, RES: tl.constexpr):  # fmt: skip
    """Row m's inputs as float32 (nothing read past row M - 1): x (with SILU, the gate
    half), the up half (SILU) and the residual's columns (RES); unused ones 0."""
    row = x_ptr + m * stride_x
    # m < M as a tensor: a plain bool mask term is refused by some interpreter versions
    kmask = kmask & ((ks * 0 + m) < M)
    a = tl.load(row + ks, mask=kmask, other=0.0).to(tl.float32)
    b = a
    if SILU:
        b = tl.load(row + K + ks, mask=kmask, other=0.0).to(tl.float32)
    r = tl.zeros(cols.shape, tl.float32)
    if RES:
        cmask = cmask & ((cols * 0 + m) < M)
        r = tl.load(r_ptr + m * stride_r + cols, mask=cmask, other=0.0).to(tl.float32)
    return a, b, r


_LAUNCH = CachedLaunch(_fused_linear_kernel)


def check_fused_linear_args(
    x, weight, *, bias=None, norm_weight=None, silu=False, residual=None, out=None
) -> None:
    """fused_linear's argument checks (nothing launched)."""
    _check_tensor("x", x, 2, _DTYPES)
    _check_tensor("weight", weight, 2, (x.dtype,))
    m, width = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x has {m} rows: fused_linear takes 1 to {MAX_ROWS}")
    k = weight.shape[1]
    want = 2 * k if silu else k
    if width != want:
        raise ValueError(
            f"x has {width} columns; weight {tuple(weight.shape)} needs {want}"
            + (" ([gate | up] with silu=True)" if silu else "")
        )
    if not 1 <= k <= MAX_K:
        raise ValueError(f"weight has in_features {k}: fused_linear takes 1 to {MAX_K}")
    n = weight.shape[0]
    for name, t in (("weight", weight), ("bias", bias), ("norm_weight", norm_weight),
                    ("residual", residual), ("out", out)):  # fmt: skip
        if t is not None and isinstance(t, torch.Tensor) and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if bias is not None:
        _check_tensor("bias", bias, 1, (x.dtype,))
        if bias.shape[0] != n:
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected [{n}]")
    if norm_weight is not None:
        if silu:
            raise ValueError("norm_weight and silu=True cannot be combined")
        _check_tensor("norm_weight", norm_weight, 1, (x.dtype,))
        if norm_weight.shape[0] != k:
            raise ValueError(f"norm_weight has shape {tuple(norm_weight.shape)}, expected [{k}]")
    for name, t in (("residual", residual), ("out", out)):
        if t is not None:
            _check_tensor(name, t, 2, (x.dtype,))
            if tuple(t.shape) != (m, n):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [{m}, {n}]")
    if out is not None and out.data_ptr() != 0:
        x_end = x.data_ptr() + x.element_size() * ((m - 1) * x.stride(0) + width)
        o_end = out.data_ptr() + out.element_size() * ((m - 1) * out.stride(0) + n)
        if out.data_ptr() < x_end and x.data_ptr() < o_end:
            raise ValueError("out overlaps x: every program reads all of x")
        same = residual is not None and residual.data_ptr() == out.data_ptr()
        if same and residual.stride() != out.stride():
            raise ValueError("out aliases residual with other strides")


def rows_per_program(m: int, *, interpret: bool = INTERPRET) -> int:
    """Rows of x one program takes, for m rows (ROWS_PER_PROGRAM when set). Under the
    interpreter, which pays per program, all of them."""
    if ROWS_PER_PROGRAM is not None:
        return max(1, min(ROWS_PER_PROGRAM, m))
    if interpret:
        return m
    # H200, SmolLM2's four projections x 30 layers under a graph with PDL (µs for 1, 2,
    # 3, 4 ... rows a program): 2 rows 288 / 281; 3 rows 352 / 374; 4 rows 410 / 389 /
    # 427 (4); 8 rows 692 / 573 / 603 (4) / 712 (8). One row a program multiplies the
    # programs, each holding its W slice in registers, into several waves; all rows in
    # one program run them one after another.
    return 1 if m == 1 else 2


# Programs a launch may take with more than 4 rows: each holds its W slice in registers,
# and past about this many (a few waves) the fused path lost to cuBLAS. H200, decode step
# at 8 rows under a graph (largest projection's programs): SmolLM2-135M 867 vs 1027 µs
# unfused (1536), its one-layer EAGLE head 56.7 vs 61.5 (1536), llama-68m 136 vs 109
# (3072); llama-68m at 4 rows 94.9 vs 103 (1536).
PROGRAM_BUDGET = 1536
MIN_FUSED_ROWS = 4  # rows every model takes on the fused path (the limit before stop 26)


def max_fused_rows(shapes) -> int:
    """Rows up to which a model whose projections have these weight shapes ([N, K]
    pairs) takes the fused decode path: MIN_FUSED_ROWS, and up to MAX_ROWS while no
    launch needs more than PROGRAM_BUDGET programs (GPU tiles, also under the
    interpreter, so the choice is the same on every machine)."""
    limit = MIN_FUSED_ROWS
    for m in range(MIN_FUSED_ROWS + 1, MAX_ROWS + 1):
        rows = rows_per_program(m, interpret=False)
        progs = max(
            triton.cdiv(int(n), _tile(int(k), interpret=False)[1]) * triton.cdiv(m, rows)
            for n, k in shapes
        )
        if progs > PROGRAM_BUDGET:
            break
        limit = m
    return limit


def _tile(k: int, *, interpret: bool = INTERPRET) -> tuple[int, int, int]:
    """(K padded, columns a program, warps): 64 weights a thread, 4 warps up to K 8192
    (~8192 weights a program; SmolLM2 on the H200: 1.74 µs a launch in a chain), more
    warps past it. One warp a program (row reductions without barriers) measured
    1.07-1.63x slower."""
    kp = triton.next_power_of_2(k)
    warps = min(16, max(4, kp // 2048))
    block_n = max(1, 64 * 32 * warps // kp)
    if interpret:  # the interpreter pays per program: larger slices
        block_n = max(block_n, min(64, 65536 // kp))
    return kp, block_n, warps


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu: bool = False,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """[M, N] = f(x) @ weight[N, K]^T (+ bias) (+ residual), M <= MAX_ROWS, one launch.

    f is the identity, RMSNorm with norm_weight and eps, or (silu=True, x [M, 2K])
    silu(x[:, :K]) * x[:, K:]. out may be residual itself (an in-place residual stream),
    never overlap x. pdl=True launches with programmatic dependent launch (CUDA,
    compute capability 9 or later; see kernels.pdl_supported)."""
    check_fused_linear_args(
        x, weight, bias=bias, norm_weight=norm_weight, silu=silu, residual=residual, out=out
    )
    m = x.shape[0]
    n, k = weight.shape
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    gdc, options = pdl_launch(pdl)
    common = (x, weight, bias if bias is not None else weight,
              norm_weight if norm_weight is not None else weight,
              residual if residual is not None else out, out, m, n, k, float(eps),
              x.stride(0), weight.stride(0),
              residual.stride(0) if residual is not None else 0, out.stride(0))  # fmt: skip
    flags = (bias is not None, norm_weight is not None, bool(silu), residual is not None, gdc)
    kp, block_n, warps = _tile(k)
    rows = rows_per_program(m)
    args = common + (kp, block_n) + flags + (rows,)
    key = specialization_key(args) + (x.device.index, warps)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, rows))
    _LAUNCH(key, grid, args, {"num_warps": warps, **options})
    return out
