"""DeepSeek Sparse Attention (DSA) in plain torch: the CPU path and the reference for `triton_sparse_attention`.

DSA (DeepSeek-AI, 2025, "DeepSeek-V3.2: Pushing the Frontier of Open Large Language Models", the lightning indexer of
DeepSeek-V3.2-Exp) gives each MLA layer a small indexer: per query token t and cached token s the index score is
`I[t, s] = sum_h w[t, h] * ReLU(q_idx[t, h] . k_idx[s])` (a few index heads, one shared index key per token), and the
query attends only to its `index_topk` highest-scoring tokens among those it may see, over the usual latent cache.

- `indexer_topk`: the scores over every visible cached token (read through the block tables from the indexer's own
  paged key cache, the same slots as the latent cache) and each query's top-k as context positions, -1 padded.
- `sparse_latent_attention`: MLA in absorbed form restricted to those positions. Here it is the dense reference
  (`attention.paged_latent_attention`) under the step's mask ANDed with the selection, so a selection holding every
  visible token gives exactly dense MLA (and the cost is dense MLA's; the Triton kernel reads only the selected rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.kernels.attention import (
    MixedAttentionMetadata,
    TorchAttentionMetadata,
    _context_slots,
    paged_latent_attention,
    write_kv_cache,
)

__all__ = ["indexer_scores", "indexer_topk", "select_topk", "sparse_latent_attention", "token_sequences", "visible_keys",
           "write_kv_cache"]

_SCORE_ELEMENTS = 1 << 24  # query rows per scoring chunk are sized so a chunk's [rows, heads, keys] stays this small


def visible_keys(batch: ForwardBatch, rows: torch.Tensor, seq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[R, L] whether query token `rows[r]` (of sequence `seq[r]`) may see context position `positions[l]`: the
    cached context, and among the step's own tokens the causal prefix (or its draft-tree ancestors)."""
    starts = batch.query_start_loc[seq]
    context = batch.seq_lens[seq] - (batch.query_start_loc[seq + 1] - starts)
    offset = positions.view(1, -1) - context.view(-1, 1)  # index of the key among the step's tokens
    visible = offset <= (rows - starts).view(-1, 1)
    if batch.tree_mask is not None:
        qmax = batch.tree_mask.shape[1]
        tree = torch.gather(batch.tree_mask[rows], 1, offset.clamp(0, qmax - 1))
        visible &= (offset < 0) | tree
    return visible


def token_sequences(batch: ForwardBatch, num_tokens: int) -> torch.Tensor:
    """[T] the sequence each flattened query token belongs to."""
    tokens = torch.arange(num_tokens, device=batch.query_start_loc.device)
    return torch.searchsorted(batch.query_start_loc[1:], tokens, right=True)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, batch: ForwardBatch, start: int,
                   stop: int) -> torch.Tensor:
    """Index scores of query tokens start..stop-1 over context positions 0..max_seq_len-1: [R, L] float32, -inf where
    the query may not see the position. q [T, H, D] index queries (rotated); weights [T, H] float32 per-head weights
    with every scale folded in; k_cache [num_blocks, block_size, D] the indexer's paged keys."""
    positions = torch.arange(batch.max_seq_len, device=q.device)
    slots, _ = _context_slots(batch, k_cache.shape[1], positions)
    rows = torch.arange(start, stop, device=q.device)
    seq = token_sequences(batch, q.shape[0])[rows]
    key_rows = k_cache.flatten(0, 1)[slots[seq]].float()  # [R, L, D]
    dots = torch.einsum("rhd,rld->rhl", q[rows].float(), key_rows).relu_()
    scores = torch.einsum("rh,rhl->rl", weights[rows], dots)
    return scores.masked_fill_(~visible_keys(batch, rows, seq, positions), float("-inf"))


def _ranking_keys(scores: torch.Tensor) -> torch.Tensor:
    """[R, L] float32 scores -> int64 keys ordered by score, then by earlier position, all distinct: the float's bits
    made order-preserving as an integer (negative floats have their magnitude bits flipped) in the high half, the
    position reversed in the low half. -0.0 is made +0.0 first (a negative weight times ReLU's 0 gives -0.0)."""
    bits = (scores + 0.0).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    positions = torch.arange(scores.shape[-1], device=scores.device)
    return ordered * (1 << 32) + (0xFFFFFFFF - positions)


def select_topk(scores_fn: Callable[..., torch.Tensor], q: torch.Tensor, weights: torch.Tensor,
                k_cache: torch.Tensor, batch: ForwardBatch, topk: int) -> torch.Tensor:
    """Top-k positions per query from `scores_fn` (an `indexer_scores`), in chunks of queries whose [rows, heads,
    keys] stay small. Returns [T, min(topk, max_seq_len)] int64, -1 where a query sees fewer tokens. Equal scores
    (an exact 0 when every head's ReLU is 0 is the common one) go to the earlier position (`_ranking_keys`), so the
    selection does not depend on the step's longest sequence or on the batch (torch's topk leaves that order open)."""
    num_tokens, length = q.shape[0], batch.max_seq_len
    k = min(topk, length)
    out = torch.empty(num_tokens, k, dtype=torch.long, device=q.device)
    width = max(q.shape[1], q.shape[2])
    chunk = num_tokens  # one chunk inside a compiled decode graph, whose lengths are symbolic: no recompiles
    if not torch.compiler.is_compiling() and num_tokens * length * width > _SCORE_ELEMENTS:
        chunk = max(1, _SCORE_ELEMENTS // (length * width))
    for start in range(0, num_tokens, chunk):
        stop = min(start + chunk, num_tokens)
        scores = scores_fn(q, weights, k_cache, batch, start, stop)
        index = _ranking_keys(scores).topk(k, dim=-1).indices
        out[start:stop] = index.masked_fill_(scores.gather(1, index) == float("-inf"), -1)
    return out


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, batch: ForwardBatch,
                 topk: int) -> torch.Tensor:
    """Each query token's top-`topk` visible context positions by index score (`indexer_scores`; this step's keys
    already written). Returns [T, min(topk, max_seq_len)] int64 positions, -1 where a query sees fewer tokens."""
    return select_topk(indexer_scores, q, weights, k_cache, batch, topk)


def selection_mask(selected: torch.Tensor, length: int) -> torch.Tensor:
    """[T, K] positions (-1 padded) -> [T, length] bool."""
    mask = torch.zeros(selected.shape[0], length + 1, dtype=torch.bool, device=selected.device)
    mask.scatter_(1, torch.where(selected < 0, length, selected), True)
    return mask[:, :length]


def sparse_latent_attention(q: torch.Tensor, kv_cache: torch.Tensor, latent_dim: int, batch: ForwardBatch,
                            meta: TorchAttentionMetadata | MixedAttentionMetadata, scale: float,
                            selected: torch.Tensor) -> torch.Tensor:
    """MLA (absorbed) over only the `selected` context positions of each query ([T, K], -1 padded), as
    `attention.paged_latent_attention` otherwise: q [T, H, latent + rope] -> [T, H, latent]."""
    if isinstance(meta, MixedAttentionMetadata):
        out = q.new_empty(q.shape[0], q.shape[1], latent_dim)
        for rows, part, part_meta in meta.parts:
            out[rows] = sparse_latent_attention(q[rows], kv_cache, latent_dim, part, part_meta, scale, selected[rows])
        return out
    num_seqs, qmax, length = meta.mask.shape
    chosen = selection_mask(selected, length)
    padded = torch.ones(num_seqs * qmax, length, dtype=torch.bool, device=chosen.device)  # padding rows keep key 0
    padded[meta.query_rows] = chosen
    # the step's metadata with this layer's mask (and no additive biases cached for the step's own mask)
    sparse = dataclasses.replace(meta, mask=meta.mask & padded.view(num_seqs, qmax, length), needs_mask=True,
                                 biases={})
    return paged_latent_attention(q, kv_cache, latent_dim, batch, sparse, scale)
