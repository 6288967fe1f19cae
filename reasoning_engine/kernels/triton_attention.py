"""Triton paged attention: the same functions as `attention.py` (the torch reference), fed by a per-step metadata object.

Kernels
- `_write_cache_kernel`: scatters each token's K/V (or MLA latent) row into its paged slot.
- decode (every sequence has one query token): FlashDecoding-style split-K (Dao et al., 2023, "Flash-Decoding for
  long-context inference"): each program takes one sequence, one KV head with a block of the query heads that share it
  (so a cache tile is read once for the whole group), and one slice of the context; it keeps an online softmax
  (Milakov & Gimelshein, 2018; FlashAttention, Dao et al., 2022) and writes a normalised partial output with its
  log-sum-exp. `_decode_reduce_kernel` merges the slices, a fixed number at a time, in slice order (one
  program per sequence, head and block of output channels).
  A sequence's slices depend on its own length only (`split_plan`: slices of a fixed number of tokens, lengthened
  past `_MAX_SPLITS` slices), never on the batch it shares or on the launch's bound, so its output is bitwise the
  same alone or in any batch, eagerly or replayed from a CUDA graph (batch invariance, as argued in He et al., 2025,
  "Defeating Nondeterminism in LLM Inference"). The launch has as many slices as the longest possible sequence
  needs (the step's longest eagerly, max_model_len in a graph); programs past a sequence's last slice return at once.
- varlen prefill / extend / verification (`_prefill_kernel`): FlashAttention-2 tiling (Dao, 2023) over the ragged
  batch; queries are the last query_len tokens of each sequence, so the causal bound for query i is its absolute
  position context_len + i and chunked prefill needs nothing special. An optional draft-tree mask restricts which of
  the step's own tokens a query sees (speculative tree verification, e.g. SpecInfer, Miao et al., 2024).

MLA runs through the same kernels in absorbed form: one KV head whose key is [latent | rope] (split into two dot
products so neither part is padded to a power of two) and whose value is the latent part of the same cache row: the
kernels multiply the probabilities by the key's latent tile they already hold instead of loading it again.
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
_SPLIT_TOKENS = 256  # tokens per decode slice: enough work per program that the partial results (H x Dv float32 per
# slice) stay a small share of the cache bytes read, small enough that a 32k context spreads over 128 programs
_MAX_SPLITS = 128  # slices per sequence at most (about one per SM of an H200); longer contexts get longer slices
_MERGE_SPLITS = 32  # slices the merge kernel reads per step ...
_NO_WINDOW = 1 << 30  # the window of a full-attention layer: longer than any context, so it cuts nothing off
_MERGE_CHANNELS = 64  # ... of this many output channels: a [32, 64] float32 tile, 16 registers a thread; a batch-1
# step of 8 heads x 512 channels is 64 programs (one per (sequence, head) would be 8, each reading 128 slices)


@dataclass
class TritonAttentionMetadata:
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    tree_mask: torch.Tensor | None  # [T, max_query_len] int8, or None for causal
    max_query_len: int
    max_seq_len: int  # host bound on every sequence's length: the step's longest, or max_model_len in a CUDA graph
    block_size: int
    split_tokens: int  # tokens per decode slice (see `split_plan`)


def split_plan(seq_len: int, split_tokens: int = _SPLIT_TOKENS) -> tuple[int, int]:
    """(tokens per slice, slices) of a decoding sequence of `seq_len` tokens: slices of `split_tokens`, or whole
    multiples of it once that would exceed `_MAX_SPLITS` slices. The kernels compute the same (`_split_plan`)."""
    per_split = split_tokens * triton.cdiv(triton.cdiv(max(seq_len, 1), split_tokens), _MAX_SPLITS)
    return per_split, triton.cdiv(max(seq_len, 1), per_split)


def launch_splits(max_seq_len: int, split_tokens: int = _SPLIT_TOKENS) -> int:
    """Slices a decode launch provides: as many as any sequence of at most `max_seq_len` tokens uses (the count is
    not monotonic in the length: past the cap, slices lengthen and their number drops)."""
    return min(triton.cdiv(max(max_seq_len, 1), split_tokens), _MAX_SPLITS)


def prepare_attention(batch: ForwardBatch, block_size: int, split_tokens: int = _SPLIT_TOKENS) -> TritonAttentionMetadata:
    """Per-step metadata shared by all layers. `split_tokens` sets the decode slice length (tests shorten it to split
    small contexts). A CUDA-graph batch has `static_shapes`: its max_seq_len is the bound max_model_len, so the launch
    has the slices of the longest possible sequence, while each sequence still uses its own (`split_plan`).
    Nothing here reads a tensor's values, so this runs inside the capture and its conversions replay with the graph."""
    return TritonAttentionMetadata(
        query_start_loc=batch.query_start_loc.to(torch.int32),
        seq_lens=batch.seq_lens.to(torch.int32),
        block_tables=batch.block_tables.to(torch.int32),
        tree_mask=None if batch.tree_mask is None else batch.tree_mask.to(torch.int8),
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        block_size=block_size,
        split_tokens=split_tokens,
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
def _split_plan(seq_len, split_tokens, MAX_SPLITS: tl.constexpr):
    """(tokens per slice, slices) of a sequence, as `split_plan`."""
    per_split = split_tokens * tl.cdiv(tl.cdiv(seq_len, split_tokens), MAX_SPLITS)
    return per_split, tl.cdiv(seq_len, per_split)


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    num_heads, group, block_size, num_splits, split_tokens,
    D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, V_FROM_K: tl.constexpr, MAX_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One slice of one sequence for a block of the query heads of one KV head. V_FROM_K: the value is the key's first
    DV channels (MLA's latent), taken from the key tile instead of loaded again. A sliding `window` slices only the
    keys it spans: the last `window` of the sequence."""
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = tl.maximum(seq_len - window, 0)
    per_split, splits = _split_plan(seq_len - lo, split_tokens, MAX_SPLITS)
    if split >= splits:
        return  # past this sequence's last slice: the merge reads only its own slices
    num_head_blocks = tl.cdiv(group, BLOCK_G)
    kv_head = head_block // num_head_blocks
    g = (head_block % num_head_blocks) * BLOCK_G + tl.arange(0, BLOCK_G)
    g_ok = g < group
    heads = kv_head * group + g
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)
    part_row = (seq * num_heads + heads).to(tl.int64) * num_splits + split

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
        if V_FROM_K:
            v = k1
        else:
            v_rows = v_ptr + blk * stride_vb + slot_in_block * stride_vs + kv_head * stride_vh
            v = tl.load(v_rows[:, None] + dv[None, :], mask=ok[:, None] & (dv < DV)[None, :], other=0.0)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(part_lse_ptr + part_row, m_i + tl.log2(l_i), mask=g_ok)
    tl.store(part_out_ptr + part_row[:, None] * DV + dv[None, :], out, mask=g_ok[:, None] & (dv < DV)[None, :])


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, seq_lens_ptr, sinks_ptr, stride_ot, stride_oh, num_heads, num_splits,
    split_tokens, window,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, MAX_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Merge one (sequence, head)'s slices for BLOCK_DV of its channels: the largest log-sum-exp first, then the
    slices' outputs weighted by exp2(lse - max), BLOCK_S slices at a time in slice order, so the sum's order depends
    on the sequence alone. A head's sink logit (HAS_SINKS) joins the denominator as one more slice with no output."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    _, splits = _split_plan(seq_len - tl.maximum(seq_len - window, 0), split_tokens, MAX_SPLITS)
    base = (seq * num_heads + head).to(tl.int64) * num_splits
    dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    top = tl.full([], float("-inf"), tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        top = tl.maximum(top, tl.max(tl.load(part_lse_ptr + base + s, mask=s < splits, other=float("-inf")), axis=0))
    acc = tl.zeros([BLOCK_DV], tl.float32)
    total = tl.zeros([], tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        used = s < splits
        weights = tl.exp2(tl.load(part_lse_ptr + base + s, mask=used, other=float("-inf")) - top)
        parts = tl.load(part_out_ptr + (base + s)[:, None] * DV + dv[None, :], mask=used[:, None] & (dv < DV)[None, :], other=0.0)
        acc += tl.sum(weights[:, None] * parts, axis=0)
        total += tl.sum(weights, axis=0)
    if HAS_SINKS:  # the partial sums are relative to exp2(top): rescale them to a maximum that counts the sink
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        new_top = tl.maximum(top, sink)
        acc = acc * tl.exp2(top - new_top)
        total = total * tl.exp2(top - new_top) + tl.exp2(sink - new_top)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + dv, (acc / total).to(out_ptr.dtype.element_ty), mask=dv < DV)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, tree_ptr, positions_ptr, sinks_ptr,
    qk_scale, window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt, stride_tree,
    group, block_size,
    D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_TREE: tl.constexpr, V_FROM_K: tl.constexpr,
    PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """A sliding `window` counts back from each query's position (a draft node's: context length + depth, read from
    `positions_ptr`); a head's sink logit (HAS_SINKS) joins each row's softmax denominator at the end."""
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

    if HAS_TREE:
        win_pos = tl.load(positions_ptr + tok, mask=i_ok, other=0)
        kv_start = tl.maximum(context_len + 1 - window, 0)  # a draft node's position is at least context_len
    else:
        win_pos = q_pos
        kv_start = tl.maximum(context_len + m_block * BLOCK_M + 1 - window, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    kv_end = tl.minimum(seq_len, context_len + (m_block + 1) * BLOCK_M)
    for n0 in range(kv_start, kv_end, BLOCK_N):
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
        allowed = i_ok[:, None] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > win_pos[:, None] - window)
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
        if V_FROM_K:
            v = k1
        else:
            v_rows = v_ptr + blk * stride_vb + slot_in_block * stride_vs + kv_head * stride_vh
            v = tl.load(v_rows[:, None] + dv[None, :], mask=ok[:, None] & (dv < DV)[None, :], other=0.0)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, PRECISION)
        m_i = m_new

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        acc = acc * tl.exp2(m_i - m_fin)[:, None]
        l_i = l_i * tl.exp2(m_i - m_fin) + tl.exp2(sink - m_fin)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = out_ptr + tok[:, None] * stride_ot + head * stride_oh
    tl.store(o_rows + dv[None, :], out.to(out_ptr.dtype.element_ty), mask=i_ok[:, None] & (dv < DV)[None, :])


def _decode_tiles(group: int, block_dv: int, v_from_k: bool) -> tuple[int, int, int]:
    """(query heads per program, keys per tile, warps) of the decode kernel. Wide values (MLA's 512-channel latent)
    keep a [heads, 512] float32 accumulator in registers: 16 heads x 32 keys (127-128 registers, two CTAs per SM on
    sm_90 and sm_100), or, when the key tile doubles as the value tile, 32 heads x 16 keys (Kimi's 64 heads: two
    programs per cache tile; 130 registers on sm_90, so one CTA per SM there, and 128, two CTAs, on sm_100), both 56 KB
    shared (benchmarks/results/kernel_report_cpu_aot_2026-12-07.md). 64 heads per program spills 76 to 1,040 bytes a
    thread on sm_90 at 8 or 16 warps, 16 or 32 keys, 1 to 3 stages."""
    if block_dv >= 256:
        if v_from_k and group > 16:
            return 32, 16, 8
        return min(pow2(group, 16), 16), 32, 8
    return min(pow2(group, 16), 64), 64, 4


def decode_traffic(seq_lens: list[int], num_heads: int, num_kv_heads: int, k_dims: tuple[int, int], v_dim: int,
                   elem_bytes: int, v_from_k: bool, split_tokens: int = _SPLIT_TOKENS) -> dict[str, tuple[float, int]]:
    """(bytes requested as written, programs that do work) of each of a decode step's two kernels, for
    benchmarks/kernel_report.py's roofline table: a program reads its slice's cache rows (and value rows unless
    V_FROM_K) and its queries, and writes a partial output per head; the merge reads them back (the log-sum-exps once
    per pass and block of channels) and writes the output. Programs past a sequence's last slice are not counted."""
    group = num_heads // num_kv_heads
    block_g = _decode_tiles(group, pow2(v_dim, 16), v_from_k)[0]
    head_blocks = num_kv_heads * triton.cdiv(group, block_g)
    channel_blocks = triton.cdiv(v_dim, min(pow2(v_dim, 16), _MERGE_CHANNELS))
    row = (sum(k_dims) + (0 if v_from_k else v_dim)) * elem_bytes
    partial = merge = 0.0
    programs = 0
    for seq_len in seq_lens:
        splits = split_plan(seq_len, split_tokens)[1]
        partial += head_blocks * seq_len * row + splits * num_heads * (sum(k_dims) * elem_bytes + v_dim * 4 + 4)
        merge += num_heads * (splits * (v_dim * 4 + 8 * channel_blocks) + v_dim * elem_bytes)
        programs += head_blocks * splits
    return {"_decode_partial_kernel": (partial, programs),
            "_decode_reduce_kernel": (merge, len(seq_lens) * num_heads * channel_blocks)}


def _attend(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_dims: tuple[int, int], v_dim: int,
    batch: ForwardBatch, meta: TritonAttentionMetadata, scale: float, sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """q [T, H, d1 + d2]; k/v caches viewed as [num_blocks, block_size, KVH, *] (v may alias k); returns [T, H, v_dim].
    `sinks` [H] and `window` as in `paged_attention`."""
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
    v_from_k = v_cache is k_cache and v_dim == d1
    window = _NO_WINDOW if window is None else window
    sink_arg = sinks if sinks is not None else meta.seq_lens  # any pointer when there are no sinks
    if meta.max_query_len == 1:
        splits = launch_splits(meta.max_seq_len, meta.split_tokens)
        block_g, block_n, warps = _decode_tiles(group, dims["BLOCK_DV"], v_from_k)
        part_out = torch.empty(num_seqs, num_heads, splits, v_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
        _decode_partial_kernel[(num_seqs, num_kv_heads * triton.cdiv(group, block_g), splits)](
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, part_out, part_lse,
            qk_scale, window, *strides, meta.block_tables.stride(0), num_heads, group, meta.block_size, splits, meta.split_tokens,
            BLOCK_G=block_g, BLOCK_N=block_n, V_FROM_K=v_from_k, MAX_SPLITS=_MAX_SPLITS, num_warps=warps, **dims,
        )
        merge_dv = min(dims["BLOCK_DV"], _MERGE_CHANNELS)
        _decode_reduce_kernel[(num_seqs, num_heads, triton.cdiv(v_dim, merge_dv))](
            part_out, part_lse, out, meta.seq_lens, sink_arg, out.stride(0), out.stride(1), num_heads, splits,
            meta.split_tokens, window,
            DV=v_dim, BLOCK_DV=merge_dv, BLOCK_S=_MERGE_SPLITS, MAX_SPLITS=_MAX_SPLITS, HAS_SINKS=sinks is not None,
            num_warps=num_warps_for(_MERGE_SPLITS * merge_dv),
        )
        return out
    tree = meta.tree_mask
    block_m = 16 if wide else 64
    _prefill_kernel[(triton.cdiv(meta.max_query_len, block_m), num_seqs, num_heads)](
        q, k_cache, v_cache, out, meta.block_tables, meta.query_start_loc, meta.seq_lens, tree if tree is not None else meta.seq_lens,
        batch.positions if tree is not None else meta.seq_lens, sink_arg, qk_scale, window, *strides, out.stride(0), out.stride(1), meta.block_tables.stride(0), tree.stride(0) if tree is not None else 0,
        group, meta.block_size,
        BLOCK_M=block_m, BLOCK_N=32 if wide else 64, HAS_TREE=tree is not None, V_FROM_K=v_from_k,
        HAS_SINKS=sinks is not None,
        num_warps=8 if wide else 4, num_stages=2 if wide else 3, **dims,  # wide, 3 stages: the tree mask spills
    )
    return out


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, meta: TritonAttentionMetadata,
    scale: float, sinks: torch.Tensor | None = None, window: int | None = None,
) -> torch.Tensor:
    """GQA over the paged cache. q [T, H, D]; caches [num_blocks, block_size, KVH, D]; returns [T, H, Dv].
    Decode-only steps take the split-K path (T == B, token b belongs to sequence b); others the varlen kernel.
    `sinks` [H]: per-head logits in each softmax's denominator; `window`: a query at position p sees only the keys at
    positions above p - window."""
    return _attend(q, k_cache, v_cache, (q.shape[-1], 0), v_cache.shape[-1], batch, meta, scale, sinks, window)


def paged_latent_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, latent_dim: int, batch: ForwardBatch, meta: TritonAttentionMetadata, scale: float
) -> torch.Tensor:
    """MLA in absorbed form: one shared latent head. q [T, H, latent + rope]; cache [num_blocks, block_size,
    latent + rope] whose first `latent_dim` channels are also the values; returns [T, H, latent]."""
    cache = kv_cache.unsqueeze(2)
    return _attend(q, cache, cache, (latent_dim, kv_cache.shape[-1] - latent_dim), latent_dim, batch, meta, scale)
