"""Test set-up: the Triton interpreter when there is no GPU, fixed seeds, the gpu and
interpreter markers."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before any @triton.jit function is created.
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
def _seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"
