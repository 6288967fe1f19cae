"""Qwen3-Next's and Qwen3.5's / Qwen3.6's multi-token-prediction (MTP) layer as a draft model.

The published checkpoints (Qwen3-Next-80B-A3B, Qwen3.5, Qwen3.6: config `num_nextn_predict_layers` or
`mtp_num_hidden_layers`) store one MTP layer beside the text model, at the top level under `mtp.`: `fc` (2h -> h),
`pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `layers.0` (a gated full-attention decoder layer of the model's own
kind, with its MoE or dense MLP) and `norm`; it has no embedding or LM head of its own and reads the target's. Every
norm is zero-centred (x * (1 + w)), as the model's. For position t, with h_t the target's final-normed hidden state:

    z_t = fc([pre_fc_norm_embedding(embed(x_{t+1})); pre_fc_norm_hidden(h_t)]),   z'_t = norm(layer(z_t)),
    logits = lm_head(z'_t) -> x_{t+2}

(the layout and the order of the concatenation as vLLM's `qwen3_next_mtp.py` / `qwen3_5_mtp.py` read these
checkpoints). Drafts longer than one token reuse the layer autoregressively with z'_t standing in for the target's
hidden state, as those implementations chain it. The layer is full attention, so its K/V lives in a paged cache that
mirrors the target's full-attention blocks (engine/worker.py `DraftRunner`); the linear-attention layers stay the
target's alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.config import EngineConfig, ModelConfig
from reasoning_engine.layers import use_kernel_backend
from reasoning_engine.layers.attention import GQAttention
from reasoning_engine.layers.linear import can_pack, pack_linears
from reasoning_engine.layers.norm import OffsetRMSNorm
from reasoning_engine.layers.rotary import RotaryEmbedding
from reasoning_engine.models.base import CausalLM, WeightTarget, load_parameters, materialize, packed_targets
from reasoning_engine.models.qwen3_next import full_attention_layer, map_layer_weight
from reasoning_engine.quant_config import parse_quant_config
from reasoning_engine.models.weights import checkpoint_files, iter_checkpoint_tensors
from reasoning_engine.parallel import Parallel

PREFIX = "mtp."


@dataclass(frozen=True)
class TargetTables:
    """The target's embedding and logits, which the MTP layer reads but does not own (plain references, not
    submodules: they are loaded, packed and counted with the target)."""

    embed: Callable[[torch.Tensor], torch.Tensor]
    logits: Callable[[torch.Tensor], torch.Tensor]

    def greedy(self, head_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The argmax token of each row and the draft's probability of it."""
        logits = self.logits(head_input).float()
        top, tokens = logits.max(dim=-1)
        return tokens, (top - logits.logsumexp(dim=-1)).exp()


class Qwen3NextMTPDraftModel(nn.Module):
    """The checkpoint's MTP layer as a `DraftModel` (speculative/decoder.py); it reads the target's final hidden state."""

    aux_layers: tuple[int, ...] = ()

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, tables: TargetTables,
                 parallel: Parallel = Parallel()) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = OffsetRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(hidden, eps)
        self.layers = nn.ModuleList([full_attention_layer(config, config.num_hidden_layers, rotary, parallel)])
        self.norm = OffsetRMSNorm(hidden, eps)
        self.tables = tables

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.layers]

    def target_features(self, hidden: torch.Tensor, aux_hidden: Mapping[int, torch.Tensor]) -> torch.Tensor:
        return hidden

    def forward(self, batch: ForwardBatch, features: torch.Tensor,
                input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embedded = self.pre_fc_norm_embedding(self.tables.embed(input_ids))
        z = self.fc(torch.cat([embedded, self.pre_fc_norm_hidden(features)], dim=-1))
        z = self.norm(self.layers[0](batch.positions, z, batch))
        return z, z

    def greedy(self, head_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tables.greedy(head_input)


def has_mtp_layer(config: ModelConfig) -> bool:
    return any(name.startswith(PREFIX) for name in checkpoint_files(config.path))


def load_qwen3_next_mtp(target: CausalLM, engine_config: EngineConfig) -> Qwen3NextMTPDraftModel:
    """The MTP layer of the target's checkpoint, on the target's device and dtype, sharing its rotary table,
    embedding and LM head."""
    config = engine_config.model
    if not has_mtp_layer(config):
        raise ValueError(f"speculative_config.method 'mtp' needs the multi-token-prediction layer in the checkpoint "
                         f"(tensors under {PREFIX!r}); {config.path} has none")
    rotary = next(layer for layer in target.attention_layers() if isinstance(layer, GQAttention)).rotary
    tables = TargetTables(target.embed_tokens, target.compute_logits)
    with torch.device("meta"):
        model = Qwen3NextMTPDraftModel(config, rotary, tables, target.parallel)
    model = materialize(model, engine_config.dtype, engine_config.device)

    def map_weight(name: str) -> WeightTarget | None:
        if CausalLM.ignored.search(name):
            return None
        return map_layer_weight(name, config, target.parallel) if name.startswith("layers.") else WeightTarget(name)

    return load_prefixed_layer(model, PREFIX, map_weight, engine_config)


def load_prefixed_layer(model: nn.Module, prefix: str, map_weight: Callable[[str], WeightTarget | None],
                        engine_config: EngineConfig) -> nn.Module:
    """Fill a materialized draft model from the checkpoint tensors under `prefix` (names without it, through
    `map_weight`; routed experts kept packed where the model keeps them so), then pack its linears and pick its
    kernels as the target's (the MTP layers stored at the top level: Qwen3-Next's, DeepSeek-V4's)."""
    config = engine_config.model
    weights = iter_checkpoint_tensors(config.path, parse_quant_config(config.raw), engine_config.dtype,
                                      prefix_strip=prefix, progress=False,
                                      keep_packed=packed_targets(model, map_weight))
    load_parameters(model, weights, map_weight, config.path)
    if can_pack(engine_config.dtype, engine_config.device):
        pack_linears(model)
    use_kernel_backend(model, engine_config.kernel_backend)
    return model.eval()
