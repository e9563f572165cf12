"""y = x W^T for a few rows of x (decode and draft steps: M <= 16).

The profile of a SmolLM2-135M decode step at batch 1 on the H200 shows cuBLAS taking
3.7-3.9 µs for each of its 120 GEMMs, where reading one projection's weights takes
0.2-1 µs. Here one launch over blocks of output features: each program keeps the (at
most 16) rows of x in a padded [16, BLOCK_K] tile, streams its [BLOCK_N, K] slice of W
once and accumulates in float32 through tl.dot; optional bias. Whether this beats
cuBLAS on a given GPU and shape is measured by bench/gemv.py; specdraft.layers.Linear
uses it only when enabled (SPECDRAFT_GEMV=1 or specdraft.ops.set_small_m_linear(True)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import CachedLaunch, specialization_key
from .paged_attention import _check_tensor, cdiv

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROWS = 16


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = tl.arange(0, 16)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + ks[None, :],
                    mask=cmask[:, None] & kmask[None, :], other=0.0)  # fmt: skip
        if IEEE:  # float32 weights: full-precision products, as F.linear computes
            acc += tl.dot(x, tl.trans(w), input_precision="ieee", out_dtype=tl.float32)
        else:
            acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])  # fmt: skip


_LAUNCH = CachedLaunch(_gemv_kernel)


def check_linear_small_m_args(x, weight, bias=None, *, out=None) -> None:
    """linear_small_m's argument checks (nothing launched)."""
    _check_tensor("x", x, 2, _DTYPES)
    _check_tensor("weight", weight, 2, (x.dtype,))
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x has {m} rows: linear_small_m takes 1 to {MAX_ROWS}")
    if weight.shape[1] != k or weight.device != x.device:
        raise ValueError(
            f"weight {tuple(weight.shape)} on {weight.device} must be [N, {k}] on {x.device}"
        )
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must have contiguous rows")
    n = weight.shape[0]
    if bias is not None:
        _check_tensor("bias", bias, 1, (x.dtype,))
        if bias.shape[0] != n or bias.device != x.device or bias.stride(0) != 1:
            raise ValueError(f"bias {tuple(bias.shape)} must be a contiguous [{n}] on {x.device}")
    if out is not None:
        _check_tensor("out", out, 2, (x.dtype,))
        if tuple(out.shape) != (m, n) or out.device != x.device or out.stride(1) != 1:
            raise ValueError(f"out {tuple(out.shape)} must be [{m}, {n}] with contiguous rows")


def _blocks(n: int, k: int) -> tuple[int, int]:
    block_k = min(256, max(16, triton.next_power_of_2(k)))
    # Enough programs to spread the weights over the SMs, few enough that each streams a
    # useful slice: 32 columns for small N, 64 from N 4096 on.
    block_n = 32 if n < 4096 else 64
    return block_n, block_k


def linear_small_m(x, weight, bias=None, *, out=None) -> torch.Tensor:
    """x [M, K] (M <= 16) @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype."""
    check_linear_small_m_args(x, weight, bias, out=out)
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0 or k == 0:
        return out.zero_() if k == 0 else out
    block_n, block_k = _blocks(n, k)
    has_bias = bias is not None
    args = (x, weight, bias if has_bias else weight, out, m, n, k, x.stride(0),
            weight.stride(0), out.stride(0), has_bias, x.dtype == torch.float32, block_n,
            block_k)  # fmt: skip
    key = specialization_key(args) + (x.device.index,)
    _LAUNCH(key, (cdiv(n, block_n),), args, {"num_warps": 4})
    return out
