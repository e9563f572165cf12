"""A grid barrier for persistent launches: every program of the launch resident at once
(at most one a multiprocessor here), meeting at one int32 counter.

A program arrives after its stores (a CTA barrier, then one release add by one thread);
a program waits until the counter reaches the arrivals it needs (acquire loads by one
thread, then a CTA barrier). Targets grow through a launch: the phase-p wait needs p x
programs arrivals. The launch leaves the counter at zero: the last program to arrive
after the last phase resets it, when no program can be waiting on it any more.

Under the interpreter programs run one after another, so a wait on another program
never returns: callers run one program there. Data written by another program before a
barrier is read at L2 (cache_modifier=".cg") after it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grid_arrive(counter_ptr):
    """Every store of this program so far is visible to a program whose grid_wait
    counts this arrival. Returns the counter before the arrival."""
    tl.debug_barrier()  # every thread's stores precede the release
    return tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def grid_wait(counter_ptr, target):
    """Returns once the counter holds at least `target` arrivals."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()  # no thread reads before the acquire


@triton.jit
def grid_reset(counter_ptr, last_old, arrivals):
    """After a program's last arrival (which returned `last_old`): the last program of
    all `arrivals` sets the counter back to zero."""
    if last_old == arrivals - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


def check_grid_resident(programs: int, device) -> None:
    """A persistent launch's programs must all be resident: at most one a multiprocessor."""
    import torch

    if torch.device(device).type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if programs > sms:
            raise ValueError(f"programs {programs}: a grid barrier needs at most {sms} (one an SM)")
