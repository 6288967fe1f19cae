"""RMSNorm (Zhang & Sennrich, 2019, "Root Mean Square Layer Normalization") in plain torch, optionally fused with the
residual add that precedes it in every pre-norm transformer block. The CPU path and the reference for `triton_norm`.

Rounding follows transformers' RMSNorm: the residual sum is rounded to the activation dtype, the statistics are taken in
float32, the normalised value is rounded to the activation dtype before the weight is applied.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] (rows may be strided), weight [H] -> [T, H] in x's dtype."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # no rounding steps: torch's fused op, same formula
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(x.dtype) * h.to(x.dtype)).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the new residual stream and the next sublayer's input, in one
    pass over memory on the Triton path."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def fused_add_rms_norm_with_float(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fused_add_rms_norm` plus the normalised rows widened to float32 (the MoE router's input, which the Triton
    path writes from the same kernel instead of casting)."""
    out, summed = fused_add_rms_norm(x, residual, weight, eps)
    return out, summed, out.float()
