"""Attention layers over the paged KV cache: grouped-query attention (Llama, Qwen3) and DeepSeek's multi-head latent
attention (MLA, DeepSeek-AI 2024, arXiv:2405.04434).

MLA caches only the compressed latent c_kv and the shared rotary key k_pe per token. Attention runs in the absorbed
form: W_UK is folded into the query and W_UV applied after attention, so the cache is never expanded to per-head K/V.

Under tensor parallelism (`tp`) each rank keeps its share of the query heads (and of GQA's KV heads) and the output
projection sums the ranks' partial products. MLA's latent is shared by every head, so each rank caches the whole
latent of its requests (the known cost of MLA under TP, which data-parallel attention avoids).

`use_fp8_cache()` (kv_cache_dtype="fp8") makes a layer's K/V or latent cache rows e4m3 bytes with a scale each
(kernels/fp8_cache.py): GQA's keys and values per token and head, its queries and keys rotated alike first
(`fp8_cache.key_rotation`: q.k unchanged, the keys' large channels spread before rounding), MLA's latent per token
with its rotary key kept in bfloat16. `cache_dtypes` says each cache tensor's dtype for the worker that allocates
them.
"""

from __future__ import annotations

import torch
from torch import nn

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.kernels import kernel_module
from reasoning_engine.kernels.fp8_cache import key_rotation, row_bytes
from reasoning_engine.layers.indexer import Indexer, PooledIndexer
from reasoning_engine.layers.linear import row_parallel
from reasoning_engine.layers.norm import RMSNorm, ShardedRMSNorm
from reasoning_engine.layers.rotary import RotaryEmbedding
from reasoning_engine.parallel import Group


class GQAttention(nn.Module):
    """Fused QKV projection, optional per-head q/k RMSNorm (Qwen3), RoPE, paged attention, output projection."""

    kernel_family = "attention"
    cache_group = 0  # the KV cache group whose block tables it reads (cache_groups.py; set when caches are bound)

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary: RotaryEmbedding,
                 bias: bool = False, qk_norm_eps: float | None = None, tp: Group = Group(),
                 o_bias: bool | None = None, qk_norm_all_heads: bool = False, sinks: bool = False,
                 sliding_window: int | None = None) -> None:
        """Head counts are the model's; this rank keeps 1 / tp.size of each. `o_bias` None: the output projection
        has a bias when the QKV projection does (Llama, Qwen3); GLM-4.5 biases q/k/v only. `qk_norm_all_heads`: the
        q/k RMSNorm spans all heads' channels of a token (MiniMax-M2) instead of each head (Qwen3); under tensor
        parallelism its statistic is then all-reduced over the ranks."""
        super().__init__()
        num_heads, num_kv_heads = num_heads // tp.size, num_kv_heads // tp.size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qkv_proj = nn.Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias)
        self.o_proj = row_parallel(num_heads * head_dim * tp.size, hidden_size, bias if o_bias is None else o_bias, tp)
        self.qk_norm_all_heads = qk_norm_all_heads
        if qk_norm_eps is not None and qk_norm_all_heads:
            self.q_norm = ShardedRMSNorm(num_heads * tp.size * head_dim, qk_norm_eps, tp)
            self.k_norm = ShardedRMSNorm(num_kv_heads * tp.size * head_dim, qk_norm_eps, tp)
        else:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
            self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.rotary = rotary
        self.scale = head_dim**-0.5
        # gpt-oss: a learned logit per head (this rank's) in the softmax denominator, and sliding-window layers
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        self.sliding_window = sliding_window
        self.ops = kernel_module(self.kernel_family, "torch")
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.fp8_cache = False
        self.key_rotation: torch.Tensor | None = None  # [head_dim, head_dim] with an FP8 cache

    def use_fp8_cache(self, device: torch.device) -> None:
        self.fp8_cache = True
        self.key_rotation = key_rotation(self.head_dim).to(device)

    def cache_shape(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        row = row_bytes(self.head_dim) if self.fp8_cache else self.head_dim
        shape = (num_blocks, block_size, self.num_kv_heads, row)
        return [shape, shape]

    def cache_dtypes(self, dtype: torch.dtype) -> list[torch.dtype]:
        """Each cache tensor's dtype: the model's, or uint8 rows for an FP8 cache."""
        return [torch.uint8 if self.fp8_cache else dtype] * 2

    def bind_cache(self, caches: list[torch.Tensor]) -> None:
        self.k_cache, self.v_cache = caches

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.qk_norm_all_heads:  # one RMS over all of a token's heads
            q, k = self.q_norm(q.flatten(1)).view_as(q), self.k_norm(k.flatten(1)).view_as(k)
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        if self.key_rotation is not None:  # in float32: the keys are rounded once, to e4m3, when written
            k = k.float() @ self.key_rotation
            q = (q.float() @ self.key_rotation).to(q.dtype)
        batch = batch.group(self.cache_group)
        self.ops.write_kv_cache(self.k_cache, k, batch.slot_mapping)
        self.ops.write_kv_cache(self.v_cache, v, batch.slot_mapping)
        out = self.ops.paged_attention(q, self.k_cache, self.v_cache, batch, batch.attn_metadata, self.scale,
                                       sinks=self.sinks, window=self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, -1))


class MLAttention(nn.Module):
    """Multi-head latent attention with an optional low-rank query (q_lora_rank) and the absorbed decode form."""

    kernel_family = "attention"
    cache_group = 0  # the KV cache group whose block tables it reads (cache_groups.py; set when caches are bound)

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rotary: RotaryEmbedding,
                 eps: float, softmax_scale: float, bias: bool = False, tp: Group = Group(),
                 indexer: Indexer | PooledIndexer | None = None) -> None:
        """`num_heads` is the model's; this rank keeps 1 / tp.size of them (the latent projections are whole).
        `indexer`: DeepSeek Sparse Attention's lightning indexer (layers/indexer.py; whole on every rank), whose
        top-k selection restricts each query's attention; its caches follow this layer's latent cache."""
        super().__init__()
        num_heads //= tp.size
        self.num_heads = num_heads
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        qk_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None and not bias:
            # q_proj and kv_a_proj_with_mqa read the same input: one fused matmul (the query's rows first)
            self.fused_q_kv_a_proj = nn.Linear(hidden_size, num_heads * qk_dim + kv_lora_rank + qk_rope_head_dim, bias=False)
        elif q_lora_rank is None:  # a biased kv_a_proj_with_mqa beside the unbiased q_proj: two matmuls
            self.q_proj = nn.Linear(hidden_size, num_heads * qk_dim, bias=False)
            self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        else:
            # q_a_proj and kv_a_proj_with_mqa read the same input: one fused matmul
            self.fused_qkv_a_proj = nn.Linear(hidden_size, q_lora_rank + kv_lora_rank + qk_rope_head_dim, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = row_parallel(num_heads * v_head_dim * tp.size, hidden_size, bias, tp)
        self.rotary = rotary
        self.scale = softmax_scale
        self.ops = kernel_module(self.kernel_family, "torch")
        self.w_uk: torch.Tensor | None = None  # [H, nope, latent]
        self.w_uv: torch.Tensor | None = None  # [H, latent, v]
        self.kv_cache: torch.Tensor | None = None
        self.fp8_cache = False
        self.indexer = indexer
        # GLM-5's "shared" layers attend to the tokens an earlier layer's indexer chose (a tuple: not a submodule)
        self.shared_indexer: tuple[Indexer | PooledIndexer, ...] = ()

    def use_fp8_cache(self, device: torch.device) -> None:
        """The latent in e4m3 with a scale per token, the rotary key in bfloat16; the indexer's keys (DeepSeek
        Sparse Attention) stay in the model's dtype."""
        self.fp8_cache = True

    def cache_shape(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        row = row_bytes(self.kv_lora_rank, self.rope_dim) if self.fp8_cache else self.kv_lora_rank + self.rope_dim
        latent = (num_blocks, block_size, row)
        return [latent] if self.indexer is None else [latent, *self.indexer.cache_shapes(num_blocks, block_size)]

    def cache_dtypes(self, dtype: torch.dtype) -> list[torch.dtype]:
        """Each cache tensor's dtype: the latent's (uint8 rows for an FP8 cache), then the indexer's."""
        indexer = [] if self.indexer is None else [dtype] * len(self.indexer.cache_shapes(1, 1))
        return [torch.uint8 if self.fp8_cache else dtype, *indexer]

    def bind_cache(self, caches: list[torch.Tensor]) -> None:
        self.kv_cache = caches[0]
        if self.indexer is not None:
            self.indexer.bind_cache(caches[1:])

    def process_weights_after_loading(self) -> None:
        """Split kv_b_proj into the per-head up-projections the absorbed form multiplies by."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_uk = w[:, : self.nope_dim, :].contiguous()
        self.w_uv = w[:, self.nope_dim :, :].transpose(1, 2).contiguous()

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        num_tokens = x.shape[0]
        batch = batch.group(self.cache_group)
        if self.q_lora_rank is None and hasattr(self, "fused_q_kv_a_proj"):
            q, kv_a = self.fused_q_kv_a_proj(x).split(
                [self.num_heads * (self.nope_dim + self.rope_dim), self.kv_lora_rank + self.rope_dim], dim=-1)
        elif self.q_lora_rank is None:
            q = self.q_proj(x)
            kv_a = self.kv_a_proj_with_mqa(x)
        else:
            q_a, kv_a = self.fused_qkv_a_proj(x).split([self.q_lora_rank, self.kv_lora_rank + self.rope_dim], dim=-1)
            q_resid = self.q_a_layernorm(q_a)
            q = self.q_b_proj(q_resid)
        q = q.view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        if isinstance(self.rotary, RotaryEmbedding):  # latent norm, rotations, cache write, absorbed query: one kernel
            query = self.rotary.mla_rope_and_cache(positions, q, kv_a, self.w_uk, self.kv_a_layernorm.weight,
                                                   self.kv_a_layernorm.eps, self.kv_cache, batch.slot_mapping)
        else:  # a layer without position encoding (Kimi Linear's NoPE MLA)
            q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
            c_kv, k_pe = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            c_kv = self.kv_a_layernorm(c_kv)
            q_pe, k_pe = self.rotary(positions, q_pe, k_pe.unsqueeze(1))
            self.ops.write_kv_cache(self.kv_cache, torch.cat([c_kv, k_pe.squeeze(1)], dim=-1), batch.slot_mapping)
            q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [T, H, latent]
            query = torch.cat([q_latent, q_pe], dim=-1)
        # DeepSeek Sparse Attention: this layer's indexer picks each query's tokens, or a GLM-5 "shared" layer reuses
        # the pick of the indexer it points at; None (no indexer, or no query sees more than index_topk) is dense
        source = self.indexer if self.indexer is not None else next(iter(self.shared_indexer), None)
        selected = None
        if self.indexer is not None:
            selected = self.indexer(positions, x, q_resid, batch)
        elif source is not None:
            selected = source.selected
        if selected is None:
            out_latent = self.ops.paged_latent_attention(query, self.kv_cache,
                                                         self.kv_lora_rank, batch, batch.attn_metadata, self.scale)
        else:
            out_latent = source.ops.sparse_latent_attention(query, self.kv_cache,
                                                            self.kv_lora_rank, batch, batch.attn_metadata, self.scale,
                                                            selected)
        return self.o_proj(self._up_project_values(out_latent))

    def _up_project_values(self, out_latent: torch.Tensor) -> torch.Tensor:
        """[T, H, latent] -> [T, H * v]: each head's output times its W_UV, written straight into o_proj's input rows
        (the product's [H, T, v] is a strided view of them), so several query rows need no copy after the bmm.
        Under torch.compile (which takes no strided `out=`) the product is reshaped instead."""
        num_tokens = out_latent.shape[0]
        if torch.compiler.is_compiling():
            return torch.bmm(out_latent.transpose(0, 1), self.w_uv).transpose(0, 1).reshape(num_tokens, -1)
        out = torch.empty(num_tokens, self.num_heads, self.v_dim, dtype=out_latent.dtype, device=out_latent.device)
        torch.bmm(out_latent.transpose(0, 1), self.w_uv, out=out.transpose(0, 1))
        return out.view(num_tokens, -1)
