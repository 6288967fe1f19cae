"""DeepSeek-style multi-token prediction (MTP) layers as a draft model.

DeepSeek-V3 (DeepSeek-AI, 2024, arXiv:2412.19437, §2.2) trains MTP modules beside the main model and ships them in the
checkpoint as layers `model.layers.{num_hidden_layers + i}` (config `num_nextn_predict_layers`), each with its own
copy of the embedding (`embed_tokens`), `enorm` / `hnorm`, the projection `eh_proj`, a full decoder block (MLA
attention and the MoE, with their layer norms) and an output head (`shared_head.norm`, `shared_head.head`, a copy
of the LM head). For position t, with h_t the main model's final-normed hidden state (what the LM head reads, as the
bundled tiny model trains it: tiny/model.py `TinyDeepseekV3.forward(with_mtp=True)`):

    z_t = eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)]),   z'_t = block(z_t),   logits = head(norm(z'_t)) -> x_{t+2}

The block attends causally over the MTP's own positions, so it has its own latent cache, filled by the model runner
for every position the target keeps (`DraftModel` in decoder.py). Drafts longer than one token reuse the first MTP
layer autoregressively: its output z'_t stands in for the target's hidden state at t + 1 and its argmax for x_{t+2}.
Drafts are greedy, hence point masses, so verification stays exact.

GLM-4.5 / 4.6 / 4.7 ship the same module (`num_nextn_predict_layers`, same tensor names) around a block of their own
stack (GQA attention and the MoE); `_FAMILY_LAYERS` names each family's block builder and tensor mapping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.config import EngineConfig, ModelConfig
from reasoning_engine.layers import use_kernel_backend
from reasoning_engine.layers.linear import can_pack, lm_head, pack_linears, vocab_embedding
from reasoning_engine.layers.norm import RMSNorm
from reasoning_engine.layers.rotary import RotaryEmbedding
from reasoning_engine.models.base import (
    CausalLM,
    DecoderLayer,
    WeightTarget,
    load_parameters,
    materialize,
    packed_targets,
    vocab_target,
)
from reasoning_engine.models import deepseek_v3, glm4_moe
from reasoning_engine.quant_config import parse_quant_config
from reasoning_engine.models.weights import LazyTensor, checkpoint_files, iter_checkpoint_tensors
from reasoning_engine.parallel import Parallel

# family -> (decoder block of layer `index`, checkpoint tensor -> parameter mapping) of the target's stack
_FAMILY_LAYERS: dict[str, tuple[Callable[..., DecoderLayer], Callable[..., WeightTarget | None]]] = {
    "deepseek_v3": (deepseek_v3.decoder_layer, deepseek_v3.map_layer_weight),
    "deepseek_v2": (deepseek_v3.decoder_layer, deepseek_v3.map_layer_weight),
    "deepseek_v32": (deepseek_v3.decoder_layer, deepseek_v3.map_layer_weight),  # its MTP layer has an indexer too
    "glm_moe_dsa": (deepseek_v3.decoder_layer, deepseek_v3.map_layer_weight),
    "glm4_moe": (glm4_moe.decoder_layer, glm4_moe.map_layer_weight),
}


class SharedHead(nn.Module):
    """The MTP module's output norm and its copy of the LM head (split like the target's under tensor parallelism)."""

    def __init__(self, hidden_size: int, vocab_size: int, eps: float, parallel: Parallel) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = lm_head(hidden_size, vocab_size, parallel.tp)


class MTPLayer(DecoderLayer):
    """A decoder block of the main stack (same attention and MLP for its index, split the same way over the ranks)
    plus the MTP inputs and head."""

    def __init__(self, config: ModelConfig, index: int, rotary: RotaryEmbedding, parallel: Parallel) -> None:
        block = _FAMILY_LAYERS[config.family][0](config, index, rotary, parallel)
        super().__init__(block.self_attn, block.mlp, config.hidden_size, config.rms_norm_eps)
        hidden, vocab, eps = config.hidden_size, config.vocab_size, config.rms_norm_eps
        self.embed_tokens = vocab_embedding(vocab, hidden, parallel.tp)
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(hidden, vocab, eps, parallel)


class MTPDraftModel(nn.Module):
    """The checkpoint's first MTP layer as a `DraftModel`; it reads the target's final hidden state."""

    aux_layers: tuple[int, ...] = ()

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, parallel: Parallel = Parallel()) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MTPLayer(config, config.num_hidden_layers, rotary, parallel)])

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.layers]

    def target_features(self, hidden: torch.Tensor, aux_hidden: Mapping[int, torch.Tensor]) -> torch.Tensor:
        return hidden

    def forward(self, batch: ForwardBatch, features: torch.Tensor,
                input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[0]
        z = layer.eh_proj(torch.cat([layer.enorm(layer.embed_tokens(input_ids)), layer.hnorm(features)], dim=-1))
        z = layer(batch.positions, z, batch)
        return layer.shared_head.norm(z), z

    def greedy(self, head_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.layers[0].shared_head.head(head_input).float()
        top, tokens = logits.max(dim=-1)
        return tokens, (top - logits.logsumexp(dim=-1)).exp()


def _mtp_weights(config: ModelConfig, prefix: str, dtype: torch.dtype,
                 packed: Callable[[str], bool]) -> Iterator[tuple[str, LazyTensor]]:
    """The first MTP layer's tensors only (the per-tensor reader skips the rest of the checkpoint), renamed to
    `layers.0.*` so the main model's fused-layout mapping applies; `packed` says which stay quantized (by new name)."""
    quant = parse_quant_config(config.raw)
    for name, tensor in iter_checkpoint_tensors(config.path, quant, dtype, prefix_strip=prefix, progress=False,
                                                keep_packed=lambda n: packed(f"layers.0.{n}")):
        yield f"layers.0.{name}", tensor


def load_mtp(target: CausalLM, engine_config: EngineConfig) -> MTPDraftModel:
    """The first MTP layer of the target's checkpoint, on the target's device and dtype, sharing its rotary table."""
    config = engine_config.model
    layer_prefix = f"{config.weight_prefix}model.layers.{config.num_hidden_layers}."
    has_layers = config.family in _FAMILY_LAYERS and (config.get("num_nextn_predict_layers", 0) or 0) >= 1
    if not has_layers or not any(n.startswith(layer_prefix) for n in checkpoint_files(config.path)):
        raise ValueError(f"speculative_config.method 'mtp' needs multi-token-prediction layers in the checkpoint "
                         f"(num_nextn_predict_layers >= 1 and tensors under {layer_prefix!r}); {config.path} has none")
    rotary = target.layers[0].self_attn.rotary
    with torch.device("meta"):
        model = MTPDraftModel(config, rotary, target.parallel)
    model = materialize(model, engine_config.dtype, engine_config.device)
    tables = ("layers.0.embed_tokens.weight", "layers.0.shared_head.head.weight")

    def map_weight(name: str) -> WeightTarget | None:
        if name in tables:
            return vocab_target(name, config.vocab_size, target.parallel.tp)
        return _FAMILY_LAYERS[config.family][1](name, config, target.parallel)

    weights = _mtp_weights(config, layer_prefix, engine_config.dtype, packed_targets(model, map_weight))
    load_parameters(model, weights, map_weight, config.path)
    if can_pack(engine_config.dtype, engine_config.device):
        pack_linears(model)
    use_kernel_backend(model, engine_config.kernel_backend)
    return model.eval()
