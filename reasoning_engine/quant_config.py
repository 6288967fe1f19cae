"""A checkpoint's ``quantization_config`` read into a `QuantConfig`: its format and which linear layers it stores
quantized. Plain data, below the models that load the tensors (`models/quantization.py`) and the parallel config that
checks how the packed experts split over ranks."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SUPPORTED_QUANT_METHODS = ("compressed-tensors", "fp8", "mxfp4")  # compressed-tensors INT4 or FP8 ("fp8-channel")


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's weight quantization, reduced to what loading needs.

    ``method`` is ``"compressed-tensors"`` (INT4 pack-quantized, ``group_size``), ``"fp8"`` (``block``) or
    ``"fp8-channel"`` (compressed-tensors float-quantized, per-channel or per-tensor scales).
    ``targets`` and ``ignore`` use the compressed-tensors conventions: ``"Linear"`` (any linear layer),
    ``"re:<regex>"`` (matched from the start of the module name) or an exact module name.
    """

    method: str
    group_size: int = 32
    block: tuple[int, int] = (128, 128)
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()
    expert_dtype: str = "fp8"  # block FP8: the routed experts' format, "fp8" or DeepSeek-V4's "fp4" (MXFP4 layout)

    def is_quantized(self, module_name: str) -> bool:
        """Whether the linear layer ``module_name`` (e.g. ``model.layers.3.mlp.experts.7.up_proj``) is stored
        quantized. Callers ask only about linear layers; for FP8 the MoE router (``mlp.gate``) and ``lm_head`` are
        never quantized, as in the DeepSeek checkpoints."""
        if any(_matches(module_name, pattern) for pattern in self.ignore):
            return False
        if self.method == "fp8":
            return not (module_name.endswith("lm_head") or module_name.endswith("mlp.gate"))
        return any(_matches(module_name, pattern) for pattern in self.targets)


def _matches(module_name: str, pattern: str) -> bool:
    """compressed-tensors matching; an exact name also matches under a wrapper prefix ("lm_head" matches
    "language_model.lm_head") because the published ignore lists name modules of the text model."""
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module_name) is not None
    return module_name == pattern or module_name.endswith("." + pattern)


def parse_quant_config(hf_config: dict[str, Any]) -> QuantConfig | None:
    """Read ``quantization_config`` from a config.json dict (or from its ``text_config``, where Kimi K2.5 keeps it).

    Returns None for unquantized checkpoints; raises ValueError naming anything this engine cannot load exactly.
    """
    raw = hf_config.get("quantization_config")
    if raw is None and isinstance(hf_config.get("text_config"), dict):
        raw = hf_config["text_config"].get("quantization_config")
    if raw is None:
        return None
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _parse_compressed_tensors(raw)
    if method == "fp8":
        return _parse_fp8({"expert_dtype": hf_config.get("expert_dtype"), **raw})
    if method == "mxfp4":  # gpt-oss: its experts' `*_blocks` / `*_scales`, read as stored and kept packed
        return QuantConfig(method="mxfp4", group_size=32, ignore=tuple(raw.get("modules_to_not_convert") or ()))
    raise ValueError(
        f"unsupported quantization method {method!r} in quantization_config; supported: {', '.join(SUPPORTED_QUANT_METHODS)}"
    )


def _parse_compressed_tensors(raw: dict[str, Any]) -> QuantConfig:
    groups = raw.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    if raw.get("kv_cache_scheme"):
        raise ValueError("compressed-tensors kv_cache_scheme (quantized KV cache in the checkpoint) is not supported")
    if {group.get("format") or raw.get("format") for group in groups.values()} == {"float-quantized"}:
        return _parse_compressed_fp8(raw, groups)
    targets: list[str] = []
    group_sizes: set[int] = set()
    for name, group in groups.items():
        fmt = group.get("format") or raw.get("format")
        if fmt != "pack-quantized":
            raise ValueError(f"unsupported compressed-tensors format {fmt!r} (config group {name!r}); supported: 'pack-quantized'")
        if group.get("input_activations") or group.get("output_activations"):
            raise ValueError(f"compressed-tensors config group {name!r} quantizes activations; only weight-only INT4 is supported")
        args = group.get("weights") or {}
        wanted = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
        wrong = {k: args.get(k) for k, v in wanted.items() if args.get(k) != v}
        if wrong or not isinstance(args.get("group_size"), int):
            raise ValueError(
                f"unsupported compressed-tensors weights in config group {name!r}: "
                f"{wrong or {'group_size': args.get('group_size')}}; supported: {wanted} with an integer group_size"
            )
        group_sizes.add(args["group_size"])
        targets.extend(group.get("targets") or ["Linear"])
    if len(group_sizes) > 1:
        raise ValueError(f"compressed-tensors config groups with different group sizes {sorted(group_sizes)} are not supported")
    return QuantConfig(
        method="compressed-tensors",
        group_size=group_sizes.pop(),
        targets=tuple(targets),
        ignore=tuple(raw.get("ignore") or ()),
    )


def _parse_compressed_fp8(raw: dict[str, Any], groups: dict[str, Any]) -> QuantConfig:
    """FP8 weights with one scale per output channel or per tensor (GLM-4.5 FP8). Input activations, dynamic or
    static, are left unquantized: layers run in the compute dtype (routed experts dequantized on the fly, the rest at
    load)."""
    targets: list[str] = []
    for name, group in groups.items():
        args = group.get("weights") or {}
        wanted = {"num_bits": 8, "type": "float", "symmetric": True}
        wrong = {k: args.get(k) for k, v in wanted.items() if args.get(k) != v}
        if wrong or args.get("strategy") not in ("channel", "tensor"):
            raise ValueError(f"unsupported compressed-tensors FP8 weights in config group {name!r}: "
                             f"{wrong or {'strategy': args.get('strategy')}}; supported: {wanted} with strategy "
                             f"'channel' or 'tensor'")
        if group.get("output_activations"):
            raise ValueError(f"compressed-tensors config group {name!r} quantizes output activations; not supported")
        targets.extend(group.get("targets") or ["Linear"])
    return QuantConfig(method="fp8-channel", targets=tuple(targets), ignore=tuple(raw.get("ignore") or ()))


def _parse_fp8(raw: dict[str, Any]) -> QuantConfig:
    """Block FP8 (`expert_dtype` in `raw`, or None: V4 keeps it beside quantization_config)."""
    fmt = raw.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):  # MiniMax-M2 spells it out
        raise ValueError(f"unsupported fp8 format {fmt!r}; supported: 'e4m3' (float8_e4m3fn)")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"unsupported fp8 activation_scheme {raw.get('activation_scheme')!r}; supported: 'dynamic'")
    block = raw.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"fp8 quantization_config needs weight_block_size [rows, cols] (block FP8), got {block!r}")
    if raw.get("scale_fmt", "float") not in ("float", "ue8m0"):
        raise ValueError(f"unsupported fp8 scale_fmt {raw.get('scale_fmt')!r}; supported: 'float', 'ue8m0'")
    experts = raw.get("expert_dtype") or "fp8"
    if experts not in ("fp8", "fp4"):
        raise ValueError(f"unsupported expert_dtype {experts!r}; supported: 'fp8', 'fp4'")
    ignore = tuple(raw.get("modules_to_not_convert") or raw.get("ignored_layers") or ())
    return QuantConfig(method="fp8", block=(block[0], block[1]), ignore=ignore, expert_dtype=experts)
