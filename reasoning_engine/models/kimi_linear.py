"""Kimi Linear (`kimi_linear`; Kimi Team 2025, arXiv:2510.26692): a hybrid stack of Kimi Delta Attention layers
(layers/linear_attention.py `KimiDeltaAttention`, three of every four) and MLA full-attention layers, with
DeepSeek-V3's MoE (sigmoid scores, correction bias, group-limited choice, shared experts) after dense first layers.

The MLA layers use no position encoding (NoPE): the rotary part of each head (`qk_rope_head_dim`) is kept, shared by
the heads as in DeepSeek's MLA, but never rotated; the softmax scale is qk_head_dim ** -0.5.

Checkpoints (the hub's, and transformers' save_pretrained, which writes the same names) keep the KDA layer's
q/k/v projections and their convs apart (`q_conv1d` ...; fused here), the forget-gate tensors `f_a_proj`, `f_b_proj`,
`A_log` [1, 1, H, 1], `dt_bias` on the layer, and name every MLP `block_sparse_moe` with experts' `w1`/`w3`/`w2`
(gate/up/down).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from reasoning_engine.config import ModelConfig
from reasoning_engine.layers.attention import MLAttention
from reasoning_engine.layers.linear_attention import KimiDeltaAttention
from reasoning_engine.models.base import CausalLM, DecoderLayer, Split, WeightTarget, column_split, row_split, rows
from reasoning_engine.models.deepseek_v3 import map_layer_weight, mlp_block
from reasoning_engine.parallel import Group, Parallel


_EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


class NoPosition(nn.Module):
    """MLA's rotary hook for NoPE layers: q and k pass unchanged."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class KimiLinearForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, max_positions: int, parallel: Parallel = Parallel()) -> None:
        raw, eps, tp = config.raw, config.rms_norm_eps, parallel.tp
        linear = raw.get("linear_attn_config") or {}
        if raw.get("mla_use_nope") is False or linear.get("gate_lower_bound") is not None or linear.get("use_full_rank_gate"):
            raise ValueError("kimi_linear: rotary MLA layers (mla_use_nope false) and KDA's gate_lower_bound / "
                             "use_full_rank_gate are not supported")
        layers = []
        for i, kind in enumerate(raw["layer_types"]):
            if kind == "linear_attention":
                mixer: nn.Module = KimiDeltaAttention(config.hidden_size, raw["linear_num_heads"], raw["linear_head_dim"],
                                                      raw["linear_conv_kernel_dim"], eps, tp)
            else:
                nope, rope = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"]
                mixer = MLAttention(config.hidden_size, config.num_attention_heads, raw.get("q_lora_rank"),
                                    raw["kv_lora_rank"], nope, rope, raw["v_head_dim"], NoPosition(), eps,
                                    (nope + rope) ** -0.5, bias=bool(raw.get("attention_bias", False)), tp=tp)
            layers.append(DecoderLayer(mixer, mlp_block(config, i, parallel), config.hidden_size, eps))
        super().__init__(config, layers, parallel)

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.layers if isinstance(layer.self_attn, MLAttention)]

    def linear_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.layers if isinstance(layer.self_attn, KimiDeltaAttention)]

    def map_weight(self, name: str) -> WeightTarget | None:
        name = name.replace(".block_sparse_moe.", ".mlp.").replace(".self_attn.forget_gate.", ".self_attn.")
        name = re.sub(r"\.experts\.(\d+)\.(w[123])\.", lambda m: f".experts.{m.group(1)}.{_EXPERT_PROJ[m.group(2)]}.", name)
        match = re.fullmatch(r"(layers\.(\d+)\.self_attn)\.(\w+?)(\.weight)?", name)
        if match and self.config.raw["layer_types"][int(match.group(2))] == "linear_attention":
            return kda_target(match.group(1), match.group(3), name, self.config, self.parallel.tp)
        return map_layer_weight(name, self.config, self.parallel)


def kda_target(prefix: str, part: str, name: str, config: ModelConfig, tp: Group,
               a_log_4d: bool = True) -> WeightTarget:
    """A KDA layer's tensor (`part` of the layer at `prefix`): q/k/v projections and convs into the fused qkv_proj /
    conv1d rows; A_log (stored [1, 1, H, 1] by Kimi Linear, [H] with `a_log_4d` False) into [H]. Under tensor
    parallelism each rank reads its heads' rows of everything per head, and o_proj's columns. Also GLM-5.3-Flash's."""
    width = config.raw["linear_num_heads"] * config.raw["linear_head_dim"] // tp.size
    fused = re.fullmatch(r"([qkv])_(proj|conv1d)", part)
    if fused:
        start = "qkv".index(fused.group(1)) * width
        param = "qkv_proj" if fused.group(2) == "proj" else "conv1d"
        return WeightTarget(f"{prefix}.{param}.weight", rows(start, start + width), column_split(tp))
    if part == "conv1d":  # one conv over q, k and v (transformers' module layout): each rank's heads of each
        return WeightTarget(f"{prefix}.conv1d.weight", source=Split(0, tp, blocks=(width * tp.size,) * 3)
                            if tp.size > 1 else None)
    if part == "A_log" and a_log_4d:
        return WeightTarget(name, lambda t: t.view(1, 1, -1, 1), Split(2, tp) if tp.size > 1 else None)
    if part in ("f_b_proj", "g_b_proj", "b_proj", "dt_bias", "A_log"):
        return WeightTarget(name, source=column_split(tp))
    if part == "o_proj":
        return WeightTarget(name, source=row_split(tp))
    return WeightTarget(name)  # f_a_proj, g_a_proj, o_norm: whole on every rank
