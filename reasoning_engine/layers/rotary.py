"""Rotary position embeddings (Su et al., 2021, arXiv:2104.09864) with the scalings published checkpoints use:
linear, llama3, and YaRN (Peng et al., 2023, arXiv:2309.00071) with DeepSeek's mscale.

Two layouts: neox pairs channel i with i + d/2; interleaved (DeepSeek) pairs channels 2i and 2i+1. Both are applied as
a rotation of (x1, x2) halves and return the rotated halves concatenated; for the interleaved layout that output is
de-interleaved, which is fine because q and k always share it and attention only takes their dot product.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from reasoning_engine.kernels import kernel_module


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for `dim` rotary channels and the factor applied to cos/sin."""
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if not scaling:
        return base, 1.0
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return base / scaling["factor"], 1.0
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > old_len / low, base / factor, base)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, max_position_embeddings, base)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3, yarn)")


def _yarn(dim: int, theta: float, scaling: dict[str, Any], max_position_embeddings: int, base: torch.Tensor) -> tuple[torch.Tensor, float]:
    original = scaling.get("original_max_position_embeddings", max_position_embeddings)
    factor = scaling.get("factor") or max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (base / factor) * (1 - extrapolation) + base * extrapolation
    return inv_freq, float(attention_factor)


def yarn_softmax_scale(scaling: dict[str, Any] | None) -> float:
    """DeepSeek multiplies the softmax scale by mscale(factor, mscale_all_dim)^2 under YaRN."""
    if not scaling or scaling.get("rope_type") != "yarn" or not scaling.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2


class RotaryEmbedding(nn.Module):
    """Holds a cos/sin table and rotates q and k in place of their rotary channels."""

    kernel_family = "rotary"

    def __init__(self, dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int,
                 max_positions: int, interleaved: bool = False) -> None:
        super().__init__()
        with torch.device("cpu"):  # real tables even when the model is built on the meta device
            inv_freq, attention_factor = rope_inv_freq(dim, theta, scaling, max_position_embeddings)
            freqs = torch.arange(max_positions, dtype=torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)
        self.cos = freqs.cos() * attention_factor  # plain float32 tensors: not cast with the weights
        self.sin = freqs.sin() * attention_factor
        self.interleaved = interleaved
        self.ops = kernel_module(self.kernel_family, "torch")

    def to_device(self, device: torch.device) -> None:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, d], k [T, KVH, d] -> rotated copies."""
        return self.ops.apply_rotary(positions, q, k, self.cos, self.sin, self.interleaved)

    def mla_rope_and_cache(self, positions: torch.Tensor, q: torch.Tensor, kv_a: torch.Tensor, w_uk: torch.Tensor,
                           norm_weight: torch.Tensor, eps: float, cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> torch.Tensor:
        """MLA's query/key side with this table (the kernels' `mla_rope_and_cache`): the latent normalised and
        written with the rotated k_pe to the cache; returns the absorbed query [T, H, latent + rope]."""
        return self.ops.mla_rope_and_cache(positions, q, kv_a, w_uk, norm_weight, eps, self.cos, self.sin,
                                           self.interleaved, cache, slot_mapping)
