"""DeepSeek-V4's attention (DeepSeek-AI, 2026, "DeepSeek-V4", section 2.3): shared-KV multi-query attention over one
latent row per token (K = V, `head_dim` wide, the last `rope_dim` channels rotated), a learned sink per head, and a
grouped low-rank output projection. Every layer attends over a sliding window; a compressed layer adds rows that
each stand for `rate` tokens:

- heavily compressed attention (HCA, rate 128): a row is the softmax-gated sum of its window's tokens (gate logits
  plus a learned bias per position in the window), RMS-normed and rotated at the window's first position; every
  finished row is attended.
- compressed sparse attention (CSA, rate 4): rows overlap, a row pools its own window's tokens and the previous
  window's (two projections per token, Ca for the next row and Cb for its own); a lightning indexer (its own
  compressor at `index_head_dim`, index queries from the low-rank query) scores the finished rows and each query
  attends to its `index_topk` best.

The output's rotated channels are rotated back by the query's angle (the values carry their keys' rotation), then
the heads are projected in `o_groups` groups to `o_lora_rank` each (`o_a_proj`) and mixed to the hidden size
(`o_b_proj`). Caches and the step's addressing: kernels/compressed_attention.py.
"""

from __future__ import annotations

import torch
from torch import nn

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.kernels import compressed_attention as ops
from reasoning_engine.kernels import kernel_module
from reasoning_engine.kernels.rotary import rotate_tail_interleaved
from reasoning_engine.layers.hyper_connection import rms_normalise
from reasoning_engine.layers.linear import row_parallel
from reasoning_engine.layers.norm import RMSNorm
from reasoning_engine.layers.rotary import RotaryEmbedding
from reasoning_engine.parallel import Group

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


class LayerCaches(nn.Module):
    """The paged tensors one attention layer keeps in one KV cache group (what the worker allocates and binds): per
    token (`rate` None: `block_size` rows per block) or per compressed row (max(1, block_size // rate) per block),
    one tensor per width."""

    cache_group = 0  # set when the caches are bound

    def __init__(self, widths: list[int], rate: int | None = None) -> None:
        super().__init__()
        self.widths, self.rate = widths, rate
        self.caches: list[torch.Tensor] = []

    def cache_shape(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        rows = block_size
        if self.rate is not None:
            if block_size % self.rate and self.rate % block_size:
                raise ValueError(f"block_size {block_size} and the compression rate {self.rate} must divide one another")
            rows = max(1, block_size // self.rate)
        return [(num_blocks, rows, width) for width in self.widths]

    def bind_cache(self, caches: list[torch.Tensor]) -> None:
        self.caches = caches


class Compressor(nn.Module):
    """Rows of `head_dim` from windows of `rate` tokens: per token kv and gate projections (two of each with
    `overlap`: the part for the next row first), pooled by `ops.gated_pool`, RMS-normed, rotated at the window's
    first position."""

    def __init__(self, hidden_size: int, head_dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.head_dim, self.rate, self.overlap = head_dim, rate, int(overlap)
        width = (1 + self.overlap) * head_dim
        self.kv_proj = nn.Linear(hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, width))
        self.kv_norm = RMSNorm(head_dim, eps)

    @property
    def cache_width(self) -> int:
        """Channels per token in the projection cache: kv then gate."""
        return 2 * (1 + self.overlap) * self.head_dim

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)

    def compress(self, cache: torch.Tensor, addr: ops.RowAddressing, rotary: RotaryEmbedding) -> torch.Tensor:
        """The rows the step's closing tokens finish [F, head_dim], from the projections in `cache`."""
        src = ops.read_rows(cache, addr.source_block, addr.source_offset)  # [F, (1 + overlap) rate, 2 width]
        kv, gate = src.chunk(2, dim=-1)
        gate = gate + self.position_bias.repeat(1 + self.overlap, 1).to(gate.dtype)
        if self.overlap:  # the previous window's Ca channels, then this window's Cb channels
            d, r = self.head_dim, self.rate
            kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
            gate = torch.cat([gate[:, :r, :d], gate[:, r:, d:]], dim=1)
        rows = self.kv_norm(ops.gated_pool(kv, gate, addr.source_valid))
        cos, sin = rotary.cos[addr.row_position], rotary.sin[addr.row_position]
        return rotate_tail_interleaved(rows.unsqueeze(1), cos, sin).squeeze(1)


class LightningIndexer(nn.Module):
    """CSA's row picker: its compressor's rows are the index keys; index queries are `q_b_proj` of the low-rank
    query, rotated like the keys; a query's score for a row is sum_h w_h ReLU(q_h . k) with w = weights_proj(x)."""

    def __init__(self, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int, rate: int, topk: int,
                 eps: float) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.topk = num_heads, head_dim, topk
        self.compressor = Compressor(hidden_size, head_dim, rate, overlap=True, eps=eps)
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.weight_scale = head_dim**-0.5 * num_heads**-0.5  # ReLU(a) c = ReLU(a c) for c > 0: folded into w

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        q = self.q_b_proj(q_resid).view(x.shape[0], self.num_heads, self.head_dim)
        q = rotate_tail_interleaved(q, cos, sin)
        weights = self.weights_proj(x).float() * self.weight_scale
        return ops.select_rows(q, weights, keys, visible, self.topk)


class GroupedLinear(nn.Module):
    """`groups` independent projections of equal slices of the input: weight [groups * out, in / groups]."""

    def __init__(self, in_per_group: int, out_per_group: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * out_per_group, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, groups * in] -> [T, groups * out]."""
        w = self.weight.view(self.groups, -1, self.weight.shape[1])
        return torch.einsum("tgi,goi->tgo", x.view(x.shape[0], self.groups, -1), w).flatten(1)


class DeepseekV4Attention(nn.Module):
    """One layer of `kind` (sliding_attention, compressed_sparse_attention or heavily_compressed_attention). Under
    tensor parallelism a rank keeps 1 / tp of the heads and of the output groups (their sinks, q_b_proj rows, o_a_proj
    groups, o_b_proj columns); the latent row, the compressors and the indexer are whole on every rank. The
    attention itself (window and compressed rows, one softmax with the sink) is `ops.compressed_attention` of the
    kernel backend (`kernel_family`); the compressors and the indexer run in torch."""

    kernel_family = "compressed_attention"

    def __init__(self, kind: str, hidden_size: int, num_heads: int, head_dim: int, q_lora_rank: int, o_groups: int,
                 o_lora_rank: int, rotary: RotaryEmbedding, eps: float, rate: int | None = None,
                 index: tuple[int, int, int] | None = None, tp: Group = Group()) -> None:
        """`index`: (heads, head_dim, topk) of a CSA layer's indexer."""
        super().__init__()
        if kind not in (SLIDING, CSA, HCA):
            raise ValueError(f"layer_types entries must be {SLIDING}, {CSA} or {HCA}, got {kind!r}")
        if num_heads % tp.size or o_groups % tp.size:
            raise ValueError(f"tensor_parallel_size {tp.size} must divide num_attention_heads ({num_heads}) and "
                             f"o_groups ({o_groups})")
        self.kind, self.eps = kind, eps
        self.num_heads, self.head_dim = num_heads // tp.size, head_dim
        groups = o_groups // tp.size
        self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(q_lora_rank, eps)
        self.q_b_proj = nn.Linear(q_lora_rank, self.num_heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.kv_norm = RMSNorm(head_dim, eps)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))
        self.o_a_proj = GroupedLinear(num_heads * head_dim // o_groups, o_lora_rank, groups)
        self.o_b_proj = row_parallel(o_groups * o_lora_rank, hidden_size, False, tp)
        self.rotary = rotary
        self.ops = kernel_module(self.kernel_family, "torch")
        self.scale = head_dim**-0.5
        self.compressor: Compressor | None = None
        self.indexer: LightningIndexer | None = None
        window_widths, row_widths = [head_dim], []
        if kind != SLIDING:
            self.compressor = Compressor(hidden_size, head_dim, rate, overlap=kind == CSA, eps=eps)
            window_widths.append(self.compressor.cache_width)
            row_widths.append(head_dim)
        if kind == CSA:
            heads, dim, topk = index
            self.indexer = LightningIndexer(hidden_size, q_lora_rank, heads, dim, rate, topk, eps)
            window_widths.append(self.indexer.compressor.cache_width)
            row_widths.append(dim)
        self.window = LayerCaches(window_widths)
        self.rows = LayerCaches(row_widths, rate) if row_widths else None

    @property
    def rate_key(self) -> tuple[int, int] | None:
        """(rate, overlap) of this layer's rows, as `ops.prepare_compressed` addresses them."""
        return None if self.compressor is None else (self.compressor.rate, self.compressor.overlap)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch,
                meta: ops.CompressedMetadata) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        cos, sin = self.rotary.cos[positions], self.rotary.sin[positions]
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = rotate_tail_interleaved(rms_normalise(self.q_b_proj(q_resid).view(t, h, d), self.eps), cos, sin)
        kv = rotate_tail_interleaved(self.kv_norm(self.kv_proj(x)).unsqueeze(1), cos, sin).squeeze(1)
        slots = batch.group(self.window.cache_group).slot_mapping
        caches = self.window.caches
        block, offset = slots // caches[0].shape[1], slots % caches[0].shape[1]
        ops.write_rows(caches[0], block, offset, kv)
        picked = {}  # the compressed rows each query attends to, as (block, offset, valid) in the row cache
        if self.compressor is not None:
            addr = meta.rates[self.rate_key]
            rows = self.rows.caches
            ops.write_rows(caches[1], block, offset, self.compressor.project(x))
            ops.write_rows(rows[0], addr.row_block, addr.row_offset, self.compressor.compress(caches[1], addr, self.rotary))
            if self.indexer is None:  # HCA: every finished row
                picked = dict(row_block=addr.visible_block, row_offset=addr.visible_offset, row_valid=addr.visible)
            else:
                ops.write_rows(caches[2], block, offset, self.indexer.compressor.project(x))
                ops.write_rows(rows[1], addr.row_block, addr.row_offset,
                               self.indexer.compressor.compress(caches[2], addr, self.rotary))
                index_keys = ops.read_rows(rows[1], addr.visible_block, addr.visible_offset)
                chosen = self.indexer.select(x, q_resid, cos, sin, index_keys, addr.visible)
                pick = chosen.clamp(min=0)
                picked = dict(row_block=addr.visible_block.gather(1, pick), row_offset=addr.visible_offset.gather(1, pick),
                              row_valid=chosen >= 0)
            picked["row_cache"] = rows[0]
        out = self.ops.compressed_attention(q, caches[0], meta.window_block, meta.window_offset, meta.window_valid,
                                            self.sinks, self.scale, **picked)
        out = rotate_tail_interleaved(out, cos, -sin)
        return self.o_b_proj(self.o_a_proj(out.reshape(t, -1)))
