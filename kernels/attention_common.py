"""Device helpers both attention kernels use (kernels/paged_attention.py, the tiled
kernel; kernels/token_attention.py, the token programs): one definition each, so the two
clamp metadata and cap scores the same way."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_qsl(qsl_ptr, i, num_tokens):
    """query_start_loc[i] clamped into [0, num_tokens]: a start past q's rows (or
    negative) can neither index q nor place a write outside `out`."""
    return tl.minimum(tl.maximum(tl.load(qsl_ptr + i), 0), num_tokens)


@triton.jit
def _softcapped(s, scale, softcap):
    """Scores s (q . k, unscaled) as softcap * tanh(s * scale / softcap) in log2 units;
    tanh through exp: saturates to +-1, never NaN."""
    x = s * (scale / softcap)
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * 1.4426950408889634
