"""Paged attention in plain torch: the CPU path and the reference the Triton kernels are tested against.

Each step's ragged batch is gathered once into a padded [B, Qmax] x [B, L] problem and handed to
`scaled_dot_product_attention` with a boolean mask. The mask and gather indices depend only on the batch, so they are
built once per step (`prepare_attention`) and reused by every layer. Grouped heads are folded into the query
axis, so K/V are never repeated per head, and MLA's single latent head is the same problem with one KV head.

A step that mixes a long prefill chunk with decoding sequences would pad every decode to the chunk's length (B x
Qmax x L work instead of Qmax x L): such a step is split into parts, each long chunk alone, the decoding sequences
(one query each) together as a decode step, and the other short queries (draft trees being verified, short chunks)
together (`MixedAttentionMetadata`); the parts' outputs are scattered back into the step's token order. A
verification step where a few of 32 sequences draft 8 tokens thus costs about what 32 decodes do, not what 32
sequences of 9 queries do. Decoding sequences of very different lengths are split the same way, by power of two of
their length, when padding them all to the longest would more than double the keys gathered (one long context among
short ones would make every decode gather its length). Measurements: docs/measurements.md.

`decode_attention` is the same computation for decode steps written for Inductor to fuse; the metadata's
`fused_decode` makes `paged_attention` and `paged_latent_attention` call it instead of gathering, which
engine/compiled_decode.py sets for the steps it compiles that way.

An FP8 cache (`kv_cache_dtype="fp8"`: uint8 caches of e4m3 rows with a scale each, kernels/fp8_cache.py) is quantised
by `write_kv_cache` and dequantised where rows are read: after the gather, or inside `decode_attention`'s loads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.kernels.fp8_cache import dequantize_rows, is_fp8_cache, quantize_rows


# Below this many queries per KV head, two small matmuls beat SDPA's fused CPU kernel, whose per-call set-up
# (thread-parallel tiling over the query axis) dominates when decoding.
SMALL_QUERY = 64


@dataclass
class TorchAttentionMetadata:
    kv_index: torch.Tensor  # [B * L] cache slot of each context position (0 where beyond the sequence)
    mask: torch.Tensor  # [B, Qmax, L] bool, True where a query may attend
    query_rows: torch.Tensor  # [T] position of each token in the padded [B * Qmax] query layout
    padded: bool  # False when every sequence has exactly Qmax query tokens (no scatter needed)
    needs_mask: bool  # False for a single sequence decoding one token over its own length: it sees every key
    biases: dict[tuple[int, torch.dtype, int | None], torch.Tensor] = field(default_factory=dict)  # additive masks per
    # head group (and sliding window)
    fused_decode: bool = False  # a decode step inside a compiled graph: `decode_attention` instead of the gather path
    query_pos: torch.Tensor | None = None  # [B, Qmax] each query's position (0 for padding rows), for sliding windows

    def _window(self, window: int | None) -> int | None:
        """The window, or None where it cuts nothing off (every key of the step lies within it)."""
        return window if window is not None and window < self.mask.shape[-1] else None

    def windowed_mask(self, window: int | None) -> torch.Tensor:
        """The mask restricted to the last `window` positions up to each query (sliding-window layers)."""
        if window is None:
            return self.mask
        keys = torch.arange(self.mask.shape[-1], device=self.mask.device)
        return self.mask & (keys.view(1, 1, -1) > (self.query_pos - window).unsqueeze(-1))

    def bias(self, group: int, dtype: torch.dtype, window: int | None = None) -> torch.Tensor | None:
        """The mask (within `window` of each query when given) as an additive bias [B, 1, Qmax * group, L], built
        once per step and shared by all layers."""
        window = self._window(window)
        if not self.needs_mask and window is None:
            return None
        key = (group, dtype, window)
        if key not in self.biases:
            mask = self.windowed_mask(window)
            num_seqs, qmax, length = mask.shape
            expanded = mask.unsqueeze(2).expand(-1, -1, group, -1).reshape(num_seqs, 1, qmax * group, length)
            bias = torch.zeros(expanded.shape, dtype=dtype, device=mask.device)
            self.biases[key] = bias.masked_fill_(~expanded, float("-inf"))
        return self.biases[key]

    def decode_valid(self, window: int | None = None) -> torch.Tensor | None:
        """[B, L] whether each context position lies within its sequence (and `window`), for one query per
        sequence; None when every position does."""
        window = self._window(window)
        if not self.needs_mask and window is None:
            return None
        return self.windowed_mask(window).view(self.mask.shape[0], -1)


def write_kv_cache(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each token's K/V (or MLA latent) at its slot. cache: [num_blocks, block_size, ...]; values: [T, ...].
    An FP8 cache's rows are wider than the values by their scale (and by a bfloat16 tail's second bytes: MLA's
    rotary key), which says how many trailing channels stay bfloat16."""
    if values.shape[0]:
        if is_fp8_cache(cache):
            values = quantize_rows(values, tail=cache.shape[-1] - values.shape[-1] - 2)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, values.to(cache.dtype))


def read_rows(cache_rows: torch.Tensor, index: torch.Tensor, quantized: int, dtype: torch.dtype) -> torch.Tensor:
    """cache_rows[index] (cache_rows: blocks flattened into slots), dequantised to `dtype` from an FP8 cache, whose
    rows hold `quantized` e4m3 channels before their scale."""
    rows = cache_rows.index_select(0, index.reshape(-1)).view(*index.shape, *cache_rows.shape[1:])
    return dequantize_rows(rows, quantized, dtype) if is_fp8_cache(cache_rows) else rows


def _context_slots(batch: ForwardBatch, block_size: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] cache slot of each context position, read through the block tables (0 beyond its sequence), and
    [B, L] whether the position lies within the sequence."""
    blocks = batch.block_tables[:, : (batch.max_seq_len + block_size - 1) // block_size].long()
    slots = (blocks.repeat_interleave(block_size, dim=1)[:, : positions.shape[0]] * block_size) + (positions % block_size)
    valid = positions.view(1, -1) < batch.seq_lens.view(-1, 1)
    return slots * valid, valid


LONG_QUERY = 32  # a sequence with more query tokens than this is attended alone in a mixed step
UNEVEN_PADDING = 2.0  # decodes padded to the longest context gathering more than this many times their keys are split


@dataclass
class MixedAttentionMetadata:
    """A step split into parts: each part's token rows in the step and its own metadata over its sequences."""

    parts: list[tuple[torch.Tensor, ForwardBatch, TorchAttentionMetadata]]
    fused_decode: bool = False


def prepare_attention(batch: ForwardBatch, block_size: int) -> TorchAttentionMetadata | MixedAttentionMetadata:
    """Gather indices and the causal (or draft-tree) mask of one step, shared by all layers."""
    if batch.max_query_len == 1 and batch.tree_mask is None:
        groups = _length_groups(batch)
        return _prepare_decode(batch, block_size) if len(groups) == 1 else _split(batch, groups, block_size)
    lens = batch.query_lens_cpu
    decoding = [b for b, n in enumerate(lens) if n == 1]
    drafted = [b for b, n in enumerate(lens) if 1 < n <= LONG_QUERY]
    groups = [[b] for b, n in enumerate(lens) if n > LONG_QUERY] + [g for g in (decoding, drafted) if g]
    if len(groups) == 1 or min(lens) == max(lens):
        return _prepare_ragged(batch, block_size)
    return _split(batch, groups, block_size)


def _length_groups(batch: ForwardBatch) -> list[list[int]]:
    """A decode step's sequences grouped by power of two of their length where padding them all to the longest would
    gather more than UNEVEN_PADDING times their keys; otherwise one group. A CUDA-graph batch keeps its shapes."""
    lens = batch.seq_lens_cpu
    if batch.static_shapes or len(lens) * max(lens, default=0) <= UNEVEN_PADDING * sum(lens):
        return [list(range(len(lens)))]
    groups: dict[int, list[int]] = {}
    for b, n in enumerate(lens):
        groups.setdefault((n - 1).bit_length(), []).append(b)
    return list(groups.values())


def _split(batch: ForwardBatch, groups: list[list[int]], block_size: int) -> MixedAttentionMetadata:
    starts = batch.query_start_loc.tolist()
    parts = []
    for seqs in groups:
        part = _sub_batch(batch, seqs)
        rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in seqs]).to(batch.query_start_loc.device)
        parts.append((rows, part, prepare_attention(part, block_size)))
    return MixedAttentionMetadata(parts)


def _sub_batch(batch: ForwardBatch, seqs: list[int]) -> ForwardBatch:
    """The attention-relevant fields of `batch` for sequences `seqs` (their tokens, tables and lengths)."""
    index = torch.tensor(seqs, device=batch.seq_lens.device)
    lens = [batch.query_lens_cpu[b] for b in seqs]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    tree = None
    if batch.tree_mask is not None:
        first = batch.query_start_loc.tolist()
        rows = torch.cat([torch.arange(first[b], first[b + 1]) for b in seqs]).to(batch.tree_mask.device)
        tree = batch.tree_mask[rows, : max(lens)] if max(lens) > 1 else None  # one query: nothing to order
    seq_lens = [batch.seq_lens_cpu[b] for b in seqs]
    return ForwardBatch(  # positions: a draft tree's query positions set its sliding windows (`_query_positions`)
        input_ids=batch.input_ids[:0], positions=batch.positions[:0] if tree is None else batch.positions[rows],
        slot_mapping=batch.slot_mapping[:0],
        query_start_loc=torch.tensor(starts, dtype=batch.query_start_loc.dtype, device=batch.query_start_loc.device),
        seq_lens=batch.seq_lens[index], block_tables=batch.block_tables[index], logits_indices=batch.logits_indices[:0],
        max_query_len=max(lens), max_seq_len=max(seq_lens), query_lens_cpu=lens, seq_lens_cpu=seq_lens,
        tree_mask=tree, static_shapes=batch.static_shapes)


def _prepare_ragged(batch: ForwardBatch, block_size: int) -> TorchAttentionMetadata:
    """Any step: sequences with different numbers of query tokens, causal or draft-tree order among them."""
    device = batch.block_tables.device
    num_seqs, qmax, max_len = batch.num_seqs, batch.max_query_len, batch.max_seq_len
    positions = torch.arange(max_len, device=device)
    kv_index, _ = _context_slots(batch, block_size, positions)
    query_lens = batch.query_lens().view(-1, 1)
    context_lens = batch.seq_lens.view(-1, 1) - query_lens
    qpos = torch.arange(qmax, device=device).view(1, -1)
    # query i of sequence b sits at context_lens[b] + i and sees keys up to itself
    mask = positions.view(1, 1, -1) <= (context_lens + qpos).unsqueeze(-1)
    mask &= qpos.unsqueeze(-1) < query_lens.unsqueeze(-1)
    query_rows = torch.cat([torch.arange(n, device=device) + b * qmax for b, n in enumerate(batch.query_lens_cpu)]) if num_seqs else torch.zeros(0, dtype=torch.long, device=device)
    if batch.tree_mask is not None:
        mask = _apply_tree_mask(mask, batch, context_lens, query_rows)
    # padding query rows see key 0 so softmax stays finite; their outputs are dropped
    mask[:, :, 0] |= ~(qpos < query_lens)
    padded = any(n != qmax for n in batch.query_lens_cpu)
    # a single decoding sequence sees every key, unless the key axis is the static bound rather than its length
    needs_mask = batch.static_shapes or not (num_seqs == 1 and qmax == 1)
    return TorchAttentionMetadata(kv_index=kv_index.reshape(-1), mask=mask, query_rows=query_rows, padded=padded,
                                  needs_mask=needs_mask, query_pos=_query_positions(batch, context_lens, qpos, query_rows))


def _query_positions(batch: ForwardBatch, context_lens: torch.Tensor, qpos: torch.Tensor,
                     query_rows: torch.Tensor) -> torch.Tensor:
    """[B, Qmax] position of each query (0 for padding rows): its index in the sequence, or under a draft tree its
    position in `batch.positions` (context length + depth), which is what a sliding window counts back from."""
    if batch.tree_mask is not None:
        out = torch.zeros(batch.num_seqs * batch.max_query_len, dtype=torch.long, device=context_lens.device)
        out[query_rows] = batch.positions.long()
        return out.view(batch.num_seqs, batch.max_query_len)
    return torch.where(qpos < batch.query_lens().view(-1, 1), context_lens + qpos, 0)


def _prepare_decode(batch: ForwardBatch, block_size: int) -> TorchAttentionMetadata:
    """One query per sequence, its last token: it sees exactly the keys below its sequence's length, so the mask
    needs no causal part and no padded query rows. Half the ops of `_prepare_ragged`, paid on the host every step."""
    num_seqs = batch.num_seqs
    positions = torch.arange(batch.max_seq_len, device=batch.block_tables.device)
    kv_index, valid = _context_slots(batch, block_size, positions)
    return TorchAttentionMetadata(kv_index=kv_index.reshape(-1), mask=valid.view(num_seqs, 1, -1),
                                  query_rows=torch.arange(num_seqs, device=positions.device), padded=False,
                                  needs_mask=batch.static_shapes or num_seqs != 1,
                                  query_pos=(batch.seq_lens.long() - 1).view(num_seqs, 1))


def _apply_tree_mask(mask: torch.Tensor, batch: ForwardBatch, context_lens: torch.Tensor, query_rows: torch.Tensor) -> torch.Tensor:
    """Within the step's own tokens, allow only draft-tree ancestors (and self) instead of the causal prefix."""
    num_seqs, qmax, max_len = mask.shape
    tree = torch.zeros(num_seqs * qmax, qmax, dtype=torch.bool, device=mask.device)
    tree[query_rows] = batch.tree_mask[:, :qmax]
    tree = tree.view(num_seqs, qmax, qmax)
    key_offset = torch.arange(max_len, device=mask.device).view(1, -1) - context_lens  # [B, L] index into the step's tokens
    in_step = (key_offset >= 0) & (key_offset < qmax)
    gathered = torch.gather(tree, 2, key_offset.clamp(0, qmax - 1).unsqueeze(1).expand(-1, qmax, -1))
    return torch.where(in_step.unsqueeze(1), gathered & mask, mask)


def _to_padded(x: torch.Tensor, meta: TorchAttentionMetadata, num_seqs: int, qmax: int) -> torch.Tensor:
    if not meta.padded:
        return x.view(num_seqs, qmax, *x.shape[1:])
    out = x.new_zeros(num_seqs * qmax, *x.shape[1:])
    out[meta.query_rows] = x
    return out.view(num_seqs, qmax, *x.shape[1:])


def _from_padded(x: torch.Tensor, meta: TorchAttentionMetadata) -> torch.Tensor:
    flat = x.reshape(-1, *x.shape[2:])
    return flat[meta.query_rows] if meta.padded else flat


def _grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: TorchAttentionMetadata, scale: float,
                  sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q [B, Qmax, H, D], k [B, L, KVH, D], v [B, L, KVH, Dv] -> [B, Qmax, H, Dv], heads folded into the query axis.
    `sinks` [H]: a learned logit per head that joins each softmax's denominator only (gpt-oss), so SDPA cannot take
    it and the explicit product runs; `window`: each query sees its last `window` positions only."""
    num_seqs, qmax, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    qg = q.view(num_seqs, qmax, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, qmax * group, head_dim)
    bias = meta.bias(group, q.dtype, window)
    if qmax * group <= SMALL_QUERY or sinks is not None:
        scores = torch.matmul(qg, k.permute(0, 2, 3, 1)) * scale
        if bias is not None:
            scores = scores + bias
        if sinks is None:
            probs = scores.softmax(dim=-1)
        else:  # rows in query-major order: row q * group + g is head kv_head * group + g
            sink = sinks.to(scores.dtype).view(1, num_kv_heads, 1, group, 1).expand(num_seqs, -1, qmax, -1, -1)
            probs = torch.cat([scores, sink.reshape(num_seqs, num_kv_heads, qmax * group, 1)], -1).softmax(-1)[..., :-1]
        out = torch.matmul(probs, v.transpose(1, 2))
    else:
        out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, scale=scale)
    return out.view(num_seqs, num_kv_heads, qmax, group, -1).permute(0, 2, 1, 3, 4).reshape(num_seqs, qmax, num_heads, -1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_index: torch.Tensor,
                     valid: torch.Tensor | None, scale: float, sinks: torch.Tensor | None = None,
                     fp8_widths: tuple[int, int] | None = None) -> torch.Tensor:
    """One query per sequence as loops Inductor fuses: keys and values are loaded through `kv_index` inside the score
    and output reductions, so nothing is gathered into a copy and no key layout is made for a matrix product: the
    gather path spends most of a decode step's attention on those copies. Scores keep all heads of a position side by side ([B, L, H]), so the max, the exponent and
    the sums over positions vectorise across heads; the padding mask is one flag per position, broadcast over heads;
    the output is normalised once, after its sum. Run eagerly it builds [B, L, H, D] products: it is meant to be
    traced into a compiled graph (engine/compiled_decode.py).
    q [B, H, D]; k [slots, KVH, D] and v [slots, KVH, Dv] (the caches with blocks flattened, any strides);
    kv_index [B, L]; valid [B, L] (False beyond each sequence or its window) or None; sinks [H] (logits that join
    only the denominator) or None; fp8_widths: for FP8 caches (uint8 rows), the e4m3 channels of a key row and of a
    value row -> [B, H, Dv]."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, length = k.shape[1], kv_index.shape[1]
    group = num_heads // num_kv_heads
    k_rows, v_rows = k[kv_index], v[kv_index]
    if fp8_widths is not None:
        k_rows, v_rows = (dequantize_rows(k_rows, fp8_widths[0], q.dtype), dequantize_rows(v_rows, fp8_widths[1], q.dtype))
    keys = k_rows.view(num_seqs, length, num_kv_heads, 1, head_dim)
    query = q.view(num_seqs, 1, num_kv_heads, group, head_dim) * scale
    scores = (query * keys).sum(-1).view(num_seqs, length, num_heads)
    if valid is not None:
        scores = scores.masked_fill(~valid.view(num_seqs, length, 1), float("-inf"))
    top = scores.amax(1, keepdim=True)
    if sinks is not None:
        top = torch.maximum(top, sinks.to(scores.dtype).view(1, 1, num_heads))
    weights = (scores - top).exp().view(num_seqs, length, num_kv_heads, group, 1)
    values = v_rows.view(num_seqs, length, num_kv_heads, 1, v_rows.shape[-1])
    total = weights.sum(1)
    if sinks is not None:
        total = total + (sinks.to(scores.dtype).view(1, 1, num_heads) - top).exp().view(num_seqs, num_kv_heads, group, 1)
    return ((weights * values).sum(1) / total).view(num_seqs, num_heads, v_rows.shape[-1])


def _by_parts(q: torch.Tensor, meta: MixedAttentionMetadata, dv: int,
              attend: Callable[[torch.Tensor, ForwardBatch, TorchAttentionMetadata], torch.Tensor]) -> torch.Tensor:
    """Each part's attention on its own rows of q, written back to the step's token order."""
    out = q.new_empty(q.shape[0], q.shape[1], dv)
    for rows, part, part_meta in meta.parts:
        out[rows] = attend(q[rows], part, part_meta)
    return out


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
    meta: TorchAttentionMetadata | MixedAttentionMetadata, scale: float, sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """GQA over the paged cache. q [T, H, D]; caches [num_blocks, block_size, KVH, D]; returns [T, H, Dv].
    `sinks` [H]: per-head logits in each softmax's denominator; `window`: a query at position p sees only the keys at
    positions above p - window (sliding-window layers: the table entries of older blocks may be the null block, which
    the mask keeps out; its slots are gathered, zero, and weigh nothing)."""
    fp8 = is_fp8_cache(k_cache)
    dv = v_cache.shape[-1] - 2 if fp8 else v_cache.shape[-1]
    if isinstance(meta, MixedAttentionMetadata):
        return _by_parts(q, meta, dv,
                         lambda qp, part, m: paged_attention(qp, k_cache, v_cache, part, m, scale, sinks, window))
    num_seqs, qmax = batch.num_seqs, batch.max_query_len
    if meta.fused_decode:
        return decode_attention(q, k_cache.flatten(0, 1), v_cache.flatten(0, 1), meta.kv_index.view(num_seqs, -1),
                                meta.decode_valid(window), scale, sinks, (q.shape[-1], dv) if fp8 else None)
    index = meta.kv_index.view(num_seqs, -1)
    k = read_rows(k_cache.flatten(0, 1), index, q.shape[-1], q.dtype)
    v = read_rows(v_cache.flatten(0, 1), index, dv, q.dtype)
    out = _grouped_sdpa(_to_padded(q, meta, num_seqs, qmax), k, v, meta, scale, sinks, window)
    return _from_padded(out, meta)


def paged_latent_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, latent_dim: int, batch: ForwardBatch,
    meta: TorchAttentionMetadata | MixedAttentionMetadata, scale: float
) -> torch.Tensor:
    """MLA in absorbed form: one shared latent head. q [T, H, latent + rope]; cache [num_blocks, block_size,
    latent + rope] whose first `latent_dim` channels are also the values; returns [T, H, latent]."""
    if isinstance(meta, MixedAttentionMetadata):
        return _by_parts(q, meta, latent_dim,
                         lambda qp, part, m: paged_latent_attention(qp, kv_cache, latent_dim, part, m, scale))
    num_seqs, qmax = batch.num_seqs, batch.max_query_len
    fp8 = is_fp8_cache(kv_cache)
    value_bytes = latent_dim + 2 if fp8 else latent_dim  # an FP8 row's values: the e4m3 latent and its scale
    if meta.fused_decode:
        kv_rows = kv_cache.flatten(0, 1).unsqueeze(1)
        return decode_attention(q, kv_rows, kv_rows[..., :value_bytes], meta.kv_index.view(num_seqs, -1),
                                meta.decode_valid(), scale, fp8_widths=(latent_dim, latent_dim) if fp8 else None)
    kv = read_rows(kv_cache.flatten(0, 1), meta.kv_index.view(num_seqs, -1), latent_dim, q.dtype).unsqueeze(2)
    out = _grouped_sdpa(_to_padded(q, meta, num_seqs, qmax), kv, kv[..., :latent_dim], meta, scale)
    return _from_padded(out, meta)
