"""Test set-up: the Triton interpreter when there is no GPU (with exact shortcuts in
its slowest paths, checked by test_interpreter_shortcuts), fixed seeds, the gpu and
interpreter markers."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def _share_cores_between_workers() -> None:
    """Under pytest-xdist each worker would start as many torch threads as the machine
    has cores, so two workers on two cores run four busy threads. Each worker takes its
    share instead (an explicit OMP_NUM_THREADS wins): the CPU suite's two heaviest model
    tests took 256 s together at 2 threads a worker and 118 s at 1."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere all cores
        cores = len(affinity(0)) if affinity else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // workers))


_share_cores_between_workers()
if not HAS_CUDA:
    # Must be set before any @triton.jit function is created.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _skip_nested_language_patching(ti) -> None:
    """The interpreter patches triton.language for a launch (and restores it after the
    grid), then patches it again on every call of a @triton.jit helper inside the
    kernel: inspect.getmembers over the language modules each time, about a quarter of
    a helper-heavy test's time, to re-install what the launch already installed. While
    a launch's patch is active, a helper whose language modules it covers skips that;
    anything else takes the interpreter's own path."""
    import inspect

    import triton.language as tl

    original = getattr(ti, "_patch_lang", None)
    if original is None or getattr(original, "_specdraft_shim", False):
        return
    active: list[set[int]] = []  # the language modules the running launch patched

    class _Nothing:
        def restore(self) -> None:
            pass

    modules: dict[object, set[int]] = {}  # a function's language modules, by function

    def patch_lang(fn):
        langs = modules.get(fn)
        if langs is None:
            langs = modules[fn] = {
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
            }
        if active and langs <= active[-1]:
            return _Nothing()
        scope = original(fn)
        if active:  # a helper with other modules: patched as before, never restored
            active[-1] |= langs
            return scope
        active.append(langs)
        restore = scope.restore

        def restore_and_pop() -> None:
            active.pop()
            restore()

        scope.restore = restore_and_pop
        return scope

    patch_lang._specdraft_shim = True
    ti._patch_lang = patch_lang


def _faster_interpreter_paths(ti) -> None:
    """Two more of the interpreter's costs, both exact:
    - tl.sort's bitonic network reduces with xor_sum, which the interpreter runs as a
      Python loop calling the combine function once an element (~20 ms a call on a
      128-element tile); xor is associative and commutative on integers, so numpy's
      bitwise_xor.reduce gives the same bits;
    - the numpy dtype of a Triton dtype: the interpreter rebuilds a 19-entry dict (every
      key hashed) on each of its hundreds of thousands of calls; the answer is cached."""
    import functools

    import numpy as np
    import triton.language as tl

    xor = getattr(tl.standard, "_xor_combine", None)
    reduce_ops = getattr(ti, "ReduceOps", None)
    if xor is not None and reduce_ops is not None and hasattr(reduce_ops, "apply_impl"):
        apply_impl = reduce_ops.apply_impl

        def apply_impl_xor(self, input):
            if self.combine_fn is xor and len(input) == 1:
                data = input[0].handle.data
                out = np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims)
                return self.to_tensor(out, input[0].dtype)
            return apply_impl(self, input)

        reduce_ops.apply_impl = apply_impl_xor
    np_dtype = getattr(ti, "_get_np_dtype", None)
    if np_dtype is not None:
        scalar = functools.lru_cache(maxsize=None)(np_dtype)  # block, pointer types: unhashable

        def get_np_dtype(tt_dtype):
            if isinstance(tt_dtype, tl.block_type):
                tt_dtype = tt_dtype.element_ty
            if isinstance(tt_dtype, tl.pointer_type):
                return np_dtype(tt_dtype)
            return scalar(tt_dtype)

        ti._get_np_dtype = get_np_dtype


if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        from triton.runtime import interpreter as _interpreter
    except ImportError:  # another Triton layout: the interpreter's own paths
        _interpreter = None
    if _interpreter is not None:
        _skip_nested_language_patching(_interpreter)
        _faster_interpreter_paths(_interpreter)


def pytest_configure(config):
    from tests.hf_compat import hide_repo_kernels_from_transformers

    hide_repo_kernels_from_transformers()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        # Kernels on CPU tensors need the interpreter, which is off where CUDA is present;
        # the gpu-marked variants of these tests run there instead.
        marker, reason = "interpreter", "CPU tensors through Triton kernels: CPU-only check"
    else:
        marker, reason = "gpu", "needs an NVIDIA GPU"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _interpreter_overflow_check(request):
    """The interpreter checks every int32 add, sub and mul for overflow (an int64 redo
    and an assert each: ~17% of an engine-level test). The kernels' own unit tests keep
    the check; modules marked no_overflow_check (engines, models, graphs: the same
    kernels again, as plumbing) run without it."""
    if os.environ.get("TRITON_INTERPRET") != "1" or not request.node.get_closest_marker(
        "no_overflow_check"
    ):
        yield
        return
    import dataclasses

    from triton.runtime import interpreter as ti

    builder = ti.interpreter_builder
    options = builder.options
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    try:
        yield
    finally:
        builder.options = options


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"
