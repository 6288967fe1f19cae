"""Triton ragged non-causal attention for the vision encoder: the same function as `vision_attention.py`.

FlashAttention-2 tiling (Dao, 2023) over a packed batch of images: one program per (query block, item, head) keeps
an online softmax (Milakov & Gimelshein, 2018) over its item's keys, so the [L, L] score matrix never exists and
items of any mix of sizes share one launch. Programs whose query block lies past their item's end return at once.
Head dimensions that are not a power of two (MoonViT's 72) are padded to the next one with masked loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reasoning_engine.kernels._triton_utils import dot_mode, mma, pow2

_LOG2E = 1.4426950408889634


@triton.jit
def _varlen_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    m_block = tl.program_id(0)
    item = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(cu_ptr + item)
    length = tl.load(cu_ptr + item + 1) - start
    if m_block * BLOCK_M >= length:
        return

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < length
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_tok = (start + rows).to(tl.int64)
    q = tl.load(q_ptr + q_tok[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, length, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < length  # every tile has at least one valid key, so each row's running max stays finite
        kv_tok = (start + cols).to(tl.int64)
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_tok[:, None] * stride_kt + head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        s = tl.where(col_ok[None, :], mma(q, tl.trans(k), PRECISION) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_tok[:, None] * stride_vt + head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_ptrs = out_ptr + q_tok[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _tiles(block_d: int) -> tuple[int, int, int]:
    """(queries per program, keys per tile, warps): wide heads (MoonViT's 72 padded to 128) take narrower key tiles
    and 8 warps, so the [BLOCK_M, BLOCK_D] float32 accumulator and the K/V tiles fit in registers (179 registers,
    no spill on sm_90 by benchmarks/kernel_report.py; 4 warps spilled)."""
    if block_d >= 128:
        return 64, 32, 8
    return 64, 64, 4


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                     max_seqlen: int | None = None) -> torch.Tensor:
    """q, k, v [T, heads, head_dim] with unit stride in head_dim; cu_seqlens [items + 1] int, from 0 to T. Returns
    [T, heads, head_dim] in q's dtype. `max_seqlen` (the longest item) sizes the launch; read from cu_seqlens if
    not given."""
    tokens, heads, head_dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    items = cu_seqlens.numel() - 1
    if not tokens or items <= 0:
        return out
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    block_d = pow2(head_dim, 16)
    block_m, block_n, warps = _tiles(block_d)
    _varlen_attention_kernel[(triton.cdiv(max_seqlen, block_m), items, heads)](
        q, k, v, out, cu_seqlens.to(device=q.device, dtype=torch.int32),
        scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=dot_mode(q.dtype),
        num_warps=warps,
    )
    return out
