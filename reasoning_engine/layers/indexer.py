"""The lightning indexer of DeepSeek Sparse Attention (DeepSeek-AI, 2025, "DeepSeek-V3.2: Pushing the Frontier of Open
Large Language Models"; also GLM-5's attention): it picks, per query token, the `index_topk` cached tokens its MLA
layer attends to.

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
from torch import nn

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.kernels import kernel_module
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

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.head_dim)

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
