"""INT4 pack-quantized and block-FP8 formats: bit layout, exact dequantization, edge blocks, config parsing."""

from __future__ import annotations

import pytest
import torch

from reasoning_engine.layers.moe import ExpertQuant
from reasoning_engine.models.quantization import (
    dequantize_fp8_block,
    dequantize_fp8_channel,
    expert_quant,
    dequantize_int4_pack,
)
from reasoning_engine.quant_config import QuantConfig, parse_quant_config

from .quant_writer import (
    FP8_QUANTIZATION_CONFIG,
    fp8_channel_quantization_config,
    quantize_fp8_channel,
    KIMI_INT4_IGNORE,
    KIMI_K25_EXTRA_IGNORE,
    fp8_dense,
    int4_dense,
    int4_quantization_config,
    pack_int4,
    pack_nibbles,
    quantize_fp8_block,
    quantize_int4,
)


def test_int4_packing_is_offset_by_8_lowest_nibble_first() -> None:
    # q = -8..-1 is stored as nibbles 0..7, q = 0..7 as 8..15; element i of each eight sits in bits 4i..4i+3
    q = torch.tensor([[-8, -7, -6, -5, -4, -3, -2, -1], [0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.int8)
    packed = pack_nibbles(q)
    assert packed.dtype == torch.int32
    assert packed.tolist() == [[0x76543210], [0xFEDCBA98 - 2**32]]
    ones = torch.ones(2, 1, dtype=torch.bfloat16)
    assert torch.equal(dequantize_int4_pack(packed, ones, (2, 8), group_size=8), q.float())


@pytest.mark.parametrize("shape", [(64, 64), (48, 96), (16, 40), (3, 8)])
def test_int4_dequantization_is_exact(shape: tuple[int, int]) -> None:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_int4(weight, 32)
    packed, packed_scale, weight_shape = pack_int4(weight, 32)
    assert packed.shape == (shape[0], -(-shape[1] // 8)) and packed_scale.shape == (shape[0], -(-shape[1] // 32))
    assert weight_shape.tolist() == list(shape) and packed_scale.dtype == torch.bfloat16
    dense = dequantize_int4_pack(packed, packed_scale, weight_shape, 32)
    assert torch.equal(dense, int4_dense(q, scale))
    # within about half a quantization step of the original (the top value 7.5 steps is clamped to 7; the bf16
    # rounding of the scale moves the grid by at most 2^-8 relative)
    step = scale.float().repeat_interleave(32, dim=1)[:, : shape[1]]
    assert ((dense - weight).abs() <= 0.55 * step).all()


def test_int4_dequantizes_into_the_requested_dtype() -> None:
    packed, scale, shape = pack_int4(torch.randn(32, 64), 32)
    f32 = dequantize_int4_pack(packed, scale, shape, 32)
    assert torch.equal(dequantize_int4_pack(packed, scale, shape, 32, dtype=torch.bfloat16), f32.to(torch.bfloat16))


def test_int4_rejects_inconsistent_parts() -> None:
    packed, scale, shape = pack_int4(torch.randn(32, 64), 32)
    with pytest.raises(ValueError, match=r"weight_packed must be int32 of shape \(32, 8\)"):
        dequantize_int4_pack(packed[:, :4], scale, shape, 32)
    with pytest.raises(ValueError, match=r"weight_scale must have shape \(32, 2\)"):
        dequantize_int4_pack(packed, scale[:, :1], shape, 32)


@pytest.mark.parametrize("shape", [(200, 300), (256, 128), (100, 60), (129, 257)])
def test_fp8_block_dequantization_with_partial_edge_blocks(shape: tuple[int, int]) -> None:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    fp8, scale_inv = quantize_fp8_block(weight, (128, 128))
    assert fp8.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
    assert scale_inv.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    dense = dequantize_fp8_block(fp8, scale_inv, (128, 128))
    assert torch.equal(dense, fp8_dense(fp8, scale_inv, (128, 128)))
    # the bottom-right element belongs to the last (partial) block
    assert dense[-1, -1] == fp8[-1, -1].float() * scale_inv[-1, -1]
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 (plus subnormals near zero)
    assert ((dense - weight).abs() <= weight.abs() / 16 + scale_inv.max() * 2**-9).all()


def test_fp8_rejects_a_scale_grid_of_the_wrong_shape() -> None:
    fp8, scale_inv = quantize_fp8_block(torch.randn(200, 300), (128, 128))
    with pytest.raises(ValueError, match=r"weight_scale_inv must have shape \(2, 3\) for a 200x300 weight"):
        dequantize_fp8_block(fp8, scale_inv[:, :2], (128, 128))


def test_parse_none_when_unquantized() -> None:
    assert parse_quant_config({"model_type": "llama"}) is None


def test_parse_kimi_k25_int4_from_text_config() -> None:
    qc = int4_quantization_config(KIMI_INT4_IGNORE + KIMI_K25_EXTRA_IGNORE)
    config = parse_quant_config({"model_type": "kimi_k25", "text_config": {"quantization_config": qc}})
    assert config is not None and config.method == "compressed-tensors" and config.group_size == 32
    assert config.is_quantized("model.layers.3.mlp.experts.17.gate_proj")
    assert config.is_quantized("model.layers.3.mlp.experts.0.down_proj")
    for dense in ("model.layers.3.self_attn.q_a_proj", "model.layers.3.self_attn.kv_b_proj",
                  "model.layers.3.mlp.shared_experts.up_proj", "model.layers.0.mlp.gate_proj",
                  "model.layers.0.mlp.down_proj", "lm_head", "language_model.lm_head", "vision_tower.blocks.0.wqkv"):
        assert not config.is_quantized(dense), dense


def test_parse_block_fp8() -> None:
    config = parse_quant_config({"quantization_config": dict(FP8_QUANTIZATION_CONFIG)})
    assert config == QuantConfig(method="fp8", block=(128, 128))
    assert config.is_quantized("model.layers.0.self_attn.kv_a_proj_with_mqa")
    assert config.is_quantized("model.layers.5.mlp.experts.3.up_proj")
    assert not config.is_quantized("model.layers.5.mlp.gate") and not config.is_quantized("lm_head")


@pytest.mark.parametrize(
    "quantization_config, message",
    [
        ({"quant_method": "gptq", "bits": 4}, r"unsupported quantization method 'gptq'.*compressed-tensors, fp8"),
        ({"quant_method": "awq"}, r"'awq'.*supported: compressed-tensors, fp8"),
        ({**int4_quantization_config([]), "format": "float-quantized"}, r"compressed-tensors FP8 weights.*'num_bits': 4"),
        ({**int4_quantization_config([]), "format": "int-quantized"}, r"format 'int-quantized'.*'pack-quantized'"),
        ({**FP8_QUANTIZATION_CONFIG, "weight_block_size": None}, r"weight_block_size"),
        ({**FP8_QUANTIZATION_CONFIG, "activation_scheme": "static"}, r"activation_scheme 'static'"),
    ],
)
def test_parse_rejects_what_cannot_be_loaded(quantization_config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_quant_config({"quantization_config": quantization_config})


def test_parse_rejects_asymmetric_int4() -> None:
    qc = int4_quantization_config([])
    qc["config_groups"]["group_0"]["weights"]["symmetric"] = False
    with pytest.raises(ValueError, match="symmetric"):
        parse_quant_config({"quantization_config": qc})


def test_fp8_channel_dequantization_is_exact() -> None:
    weight = torch.randn(48, 80, generator=torch.Generator().manual_seed(2))
    fp8, scale = quantize_fp8_channel(weight)
    assert fp8.dtype == torch.float8_e4m3fn and scale.shape == (48, 1) and scale.dtype == torch.bfloat16
    dense = dequantize_fp8_channel(fp8, scale)
    assert torch.equal(dense, fp8.float() * scale.float())
    assert ((dense - weight).abs() <= weight.abs() / 16 + scale.float() * 2**-9).all()
    assert torch.equal(dequantize_fp8_channel(fp8, torch.tensor([0.5])), fp8.float() * 0.5)  # per-tensor scale
    with pytest.raises(ValueError, match="one value per output channel"):
        dequantize_fp8_channel(fp8, scale[:3])


def test_parse_glm_fp8_channel() -> None:
    """GLM-4.5-FP8: compressed-tensors float-quantized, per-channel weights, dynamic per-token activations."""
    config = parse_quant_config({"quantization_config": fp8_channel_quantization_config(["lm_head"])})
    assert config == QuantConfig(method="fp8-channel", targets=("Linear",), ignore=("lm_head",))
    assert config.is_quantized("model.layers.3.mlp.experts.7.up_proj") and not config.is_quantized("lm_head")
    assert expert_quant(config, 3) is None  # without the sizes: dequantized at load
    # kept packed as block FP8: one output channel by every input channel (in whole 128s)
    assert expert_quant(config, 3, hidden_size=5120, intermediate_size=1536) == ExpertQuant("fp8_block", block_shape=(1, 5120))
    assert expert_quant(config, 3, hidden_size=64, intermediate_size=32).block_shape == (1, 128)
    qc = fp8_channel_quantization_config([])
    qc["config_groups"]["group_0"]["weights"]["strategy"] = "block"
    with pytest.raises(ValueError, match="strategy 'channel' or 'tensor'"):
        parse_quant_config({"quantization_config": qc})


def test_fp8_channel_plan_skips_static_input_scales(tmp_path) -> None:
    """A static-activation FP8 checkpoint's input_scale is not a model tensor: the layer reads as one dense weight."""
    from reasoning_engine.models.weights import iter_checkpoint_weights

    from .st_files import write_tensors

    weight = torch.randn(8, 16)
    fp8, scale = quantize_fp8_channel(weight)
    write_tensors(tmp_path, {"model.layers.0.mlp.down_proj.weight": fp8, "model.layers.0.mlp.down_proj.weight_scale": scale,
                             "model.layers.0.mlp.down_proj.input_scale": torch.tensor([0.1]),
                             "model.norm.weight": torch.ones(8)}, 1)
    (tmp_path / "config.json").write_text("{}")
    quant = parse_quant_config({"quantization_config": fp8_channel_quantization_config([])})
    loaded = dict(iter_checkpoint_weights(tmp_path, quant, torch.float32, progress=False))
    assert sorted(loaded) == ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"]
    assert torch.equal(loaded["model.layers.0.mlp.down_proj.weight"], fp8.float() * scale.float())
    with pytest.raises(ValueError, match="stored in fp8-channel format but config.json has no quantization_config"):
        list(iter_checkpoint_weights(tmp_path, None, torch.float32, progress=False))
