"""Triton RoPE for q and k: one program per (token, block of heads) loads its angle row once and rotates every head in
the block, reading and writing each element once. Same signature and layouts as `rotary.py` (see there). Also MLA's
whole query/key side in one launch (`mla_rope_and_cache`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reasoning_engine.kernels._triton_utils import dot_mode, mma, num_warps_for, pow2
from reasoning_engine.kernels import rotary as torch_rotary
from reasoning_engine.kernels.fp8_cache import is_fp8_cache


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


@triton.jit
def _rope_pair(x_row, pairs, m, c, s, INTERLEAVED: tl.constexpr, HALF_OFF):
    """Rotated halves (x1 c - x2 s, x2 c + x1 s) in float32 of the rope channels at x_row (+ pair offsets)."""
    if INTERLEAVED:
        first, second = 2 * pairs, 2 * pairs + 1
    else:
        first, second = pairs, pairs + HALF_OFF
    x1 = tl.load(x_row + first[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + second[None, :], mask=m, other=0.0).to(tl.float32)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _mla_rope_cache_kernel(
    q_ptr, kv_ptr, wuk_ptr, nw_ptr, pos_ptr, cos_ptr, sin_ptr, cache_ptr, slots_ptr, out_ptr,
    tokens, num_heads, nope, latent, half, eps,
    stride_qt, stride_qh, stride_kvt, stride_wh, stride_wn, stride_cos, stride_sin, stride_cache, stride_ot, stride_oh,
    INTERLEAVED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_LAT: tl.constexpr, MODE: tl.constexpr,
):
    """Programs (token block, head) for head < H: the absorbed query q_nope @ W_UK[head] (BLOCK_L latent channels at a
    time, W_UK read once per token block) and the rotated q_pe. Programs (token block, H): the token block's cache rows,
    the latent RMS-normalised as `norm.rms_norm` rounds it and k_pe rotated."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    t_ok = t < tokens
    t64 = t.to(tl.int64)
    pos = tl.load(pos_ptr + t, mask=t_ok, other=0).to(tl.int64)
    pairs = tl.arange(0, BLOCK_HALF)
    m = t_ok[:, None] & (pairs < half)[None, :]
    c = tl.load(cos_ptr + pos[:, None] * stride_cos + pairs[None, :], mask=m, other=0.0)
    s = tl.load(sin_ptr + pos[:, None] * stride_sin + pairs[None, :], mask=m, other=0.0)
    if head < num_heads:
        q_row = q_ptr + t64[:, None] * stride_qt + head * stride_qh
        o_row = out_ptr + t64[:, None] * stride_ot + head * stride_oh
        for l0 in range(0, latent, BLOCK_L):
            lat = l0 + tl.arange(0, BLOCK_L)
            l_ok = lat < latent
            acc = tl.zeros([BLOCK_T, BLOCK_L], tl.float32)
            for k0 in range(0, nope, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < nope
                a = tl.load(q_row + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(wuk_ptr + head * stride_wh + k[:, None] * stride_wn + lat[None, :],
                            mask=k_ok[:, None] & l_ok[None, :], other=0.0)
                acc += mma(a, w, MODE)
            tl.store(o_row + lat[None, :], acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & l_ok[None, :])
        r1, r2 = _rope_pair(q_row + nope, pairs, m, c, s, INTERLEAVED, half)
        tl.store(o_row + latent + pairs[None, :], r1.to(out_ptr.dtype.element_ty), mask=m)
        tl.store(o_row + latent + half + pairs[None, :], r2.to(out_ptr.dtype.element_ty), mask=m)
    else:
        kv_row = kv_ptr + t64[:, None] * stride_kvt
        cols = tl.arange(0, BLOCK_LAT)
        cm = t_ok[:, None] & (cols < latent)[None, :]
        x = tl.load(kv_row + cols[None, :], mask=cm, other=0.0)
        xf = x.to(tl.float32)
        inv_rms = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / latent + eps)
        normed = (xf * inv_rms[:, None]).to(x.dtype)
        w = tl.load(nw_ptr + cols, mask=cols < latent, other=0.0).to(x.dtype)
        y = (normed.to(tl.float32) * w.to(tl.float32)[None, :]).to(x.dtype)
        slot = tl.load(slots_ptr + t, mask=t_ok, other=0).to(tl.int64)
        c_row = cache_ptr + slot[:, None] * stride_cache
        tl.store(c_row + cols[None, :], y.to(cache_ptr.dtype.element_ty), mask=cm)
        r1, r2 = _rope_pair(kv_row + latent, pairs, m, c, s, INTERLEAVED, half)
        tl.store(c_row + latent + pairs[None, :], r1.to(x.dtype).to(cache_ptr.dtype.element_ty), mask=m)
        tl.store(c_row + latent + half + pairs[None, :], r2.to(x.dtype).to(cache_ptr.dtype.element_ty), mask=m)


def mla_rope_and_cache(
    positions: torch.Tensor, q: torch.Tensor, kv_a: torch.Tensor, w_uk: torch.Tensor, norm_weight: torch.Tensor,
    eps: float, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """`rotary.mla_rope_and_cache` in one launch: the latent's norm, both rotations, the cache write and the absorbed
    query (every rope channel rotated: rope = 2 * cos.shape[-1]). An FP8 cache (uint8 rows) takes the torch
    reference's path, which quantises the rows as it writes them."""
    if is_fp8_cache(cache):
        return torch_rotary.mla_rope_and_cache(positions, q, kv_a, w_uk, norm_weight, eps, cos, sin, interleaved,
                                               cache, slot_mapping)
    tokens, num_heads, qk_dim = q.shape
    nope, latent = w_uk.shape[1], w_uk.shape[2]
    half = cos.shape[-1]
    if qk_dim != nope + 2 * half or kv_a.shape[-1] != latent + 2 * half or cache.shape[-1] != latent + 2 * half:
        raise ValueError(f"MLA shapes disagree: q {tuple(q.shape)}, kv_a {tuple(kv_a.shape)}, w_uk {tuple(w_uk.shape)}, "
                         f"cache {tuple(cache.shape)}, {2 * half} rotary channels")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv_a.stride(-1) != 1:
        kv_a = kv_a.contiguous()
    if w_uk.stride(-1) != 1:
        w_uk = w_uk.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(tokens, num_heads, latent + 2 * half, dtype=q.dtype, device=q.device)
    if tokens:
        block_t = 16
        block_l = min(128, pow2(latent, 16))
        _mla_rope_cache_kernel[(triton.cdiv(tokens, block_t), num_heads + 1)](
            q, kv_a, w_uk, norm_weight, positions, cos, sin, cache, slot_mapping, out,
            tokens, num_heads, nope, latent, half, eps,
            q.stride(0), q.stride(1), kv_a.stride(0), w_uk.stride(0), w_uk.stride(1), cos.stride(0), sin.stride(0),
            cache.shape[-1], out.stride(0), out.stride(1),
            INTERLEAVED=interleaved, BLOCK_T=block_t, BLOCK_K=min(64, pow2(nope, 16)), BLOCK_L=block_l,
            BLOCK_HALF=pow2(half), BLOCK_LAT=pow2(latent), MODE=dot_mode(q.dtype), num_warps=4,
        )
    return out
