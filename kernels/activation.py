"""SwiGLU activation: silu(gate) * up over the fused gate_up projection output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import _check_tensor, cdiv

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    n_cols,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    # silu rounded to the input dtype before the product, as torch computes
    # act_fn(gate) * up in that dtype. The exponent is capped so that very negative g
    # gives ~-0 without an overflow (silu(-80) is -1e-33 either way).
    s = (g / (1.0 + tl.exp(tl.minimum(-g, 80.0)))).to(out_ptr.dtype.element_ty)
    s = s.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def check_silu_and_mul_args(x: torch.Tensor, *, out: torch.Tensor | None = None) -> None:
    """silu_and_mul's argument checks (nothing launched)."""
    _check_tensor("x", x, 2, _DTYPES)
    rows, width = x.shape
    if width % 2:
        raise ValueError(f"x must have an even last dimension [gate | up], got {width}")
    n = width // 2
    if out is not None:
        _check_tensor("out", out, 2, (x.dtype,))
        if tuple(out.shape) != (rows, n) or out.device != x.device:
            raise ValueError(
                f"out {tuple(out.shape)} on {out.device} must be [{rows}, {n}] on {x.device}"
            )


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [rows, 2 * n] holding [gate | up]; returns silu(gate) * up, [rows, n]."""
    check_silu_and_mul_args(x, out=out)
    rows, width = x.shape
    n = width // 2
    if out is None:
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    block = min(triton.next_power_of_2(n), 2048)
    _silu_and_mul_kernel[(rows, cdiv(n, block))](
        x,
        out,
        n,
        x.stride(0),
        out.stride(0),
        BLOCK=block,
        num_warps=max(1, min(8, block // 256)),
    )
    return out
