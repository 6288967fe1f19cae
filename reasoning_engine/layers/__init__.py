"""Building blocks of the models: each layer reads the step's ForwardBatch and never imports the engine."""

from __future__ import annotations

from torch import nn

from reasoning_engine.kernels import kernel_module


def use_kernel_backend(model: nn.Module, backend: str) -> None:
    """Point every layer that has kernels (it names its `kernel_family`) at the torch or Triton implementation."""
    for module in model.modules():
        family = getattr(module, "kernel_family", None)
        if family is not None:
            module.ops = kernel_module(family, backend)
