"""Triton paged attention: the same functions as `attention.py` (the torch reference), fed by a per-step metadata object.

Kernels
- `_write_cache_kernel`: scatters each token's K/V (or MLA latent) row into its paged slot.
- decode (every sequence has one query token): FlashDecoding-style split-K (Dao et al., 2023, "Flash-Decoding for
  long-context inference"): each program takes one sequence, one KV head with a block of the query heads that share it
  (so a cache tile is read once for the whole group), and one slice of the context; it keeps an online softmax
  (Milakov & Gimelshein, 2018; FlashAttention, Dao et al., 2022) and writes a normalised partial output with its
  log-sum-exp. `_decode_reduce_kernel` merges the slices. The number of slices is fixed per step (not per sequence),
  so the launch grid depends only on the batch size: each sequence divides its own length into that many slices, and
  a slice past a short sequence's end only marks itself empty (cheap, so a CUDA graph can fix a count for long ones).
- varlen prefill / extend / verification (`_prefill_kernel`): FlashAttention-2 tiling (Dao, 2023) over the ragged
  batch; queries are the last query_len tokens of each sequence, so the causal bound for query i is its absolute
  position context_len + i and chunked prefill needs nothing special. An optional draft-tree mask restricts which of
  the step's own tokens a query sees (speculative tree verification, e.g. SpecInfer, Miao et al., 2024).

MLA runs through the same kernels in absorbed form: one KV head whose key is [latent | rope] (split into two dot
products so neither part is padded to a power of two) and whose value is the latent part of the same cache row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.kernels._triton_utils import dot_mode, mma, num_warps_for, pow2

_LOG2E = 1.4426950408889634
_SPLIT_MIN_TOKENS = 128  # a decode slice shorter than this costs more in the merge than it gains in parallelism
_TARGET_PROGRAMS = 256  # about two waves of an H100/H200's 132 multiprocessors


@dataclass
class TritonAttentionMetadata:
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    tree_mask: torch.Tensor | None  # [T, max_query_len] int8, or None for causal
    max_query_len: int
    block_size: int
    num_splits: int  # decode context slices per sequence


def prepare_attention(batch: ForwardBatch, block_size: int, num_splits: int | None = None) -> TritonAttentionMetadata:
    """Per-step metadata shared by all layers. `num_splits` fixes the decode split count; by default it is a power of
    two that grows with the context and shrinks with the batch (a power of two keeps the number of compiled variants
    of the merge kernel small). A captured CUDA graph needs the same grid at every replay: its batch has
    `static_shapes`, whose max_seq_len is the bound max_model_len, so the count depends on the batch size alone.
    Nothing here reads a tensor's values, so this runs inside the capture and its conversions replay with the graph."""
    if num_splits is None:
        wanted = min(triton.cdiv(max(batch.max_seq_len, 1), _SPLIT_MIN_TOKENS), triton.cdiv(_TARGET_PROGRAMS, max(batch.num_seqs, 1)))
        num_splits = triton.next_power_of_2(max(wanted, 1))
    return TritonAttentionMetadata(
        query_start_loc=batch.query_start_loc.to(torch.int32),
        seq_lens=batch.seq_lens.to(torch.int32),
        block_tables=batch.block_tables.to(torch.int32),
        tree_mask=None if batch.tree_mask is None else batch.tree_mask.to(torch.int8),
        max_query_len=batch.max_query_len,
        block_size=block_size,
        num_splits=num_splits,
    )


@triton.jit
def _write_cache_kernel(values_ptr, cache_ptr, slots_ptr, stride_v, stride_c, width, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    row = tl.load(values_ptr + tok * stride_v + cols, mask=mask)
    tl.store(cache_ptr + slot * stride_c + cols, row.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each token's K/V (or MLA latent) at its slot. cache: [num_blocks, block_size, ...]; values: [T, ...]."""
    tokens = values.shape[0]
    if not tokens:
        return
    width = math.prod(cache.shape[2:])
    flat = values.reshape(tokens, width)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    block = min(pow2(width), 1024)
    _write_cache_kernel[(tokens, triton.cdiv(width, block))](
        flat, cache, slot_mapping, flat.stride(0), width, width, BLOCK=block, num_warps=num_warps_for(block)
    )


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    qk_scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    num_heads, group, block_size, num_splits,
    D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    num_head_blocks = tl.cdiv(group, BLOCK_G)
    kv_head = head_block // num_head_blocks
    g = (head_block % num_head_blocks) * BLOCK_G + tl.arange(0, BLOCK_G)
    g_ok = g < group
    heads = kv_head * group + g

    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    part_row = (seq * num_heads + heads).to(tl.int64) * num_splits + split
    if start >= end:
        # a slice past this sequence's end (the split count is the batch's, or a CUDA graph's bound): no keys, so
        # only its log-sum-exp, which tells the merge to skip it
        tl.store(part_lse_ptr + part_row, tl.full([BLOCK_G], float("-inf"), tl.float32), mask=g_ok)
        return

    d1 = tl.arange(0, BLOCK_D1)
    dv = tl.arange(0, BLOCK_DV)
    q_rows = q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q1 = tl.load(q_rows + d1[None, :], mask=g_ok[:, None] & (d1 < D1)[None, :], other=0.0)
    if D2 > 0:
        d2 = tl.arange(0, BLOCK_D2)
        q2 = tl.load(q_rows + D1 + d2[None, :], mask=g_ok[:, None] & (d2 < D2)[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < end
        blk = tl.load(bt_ptr + seq.to(tl.int64) * stride_bt + pos // block_size, mask=ok, other=0).to(tl.int64)
        slot_in_block = (pos % block_size).to(tl.int64)
        k_rows = k_ptr + blk * stride_kb + slot_in_block * stride_ks + kv_head * stride_kh
        k1 = tl.load(k_rows[:, None] + d1[None, :], mask=ok[:, None] & (d1 < D1)[None, :], other=0.0)
        s = mma(q1, tl.trans(k1), PRECISION)
        if D2 > 0:
            k2 = tl.load(k_rows[:, None] + D1 + d2[None, :], mask=ok[:, None] & (d2 < D2)[None, :], other=0.0)
            s += mma(q2, tl.trans(k2), PRECISION)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = v_ptr + blk * stride_vb + slot_in_block * stride_vs + kv_head * stride_vh
        v = tl.load(v_rows[:, None] + dv[None, :], mask=ok[:, None] & (dv < DV)[None, :], other=0.0)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, PRECISION)
        m_i = m_new

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(part_lse_ptr + part_row, lse, mask=g_ok)
    tl.store(part_out_ptr + part_row[:, None] * DV + dv[None, :], out, mask=g_ok[:, None] & (dv < DV)[None, :])


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, num_heads, num_splits,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    base = (seq * num_heads + head).to(tl.int64) * num_splits
    lse = tl.load(part_lse_ptr + base + s, mask=s < num_splits, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, axis=0))
    used = lse > float("-inf")  # empty slices wrote no output (their weight is 0)
    parts = tl.load(part_out_ptr + (base + s)[:, None] * DV + dv[None, :], mask=used[:, None] & (dv < DV)[None, :], other=0.0)
    out = tl.sum(weights[:, None] * parts, axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + dv, out.to(out_ptr.dtype.element_ty), mask=dv < DV)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, tree_ptr,
    qk_scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt, stride_tree,
    group, block_size,
    D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_TREE: tl.constexpr, PRECISION: tl.constexpr,
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    kv_head = head // group

    i = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    i_ok = i < q_len
    q_pos = context_len + i
    tok = (q_start + i).to(tl.int64)
    d1 = tl.arange(0, BLOCK_D1)
    dv = tl.arange(0, BLOCK_DV)
    q_rows = q_ptr + tok[:, None] * stride_qt + head * stride_qh
    q1 = tl.load(q_rows + d1[None, :], mask=i_ok[:, None] & (d1 < D1)[None, :], other=0.0)
    if D2 > 0:
        d2 = tl.arange(0, BLOCK_D2)
        q2 = tl.load(q_rows + D1 + d2[None, :], mask=i_ok[:, None] & (d2 < D2)[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    kv_end = tl.minimum(seq_len, context_len + (m_block + 1) * BLOCK_M)
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < kv_end
        blk = tl.load(bt_ptr + seq.to(tl.int64) * stride_bt + pos // block_size, mask=ok, other=0).to(tl.int64)
        slot_in_block = (pos % block_size).to(tl.int64)
        k_rows = k_ptr + blk * stride_kb + slot_in_block * stride_ks + kv_head * stride_kh
        k1 = tl.load(k_rows[:, None] + d1[None, :], mask=ok[:, None] & (d1 < D1)[None, :], other=0.0)
        s = mma(q1, tl.trans(k1), PRECISION)
        if D2 > 0:
            k2 = tl.load(k_rows[:, None] + D1 + d2[None, :], mask=ok[:, None] & (d2 < D2)[None, :], other=0.0)
            s += mma(q2, tl.trans(k2), PRECISION)
        allowed = i_ok[:, None] & (pos[None, :] <= q_pos[:, None])
        if HAS_TREE:
            j = pos - context_len  # index among the step's own tokens; negative for the cached context
            in_step = (j >= 0)[None, :]
            tree = tl.load(tree_ptr + tok[:, None] * stride_tree + j[None, :], mask=allowed & in_step, other=0)
            allowed = allowed & ((tree != 0) | ~in_step)
        s = tl.where(allowed, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = v_ptr + blk * stride_vb + slot_in_block * stride_vs + kv_head * stride_vh
        v = tl.load(v_rows[:, None] + dv[None, :], mask=ok[:, None] & (dv < DV)[None, :], other=0.0)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = out_ptr + tok[:, None] * stride_ot + head * stride_oh
    tl.store(o_rows + dv[None, :], out.to(out_ptr.dtype.element_ty), mask=i_ok[:, None] & (dv < DV)[None, :])


def _attend(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_dims: tuple[int, int], v_dim: int,
    batch: ForwardBatch, meta: TritonAttentionMetadata, scale: float,
) -> torch.Tensor:
    """q [T, H, d1 + d2]; k/v caches viewed as [num_blocks, block_size, KVH, *] (v may alias k); returns [T, H, v_dim]."""
    tokens, num_heads, _ = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    d1, d2 = k_dims
    out = torch.empty(tokens, num_heads, v_dim, dtype=q.dtype, device=q.device)
    if not tokens:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    q = q.to(k_cache.dtype)
    dims = dict(
        D1=d1, D2=d2, DV=v_dim, BLOCK_D1=pow2(d1, 16), BLOCK_D2=pow2(d2, 16) if d2 else 0, BLOCK_DV=pow2(v_dim, 16),
        PRECISION=dot_mode(k_cache.dtype),
    )
    strides = (*q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3])
    wide = dims["BLOCK_DV"] >= 256
    qk_scale = scale * _LOG2E
    num_seqs = batch.num_seqs
    if meta.max_query_len == 1:
        splits = meta.num_splits
        block_g = min(pow2(group, 16), 16 if wide else 64)
        part_out = torch.empty(num_seqs, num_heads, splits, v_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
        _decode_partial_kernel[(num_seqs, num_kv_heads * triton.cdiv(group, block_g), splits)](
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, part_out, part_lse,
            qk_scale, *strides, meta.block_tables.stride(0), num_heads, group, meta.block_size, splits,
            BLOCK_G=block_g, BLOCK_N=32 if wide else 64, num_warps=8 if wide else 4, **dims,
        )
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_heads, splits,
            DV=v_dim, BLOCK_DV=dims["BLOCK_DV"], BLOCK_S=pow2(splits), num_warps=num_warps_for(dims["BLOCK_DV"]),
        )
        return out
    tree = meta.tree_mask
    block_m = 16 if wide else 64
    _prefill_kernel[(triton.cdiv(meta.max_query_len, block_m), num_seqs, num_heads)](
        q, k_cache, v_cache, out, meta.block_tables, meta.query_start_loc, meta.seq_lens, tree if tree is not None else meta.seq_lens,
        qk_scale, *strides, out.stride(0), out.stride(1), meta.block_tables.stride(0), tree.stride(0) if tree is not None else 0,
        group, meta.block_size,
        BLOCK_M=block_m, BLOCK_N=32 if wide else 64, HAS_TREE=tree is not None, num_warps=8 if wide else 4, **dims,
    )
    return out


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, meta: TritonAttentionMetadata, scale: float
) -> torch.Tensor:
    """GQA over the paged cache. q [T, H, D]; caches [num_blocks, block_size, KVH, D]; returns [T, H, Dv].
    Decode-only steps take the split-K path (T == B, token b belongs to sequence b); others the varlen kernel."""
    return _attend(q, k_cache, v_cache, (q.shape[-1], 0), v_cache.shape[-1], batch, meta, scale)


def paged_latent_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, latent_dim: int, batch: ForwardBatch, meta: TritonAttentionMetadata, scale: float
) -> torch.Tensor:
    """MLA in absorbed form: one shared latent head. q [T, H, latent + rope]; cache [num_blocks, block_size,
    latent + rope] whose first `latent_dim` channels are also the values; returns [T, H, latent]."""
    cache = kv_cache.unsqueeze(2)
    return _attend(q, cache, cache, (latent_dim, kv_cache.shape[-1] - latent_dim), latent_dim, batch, meta, scale)
