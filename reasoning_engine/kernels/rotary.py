"""Rotary position embedding (Su et al., 2021, "RoFormer") applied to q and k, in plain torch: the CPU path and the
reference for `triton_rotary`.

Tables: `cos` and `sin` are [max_positions, rot_dim // 2] float32, one angle per rotated pair, with any scaling
(llama3, yarn, including yarn's attention factor) already folded in by the layer that builds them. The first `rot_dim`
channels of each head are rotated, the rest pass through unchanged.

Layouts:
- neox (`interleaved=False`): pair i is (x[i], x[i + rot_dim/2]) ("rotate half"); output keeps that layout.
- interleaved (`interleaved=True`, DeepSeek/Kimi): pair i is (x[2i], x[2i+1]). The output is written de-interleaved,
  [rotated evens | rotated odds], exactly as transformers' `apply_rotary_pos_emb_interleave` returns it. Since q and k
  get the same channel permutation, q·k is unchanged; the permuted k_pe is what goes into the KV cache.
"""

from __future__ import annotations

import torch

from reasoning_engine.kernels.attention import write_kv_cache
from reasoning_engine.kernels.norm import rms_norm


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    half = cos.shape[-1]
    whole = 2 * half == x.shape[-1]  # every channel rotated: no pass-through tail to append
    rot = x if whole else x[..., : 2 * half]
    if rot.dtype != torch.float32:
        rot = rot.float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    if rotated.dtype != x.dtype:
        rotated = rotated.to(x.dtype)
    return rotated if whole else torch.cat([rotated, x[..., 2 * half :]], dim=-1)


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T]; q [T, Hq, D], k [T, Hk, D] (may be strided views); cos/sin [max_pos, rot_dim // 2] float32.
    Returns new (q, k), the first rot_dim channels of every head rotated by its token's angle. q and k are rotated
    as one [T, Hq + Hk, D] tensor and returned as views of it: in a CPU decode step each op's dispatch costs more than
    its arithmetic, and one pass instead of two halves the ops."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    both = _rotate(torch.cat([q, k], dim=1), c, s, interleaved)
    return both[:, : q.shape[1]], both[:, q.shape[1] :]


def rotate_tail_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's rotary: the last rot_dim channels of each head rotated in interleaved pairs (2i, 2i+1), kept in
    place (no de-interleaving: V4's values are its keys, and the output projection reads the channels as stored).
    x [T, H, D]; cos, sin [T, rot_dim // 2] float32, already taken at each token's position (negate sin to undo)."""
    half = cos.shape[-1]
    tail = x[..., x.shape[-1] - 2 * half :].float()
    x1, x2 = tail[..., 0::2], tail[..., 1::2]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., : x.shape[-1] - 2 * half], rotated], dim=-1)


def mla_rope_and_cache(
    positions: torch.Tensor, q: torch.Tensor, kv_a: torch.Tensor, w_uk: torch.Tensor, norm_weight: torch.Tensor,
    eps: float, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """What multi-head latent attention (absorbed form) does between its projections and the attention kernel:
    q [T, H, nope + rope] and kv_a [T, latent + rope] (the projections' outputs, may be strided views), w_uk
    [H, nope, latent]. The latent is RMS-normalised (`norm_weight`, `eps`), k_pe rotated, and both written to the
    cache row [latent | rope] at each token's slot; returns the attention query [T, H, latent + rope]: q_nope @ W_UK
    per head, then q_pe rotated. One kernel on the Triton path."""
    nope, latent = w_uk.shape[1], w_uk.shape[2]
    q_nope, q_pe = q.split([nope, q.shape[-1] - nope], dim=-1)
    c_kv, k_pe = kv_a.split([latent, kv_a.shape[-1] - latent], dim=-1)
    c_kv = rms_norm(c_kv, norm_weight, eps)
    q_pe, k_pe = apply_rotary(positions, q_pe, k_pe.unsqueeze(1), cos, sin, interleaved)
    write_kv_cache(cache, torch.cat([c_kv, k_pe.squeeze(1)], dim=-1), slot_mapping)
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, latent]
    return torch.cat([q_latent, q_pe], dim=-1)
