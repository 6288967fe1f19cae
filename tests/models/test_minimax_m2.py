"""MiniMax-M2 specifics beyond the parity tests: the published tensor names and block FP8 layout the tiny variants
claim, routed experts kept in FP8 (bit for bit, and the Triton kernels on them equal to the dequantized checkpoint),
and multi-token-prediction tensors skipped."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from reasoning_engine.config import load_model_config
from reasoning_engine.models.registry import build_model

from .checkpoints import TinyCheckpoint, prompts
from .st_files import read_tensors, write_tensors

Builder = Callable[[str], TinyCheckpoint]

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(path: Path) -> torch.nn.Module:
    return build_model(load_model_config(path), torch.float32, torch.device("cpu"), max_positions=64)


def test_published_layout_and_block_fp8(tiny_checkpoint: Builder) -> None:
    """Guards the builders: Mixtral-style MoE names, q/k norms over all heads, MiniMax's quantization_config."""
    plain = tiny_checkpoint("minimax_m2").path
    names = set(read_tensors(plain))
    assert {"model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.block_sparse_moe.e_score_correction_bias",
            "model.layers.0.block_sparse_moe.experts.7.w3.weight"} <= names
    config = json.loads((plain / "config.json").read_text())
    assert config["rotary_dim"] == 8 and "rope_parameters" not in config
    fp8_path = tiny_checkpoint("minimax_m2_fp8").path
    fp8 = read_tensors(fp8_path)
    assert fp8["model.layers.0.self_attn.q_norm.weight"].shape == (4 * 48,)  # all heads' channels
    assert fp8["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
    assert fp8["model.layers.0.self_attn.k_proj.weight_scale_inv"].shape == (1, 2)  # 96 x 192
    assert fp8["model.layers.1.block_sparse_moe.experts.0.w1.weight_scale_inv"].shape == (2, 2)  # 160 x 192
    assert fp8["model.layers.1.block_sparse_moe.gate.weight"].dtype == torch.float32
    quant = json.loads((fp8_path / "config.json").read_text())["quantization_config"]
    assert quant["fmt"] == "float8_e4m3fn" and quant["modules_to_not_convert"] == ["gate", "e_score_correction_bias",
                                                                                    "lm_head"]


def test_routed_experts_stay_fp8(tiny_checkpoint: Builder) -> None:
    model = _model(tiny_checkpoint("minimax_m2_fp8").path)
    for layer in model.layers:
        experts = layer.mlp.experts
        assert experts.quant is not None and experts.quant.method == "fp8_block"
        assert experts.w13.dtype == experts.w2.dtype == torch.float8_e4m3fn
        assert layer.self_attn.qkv_proj.weight.dtype == torch.float32  # dequantized at load
        assert layer.mlp.gate.e_score_correction_bias is not None


def test_fp8_experts_hold_the_stored_tensors_and_triton_matches_dequantized(tiny_checkpoint: Builder) -> None:
    """Expert 5 of the last layer holds the stored w1 (gate) / w3 (up) / w2 (down) bit for bit; the Triton kernels
    (interpreted on CPU) on the packed experts give the dense checkpoint's logits and tokens."""
    from reasoning_engine import LLM, SamplingParams

    ckpt = tiny_checkpoint("minimax_m2_fp8")
    packed = LLM(str(ckpt.path), dtype="float32", device="cpu", kernel_backend="triton")
    experts = packed.engine.model.layers[-1].mlp.experts
    stored = read_tensors(ckpt.path)
    prefix = f"model.layers.{len(packed.engine.model.layers) - 1}.block_sparse_moe.experts.5"
    half, scale_half = experts.w13.shape[1] // 2, experts.w13_scale.shape[1] // 2
    parts = {"w1": (experts.w13[5, :half], experts.w13_scale[5, :scale_half]),
             "w3": (experts.w13[5, half:], experts.w13_scale[5, scale_half:]),
             "w2": (experts.w2[5], experts.w2_scale[5])}
    for proj, (values, scales) in parts.items():
        assert torch.equal(values.view(torch.uint8), stored[f"{prefix}.{proj}.weight"].view(torch.uint8)), proj
        assert torch.equal(scales, stored[f"{prefix}.{proj}.weight_scale_inv"]), proj
    dense = LLM(str(ckpt.reference_path), dtype="float32", device="cpu")
    batch = [[3, 17, 9, 42, 5], [7, 30]]
    (got,), (want,) = packed.compute_logits(batch[:1]), dense.compute_logits(batch[:1])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    requests = [{"prompt_token_ids": ids} for ids in batch]
    tokens = [o.outputs[0].token_ids for o in packed.generate(requests, params, use_tqdm=False)]
    assert tokens == [o.outputs[0].token_ids for o in dense.generate(requests, params, use_tqdm=False)]


def test_tensor_parallel_fp8_experts_need_whole_blocks(tiny_checkpoint: Builder) -> None:
    """The experts' width is intermediate_size here (160: no whole 128-channel blocks for 2 ranks); expert
    parallelism is the way out, as the error says."""
    from reasoning_engine import LLM

    with pytest.raises(ValueError, match=r"must split intermediate_size \(160\) into whole quantization blocks of 128"
                                         r".*enable_expert_parallel"):
        LLM(str(tiny_checkpoint("minimax_m2_fp8").path), tensor_parallel_size=2, dtype="float32", device="cpu")


def test_mtp_module_tensors_are_skipped(tiny_checkpoint: Builder, tmp_path: Path) -> None:
    """The official checkpoints carry multi-token-prediction modules after the last layer; the model ignores them."""
    source = tiny_checkpoint("minimax_m2").path
    path = tmp_path / "with_mtp"
    shutil.copytree(source, path)
    tensors = read_tensors(path)
    last = json.loads((path / "config.json").read_text())["num_hidden_layers"] - 1
    tensors.update({k.replace(f"layers.{last}.", f"layers.{last + 1}."): torch.randn(v.shape)
                    for k, v in tensors.items() if f"layers.{last}." in k})
    write_tensors(path, tensors)
    from reasoning_engine import LLM

    batch = prompts()
    want, got = (LLM(str(p), dtype="float32", device="cpu").compute_logits(batch) for p in (source, path))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
