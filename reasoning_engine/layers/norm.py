"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 as the published models were trained."""

from __future__ import annotations

import torch
from torch import nn

from reasoning_engine.kernels import kernel_module


class RMSNorm(nn.Module):
    kernel_family = "norm"

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = kernel_module(self.kernel_family, "torch")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)  # per-head q/k norm
