"""Tiny random checkpoints of every supported family and config variant, written by transformers' own model classes
(`save_pretrained` writes the real per-expert tensor names), float32, without tokenizer files (prompts are token ids).

Each variant is a few layers of width 64 (192 for block FP8, so blocks of 128 have partial edges) and builds in well
under a second. Configs are written either as transformers writes them (`rope_parameters`) or as the published
checkpoints do (`rope_theta` + `rope_scaling`, DeepSeek's `topk_method`/`scoring_func`, Qwen3-MoE's `num_experts`).
`TinyCheckpoint.reference()` loads the transformers model the engine must match: from the same files, or for quantized
checkpoints from a sibling folder holding exactly the dequantized weights.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .quant_writer import quantize_checkpoint
from .st_files import read_tensors, write_tensors

VOCAB = 256
PROMPT_LENGTHS = (4, 9, 16, 23)

_DEEPSEEK_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1,
    n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=512,
    num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1, initializer_range=0.2,
    rope_parameters=dict(rope_type="yarn", type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                         beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
)
_KIMI_ROPE = dict(rope_type="yarn", type="yarn", rope_theta=50000.0, factor=32.0, original_max_position_embeddings=16,
                  beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
_KIMI: dict[str, Any] = dict(n_group=1, topk_group=1, routed_scaling_factor=2.827, max_position_embeddings=512,
                            rope_parameters=_KIMI_ROPE)
_GQA_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, initializer_range=0.2,
)
_BASES: dict[str, dict[str, Any]] = {
    "deepseek_v3": _DEEPSEEK_BASE,
    # DeepSeek Sparse Attention with index_topk 8: prompts of 9 tokens and more already attend sparsely; 16 index
    # heads make an exact-zero score (every head's ReLU zero: a tie topk may order either way) rare
    "deepseek_v32": dict(_DEEPSEEK_BASE, index_topk=8, index_n_heads=16, index_head_dim=16),
    "glm_moe_dsa": dict(_DEEPSEEK_BASE, index_topk=8, index_n_heads=16, index_head_dim=16, n_group=1, topk_group=1,
                        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "deepseek_v2": dict(
        _DEEPSEEK_BASE, q_lora_rank=None, n_shared_experts=2, n_group=None, topk_group=None, topk_method="greedy",
        norm_topk_prob=False, routed_scaling_factor=1.0,
        rope_parameters=dict(_DEEPSEEK_BASE["rope_parameters"], mscale=0.707, mscale_all_dim=0.707),
    ),
    "qwen3": dict(_GQA_BASE, tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    "qwen3_moe": dict(_GQA_BASE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    "llama": dict(_GQA_BASE, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                                  high_freq_factor=4.0, original_max_position_embeddings=64)),
    # GLM-4.5-Air-like: q/k/v biases, no q/k norm, half the head's channels rotated, head_dim != hidden / heads
    "glm4_moe": dict(_GQA_BASE, head_dim=32, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                     num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                     norm_topk_prob=True, attention_bias=True, use_qk_norm=False, num_nextn_predict_layers=0,
                     rope_parameters=dict(rope_type="default", rope_theta=1000000.0, partial_rotary_factor=0.5)),
    # GLM-4.7-Flash: DeepSeek-V3's MLA with GLM's MoE; `mlp_layer_types` (first layer dense) as transformers writes it
    "glm4_moe_lite": dict(_DEEPSEEK_BASE, routed_scaling_factor=1.8, mlp_layer_types=["dense", "sparse", "sparse"],
                          rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
    # MiniMax-M2-like: q/k norms over all heads, half the head's channels rotated, sigmoid routing with a bias
    # gpt-oss-like: sinks, q/k/v/o biases, YaRN, sliding windows of 8 tokens (prompts and continuations cross them),
    # experts with biases and the clamped SwiGLU
    "gpt_oss": dict(_GQA_BASE, num_hidden_layers=4, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=8, rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0,
                                                           original_max_position_embeddings=128, beta_fast=32.0,
                                                           beta_slow=1.0, truncate=False)),
    "minimax_m2": dict(_GQA_BASE, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                       rope_parameters=dict(rope_type="default", rope_theta=5000000.0, partial_rotary_factor=0.5)),
    # hybrid: Gated DeltaNet layers (2 key heads, 4 value heads: each key head serves two) and one gated full-attention
    # layer in four, a quarter of each head rotated; Qwen3-Next fuses its projections, Qwen3.5 keeps them apart
    "qwen3_next": dict(_GQA_BASE, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32, norm_topk_prob=True,
                       rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
    # Kimi Linear: three KDA layers (4 heads of 16) then one NoPE MLA layer, a dense first layer, DeepSeek-V3's
    # group-limited sigmoid routing with a shared expert
    "kimi_linear": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4,
        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=512,
        layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] + ["sparse"] * 3,
        linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4, bos_token_id=0, eos_token_id=1,
        pad_token_id=None, initializer_range=0.2),
    # DeepSeek-V4: one layer of each attention kind (a second CSA layer), hash-routed then sqrtsoftplus MoE layers,
    # 4 hyper-connection streams; rates 4 and 16 and a window of 8 (the sliding group keeps 16 tokens), so the
    # prompts cross many row boundaries; YaRN on the compressed layers' rotary; 16 index heads make an exact-zero
    # index score (a tie) rare; a low swiglu_limit so the clamp bites
    "deepseek_v4": dict(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        head_dim=32, q_lora_rank=48, num_experts_per_tok=2, n_routed_experts=8, partial_rotary_factor=0.25,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}, hc_mult=4,
        sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=4,
        swiglu_limit=0.5, max_position_embeddings=512, initializer_range=0.2, bos_token_id=0, eos_token_id=1,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=32,
                             beta_slow=1)),
    # GLM-5.3-Flash: KDA layers (lower-bounded forget gate) around two NoPE DSA layers, the second sharing the first's
    # choice ("shared"); the indexer scores pools of 4 tokens and keeps 2 (plus the query's unfinished pool), so
    # prompts past 11 tokens attend sparsely; 16 index heads make an exact-zero index score (a tie) rare; 4
    # hyper-connection streams; group-limited routing; a low swiglu_limit so the clamp bites
    "glm5_next": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=0,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
        topk_group=2, layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        mlp_layer_types=["dense"] + ["sparse"] * 3, indexer_types=["full", "full", "shared", "full"], index_topk=8,
        index_kpool=4, index_n_heads=16, index_head_dim=16, linear_head_dim=16, linear_num_heads=4, hc_mult=4,
        swiglu_limit=0.5, max_position_embeddings=512, pad_token_id=None, bos_token_id=0, eos_token_id=1,
        initializer_range=0.2),
}
_BASES["qwen3_5_text"] = {k: v for k, v in _BASES["qwen3_next"].items()
                          if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                       "shared_expert_intermediate_size", "norm_topk_prob")}
_BASES["qwen3_5_moe_text"] = {k: v for k, v in _BASES["qwen3_next"].items()
                              if k not in ("intermediate_size", "norm_topk_prob")}
_QWEN_FP8: dict[str, Any] = dict(hidden_size=192, head_dim=48, linear_key_head_dim=48, linear_value_head_dim=48,
                                 moe_intermediate_size=160, shared_expert_intermediate_size=160, num_hidden_layers=2,
                                 layer_types=["linear_attention", "full_attention"])
# keys transformers adds that the published configs do not have
_NOT_PUBLISHED = ("qk_head_dim", "transformers_version", "output_router_logits", "pretraining_tp")


@dataclass(frozen=True)
class Variant:
    """One checkpoint shape: a family, config overrides and how the folder is laid out."""

    family: str
    overrides: dict[str, Any] = field(default_factory=dict)
    published: bool = True  # config.json as the published checkpoints write it, else as transformers 5 writes it
    layout: str = "plain"  # "plain", "kimi_k2" (model_type kimi_k2), "kimi_k25" (wrapper, language_model. prefix),
    # "qwen3_5" (Qwen3.5's image-text wrapper: text_config, model.language_model. prefix, a vision tower beside) or
    # "glm5_next" (GLM-5.3-Flash's, likewise)
    mtp: bool = False  # add the family's MTP layer: DeepSeek's at index num_hidden_layers, Qwen3-Next's under mtp.
    shards: int = 1
    quant: str | None = None  # "int4" (routed experts, compressed-tensors), "fp8" (block FP8), "fp8_channel" or "v4"


VARIANTS: dict[str, Variant] = {
    # q_lora_rank, yarn with mscale == mscale_all_dim, group-limited routing, first dense layer, norm_topk_prob
    "deepseek_v3": Variant("deepseek_v3"),
    # plain q_proj, rope_parameters form, mscale != mscale_all_dim (cos/sin scaled), no groups, no dense layer,
    # unnormalised top-k weights, routed_scaling_factor 1
    "deepseek_v3_plain_q": Variant("deepseek_v3", dict(
        q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=0, norm_topk_prob=False, routed_scaling_factor=1.0,
        rope_parameters=dict(_DEEPSEEK_BASE["rope_parameters"], mscale=0.9, mscale_all_dim=0.7)), published=False),
    "deepseek_v3_mtp": Variant("deepseek_v3", dict(num_nextn_predict_layers=1), mtp=True),
    "deepseek_v3_sharded": Variant("deepseek_v3", shards=4),
    # DeepSeek-V3.2 (neox-rotated index keys) as published; GLM-5 (interleaved) as transformers saves it, its middle
    # layer reusing the first layer's top-k ("shared")
    "deepseek_v32": Variant("deepseek_v32"),
    "glm_moe_dsa": Variant("glm_moe_dsa", dict(indexer_types=["full", "shared", "full"]), published=False),
    "deepseek_v32_mtp": Variant("deepseek_v32", dict(num_nextn_predict_layers=1), mtp=True),
    "kimi_k2": Variant("deepseek_v3", _KIMI, layout="kimi_k2"),
    "kimi_k25": Variant("deepseek_v3", _KIMI, layout="kimi_k25", shards=3),
    "qwen3": Variant("qwen3"),
    "qwen3_moe": Variant("qwen3_moe"),
    "llama": Variant("llama"),
    "deepseek_v2": Variant("deepseek_v2"),
    # config.json exactly as the installed transformers' save_pretrained writes it (5.x: rope_parameters, dtype,
    # Qwen3-MoE's num_local_experts); the variants above carry the hub's older spellings
    "qwen3_as_saved": Variant("qwen3", published=False),
    "qwen3_moe_as_saved": Variant("qwen3_moe", published=False),
    "llama_as_saved": Variant("llama", published=False),
    "deepseek_v2_as_saved": Variant("deepseek_v2", published=False),
    # quantized: every linear but router / embeddings / head in block FP8 with partial edge blocks (192 = 128 + 64)
    "deepseek_v3_fp8": Variant("deepseek_v3", dict(
        hidden_size=192, intermediate_size=320, moe_intermediate_size=160, num_hidden_layers=2, kv_lora_rank=64,
        q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32), quant="fp8", shards=2),
    # with an MTP layer, whose routed experts the speculative decoder also keeps packed
    "deepseek_v3_fp8_mtp": Variant("deepseek_v3", dict(
        hidden_size=192, intermediate_size=320, moe_intermediate_size=160, num_hidden_layers=2, kv_lora_rank=64,
        q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_nextn_predict_layers=1),
        quant="fp8", mtp=True),
    "kimi_k2_int4": Variant("deepseek_v3", _KIMI, layout="kimi_k2", quant="int4"),
    "kimi_k25_int4": Variant("deepseek_v3", _KIMI, layout="kimi_k25", quant="int4", shards=3),
    # GLM-4.5: hub config (rope_theta, top-level partial_rotary_factor); as transformers saves it (rope_parameters),
    # with q/k norm, a quarter of the channels rotated, group-limited routing, unnormalised weights, no biases
    "glm4_moe": Variant("glm4_moe"),
    "glm4_moe_as_saved": Variant("glm4_moe", dict(
        use_qk_norm=True, attention_bias=False, n_group=4, topk_group=2, norm_topk_prob=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)), published=False),
    "glm4_moe_mtp": Variant("glm4_moe", dict(num_nextn_predict_layers=1), mtp=True),
    # GLM-4.5-FP8's compressed-tensors per-channel FP8 (every linear but router / embeddings / head)
    "glm4_moe_fp8": Variant("glm4_moe", quant="fp8_channel", shards=2),
    "glm4_moe_fp8_mtp": Variant("glm4_moe", dict(num_nextn_predict_layers=1), quant="fp8_channel", mtp=True),
    # GLM-4.7-Flash as transformers saves it, and hub-style (first_k_dense_replace, rope_theta) with its MTP layer
    "glm4_moe_lite_as_saved": Variant("glm4_moe_lite", published=False),
    "glm4_moe_lite_mtp": Variant("glm4_moe_lite", dict(n_group=1, topk_group=1, num_nextn_predict_layers=1), mtp=True),
    # MiniMax-M2: hub config (rope_theta + rotary_dim and the official extra keys); as transformers saves it
    # (rope_parameters' partial_rotary_factor), with heads x head_dim != hidden_size, a quarter rotated, top-3
    "minimax_m2": Variant("minimax_m2"),
    # gpt-oss: hub config (rope_theta + rope_scaling, experts_per_token, initial_context_length); as transformers
    # saves it, with full layers first, a window of 5 and top-3 routing
    "gpt_oss": Variant("gpt_oss"),
    "gpt_oss_as_saved": Variant("gpt_oss", dict(
        num_hidden_layers=3, sliding_window=5, num_experts_per_tok=3,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"]), published=False),
    # the experts in MXFP4 as the official checkpoints ship them (the reference runs on the dequantized weights)
    "gpt_oss_mxfp4": Variant("gpt_oss", quant="mxfp4"),
    "minimax_m2_as_saved": Variant("minimax_m2", dict(
        head_dim=32, num_experts_per_tok=3,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)), published=False),
    # the official block FP8 (every linear but the router and LM head, MiniMax's quantization_config spelling) with
    # partial edge blocks: k/v projections 96 x 192, experts 160 x 192
    # hybrid linear-attention models as transformers saves them (the hub's Qwen3.5 configs wrap the text model)
    "qwen3_next": Variant("qwen3_next", published=False),
    "qwen3_5": Variant("qwen3_5_text", published=False, layout="qwen3_5"),
    "qwen3_5_moe_text": Variant("qwen3_5_moe_text", published=False),
    # with the multi-token-prediction layer the published checkpoints carry (random: a draft model, or skipped)
    "qwen3_next_mtp": Variant("qwen3_next", dict(num_nextn_predict_layers=1), published=False, mtp=True),
    "qwen3_5_mtp": Variant("qwen3_5_text", dict(mtp_num_hidden_layers=1), published=False, layout="qwen3_5", mtp=True),
    "kimi_linear": Variant("kimi_linear", published=False),
    # the hub's config.json: linear_attn_config (1-based layer lists), first_k_dense_replace, Kimi's MoE names
    "kimi_linear_published": Variant("kimi_linear", dict(mlp_layer_types=["dense"] * 2 + ["sparse"] * 2)),
    "minimax_m2_fp8": Variant("minimax_m2", dict(hidden_size=192, head_dim=48, intermediate_size=160, num_hidden_layers=2),
                              quant="fp8", shards=2),
    # the official Qwen3-Next / Qwen3.5-MoE FP8: block FP8 with bf16 scales, in_proj_ba (in_proj_a / in_proj_b), the
    # router, the shared-expert gate, conv1d and the vision tower unconverted, each listed in modules_to_not_convert;
    # partial edge blocks: k/v 96 x 192, in_proj_qkvz 576 x 192, in_proj_z 192 x 192, experts 160 x 192
    "qwen3_next_fp8": Variant("qwen3_next", _QWEN_FP8, published=False, quant="fp8", shards=2),
    "qwen3_5_moe_fp8": Variant("qwen3_5_moe_text", _QWEN_FP8, published=False, layout="qwen3_5", quant="fp8"),
    # DeepSeek-V4 as transformers' save_pretrained writes it (the official tensor names)
    "deepseek_v4": Variant("deepseek_v4", published=False),
    # and as released: block FP8 with e8m0 scales, FP4 routed experts (64 intermediate channels: whole groups of 32
    # per rank under TP 2), int32 tid2eid, its MTP layer quantized alike
    "deepseek_v4_fp4": Variant("deepseek_v4", dict(moe_intermediate_size=64), published=False, quant="v4", mtp=True),
    # and with its MTP layer (`mtp.0.*`, as released), which transformers does not load
    "deepseek_v4_mtp": Variant("deepseek_v4", published=False, mtp=True),
    # GLM-5.3-Flash's image-text checkpoint as save_pretrained writes it (official names, a one-block vision tower)
    "glm5_next": Variant("glm5_next", published=False, layout="glm5_next"),
}


@dataclass(frozen=True)
class TinyCheckpoint:
    """A built checkpoint folder and how to load the transformers model it must match."""

    name: str
    path: Path
    reference_path: Path
    layout: str
    vocab_size: int

    def reference(self) -> torch.nn.Module:
        """The transformers model (float32, eval) on the same weights, checked to have loaded every parameter."""
        from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

        if self.layout == "plain":
            model, info = AutoModelForCausalLM.from_pretrained(self.reference_path, dtype=torch.float32, output_loading_info=True)
        elif self.layout == "glm5_next":
            from transformers import Glm5NextForConditionalGeneration

            model, info = Glm5NextForConditionalGeneration.from_pretrained(self.reference_path, dtype=torch.float32,
                                                                           output_loading_info=True)
        elif self.layout == "qwen3_5":
            import transformers

            moe = json.loads((self.reference_path / "config.json").read_text())["model_type"] == "qwen3_5_moe"
            cls = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
            model, info = cls.from_pretrained(self.reference_path, dtype=torch.float32, output_loading_info=True)
        else:
            raw = json.loads((self.reference_path / "config.json").read_text())
            text = raw["text_config"] if self.layout == "kimi_k25" else raw
            text = {k: v for k, v in text.items() if k not in ("model_type", "auto_map", "quantization_config")}
            config = DeepseekV3Config.from_dict(text)
            mapping = {r"^language_model\.": ""} if self.layout == "kimi_k25" else None
            model, info = DeepseekV3ForCausalLM.from_pretrained(
                self.reference_path, config=config, dtype=torch.float32, key_mapping=mapping, output_loading_info=True
            )
        if info["missing_keys"] or info["mismatched_keys"]:
            raise AssertionError(f"reference for {self.name} did not load: {info}")
        return model.eval()


def prompts(vocab_size: int = VOCAB, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of different lengths (ids >= 2 so none is bos/eos)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def build_checkpoint(name: str, root: Path, seed: int = 0) -> TinyCheckpoint:
    """Write variant `name` under `root/name` (and `root/name-dense` for quantized ones)."""
    variant = VARIANTS[name]
    path = root / name
    if path.exists():
        shutil.rmtree(path)
    model = _random_model(variant, seed)
    model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    if variant.published:
        config = _published(config)
    tensors = read_tensors(path)
    if variant.mtp and variant.family.startswith("qwen3"):
        tensors.update(_qwen3_next_mtp_tensors(tensors, config.get("text_config", config), seed))
    elif variant.mtp and variant.family == "deepseek_v4":
        tensors.update(_deepseek_v4_mtp_tensors(variant, tensors, seed, root / f"{name}-mtp"))
    elif variant.mtp:
        tensors.update(_mtp_tensors(tensors, config, seed))
    if variant.layout in ("kimi_k2", "kimi_k25"):
        config["model_type"] = "kimi_k2"
        config["auto_map"] = {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        }
    if variant.layout == "kimi_k25":
        wrapper, vision = _kimi_k25_vision_part(config, seed, root / f"{name}-vision")
        tensors = {f"language_model.{k}": v for k, v in tensors.items()} | vision
        config = wrapper
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tensors(path, tensors, variant.shards)
    reference_path = path
    if variant.quant:
        dense = quantize_checkpoint(path, variant.quant, variant.shards)
        reference_path = root / f"{name}-dense"
        if reference_path.exists():
            shutil.rmtree(reference_path)
        reference_path.mkdir()
        (reference_path / "config.json").write_text(json.dumps(config, indent=2))
        write_tensors(reference_path, dense, variant.shards)
    return TinyCheckpoint(name, path, reference_path, variant.layout, VOCAB)


def _random_model(variant: Variant, seed: int) -> torch.nn.Module:
    """The transformers model with random weights, non-trivial norms and a non-zero routing bias."""
    import transformers

    config_cls, model_cls = {
        "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
        "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
        "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
        "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
        "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM"),
        "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM"),
        "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
        "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
        "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
        "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
        "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM"),
        "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM"),
        "glm5_next": ("Glm5NextTextConfig", "Glm5NextForConditionalGeneration"),
    }[variant.family]
    kwargs = {**_BASES[variant.family], **variant.overrides}
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**kwargs)
    if variant.layout == "qwen3_5":  # the image-text wrapper (dense or MoE) with a one-block vision tower
        wrapper = "Qwen3_5Moe" if variant.family == "qwen3_5_moe_text" else "Qwen3_5"
        config = getattr(transformers, f"{wrapper}Config")(text_config=config.to_dict(), vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=config.hidden_size))
        model_cls = f"{wrapper}ForConditionalGeneration"
    elif variant.layout == "glm5_next":  # a one-block vision tower beside the text model
        config = transformers.Glm5NextConfig(text_config=config.to_dict(), vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=config.hidden_size,
            projection_intermediate_size=32, patch_size=2))
    model = getattr(transformers, model_cls)(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif ".self_attn." in name and name.endswith(".bias"):  # transformers initialises biases to zero
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith(("self_attn.sinks", "mlp.router.bias", "experts.gate_up_proj_bias",
                                "experts.down_proj_bias",  # gpt-oss
                                "position_bias", "_hc.base", "hc_head.hc_base",  # DeepSeek-V4
                                "index_kpool_compress_ape", "index_kpool_compress_gate", "k_norm.bias",  # GLM-5.3
                                "forget_gate.A_log", "forget_gate.dt_bias")):
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            elif name.endswith(("_hc.scale", "hc_head.hc_scale")):  # DeepSeek-V4's hyper-connections
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))
            elif name.endswith("tid2eid"):  # DeepSeek-V4's hash routing: distinct experts per token
                experts = model.config.n_routed_experts
                buf.copy_(torch.stack([torch.randperm(experts, generator=gen)[: buf.shape[1]] for _ in range(buf.shape[0])]))
    return model


def _published(config: dict[str, Any]) -> dict[str, Any]:
    """config.json as the published checkpoints write it: rope_theta + rope_scaling, torch_dtype, family keys."""
    config = {k: v for k, v in config.items() if k not in _NOT_PUBLISHED}
    if config["model_type"] == "kimi_linear":
        return _published_kimi_linear(config)
    rope = dict(config.pop("rope_parameters") or {})
    if "partial_rotary_factor" in rope:  # GLM-4.5's hub config keeps it at the top level
        config["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    config["rope_theta"] = rope.pop("rope_theta", 10000.0)
    rope_type = rope.pop("rope_type", "default")
    if "type" not in rope and rope_type != "default":
        rope["rope_type"] = rope_type
    config["rope_scaling"] = rope or None
    config["torch_dtype"] = config.pop("dtype", "float32")
    if config["model_type"].startswith("deepseek"):
        del config["head_dim"]  # transformers' alias for qk_rope_head_dim
    if config["model_type"] == "deepseek_v3":
        config.update(topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1)
    elif config["model_type"] == "deepseek_v2":
        config.update(scoring_func="softmax", moe_layer_freq=1)
    elif config["model_type"] == "glm4_moe_lite":
        config["first_k_dense_replace"] = config.pop("mlp_layer_types").index("sparse")
    elif config["model_type"] == "qwen3_moe":
        config["num_experts"] = config.pop("num_local_experts")
    elif config["model_type"] == "gpt_oss":  # the official config's own keys beside transformers'
        config.update(experts_per_token=config["num_experts_per_tok"], initial_context_length=4096)
    elif config["model_type"] == "minimax_m2":  # the official config: rotary_dim, and MiniMax's own keys
        config["rotary_dim"] = int(config["head_dim"] * config.pop("partial_rotary_factor", 1.0))
        config.update(scoring_func="sigmoid", use_qk_norm=True, qk_norm_type="per_layer", use_routing_bias=True,
                      shared_intermediate_size=0, attn_type_list=[1] * config["num_hidden_layers"], use_mtp=False)
    return config


def _published_kimi_linear(config: dict[str, Any]) -> dict[str, Any]:
    """Kimi Linear's hub config.json: the layer kinds as 1-based lists in linear_attn_config, the dense layers as
    first_k_dense_replace, NoPE MLA flagged, torch_dtype (its MoE keys are already the hub's: num_experts, ...)."""
    kinds = config.pop("layer_types")
    config["linear_attn_config"] = dict(
        full_attn_layers=[i + 1 for i, kind in enumerate(kinds) if kind == "full_attention"],
        kda_layers=[i + 1 for i, kind in enumerate(kinds) if kind == "linear_attention"],
        head_dim=config.pop("linear_head_dim"), num_heads=config.pop("linear_num_heads"),
        short_conv_kernel_size=config.pop("linear_conv_kernel_dim"))
    config["first_k_dense_replace"] = config.pop("mlp_layer_types").index("sparse")
    del config["head_dim"]  # transformers' alias for qk_rope_head_dim
    config.update(mla_use_nope=True, moe_router_activation_func="sigmoid", torch_dtype=config.pop("dtype", "float32"))
    return config


def _mtp_tensors(tensors: dict[str, torch.Tensor], config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's multi-token-prediction layer at index num_hidden_layers: its own embedding, enorm/hnorm, eh_proj,
    shared_head and a full decoder block shaped like the last layer. Random: the engine must skip all of it."""
    last, mtp = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    gen = torch.Generator().manual_seed(seed + 2)
    shapes = {k.replace(f"model.layers.{last}.", f"model.layers.{mtp}."): v.shape
              for k, v in tensors.items() if k.startswith(f"model.layers.{last}.")}
    shapes.update({
        f"model.layers.{mtp}.embed_tokens.weight": (vocab, hidden),
        f"model.layers.{mtp}.enorm.weight": (hidden,),
        f"model.layers.{mtp}.hnorm.weight": (hidden,),
        f"model.layers.{mtp}.eh_proj.weight": (hidden, 2 * hidden),
        f"model.layers.{mtp}.shared_head.norm.weight": (hidden,),
        f"model.layers.{mtp}.shared_head.head.weight": (vocab, hidden),
    })
    return {k: 0.1 * torch.randn(s, generator=gen) for k, s in shapes.items()}


def _deepseek_v4_mtp_tensors(variant: Variant, tensors: dict[str, torch.Tensor], seed: int,
                             reference: Path) -> dict[str, torch.Tensor]:
    """DeepSeek-V4's MTP layer as released, `mtp.0.*`: a one-layer transformers model's block (sliding-window
    attention, sqrtsoftplus MoE), `hc_head_*` and `norm`, random like the variant, plus `enorm` / `hnorm` / `e_proj` /
    `h_proj`. That one-layer model is saved to `reference` with the target's LM head (`mtp.pt` beside it: the four
    input tensors), for tests to run the layer's block through transformers."""
    overrides = {**variant.overrides, "num_hidden_layers": 1, "layer_types": ["sliding_attention"],
                 "mlp_layer_types": ["moe"]}
    block = _random_model(Variant("deepseek_v4", overrides), seed + 2)
    head = next(v for k, v in tensors.items() if k.endswith("head.weight") and "embed" not in k and ".layers." not in k)
    with torch.no_grad():
        block.lm_head.weight.copy_(head)
    if reference.exists():
        shutil.rmtree(reference)
    block.save_pretrained(reference)
    hidden = block.config.hidden_size
    gen = torch.Generator().manual_seed(seed + 3)
    extra = {"enorm.weight": 1.0 + 0.2 * torch.randn(hidden, generator=gen),
             "hnorm.weight": 1.0 + 0.2 * torch.randn(hidden, generator=gen),
             "e_proj.weight": torch.randn(hidden, hidden, generator=gen) * hidden**-0.5,
             "h_proj.weight": torch.randn(hidden, hidden, generator=gen) * hidden**-0.5}
    torch.save(extra, reference / "mtp.pt")
    out = {f"mtp.0.{k}": v for k, v in extra.items()}
    for name, tensor in read_tensors(reference).items():
        name = name.removeprefix("model.")
        if name.startswith("layers.0."):
            out[f"mtp.0.{name.removeprefix('layers.0.')}"] = tensor
        elif name.startswith("hc_head.hc_"):
            out[f"mtp.0.hc_head_{name.removeprefix('hc_head.hc_')}"] = tensor
        elif name == "norm.weight":
            out["mtp.0.norm.weight"] = tensor
    return out


def _qwen3_next_mtp_tensors(tensors: dict[str, torch.Tensor], config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Qwen3-Next's / Qwen3.5's multi-token-prediction layer, top-level `mtp.` as the published checkpoints store it
    (names as vLLM's qwen3_next_mtp.py loads them): `fc` (2h -> h), the zero-centred `pre_fc_norm_embedding`,
    `pre_fc_norm_hidden` and `norm`, and `layers.0` shaped like the model's last full-attention layer; no embedding
    or LM head of its own. Random."""
    last = max(i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention")
    prefix = next(p for p in ("model.language_model.", "model.") if f"{p}layers.{last}.input_layernorm.weight" in tensors)
    hidden = config["hidden_size"]
    gen = torch.Generator().manual_seed(seed + 2)
    shapes = {k.replace(f"{prefix}layers.{last}.", "mtp.layers.0."): v.shape
              for k, v in tensors.items() if k.startswith(f"{prefix}layers.{last}.")}
    shapes.update({"mtp.fc.weight": (hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": (hidden,),
                   "mtp.pre_fc_norm_hidden.weight": (hidden,), "mtp.norm.weight": (hidden,)})
    return {k: 0.2 * torch.randn(s, generator=gen) for k, s in shapes.items()}


def _kimi_k25_vision_part(text: dict[str, Any], seed: int, scratch: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Kimi K2.5's multimodal config.json and its vision tower + projector tensors, as transformers'
    `Kimi_K25ForConditionalGeneration.save_pretrained` writes them for a tiny vision config (patches of 2 pixels, one
    block of width 16), with the variant's text config (as published, under text_config) in place of its own."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=2,
                  pos_emb_height=4, pos_emb_width=4, pos_emb_time=4, merge_kernel_size=[2, 2])
    text_config = {k: v for k, v in text.items() if k not in ("auto_map", "architectures", "torch_dtype")}
    text_config["model_type"] = "deepseek_v3"
    torch.manual_seed(seed + 3)
    config = Kimi_K25Config(text_config=text_config, vision_config=vision, projection_hidden_size=16,
                            tie_word_embeddings=False)
    Kimi_K25ForConditionalGeneration(config).float().save_pretrained(scratch)
    outer = json.loads((scratch / "config.json").read_text())
    outer["text_config"] = {**text, "architectures": ["DeepseekV3ForCausalLM"]}
    outer["torch_dtype"] = "float32"
    tensors = {k: v for k, v in read_tensors(scratch).items() if "language_model" not in k}
    shutil.rmtree(scratch)
    return outer, tensors