"""Quantized checkpoint formats and how to turn them back into dense weights (`quant_config.py` reads which layers a
checkpoint quantizes).

Three published formats are read:

- compressed-tensors ``pack-quantized`` INT4 (Kimi K2 Thinking / K2.5 routed experts): per linear layer
  ``weight_packed`` int32 ``[out, ceil(in / 8)]`` holding eight 4-bit values per int32, lowest nibble first, each value
  stored as ``q + 8`` (unsigned) for a symmetric ``q`` in ``[-8, 7]``; ``weight_scale`` ``[out, ceil(in / group)]``
  (bf16 in the published models); ``weight_shape`` ``[2]`` the logical ``[out, in]``. Dense weight = ``q * scale`` of
  the value's group.
- DeepSeek / Kimi K2 block FP8 (``quant_method: fp8``): ``weight`` float8_e4m3fn ``[out, in]`` and ``weight_scale_inv``
  float32 ``[ceil(out / bo), ceil(in / bi)]`` for ``weight_block_size: [bo, bi]``; dense weight = ``fp8 * scale`` of
  its block, edge blocks partial. Qwen3-Next / Qwen3.5 / Qwen3.6 FP8 store the scales in bf16 (widened exactly to
  float32) and name every module they leave unconverted in ``modules_to_not_convert`` (``linear_attn.in_proj_ba`` or
  ``in_proj_a`` / ``in_proj_b``, the router and shared-expert gate, norms, ``conv1d``, the vision tower), stored as is.
  DeepSeek-V4 (``scale_fmt: ue8m0``) stores each scale as a power of two, float8_e8m0fnu (widened exactly to
  float32), under ``X.scale`` in the release (``X.weight_scale_inv`` as transformers saves it); its routed experts
  (``expert_dtype: fp4``, top level in V4, inside quantization_config in V4.1) are FP4: ``X.weight`` int8
  ``[out, in / 2]``, two e2m1 codes per byte (low nibble first), and an e8m0 scale per 32 inputs ``[out, in / 32]``:
  MXFP4's codes and scales, kept packed as such. Its compressor and indexer projections are stored in bf16.
- compressed-tensors ``float-quantized`` FP8 (GLM-4.5 / 4.6 / 4.7 FP8): ``weight`` float8_e4m3fn ``[out, in]`` and
  ``weight_scale`` ``[out, 1]`` (per channel) or ``[1]`` (per tensor); dense weight = ``fp8 * scale``. Activation
  quantization (dynamic per token, or a static ``input_scale``) is not applied: activations stay in the compute dtype.
- MXFP4 (``quant_method: mxfp4``, gpt-oss): only the experts, as stacked ``*_blocks`` uint8 ``[E, out, in/32, 16]``
  (two e2m1 codes per byte, low nibble first) and ``*_scales`` uint8 ``[E, out, in/32]`` (e8m0: 2^(s - 127)). They
  are read as stored (plain tensors) into the packed experts; `kernels.fused_moe.dequantize_mxfp4` is the reference.

Routed experts stay quantized in the engine (`expert_quant` picks the format their `layers.moe.Experts` keeps; the
fused-MoE kernels dequantize on the fly), which is where nearly all the bytes of these models are. Every other
quantized linear (attention, dense MLP, shared experts) is dequantized to the compute dtype at load
(`weights.iter_checkpoint_weights`): dense GEMMs have no quantized kernel here and those layers are a small share of
the model. The inverse writers (quantizing dense weights into these formats) live with the tests in
``tests/models/quant_writer.py``: the engine only reads published checkpoints.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from reasoning_engine.layers.moe import ExpertQuant
from reasoning_engine.quant_config import QuantConfig

INT4_PACK_FACTOR = 8  # 4-bit values per int32
INT4_OFFSET = 8  # stored nibble = q + 8


def expert_quant(quant: QuantConfig | None, layer: int, hidden_size: int = 0,
                 intermediate_size: int = 0) -> ExpertQuant | None:
    """The format the routed experts of decoder layer `layer` stay in, or None when they are not quantized (they are
    then dense, dequantized at load if stored quantized). Per-channel FP8 experts stay packed as block FP8 with
    blocks of one output channel by at least every input channel (the sizes are the expert's `hidden_size` and
    `intermediate_size`; without them, such experts are dequantized at load)."""
    if quant is None or (quant.method == "fp8-channel" and not hidden_size):
        return None
    if not all(quant.is_quantized(f"model.layers.{layer}.mlp.experts.0.{proj}_proj") for proj in ("gate", "up", "down")):
        return None
    if quant.method == "fp8-channel":  # a block as wide as any input, in whole 128s so the Triton tiles divide it
        return ExpertQuant("fp8_block", block_shape=(1, -(-max(hidden_size, intermediate_size) // 128) * 128))
    if quant.method == "fp8" and quant.expert_dtype == "fp4":  # DeepSeek-V4: e2m1 codes and e8m0 scales per 32
        return ExpertQuant("mxfp4", group_size=32)
    if quant.method == "fp8":
        return ExpertQuant("fp8_block", block_shape=quant.block)
    if quant.method == "mxfp4":
        return ExpertQuant("mxfp4", group_size=quant.group_size)
    return ExpertQuant("w4a16", group_size=quant.group_size)


def int4_logical_shape(
    packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor | tuple[int, int] | list[int], group_size: int
) -> tuple[int, int]:
    """The ``[out, in]`` a pack-quantized layer stands for, checked against its ``weight_packed`` and ``weight_scale``."""
    values = shape.tolist() if isinstance(shape, torch.Tensor) else list(shape)
    if len(values) != 2:
        raise ValueError(f"weight_shape must hold [out, in], got {values}")
    rows, cols = (int(v) for v in values)
    groups = math.ceil(cols / group_size)
    if packed.dtype != torch.int32 or tuple(packed.shape) != (rows, math.ceil(cols / INT4_PACK_FACTOR)):
        raise ValueError(
            f"weight_packed must be int32 of shape {(rows, math.ceil(cols / INT4_PACK_FACTOR))} for weight_shape "
            f"{[rows, cols]}, got {packed.dtype} {tuple(packed.shape)}"
        )
    if tuple(scale.shape) != (rows, groups):
        raise ValueError(f"weight_scale must have shape {(rows, groups)} for weight_shape {[rows, cols]} and group size {group_size}, got {tuple(scale.shape)}")
    return rows, cols


def dequantize_int4_pack(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shape: torch.Tensor | tuple[int, int] | list[int],
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dense ``[out, in]`` weight from pack-quantized INT4 (``weight_packed``, ``weight_scale``, ``weight_shape``).

    The product ``q * scale`` is formed in float32 (exact for bf16 scales) and rounded once to ``dtype``.
    """
    rows, cols = int4_logical_shape(packed, scale, shape, group_size)
    groups = math.ceil(cols / group_size)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift, then the mask keeps one nibble
    q = nibbles.reshape(rows, -1)[:, :cols].to(torch.float32) - INT4_OFFSET
    q = F.pad(q, (0, groups * group_size - cols)).view(rows, groups, group_size)
    dense = (q * scale.to(torch.float32).unsqueeze(-1)).view(rows, groups * group_size)[:, :cols]
    return dense.to(dtype).contiguous()


def dequantize_fp8_channel(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense ``[out, in]`` weight from compressed-tensors FP8: ``weight`` times its row's ``scale`` (``[out, 1]``) or
    the one per-tensor scale, the product formed in float32 and rounded once to ``dtype``."""
    rows = weight.shape[0]
    if scale.numel() not in (1, rows):
        raise ValueError(f"weight_scale must hold one value per output channel ({rows}) or one per tensor, got shape "
                         f"{tuple(scale.shape)}")
    dense = weight.to(torch.float32) * scale.to(torch.float32).reshape(-1, 1)
    return dense.to(dtype).contiguous()


def e8m0_exponents(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales as e8m0 bytes (2^(byte - 127), MXFP4's scale format): float8_e8m0fnu and uint8 as stored;
    float scales (``scale_fmt: float``) converted exactly, or ValueError where one is not a power of two e8m0 holds."""
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if not scale.is_floating_point():
        raise ValueError(f"power-of-two scales must be float8_e8m0fnu, uint8 or a float type, got {scale.dtype}")
    mantissa, exponent = torch.frexp(scale.float())  # scale = mantissa * 2^exponent, mantissa in [0.5, 1)
    byte = exponent.long() + 126
    if not bool(((mantissa == 0.5) & (byte >= 0) & (byte <= 254)).all()):
        raise ValueError("FP4 scales must be powers of two from 2^-127 to 2^127 (e8m0)")
    return byte.to(torch.uint8)


def dequantize_fp8_block(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] | list[int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dense ``[out, in]`` weight from block FP8: each ``block`` tile of ``weight`` times its ``scale_inv`` entry;
    tiles on the right and bottom edges are partial when the dims are not multiples of the block."""
    rows, cols = weight.shape
    br, bc = int(block[0]), int(block[1])
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    if tuple(scale_inv.shape) != (nr, nc):
        raise ValueError(
            f"weight_scale_inv must have shape {(nr, nc)} for a {rows}x{cols} weight in {br}x{bc} blocks, got {tuple(scale_inv.shape)}"
        )
    w = F.pad(weight.to(torch.float32), (0, nc * bc - cols, 0, nr * br - rows)).view(nr, br, nc, bc)
    dense = (w * scale_inv.to(torch.float32).view(nr, 1, nc, 1)).view(nr * br, nc * bc)[:rows, :cols]
    return dense.to(dtype).contiguous()
