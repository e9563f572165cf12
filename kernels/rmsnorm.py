"""RMSNorm with an optional fused residual add.

One program per row; the row lives in registers (hidden sizes up to MAX_HIDDEN), so the
residual add, the sum of squares and the scaling cost one read and one write of each
tensor. The rounding order follows Hugging Face's LlamaRMSNorm: the residual sum is
rounded to the input dtype before it is normalised, and the normalised row is rounded
before it is multiplied by the weight, so bf16 results match the reference bit for bit
in most elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import _check_tensor
from .validation import check_positive_float

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HIDDEN = 32768


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    res_out_ptr,
    w_ptr,
    out_ptr,
    n_cols,
    eps,
    stride_x,
    stride_r,
    stride_ro,
    stride_o,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    y = x * tl.rsqrt(var + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_rows(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    _check_tensor(name, t, 2, (like.dtype,))
    if t.shape != like.shape or t.device != like.device:
        raise ValueError(
            f"{name} {tuple(t.shape)} on {t.device} must match x {tuple(like.shape)} on "
            f"{like.device}"
        )


def check_rms_norm_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> None:
    """rms_norm's argument checks (nothing launched)."""
    _check_tensor("x", x, 2, _DTYPES)
    _check_tensor("weight", weight, 1, _DTYPES)
    rows, hidden = x.shape
    if weight.shape[0] != hidden or weight.device != x.device:
        raise ValueError(
            f"weight {tuple(weight.shape)} on {weight.device} must be [{hidden}] on {x.device}"
        )
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is over MAX_HIDDEN {MAX_HIDDEN}")
    # float32 in the kernel: an eps that rounds to 0 there turns an all-zero row into NaN.
    check_positive_float("eps", eps)
    if residual is not None:
        _check_rows("residual", residual, x)
        _check_rows("residual_out", residual if residual_out is None else residual_out, x)
    elif residual_out is not None:
        raise ValueError("residual_out needs residual")
    if out is not None:
        _check_rows("out", out, x)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y = weight * x / sqrt(mean(x^2) + eps) over the last dimension of x [rows, hidden].

    With `residual` [rows, hidden]: s = x + residual is written to `residual_out`
    (default: `residual`, in place) and y = norm(s); returns (y, residual_out). Without:
    returns y. `out` may be x itself (each program reads its row before writing it).
    Rows are independent, so padded rows with finite inputs stay finite."""
    check_rms_norm_args(x, weight, eps, residual=residual, residual_out=residual_out, out=out)
    rows, hidden = x.shape
    if residual is not None and residual_out is None:
        residual_out = residual
    if out is None:
        out = torch.empty_like(x)
    if rows > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x,
            residual if residual is not None else x,
            residual_out if residual_out is not None else x,
            weight,
            out,
            hidden,
            float(eps),
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            residual_out.stride(0) if residual_out is not None else 0,
            out.stride(0),
            BLOCK_N=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 512)),
        )
    return out if residual is None else (out, residual_out)
