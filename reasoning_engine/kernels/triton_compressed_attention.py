"""Triton DeepSeek-V4 attention: `compressed_attention` as in `compressed_attention.py` (the torch reference).

Kernel
- `_compressed_attention_kernel`: one program per query token and block of heads. It walks the token's window rows,
  then its compressed rows (every finished row for HCA, the indexer's picks for CSA), in tiles: each row is gathered
  in place from its paged cache by the (block, offset) the step's addressing gives (the torch path copies them into a
  [T, keys, head_dim] tensor first), scored against every head of the block through `mma` (multi-query: one K = V row
  serves all heads), and folded into an online softmax (FlashAttention, Dao et al., 2022) whose running maximum and
  sum start from the head's sink (exp(sink - m) is the sink's share of the denominator, never of the output). Work
  per query is O(window + rows) whatever the context length; the value of a row is the row tile already loaded.
The compressors, the indexer's scores and its top-k stay in torch (`compressed_attention.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reasoning_engine.kernels._triton_utils import dot_mode, mma, num_warps_for, online_softmax_step, pow2

__all__ = ["compressed_attention"]

_LOG2E = 1.4426950408889634
_ROW_TILE = 32  # rows per step of the loop
_HEAD_BLOCK = 16  # heads per program (mma's smallest M)


@triton.jit
def _attend_rows(q, m_i, l_i, acc, cache_ptr, blk_ptr, off_ptr, valid_ptr, count, qk_scale,
                 stride_cb, stride_cs, d, d_ok, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Fold `count` rows, cache[blk[n], off[n]] where valid[n], into the online softmax (m_i, l_i, acc)."""
    for n0 in range(0, count, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        inside = n < count
        ok = tl.load(valid_ptr + n, mask=inside, other=0) != 0
        blk = tl.load(blk_ptr + n, mask=ok, other=0).to(tl.int64)
        off = tl.load(off_ptr + n, mask=ok, other=0).to(tl.int64)
        rows = cache_ptr + blk * stride_cb + off * stride_cs
        k = tl.load(rows[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        s = mma(q, tl.trans(k), PRECISION) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, k, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _compressed_attention_kernel(
    q_ptr, sink_ptr, out_ptr,
    win_ptr, win_blk_ptr, win_off_ptr, win_valid_ptr,
    row_ptr, row_blk_ptr, row_off_ptr, row_valid_ptr,
    qk_scale, num_heads, num_window, num_rows,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_wb, stride_ws, stride_wblk, stride_woff, stride_wvalid,
    stride_rb, stride_rs, stride_rblk, stride_roff, stride_rvalid,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                other=0.0)
    # the sink as a key of score `sink` and no value: the softmax starts from it (m = sink, l = exp(sink - m) = 1)
    m_i = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    m_i, l_i, acc = _attend_rows(q, m_i, l_i, acc, win_ptr, win_blk_ptr + t * stride_wblk, win_off_ptr + t * stride_woff,
                                 win_valid_ptr + t * stride_wvalid, num_window, qk_scale, stride_wb, stride_ws, d, d_ok,
                                 BLOCK_N, PRECISION)
    m_i, l_i, acc = _attend_rows(q, m_i, l_i, acc, row_ptr, row_blk_ptr + t * stride_rblk, row_off_ptr + t * stride_roff,
                                 row_valid_ptr + t * stride_rvalid, num_rows, qk_scale, stride_rb, stride_rs, d, d_ok,
                                 BLOCK_N, PRECISION)
    out = acc / l_i[:, None]
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & d_ok[None, :])


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def compressed_attention(q: torch.Tensor, window_cache: torch.Tensor, window_block: torch.Tensor,
                         window_offset: torch.Tensor, window_valid: torch.Tensor, sinks: torch.Tensor, scale: float,
                         row_cache: torch.Tensor | None = None, row_block: torch.Tensor | None = None,
                         row_offset: torch.Tensor | None = None, row_valid: torch.Tensor | None = None) -> torch.Tensor:
    """As `compressed_attention.compressed_attention`: q [T, H, D]; the caches [blocks, rows per block, D] (their
    last dimension contiguous: the paged tensors as allocated); addressing [T, W] and [T, R]; returns [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    out = q.new_empty(num_tokens, num_heads, head_dim)
    if num_tokens == 0:
        return out
    for name, cache in (("window_cache", window_cache), ("row_cache", row_cache)):
        if cache is not None and (cache.shape[-1] != head_dim or cache.stride(-1) != 1):
            raise ValueError(f"{name} must be [blocks, rows, {head_dim}] with a contiguous last dimension, got shape "
                             f"{tuple(cache.shape)} strides {cache.stride()}")
    q = _unit_last(q)
    window_block, window_offset, window_valid = (_unit_last(x) for x in (window_block, window_offset, window_valid))
    if row_cache is None:  # no compressed rows: the row loop runs zero times over the window's tensors
        row_cache, row_block, row_offset, row_valid, num_rows = window_cache, window_block, window_offset, window_valid, 0
    else:
        row_block, row_offset, row_valid = (_unit_last(x) for x in (row_block, row_offset, row_valid))
        num_rows = row_block.shape[1]
    block_h = min(pow2(num_heads, _HEAD_BLOCK), _HEAD_BLOCK)
    block_d = pow2(head_dim, 16)
    _compressed_attention_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        q, sinks, out,
        window_cache, window_block, window_offset, window_valid,
        row_cache, row_block, row_offset, row_valid,
        scale * _LOG2E, num_heads, window_block.shape[1], num_rows,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        window_cache.stride(0), window_cache.stride(1), window_block.stride(0), window_offset.stride(0),
        window_valid.stride(0),
        row_cache.stride(0), row_cache.stride(1), row_block.stride(0), row_offset.stride(0), row_valid.stride(0),
        D=head_dim, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_N=_ROW_TILE, PRECISION=dot_mode(q.dtype),
        num_warps=num_warps_for(block_h * block_d),
    )
    return out
