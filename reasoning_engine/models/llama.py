"""Llama (and Llama-3 rope scaling): GQA attention with fused QKV, SwiGLU MLP."""

from __future__ import annotations

from reasoning_engine.config import ModelConfig
from reasoning_engine.layers.attention import GQAttention
from reasoning_engine.layers.moe import GatedMLP
from reasoning_engine.layers.rotary import RotaryEmbedding
from reasoning_engine.models.base import CausalLM, DecoderLayer, WeightTarget, gqa_target
from reasoning_engine.parallel import Parallel


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, max_positions: int, parallel: Parallel = Parallel()) -> None:
        rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                 config.max_position_embeddings, max_positions)
        bias = bool(config.get("attention_bias", False))
        layers = [
            DecoderLayer(
                GQAttention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                            config.head_dim, rotary, bias=bias, tp=parallel.tp),
                GatedMLP(config.hidden_size, config.raw["intermediate_size"], bias=bool(config.get("mlp_bias", False)),
                         tp=parallel.tp),
                config.hidden_size, config.rms_norm_eps)
            for _ in range(config.num_hidden_layers)
        ]
        super().__init__(config, layers, parallel)

    def map_weight(self, name: str) -> WeightTarget | None:
        c = self.config
        return gqa_target(name, c.num_attention_heads, c.num_key_value_heads, c.head_dim, self.parallel)
