"""load_format="dummy": a folder with only config.json builds a working model with seeded random weights (quantized
experts as random packed codes), and no weights file is ever opened."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from reasoning_engine.kernels.fused_moe import dequantize_int4_packed
from reasoning_engine.layers.moe import Experts

from .checkpoints import TinyCheckpoint, prompts

Builder = Callable[[str], TinyCheckpoint]


def _config_only(ckpt: TinyCheckpoint, tmp_path: Path) -> Path:
    folder = tmp_path / f"{ckpt.name}-config"
    folder.mkdir()
    shutil.copy(ckpt.path / "config.json", folder / "config.json")
    return folder


def _dummy(path: Path, dtype: str = "bfloat16", backend: str = "torch"):
    from reasoning_engine import LLM

    return LLM(str(path), dtype=dtype, device="cpu", load_format="dummy", kernel_backend=backend)


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "deepseek_v3", "kimi_k25_int4", "deepseek_v3_fp8", "gpt_oss_mxfp4",
                                  "minimax_m2_fp8", "glm4_moe_fp8", "glm4_moe_lite_as_saved",
                                  "deepseek_v4", "glm5_next"])
def test_config_json_alone_gives_finite_logits_and_tokens(tiny_checkpoint: Builder, tmp_path: Path, name: str) -> None:
    from reasoning_engine import SamplingParams

    llm = _dummy(_config_only(tiny_checkpoint(name), tmp_path))
    assert llm.tokenizer is None
    for logits in llm.compute_logits(prompts()):
        assert torch.isfinite(logits).all()
        assert 0.1 < logits.std().item() < 10, "weights scaled for unit-scale activations give logits near N(0, 1)"
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts()],
                        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4] * len(prompts())


def test_no_weights_file_is_opened(tiny_checkpoint: Builder, monkeypatch: pytest.MonkeyPatch) -> None:
    import reasoning_engine.models.weights as weights

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("load_format='dummy' opened a checkpoint file")

    monkeypatch.setattr(weights, "safe_open", refuse)
    monkeypatch.setattr(weights, "checkpoint_files", refuse)
    llm = _dummy(tiny_checkpoint("deepseek_v3").path)  # a full checkpoint folder: its safetensors stay untouched
    assert torch.isfinite(llm.compute_logits([[3, 4, 5]])[0]).all()


def test_weights_are_deterministic_and_scaled(tiny_checkpoint: Builder, tmp_path: Path) -> None:
    path = _config_only(tiny_checkpoint("deepseek_v3"), tmp_path)
    first, second = _dummy(path, "float32"), _dummy(path, "float32")
    assert torch.equal(first.compute_logits([[5, 6, 7]])[0], second.compute_logits([[5, 6, 7]])[0])
    params = dict(first.engine.model.named_parameters())
    assert torch.equal(params["layers.0.input_layernorm.weight"], torch.ones(64))
    assert torch.equal(params["layers.1.mlp.gate.e_score_correction_bias"], torch.zeros(8))
    kv_b = first.engine.model.layers[0].self_attn.kv_b_proj.dense_weight()  # [heads * (nope + v), kv_lora_rank 32]
    assert abs(kv_b.std().item() * 32**0.5 - 1) < 0.1


def test_quantized_experts_are_random_packed_codes(tiny_checkpoint: Builder, tmp_path: Path) -> None:
    int4 = _dummy(_config_only(tiny_checkpoint("kimi_k2_int4"), tmp_path))
    experts = next(m for m in int4.engine.model.modules() if isinstance(m, Experts))
    assert experts.w13.dtype == torch.int32 and experts.w13_scale.dtype == torch.bfloat16
    nibbles = (experts.w13.unsqueeze(-1) >> torch.arange(0, 32, 4, dtype=torch.int32)) & 0xF
    counts = torch.bincount(nibbles.flatten(), minlength=16)
    assert counts.min() > 0.8 * nibbles.numel() / 16, counts  # every code, sign nibble included, about equally often
    dense = dequantize_int4_packed(experts.w13, experts.w13_scale, 32)
    assert abs(dense.std().item() * 64**0.5 - 1) < 0.1  # the dequantized weight has the dense init's spread
    fp8 = _dummy(_config_only(tiny_checkpoint("deepseek_v3_fp8"), tmp_path))
    experts = next(m for m in fp8.engine.model.modules() if isinstance(m, Experts))
    assert experts.w13.dtype == torch.float8_e4m3fn and torch.isfinite(experts.w13.float()).all()
    dense = experts.w13.float() * experts.w13_scale.repeat_interleave(128, 1)[:, :320].repeat_interleave(128, 2)[..., :192]
    assert abs(dense.std().item() * 192**0.5 - 1) < 0.1  # the dequantized weight has the dense init's spread


def test_unknown_load_format_is_rejected(tiny_checkpoint: Builder) -> None:
    from reasoning_engine.config import load_model_config
    from reasoning_engine.models.registry import build_model

    with pytest.raises(ValueError, match="load_format must be 'auto' or 'dummy', got 'pt'"):
        build_model(load_model_config(tiny_checkpoint("llama").path), torch.float32, torch.device("cpu"), 64, load_format="pt")
