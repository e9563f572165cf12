"""Where the kernels can run, checked before a launch.

Triton compiles for a GPU. On CPU tensors it can only run its interpreter, which is on
when TRITON_INTERPRET=1 is set before the kernels are defined (that is, before
`specdraft` is imported). Without it, Triton fails deep in its driver lookup ("0 active
drivers"); under it, tl.dot on bfloat16 computes garbage (errors of order 1e8), so a
bf16 model would decode nonsense without any error. Both are refused here with a message
that says what to do.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TypeVar

import torch

# Read once: @triton.jit reads the variable when a kernel is defined, so setting it later
# does not turn the interpreter on for kernels already defined.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

F = TypeVar("F", bound=Callable)


def check_tensors_runnable(fn_name: str, named: list[tuple[str, object]]) -> None:
    """Raise ValueError for a CPU tensor without the interpreter, TypeError for a
    bfloat16 tensor under it. `named`: (argument name, value) pairs; non-tensors skipped."""
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            continue
        if t.device.type != "cuda" and not INTERPRET:
            raise ValueError(
                f"{fn_name}: {name} is on {t.device}, but specdraft's Triton kernels need an "
                "NVIDIA GPU. Move the tensors to 'cuda'; on a machine without a GPU either "
                "use the runtime's layers (specdraft.ops runs the PyTorch implementation on "
                "CPU tensors) or set TRITON_INTERPRET=1 before importing specdraft to run "
                "the kernels under the Triton interpreter (slow; for tests)."
            )
        if INTERPRET and t.dtype == torch.bfloat16:
            raise TypeError(
                f"{fn_name}: {name} is bfloat16, which the Triton interpreter computes "
                "wrongly (its bf16 tl.dot); use float16 or float32 under "
                "TRITON_INTERPRET=1, or run bfloat16 on a GPU or through specdraft.ops' "
                "PyTorch path (TRITON_INTERPRET unset)."
            )


def runnable(fn: F) -> F:
    """Decorate a public launcher: check every tensor argument with
    check_tensors_runnable before the launcher runs."""
    import inspect

    params = list(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        named = list(zip(params, args)) + list(kwargs.items())
        check_tensors_runnable(fn.__name__, named)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


# One switch for value checks on device data, kept in kernels/validation.py.
from .validation import validation_enabled  # noqa: E402,F401
