"""Qwen3 and Qwen3-MoE: GQA attention with per-head q/k RMSNorm; MoE layers with softmax top-k routing."""

from __future__ import annotations

from torch import nn

from reasoning_engine.config import ModelConfig
from reasoning_engine.layers.attention import GQAttention
from reasoning_engine.layers.moe import Experts, GatedMLP, Router, SparseMoE
from reasoning_engine.layers.rotary import RotaryEmbedding
from reasoning_engine.models.base import CausalLM, DecoderLayer, WeightTarget, gqa_target
from reasoning_engine.models.quantization import expert_quant
from reasoning_engine.parallel import Parallel
from reasoning_engine.quant_config import parse_quant_config


def _is_moe_layer(config: ModelConfig, index: int) -> bool:
    num_experts = config.get("num_experts", 0) or 0
    step = config.get("decoder_sparse_step", 1) or 1
    return index not in (config.get("mlp_only_layers") or []) and num_experts > 0 and (index + 1) % step == 0


def _mlp(config: ModelConfig, index: int, parallel: Parallel) -> nn.Module:
    if config.family == "qwen3_moe" and _is_moe_layer(config, index):
        router = Router(config.hidden_size, config.raw["num_experts"], config.raw["num_experts_per_tok"], "softmax",
                        norm_topk_prob=bool(config.get("norm_topk_prob", False)))
        experts = Experts(config.raw["num_experts"], config.hidden_size, config.raw["moe_intermediate_size"],
                          expert_quant(parse_quant_config(config.raw), index), parallel)
        return SparseMoE(router, experts, None, parallel)
    return GatedMLP(config.hidden_size, config.raw["intermediate_size"], tp=parallel.tp)


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, max_positions: int, parallel: Parallel = Parallel()) -> None:
        rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                 config.max_position_embeddings, max_positions)
        bias = bool(config.get("attention_bias", False))
        layers = [
            DecoderLayer(
                GQAttention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                            config.head_dim, rotary, bias=bias, qk_norm_eps=config.rms_norm_eps, tp=parallel.tp),
                _mlp(config, i, parallel), config.hidden_size, config.rms_norm_eps)
            for i in range(config.num_hidden_layers)
        ]
        super().__init__(config, layers, parallel)

    def map_weight(self, name: str) -> WeightTarget | None:
        c = self.config
        return gqa_target(name, c.num_attention_heads, c.num_key_value_heads, c.head_dim, self.parallel,
                          c.get("num_experts", 0) or 0)
