"""Gated activations shared by dense MLPs and experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reasoning_engine.kernels.fused_moe import limited_swiglu


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer, 2020): silu(gate) * up for a fused [..., 2 * I] gate_up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def limited_silu_and_mul(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's SwiGLU: gate clamped above at `limit`, up to [-limit, limit], then silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return limited_swiglu(gate, up, limit)
