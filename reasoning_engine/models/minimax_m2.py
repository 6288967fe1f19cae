"""MiniMax-M2 / M2.1 / M2.5 / M2.7 (`minimax_m2`): GQA attention whose q and k RMSNorms each span all heads of a token
(one statistic over `num_heads * head_dim` channels, not per head; under tensor parallelism the sum of squares is
all-reduced over the ranks), partial rotary (the first `rotary_dim` channels of each head, neox layout); every layer
a MoE without shared experts: sigmoid scores, a per-expert correction bias added for the choice only, top-k, weights
the unbiased scores renormalised.

Checkpoints (the official ones and transformers' `save_pretrained`) name the MoE Mixtral's way:
`block_sparse_moe.gate`, `block_sparse_moe.e_score_correction_bias` and `block_sparse_moe.experts.E.w1/w3/w2`
(gate / up / down); these map into the shared router and stacked experts. Tensors of the multi-token-prediction
modules (layer index >= num_hidden_layers) are skipped.
"""

from __future__ import annotations

import re

from reasoning_engine.config import ModelConfig
from reasoning_engine.layers.attention import GQAttention
from reasoning_engine.layers.moe import Experts, Router, SparseMoE
from reasoning_engine.layers.rotary import RotaryEmbedding
from reasoning_engine.models.base import CausalLM, DecoderLayer, WeightTarget, column_split, expert_target, gqa_target
from reasoning_engine.models.quantization import expert_quant
from reasoning_engine.parallel import Parallel
from reasoning_engine.quant_config import parse_quant_config

_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def rotary_dim(config: ModelConfig) -> int:
    """Rotated channels per head, as transformers reads them: `rope_parameters.partial_rotary_factor` (which its
    config class derives from the official `rotary_dim`), else `rotary_dim`, else every channel."""
    factor = (config.get("rope_parameters") or {}).get("partial_rotary_factor")
    if factor is not None:
        return int(config.head_dim * factor)
    return int(config.get("rotary_dim") or config.head_dim)


def _moe(config: ModelConfig, index: int, parallel: Parallel) -> SparseMoE:
    num_experts = config.raw["num_local_experts"]
    router = Router(config.hidden_size, num_experts, config.raw["num_experts_per_tok"], "sigmoid",
                    norm_topk_prob=True, topk_method="noaux_tc", correction_bias=True)
    experts = Experts(num_experts, config.hidden_size, config.raw["intermediate_size"],
                      expert_quant(parse_quant_config(config.raw), index), parallel)
    return SparseMoE(router, experts, None, parallel)


class MiniMaxM2ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, max_positions: int, parallel: Parallel = Parallel()) -> None:
        rotary = RotaryEmbedding(rotary_dim(config), config.rope_theta, config.rope_scaling,
                                 config.max_position_embeddings, max_positions)
        qk_norm = bool(config.get("use_qk_norm", True))
        layers = [
            DecoderLayer(
                GQAttention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                            config.head_dim, rotary, qk_norm_eps=config.rms_norm_eps if qk_norm else None,
                            tp=parallel.tp, qk_norm_all_heads=True),
                _moe(config, i, parallel), config.hidden_size, config.rms_norm_eps)
            for i in range(config.num_hidden_layers)
        ]
        super().__init__(config, layers, parallel)

    def map_weight(self, name: str) -> WeightTarget | None:
        c = self.config
        layer = re.match(r"layers\.(\d+)\.", name)
        if layer and int(layer.group(1)) >= c.num_hidden_layers:
            return None  # multi-token-prediction modules
        if re.fullmatch(r"layers\.\d+\.self_attn\.[qk]_norm\.weight", name):  # this rank's heads' channels
            return WeightTarget(name, source=column_split(self.parallel.tp))
        moe = re.fullmatch(r"(layers\.\d+)\.block_sparse_moe\.(.+)", name)
        if moe is None:
            return gqa_target(name, c.num_attention_heads, c.num_key_value_heads, c.head_dim, self.parallel)
        prefix, rest = moe.groups()
        if rest == "e_score_correction_bias":
            return WeightTarget(f"{prefix}.mlp.gate.e_score_correction_bias")
        expert = re.fullmatch(r"experts\.(\d+)\.(w[123])\.(\w+)", rest)
        if expert:
            renamed = f"{prefix}.mlp.experts.{expert.group(1)}.{_EXPERT_PROJ[expert.group(2)]}.{expert.group(3)}"
            return expert_target(renamed, self.parallel, c.raw["num_local_experts"])
        return WeightTarget(f"{prefix}.mlp.{rest}")
