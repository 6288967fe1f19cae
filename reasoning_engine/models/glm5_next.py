"""GLM-5.3-Flash (`glm5_next`; Z.ai, 2026), its text model: a hybrid stack of Kimi Delta Attention layers
(`linear_attention`, layers/linear_attention.py `KimiDeltaAttention` with the lower-bounded "safe" forget gate) and
NoPE MLA layers with DeepSeek Sparse Attention (`indexed_attention`), around which `hc_mult` residual streams are
mixed by manifold-constrained hyper-connections (layers/hyper_connection.py), folded by their plain mean before the
final norm; DeepSeek-V3's MoE (sigmoid scores, correction bias, group-limited choice, a shared expert) after dense
first layers, every SwiGLU clamped at `swiglu_limit`.

The sparse attention's indexer scores pools of `index_kpool` tokens, not tokens (layers/indexer.py
`PooledIndexer`): a query keeps the `index_topk / index_kpool` best pools that end at or before it and always its own
unfinished pool. A layer whose `indexer_types` entry is "shared" has no indexer and attends to the positions the
layer right before it chose (transformers passes the choice only from one layer to the next).

Cache layout, and why: the KDA layers' states live in the linear-attention slots (engine/state_cache.py), as Kimi
Linear's; each MLA layer keeps its latent per token and its indexer's key and gate logits per token and one pooled
key per pool, all in the one full KV cache group's blocks. A pooled key is written when its last token is computed,
so the tokens of an unfinished pool are just cached tokens (chunked prefill, prefix hits at any block boundary and
preemption need nothing more). Draft trees are cut to their first path (engine.py): pools are addressed by position.
The image-text checkpoints' vision tower is models/glm5_vision.py; its rows replace the `<|image|>` embeddings (no
position encoding anywhere in the text model, so nothing else changes).

Checkpoint names: the official ones (`self_attn.q_conv1d`, `self_attn.f_a_proj`, `self_attn.A_log` [H],
`hc_attn_fn`, per-expert `experts.E.gate_proj`, ...; transformers' save_pretrained writes them) and transformers'
module names (`forget_gate.`, `attn_hc.fn`, one `conv1d`); the text model under `model.language_model.` (with a
vision tower beside it) or `model.` (text-only configs); the MTP layer (index num_hidden_layers) is skipped.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.config import ModelConfig
from reasoning_engine.kernels.compressed_attention import row_addressing
from reasoning_engine.layers.attention import MLAttention
from reasoning_engine.layers.indexer import PooledIndexer
from reasoning_engine.layers.linear_attention import KimiDeltaAttention
from reasoning_engine.layers.moe import Experts, GatedMLP
from reasoning_engine.models.base import CausalLM, HyperDecoderLayer, WeightTarget
from reasoning_engine.models.deepseek_v3 import map_layer_weight, mlp_block
from reasoning_engine.models.kimi_linear import NoPosition, kda_target
from reasoning_engine.parallel import Parallel

LINEAR, INDEXED = "linear_attention", "indexed_attention"


def _attention(config: ModelConfig, index: int, parallel: Parallel) -> nn.Module:
    raw, eps, hidden = config.raw, config.rms_norm_eps, config.hidden_size
    kind = raw["layer_types"][index]
    if kind == LINEAR:
        return KimiDeltaAttention(hidden, raw["linear_num_heads"], raw["linear_head_dim"],
                                  raw["linear_conv_kernel_dim"], eps, parallel.tp,
                                  gate_lower_bound=raw.get("linear_lower_bound"))
    if kind != INDEXED:
        raise ValueError(f"glm5_next: layer_types entries must be {LINEAR!r} or {INDEXED!r}, got {kind!r}")
    indexer = None
    if raw["indexer_types"][index] != "shared":
        indexer = PooledIndexer(hidden, raw["q_lora_rank"], raw["index_n_heads"], raw["index_head_dim"],
                                raw["index_topk"], raw["index_kpool"])
    nope, rope = raw["qk_nope_head_dim"], raw.get("qk_rope_head_dim") or 0
    return MLAttention(hidden, config.num_attention_heads, raw["q_lora_rank"], raw["kv_lora_rank"], nope, rope,
                       raw["v_head_dim"], NoPosition(), eps, (nope + rope) ** -0.5,
                       bias=bool(raw.get("attention_bias", False)), tp=parallel.tp, indexer=indexer)


def _mlp(config: ModelConfig, index: int, parallel: Parallel) -> nn.Module:
    """DeepSeek-V3's dense MLP or MoE with every SwiGLU (dense, routed and shared experts) clamped."""
    block = mlp_block(config, index, parallel)
    for module in block.modules():
        if isinstance(module, (GatedMLP, Experts)):
            module.silu_limit = config.raw.get("swiglu_limit")
    return block


def _check(raw: dict) -> None:
    """What transformers' model would fail on at run time, refused at load, naming the field."""
    if not raw.get("index_kpool_always_select_tail", True):
        raise ValueError("glm5_next: index_kpool_always_select_tail false (queries that see no finished pool attend "
                         "to nothing) is not supported")
    kinds, modes = raw["layer_types"], raw["indexer_types"]
    for i, kind in enumerate(kinds):
        if kind == INDEXED and modes[i] == "shared" and (i == 0 or kinds[i - 1] != INDEXED or modes[i - 1] != "full"):
            raise ValueError(f"glm5_next: indexer_types[{i}] is 'shared', but layer {i - 1} is not an "
                             f"{INDEXED} layer with its own indexer ('full') to share the choice of")


class Glm5NextForCausalLM(CausalLM):
    draft_trees = False  # pools are addressed by position: drafts verify as chains
    eager_only = True  # no CUDA graphs or compiled decode: the step's pool addressing is built on the host

    def __init__(self, config: ModelConfig, max_positions: int, parallel: Parallel = Parallel()) -> None:
        raw = config.raw
        _check(raw)
        layers = [HyperDecoderLayer(_attention(config, i, parallel), _mlp(config, i, parallel), config.hidden_size,
                                    config.rms_norm_eps, raw["hc_mult"], raw["hc_sinkhorn_iters"], raw["hc_eps"])
                  for i in range(config.num_hidden_layers)]
        for previous, layer in zip(layers, layers[1:]):
            attn = layer.self_attn
            if isinstance(attn, MLAttention) and attn.indexer is None:
                attn.shared_indexer = (previous.self_attn.indexer,)
        super().__init__(config, layers, parallel)
        self.hc_mult = raw["hc_mult"]
        self.indexers = [attn.indexer for attn in self.attention_layers() if attn.indexer is not None]

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.layers if isinstance(layer.self_attn, MLAttention)]

    def linear_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.layers if isinstance(layer.self_attn, KimiDeltaAttention)]

    def forward(self, batch: ForwardBatch, aux_hidden: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        if self.indexers:  # the step's pools, once for every indexer
            first = self.indexers[0]
            pools = row_addressing(batch, 0, 0, first.pool, 0, first.token_caches.caches[0].shape[1])
            for indexer in self.indexers:
                indexer.addressing = pools
        streams = self.embed(batch).unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for index, layer in enumerate(self.layers):
            streams = layer(batch.positions, streams, batch)
            if aux_hidden is not None and index in aux_hidden:
                aux_hidden[index] = streams.mean(dim=1)
        return self.norm(streams.mean(dim=1))

    def map_weight(self, name: str) -> WeightTarget | None:
        match = re.match(r"layers\.(\d+)\.", name)
        if match and int(match.group(1)) >= self.config.num_hidden_layers:
            return None  # the MTP layer
        name = re.sub(r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2", name).replace(".forget_gate.", ".")
        match = re.fullmatch(r"(layers\.(\d+)\.self_attn)\.(\w+?)(\.weight)?", name)
        if match and self.config.raw["layer_types"][int(match.group(2))] == LINEAR:
            return kda_target(match.group(1), match.group(3), name, self.config, self.parallel.tp, a_log_4d=False)
        return map_layer_weight(name, self.config, self.parallel)
