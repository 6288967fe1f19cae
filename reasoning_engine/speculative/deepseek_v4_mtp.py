"""DeepSeek-V4's multi-token-prediction (MTP) layer as a draft model.

The release stores one MTP layer (config `num_nextn_predict_layers`) at the top level under `mtp.0.`: a full V4 block
(sliding-window attention with its sinks, the sqrtsoftplus MoE with a correction bias, the two hyper-connection
mixings: `attn.*`, `ffn.*`, `attn_norm`, `ffn_norm`, `hc_attn_*`, `hc_ffn_*`), the input norms `enorm` / `hnorm`, the
projections `e_proj` / `h_proj`, and its own stream fold `hc_head_*` and final `norm`; it reads the target's embedding
and LM head. For position t, with S_t the target's last-layer residual streams [hc_mult, hidden] (before its own
`hc_head`), as DeepSeek's inference code runs the layer:

    X_t = e_proj(enorm(embed(x_{t+1}))) + h_proj(hnorm(S_t))   (the first term added to every stream)
    S'_t = block(X_t),   logits = lm_head(norm(hc_head(S'_t))) -> x_{t+2}

Chained drafts feed S'_t back in place of the target's streams. The block's window cache mirrors the target's
group-0 blocks (engine/worker.py `DraftRunner`: the compressed rows' pool, which keeps every block of a running
request), one K=V row per token; its attention reads only the last `sliding_window` of them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.config import EngineConfig, ModelConfig
from reasoning_engine.kernels.compressed_attention import prepare_compressed
from reasoning_engine.layers.compressed_attention import SLIDING
from reasoning_engine.layers.hyper_connection import HyperHead
from reasoning_engine.layers.norm import RMSNorm
from reasoning_engine.models.base import CausalLM, WeightTarget, materialize
from reasoning_engine.models.deepseek_v4 import FINAL_STREAMS, DeepseekV4Layer, canonical_name, rope_tables
from reasoning_engine.models.weights import checkpoint_files
from reasoning_engine.speculative.qwen3_next_mtp import TargetTables, load_prefixed_layer

PREFIX = "mtp.0."
_BLOCK_PARTS = ("attn.", "ffn.", "attn_norm.", "ffn_norm.", "hc_attn_", "hc_ffn_")


def parameter_name(stored: str) -> str:
    """A tensor of the MTP layer (name under `mtp.0.`) as this module names it: the block's under `layers.0.`
    (the target's names), the rest as the target names its own (`hc_head_fn` -> `hc_head.hc_fn`)."""
    if stored.startswith(_BLOCK_PARTS):
        return canonical_name(f"layers.0.{stored}")
    return canonical_name(stored)


class DeepseekV4MTPDraftModel(nn.Module):
    """The checkpoint's MTP layer as a `DraftModel` (speculative/decoder.py); it reads the target's final streams."""

    aux_layers: tuple[int, ...] = (FINAL_STREAMS,)

    def __init__(self, config: ModelConfig, target: CausalLM, tables: TargetTables) -> None:
        super().__init__()
        raw, hidden, eps = config.raw, config.hidden_size, config.rms_norm_eps
        self.hc_mult, self.sliding_window = raw["hc_mult"], raw["sliding_window"]
        # a sliding layer's rotary table (`rope_theta`), as long as the target's
        rotary = {"main": rope_tables(config, "main", target.layers[0].self_attn.rotary.cos.shape[0])}
        self.layers = nn.ModuleList([DeepseekV4Layer(config, config.num_hidden_layers, rotary, target.parallel,
                                                     kinds=(SLIDING, "moe"))])
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.e_proj = nn.Linear(hidden, hidden, bias=False)
        self.h_proj = nn.Linear(hidden, hidden, bias=False)
        self.hc_head = HyperHead(hidden, self.hc_mult, raw["hc_eps"], eps)
        self.norm = RMSNorm(hidden, eps)
        self.tables = tables

    @property
    def feature_width(self) -> int:
        """Channels of the features a chained pass carries: every stream."""
        return self.hc_mult * self.e_proj.weight.shape[0]

    def attention_layers(self) -> list[nn.Module]:
        return [self.layers[0].self_attn.window]

    def target_features(self, hidden: torch.Tensor, aux_hidden: Mapping[int, torch.Tensor]) -> torch.Tensor:
        return aux_hidden[FINAL_STREAMS]

    def forward(self, batch: ForwardBatch, features: torch.Tensor,
                input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        streams = features.view(features.shape[0], self.hc_mult, -1)
        x = self.e_proj(self.enorm(self.tables.embed(input_ids))).unsqueeze(1) + self.h_proj(self.hnorm(streams))
        window = self.layers[0].self_attn.window
        meta = prepare_compressed(batch, window.cache_group, None, self.sliding_window, [], window.caches[0].shape[1])
        streams = self.layers[0](batch.positions, x, batch, meta)
        return self.norm(self.hc_head(streams)), streams.flatten(1)

    def greedy(self, head_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tables.greedy(head_input)


def load_deepseek_v4_mtp(target: CausalLM, engine_config: EngineConfig) -> DeepseekV4MTPDraftModel:
    """The MTP layer of the target's checkpoint, on the target's device and dtype, sharing its rotary table,
    embedding and LM head; quantized as the release stores it (FP8 linears dequantized, FP4 experts kept packed)."""
    config = engine_config.model
    if not any(name.startswith(PREFIX) for name in checkpoint_files(config.path)):
        raise ValueError(f"speculative_config.method 'mtp' needs the multi-token-prediction layer in the checkpoint "
                         f"(tensors under {PREFIX!r}); {config.path} has none")
    ratios = config.raw.get("compress_ratios") or []
    if len(ratios) > config.num_hidden_layers and ratios[config.num_hidden_layers]:
        raise ValueError(f"deepseek_v4: an MTP layer with compressed attention (compress_ratios[-1] = "
                         f"{ratios[config.num_hidden_layers]}) is not supported; its sliding-window form is")
    if target.cache_groups()[0].kind != "full":
        raise ValueError("deepseek_v4: the MTP draft mirrors the compressed rows' blocks; this model has none")
    tables = TargetTables(target.embed_tokens, target.compute_logits)
    with torch.device("meta"):
        model = DeepseekV4MTPDraftModel(config, target, tables)
    model = materialize(model, engine_config.dtype, engine_config.device)

    def map_weight(stored: str) -> WeightTarget | None:
        name = parameter_name(stored)
        return target.map_weight(name) if name.startswith("layers.") else WeightTarget(name)

    return load_prefixed_layer(model, PREFIX, map_weight, engine_config)
