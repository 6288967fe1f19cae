"""DeepSeek-V4 (`deepseek_v4`; DeepSeek-AI, 2026, "DeepSeek-V4"): V4-Flash, V4-Pro.

- Attention (layers/compressed_attention.py): every layer a sliding window over one shared K=V latent row per token
  with a sink per head; `compressed_sparse_attention` layers add rows compressed 4:1 picked per query by a lightning
  indexer, `heavily_compressed_attention` layers rows compressed 128:1 attended densely; the grouped low-rank output
  projection. Sliding-only layers rotate with `rope_theta`, compressed layers (their window included) with
  `compress_rope_theta` (YaRN in the published configs).
- Residual: `hc_mult` streams mixed around every block by manifold-constrained hyper-connections
  (layers/hyper_connection.py), folded by `hc_head` before the final norm.
- MoE: `hash_moe` layers route by the frozen table tid2eid[token id] (the step's input ids reach them through the
  batch, draft tokens included), `moe` layers by sqrtsoftplus scores with a correction bias; routed and shared
  experts use the clamped SwiGLU (`swiglu_limit`).

Cache layout, and why: two KV cache groups, each in its own block pool (cache_groups.py), so a block costs what its
group holds.
- The sliding group (window max(sliding_window, 2 x CSA rate, HCA rate); pool 1) holds per token each layer's latent
  row and its compressors' kv and gate projections. A compressed row is made from its tokens' projections when its
  last token is computed, so the tail of an unfinished window is never separate state: it is in the cache like any
  token, and chunked prefill, prefix hits (at any block boundary: the group keeps what the next rows read),
  preemption and draft chains need nothing beyond what the engine does for every sliding group. Its pool is sized
  for the running sequences' windows (worker.py), whatever the context length.
- The full group (pool 0) holds the compressed rows (and the indexer's keys): row w in the block of its last token,
  so a block of the prefix cache carries exactly the rows its tokens closed, and a block holds max(1, block_size /
  rate) rows of each compressed layer (a block costs block_size / rate rows, not block_size tokens of every layer:
  the context's bytes per token are those of the rows alone).
Weights as released (models/quantization.py): block FP8 linears (e8m0 scales under `X.scale`) dequantized at load,
FP4 routed experts kept packed as MXFP4 codes and scales, the compressors' and indexer's bf16 projections as stored,
the int32 tid2eid table widened to int64.

The MTP layer (`mtp.0.*`) drafts through speculative/deepseek_v4_mtp.py, reading the last layer's streams
(`FINAL_STREAMS`). Limits: draft trees are cut to their first path (positions address the windows and rows, and a
tree's nodes share positions).

Checkpoint names: the official ones (`layers.N.attn.wq_a`, `ffn.experts.E.w1`, `hc_attn_fn`, `embed`, `head`, ...,
which transformers' save_pretrained also writes) and transformers' module names are both read.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.cache_groups import CacheGroup
from reasoning_engine.config import ModelConfig
from reasoning_engine.kernels.compressed_attention import prepare_compressed
from reasoning_engine.layers.compressed_attention import CSA, HCA, SLIDING, DeepseekV4Attention
from reasoning_engine.layers.hyper_connection import HyperHead
from reasoning_engine.layers.moe import Experts, GatedMLP, HashRouter, Router, SparseMoE
from reasoning_engine.layers.rotary import RotaryEmbedding
from reasoning_engine.models.base import (
    CausalLM,
    HyperDecoderLayer,
    Split,
    WeightTarget,
    column_split,
    mlp_target,
    row_split,
)
from reasoning_engine.models.quantization import expert_quant
from reasoning_engine.parallel import Parallel
from reasoning_engine.quant_config import parse_quant_config

# official checkpoint names -> this module's, applied in order (after the "model." prefix is dropped)
_RENAMES = [
    (r"^embed\.weight$", "embed_tokens.weight"), (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"), (r"\.wq_a\.", ".q_a_proj."), (r"\.q_norm\.", ".q_a_norm."), (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."), (r"\.ape$", ".position_bias"), (r"\.norm\.", ".kv_norm."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.(experts\.\d+|shared_experts)\.w1\.", r".\1.gate_proj."), (r"\.(experts\.\d+|shared_experts)\.w2\.", r".\1.down_proj."),
    (r"\.(experts\.\d+|shared_experts)\.w3\.", r".\1.up_proj."),
    # transformers' module names
    (r"\.compressor\.indexer\.scorer\.", ".indexer."), (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.q_b_proj."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."),
]


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name (official or transformers', without `model.`) as this module names it."""
    for pattern, repl in _RENAMES:
        name = re.sub(pattern, repl, name)
    return name


def rope_tables(config: ModelConfig, which: str, max_positions: int) -> RotaryEmbedding:
    """The "main" (sliding-only layers) or "compress" (compressed layers and their compressors) rotary table."""
    raw = config.raw
    params = (raw.get("rope_parameters") or {}).get(which) or {}
    theta = params.get("rope_theta", raw.get("rope_theta" if which == "main" else "compress_rope_theta", 10000.0))
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return RotaryEmbedding(rope_dim(config), float(theta), scaling, config.max_position_embeddings, max_positions,
                           interleaved=True)


def rope_dim(config: ModelConfig) -> int:
    factor = config.raw.get("partial_rotary_factor") or 64 / 512
    return int(config.head_dim * factor)


def sliding_group_window(config: ModelConfig) -> int:
    """How far back the sliding group keeps tokens: the attention window, and what a compressor reads (a CSA row the
    previous window's tokens too)."""
    raw, kinds = config.raw, set(config.raw["layer_types"])
    window = raw["sliding_window"]
    if CSA in kinds:
        window = max(window, 2 * raw["compress_rates"][CSA])
    if HCA in kinds:
        window = max(window, raw["compress_rates"][HCA])
    return window


def _mlp(config: ModelConfig, index: int, parallel: Parallel, kind: str) -> SparseMoE:
    raw = config.raw
    num_experts, top_k, hidden = raw["n_routed_experts"], raw["num_experts_per_tok"], config.hidden_size
    scaling = float(raw.get("routed_scaling_factor", 1.0))
    if raw.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise ValueError(f"deepseek_v4: scoring_func must be 'sqrtsoftplus', got {raw.get('scoring_func')!r}")
    if kind == "hash_moe":
        router: nn.Module = HashRouter(hidden, num_experts, top_k, config.vocab_size, scaling)
    else:
        router = Router(hidden, num_experts, top_k, "sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=scaling,
                        correction_bias=True)
    limit = raw.get("swiglu_limit")
    experts = Experts(num_experts, hidden, raw["moe_intermediate_size"],
                      expert_quant(parse_quant_config(raw), index), parallel)
    experts.silu_limit = limit
    shared = None
    if raw.get("n_shared_experts", 1):
        shared = GatedMLP(hidden, raw["moe_intermediate_size"] * raw.get("n_shared_experts", 1), tp=parallel.tp,
                          reduce=False, silu_limit=limit)
    return SparseMoE(router, experts, shared, parallel)


class DeepseekV4Layer(HyperDecoderLayer):
    """attention then MoE, each between the hyper-connection mixings of the residual streams; the attention also
    takes the step's compressed-row addressing."""

    def __init__(self, config: ModelConfig, index: int, tables: dict[str, RotaryEmbedding], parallel: Parallel,
                 kinds: tuple[str, str] | None = None) -> None:
        """`kinds`: (attention, MLP) kind, else layer `index`'s in the config (the MTP layer past the stack has
        none there)."""
        raw, eps, hidden = config.raw, config.rms_norm_eps, config.hidden_size
        kind, mlp_kind = kinds or (raw["layer_types"][index], raw["mlp_layer_types"][index])
        rate = raw["compress_rates"].get(kind) if kind != SLIDING else None
        index_shape = (raw["index_n_heads"], raw["index_head_dim"], raw["index_topk"]) if kind == CSA else None
        attn = DeepseekV4Attention(
            kind, hidden, config.num_attention_heads, config.head_dim, raw["q_lora_rank"], raw["o_groups"],
            raw["o_lora_rank"], tables["main" if kind == SLIDING else "compress"], eps, rate, index_shape, parallel.tp)
        super().__init__(attn, _mlp(config, index, parallel, mlp_kind), hidden, eps, raw["hc_mult"],
                         raw["hc_sinkhorn_iters"], raw["hc_eps"])


FINAL_STREAMS = -1  # `aux_hidden` key of the last layer's unfolded streams


class DeepseekV4ForCausalLM(CausalLM):
    draft_trees = False  # its windows and rows are addressed by position: drafts verify as chains
    eager_only = True  # no CUDA graphs or compiled decode: the step's addressing is built on the host

    def __init__(self, config: ModelConfig, max_positions: int, parallel: Parallel = Parallel()) -> None:
        raw = config.raw
        tables = {which: rope_tables(config, which, max_positions) for which in ("main", "compress")}
        layers = [DeepseekV4Layer(config, i, tables, parallel) for i in range(config.num_hidden_layers)]
        super().__init__(config, layers, parallel)
        self.hc_mult = raw["hc_mult"]
        self.hc_head = HyperHead(config.hidden_size, raw["hc_mult"], raw["hc_eps"], config.rms_norm_eps)
        self.sliding_window = raw["sliding_window"]
        self.rate_keys = sorted({layer.self_attn.rate_key for layer in layers if layer.self_attn.rate_key})

    def attention_layers(self) -> list[nn.Module]:
        """Each layer's per-token caches (the sliding group), then each compressed layer's row caches (the full
        group)."""
        attns = [layer.self_attn for layer in self.layers]
        return [a.window for a in attns] + [a.rows for a in attns if a.rows is not None]

    def cache_groups(self) -> list[CacheGroup]:
        n = len(self.layers)
        compressed = sum(layer.self_attn.rows is not None for layer in self.layers)
        if not compressed:
            return [CacheGroup("sliding", tuple(range(n)), sliding_group_window(self.config))]
        return [CacheGroup("full", tuple(range(n, n + compressed))),
                CacheGroup("sliding", tuple(range(n)), sliding_group_window(self.config), pool=1)]

    def forward(self, batch: ForwardBatch, aux_hidden: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        """`aux_hidden`: layer index -> that layer's output folded by `hc_head`; key FINAL_STREAMS -> the last layer's
        streams as they are, [T, hc_mult * hidden] (what the MTP layer reads)."""
        x = self.embed_tokens(batch.input_ids)
        first = self.layers[0].self_attn
        rows = next((layer.self_attn.rows for layer in self.layers if layer.self_attn.rows is not None), None)
        meta = prepare_compressed(batch, first.window.cache_group, None if rows is None else rows.cache_group,
                                  self.sliding_window, self.rate_keys, first.window.caches[0].shape[1])
        streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for index, layer in enumerate(self.layers):
            streams = layer(batch.positions, streams, batch, meta)
            if aux_hidden is not None and index in aux_hidden:
                aux_hidden[index] = self.hc_head(streams)
        if aux_hidden is not None and FINAL_STREAMS in aux_hidden:
            aux_hidden[FINAL_STREAMS] = streams.flatten(1)
        return self.norm(self.hc_head(streams))

    def _map_checkpoint_name(self, name: str) -> WeightTarget | None:
        name = name[len("model."):] if name.startswith("model.") else name
        if name.startswith("mtp."):
            return None  # the multi-token-prediction layer: a draft model
        return super()._map_checkpoint_name(canonical_name(name))

    def map_weight(self, name: str) -> WeightTarget | None:
        tp = self.parallel.tp
        match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if match and int(match.group(1)) >= self.config.num_hidden_layers:
            return None  # MTP layers stored as extra layers
        if re.fullmatch(r"layers\.\d+\.self_attn\.(q_b_proj\.weight|sinks)", name):
            return WeightTarget(name, source=column_split(tp))  # this rank's heads
        if re.fullmatch(r"layers\.\d+\.self_attn\.o_a_proj\.weight", name):
            return WeightTarget(name, source=column_split(tp))  # this rank's groups (their heads' inputs)
        if re.fullmatch(r"layers\.\d+\.self_attn\.o_b_proj\.weight", name):
            return WeightTarget(name, source=row_split(tp))
        match = re.fullmatch(r"(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)", name)
        if match:  # transformers' stacked experts [E, 2I, H] / [E, H, I]: already the engine's layout
            return self._stacked_expert(match.group(1), match.group(2))
        return mlp_target(name, self.parallel, self.config.raw["n_routed_experts"])

    def _stacked_expert(self, prefix: str, which: str) -> WeightTarget:
        ep, tp = self.parallel.ep, self.parallel.tp
        param = f"{prefix}.{'w13' if which == 'gate_up_proj' else 'w2'}"
        if ep is not None:
            return WeightTarget(param, source=Split(0, ep))
        if tp.size == 1:
            return WeightTarget(param)
        if which == "down_proj":
            return WeightTarget(param, source=Split(2, tp))
        inter = self.config.raw["moe_intermediate_size"]
        return WeightTarget(param, source=Split(1, tp, blocks=(inter, inter)))  # each rank's gate and up rows
