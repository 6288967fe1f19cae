"""Writes checkpoints in the published quantized formats, for tests only (the engine only reads them).

- INT4 compressed-tensors ``pack-quantized`` as Kimi K2 Thinking / K2.5 ship their routed experts: symmetric, group 32,
  ``weight_packed`` int32 ``[out, in/8]`` (stored value ``q + 8``, lowest nibble first), ``weight_scale`` bf16
  ``[out, in/32]``, ``weight_shape`` int64 ``[2]``.
- Block FP8 as DeepSeek-V3 / Kimi K2 ship every linear layer but the router, embeddings and LM head: float8_e4m3fn
  ``weight`` and float32 ``weight_scale_inv`` per 128x128 block (edge blocks partial).
- The same block FP8 as Qwen3-Next / Qwen3.5 / Qwen3.6 FP8 ship it: bf16 ``weight_scale_inv``, and besides the router,
  embeddings, norms and LM head they leave the linear-attention ``in_proj_ba`` (Qwen3-Next) or ``in_proj_a`` /
  ``in_proj_b`` (Qwen3.5), the shared-expert gate, ``conv1d`` and the vision tower unconverted, each such module named
  in ``modules_to_not_convert``.
- compressed-tensors ``float-quantized`` FP8 as GLM-4.5 / 4.6 / 4.7 FP8 ship every linear layer but the router,
  embeddings and LM head: float8_e4m3fn ``weight`` and bf16 ``weight_scale`` ``[out, 1]`` (row amax / 448), dynamic
  per-token input activations (no input_scale).

- DeepSeek-V4 as released (``scale_fmt: ue8m0``, ``expert_dtype: fp4``): every linear but the router, embeddings,
  LM head and the compressors' and indexer's bf16 projections in block FP8, quantized by transformers' own
  ``Fp8Quantize`` (power-of-two float8_e8m0fnu scales), stored under the release's ``X.scale``; routed experts in
  FP4, ``X.weight`` int8 ``[out, in/2]`` (two e2m1 codes per byte, low nibble first) and ``X.scale`` e8m0
  ``[out, in/32]`` (transformers has no FP4 writer: the MXFP4 rounding below); ``tid2eid`` int32.

- MXFP4 as gpt-oss ships its experts: each layer's stacked ``gate_up_proj`` / ``down_proj`` ([E, in, out] in
  transformers) as ``*_blocks`` uint8 ``[E, out, in/32, 16]`` (e2m1 codes, low nibble first) and ``*_scales`` uint8
  ``[E, out, in/32]`` (e8m0, 2^(s - 127), the smallest power of two that brings the group's amax within 6).

Each writer also gives the dense weight the stored one stands for, computed here independently of the engine's
dequantization, so the transformers reference can run on exactly those weights.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F

from .st_files import read_tensors, write_tensors

FP8_MAX = 448.0  # largest finite float8_e4m3fn
KIMI_INT4_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
KIMI_K25_EXTRA_IGNORE = ["re:vision_tower.*", "re:mm_projector.*"]
ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
NOT_FP8 = re.compile(r"(embed_tokens|lm_head|norm|\.mlp\.gate\.|\.block_sparse_moe\.gate\.|shared_head\.head)")
QWEN_NOT_FP8 = re.compile(r"(\.linear_attn\.in_proj_(ba|a|b)\.|\.mlp\.shared_expert_gate\.|^model\.visual\.)")
QWEN_HYBRID_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")


def int4_quantization_config(ignore: list[str]) -> dict:
    """The quantization_config Kimi K2 Thinking / K2.5 publish."""
    return {
        "config_groups": {
            "group_0": {
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": 32,
                    "num_bits": 4,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "strategy": "group",
                    "symmetric": True,
                    "type": "int",
                },
            }
        },
        "format": "pack-quantized",
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def fp8_channel_quantization_config(ignore: list[str]) -> dict:
    """The quantization_config GLM-4.5-FP8 publishes: FP8 weights per output channel, FP8 activations per token
    (dynamic)."""
    def args(strategy: str, dynamic: bool, observer: str | None) -> dict:
        return {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": None, "num_bits": 8,
                "observer": observer, "observer_kwargs": {}, "strategy": strategy, "symmetric": True, "type": "float"}

    return {
        "config_groups": {"group_0": {"input_activations": args("token", True, None), "output_activations": None,
                                      "targets": ["Linear"], "weights": args("channel", False, "minmax")}},
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def quantize_fp8_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel FP8: float8_e4m3fn weight and bf16 weight_scale [out, 1] (row amax / 448)."""
    scale = (weight.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12).to(torch.bfloat16)
    fp8 = (weight.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return fp8.contiguous(), scale


FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# MiniMax-M2's spelling of the same format (its published config.json)
MINIMAX_FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                                   "weight_block_size": [128, 128],
                                   "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}


def qwen_fp8_quantization_config(not_converted: list[str]) -> dict:
    """The quantization_config Qwen3-Next / Qwen3.5 FP8 publish: block FP8 with each unconverted module named."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
            "modules_to_not_convert": not_converted}


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-group INT4: values q in [-8, 7] (int8) and bf16 scales [out, ceil(in / group_size)]."""
    rows, cols = weight.shape
    groups = math.ceil(cols / group_size)
    w = F.pad(weight.float(), (0, groups * group_size - cols)).view(rows, groups, group_size)
    scale = (w.abs().amax(-1) / 7.5).clamp(min=1e-8).to(torch.bfloat16)
    q = torch.round(w / scale.float().unsqueeze(-1)).clamp(-8, 7).view(rows, -1)[:, :cols]
    return q.to(torch.int8), scale


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Pack int8 values in [-8, 7] eight to an int32: stored as q + 8, value i of each eight in bits 4i..4i+3."""
    rows, cols = q.shape
    stored = F.pad(q.to(torch.int64) + 8, (0, -cols % 8)).view(rows, -1, 8)
    packed = (stored << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def int4_dense(q: torch.Tensor, scale: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """The float32 weight INT4 values stand for: q times the scale of its group."""
    cols = q.shape[1]
    return q.float() * scale.float().repeat_interleave(group_size, dim=1)[:, :cols]


def pack_int4(weight: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight` as compressed-tensors pack-quantized parts: (weight_packed, weight_scale, weight_shape)."""
    q, scale = quantize_int4(weight, group_size)
    return pack_nibbles(q), scale, torch.tensor(list(weight.shape), dtype=torch.int64)


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek block FP8: float8_e4m3fn weight and float32 weight_scale_inv (block amax / 448) per block."""
    rows, cols = weight.shape
    br, bc = block
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    w = F.pad(weight.float(), (0, nc * bc - cols, 0, nr * br - rows)).view(nr, br, nc, bc)
    scale_inv = (w.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    fp8 = (w / scale_inv.view(nr, 1, nc, 1)).clamp(-FP8_MAX, FP8_MAX).view(nr * br, nc * bc)[:rows, :cols]
    return fp8.to(torch.float8_e4m3fn).contiguous(), scale_inv


def fp8_dense(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """The float32 weight a block-FP8 tensor stands for, block by block."""
    dense = weight.float()
    scale_inv = scale_inv.float()
    br, bc = block
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            dense[i * br : (i + 1) * br, j * bc : (j + 1) * bc] *= scale_inv[i, j]
    return dense


E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
GPT_OSS_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
MXFP4_QUANTIZATION_CONFIG = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    "quant_method": "mxfp4",
}


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[E, in, out] (transformers' stacked expert layout) -> blocks uint8 [E, out, in/32, 16], scales uint8
    [E, out, in/32], and the dense [E, in, out] they stand for (round to the nearest e2m1 magnitude, ties to the
    smaller)."""
    rows = weight.transpose(1, 2).float()
    groups = rows.unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax.clamp_min(1e-30) / 6.0)), torch.full_like(amax, -127))
    exponent = exponent.clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    table = torch.tensor(E2M1_MAGNITUDES)
    index = (scaled.abs().unsqueeze(-1) - table).abs().argmin(-1)
    codes = index + 8 * (scaled < 0).long()
    dense = table[index] * torch.where(scaled < 0, -1.0, 1.0) * torch.exp2(exponent).unsqueeze(-1)
    codes = codes.flatten(-2)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    blocks = packed.unflatten(-1, (-1, 16))
    return blocks, (exponent + 127).to(torch.uint8), dense.flatten(-2).transpose(1, 2).contiguous()


V4_ROUTED_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
V4_NOT_FP8 = re.compile(r"(embed|^head\.|norm|\.ffn\.gate\.|\.compressor\.(wkv|wgate)\.|\.indexer\.weights_proj\.)")
V4_BLOCK = (16, 16)  # tiny shapes: blocks that divide every linear, as 128 x 128 divide the released model's
V4_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                          "weight_block_size": list(V4_BLOCK)}


def quantize_fp8_ue8m0(weight: torch.Tensor, block: tuple[int, int] = V4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 with power-of-two e8m0 scales, by transformers' own quantizer (the ops its FP8 save runs)."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    from transformers.utils.quantization_config import FineGrainedFP8Config

    config = FineGrainedFP8Config(weight_block_size=block, scale_fmt="ue8m0", expert_dtype="fp4")
    out = Fp8Quantize(FineGrainedFP8HfQuantizer(config))._quantize_one("x.weight", weight)
    return out["x.weight"], out["x.weight_scale_inv"]


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] -> FP4 codes int8 [out, in/2], e8m0 scales [out, in/32] and the dense weight they stand for."""
    blocks, scales, dense = quantize_mxfp4(weight.t().unsqueeze(0))
    return (blocks[0].flatten(-2).view(torch.int8), scales[0].view(torch.float8_e8m0fnu),
            dense[0].t().contiguous())


def dequantize_v4(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """transformers' own dequantization of a released DeepSeek-V4 tensor (block FP8 or FP4), in float32."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=torch.float32)


def quantize_checkpoint(folder: Path, scheme: str, shards: int = 1) -> dict[str, torch.Tensor]:
    """Rewrite the checkpoint in `folder` in place: routed experts to INT4 (`scheme="int4"`) or every linear weight
    but router / embeddings / LM head to block FP8 (`scheme="fp8"`) or per-channel FP8 (`"fp8_channel"`), with the matching quantization_config (inside
    text_config for a Kimi K2.5 wrapper, as published). Returns the dense float32 state it stands for, by stored name."""
    config = json.loads((folder / "config.json").read_text())
    qwen = config.get("model_type") in QWEN_HYBRID_TYPES
    stored: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    not_converted: list[str] = []
    for name, tensor in read_tensors(folder).items():
        base = name[: -len(".weight")]
        if scheme == "v4" and V4_ROUTED_EXPERT.search(name):
            codes, scale, _ = quantize_fp4(tensor)
            stored.update({name: codes, f"{base}.scale": scale})
            dense[name] = dequantize_v4(codes, scale)
        elif scheme == "v4" and name.endswith(".weight") and tensor.dim() == 2 and not V4_NOT_FP8.search(name):
            fp8, scale = quantize_fp8_ue8m0(tensor)
            stored.update({name: fp8, f"{base}.scale": scale})
            dense[name] = dequantize_v4(fp8, scale)
        elif scheme == "v4" and name.endswith(".tid2eid"):
            stored[name], dense[name] = tensor.to(torch.int32), tensor
        elif scheme == "mxfp4" and GPT_OSS_EXPERTS.search(name):
            blocks, scales, dense[name] = quantize_mxfp4(tensor)
            stored.update({f"{name}_blocks": blocks, f"{name}_scales": scales})
        elif scheme == "int4" and ROUTED_EXPERT.search(name):
            q, scale = quantize_int4(tensor)
            stored.update({f"{base}.weight_packed": pack_nibbles(q), f"{base}.weight_scale": scale,
                           f"{base}.weight_shape": torch.tensor(list(tensor.shape), dtype=torch.int64)})
            dense[name] = int4_dense(q, scale)
        elif (scheme == "fp8" and name.endswith(".weight") and tensor.dim() == 2 and not NOT_FP8.search(name)
              and not (qwen and QWEN_NOT_FP8.search(name))):
            fp8, scale_inv = quantize_fp8_block(tensor)
            if qwen:  # Qwen's FP8 checkpoints store the block scales in bf16
                scale_inv = scale_inv.to(torch.bfloat16)
            stored.update({name: fp8, f"{base}.weight_scale_inv": scale_inv})
            dense[name] = fp8_dense(fp8, scale_inv)
        elif scheme == "fp8_channel" and name.endswith(".weight") and tensor.dim() == 2 and not NOT_FP8.search(name):
            fp8, scale = quantize_fp8_channel(tensor)
            stored.update({name: fp8, f"{base}.weight_scale": scale})
            dense[name] = fp8.float() * scale.float()
        else:
            stored[name] = dense[name] = tensor
            module = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
            not_converted += [] if module in not_converted else [module]
    if scheme == "v4":  # expert_dtype beside quantization_config, as V4 (not V4.1) publishes it
        qc = dict(V4_QUANTIZATION_CONFIG)
        config["expert_dtype"] = "fp4"
    elif scheme == "mxfp4":
        qc = dict(MXFP4_QUANTIZATION_CONFIG)
    elif scheme == "int4":
        wrapper = "text_config" in config
        qc = int4_quantization_config(KIMI_INT4_IGNORE + (KIMI_K25_EXTRA_IGNORE if wrapper else []))
    elif scheme == "fp8_channel":
        qc = fp8_channel_quantization_config(["lm_head"])
    elif config.get("model_type") == "minimax_m2":
        qc = dict(MINIMAX_FP8_QUANTIZATION_CONFIG)
    elif qwen:  # at the top level of Qwen3.5's image-text wrapper too
        qc = qwen_fp8_quantization_config(not_converted)
    else:
        qc = dict(FP8_QUANTIZATION_CONFIG)
    wrapped = "text_config" in config and not qwen  # Kimi K2.5 keeps it inside text_config
    (config["text_config"] if wrapped else config)["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_tensors(folder, stored, shards)
    return dense
