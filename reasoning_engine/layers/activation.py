"""Gated activations shared by dense MLPs and experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer, 2020): silu(gate) * up for a fused [..., 2 * I] gate_up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
