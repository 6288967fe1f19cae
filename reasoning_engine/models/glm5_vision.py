"""GLM-5.3-Flash's vision tower (transformers' `Glm5NextVisionModel`), images only, in plain torch.

Per image of h x w patches (grid (1, h, w)), its rows in the processor's order: m x m merge windows row-major, the
window's patches row-major inside it (m = `spatial_merge_size`), each row one patch of `temporal_patch_size` copies
of the image:
- patch embedding: a Conv3d over (temporal_patch_size, P, P) patches, i.e. one matmul over the flattened rows;
- pre-RMSNorm blocks: attention over the image's own patches (fused qkv with biases, an RMSNorm per head on q and k,
  a 2D rotary embedding: channel pairs (i, i + head_dim / 2) of the first half turn with the patch's row, of the
  second half with its column, at theta^(-4j / head_dim)), then a SwiGLU MLP with biases, gate and up clamped at
  `swiglu_limit`;
- RMSNorm, each merge window folded into one token by a stride-m Conv2d (a matmul) to `out_hidden_size`;
- the merger: Linear, LayerNorm, exact GELU, a clamped SwiGLU MLP: one row per window, the text model's width.

Items of one call run as one packed batch, attention ragged (`kernels/vision_attention.py` or its Triton twin), as
Kimi K2.5's tower (models/kimi_vision.py) does. Checkpoint names are transformers' (`model.visual.*`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from reasoning_engine.layers.moe import GatedMLP
from reasoning_engine.layers.norm import RMSNorm
from reasoning_engine.models.base import WeightTarget, half, load_parameters
from reasoning_engine.models.dummy import build_loaded
from reasoning_engine.models.kimi_vision import attention_function, rotate_pairs
from reasoning_engine.models.weights import read_tensors_where

PREFIX = "model.visual."


@dataclass(frozen=True)
class Glm5VisionConfig:
    """The tower's shapes, from config.json's `vision_config` (transformers' defaults for what it leaves out)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    depth: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    out_hidden_size: int
    projection_intermediate_size: int
    in_channels: int = 3
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 10.0
    attention_bias: bool = True
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_width(self) -> int:
        """Values per patch row: channels x temporal_patch_size x P x P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_config(cls, outer: dict[str, Any]) -> Glm5VisionConfig:
        from transformers import Glm5NextVisionConfig

        vision = Glm5NextVisionConfig(**{k: v for k, v in (outer.get("vision_config") or {}).items()
                                         if k != "model_type"})
        if vision.hidden_act != "silu":
            raise ValueError(f"vision_config.hidden_act {vision.hidden_act!r} is not supported (only 'silu')")
        rope = vision.rope_parameters or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config.rope_parameters.rope_type {rope['rope_type']!r}: only 'axial' is known")
        config = cls(vision.hidden_size, vision.intermediate_size, vision.num_heads, vision.depth, vision.patch_size,
                     vision.temporal_patch_size, vision.spatial_merge_size, vision.out_hidden_size,
                     vision.projection_intermediate_size, vision.in_channels, vision.rms_norm_eps,
                     vision.swiglu_limit, vision.attention_bias, float(rope.get("rope_theta", 10000.0)))
        text_hidden = (outer.get("text_config") or outer).get("hidden_size")
        if text_hidden is not None and config.out_hidden_size != text_hidden:
            raise ValueError(f"vision_config.out_hidden_size {config.out_hidden_size} must be the text model's "
                             f"hidden_size {text_hidden}: image rows replace token embeddings")
        if config.hidden_size % config.num_heads or config.head_dim % 4:
            raise ValueError(f"vision hidden_size {config.hidden_size} over {config.num_heads} heads must give a head "
                             "dimension divisible by 4 (the 2D rotary embedding splits it into row and column pairs)")
        return config


class VisionAttention(nn.Module):
    def __init__(self, config: Glm5VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.attention_bias)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cu_seqlens: torch.Tensor,
                max_seqlen: int, attention) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(x).view(tokens, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotate_pairs(self.q_norm(q), *rotary), rotate_pairs(self.k_norm(k), *rotary)
        return self.proj(attention(q, k, v, cu_seqlens, self.head_dim ** -0.5, max_seqlen).reshape(tokens, -1))


class VisionBlock(nn.Module):
    def __init__(self, config: Glm5VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = VisionAttention(config)
        self.norm2 = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.attention_bias,
                            silu_limit=config.swiglu_limit)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cu_seqlens: torch.Tensor,
                max_seqlen: int, attention) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotary, cu_seqlens, max_seqlen, attention)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    def __init__(self, config: Glm5VisionConfig) -> None:
        super().__init__()
        dim = config.out_hidden_size
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(dim)
        self.mlp = GatedMLP(dim, config.projection_intermediate_size, silu_limit=config.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(F.gelu(self.post_projection_norm(self.proj(x))))


class Glm5VisionEncoder(nn.Module):
    """Patch rows of several images -> one [h * w / m^2, text hidden] tensor of embeddings per image."""

    def __init__(self, config: Glm5VisionConfig, kernel_backend: str = "torch") -> None:
        super().__init__()
        self.config = config
        self.attention = attention_function(kernel_backend)
        self.patch_embed = nn.Linear(config.patch_width, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.post_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.downsample = nn.Linear(config.hidden_size * config.merge_size ** 2, config.out_hidden_size)
        self.merger = Merger(config)

    def forward(self, pixel_values: torch.Tensor, grid_thws: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """pixel_values [sum of h * w, patch_width] as the GLM-5.3 image processor returns them; one (1, h, w) per
        image. Returns, per image, [h * w / m^2, out_hidden_size] in the parameters' dtype."""
        grids = [tuple(int(v) for v in grid) for grid in grid_thws]
        self._check_inputs(pixel_values, grids)
        weight = self.patch_embed.weight
        x = self.patch_embed(pixel_values.to(device=weight.device, dtype=weight.dtype))
        lengths = [h * w for _, h, w in grids]
        cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=x.device)
        rotary = self._rotary_tables(grids, x.device)
        for block in self.blocks:
            x = block(x, rotary, cu_seqlens, max(lengths), self.attention)
        m, dim = self.config.merge_size, self.config.hidden_size
        windows = self.post_layernorm(x).view(-1, m, m, dim).permute(0, 3, 1, 2).flatten(1)  # [windows, dim m m]
        out = self.merger(self.downsample(windows))
        return list(out.split([n // m ** 2 for n in lengths]))

    def _check_inputs(self, pixel_values: torch.Tensor, grids: list[tuple[int, ...]]) -> None:
        width, m = self.config.patch_width, self.config.merge_size
        if not grids:
            raise ValueError("no items to encode")
        if pixel_values.dim() != 2 or pixel_values.shape[1] != width:
            raise ValueError(f"pixel_values must be [patches, {width}], got {list(pixel_values.shape)}")
        for grid in grids:
            t, h, w = grid
            if t != 1 or h <= 0 or w <= 0 or h % m or w % m:
                raise ValueError(f"grid {grid}: one frame whose height and width are positive multiples of the merge "
                                 f"size {m}")
        total = sum(h * w for _, h, w in grids)
        if pixel_values.shape[0] != total:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, the grids {grids} need {total}")

    def _rotary_tables(self, grids: list[tuple[int, ...]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [tokens, 1, head_dim] for each patch's (row, column), rows in merge-window order."""
        head_dim, m = self.config.head_dim, self.config.merge_size
        inv_freq = 1.0 / (self.config.rope_theta ** (
            torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device=device) / (head_dim // 2)))
        positions = []
        for _, h, w in grids:
            rows = torch.arange(h, device=device).view(h // m, m, 1, 1).expand(-1, -1, w // m, m)
            cols = torch.arange(w, device=device).view(1, 1, w // m, m).expand(h // m, m, -1, -1)
            positions.append(torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1))
        angles = (torch.cat(positions).unsqueeze(-1).float() * inv_freq).flatten(1)  # [T, head_dim / 2]: rows, cols
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
        return angles.cos(), angles.sin()

    # ---- weights ----
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: object = "the checkpoint") -> None:
        """Fill every parameter from the checkpoint's `model.visual.*` tensors (names from the checkpoint root)."""
        load_parameters(self, ((name.removeprefix(PREFIX), tensor) for name, tensor in weights), self._target, source)

    def _target(self, name: str) -> WeightTarget | None:
        c = self.config
        if name == "patch_embed.proj.weight":  # [hidden, channels, temporal, P, P]
            shape = (c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
            return WeightTarget("patch_embed.weight", lambda t: t.view(shape))
        if name == "downsample.weight":  # [out, hidden, m, m]
            return WeightTarget(name, lambda t: t.view(c.out_hidden_size, c.hidden_size, c.merge_size, c.merge_size))
        for stem in ("mlp.", "merger."):
            for which in ("gate", "up"):
                if f"{stem}{which}_proj." in name:
                    return WeightTarget(name.replace(f"{which}_proj.", "gate_up_proj.").replace(
                        "merger.", "merger.mlp."), half(which))
        if name.startswith("merger.down_proj."):
            return WeightTarget(name.replace("merger.", "merger.mlp."))
        return WeightTarget(name.replace("patch_embed.proj.", "patch_embed."))


def build_glm5_vision_encoder(model_dir: Path | str, dtype: torch.dtype, device: torch.device | str,
                              kernel_backend: str = "torch", load_format: str = "auto") -> Glm5VisionEncoder | None:
    """The checkpoint's vision tower with its weights loaded (random with load_format "dummy"), or None for a
    glm5_next checkpoint without one (a text-only config)."""
    root = Path(model_dir)
    outer = json.loads((root / "config.json").read_text())
    if not outer.get("vision_config"):
        return None
    config = Glm5VisionConfig.from_config(outer)
    return build_loaded(lambda: Glm5VisionEncoder(config, kernel_backend), dtype, device, load_format,
                        lambda encoder: encoder.load_weights(
                            read_tensors_where(root, lambda name: name.startswith(PREFIX)), root))
