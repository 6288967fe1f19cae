"""gpt-oss (OpenAI, 2025, "gpt-oss-120b & gpt-oss-20b Model Card"): GQA attention with q/k/v/o biases, a learned sink
logit per head in every softmax's denominator, sliding-window (128) and full layers alternating (`layer_types`), YaRN
RoPE; every layer an MoE whose router is a linear layer with a bias (top-k of its logits, softmax over those k) and
whose experts have biases and a clamped SwiGLU.

Checkpoint layout (transformers' GptOssForCausalLM): each layer's experts are stacked tensors, `gate_up_proj`
[E, H, 2I] (input-major, gate and up channels interleaved: gate i at column 2i, up i at 2i + 1) with
`gate_up_proj_bias` [E, 2I], `down_proj` [E, I, H] with `down_proj_bias` [E, H]. They are read transposed into the
engine's stacked w13 [E, 2I, H] / w2 [E, H, I] and the gate and up rows de-interleaved once loaded, so the experts run
in the shared (gate rows, then up rows) layout. The official checkpoints ship the experts in MXFP4 (`quant_method`
"mxfp4"): `gate_up_proj_blocks` [E, 2I, H/32, 16] / `_scales` [E, 2I, H/32] (rows = output channels, interleaved the
same way) and `down_proj_blocks` / `_scales`; those stay packed (`Experts` with `ExpertQuant("mxfp4")`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from reasoning_engine.cache_groups import CacheGroup, groups_by_window
from reasoning_engine.config import ModelConfig
from reasoning_engine.kernels.fused_moe import MoEQuant, fused_moe_op
from reasoning_engine.layers.attention import GQAttention
from reasoning_engine.layers.moe import ExpertQuant, Experts, Router, SparseMoE
from reasoning_engine.layers.rotary import RotaryEmbedding
from reasoning_engine.models.base import CausalLM, DecoderLayer, Split, WeightTarget, column_split, gqa_target
from reasoning_engine.models.quantization import expert_quant
from reasoning_engine.parallel import Group, Parallel
from reasoning_engine.quant_config import parse_quant_config


class BiasedExperts(Experts):
    """gpt-oss's experts: the shared stacked experts (plain, or MXFP4 kept packed and dequantized on the fly by the
    fused-MoE kernels) plus a bias per projection and the clamped SwiGLU. Under tensor parallelism each rank's down
    projection is a partial sum, so only rank 0 adds the down bias (expert parallelism: each rank adds its own
    experts' biases)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, swiglu_limit: float,
                 quant: ExpertQuant | None, parallel: Parallel = Parallel()) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, quant, parallel)
        local = len(self.expert_range)
        self.w13_bias = nn.Parameter(torch.empty(local, self.w13.shape[1]))
        self.w2_bias = nn.Parameter(torch.empty(local, hidden_size))
        self.swiglu_limit = swiglu_limit
        self.adds_down_bias = parallel.ep is not None or parallel.tp.rank == 0

    def process_weights_after_loading(self) -> None:
        """The checkpoint interleaves gate and up channels (rows of w13, of its scales and bias); the expert loop
        reads gate rows, then up rows."""
        params = [self.w13, self.w13_bias] + ([self.w13_scale] if self.quant is not None else [])
        for param in params:
            param.data.copy_(torch.cat([param.data[:, 0::2], param.data[:, 1::2]], dim=1))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        partial = len(self.expert_range) < self.num_experts
        if partial:
            ids = self.local_ids(ids)
        w2_bias = self.w2_bias if self.adds_down_bias else None
        if torch.compiler.is_compiling():  # compiled decode: the expert loop as one opaque op
            q = self.quant
            scales = (self.w13_scale, self.w2_scale) if q is not None else (None, None)
            return fused_moe_op(x, self.w13, self.w2, weights, ids, q.method if q else None, *scales,
                                q.group_size if q else 0, [0, 0], self.w13_bias, w2_bias, self.swiglu_limit)
        quant = None
        if self.quant is not None:
            quant = MoEQuant(self.quant.method, self.w13_scale, self.w2_scale, self.quant.group_size)
        return self.ops.fused_moe(x, self.w13, self.w2, weights, ids, quant, other_experts=partial,
                                  w13_bias=self.w13_bias, w2_bias=w2_bias, swiglu_limit=self.swiglu_limit)


def layer_window(config: ModelConfig, index: int) -> int | None:
    """The sliding window of layer `index`, None for a full-attention layer."""
    types = config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(config.num_hidden_layers)]
    return config.get("sliding_window") if types[index] == "sliding_attention" else None


class GptOssForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, max_positions: int, parallel: Parallel = Parallel()) -> None:
        rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                 config.max_position_embeddings, max_positions)
        raw = config.raw
        num_experts = raw["num_local_experts"]
        quant = parse_quant_config(raw)
        layers = []
        for i in range(config.num_hidden_layers):
            attn = GQAttention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                               config.head_dim, rotary, bias=bool(config.get("attention_bias", True)), tp=parallel.tp,
                               sinks=True, sliding_window=layer_window(config, i))
            router = Router(config.hidden_size, num_experts, raw["num_experts_per_tok"], "softmax",
                            norm_topk_prob=True, bias=True)  # softmax over the top-k logits, as renormalised top-k
            experts = BiasedExperts(num_experts, config.hidden_size, raw["intermediate_size"],
                                    float(config.get("swiglu_limit", 7.0)), expert_quant(quant, i), parallel)
            layers.append(DecoderLayer(attn, SparseMoE(router, experts, None, parallel), config.hidden_size,
                                       config.rms_norm_eps))
        super().__init__(config, layers, parallel)

    def cache_groups(self) -> list[CacheGroup]:
        """The full layers, then the sliding ones: the sliding layers give back blocks past their window."""
        return groups_by_window([attn.sliding_window for attn in self.attention_layers()])

    def map_weight(self, name: str) -> WeightTarget | None:
        c, tp, ep = self.config, self.parallel.tp, self.parallel.ep
        if re.fullmatch(r"layers\.\d+\.self_attn\.sinks", name):
            return WeightTarget(name, source=column_split(tp))
        match = re.fullmatch(r"(layers\.\d+\.mlp)\.router\.(weight|bias)", name)
        if match:
            return WeightTarget(f"{match.group(1)}.gate.{match.group(2)}")
        match = re.fullmatch(r"(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?", name)
        if match:
            return _expert_target(match.group(1), match.group(2) == "gate_up_proj", match.group(3) or "", tp, ep)
        return gqa_target(name, c.num_attention_heads, c.num_key_value_heads, c.head_dim, self.parallel)


def _expert_target(prefix: str, gate_up: bool, part: str, tp: Group, ep: Group | None) -> WeightTarget:
    """A stacked expert tensor (`part`: "" the weight, "_bias", or MXFP4's "_blocks" / "_scales") -> w13 / w2 or their
    bias / scale. Plain weights are read transposed ([E, in, out] -> [E, out, in]), MXFP4 blocks into the packed
    bytes of each row: views, so nothing is copied twice. Under expert parallelism this rank reads its experts
    (dim 0); under tensor parallelism its intermediate channels: the output rows of gate_up (an even share of the
    interleaved rows keeps whole gate/up pairs) and the input of down (whole groups of 32 for MXFP4)."""
    kind = {"": "", "_bias": "_bias", "_blocks": "", "_scales": "_scale"}[part]
    param = f"{prefix}.{'w13' if gate_up else 'w2'}{kind}"
    slicer = {"": lambda t: t.transpose(1, 2), "_blocks": lambda t: t.unflatten(-1, (-1, 16))}.get(part)
    if ep is not None:
        return WeightTarget(param, slicer, Split(0, ep))
    if tp.size == 1 or (part == "_bias" and not gate_up):
        return WeightTarget(param, slicer)
    if part == "":  # gate_up [E, H, 2I] on its channels, down [E, I, H] on I
        return WeightTarget(param, slicer, Split(2 if gate_up else 1, tp))
    return WeightTarget(param, slicer, Split(1 if gate_up else 2, tp))  # [E, 2I, ...] rows; down [E, H, I/32, ...]
