"""GLM-4.5 / 4.6 / 4.7 configuration as the engine reads it (parity with transformers is in test_parity.py): the
rotated share of each head from any spelling of `partial_rotary_factor` (transformers' default 0.5 when absent), the
MTP layer count under both names, q/k/v biases without an output bias, and GLM-4.7-Flash (glm4_moe_lite) as
DeepSeek-V3's MLA with its own dense / MoE layer pattern."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from reasoning_engine.cache_groups import cache_bytes
from reasoning_engine.config import load_model_config
from reasoning_engine.models.glm4_moe import Glm4MoeForCausalLM, rotary_dim
from reasoning_engine.models.registry import FAMILIES

# GLM-4.5-Air's config.json fields (sizes shrunk)
HUB = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True, "head_dim": 32,
       "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 8,
       "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "norm_topk_prob": True,
       "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "num_attention_heads": 4,
       "num_key_value_heads": 2, "num_hidden_layers": 2, "num_nextn_predict_layers": 1, "rope_theta": 1000000,
       "rope_scaling": None, "partial_rotary_factor": 0.5, "use_qk_norm": False, "vocab_size": 256,
       "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "eos_token_id": [1, 2]}


def _config(tmp_path: Path, name: str, raw: dict[str, Any]) -> Any:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    return load_model_config(folder)


@pytest.mark.parametrize("rope, rotated", [
    ({"partial_rotary_factor": 0.5}, 16),  # the hub's top-level field
    ({}, 16),  # absent: transformers' default for glm4_moe
    ({"rope_theta": None, "partial_rotary_factor": None,  # as transformers 5 writes it
      "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}}, 8),
])
def test_partial_rotary_from_any_spelling(tmp_path: Path, rope: dict[str, Any], rotated: int) -> None:
    raw = {k: v for k, v in HUB.items() if k != "partial_rotary_factor"}
    for key, value in rope.items():  # None: the field is left out
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    config = _config(tmp_path, "glm", raw)
    assert rotary_dim(config) == rotated and config.rope_theta == 1e6 and config.rope_scaling is None
    assert config.raw["num_nextn_predict_layers"] == config.raw["num_mtp_layers"] == 1
    assert config.eos_token_ids == [1, 2]


def test_qkv_biases_without_an_output_bias_and_dense_first_layers(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = Glm4MoeForCausalLM(_config(tmp_path, "glm", HUB), max_positions=64)
    attn = model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    assert attn.q_norm is None and attn.rotary.cos.shape == (64, 8)  # 16 of 32 channels rotated: 8 angles
    assert type(model.layers[0].mlp).__name__ == "GatedMLP" and type(model.layers[1].mlp).__name__ == "SparseMoE"
    router = model.layers[1].mlp.gate
    assert router.scoring == "sigmoid" and router.e_score_correction_bias is not None
    assert model.map_weight("layers.2.eh_proj.weight") is None  # the MTP layer is the draft's, not the model's


def test_glm4_moe_lite_runs_as_deepseek_v3_with_its_layer_pattern(tmp_path: Path) -> None:
    lite = {"model_type": "glm4_moe_lite", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "kv_lora_rank": 32, "q_lora_rank": 48,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "rope_theta": 1e6}
    config = _config(tmp_path, "lite", lite)
    assert config.family == "deepseek_v3" and config.is_mla
    assert config.raw["mlp_layer_types"] == ["dense", "sparse", "sparse"]  # Glm4MoeLiteConfig's default
    with torch.device("meta"):
        model = FAMILIES[config.family](config, 64)
    assert cache_bytes(model.attention_layers(), torch.bfloat16) == (32 + 8) * 2 * 3  # latent and rope key per layer
