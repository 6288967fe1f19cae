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

MLA runs in absorbed form: one KV head whose key is [latent | rope] (split into two dot products so neither part is
padded to a power of two) and whose value is the latent part of the same cache row, multiplied by the probabilities
from the key tile already held instead of loaded again. Its sequences of at most SHORT_QUERY query tokens (decodes,
draft trees being verified, small chunks) go through `_latent_partial_kernel`, in the manner of FlashMLA (DeepSeek,
2025): one program per (sequence, slice of the context, block of 64 query-token x head rows), so every head of a
token shares each latent tile, loaded once for the QK product and every value channel, and the rows form a tile the
tensor cores take whole (wgmma on sm_90, tcgen05 on sm_100); the slices
(`latent_split_plan`: as many as the GPU has SMs, none shorter than its partial output weighs, from the sequence's
own length) merge in `_latent_reduce_kernel` (a cast, a copy, where every sequence has one slice).
Longer chunks in the same step go through the prefill kernel, which skips the short sequences. A step of decodes
alone with at most `_DECODE_KERNEL_HEADS` heads per rank takes the decode kernel instead, which holds all of them in
one program (`decodes_take_decode_kernel`).

An FP8 cache (uint8 rows of e4m3 values, each row's bfloat16 scale after them, MLA's rotary key in bfloat16 after that:
kernels/fp8_cache.py) is dequantised as each tile is loaded (`_load_rows`, `_load_tail`; FP8 constexpr), into the
query's dtype, so the products run as with a bfloat16 cache; rows are written quantised by torch ops, then scattered.
The latent split kernel (and the decode kernel over MLA's latent) instead converts the e4m3 values alone (exact in
bfloat16) and, the scale being one per key, multiplies the scores' column and the probabilities' column by it
([rows, keys] products, not one per loaded value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.kernels._triton_utils import dot_mode, mma, num_warps_for, pow2
from reasoning_engine.kernels.fp8_cache import SCALE_BYTES, is_fp8_cache, quantize_rows

_LOG2E = 1.4426950408889634
_SPLIT_TOKENS = 256  # tokens per decode slice: enough work per program that the partial results (H x Dv float32 per
# slice) stay a small share of the cache bytes read, small enough that a 32k context spreads over 128 programs
_MAX_SPLITS = 128  # slices per sequence at most (about one per SM of an H200); longer contexts get longer slices
_MERGE_SPLITS = 32  # slices the merge kernel reads per step ...
_NO_WINDOW = 1 << 30  # the window of a full-attention layer: longer than any context, so it cuts nothing off
_MERGE_CHANNELS = 64  # ... of this many output channels: a [32, 64] float32 tile, 16 registers a thread; a batch-1
# step of 8 heads x 512 channels is 64 programs (one per (sequence, head) would be 8, each reading 128 slices)
SHORT_QUERY = 16  # query tokens of a sequence the latent split kernel takes (decodes, drafts, small chunks)
_LATENT_BLOCK_M = 64  # (query token, head) rows of a latent program: one warpgroup-wide tile (wgmma / tcgen05)
_LATENT_BLOCK_N = 32  # keys per latent tile
_LATENT_SLICE_KEYS = 64  # latent slices are whole multiples of this many keys (two tiles)
_LATENT_WARPS = 8  # two warpgroups, each with half of the value channels of a program's [64, 512] float32 accumulator
_LATENT_STAGES = 2  # latent tiles in flight: [32, 576] bf16 (36 KB) each, beside the queries' 72 KB
_LATENT_BLOCK_N_FP8 = 64  # keys per latent tile of an FP8 cache: its 642-byte rows are only 2-byte aligned, so a tile
# is loaded through registers a few bytes at a time, and the loop's work per tile (the accumulator's rescaling, the
# tensor-core handshakes) is paid over twice the keys (128 keys: spills)
_LATENT_STAGES_FP8 = 1  # ... loaded in the iteration that uses them (no async copy to overlap at that alignment)
MAX_TREE_QUERY = 31  # query tokens of a short sequence at most: its draft-tree rows are bit masks in an int32
_DEFAULT_SMS = 132  # an H100's / H200's SM count: the latent slice cap where no GPU is visible (ahead-of-time reports)
_DECODE_KERNEL_HEADS = 16  # MLA heads per rank up to which a step of decodes alone takes the decode kernel


def device_sms(device: torch.device) -> int:
    """The SM count of `device` (the latent kernels' cap on slices per sequence), or an H200's without a GPU."""
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def latent_min_split(num_heads: int, latent_dim: int, row_bytes: int) -> int:
    """Fewest keys per slice of the latent kernel: whole pairs of key tiles, enough that the slice's cache rows weigh at least
    its partial output (heads x latent float32), which a program writes whatever its length. A program's time is
    about its bytes over one SM's share of bandwidth, so slicing shorter than this makes no program faster."""
    tiles = triton.cdiv(num_heads * latent_dim * 4, _LATENT_SLICE_KEYS * row_bytes)
    return _LATENT_SLICE_KEYS * max(tiles, 1)


def latent_split_plan(seq_len: int, min_split: int, max_splits: int) -> tuple[int, int]:
    """(keys per slice, slices) of a sequence of `seq_len` keys in the latent kernel: as many slices as the GPU has
    SMs (so one sequence alone fills it), none shorter than `min_split`, each a whole multiple of it. It depends on
    the sequence's own length only (batch invariance). The kernels compute the same (`_latent_plan`)."""
    per_split = min_split * triton.cdiv(triton.cdiv(max(seq_len, 1), max_splits), min_split)
    return per_split, triton.cdiv(max(seq_len, 1), per_split)


def latent_launch_splits(max_seq_len: int, min_split: int, max_splits: int) -> int:
    """Slices a latent launch provides: the most any sequence of at most `max_seq_len` keys uses (monotonic)."""
    return min(triton.cdiv(max(max_seq_len, 1), min_split), max_splits)


def decodes_take_decode_kernel(num_heads: int, max_heads: int = _DECODE_KERNEL_HEADS) -> bool:
    """Whether an MLA step of decodes alone (one query token per sequence) with `num_heads` heads per rank goes
    through the decode kernel rather than the latent split kernel: up to `_DECODE_KERNEL_HEADS` heads (Kimi K2.5
    under TP 8, Moonlight; `max_heads`: tests lower it). There one decode program holds every head over a cache tile
    (`_decode_tiles`), reads the tile once, and its loop issues enough to draw more than HBM's bandwidth with two CTAs
    an SM, while the latent kernel's 64-row tile is mostly padding and its [64, 512] accumulator leaves one CTA an SM
    (benchmarks/kernel_report.py). With more heads (64: Kimi without TP) the decode kernel splits the heads over
    several programs per tile and the latent kernel does better. Steps with drafts or chunks use the
    latent kernel whatever the head count, so at these head counts a decode's bits depend on whether its step also
    verifies drafts (never on the other sequences' lengths)."""
    return num_heads <= max_heads


@dataclass
class TritonAttentionMetadata:
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    tree_mask: torch.Tensor | None  # [T, max_query_len] int8, or None for causal
    tree_bits: torch.Tensor | None  # [T] int32: bit j set where a short sequence's query row sees its step token j
    max_query_len: int
    max_seq_len: int  # host bound on every sequence's length: the step's longest, or max_model_len in a CUDA graph
    block_size: int
    split_tokens: int | None  # tokens per decode slice (see `split_plan`), or None for each kernel's own choice
    max_splits: int  # slices per sequence at most of the latent kernels: the device's SM count (`latent_split_plan`)
    short_query: int  # a sequence with at most this many query tokens goes through the latent split kernel
    decode_kernel_heads: int  # ... except in a step of decodes alone with at most this many heads (`decodes_take_decode_kernel`)
    short_rows_start: torch.Tensor  # [B + 1] int32: where each short sequence's query rows start among all short rows
    short_rows: int  # query rows of the short sequences (the latent partial buffers' first dimension)
    short_max_query_len: int  # the most query tokens of a short sequence (0: none)
    short_max_seq_len: int  # host bound on a short sequence's length
    has_long: bool  # some sequence has more than `short_query` query tokens (the prefill kernel's)


def tree_bits(tree_mask: torch.Tensor, short_query: int) -> torch.Tensor:
    """Each query row's draft-tree mask over the step's first `short_query` tokens as the bits of an int32 (bit j: the
    row sees token j), which the latent kernel reads once per row instead of a byte per (row, key) in its loop."""
    if not 0 < short_query <= MAX_TREE_QUERY:
        raise ValueError(f"short_query must be in 1..{MAX_TREE_QUERY}, got {short_query}")
    cols = min(tree_mask.shape[1], short_query)
    weights = torch.ones(cols, dtype=torch.int32, device=tree_mask.device) << torch.arange(cols, dtype=torch.int32, device=tree_mask.device)
    return (tree_mask[:, :cols].to(torch.int32) * weights).sum(dim=1, dtype=torch.int32)


def split_plan(seq_len: int, split_tokens: int = _SPLIT_TOKENS) -> tuple[int, int]:
    """(tokens per slice, slices) of a decoding sequence of `seq_len` tokens: slices of `split_tokens`, or whole
    multiples of it once that would exceed `_MAX_SPLITS` slices. The kernels compute the same (`_split_plan`)."""
    per_split = split_tokens * triton.cdiv(triton.cdiv(max(seq_len, 1), split_tokens), _MAX_SPLITS)
    return per_split, triton.cdiv(max(seq_len, 1), per_split)


def launch_splits(max_seq_len: int, split_tokens: int = _SPLIT_TOKENS) -> int:
    """Slices a decode launch provides: as many as any sequence of at most `max_seq_len` tokens uses (the count is
    not monotonic in the length: past the cap, slices lengthen and their number drops)."""
    return min(triton.cdiv(max(max_seq_len, 1), split_tokens), _MAX_SPLITS)


def prepare_attention(batch: ForwardBatch, block_size: int, split_tokens: int | None = None,
                      short_query: int = SHORT_QUERY, decode_kernel_heads: int = _DECODE_KERNEL_HEADS) -> TritonAttentionMetadata:
    """Per-step metadata shared by all layers. `split_tokens` sets the decode slice length (tests shorten it to split
    small contexts; `decode_kernel_heads` 0 sends MLA decodes of any head count to the latent kernel). A CUDA-graph
    batch has `static_shapes`: its max_seq_len is the bound max_model_len, so the launch has the slices of the
    longest possible sequence, while each sequence still uses its own (`split_plan`).
    A decode step's short rows are its sequences (one each, the query start offsets); a step with longer queries
    counts them on the host (`query_lens_cpu`), which only eager steps have.
    Nothing here reads a tensor's values, so this runs inside the capture and its conversions replay with the graph."""
    query_start_loc = batch.query_start_loc.to(torch.int32)
    if batch.max_query_len <= 1:
        short_start, short_rows, short_query_len = query_start_loc, batch.num_seqs, batch.max_query_len
        short_seq_len, has_long = batch.max_seq_len, False
    else:
        lens = batch.query_lens_cpu
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + (n if n <= short_query else 0))
        short_start = torch.tensor(starts, dtype=torch.int32, device=query_start_loc.device)
        short = [b for b, n in enumerate(lens) if n <= short_query]
        short_rows, has_long = starts[-1], len(short) < len(lens)
        short_query_len = max((lens[b] for b in short), default=0)
        short_seq_len = max((batch.seq_lens_cpu[b] for b in short), default=0)
    return TritonAttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=batch.seq_lens.to(torch.int32),
        block_tables=batch.block_tables.to(torch.int32),
        tree_mask=None if batch.tree_mask is None else batch.tree_mask.to(torch.int8),
        tree_bits=None if batch.tree_mask is None else tree_bits(batch.tree_mask, short_query),
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        block_size=block_size,
        split_tokens=split_tokens,
        max_splits=device_sms(batch.seq_lens.device),
        short_query=short_query,
        decode_kernel_heads=decode_kernel_heads,
        short_rows_start=short_start,
        short_rows=short_rows,
        short_max_query_len=short_query_len,
        short_max_seq_len=short_seq_len,
        has_long=has_long,
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
    """Store each token's K/V (or MLA latent) at its slot. cache: [num_blocks, block_size, ...]; values: [T, ...].
    An FP8 cache's rows are quantised first (as `attention.write_kv_cache` does), then scattered as bytes."""
    tokens = values.shape[0]
    if not tokens:
        return
    if is_fp8_cache(cache):
        values = quantize_rows(values, tail=cache.shape[-1] - values.shape[-1] - SCALE_BYTES)
    width = math.prod(cache.shape[2:])
    flat = values.reshape(tokens, width)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    block = min(pow2(width), 1024)
    _write_cache_kernel[(tokens, triton.cdiv(width, block))](
        flat, cache, slot_mapping, flat.stride(0), width, width, BLOCK=block, num_warps=num_warps_for(block)
    )


@triton.jit
def _load_rows(rows, cols, ok, cols_ok, WIDTH: tl.constexpr, FP8: tl.constexpr, DTYPE: tl.constexpr):
    """A [N, C] tile of cache rows (`rows`: [N] pointers to each row's start; `ok` [N], `cols_ok` [C] its masks).
    FP8: the rows' first WIDTH bytes are e4m3 values and their bfloat16 scale follows; dequantised to DTYPE."""
    mask = ok[:, None] & cols_ok[None, :]
    if FP8:  # if / else, not an early return: compiled, a constexpr branch that returns does not end the function
        raw = tl.load(rows[:, None] + cols[None, :], mask=mask, other=0)
        scale = tl.load((rows + WIDTH).to(tl.pointer_type(tl.bfloat16)), mask=ok, other=0.0).to(tl.float32)
        tile = (raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]).to(DTYPE)
    else:
        tile = tl.load(rows[:, None] + cols[None, :], mask=mask, other=0.0)
    return tile


@triton.jit
def _load_tail(rows, cols, ok, cols_ok, WIDTH: tl.constexpr, FP8: tl.constexpr, DTYPE: tl.constexpr):
    """The channels after a row's first WIDTH (MLA's rotary key): in an FP8 row, bfloat16 after the scale."""
    mask = ok[:, None] & cols_ok[None, :]
    if FP8:
        tail = (rows + WIDTH + 2).to(tl.pointer_type(tl.bfloat16))
        tile = tl.load(tail[:, None] + cols[None, :], mask=mask, other=0.0).to(DTYPE)
    else:
        tile = tl.load(rows[:, None] + WIDTH + cols[None, :], mask=mask, other=0.0)
    return tile


@triton.jit
def _fp8_latent_scores(rows, cols, ok, q, WIDTH: tl.constexpr, PRECISION: tl.constexpr):
    """MLA's FP8 latent rows as the products' operand and the scores of `q` against them: the e4m3 values converted
    as they are (exact in the queries' 16-bit type, no float32 step), each row's scale applied to its score column
    (and by the caller to its probabilities) instead of to every loaded value. Rows are loaded unmasked: a key past
    the slice reads a row of cache block 0 (its table entry loads as 0), zeros or a written row's finite values
    (e4m3's NaN is never written), and its scale loads as 0. Returns (tile, scales, scores)."""
    raw = tl.load(rows[:, None] + cols[None, :], mask=(cols < WIDTH)[None, :], other=0)
    tile = raw.to(tl.float8e4nv, bitcast=True).to(q.dtype)
    scale = tl.load((rows + WIDTH).to(tl.pointer_type(tl.bfloat16)), mask=ok, other=0.0).to(tl.float32)
    return tile, scale, mma(q, tl.trans(tile), PRECISION) * scale[None, :]


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
    PRECISION: tl.constexpr, FP8: tl.constexpr,
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
        if FP8 and V_FROM_K:  # MLA's latent: its scale after the products
            k1, k_scale, s = _fp8_latent_scores(k_rows, d1, ok, q1, D1, PRECISION)
        else:
            k1 = _load_rows(k_rows, d1, ok, d1 < D1, D1, FP8, q_ptr.dtype.element_ty)
            s = mma(q1, tl.trans(k1), PRECISION)
        if D2 > 0:
            k2 = _load_tail(k_rows, d2, ok | (FP8 and V_FROM_K), d2 < D2, D1, FP8, q_ptr.dtype.element_ty)
            s += mma(q2, tl.trans(k2), PRECISION)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP8 and V_FROM_K:
            v = k1
            p = p * k_scale[None, :]
        elif V_FROM_K:
            v = k1
        else:
            v_rows = v_ptr + blk * stride_vb + slot_in_block * stride_vs + kv_head * stride_vh
            v = _load_rows(v_rows, dv, ok, dv < DV, DV, FP8, q_ptr.dtype.element_ty)
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
    """Merge one (sequence, head)'s slices for BLOCK_DV of its channels (`_merge_slices`). A head's sink logit (HAS_SINKS) joins the denominator as one more slice with no output."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    _, splits = _split_plan(seq_len - tl.maximum(seq_len - window, 0), split_tokens, MAX_SPLITS)
    base = (seq * num_heads + head).to(tl.int64) * num_splits
    dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    acc, total, top = _merge_slices(part_out_ptr, part_lse_ptr, base, splits, dv, DV, BLOCK_DV, BLOCK_S)
    if HAS_SINKS:  # the partial sums are relative to exp2(top): rescale them to a maximum that counts the sink
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        new_top = tl.maximum(top, sink)
        acc = acc * tl.exp2(top - new_top)
        total = total * tl.exp2(top - new_top) + tl.exp2(sink - new_top)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + dv, (acc / total).to(out_ptr.dtype.element_ty), mask=dv < DV)


@triton.jit
def _latent_plan(seq_len, min_split, max_splits):
    """(keys per slice, slices) of a sequence, as `latent_split_plan`."""
    per_split = min_split * tl.cdiv(tl.cdiv(seq_len, max_splits), min_split)
    return per_split, tl.cdiv(seq_len, per_split)


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One tile's step of the online softmax over base-2 logits `s` (-inf where masked): (probabilities, the factor
    that rescales what was accumulated, the new running maximum, the new running sum). Rows that have seen no key
    yet keep a maximum of -inf and weigh nothing."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _latent_partial_kernel(
    q_ptr, kv_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, rows_start_ptr, tree_ptr, part_out_ptr, part_lse_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_kb, stride_bt,
    num_heads, num_splits, min_split, max_splits, short_query,
    D1: tl.constexpr, D2: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, STRIDE_KS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_TREE: tl.constexpr,
    PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    """MLA over one slice of one sequence's context for BLOCK_M of its (query token, head) rows, token-major (row r
    is token r // HEADS, head r % HEADS): every head of a token, or of several tokens, shares each latent tile, which
    is loaded once for the QK product ([latent | rope] channels) and reused as the values. Sequences with more than
    `short_query` query tokens are the prefill kernel's. CAUSAL: the step's own tokens are seen in causal order, or
    by the draft tree (HAS_TREE: `tree_ptr` holds each row's tree as int32 bits, `tree_bits`, so the loop shifts a
    register instead of loading a byte per row and key); rows that see no key of the slice write a log-sum-exp of
    -inf and weigh nothing.
    One program holds every value channel ([64, 512] float32 at Kimi's latent: two warpgroups, each with half of
    them, as FlashMLA splits them), so a tile is loaded once for the QK product and the values of every head. That
    fits in 255 registers a thread on sm_90 and sm_100 at 8 warps, 32-key tiles and two stages only because the main
    loop computes its tile addresses where it uses them (`disable_licm`): hoisted out of the loop, they spill.
    Slices start at multiples of BLOCK_N (`min_split` is one), and the cache's block size and row stride are
    constants: where BLOCK_SIZE divides BLOCK_N, a thread's rows of a tile are a few cache blocks' bases plus
    offsets known when compiling, not a division and a 64-bit product per row."""
    seq = tl.program_id(0)
    m_block = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_len > short_query or m_block * BLOCK_M >= q_len * HEADS:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    per_split, splits = _latent_plan(seq_len, min_split, max_splits)
    if split >= splits:
        return  # past this sequence's last slice: the merge reads only its own slices
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    r = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    t = r // HEADS
    h = r % HEADS
    row_ok = (t < q_len) & (h < num_heads)
    tok = (q_start + t).to(tl.int64)

    d1 = tl.arange(0, BLOCK_D1)
    q_rows = q_ptr + tok[:, None] * stride_qt + h[:, None] * stride_qh
    q1 = tl.load(q_rows + d1[None, :], mask=row_ok[:, None] & (d1 < D1)[None, :], other=0.0)
    if D2 > 0:
        d2 = tl.arange(0, BLOCK_D2)
        q2 = tl.load(q_rows + D1 + d2[None, :], mask=row_ok[:, None] & (d2 < D2)[None, :], other=0.0)
    q_pos = seq_len - q_len + t
    if HAS_TREE:
        # the row's tree mask over the step's tokens, causal too (tokens 0..t): a key then needs no position test
        seen_bits = tl.load(tree_ptr + tok, mask=row_ok, other=0) & ((2 << t) - 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D1], tl.float32)
    table = bt_ptr + seq.to(tl.int64) * stride_bt
    offs = tl.arange(0, BLOCK_N)
    # disable_licm: the tile's addresses are computed in the loop where they are used, not hoisted out of it and held
    # in registers, which beside the [64, 512] accumulator would spill
    for n0 in tl.range(start, end, BLOCK_N, disable_licm=True):
        n0 = tl.multiple_of(n0, BLOCK_N)
        pos = n0 + offs
        ok = pos < end
        if BLOCK_N % BLOCK_SIZE == 0:
            blk = tl.load(table + n0 // BLOCK_SIZE + offs // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
            slot = offs % BLOCK_SIZE
        else:
            blk = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
            slot = pos % BLOCK_SIZE
        k_rows = kv_ptr + blk * stride_kb + slot * STRIDE_KS
        if FP8:
            k1, k_scale, s = _fp8_latent_scores(k_rows, d1, ok, q1, D1, PRECISION)
        else:
            k1 = _load_rows(k_rows, d1, ok, d1 < D1, D1, FP8, q_ptr.dtype.element_ty)
            s = mma(q1, tl.trans(k1), PRECISION)
        if D2 > 0:
            k2 = _load_tail(k_rows, d2, ok | FP8, d2 < D2, D1, FP8, q_ptr.dtype.element_ty)  # FP8: rows unmasked too
            s += mma(q2, tl.trans(k2), PRECISION)
        if HAS_TREE:
            j = pos - (seq_len - q_len)  # index among the step's own tokens; negative for the cached context
            in_tree = ((seen_bits[:, None] >> tl.maximum(j, 0)[None, :]) & 1) != 0
            allowed = ok[None, :] & (in_tree | (j < 0)[None, :])
        elif CAUSAL:
            allowed = ok[None, :] & (pos[None, :] <= q_pos[:, None])
        else:
            allowed = ok[None, :]
        p, alpha, m_new, l_i = _online_softmax(tl.where(allowed, s * qk_scale, float("-inf")), m_i, l_i)
        if FP8:
            p_v = p * k_scale[None, :]  # each key's weight on the values: its probability times its row's scale
        else:
            p_v = p
        acc = acc * alpha[:, None] + mma(p_v.to(k1.dtype), k1, PRECISION)
        m_i = m_new

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    part_row = ((tl.load(rows_start_ptr + seq) + t).to(tl.int64) * num_heads + h) * num_splits + split
    tl.store(part_lse_ptr + part_row, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf")), mask=row_ok)
    tl.store(part_out_ptr + part_row[:, None] * D1 + d1[None, :], out, mask=row_ok[:, None] & (d1 < D1)[None, :])


@triton.jit
def _merge_slices(part_out_ptr, part_lse_ptr, base, splits, dv, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    """(weighted sum of the slices' outputs, sum of their weights, the largest log-sum-exp) over slices
    base .. base + splits of a partial buffer: the largest log-sum-exp first, then BLOCK_S slices at a time in slice
    order, so the sum's order depends on the sequence alone."""
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
    return acc, total, top


@triton.jit
def _latent_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, qsl_ptr, seq_lens_ptr, rows_start_ptr, stride_ot, stride_oh,
    num_heads, num_splits, min_split, max_splits, short_query,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Merge the slices of one (query token, head) row of a short sequence for BLOCK_DV of its channels."""
    seq = tl.program_id(0)
    row = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    t = row // num_heads
    head = row % num_heads
    if q_len > short_query or t >= q_len:
        return
    _, splits = _latent_plan(tl.load(seq_lens_ptr + seq), min_split, max_splits)
    base = ((tl.load(rows_start_ptr + seq) + t).to(tl.int64) * num_heads + head) * num_splits
    dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    acc, total, _ = _merge_slices(part_out_ptr, part_lse_ptr, base, splits, dv, DV, BLOCK_DV, BLOCK_S)
    tl.store(out_ptr + (q_start + t).to(tl.int64) * stride_ot + head * stride_oh + dv,
             (acc / total).to(out_ptr.dtype.element_ty), mask=dv < DV)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, tree_ptr, positions_ptr, sinks_ptr,
    qk_scale, window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt, stride_tree,
    group, block_size, min_query,
    D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_TREE: tl.constexpr, V_FROM_K: tl.constexpr,
    PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr, FP8: tl.constexpr,
):
    """A sliding `window` counts back from each query's position (a draft node's: context length + depth, read from
    `positions_ptr`); a head's sink logit (HAS_SINKS) joins each row's softmax denominator at the end. Sequences of
    at most `min_query` query tokens are left to the latent split kernel."""
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len or q_len <= min_query:
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
        k1 = _load_rows(k_rows, d1, ok, d1 < D1, D1, FP8, q_ptr.dtype.element_ty)
        s = mma(q1, tl.trans(k1), PRECISION)
        if D2 > 0:
            k2 = _load_tail(k_rows, d2, ok, d2 < D2, D1, FP8, q_ptr.dtype.element_ty)
            s += mma(q2, tl.trans(k2), PRECISION)
        allowed = i_ok[:, None] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > win_pos[:, None] - window)
        if HAS_TREE:
            j = pos - context_len  # index among the step's own tokens; negative for the cached context
            in_step = (j >= 0)[None, :]
            tree = tl.load(tree_ptr + tok[:, None] * stride_tree + j[None, :], mask=allowed & in_step, other=0)
            allowed = allowed & ((tree != 0) | ~in_step)
        p, alpha, m_new, l_i = _online_softmax(tl.where(allowed, s * qk_scale, float("-inf")), m_i, l_i)
        if V_FROM_K:
            v = k1
        else:
            v_rows = v_ptr + blk * stride_vb + slot_in_block * stride_vs + kv_head * stride_vh
            v = _load_rows(v_rows, dv, ok, dv < DV, DV, FP8, q_ptr.dtype.element_ty)
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
                   elem_bytes: int, v_from_k: bool, split_tokens: int = _SPLIT_TOKENS,
                   row_bytes: int | None = None) -> dict[str, tuple[float, int]]:
    """(bytes requested as written, programs that do work) of each of a decode step's two kernels, for
    benchmarks/kernel_report.py's roofline table: a program reads its slice's cache rows (and value rows unless
    V_FROM_K) and its queries, and writes a partial output per head; the merge reads them back (the log-sum-exps once
    per pass and block of channels) and writes the output. Programs past a sequence's last slice are not counted.
    `row_bytes`: a token's cache bytes per KV head where they are not the channels in `elem_bytes` (an FP8 cache)."""
    group = num_heads // num_kv_heads
    block_g = _decode_tiles(group, pow2(v_dim, 16), v_from_k)[0]
    head_blocks = num_kv_heads * triton.cdiv(group, block_g)
    channel_blocks = triton.cdiv(v_dim, min(pow2(v_dim, 16), _MERGE_CHANNELS))
    row = row_bytes or (sum(k_dims) + (0 if v_from_k else v_dim)) * elem_bytes
    partial = merge = 0.0
    programs = 0
    for seq_len in seq_lens:
        splits = split_plan(seq_len, split_tokens)[1]
        partial += head_blocks * seq_len * row + splits * num_heads * (sum(k_dims) * elem_bytes + v_dim * 4 + 4)
        merge += num_heads * (splits * (v_dim * 4 + 8 * channel_blocks) + v_dim * elem_bytes)
        programs += head_blocks * splits
    return {"_decode_partial_kernel": (partial, programs),
            "_decode_reduce_kernel": (merge, len(seq_lens) * num_heads * channel_blocks)}


def latent_traffic(seq_lens: list[int], query_lens: list[int], num_heads: int, latent: int, rope: int,
                   elem_bytes: int, max_splits: int = _DEFAULT_SMS, short_query: int = SHORT_QUERY,
                   row_bytes: int | None = None) -> dict[str, tuple[float, int]]:
    """(bytes requested as written, programs that do work) of the latent split kernel and its merge over the step's
    sequences of at most `short_query` query tokens, for benchmarks/kernel_report.py: each program reads its slice's
    latent rows once for all the (token, head) rows of its tile and every value channel, and its queries, and writes a
    partial output per row;
    the merge reads them back (the log-sum-exps once per block of channels) and writes the outputs. `row_bytes`: a
    token's cache bytes where they are not the channels in `elem_bytes` (an FP8 cache; queries stay `elem_bytes`)."""
    query = (latent + rope) * elem_bytes
    row = row_bytes or query
    min_split = latent_min_split(num_heads, latent, row)
    channel_blocks = triton.cdiv(latent, min(pow2(latent, 16), _MERGE_CHANNELS))
    partial = merge = 0.0
    programs = rows = 0
    for seq_len, q_len in zip(seq_lens, query_lens):
        if q_len > short_query:
            continue
        splits = latent_split_plan(seq_len, min_split, max_splits)[1]
        tiles = triton.cdiv(q_len * pow2(num_heads), _LATENT_BLOCK_M)
        partial += tiles * seq_len * row + splits * q_len * num_heads * (query + latent * 4 + 4)
        merge += q_len * num_heads * (splits * (latent * 4 + 4 * channel_blocks) + latent * elem_bytes)
        programs += tiles * splits
        rows += q_len * num_heads
    return {"_latent_partial_kernel": (partial, programs), "_latent_reduce_kernel": (merge, rows * channel_blocks)}


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
    q = _as_operand(q, _operand_dtype(q, k_cache))
    dims = _dims(d1, d2, v_dim, q.dtype, fp8=is_fp8_cache(k_cache))
    strides = (*q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3])
    qk_scale = scale * _LOG2E
    num_seqs = batch.num_seqs
    v_from_k = v_cache is k_cache and v_dim == d1
    window = _NO_WINDOW if window is None else window
    sink_arg = sinks if sinks is not None else meta.seq_lens  # any pointer when there are no sinks
    if meta.max_query_len == 1:
        split_tokens = meta.split_tokens or _SPLIT_TOKENS
        splits = launch_splits(meta.max_seq_len, split_tokens)
        block_g, block_n, warps = _decode_tiles(group, dims["BLOCK_DV"], v_from_k)
        part_out = torch.empty(num_seqs, num_heads, splits, v_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
        _decode_partial_kernel[(num_seqs, num_kv_heads * triton.cdiv(group, block_g), splits)](
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, part_out, part_lse,
            qk_scale, window, *strides, meta.block_tables.stride(0), num_heads, group, meta.block_size, splits, split_tokens,
            BLOCK_G=block_g, BLOCK_N=block_n, V_FROM_K=v_from_k, MAX_SPLITS=_MAX_SPLITS, num_warps=warps, **dims,
        )
        merge_dv = min(dims["BLOCK_DV"], _MERGE_CHANNELS)
        _decode_reduce_kernel[(num_seqs, num_heads, triton.cdiv(v_dim, merge_dv))](
            part_out, part_lse, out, meta.seq_lens, sink_arg, out.stride(0), out.stride(1), num_heads, splits,
            split_tokens, window,
            DV=v_dim, BLOCK_DV=merge_dv, BLOCK_S=_MERGE_SPLITS, MAX_SPLITS=_MAX_SPLITS, HAS_SINKS=sinks is not None,
            num_warps=num_warps_for(_MERGE_SPLITS * merge_dv),
        )
        return out
    _prefill(q, k_cache, v_cache, dims, batch, meta, qk_scale, sinks, window, out, min_query=0)
    return out


def _operand_dtype(q: torch.Tensor, cache: torch.Tensor) -> torch.dtype:
    """The products' operand dtype: the cache's, or the query's for an FP8 cache (its tiles dequantised to it)."""
    return q.dtype if is_fp8_cache(cache) else cache.dtype


def _value_width(cache: torch.Tensor) -> int:
    """Channels of a GQA cache row (an FP8 row's bytes less its scale)."""
    return cache.shape[-1] - SCALE_BYTES if is_fp8_cache(cache) else cache.shape[-1]


def _rope_width(kv_cache: torch.Tensor, latent_dim: int) -> int:
    """Rotary channels of an MLA cache row (in an FP8 row, bfloat16 after the latent's bytes and scale)."""
    if is_fp8_cache(kv_cache):
        return (kv_cache.shape[-1] - latent_dim - SCALE_BYTES) // 2
    return kv_cache.shape[-1] - latent_dim


def _as_operand(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q with unit stride in its channels, in the cache's dtype (the tensor-core operand type)."""
    return (q if q.stride(-1) == 1 else q.contiguous()).to(dtype)


def _dims(d1: int, d2: int, v_dim: int, dtype: torch.dtype, fp8: bool = False) -> dict:
    """The channel constexprs of the attention kernels: key parts d1 and d2, value width, their tiles, the mma mode,
    whether the cache holds FP8 rows."""
    return dict(D1=d1, D2=d2, DV=v_dim, BLOCK_D1=pow2(d1, 16), BLOCK_D2=pow2(d2, 16) if d2 else 0,
                BLOCK_DV=pow2(v_dim, 16), PRECISION=dot_mode(dtype), FP8=fp8)


def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, dims: dict, batch: ForwardBatch,
             meta: TritonAttentionMetadata, qk_scale: float, sinks: torch.Tensor | None, window: int,
             out: torch.Tensor, min_query: int) -> None:
    """The varlen kernel over the step's sequences with more than `min_query` query tokens, written into `out`."""
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[2]
    wide = dims["BLOCK_DV"] >= 256
    tree = meta.tree_mask
    block_m = 16 if wide else 64
    strides = (*q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3])
    _prefill_kernel[(triton.cdiv(meta.max_query_len, block_m), batch.num_seqs, num_heads)](
        q, k_cache, v_cache, out, meta.block_tables, meta.query_start_loc, meta.seq_lens, tree if tree is not None else meta.seq_lens,
        batch.positions if tree is not None else meta.seq_lens, sinks if sinks is not None else meta.seq_lens,
        qk_scale, window, *strides, out.stride(0), out.stride(1), meta.block_tables.stride(0), tree.stride(0) if tree is not None else 0,
        group, meta.block_size, min_query,
        BLOCK_M=block_m, BLOCK_N=32 if wide else 64, HAS_TREE=tree is not None,
        V_FROM_K=v_cache is k_cache and dims["DV"] == dims["D1"], HAS_SINKS=sinks is not None,
        num_warps=8 if wide else 4, num_stages=2 if wide else 3, **dims,  # wide, 3 stages: the tree mask spills
    )


def _latent_short(q: torch.Tensor, kv_cache: torch.Tensor, latent_dim: int, batch: ForwardBatch,
                  meta: TritonAttentionMetadata, qk_scale: float, out: torch.Tensor) -> None:
    """MLA for the step's sequences of at most `meta.short_query` query tokens (decodes, drafts, small chunks): the
    latent split kernel over (sequence, block of query-token x head rows, slice of the context), then the merge. When
    every sequence has one slice and the step has no long chunk, merging is a cast of the partial outputs (a single
    slice's weight is exactly 1): a copy into `out` does it, with the merge's values."""
    num_heads = q.shape[1]
    rope = _rope_width(kv_cache, latent_dim)
    min_split = meta.split_tokens or latent_min_split(num_heads, latent_dim, kv_cache.shape[-1] * kv_cache.element_size())
    fp8 = is_fp8_cache(kv_cache)
    block_n = min(_LATENT_BLOCK_N_FP8 if fp8 else _LATENT_BLOCK_N, pow2(min_split, 16))
    min_split = triton.cdiv(min_split, block_n) * block_n  # slices of whole tiles
    splits = latent_launch_splits(meta.short_max_seq_len, min_split, meta.max_splits)
    heads = pow2(num_heads)
    part_out = torch.empty(meta.short_rows, num_heads, splits, latent_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(meta.short_rows, num_heads, splits, dtype=torch.float32, device=q.device)
    causal = meta.short_max_query_len > 1
    tree = meta.tree_bits if causal else None
    dims = _dims(latent_dim, rope, latent_dim, q.dtype, fp8=is_fp8_cache(kv_cache))
    _latent_partial_kernel[(batch.num_seqs, triton.cdiv(meta.short_max_query_len * heads, _LATENT_BLOCK_M), splits)](
        q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.short_rows_start,
        tree if tree is not None else meta.seq_lens, part_out, part_lse, qk_scale,
        q.stride(0), q.stride(1), kv_cache.stride(0), meta.block_tables.stride(0),
        num_heads, splits, min_split, meta.max_splits, meta.short_query,
        D1=dims["D1"], D2=dims["D2"], BLOCK_D1=dims["BLOCK_D1"], BLOCK_D2=dims["BLOCK_D2"], STRIDE_KS=kv_cache.stride(1),
        BLOCK_SIZE=meta.block_size, HEADS=heads, BLOCK_M=_LATENT_BLOCK_M, BLOCK_N=block_n, CAUSAL=causal, HAS_TREE=tree is not None,
        PRECISION=dims["PRECISION"], FP8=dims["FP8"], num_warps=_LATENT_WARPS, num_stages=_LATENT_STAGES_FP8 if fp8 else _LATENT_STAGES,
    )
    if splits == 1 and not meta.has_long:  # the short rows are all of the step's tokens, in order
        out.copy_(part_out.view(out.shape))
        return
    merge_dv = min(dims["BLOCK_DV"], _MERGE_CHANNELS)
    _latent_reduce_kernel[(batch.num_seqs, meta.short_max_query_len * num_heads, triton.cdiv(latent_dim, merge_dv))](
        part_out, part_lse, out, meta.query_start_loc, meta.seq_lens, meta.short_rows_start, out.stride(0), out.stride(1),
        num_heads, splits, min_split, meta.max_splits, meta.short_query,
        DV=latent_dim, BLOCK_DV=merge_dv, BLOCK_S=_MERGE_SPLITS, num_warps=num_warps_for(_MERGE_SPLITS * merge_dv),
    )


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, meta: TritonAttentionMetadata,
    scale: float, sinks: torch.Tensor | None = None, window: int | None = None,
) -> torch.Tensor:
    """GQA over the paged cache. q [T, H, D]; caches [num_blocks, block_size, KVH, D]; returns [T, H, Dv].
    Decode-only steps take the split-K path (T == B, token b belongs to sequence b); others the varlen kernel.
    `sinks` [H]: per-head logits in each softmax's denominator; `window`: a query at position p sees only the keys at
    positions above p - window."""
    return _attend(q, k_cache, v_cache, (q.shape[-1], 0), _value_width(v_cache), batch, meta, scale, sinks, window)


def paged_latent_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, latent_dim: int, batch: ForwardBatch, meta: TritonAttentionMetadata, scale: float
) -> torch.Tensor:
    """MLA in absorbed form: one shared latent head. q [T, H, latent + rope]; cache [num_blocks, block_size,
    latent + rope] whose first `latent_dim` channels are also the values; returns [T, H, latent]. Sequences of at
    most `meta.short_query` query tokens (decodes, drafts) go through the latent split kernel, longer chunks through
    the prefill kernel, in the same step. A step of decodes alone with few heads per rank goes through the decode
    kernel instead (`decodes_take_decode_kernel`)."""
    tokens, num_heads, _ = q.shape
    if meta.max_query_len <= 1 and decodes_take_decode_kernel(num_heads, meta.decode_kernel_heads):
        cache = kv_cache.unsqueeze(2)
        return _attend(q, cache, cache, (latent_dim, _rope_width(kv_cache, latent_dim)), latent_dim, batch, meta, scale)
    out = torch.empty(tokens, num_heads, latent_dim, dtype=q.dtype, device=q.device)
    if not tokens:
        return out
    q = _as_operand(q, _operand_dtype(q, kv_cache))
    qk_scale = scale * _LOG2E
    if meta.short_rows:
        _latent_short(q, kv_cache, latent_dim, batch, meta, qk_scale, out)
    if meta.has_long:
        cache = kv_cache.unsqueeze(2)
        dims = _dims(latent_dim, _rope_width(kv_cache, latent_dim), latent_dim, q.dtype, fp8=is_fp8_cache(kv_cache))
        _prefill(q, cache, cache, dims, batch, meta, qk_scale, None, _NO_WINDOW, out, min_query=meta.short_query)
    return out
