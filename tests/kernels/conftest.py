"""Kernel tests run the Triton kernels on the GPU when there is one, else on CPU tensors through Triton's interpreter
(which the kernel modules select themselves when no GPU is present; TRITON_INTERPRET=1 forces it on a GPU machine)."""

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
