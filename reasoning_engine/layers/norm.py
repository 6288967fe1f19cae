"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 as the published models were trained."""

from __future__ import annotations

import torch
from torch import nn

from reasoning_engine.kernels import kernel_module
from reasoning_engine.parallel import Group


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

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) for [T, H] rows: the pre-norm block's residual add and the next norm,
        one kernel on the Triton path."""
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def add_and_norm_with_float(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`add_and_norm` and the normalised rows in float32 too (for a float32 router), one kernel on the Triton
        path."""
        return self.ops.fused_add_rms_norm_with_float(x, residual, self.weight, self.eps)


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a feature dimension that tensor parallelism splits (MiniMax-M2's q/k norm spans all heads of a
    token, and the heads are split over `tp`): each rank keeps its slice of the weight, and the statistic is the
    sum of squares all-reduced over the group divided by the whole dimension, so every rank normalises by the full
    row's RMS, as the unsplit model does."""

    def __init__(self, dim: int, eps: float, tp: Group = Group()) -> None:
        """`dim` is the model's; this rank keeps dim / tp.size channels."""
        super().__init__(dim // tp.size, eps)
        self.tp, self.full_dim = tp, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, dim / tp.size] (rows may be strided)."""
        if self.tp.size == 1:
            return super().forward(x)
        h = x.float()
        sum_sq = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True))
        h = h * torch.rsqrt(sum_sq / self.full_dim + self.eps)
        return (self.weight.to(x.dtype) * h.to(x.dtype)).to(x.dtype)


class OffsetRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint stores weight - 1 (Qwen3-Next, Qwen3.5: a zero-centred weight, so weight decay pulls
    it towards the identity); the one is added once the weights are loaded."""

    def process_weights_after_loading(self) -> None:
        self.weight.data += 1
