"""Qwen3-Next, Qwen3.5 and Qwen3.6 (text): hybrid stacks of Gated DeltaNet linear-attention layers
(layers/linear_attention.py, three of every four) and gated full-attention layers, with zero-centred RMSNorms.

The full-attention layers are GQA whose query projection also yields a per-channel output gate (sigmoid(gate) times
the attention output, before o_proj), with per-head q/k norms and rotary on the first quarter of each head. MLPs are
dense (Qwen3.5) or MoE with softmax top-k routing and one shared expert scaled by a sigmoid gate (Qwen3-Next,
Qwen3.5-MoE). Qwen3-Next's linear layers fuse their input projections per key head (in_proj_qkvz, in_proj_ba);
Qwen3.5's keep them apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.config import ModelConfig
from reasoning_engine.layers.attention import GQAttention
from reasoning_engine.layers.linear_attention import GatedDeltaNet
from reasoning_engine.layers.moe import Experts, GatedMLP, Router, SparseMoE
from reasoning_engine.layers.norm import OffsetRMSNorm
from reasoning_engine.layers.rotary import RotaryEmbedding
from reasoning_engine.models.base import (CausalLM, DecoderLayer, Split, WeightTarget, column_split, mlp_target,
                                          row_split, rows)
from reasoning_engine.models.quantization import expert_quant
from reasoning_engine.parallel import Parallel
from reasoning_engine.quant_config import parse_quant_config


class GatedAttention(GQAttention):
    """GQA whose q projection gives each head its query and an output gate: out = o_proj(attn * sigmoid(gate))."""

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * h * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, gate = qg.view(t, h, 2 * d).split([d, d], dim=-1)
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.reshape(t, self.num_kv_heads, d))
        q, k = self.rotary(positions, q, k)
        v = v.reshape(t, self.num_kv_heads, d)
        self.ops.write_kv_cache(self.k_cache, k, batch.slot_mapping)
        self.ops.write_kv_cache(self.v_cache, v, batch.slot_mapping)
        out = self.ops.paged_attention(q, self.k_cache, self.v_cache, batch, batch.attn_metadata, self.scale)
        return self.o_proj((out * torch.sigmoid(gate)).reshape(t, -1))


class GatedSharedExpert(nn.Module):
    """The MoE's shared expert, scaled per token by sigmoid(shared_expert_gate(x)); a partial sum under tensor
    parallelism, like the routed experts', which the MoE block reduces."""

    def __init__(self, hidden_size: int, intermediate_size: int, parallel: Parallel) -> None:
        super().__init__()
        self.mlp = GatedMLP(hidden_size, intermediate_size, tp=parallel.tp, reduce=False)
        self.gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * self.mlp(x)


def _mlp(config: ModelConfig, index: int, parallel: Parallel) -> nn.Module:
    num_experts = config.get("num_experts", 0) or 0
    step = config.get("decoder_sparse_step", 1) or 1
    if not num_experts or index in (config.get("mlp_only_layers") or []) or (index + 1) % step:
        return GatedMLP(config.hidden_size, config.raw["intermediate_size"], tp=parallel.tp)
    router = Router(config.hidden_size, num_experts, config.raw["num_experts_per_tok"], "softmax",
                    norm_topk_prob=bool(config.get("norm_topk_prob", True)))
    experts = Experts(num_experts, config.hidden_size, config.raw["moe_intermediate_size"],
                      expert_quant(parse_quant_config(config.raw), index), parallel)
    shared_size = config.get("shared_expert_intermediate_size", 0) or 0
    shared = GatedSharedExpert(config.hidden_size, shared_size, parallel) if shared_size else None
    return SparseMoE(router, experts, shared, parallel)


def _decoder_layer(config: ModelConfig, mixer: nn.Module, index: int, parallel: Parallel) -> DecoderLayer:
    layer = DecoderLayer(mixer, _mlp(config, index, parallel), config.hidden_size, config.rms_norm_eps)
    layer.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
    layer.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
    return layer


def full_attention_layer(config: ModelConfig, index: int, rotary: RotaryEmbedding, parallel: Parallel) -> DecoderLayer:
    """A gated full-attention layer with the MLP of layer `index` (also the block of the MTP layer, speculative/
    qwen3_next_mtp.py)."""
    eps, bias = config.rms_norm_eps, bool(config.get("attention_bias", False))
    attn = GatedAttention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                          rotary, bias=bias, qk_norm_eps=eps, tp=parallel.tp)
    attn.q_norm, attn.k_norm = OffsetRMSNorm(config.head_dim, eps), OffsetRMSNorm(config.head_dim, eps)
    attn.qkv_proj = nn.Linear(config.hidden_size, (2 * attn.num_heads + 2 * attn.num_kv_heads) * config.head_dim,
                              bias=bias)
    return _decoder_layer(config, attn, index, parallel)


def rotary_dim(config: ModelConfig) -> int:
    rope = config.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor") or config.get("partial_rotary_factor", 0.25)
    return int(config.head_dim * factor)


class Qwen3NextForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, max_positions: int, parallel: Parallel = Parallel()) -> None:
        tp = parallel.tp
        rotary = RotaryEmbedding(rotary_dim(config), config.rope_theta, config.rope_scaling,
                                 config.max_position_embeddings, max_positions)
        eps = config.rms_norm_eps
        fused = config.model_type == "qwen3_next"  # Qwen3.5 keeps its projections apart
        layers = []
        for i, kind in enumerate(config.raw["layer_types"]):
            if kind == "linear_attention":
                mixer = GatedDeltaNet(config.hidden_size, config.raw["linear_num_key_heads"],
                                      config.raw["linear_num_value_heads"], config.raw["linear_key_head_dim"],
                                      config.raw["linear_value_head_dim"], config.raw["linear_conv_kernel_dim"], eps,
                                      fused_projections=fused, tp=tp)
                layers.append(_decoder_layer(config, mixer, i, parallel))
            else:
                layers.append(full_attention_layer(config, i, rotary, parallel))
        super().__init__(config, layers, parallel)
        self.norm = OffsetRMSNorm(config.hidden_size, eps)

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.layers if isinstance(layer.self_attn, GQAttention)]

    def linear_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.layers if isinstance(layer.self_attn, GatedDeltaNet)]

    def map_weight(self, name: str) -> WeightTarget | None:
        return map_layer_weight(name, self.config, self.parallel)


def map_layer_weight(name: str, config: ModelConfig, parallel: Parallel) -> WeightTarget | None:
    """A tensor of the text model (name without `model.`) -> its parameter and this rank's part of it; also maps
    the MTP layer's block."""
    c, tp = config, parallel.tp
    name = name.replace(".linear_attn.", ".self_attn.")
    name = re.sub(r"\.mlp\.shared_expert\.", ".mlp.shared_experts.mlp.", name)
    name = name.replace(".mlp.shared_expert_gate.", ".mlp.shared_experts.gate.")
    match = re.fullmatch(r"(layers\.\d+\.self_attn)\.([qkv])_proj\.(weight|bias)", name)
    if match:  # q_proj holds each head's query and gate
        h, kv, d = c.num_attention_heads // tp.size, c.num_key_value_heads // tp.size, c.head_dim
        start, size = {"q": (0, 2 * h * d), "k": (2 * h * d, kv * d), "v": (2 * h * d + kv * d, kv * d)}[match.group(2)]
        return WeightTarget(f"{match.group(1)}.qkv_proj.{match.group(3)}", rows(start, start + size), column_split(tp))
    if re.fullmatch(r"layers\.\d+\.self_attn\.(o_proj|out_proj)\.weight", name):
        return WeightTarget(name, source=row_split(tp))
    if re.fullmatch(r"layers\.\d+\.self_attn\.(in_proj_qkv|conv1d)\.weight", name):
        # q, k and v blocks (Qwen3.5's projection; both families' conv channels): this rank's heads of each
        key = c.raw["linear_num_key_heads"] * c.raw["linear_key_head_dim"]
        value = c.raw["linear_num_value_heads"] * c.raw["linear_value_head_dim"]
        return WeightTarget(name, source=Split(0, tp, blocks=(key, key, value)) if tp.size > 1 else None)
    if re.fullmatch(r"layers\.\d+\.self_attn\.(in_proj_qkvz|in_proj_ba|in_proj_z|in_proj_b|in_proj_a|A_log|dt_bias)"
                    r"(\.weight)?", name):  # rows grouped per key head (fused) or per value head: contiguous shares
        return WeightTarget(name, source=column_split(tp))
    if ".mlp.shared_experts.mlp." in name:
        inner = name.replace(".mlp.shared_experts.mlp.", ".mlp.shared_experts.")
        target = mlp_target(inner, parallel)
        return WeightTarget(target.param.replace(".mlp.shared_experts.", ".mlp.shared_experts.mlp."),
                            target.slicer, target.source)
    return mlp_target(name, parallel, c.get("num_experts", 0) or 0)
