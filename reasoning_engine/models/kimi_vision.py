"""Kimi K2.5's vision encoder (MoonViT-3D) and multimodal projector, in plain torch.

What it computes, per image or video chunk ("item") of t frames of h x w patches:
- patch embedding: a stride-P convolution over P x P patches, i.e. one matmul over the flattened patches;
- a learned [H0, W0] position table resized bicubically to (h, w), plus, for chunks of more than one frame, a fixed
  sinusoidal embedding of the frame index;
- pre-norm transformer blocks whose attention sees every token of the item (all its frames) and nothing else, with a
  2D rotary embedding of the patch's (row, column);
- a final LayerNorm, then each kh x kw neighbourhood of patches is grouped into one token and a chunk's frames are
  averaged (temporal pooling), so an item yields h * w / (kh * kw) tokens whatever its t;
- the projector: LayerNorm per patch, the group's kh * kw patches concatenated, Linear, GELU, Linear to the text
  model's width.

All items of a call run as one packed batch: every linear layer sees all tokens and attention is ragged
(`kernels/vision_attention.py`, or its Triton twin), so mixing image sizes costs no padding.

Checkpoints come in two namings, and both load: Moonshot's (`vision_tower.encoder.blocks.N.wqkv`, ... whose q/k rows
pair rotary channels as (2i, 2i + 1)) and transformers' module names (separate q/k/v whose rotary pairs are
(i, i + head_dim / 2)). We keep the latter layout, so Moonshot's fused q/k rows are permuted on load.
transformers 5.24's `save_pretrained` writes Moonshot's names except the patch embedding
(`vision_tower.encoder.patch_embed.proj`) and the projector norm (`model.mm_projector.pre_norm`).
"""

from __future__ import annotations

import importlib
import itertools
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from reasoning_engine.models.dummy import build_loaded
from reasoning_engine.models.weights import check_shape, read_tensors_where

VISION_PREFIXES = ("vision_tower.", "mm_projector.")
_LAYER_NORM_EPS = 1e-5  # the encoder's own norms (fixed in both implementations; only the projector's is configured)
_GELU_APPROXIMATION = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
# Moonshot's config names architecture variants; these are the ones Kimi K2.5 ships and this module implements
_SUPPORTED_VARIANTS = {
    "pos_emb_type": "divided_fixed",
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmerger",
    "video_attn_type": "spatial_temporal",
    "projector_hidden_act": "gelu",
}
_REQUIRED = object()


@dataclass(frozen=True)
class VisionConfig:
    """The encoder and projector shapes, read from a kimi_k25 config.json in either naming (see `from_config`)."""

    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int
    pos_emb_height: int
    pos_emb_width: int
    pos_emb_time: int  # most frames a chunk may have (rows of the temporal embedding)
    merge_kernel: tuple[int, int]  # (kh, kw) patches grouped into one output token
    text_hidden_size: int
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    projector_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_area(self) -> int:
        return self.merge_kernel[0] * self.merge_kernel[1]

    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """Placeholder tokens an item of this grid becomes: frames are pooled, so t does not count."""
        _, h, w = grid_thw
        return h * w // self.merge_area

    @classmethod
    def from_config(cls, outer: dict[str, Any]) -> VisionConfig:
        """Parse the outer kimi_k25 config.json dict. Field names are tried in the order transformers 5.24 writes
        them (`vision_config.hidden_size`, `projection_hidden_size`, `text_config.hidden_size`, ...), then Moonshot's
        (`vt_hidden_size`, `mm_hidden_size`, `text_hidden_size`, `init_pos_emb_height`, ...). A missing field is a
        ValueError naming it."""
        vision = outer.get("vision_config")
        if not isinstance(vision, dict):
            raise ValueError("kimi_k25 config.json has no vision_config")
        for key, supported in _SUPPORTED_VARIANTS.items():
            if vision.get(key) not in (None, supported):
                raise ValueError(f"vision_config.{key} = {vision[key]!r} is not supported (only {supported!r})")
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config.rope_parameters.rope_type {rope['rope_type']!r}: only 'axial' is known")
        text = outer.get("text_config") if isinstance(outer.get("text_config"), dict) else {}

        merge = _field(vision, "merge_kernel_size")
        merge_kernel = (merge, merge) if isinstance(merge, int) else tuple(int(v) for v in merge)
        if len(merge_kernel) != 2:
            raise ValueError(f"vision_config.merge_kernel_size must have two values, got {merge!r}")
        text_hidden = text.get("hidden_size") or vision.get("text_hidden_size")
        if text_hidden is None:
            raise ValueError("kimi_k25 config.json: text_config has no 'hidden_size' (nor vision_config "
                             "'text_hidden_size')")
        config = cls(
            patch_size=int(_field(vision, "patch_size")),
            hidden_size=int(_field(vision, "hidden_size", "vt_hidden_size")),
            intermediate_size=int(_field(vision, "intermediate_size", "vt_intermediate_size")),
            num_heads=int(_field(vision, "num_attention_heads", "vt_num_attention_heads")),
            num_layers=int(_field(vision, "num_hidden_layers", "vt_num_hidden_layers")),
            pos_emb_height=int(_field(vision, "pos_emb_height", "init_pos_emb_height")),
            pos_emb_width=int(_field(vision, "pos_emb_width", "init_pos_emb_width")),
            pos_emb_time=int(_field(vision, "pos_emb_time", "init_pos_emb_time")),
            merge_kernel=merge_kernel,
            text_hidden_size=int(text_hidden),
            hidden_act=_field(vision, "hidden_act", default="gelu_pytorch_tanh"),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            projector_eps=float(_projector_field(outer, "projection_layer_norm_eps", "projector_ln_eps", 1e-5)),
        )
        norm_size = _projector_field(outer, "projection_hidden_size", "mm_hidden_size", config.hidden_size)
        if int(norm_size) != config.hidden_size:
            raise ValueError(f"the projector normalises {norm_size} channels, the vision tower has "
                             f"{config.hidden_size}")
        if config.hidden_size % config.num_heads or config.head_dim % 4:
            raise ValueError(f"vision hidden_size {config.hidden_size} over {config.num_heads} heads must give a head "
                             "dimension divisible by 4 (the 2D rotary embedding splits it into row and column pairs)")
        if config.hidden_act not in _GELU_APPROXIMATION:
            raise ValueError(f"vision_config.hidden_act {config.hidden_act!r} is not supported "
                             f"(expected one of {sorted(_GELU_APPROXIMATION)})")
        return config


def _field(vision: dict[str, Any], *names: str, default: Any = _REQUIRED) -> Any:
    """The first of `names` present in vision_config; a missing required field is a ValueError naming it."""
    for name in names:
        if vision.get(name) is not None:
            return vision[name]
    if default is _REQUIRED:
        also = f" (or {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
        raise ValueError(f"kimi_k25 config.json: vision_config has no {names[0]!r}{also}")
    return default


def _projector_field(outer: dict[str, Any], name: str, official: str, default: Any) -> Any:
    """A projector setting: transformers keeps it on the outer config (`name`), Moonshot in vision_config
    (`official`); both implementations default to `default`."""
    for value in (outer.get(name), outer["vision_config"].get(official)):
        if value is not None:
            return value
    return default


def attention_function(kernel_backend: str) -> Callable[..., torch.Tensor]:
    """`varlen_attention` of the torch reference or of the Triton module (imported only when asked for)."""
    modules = {"torch": "vision_attention", "triton": "triton_vision_attention"}
    if kernel_backend not in modules:
        raise ValueError(f"kernel backend must be 'torch' or 'triton', got {kernel_backend!r}")
    return importlib.import_module(f"reasoning_engine.kernels.{modules[kernel_backend]}").varlen_attention


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in float32 on channel pairs (i, i + head_dim / 2); x [T, heads, head_dim], cos/sin
    [T, 1, head_dim]."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class VisionBlock(nn.Module):
    """Pre-norm block: x + proj(attention(norm1(x))), then + fc2(gelu(fc1(norm2(x)))). q, k and v are one matmul."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.approximate = _GELU_APPROXIMATION[config.hidden_act]
        self.norm1 = nn.LayerNorm(dim, eps=_LAYER_NORM_EPS)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=_LAYER_NORM_EPS)
        self.fc1 = nn.Linear(dim, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, dim)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cu_seqlens: torch.Tensor,
                max_seqlen: int, attention: Callable[..., torch.Tensor]) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv(self.norm1(x)).view(tokens, 3, self.num_heads, self.head_dim)
        q, k = (rotate_pairs(qkv[:, i], *rotary) for i in (0, 1))
        out = attention(q, k, qkv[:, 2], cu_seqlens, self.head_dim ** -0.5, max_seqlen)
        x = x + self.proj(out.reshape(tokens, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate=self.approximate))


class Projector(nn.Module):
    """Per-patch LayerNorm, a merged group's patches concatenated, then Linear -> GELU -> Linear to the text width."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        merged = config.hidden_size * config.merge_area
        self.pre_norm = nn.LayerNorm(config.hidden_size, eps=config.projector_eps)
        self.in_proj = nn.Linear(merged, merged)
        self.out_proj = nn.Linear(merged, config.text_hidden_size)

    def forward(self, groups: torch.Tensor) -> torch.Tensor:
        """groups [M, kh * kw, hidden] -> [M, text_hidden]."""
        x = self.pre_norm(groups).reshape(groups.shape[0], -1)
        return self.out_proj(F.gelu(self.in_proj(x)))


class KimiVisionEncoder(nn.Module):
    """Pixels of several images / video chunks -> one [num_tokens_i, text_hidden] tensor of embeddings per item."""

    def __init__(self, config: VisionConfig, kernel_backend: str = "torch") -> None:
        super().__init__()
        self.config = config
        self.attention = attention_function(kernel_backend)
        dim, patch = config.hidden_size, config.patch_size
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.pos_emb = nn.Parameter(torch.empty(config.pos_emb_height, config.pos_emb_width, dim))
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(dim, eps=_LAYER_NORM_EPS)
        self.projector = Projector(config)

    def forward(self, pixel_values: torch.Tensor, grid_thws: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """pixel_values [sum of t*h*w, 3, P, P]: the items' patches concatenated as the Kimi K2.5 image / video
        processors return them (per item: frame-major, then row-major patches); grid_thws one (t, h, w) per item.
        Returns, per item, [h * w / (kh * kw), text_hidden] in the parameters' dtype."""
        grids = [tuple(int(v) for v in grid) for grid in grid_thws]
        self._check_inputs(pixel_values, grids)
        weight = self.patch_embed.weight
        # a stride-P convolution over P x P inputs is one matmul over the flattened patches
        pixels = pixel_values.to(device=weight.device, dtype=weight.dtype).flatten(1)
        x = F.linear(pixels, weight.flatten(1), self.patch_embed.bias)
        x = x + self._position_embeddings(grids, x.device).to(x.dtype)
        rotary = self._rotary_tables(grids, x.device)
        lengths = [t * h * w for t, h, w in grids]
        cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=x.device)
        for block in self.blocks:
            x = block(x, rotary, cu_seqlens, max(lengths), self.attention)
        embeds = self.projector(self._merge(self.final_norm(x), grids))
        return list(embeds.split([self.config.num_tokens(grid) for grid in grids]))

    def _check_inputs(self, pixel_values: torch.Tensor, grids: list[tuple[int, ...]]) -> None:
        cfg = self.config
        patch = cfg.patch_size
        if not grids:
            raise ValueError("no items to encode")
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, patch, patch):
            raise ValueError(f"pixel_values must be [patches, 3, {patch}, {patch}], got {list(pixel_values.shape)}")
        kh, kw = cfg.merge_kernel
        for grid in grids:
            t, h, w = grid
            if h <= 0 or w <= 0 or h % kh or w % kw:
                raise ValueError(f"grid {grid}: height and width must be positive multiples of the merge kernel "
                                 f"{kh}x{kw}")
            if not 1 <= t <= cfg.pos_emb_time:
                raise ValueError(f"grid {grid}: a chunk has 1 to {cfg.pos_emb_time} frames")
        total = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape[0] != total:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, the grids {grids} need {total}")

    def _position_embeddings(self, grids: list[tuple[int, ...]], device: torch.device) -> torch.Tensor:
        """[tokens, hidden] float32: the learned table resized to each item's grid, plus the frame's sinusoid for
        multi-frame chunks (single frames, images, get none)."""
        table = self.pos_emb.float().permute(2, 0, 1).unsqueeze(0)  # [1, hidden, H0, W0]
        dim = table.shape[1]
        frames = _frame_embeddings(self.config.pos_emb_time, dim, device)
        resized: dict[tuple[int, int], torch.Tensor] = {}
        parts = []
        for t, h, w in grids:
            if (h, w) not in resized:
                grid = table if (h, w) == tuple(table.shape[2:]) else F.interpolate(
                    table, size=(h, w), mode="bicubic", align_corners=False)
                resized[h, w] = grid[0].permute(1, 2, 0).reshape(h * w, dim)
            spatial = resized[h, w]
            parts.append(spatial if t == 1 else (spatial[None] + frames[:t, None]).reshape(t * h * w, dim))
        return torch.cat(parts)

    def _rotary_tables(self, grids: list[tuple[int, ...]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [tokens, 1, head_dim]: channel j < head_dim / 2 and its partner j + head_dim / 2 turn by
        column * f_(j // 2) for even j and row * f_(j // 2) for odd j, with f_i = theta^(-4i / head_dim)."""
        head_dim = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (
            torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device=device) / (head_dim // 2)))
        rows = torch.cat([torch.arange(h, device=device).repeat_interleave(w).repeat(t) for t, h, w in grids])
        cols = torch.cat([torch.arange(w, device=device).repeat(t * h) for t, h, w in grids])
        pairs = torch.stack([cols[:, None] * inv_freq, rows[:, None] * inv_freq], dim=-1).flatten(1)
        angles = torch.cat([pairs, pairs], dim=-1).unsqueeze(1)
        return angles.cos(), angles.sin()

    def _merge(self, x: torch.Tensor, grids: list[tuple[int, ...]]) -> torch.Tensor:
        """[tokens, hidden] -> [merged tokens, kh * kw, hidden]: each kh x kw neighbourhood (row-major inside) becomes
        one token, averaged over the chunk's frames in float32."""
        kh, kw = self.config.merge_kernel
        dim = x.shape[-1]
        parts = []
        for (t, h, w), item in zip(grids, x.split([t * h * w for t, h, w in grids])):
            blocks = item.view(t, h // kh, kh, w // kw, kw, dim).permute(0, 1, 3, 2, 4, 5)
            parts.append(blocks.float().mean(0).reshape(-1, kh * kw, dim).to(x.dtype))
        return torch.cat(parts)

    # ---- weights ----
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from checkpoint tensors named from the checkpoint root (`vision_tower.`,
        `mm_projector.`, optionally under `model.`), in Moonshot's or transformers' naming (module docstring).
        An unknown, duplicated or missing tensor is a ValueError naming it."""
        params = dict(self.named_parameters())
        filled: dict[str, set[int | None]] = {}
        for name, tensor in weights:
            target = _weight_target(name)
            if target is None or target.param not in params:
                raise ValueError(f"unexpected vision tensor {name!r} in the checkpoint")
            param = params[target.param]
            done = filled.setdefault(target.param, set())
            if None in done or target.qkv_part in done or (target.qkv_part is None and done):
                raise ValueError(f"vision tensor {name!r} fills {target.param}, which another tensor already filled")
            dest = param.data
            if target.qkv_part is not None:
                dim = self.config.hidden_size
                dest = dest[target.qkv_part * dim : (target.qkv_part + 1) * dim]
            check_shape(name, dest.shape, tensor.shape)
            if target.interleaved_rotary:
                tensor = _split_rotary_pairs(tensor, self.config.num_heads)
            with torch.no_grad():
                dest.copy_(tensor)
            done.add(target.qkv_part)
        for param in params:
            done = filled.get(param, set())
            if None not in done and not {0, 1, 2} <= done:
                raise ValueError(f"the checkpoint has no tensor for vision parameter {param} "
                                 f"(Moonshot name {_checkpoint_name(param)!r})")


def _frame_embeddings(frames: int, dim: int, device: torch.device) -> torch.Tensor:
    """[frames, dim] float32: frame f's [sin(f * w_i), cos(f * w_i)] with w_i = 10000^(-2i / dim)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    angles = torch.arange(frames, dtype=torch.float32, device=device)[:, None] * inv_freq
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def _split_rotary_pairs(wqkv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Moonshot's fused qkv rows (weight or bias) with each q/k head's rotary pairs moved from channels (2i, 2i + 1)
    to (i, i + head_dim / 2); v is unchanged."""
    q, k, v = wqkv.chunk(3)

    def regroup(rows: torch.Tensor) -> torch.Tensor:
        return rows.reshape(num_heads, -1, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)

    return torch.cat([regroup(q), regroup(k), v])


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: our parameter, which third of the fused qkv (None: all of it), and whether
    its q/k rows pair rotary channels Moonshot's way."""

    param: str
    qkv_part: int | None = None
    interleaved_rotary: bool = False


# Moonshot's names (first) and transformers' module names of everything outside the blocks, -> ours
_OFFICIAL_MODULES = {
    "vision_tower.patch_embed.proj": "patch_embed",
    "vision_tower.encoder.final_layernorm": "final_norm",
    "mm_projector.pre_norm": "projector.pre_norm",
    "mm_projector.proj.0": "projector.in_proj",
    "mm_projector.proj.2": "projector.out_proj",
}
_OTHER_MODULES = {
    "vision_tower.encoder.patch_embed.proj": "patch_embed",  # where transformers 5.24's save_pretrained puts it
    "vision_tower.final_layernorm": "final_norm",
    "mm_projector.in_proj": "projector.in_proj",
    "mm_projector.out_proj": "projector.out_proj",
}
_OFFICIAL_POS_EMB = "vision_tower.patch_embed.pos_emb.weight"
_TRANSFORMERS_POS_EMB = "vision_tower.patch_embed.pos_emb.position_embeddings"
_OFFICIAL_BLOCK = re.compile(r"vision_tower\.encoder\.blocks\.(\d+)\.(.+)\.(weight|bias)")
_TRANSFORMERS_BLOCK = re.compile(r"vision_tower\.layers\.(\d+)\.(.+)\.(weight|bias)")
_OFFICIAL_BLOCK_PARTS = {
    "norm0": "norm1", "norm1": "norm2", "wqkv": "qkv", "wo": "proj", "mlp.fc0": "fc1", "mlp.fc1": "fc2",
}
_TRANSFORMERS_BLOCK_PARTS = {
    "norm1": "norm1", "norm2": "norm2", "attn.proj": "proj", "mlp.fc1": "fc1", "mlp.fc2": "fc2",
}
_TRANSFORMERS_QKV = {"attn.q_proj": 0, "attn.k_proj": 1, "attn.v_proj": 2}


def _weight_target(name: str) -> _Target | None:
    """Our parameter for a checkpoint tensor name (a leading `model.` ignored), or None if it is not one of ours."""
    name = name.removeprefix("model.")
    if name in (_OFFICIAL_POS_EMB, _TRANSFORMERS_POS_EMB):
        return _Target("pos_emb")
    if match := _OFFICIAL_BLOCK.fullmatch(name):
        index, part, kind = match.groups()
        if part not in _OFFICIAL_BLOCK_PARTS:
            return None
        return _Target(f"blocks.{index}.{_OFFICIAL_BLOCK_PARTS[part]}.{kind}", interleaved_rotary=part == "wqkv")
    if match := _TRANSFORMERS_BLOCK.fullmatch(name):
        index, part, kind = match.groups()
        if part in _TRANSFORMERS_QKV:
            return _Target(f"blocks.{index}.qkv.{kind}", qkv_part=_TRANSFORMERS_QKV[part])
        if part not in _TRANSFORMERS_BLOCK_PARTS:
            return None
        return _Target(f"blocks.{index}.{_TRANSFORMERS_BLOCK_PARTS[part]}.{kind}")
    module, _, kind = name.rpartition(".")
    ours = _OFFICIAL_MODULES.get(module) or _OTHER_MODULES.get(module)
    return _Target(f"{ours}.{kind}") if ours and kind in ("weight", "bias") else None


def _checkpoint_name(param: str) -> str:
    """Moonshot's checkpoint name of one of our parameters (for error messages)."""
    if param == "pos_emb":
        return _OFFICIAL_POS_EMB
    module, _, kind = param.rpartition(".")
    if match := re.fullmatch(r"blocks\.(\d+)\.(\w+)", module):
        index, ours = match.groups()
        official = next(theirs for theirs, mine in _OFFICIAL_BLOCK_PARTS.items() if mine == ours)
        return f"vision_tower.encoder.blocks.{index}.{official}.{kind}"
    return next(theirs for theirs, mine in _OFFICIAL_MODULES.items() if mine == module) + f".{kind}"


def _vision_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's vision tower and projector tensors (under `vision_tower.` / `mm_projector.`, optionally
    `model.`); the text model's tensors are never read."""
    return read_tensors_where(model_dir, lambda name: name.removeprefix("model.").startswith(VISION_PREFIXES))


def build_vision_encoder(model_dir: Path | str, dtype: torch.dtype, device: torch.device | str,
                         kernel_backend: str = "torch", load_format: str = "auto") -> KimiVisionEncoder | None:
    """The checkpoint's vision encoder with its weights loaded (random ones with load_format "dummy", as the text
    model gets), or None when the model has none (model_type other than kimi_k25)."""
    root = Path(model_dir)
    config_file = root / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {root}: not a Hugging Face checkpoint folder")
    outer = json.loads(config_file.read_text())
    if outer.get("model_type") != "kimi_k25":
        return None
    config = VisionConfig.from_config(outer)
    return build_loaded(lambda: KimiVisionEncoder(config, kernel_backend), dtype, device, load_format,
                        lambda encoder: encoder.load_weights(_vision_tensors(root)))
