"""Loading through the offline API fails with errors that name the problem."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from .checkpoints import TinyCheckpoint
from .st_files import read_tensors, write_tensors

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25", "qwen3", "qwen3_moe", "llama", "deepseek_v2")


def _llm(path: Path):
    from reasoning_engine import LLM

    return LLM(str(path), dtype="float32", device="cpu")


@pytest.fixture
def llama(tiny_checkpoint: Callable[[str], TinyCheckpoint], tmp_path: Path) -> Path:
    """A private copy of the tiny Llama checkpoint to break."""
    return Path(shutil.copytree(tiny_checkpoint("llama").path, tmp_path / "llama"))


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_config(llama: Path) -> None:
    (llama / "config.json").unlink()
    with pytest.raises((FileNotFoundError, ValueError), match="config.json"):
        _llm(llama)


def test_missing_weights(llama: Path) -> None:
    (llama / "model.safetensors").unlink()
    with pytest.raises((FileNotFoundError, ValueError), match="safetensors"):
        _llm(llama)


def test_index_pointing_at_a_missing_shard(tiny_checkpoint: Callable[[str], TinyCheckpoint], tmp_path: Path) -> None:
    path = Path(shutil.copytree(tiny_checkpoint("deepseek_v3_sharded").path, tmp_path / "sharded"))
    (path / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises((FileNotFoundError, ValueError), match=r"model-00002-of-00004\.safetensors"):
        _llm(path)


def test_unknown_model_type_lists_the_supported_ones(llama: Path) -> None:
    _edit_config(llama, model_type="mamba9", architectures=["Mamba9ForCausalLM"])
    with pytest.raises(ValueError, match="mamba9") as err:
        _llm(llama)
    missing = [t for t in SUPPORTED_MODEL_TYPES if t not in str(err.value)]
    assert not missing, f"error does not list {missing}: {err.value}"


def test_misshaped_tensor_names_it_and_both_shapes(llama: Path) -> None:
    tensors = read_tensors(llama)
    name = "model.layers.1.self_attn.o_proj.weight"
    assert tensors[name].shape == (64, 64)
    tensors[name] = torch.zeros(64, 48)
    write_tensors(llama, tensors)
    with pytest.raises(ValueError) as err:
        _llm(llama)
    message = str(err.value)
    assert "layers.1.self_attn.o_proj.weight" in message, message
    assert re.search(r"64, 48", message) and re.search(r"64, 64", message), message


def test_missing_tensor_is_named(llama: Path) -> None:
    tensors = read_tensors(llama)
    del tensors["model.layers.2.mlp.down_proj.weight"]
    write_tensors(llama, tensors)
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.down_proj"):
        _llm(llama)


def test_unsupported_quantization_method(llama: Path) -> None:
    _edit_config(llama, quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128})
    with pytest.raises(ValueError, match="gptq") as err:
        _llm(llama)
    assert "compressed-tensors" in str(err.value) and "fp8" in str(err.value), err.value


def test_kimi_k25_loads_its_vision_tower_beside_the_text_model(tiny_checkpoint: Callable[[str], TinyCheckpoint]) -> None:
    """The vision tower and projector (as transformers saves them) load into the worker's encoder; the text model
    still skips them."""
    llm = _llm(tiny_checkpoint("kimi_k25").path)
    vision = llm.engine.runner.worker.vision
    assert vision is not None and vision.config.hidden_size == 16

def test_renamed_config_fields_read_through_transformers_config_classes(tmp_path: Path) -> None:
    """A config written by transformers 5 (`num_local_experts`, `rope_parameters`) and the hub's spelling
    (`num_experts`, `rope_theta` + `rope_scaling`) are one configuration; DeepSeek's alias reads too."""
    from transformers import Qwen3MoeConfig

    from reasoning_engine.config import load_model_config

    saved = tmp_path / "saved"
    Qwen3MoeConfig(num_experts=6, num_experts_per_tok=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                   rope_parameters={"rope_type": "default", "rope_theta": 5e5}).save_pretrained(saved)
    written = json.loads((saved / "config.json").read_text())
    assert "num_local_experts" in written and "num_experts" not in written  # as transformers 5 writes it
    hub = tmp_path / "hub"
    hub.mkdir()
    old = {k: v for k, v in written.items() if k not in ("num_local_experts", "rope_parameters")}
    (hub / "config.json").write_text(json.dumps({**old, "num_experts": 6, "rope_theta": 5e5, "rope_scaling": None}))
    for path in (saved, hub):
        config = load_model_config(path)
        assert config.raw["num_experts"] == config.raw["num_local_experts"] == 6
        assert (config.rope_theta, config.rope_scaling) == (5e5, None)
    deepseek = tmp_path / "deepseek"
    deepseek.mkdir()
    (deepseek / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "num_local_experts": 5,
                                                      "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
                                                      "num_attention_heads": 4}))
    assert load_model_config(deepseek).raw["n_routed_experts"] == 5


def test_kimi_linear_hub_config_reads_its_layer_lists_and_refuses_what_it_does_not_run(
        tiny_checkpoint: Callable[[str], TinyCheckpoint], tmp_path: Path) -> None:
    """The hub's Kimi Linear config (1-based `linear_attn_config` layer lists, `first_k_dense_replace`, Kimi's MoE
    names) reads as transformers reads it; a KDA gate with a lower bound or rotary MLA is refused by name."""
    from reasoning_engine.config import load_model_config
    from reasoning_engine.models.kimi_linear import KimiLinearForCausalLM

    path = Path(shutil.copytree(tiny_checkpoint("kimi_linear_published").path, tmp_path / "kimi_linear"))
    config = load_model_config(path)
    assert config.raw["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert config.raw["mlp_layer_types"] == ["dense", "dense", "sparse", "sparse"]
    assert (config.raw["n_routed_experts"], config.raw["num_experts_per_tok"], config.raw["n_group"]) == (8, 2, 4)
    linear = json.loads((path / "config.json").read_text())["linear_attn_config"]
    for changes in ({"linear_attn_config": {**linear, "gate_lower_bound": -5.0}}, {"mla_use_nope": False}):
        _edit_config(path, **changes)
        with torch.device("meta"), pytest.raises(ValueError, match="gate_lower_bound|mla_use_nope"):
            KimiLinearForCausalLM(load_model_config(path), 64)
        _edit_config(path, linear_attn_config=linear, mla_use_nope=True)
