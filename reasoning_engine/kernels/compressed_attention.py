"""DeepSeek-V4's attention over a sliding window and compressed rows, in plain torch (the CPU path).

Per query token the keys are (DeepSeek-V4 section 2.3): the latent K=V rows of its last `window` positions (the
sliding-window branch, a sliding KV cache group), then compressed rows, each of which stands for `rate` consecutive
tokens: every row whose tokens all precede or are the query (heavily compressed attention), or the `index_topk` of
those a lightning indexer picks (compressed sparse attention). A learned sink logit per head joins every softmax's
denominator. The step's addressing is built once for all layers (`prepare_compressed`): window slots per query,
where each compressed row lives, and the tokens that close a window this step with the positions they compress.

Caches (shapes as `DeepseekV4Attention.cache_shapes` declares them):
- per token, in the sliding group's blocks: the K=V row, and each compressor's kv and gate projections (what a row
  is made of; the tokens of an unfinished window are therefore always in the cache, for chunked prefill and prefix
  hits alike);
- per compressed row, in the full group's blocks: row w (tokens w * rate .. (w + 1) * rate - 1) sits in the block of
  its last token, at offset (last % block_size) // rate, so a block holds max(1, block_size // rate) rows and a
  prefix-cached block carries the rows its tokens closed.
Caches are read and written by (block, offset) indexing only; each group's block ids are those of its own pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.kernels.sparse_attention import _ranking_keys, token_sequences


@dataclass
class RowAddressing:
    """One compression rate's addressing for a step (`overlap`: rows also read the previous window's tokens)."""

    rate: int
    overlap: int
    closing: torch.Tensor  # [F] rows of the step's tokens that close a window
    source_block: torch.Tensor  # [F, (1 + overlap) * rate] sliding-group block of each token compressed
    source_offset: torch.Tensor  # [F, span]
    source_valid: torch.Tensor  # [F, span] False before position 0
    row_block: torch.Tensor  # [F] full-group block the new row is written to
    row_offset: torch.Tensor  # [F]
    row_position: torch.Tensor  # [F] the window's first position (its row's rotary position)
    visible_block: torch.Tensor  # [T, C] full-group block of each row a query may see
    visible_offset: torch.Tensor  # [T, C]
    visible: torch.Tensor  # [T, C] bool: row w < (position + 1) // rate


@dataclass
class CompressedMetadata:
    window_block: torch.Tensor  # [T, W] sliding-group block of each of the query's window positions
    window_offset: torch.Tensor  # [T, W]
    window_valid: torch.Tensor  # [T, W] False before position 0
    rates: dict[tuple[int, int], RowAddressing] = field(default_factory=dict)


def _blocks(tables: torch.Tensor, seq: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The block of each (sequence, position) pair through the block tables; positions must be >= 0."""
    return tables.long()[seq.view(-1, *([1] * (positions.dim() - 1))).expand_as(positions), positions // block_size]


def prepare_compressed(batch: ForwardBatch, window_group: int, row_group: int | None, window: int,
                       rates: list[tuple[int, int]], block_size: int) -> CompressedMetadata:
    """The step's addressing for every layer: `window` positions per query in cache group `window_group`, and per
    (rate, overlap) the windows closed this step and the rows each query may see in group `row_group`. Draft nodes
    must form chains (their positions are context length + depth, one token per position)."""
    positions = batch.positions.long()
    seq = token_sequences(batch, positions.shape[0])
    win_tables = batch.group(window_group).block_tables
    back = torch.arange(window - 1, -1, -1, device=positions.device)
    win_pos = positions.unsqueeze(1) - back  # oldest first, the query's own position last
    win_valid = win_pos >= 0
    win_pos = win_pos.clamp(min=0)
    meta = CompressedMetadata(_blocks(win_tables, seq, win_pos, block_size), win_pos % block_size, win_valid)
    if row_group is None:
        return meta
    for rate, overlap in rates:
        meta.rates[(rate, overlap)] = row_addressing(batch, window_group, row_group, rate, overlap, block_size,
                                                     positions, seq)
    return meta


def row_addressing(batch: ForwardBatch, source_group: int, row_group: int, rate: int, overlap: int, block_size: int,
                   positions: torch.Tensor | None = None, seq: torch.Tensor | None = None) -> RowAddressing:
    """One rate's rows for the step: the windows its tokens close (their tokens read through group `source_group`'s
    tables, the new rows written through `row_group`'s) and the finished rows each query may see. Draft nodes must
    form chains."""
    positions = batch.positions.long() if positions is None else positions
    seq = token_sequences(batch, positions.shape[0]) if seq is None else seq
    src_tables = batch.group(source_group).block_tables
    row_tables = batch.group(row_group).block_tables
    closing = ((positions + 1) % rate == 0).nonzero().squeeze(1)
    last = positions[closing]
    span = torch.arange(-(overlap + 1) * rate + 1, 1, device=positions.device)
    src = last.unsqueeze(1) + span
    src_valid = src >= 0
    src = src.clamp(min=0)
    count = (positions + 1) // rate  # rows each query may see
    width = max(int(count.max()) if count.numel() else 0, 1)
    rows = torch.arange(width, device=positions.device)
    row_last = ((rows + 1) * rate - 1).unsqueeze(0).expand(positions.shape[0], -1)
    visible = rows.unsqueeze(0) < count.unsqueeze(1)
    row_last = torch.where(visible, row_last, 0)
    return RowAddressing(
        rate=rate, overlap=overlap, closing=closing,
        source_block=_blocks(src_tables, seq[closing], src, block_size), source_offset=src % block_size,
        source_valid=src_valid,
        row_block=_blocks(row_tables, seq[closing], last, block_size), row_offset=(last % block_size) // rate,
        row_position=last + 1 - rate,
        visible_block=_blocks(row_tables, seq, row_last, block_size), visible_offset=(row_last % block_size) // rate,
        visible=visible)


def write_rows(cache: torch.Tensor, block: torch.Tensor, offset: torch.Tensor, values: torch.Tensor) -> None:
    """cache[block[i], offset[i]] = values[i] (cache [blocks, per_block, D], possibly a strided view)."""
    if values.shape[0]:
        cache[block, offset] = values.to(cache.dtype)


def read_rows(cache: torch.Tensor, block: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    return cache[block, offset]


def gated_pool(kv: torch.Tensor, gate: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A compressor's softmax-gated sum over each window's tokens: kv, gate [F, S, D] (gate with its position bias),
    valid [F, S] -> [F, D]. The softmax runs in float32 per channel."""
    gate = gate.float().masked_fill(~valid.unsqueeze(-1), float("-inf"))
    kv = kv.masked_fill(~valid.unsqueeze(-1), 0)
    return (kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1)


def select_rows(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                topk: int) -> torch.Tensor:
    """The lightning indexer's choice: per query the `topk` visible rows by sum_h weights[h] * ReLU(q[h] . key),
    as indices into the visible rows (-1 where fewer are visible). q [T, H, D], weights [T, H] float32 with every
    scale folded in, keys [T, C, D], visible [T, C]. Equal scores go to the earlier row."""
    dots = torch.einsum("thd,tcd->thc", q.float(), keys.float()).relu_()
    scores = torch.einsum("th,thc->tc", weights, dots).masked_fill_(~visible, float("-inf"))
    k = min(topk, scores.shape[1])
    index = _ranking_keys(scores).topk(k, dim=-1).indices
    return index.masked_fill_(scores.gather(1, index) == float("-inf"), -1)


def compressed_attention(q: torch.Tensor, window_cache: torch.Tensor, window_block: torch.Tensor,
                         window_offset: torch.Tensor, window_valid: torch.Tensor, sinks: torch.Tensor, scale: float,
                         row_cache: torch.Tensor | None = None, row_block: torch.Tensor | None = None,
                         row_offset: torch.Tensor | None = None, row_valid: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's attention for every query token: its window rows (window_cache[window_block, window_offset],
    [T, W]) then its compressed rows (row_cache[row_block, row_offset], [T, R]: every finished row for HCA, the
    indexer's picks for CSA), masked by the `*_valid` flags, in one softmax with the sink. q [T, H, D] -> [T, H, D]
    (the value of a row is the row itself). Gathers the keys and calls `sink_attention`."""
    keys, valid = read_rows(window_cache, window_block, window_offset), window_valid
    if row_cache is not None:
        keys = torch.cat([keys, read_rows(row_cache, row_block, row_offset)], dim=1)
        valid = torch.cat([valid, row_valid], dim=1)
    return sink_attention(q, keys, valid, sinks, scale)


def sink_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Multi-query attention whose values are its keys: q [T, H, D], keys [T, K, D] (each query's own), valid [T, K]
    -> [T, H, D]. `sinks` [H] joins each head's softmax denominator only."""
    scores = torch.einsum("thd,tkd->thk", q, keys).float() * scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs.to(keys.dtype), keys)
