"""Triton RoPE for q and k: one program per (token, block of heads) loads its angle row once and rotates every head in
the block, reading and writing each element once. Same signature and layouts as `rotary.py` (see there)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reasoning_engine.kernels._triton_utils import num_warps_for, pow2


@triton.jit
def _rotary_kernel(
    x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cos, stride_sin,
    num_heads, head_dim, half,
    INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, BLOCK_HALF)
    head_ok = heads < num_heads
    pair_ok = pairs < half
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_cos + pairs, mask=pair_ok, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_sin + pairs, mask=pair_ok, other=0.0)[None, :]
    if INTERLEAVED:
        first, second = 2 * pairs, 2 * pairs + 1
    else:
        first, second = pairs, pairs + half
    x_row = x_ptr + tok * stride_xt + heads[:, None] * stride_xh
    o_row = out_ptr + tok * stride_ot + heads[:, None] * stride_oh
    m = head_ok[:, None] & pair_ok[None, :]
    x1 = tl.load(x_row + first[None, :], mask=m, other=0.0)
    x2 = tl.load(x_row + second[None, :], mask=m, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(o_row + pairs[None, :], (x1f * c - x2f * s).to(x1.dtype), mask=m)
    tl.store(o_row + half + pairs[None, :], (x2f * c + x1f * s).to(x1.dtype), mask=m)
    if BLOCK_PASS > 0:
        rest = 2 * half + tl.arange(0, BLOCK_PASS)
        mp = head_ok[:, None] & (rest < head_dim)[None, :]
        tl.store(o_row + rest[None, :], tl.load(x_row + rest[None, :], mask=mp), mask=mp)


def _rotate(positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens, heads, head_dim = x.shape
    half = cos.shape[-1]
    out = torch.empty(tokens, heads, head_dim, dtype=x.dtype, device=x.device)
    if tokens and heads:
        block_half = pow2(half)
        block_h = max(1, min(pow2(heads), 4096 // block_half))
        _rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
            x, out, positions, cos, sin,
            x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
            heads, head_dim, half,
            INTERLEAVED=interleaved, BLOCK_H=block_h, BLOCK_HALF=block_half,
            BLOCK_PASS=pow2(head_dim - 2 * half) if head_dim > 2 * half else 0,
            num_warps=num_warps_for(block_h * block_half),
        )
    return out


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T]; q [T, Hq, D], k [T, Hk, D] (may be strided views); cos/sin [max_pos, rot_dim // 2] float32.
    Returns new contiguous (q, k) with the first rot_dim channels of every head rotated by its token's angle."""
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    return _rotate(positions, q, cos, sin, interleaved), _rotate(positions, k, cos, sin, interleaved)
