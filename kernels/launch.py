"""A cheaper launch for kernels on the per-step host path.

`kernel[grid](...)` through Triton's JIT binds and specializes every argument and looks
the compiled kernel up on each call: about 20 us of host time on the H200 machine's CPU
for a 15-argument kernel. When the caller fixes everything the compiled kernel depends on
(tensor buffers, constexprs, and integer arguments either fixed or marked
do_not_specialize), the kernel compiled on the first call can be launched directly
through its `CompiledKernel[grid](*args)` handle. Under the interpreter, or if the handle
is missing, every call goes through the JIT.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from typing import Any

import torch

from .guard import INTERPRET

try:
    from triton.compiler import CompiledKernel
except ImportError:  # pragma: no cover - very old Triton
    CompiledKernel = None


def specialization_key(args: tuple) -> tuple:
    """What Triton specializes a compiled kernel on, for positional `args`: tensors by
    dtype and 16-byte alignment, other arguments by value (integers specialize on == 1
    and % 16). A cached kernel is valid for calls whose keys agree."""
    return tuple(
        (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else (type(a), a)
        for a in args
    )


class CachedLaunch:
    """Launch `jit_fn` with the compiled kernel cached under a caller-chosen key.

    The key must capture every constexpr and every specialization that varies between
    calls; all arguments are passed positionally in signature order, constexprs
    included, with launch options (num_warps, ...) given once per key."""

    def __init__(self, jit_fn: Any):
        self.jit_fn = jit_fn
        self._compiled: dict[Hashable, Any] = {}

    def __call__(self, key: Hashable, grid: tuple[int, ...], args: tuple, options: dict) -> None:
        compiled = self._compiled.get(key)
        if compiled is not None:
            # The compiled handle takes a full (x, y, z) grid; the JIT pads it itself.
            compiled[tuple(grid) + (1,) * (3 - len(grid))](*args)
            return
        ret = self.jit_fn[grid](*args, **options)
        if CompiledKernel is not None and isinstance(ret, CompiledKernel):
            self._compiled[key] = ret


_PDL: dict[int, bool] = {}


def pdl_supported(device) -> bool:
    """Whether launches on `device` may use programmatic dependent launch: a CUDA device
    of compute capability 9.0 or later, outside the interpreter, unless SPECDRAFT_PDL=0.
    Kernels launched with it wait (griddepcontrol.wait) before touching anything another
    kernel writes, so it changes timing only."""
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(
            f"device must be a torch.device, a str or a CUDA index, got {type(device).__name__}"
        )
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r} is not a device: {e}") from None
    if device.type != "cuda" or INTERPRET or os.environ.get("SPECDRAFT_PDL", "1") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    got = _PDL.get(index)
    if got is None:
        got = _PDL[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return got


def pdl_launch(pdl: bool) -> tuple[bool, dict]:
    """(the kernels' GDC constexpr, the launch options) for a launcher's `pdl` argument:
    off under the interpreter, which has no griddepcontrol."""
    gdc = bool(pdl) and not INTERPRET
    return gdc, ({"launch_pdl": True} if gdc else {})
