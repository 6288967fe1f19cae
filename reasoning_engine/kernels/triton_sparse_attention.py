"""Triton DeepSeek Sparse Attention: the same functions as `sparse_attention.py` (the torch reference).

Kernels
- `_indexer_scores_kernel`: the lightning indexer's scores (DeepSeek-AI, 2025, "DeepSeek-V3.2"), one program per query
  token and tile of context positions: the index keys are read through the block tables from the paged key cache, the
  [heads, tile] products go through `mma`, then ReLU and the per-head weights reduce them to one score per position,
  -inf where the query may not see it (causal order, or the draft tree). The top-k over those rows is torch's.
- `_sparse_mla_kernel`: MLA in absorbed form over each query's selected positions only, for prefill, decode and
  verification alike (causality is already in the selection): one program per query token and block of heads walks
  its selection in tiles, gathers those latent rows through the block tables (key [latent | rope], value = the key's
  latent tile already loaded) and keeps an online softmax (FlashAttention, Dao et al., 2022). Work is
  O(index_topk) per query whatever the context length, which is DSA's point. An FP8 latent cache's tiles are
  dequantised as they are loaded (`triton_attention._load_rows`); the index keys stay in the model's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.kernels._triton_utils import dot_mode, mma, num_warps_for, online_softmax_step, pow2
from reasoning_engine.kernels.sparse_attention import select_topk, token_sequences
from reasoning_engine.kernels.fp8_cache import is_fp8_cache
from reasoning_engine.kernels.triton_attention import (
    TritonAttentionMetadata,
    _load_rows,
    _load_tail,
    _rope_width,
    write_kv_cache,
)

__all__ = ["indexer_scores", "indexer_topk", "sparse_latent_attention", "write_kv_cache"]

_LOG2E = 1.4426950408889634
_SCORE_TILE = 64  # context positions per indexer program
_SELECT_TILE = 32  # selected positions per step of the sparse MLA loop


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, k_ptr, bt_ptr, seq_of_ptr, qsl_ptr, seq_lens_ptr, tree_ptr, out_ptr,
    row0, length, num_heads, block_size, max_query_len,
    stride_qt, stride_qh, stride_wt, stride_kb, stride_ks, stride_bt, stride_tree, stride_out,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_TREE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    t = row0 + tl.program_id(0)
    seq = tl.load(seq_of_ptr + t)
    start = tl.load(qsl_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - (tl.load(qsl_ptr + seq + 1) - start)
    pos = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offset = pos - context  # the key's index among the step's own tokens (negative: cached context)
    visible = (pos < seq_len) & (offset <= t - start)
    if HAS_TREE:
        in_step = visible & (offset >= 0)
        tree = tl.load(tree_ptr + t.to(tl.int64) * stride_tree + tl.minimum(tl.maximum(offset, 0), max_query_len - 1),
                       mask=in_step, other=0)
        visible = visible & ((offset < 0) | (tree != 0))

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < num_heads
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=h_ok[:, None] & (d < D)[None, :], other=0.0)
    w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + h, mask=h_ok, other=0.0)
    blk = tl.load(bt_ptr + seq.to(tl.int64) * stride_bt + pos // block_size, mask=visible, other=0).to(tl.int64)
    k_rows = k_ptr + blk * stride_kb + (pos % block_size).to(tl.int64) * stride_ks
    k = tl.load(k_rows[:, None] + d[None, :], mask=visible[:, None] & (d < D)[None, :], other=0.0)
    dots = tl.maximum(mma(q, tl.trans(k), PRECISION), 0.0)  # [BLOCK_H, BLOCK_N]
    score = tl.sum(w[:, None] * dots, axis=0)
    score = tl.where(visible, score, float("-inf"))
    tl.store(out_ptr + tl.program_id(0).to(tl.int64) * stride_out + pos, score, mask=pos < length)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, batch: ForwardBatch, start: int,
                   stop: int) -> torch.Tensor:
    """As `sparse_attention.indexer_scores`: [stop - start, max_seq_len] float32, -inf where not visible."""
    num_tokens, num_heads, head_dim = q.shape
    length = batch.max_seq_len
    out = torch.empty(stop - start, length, dtype=torch.float32, device=q.device)
    if stop <= start or length == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    weights = weights.float().contiguous()
    tree = batch.tree_mask.to(torch.int8) if batch.tree_mask is not None else None
    block_h, block_d = pow2(num_heads, 16), pow2(head_dim, 16)
    _indexer_scores_kernel[(stop - start, triton.cdiv(length, _SCORE_TILE))](
        q, weights, k_cache, batch.block_tables, token_sequences(batch, num_tokens), batch.query_start_loc,
        batch.seq_lens, tree if tree is not None else q, out,
        start, length, num_heads, k_cache.shape[1], max(batch.max_query_len, 1),
        q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), k_cache.stride(1), batch.block_tables.stride(0),
        tree.stride(0) if tree is not None else 0, out.stride(0),
        D=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=_SCORE_TILE, HAS_TREE=tree is not None,
        PRECISION=dot_mode(q.dtype), num_warps=num_warps_for(block_h * _SCORE_TILE),
    )
    return out


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, batch: ForwardBatch,
                 topk: int) -> torch.Tensor:
    """As `sparse_attention.indexer_topk`, with the scores from `_indexer_scores_kernel`."""
    return select_topk(indexer_scores, q, weights, k_cache, batch, topk)


@triton.jit
def _sparse_mla_kernel(
    q_ptr, kv_ptr, sel_ptr, seq_of_ptr, bt_ptr, out_ptr,
    qk_scale, num_heads, num_selected, block_size,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_st, stride_bt, stride_ot, stride_oh,
    D1: tl.constexpr, D2: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    seq = tl.load(seq_of_ptr + t).to(tl.int64)
    d1 = tl.arange(0, BLOCK_D1)
    d2 = tl.arange(0, BLOCK_D2)
    q_rows = q_ptr + t * stride_qt + h[:, None] * stride_qh
    q1 = tl.load(q_rows + d1[None, :], mask=h_ok[:, None] & (d1 < D1)[None, :], other=0.0)
    q2 = tl.load(q_rows + D1 + d2[None, :], mask=h_ok[:, None] & (d2 < D2)[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D1], tl.float32)
    for n0 in range(0, num_selected, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        pos = tl.load(sel_ptr + t * stride_st + n, mask=n < num_selected, other=-1)
        ok = pos >= 0
        pos = tl.maximum(pos, 0)
        blk = tl.load(bt_ptr + seq * stride_bt + pos // block_size, mask=ok, other=0).to(tl.int64)
        rows = kv_ptr + blk * stride_kb + (pos % block_size).to(tl.int64) * stride_ks
        k1 = _load_rows(rows, d1, ok, d1 < D1, D1, FP8, q_ptr.dtype.element_ty)
        k2 = _load_tail(rows, d2, ok, d2 < D2, D1, FP8, q_ptr.dtype.element_ty)
        s = mma(q1, tl.trans(k1), PRECISION) + mma(q2, tl.trans(k2), PRECISION)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, k1, PRECISION)
    out = acc / l_i[:, None]
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d1[None, :], out.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & (d1 < D1)[None, :])


def sparse_latent_attention(q: torch.Tensor, kv_cache: torch.Tensor, latent_dim: int, batch: ForwardBatch,
                            meta: TritonAttentionMetadata, scale: float, selected: torch.Tensor) -> torch.Tensor:
    """As `sparse_attention.sparse_latent_attention`: q [T, H, latent + rope]; selected [T, K] context positions
    (-1 padded), each query's own position among them; returns [T, H, latent]."""
    num_tokens, num_heads, _ = q.shape
    rope_dim = _rope_width(kv_cache, latent_dim)
    out = q.new_empty(num_tokens, num_heads, latent_dim)
    if num_tokens == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    selected = selected.contiguous()
    block_h = min(pow2(num_heads, 16), 16)
    block_d1, block_d2 = pow2(latent_dim, 16), pow2(rope_dim, 16)
    _sparse_mla_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        q, kv_cache, selected, token_sequences(batch, num_tokens), meta.block_tables, out,
        scale * _LOG2E, num_heads, selected.shape[1], kv_cache.shape[1],
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), selected.stride(0),
        meta.block_tables.stride(0), out.stride(0), out.stride(1),
        D1=latent_dim, D2=rope_dim, BLOCK_D1=block_d1, BLOCK_D2=block_d2, BLOCK_H=block_h, BLOCK_N=_SELECT_TILE,
        PRECISION=dot_mode(q.dtype), FP8=is_fp8_cache(kv_cache), num_warps=num_warps_for(block_h * block_d1),
    )
    return out
