"""The lightning indexer of DeepSeek Sparse Attention (DeepSeek-AI, 2025, "DeepSeek-V3.2: Pushing the Frontier of Open
Large Language Models"; also GLM-5's attention): it picks, per query token, the `index_topk` cached tokens its MLA
layer attends to. `PooledIndexer` is GLM-5.3-Flash's variant, which scores pools of tokens instead of tokens.

Index queries come from the MLA query's low-rank latent (`q_resid`, after q_a_layernorm) through `wq_b`; the index key
of a token is one small vector (`wk`, then a LayerNorm), whose first `qk_rope_head_dim` channels are rotated like the
query's (neox layout for DeepSeek-V3.2, interleaved for GLM-5) with the model's rope tables. Keys live in a paged cache
beside the latent cache (same blocks and slots), so prefix caching, chunked prefill and draft-node moves treat both
alike. The official kernels quantise q and k to FP8 after a Hadamard rotation; the rotation keeps dot products and the
quantisation only precision, so scores are computed here in the model's dtype (float32 accumulation), as transformers.

When no query of a step can see more than `index_topk` tokens the selection is every visible token: the indexer then
only writes its keys and the layer runs dense MLA (the same result, none of the scoring).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.kernels import compressed_attention as rows_ops
from reasoning_engine.kernels import kernel_module
from reasoning_engine.layers.compressed_attention import LayerCaches
from reasoning_engine.layers.rotary import RotaryEmbedding


class Indexer(nn.Module):
    """Index heads over this layer's key cache; `forward` returns the selected context positions ([T, K], -1 padded)
    or None when attention stays dense, and keeps it in `selected` for layers that share it (GLM-5)."""

    kernel_family = "sparse_attention"

    def __init__(self, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int, rope_dim: int, topk: int,
                 rotary: RotaryEmbedding, interleaved: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.rope_dim, self.topk = num_heads, head_dim, rope_dim, topk
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)
        # ReLU(a * c) = c * ReLU(a) for c > 0: the score scale and the head-averaging factor fold into the weights
        self.weight_scale = head_dim**-0.5 * num_heads**-0.5
        self.rotary = rotary  # the model's table, applied in this indexer's own layout
        self.interleaved = interleaved
        self.ops = kernel_module(self.kernel_family, "torch")
        self.k_cache: torch.Tensor | None = None
        self.selected: torch.Tensor | None = None

    def cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        """The caches it keeps beside its layer's latent cache, in its blocks: one index key per token."""
        return [(num_blocks, block_size, self.head_dim)]

    def bind_cache(self, caches: list[torch.Tensor]) -> None:
        (self.k_cache,) = caches

    def forward(self, positions: torch.Tensor, x: torch.Tensor, q_resid: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor | None:
        num_tokens = x.shape[0]
        q = self.wq_b(q_resid).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).unsqueeze(1)
        q, k = self.rotary.ops.apply_rotary(positions, q, k, self.rotary.cos, self.rotary.sin, self.interleaved)
        self.ops.write_kv_cache(self.k_cache, k.squeeze(1), batch.slot_mapping)
        if batch.max_seq_len <= self.topk:
            self.selected = None
        else:
            weights = self.weights_proj(x).float() * self.weight_scale
            self.selected = self.ops.indexer_topk(q, weights, self.k_cache, batch, self.topk)
        return self.selected


class PooledIndexer(nn.Module):
    """GLM-5.3-Flash's indexer (DSA over k-pools; transformers' `Glm5NextTextIndexer`): the index keys of `pool`
    consecutive tokens (positions w * pool .. (w + 1) * pool - 1) are folded into one pooled key, their softmax-gated
    sum per channel (gate logits `index_kpool_compress_gate` x, plus a learned bias per position in the pool); a
    query scores the pools that end at or before it, sum_h w_h ReLU(q_h . key) as the token indexer does, keeps the
    `index_topk / pool` best, and attends to their tokens and to those of its own unfinished pool (the tail). No
    rotary: the layers it serves are NoPE. Keys are LayerNorm(wk x) per token.

    Caches, beside its layer's latent cache in the same blocks: per token its key and gate logits (what a pool is
    made of), and per pool its pooled key, in the block of its last token (`LayerCaches` with rate `pool`), written
    when that token is computed, so chunked prefill, prefix hits at any block boundary and draft chains need nothing
    more. The step's pool addressing (`kernels.compressed_attention.row_addressing`, rate `pool`) is set on
    `addressing` by the model once per step. Selected positions are kept in `selected` for layers that share them."""

    kernel_family = "sparse_attention"

    def __init__(self, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int, topk: int, pool: int) -> None:
        super().__init__()
        if pool < 1 or topk % pool:
            raise ValueError(f"index_topk ({topk}) must be a multiple of index_kpool ({pool})")
        self.num_heads, self.head_dim, self.pool, self.topk_pools = num_heads, head_dim, pool, topk // pool
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.empty(pool, head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.empty(head_dim, hidden_size))
        self.weight_scale = head_dim**-0.5 * num_heads**-0.5  # as `Indexer`: folded into the head weights
        self.token_caches = LayerCaches([2 * head_dim])
        self.pool_caches = LayerCaches([head_dim], rate=pool)
        self.ops = kernel_module(self.kernel_family, "torch")
        self.addressing: rows_ops.RowAddressing | None = None
        self.selected: torch.Tensor | None = None

    def cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        tokens = self.token_caches.cache_shape(num_blocks, block_size)
        return tokens + self.pool_caches.cache_shape(num_blocks, block_size)

    def bind_cache(self, caches: list[torch.Tensor]) -> None:
        self.token_caches.bind_cache(caches[:1])
        self.pool_caches.bind_cache(caches[1:])

    def forward(self, positions: torch.Tensor, x: torch.Tensor, q_resid: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor | None:
        addr = self.addressing
        (tokens,), (pools,) = self.token_caches.caches, self.pool_caches.caches
        slots = batch.slot_mapping
        key = self.k_norm(self.wk(x))
        gate = F.linear(x, self.index_kpool_compress_gate)
        rows_ops.write_rows(tokens, slots // tokens.shape[1], slots % tokens.shape[1], torch.cat([key, gate], dim=-1))
        members = rows_ops.read_rows(tokens, addr.source_block, addr.source_offset)  # [F, pool, 2 D]
        member_keys, member_gates = members.chunk(2, dim=-1)
        pooled = rows_ops.gated_pool(member_keys, member_gates + self.index_kpool_compress_ape.to(members.dtype),
                                     addr.source_valid)
        rows_ops.write_rows(pools, addr.row_block, addr.row_offset, pooled)
        if batch.max_seq_len // self.pool <= self.topk_pools:
            self.selected = None  # no query sees more pools than it keeps: every visible token, dense attention
            return None
        q = self.wq_b(q_resid).view(x.shape[0], self.num_heads, self.head_dim)
        weights = self.weights_proj(x).float() * self.weight_scale
        keys = rows_ops.read_rows(pools, addr.visible_block, addr.visible_offset)
        chosen = rows_ops.select_rows(q, weights, keys, addr.visible, self.topk_pools)  # [T, K] pool ids, -1 padded
        offsets = torch.arange(self.pool, device=x.device)
        picked = (chosen.unsqueeze(-1) * self.pool + offsets).masked_fill_((chosen < 0).unsqueeze(-1), -1).flatten(1)
        pos = positions.long().unsqueeze(1)
        tail = (pos + 1) // self.pool * self.pool + offsets[:-1]
        self.selected = torch.cat([picked, tail.masked_fill_(tail > pos, -1)], dim=1)
        return self.selected
