"""GLM-4.5 / 4.6 / 4.7 (`glm4_moe`): GQA attention with q/k/v biases (no output bias), optional per-head q/k RMSNorm
and partial rotary (the first `partial_rotary_factor` of each head's channels, neox layout); the first
`first_k_dense_replace` layers dense, the rest MoE with DeepSeek-V3's noaux_tc routing (sigmoid scores, correction
bias for the choice, group-limited top-k, `routed_scaling_factor`) plus shared experts. The official FP8 checkpoints
(compressed-tensors, one scale per output channel) keep their routed experts packed (`quantization.expert_quant`).

Tensors of the multi-token-prediction layers (index >= num_hidden_layers) are skipped here; the speculative decoder
loads them (speculative/mtp.py) through `decoder_layer` and `map_layer_weight`, as for DeepSeek-V3.
"""

from __future__ import annotations

import re

from torch import nn

from reasoning_engine.config import ModelConfig
from reasoning_engine.layers.attention import GQAttention
from reasoning_engine.layers.moe import Experts, GatedMLP, Router, SparseMoE
from reasoning_engine.layers.rotary import RotaryEmbedding
from reasoning_engine.models.base import CausalLM, DecoderLayer, WeightTarget, gqa_target
from reasoning_engine.models.quantization import expert_quant
from reasoning_engine.parallel import Parallel
from reasoning_engine.quant_config import parse_quant_config


def rotary_dim(config: ModelConfig) -> int:
    """Rotated channels per head. transformers keeps `partial_rotary_factor` in `rope_parameters` (5.x) or at the
    top level (the hub's configs), 0.5 when absent."""
    rope = config.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor") or config.get("partial_rotary_factor", 0.5)
    return int(config.head_dim * factor)


def rotary_embedding(config: ModelConfig, max_positions: int) -> RotaryEmbedding:
    return RotaryEmbedding(rotary_dim(config), config.rope_theta, config.rope_scaling, config.max_position_embeddings,
                           max_positions)


def _mlp(config: ModelConfig, index: int, parallel: Parallel) -> nn.Module:
    num_experts = config.get("n_routed_experts", 0) or 0
    if not num_experts or index < (config.get("first_k_dense_replace", 0) or 0):
        return GatedMLP(config.hidden_size, config.raw["intermediate_size"], tp=parallel.tp)
    router = Router(
        config.hidden_size, num_experts, config.raw["num_experts_per_tok"], "sigmoid",
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        n_group=config.get("n_group", 1) or 1, topk_group=config.get("topk_group", 1) or 1,
        topk_method="noaux_tc", correction_bias=True,
    )
    inter = config.raw["moe_intermediate_size"]
    experts = Experts(num_experts, config.hidden_size, inter,
                      expert_quant(parse_quant_config(config.raw), index, config.hidden_size, inter), parallel)
    n_shared = config.get("n_shared_experts", 0) or 0
    shared = None
    if n_shared:  # split over the attention's ranks; the MoE block sums it with the routed experts
        shared = GatedMLP(config.hidden_size, inter * n_shared, tp=parallel.tp, reduce=False)
    return SparseMoE(router, experts, shared, parallel)


def decoder_layer(config: ModelConfig, index: int, rotary: RotaryEmbedding,
                  parallel: Parallel = Parallel()) -> DecoderLayer:
    """Layer `index` of the stack (MTP layers, index >= num_hidden_layers, are built the same way: MoE)."""
    attn = GQAttention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                       rotary, bias=bool(config.get("attention_bias", False)),
                       qk_norm_eps=config.rms_norm_eps if config.get("use_qk_norm", False) else None,
                       tp=parallel.tp, o_bias=False)
    return DecoderLayer(attn, _mlp(config, index, parallel), config.hidden_size, config.rms_norm_eps)


def map_layer_weight(name: str, config: ModelConfig, parallel: Parallel = Parallel()) -> WeightTarget | None:
    """`layers.N.*` tensors into the fused QKV / gate-up layouts and stacked experts (this rank's share)."""
    return gqa_target(name, config.num_attention_heads, config.num_key_value_heads, config.head_dim, parallel,
                      config.get("n_routed_experts", 0) or 0)


class Glm4MoeForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, max_positions: int, parallel: Parallel = Parallel()) -> None:
        rotary = rotary_embedding(config, max_positions)
        super().__init__(config, [decoder_layer(config, i, rotary, parallel) for i in range(config.num_hidden_layers)],
                         parallel)

    def map_weight(self, name: str) -> WeightTarget | None:
        match = re.match(r"layers\.(\d+)\.", name)
        if match and int(match.group(1)) >= self.config.num_hidden_layers:
            return None  # MTP layers
        return map_layer_weight(name, self.config, self.parallel)
