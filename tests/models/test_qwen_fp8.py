"""Qwen3-Next and Qwen3.5 / 3.6 MoE in their official block-FP8 format (bf16 ``weight_scale_inv``, the modules
``modules_to_not_convert`` names stored as they are): routed experts stay FP8 blocks holding the stored tensors, the
other quantized linears are dequantized at load, and the unconverted modules are read as stored. Parity with
transformers on the dequantized weights is in test_parity.py (variants qwen3_next_fp8, qwen3_5_moe_fp8)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch

from reasoning_engine.layers.moe import Experts
from reasoning_engine.quant_config import parse_quant_config

from .checkpoints import TinyCheckpoint
from .st_files import read_tensors

# variant -> prefix of the text model's tensors in the checkpoint, and the modules its config leaves unconverted
VARIANTS = {
    "qwen3_next_fp8": ("model.", ("linear_attn.in_proj_ba", "mlp.gate", "mlp.shared_expert_gate")),
    "qwen3_5_moe_fp8": ("model.language_model.", ("linear_attn.in_proj_a", "linear_attn.in_proj_b", "mlp.gate",
                                                  "mlp.shared_expert_gate")),
}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engines(tiny_checkpoint: Callable[[str], TinyCheckpoint]) -> Callable[[str], object]:
    cache: dict[str, object] = {}

    def get(name: str) -> object:
        if name not in cache:
            from reasoning_engine import LLM

            cache[name] = LLM(str(tiny_checkpoint(name).path), dtype="float32", device="cpu")
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(VARIANTS))
def test_routed_experts_stay_fp8_blocks_holding_the_stored_tensors(engines, tiny_checkpoint, name: str) -> None:
    model = engines(name).engine.model
    stored = read_tensors(tiny_checkpoint(name).path)
    prefix = VARIANTS[name][0]
    assert stored[f"{prefix}layers.1.mlp.experts.5.up_proj.weight_scale_inv"].dtype == torch.bfloat16  # as published
    for index, layer in enumerate(model.layers):
        experts = layer.mlp.experts
        assert isinstance(experts, Experts) and experts.quant is not None, index
        assert (experts.quant.method, experts.quant.block_shape) == ("fp8_block", (128, 128))
        shapes = {n: (p.dtype, tuple(p.shape)) for n, p in experts.named_parameters()}
        # 8 experts of 160 x 192: gate and up take two block rows each, partial edge blocks
        assert shapes == {"w13": (torch.float8_e4m3fn, (8, 320, 192)), "w13_scale": (torch.float32, (8, 4, 2)),
                          "w2": (torch.float8_e4m3fn, (8, 192, 160)), "w2_scale": (torch.float32, (8, 2, 2))}, shapes
        expert = f"{prefix}layers.{index}.mlp.experts.5"
        parts = {"gate": (experts.w13[5, :160], experts.w13_scale[5, :2]),
                 "up": (experts.w13[5, 160:], experts.w13_scale[5, 2:]),
                 "down": (experts.w2[5], experts.w2_scale[5])}
        for proj, (values, scales) in parts.items():
            assert torch.equal(values.view(torch.uint8), stored[f"{expert}.{proj}_proj.weight"].view(torch.uint8)), proj
            assert torch.equal(scales, stored[f"{expert}.{proj}_proj.weight_scale_inv"].float()), proj  # exact widening
    # every other linear (attention, linear attention, shared expert) is dense after load
    dense = {n: p.dtype for n, p in model.named_parameters() if ".experts." not in n}
    assert set(dense.values()) == {torch.float32}, dense


@pytest.mark.parametrize("name", list(VARIANTS))
def test_modules_the_config_leaves_unconverted_are_read_as_stored(engines, tiny_checkpoint, name: str) -> None:
    path = tiny_checkpoint(name).path
    config = json.loads((path / "config.json").read_text())
    quant = parse_quant_config(config)
    stored = read_tensors(path)
    model = engines(name).engine.model
    prefix, modules = VARIANTS[name]
    for module in modules:
        full = f"{prefix}layers.0.{module}"
        assert full in config["quantization_config"]["modules_to_not_convert"], full
        assert not quant.is_quantized(full), full
        assert f"{full}.weight_scale_inv" not in stored and stored[f"{full}.weight"].dtype == torch.float32, full
        target = model.get_submodule(f"layers.0.{module}".replace("linear_attn.", "self_attn.")
                                     .replace("shared_expert_gate", "shared_experts.gate"))
        weight = target.dense_weight() if hasattr(target, "dense_weight") else target.weight  # CPU-packed linears
        assert torch.equal(weight, stored[f"{full}.weight"]), full
