"""DeepSeek-V3 / Kimi K2 / Kimi K2.5 (and DeepSeek-V2): MLA attention over a latent cache, dense first layers, then
MoE layers with shared experts. The routing differs by family (noaux_tc sigmoid for V3/K2, softmax greedy for V2).

DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`) are V3 with DeepSeek Sparse Attention: every MLA layer has a
lightning indexer (layers/indexer.py) when the config has `index_topk`; GLM-5's `indexer_types` mark "shared" layers,
which have no indexer and attend to the tokens the previous "full" layer's indexer chose.

Tensors of the multi-token-prediction layers (index >= num_hidden_layers) are skipped here; the speculative decoder
loads them on its own (speculative/mtp.py), building them with `decoder_layer` and mapping them with `map_layer_weight`.
"""

from __future__ import annotations

import re

from torch import nn

from reasoning_engine.config import ModelConfig
from reasoning_engine.layers.attention import MLAttention
from reasoning_engine.layers.indexer import Indexer
from reasoning_engine.layers.moe import Experts, GatedMLP, Router, SparseMoE
from reasoning_engine.layers.rotary import RotaryEmbedding, yarn_softmax_scale
from reasoning_engine.models.base import CausalLM, DecoderLayer, WeightTarget, column_split, mlp_target, row_split, rows
from reasoning_engine.models.quantization import expert_quant
from reasoning_engine.parallel import Parallel
from reasoning_engine.quant_config import parse_quant_config


def _is_moe_layer(config: ModelConfig, index: int) -> bool:
    if not config.get("n_routed_experts"):
        return False
    types = config.get("mlp_layer_types") or ()
    if index < len(types):
        return types[index] == "sparse"
    freq = config.get("moe_layer_freq", 1) or 1
    return index >= (config.get("first_k_dense_replace", 0) or 0) and index % freq == 0


def mlp_block(config: ModelConfig, index: int, parallel: Parallel) -> nn.Module:
    """Layer `index`'s dense MLP or MoE (also Kimi Linear's)."""
    if not _is_moe_layer(config, index):
        return GatedMLP(config.hidden_size, config.raw["intermediate_size"], tp=parallel.tp)
    num_experts = config.raw["n_routed_experts"]
    v3 = config.family != "deepseek_v2"
    scoring = config.get("scoring_func", "sigmoid" if v3 else "softmax")
    router = Router(
        config.hidden_size, num_experts, config.raw["num_experts_per_tok"], scoring,
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        n_group=config.get("n_group", 1) or 1, topk_group=config.get("topk_group", 1) or 1,
        topk_method=config.get("topk_method", "noaux_tc" if v3 else "greedy"),
        correction_bias=v3 and config.get("topk_method", "noaux_tc") == "noaux_tc",
    )
    experts = Experts(num_experts, config.hidden_size, config.raw["moe_intermediate_size"],
                      expert_quant(parse_quant_config(config.raw), index), parallel)
    n_shared = config.get("n_shared_experts", 0) or 0
    shared = None
    if n_shared:  # split over the attention's ranks; the MoE block sums it with the routed experts
        shared = GatedMLP(config.hidden_size, config.raw["moe_intermediate_size"] * n_shared, tp=parallel.tp, reduce=False)
    return SparseMoE(router, experts, shared, parallel)


def rotary_embedding(config: ModelConfig, max_positions: int) -> RotaryEmbedding:
    raw = config.raw
    interleaved = config.family == "deepseek_v2" or bool(raw.get("rope_interleave", True))
    return RotaryEmbedding(raw["qk_rope_head_dim"], config.rope_theta, config.rope_scaling,
                           config.max_position_embeddings, max_positions, interleaved=interleaved)


def decoder_layer(config: ModelConfig, index: int, rotary: RotaryEmbedding, parallel: Parallel = Parallel()) -> DecoderLayer:
    """Layer `index` of the stack: MLA attention, then a dense MLP or the MoE. MTP layers (index >= num_hidden_layers)
    are built the same way."""
    raw = config.raw
    rope_dim, nope_dim = raw["qk_rope_head_dim"], raw["qk_nope_head_dim"]
    scale = (rope_dim + nope_dim) ** -0.5 * yarn_softmax_scale(config.rope_scaling)
    attn = MLAttention(config.hidden_size, config.num_attention_heads, raw.get("q_lora_rank"), raw["kv_lora_rank"],
                       nope_dim, rope_dim, raw["v_head_dim"], rotary, config.rms_norm_eps, scale,
                       bias=bool(raw.get("attention_bias", False)), tp=parallel.tp,
                       indexer=_indexer(config, index, rotary))
    return DecoderLayer(attn, mlp_block(config, index, parallel), config.hidden_size, config.rms_norm_eps)


def _indexer(config: ModelConfig, index: int, rotary: RotaryEmbedding) -> Indexer | None:
    """Layer `index`'s DSA indexer: none without `index_topk` or on GLM-5's "shared" layers. DeepSeek-V3.2 rotates
    the index query and key in the neox layout, GLM-5 interleaved like its MLA."""
    raw = config.raw
    types = raw.get("indexer_types") or ()
    if not raw.get("index_topk") or (index < len(types) and types[index] == "shared"):
        return None
    if raw.get("q_lora_rank") is None:
        raise ValueError("DeepSeek Sparse Attention's indexer reads the low-rank query: the config needs q_lora_rank")
    return Indexer(config.hidden_size, raw["q_lora_rank"], raw["index_n_heads"], raw["index_head_dim"],
                   raw["qk_rope_head_dim"], raw["index_topk"], rotary, interleaved=config.family == "glm_moe_dsa")


def share_indexers(layers: list[DecoderLayer]) -> None:
    """Point each layer without an indexer at the nearest earlier layer's (GLM-5's "shared" layers)."""
    last: Indexer | None = None
    for layer in layers:
        if layer.self_attn.indexer is not None:
            last = layer.self_attn.indexer
        elif last is not None:
            layer.self_attn.shared_indexer = (last,)


def map_layer_weight(name: str, config: ModelConfig, parallel: Parallel = Parallel()) -> WeightTarget | None:
    """`layers.N.*` tensors into our fused layouts and this rank's share: q_a_proj and kv_a_proj_with_mqa into
    fused_qkv_a_proj (when the query is low-rank; whole on every rank), or without a query LoRA (and no attention
    bias) q_proj (this rank's heads) and kv_a_proj_with_mqa (whole) into fused_q_kv_a_proj, the per-head projections'
    rows (q_b_proj or q_proj, kv_b_proj) and o_proj's columns, gate/up into gate_up_proj, routed experts into the
    stacked w13 / w2."""
    q_lora_rank = config.raw.get("q_lora_rank")
    attn = re.fullmatch(r"(layers\.\d+\.self_attn)\.(\w+)\.(weight|bias)", name)
    if attn and q_lora_rank is not None and attn.group(2) in ("q_a_proj", "kv_a_proj_with_mqa"):
        fused = f"{attn.group(1)}.fused_qkv_a_proj.{attn.group(3)}"
        if attn.group(2) == "q_a_proj":
            return WeightTarget(fused, rows(0, q_lora_rank))
        return WeightTarget(fused, lambda t: t[q_lora_rank:])
    if (attn and q_lora_rank is None and not config.raw.get("attention_bias", False)
            and attn.group(2) in ("q_proj", "kv_a_proj_with_mqa")):
        fused = f"{attn.group(1)}.fused_q_kv_a_proj.weight"
        q_rows = config.num_attention_heads // parallel.tp.size * (config.raw["qk_nope_head_dim"] + config.raw["qk_rope_head_dim"])
        if attn.group(2) == "q_proj":
            return WeightTarget(fused, rows(0, q_rows), column_split(parallel.tp))
        return WeightTarget(fused, lambda t: t[q_rows:])
    if attn and attn.group(2) in ("q_proj", "q_b_proj", "kv_b_proj"):
        return WeightTarget(name, source=column_split(parallel.tp))
    if attn and attn.group(2) == "o_proj" and attn.group(3) == "weight":
        return WeightTarget(name, source=row_split(parallel.tp))
    return mlp_target(name, parallel, config.get("n_routed_experts", 0) or 0)


class DeepseekV3ForCausalLM(CausalLM):
    """Also runs deepseek_v2, kimi_k2, kimi_k25 (their text model), deepseek_v32 and glm_moe_dsa."""

    def __init__(self, config: ModelConfig, max_positions: int, parallel: Parallel = Parallel()) -> None:
        rotary = rotary_embedding(config, max_positions)
        layers = [decoder_layer(config, i, rotary, parallel) for i in range(config.num_hidden_layers)]
        share_indexers(layers)
        super().__init__(config, layers, parallel)

    def map_weight(self, name: str) -> WeightTarget | None:
        match = re.match(r"layers\.(\d+)\.", name)
        if match and int(match.group(1)) >= self.config.num_hidden_layers:
            return None  # MTP layers
        return map_layer_weight(name, self.config, self.parallel)
