"""GLM-5.3-Flash image preprocessing: pixel patches and grids computed here, placeholder runs spliced into ids.

The chat template leaves one `<|image|>` per image (between `<|begin_of_image|>` and `<|end_of_image|>`);
`Glm5MediaProcessor.expand` widens it to `grid_h * grid_w / merge_size**2` copies, as transformers'
`Glm5NextProcessor` does, and the model scatters the image's rows into those positions. Videos are not supported
(their frames reuse the image token inside `<|begin_of_video|>` spans): `supports_video` is False.

Pixels, in plain torch, equal to transformers' `Glm5NextImageProcessor` (tests/multimodal/test_glm5_processing.py
compares them), per image:
1. RGB as for Kimi K2.5 (`processing.rgb_pixels`: transparency composited onto white);
2. the canvas: sides rounded up to whole `factor = patch_size * merge_size` windows; an image of fewer than
   `min_image_tokens` tokens is first scaled up to that many, one of more than `max_image_tokens` gets the tallest
   canvas within the budget whose width follows the aspect ratio (a search over the height), where a token is
   `temporal_patch_size` frames of a factor x factor window;
3. the content: the image scaled to fit the canvas (never up unless it was under the minimum), resized with torch's
   antialiased bicubic kernel on the uint8 pixels, then zero padding at the bottom and right up to the canvas;
4. `(pixel - mean / rescale_factor) / (std / rescale_factor)` in float32 (CLIP's mean and std by default);
5. rows of `channels x temporal_patch_size x patch x patch` (the image repeated over the temporal patch), merge
   windows row-major and the window's patches row-major inside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image

from reasoning_engine.multimodal.inputs import MediaItem, content_hash
from reasoning_engine.multimodal.processing import PixelSettings, ProcessedImage, VideoSettings, load_json, rgb_pixels

IMAGE_TOKEN = "<|image|>"
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class Glm5ImageSettings:
    """How images become patch rows; the defaults are transformers' `Glm5NextImageProcessor`'s."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_image_tokens: int = 16
    max_image_tokens: int = 8000
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    patch_expand_factor: int = 1

    @property
    def factor(self) -> int:
        """The canvas's sides are multiples of this many pixels."""
        return self.patch_size * self.merge_size * self.patch_expand_factor

    @property
    def row_width(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size ** 2


def canvas_size(height: int, width: int, s: Glm5ImageSettings) -> tuple[int, int]:
    """Step 2 of the module docstring: the padded canvas's (height, width) in pixels."""
    factor, frames = s.factor, s.temporal_patch_size
    per_token = frames * factor ** 2
    low, high = s.min_image_tokens * per_token, s.max_image_tokens * per_token

    def up(value: float) -> int:
        return math.ceil(value / factor) * factor

    canvas = (up(height), up(width))
    if frames * canvas[0] * canvas[1] < low:
        scale = math.sqrt(low / (frames * height * width))
        canvas = (up(max(1, math.ceil(height * scale))), up(max(1, math.ceil(width * scale))))
    if frames * canvas[0] * canvas[1] > high:
        if high < frames * factor ** 2:
            raise ValueError(f"max_image_tokens={s.max_image_tokens} is too small for one {factor}-pixel window")
        best, lo, hi = (factor, factor), 1, height
        while lo <= hi:  # the tallest content height whose canvas fits the budget
            mid = (lo + hi) // 2
            candidate = (up(mid), up(max(1, math.floor(width * mid / height))))
            if frames * candidate[0] * candidate[1] <= high:
                best, lo = candidate, mid + 1
            else:
                hi = mid - 1
        canvas = best
    return canvas


def content_size(height: int, width: int, s: Glm5ImageSettings) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized height, width), (canvas height, width)): step 3's scale, at most 1 unless the image is under the
    token minimum."""
    canvas = canvas_size(height, width, s)
    scale = min(canvas[0] / height, canvas[1] / width)
    if s.temporal_patch_size * height * width >= s.temporal_patch_size * s.factor ** 2 * s.min_image_tokens:
        scale = min(1.0, scale)
    resized = (max(1, min(canvas[0], math.floor(height * scale))), max(1, min(canvas[1], math.floor(width * scale))))
    return resized, canvas


def image_rows(pixels: torch.Tensor, s: Glm5ImageSettings) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """uint8 [3, H, W] -> float32 patch rows [grid_h * grid_w, row_width] and the grid (1, grid_h, grid_w)."""
    channels, height, width = pixels.shape
    (new_height, new_width), (pad_height, pad_width) = content_size(height, width, s)
    frames = pixels.unsqueeze(0)
    if (new_height, new_width) != (height, width):
        frames = F.interpolate(frames.contiguous(), size=(new_height, new_width), mode="bicubic", align_corners=False,
                               antialias=True)
    canvas = frames.new_zeros(1, channels, pad_height, pad_width)
    canvas[..., :new_height, :new_width] = frames
    scale = 1.0 / s.rescale_factor
    mean = (torch.tensor(s.image_mean, dtype=torch.float32) * scale).view(-1, 1, 1)
    std = (torch.tensor(s.image_std, dtype=torch.float32) * scale).view(-1, 1, 1)
    image = canvas[0].to(torch.float32).sub_(mean).div_(std)
    p, m = s.patch_size, s.merge_size
    grid_h, grid_w = pad_height // p, pad_width // p
    windows = image.reshape(channels, grid_h // m, m, p, grid_w // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    rows = windows.unsqueeze(5).expand(-1, -1, -1, -1, -1, s.temporal_patch_size, -1, -1)
    return rows.reshape(grid_h * grid_w, s.row_width), (1, grid_h, grid_w)


def _settings(cfg: dict[str, Any], where: str) -> Glm5ImageSettings:
    """Settings from a transformers image processor dict (unset or null keys take the class defaults); options this
    module does not implement are refused rather than silently ignored."""
    for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if cfg.get(flag) is False:
            raise ValueError(f"{where}: {flag}=false is not supported")
    if cfg.get("resample") not in (None, 3):
        raise ValueError(f"{where}: resample={cfg['resample']} is not supported, only bicubic (3)")
    defaults = Glm5ImageSettings()

    def get(key: str) -> Any:
        value = cfg.get(key)
        if value is None:
            return getattr(defaults, key)
        return tuple(value) if isinstance(value, list) else value

    return Glm5ImageSettings(**{key: get(key) for key in Glm5ImageSettings.__dataclass_fields__})


@dataclass
class Glm5MediaProcessor:
    """GLM-5.3-Flash's image preprocessing settings plus the tokenizer's image token id (the interface of
    `processing.MediaProcessor`, images only)."""

    settings: Glm5ImageSettings
    tokenizer: Any
    image_token: int
    supports_video = False
    # the media loader's limits and sampling rate: an image of up to max_image_tokens tokens (JPEGs are decoded
    # whole, `draft_fit` None, so the pixels are transformers')
    video = VideoSettings()
    draft_fit = None

    @property
    def image(self) -> PixelSettings:
        s = self.settings
        return PixelSettings(patch_size=s.patch_size, merge_size=s.merge_size,
                             max_patches=s.max_image_tokens * s.merge_size ** 2)

    @classmethod
    def from_model_dir(cls, folder: Path, config: dict[str, Any], tokenizer: Any) -> Glm5MediaProcessor:
        """Settings from processor_config.json's `image_processor`, else preprocessor_config.json, else the class
        defaults with the patch and merge sizes of config.json's vision_config."""
        combined = load_json(folder / "processor_config.json") or {}
        single = load_json(folder / "preprocessor_config.json") or {}
        if "image_processor" in combined:
            cfg, where = combined["image_processor"], "processor_config.json image_processor"
        elif single:
            cfg, where = single, "preprocessor_config.json"
        else:
            vision = config["vision_config"]
            cfg = {"patch_size": vision.get("patch_size"), "merge_size": vision.get("spatial_merge_size"),
                   "temporal_patch_size": vision.get("temporal_patch_size")}
            where = "config.json vision_config"
        token = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        if token is None or token == getattr(tokenizer, "unk_token_id", None):
            raise ValueError(f"tokenizer has no {IMAGE_TOKEN} token: it is not a GLM-5.3 tokenizer")
        declared = config.get("image_token_id")
        if declared is not None and declared != token:
            raise ValueError(f"config.json image_token_id={declared} but the tokenizer's {IMAGE_TOKEN} is id {token}")
        return cls(_settings(cfg, where), tokenizer, token)

    def num_image_tokens(self, width: int, height: int) -> int:
        _, (height, width) = content_size(height, width, self.settings)
        return height * width // (self.settings.patch_size * self.settings.merge_size) ** 2

    def preprocess_image(self, image: Image.Image) -> ProcessedImage:
        rows, grid = image_rows(torch.from_numpy(rgb_pixels(image)).permute(2, 0, 1), self.settings)
        return ProcessedImage(rows, grid)

    def preprocess_video(self, video: Any) -> Any:
        raise ValueError("GLM-5.3-Flash takes images but no video here")

    def _image_rows(self, image: Image.Image | ProcessedImage) -> tuple[torch.Tensor, tuple[int, int, int]]:
        if not isinstance(image, ProcessedImage):
            processed = self.preprocess_image(image)
            return processed.pixel_values, processed.grid_thw
        frames, grid_h, grid_w = image.grid_thw
        m = self.settings.merge_size
        if frames != 1 or grid_h <= 0 or grid_w <= 0 or grid_h % m or grid_w % m or image.pixel_values.shape != (
                grid_h * grid_w, self.settings.row_width):
            raise ValueError(f"preprocessed image has {tuple(image.pixel_values.shape)} patch rows for grid "
                             f"{tuple(image.grid_thw)}, not what these settings make")
        return image.pixel_values, image.grid_thw

    def expand(self, prompt_token_ids: Sequence[int], images: Sequence[Image.Image | ProcessedImage],
               videos: Sequence[Any]) -> tuple[list[int], list[MediaItem]]:
        """Widen each `<|image|>` (in order) to its image's token run; one `MediaItem` per image. Raises ValueError
        when placeholders and images don't pair up, or for any video."""
        if videos:
            raise ValueError("GLM-5.3-Flash takes images but no video here")
        slots = sum(1 for token in prompt_token_ids if token == self.image_token)
        if slots != len(images):
            raise ValueError(f"the prompt has {slots} image placeholder(s) ({IMAGE_TOKEN}) but {len(images)} image(s) "
                             "were given")
        processed = iter([self._image_rows(image) for image in images])
        merge = self.settings.merge_size ** 2
        ids: list[int] = []
        items: list[MediaItem] = []
        for token in prompt_token_ids:
            if token != self.image_token:
                ids.append(token)
                continue
            pixels, grid = next(processed)
            length = math.prod(grid) // merge
            items.append(MediaItem("image", content_hash(pixels, grid), len(ids), length, pixels, grid))
            ids.extend([token] * length)
        return ids, items
