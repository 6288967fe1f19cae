"""Kernel tests run the Triton kernels on the GPU when there is one, else on CPU tensors through Triton's interpreter.

The interpreter must be chosen before any `@triton.jit` function is defined, hence the environment variable is set here,
before the test modules import the kernels.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda"


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
