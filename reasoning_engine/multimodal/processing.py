"""Kimi K2.5 media preprocessing: pixel patches and grids computed here, placeholder runs spliced into ids
(multimodal/processors.py picks it or GLM-5.3-Flash's, multimodal/glm5_processing.py).

The chat template leaves one `<|media_pad|>` per image and one `<|kimi_k25_video_placeholder|>` per video in the
prompt. `MediaProcessor.expand` turns those token ids into exactly what transformers' `Kimi_K25Processor` produces
from the same text, without re-tokenizing the prompt:

- an image's `<|media_pad|>` becomes `grid_h * grid_w / merge_size**2` copies of itself;
- a video's placeholder becomes, per chunk of `temporal_patch_size` frames,
  `HH:MM:SS.mmm<|media_begin|>video<|media_content|>` + `grid_h * grid_w / merge_size**2` video placeholders +
  `<|media_end|>` (a chunk costs one frame's worth of tokens: the encoder pools its frames).

The modeling code scatters image features into the `<|media_pad|>` positions and video features into the
`<|kimi_k25_video_placeholder|>` positions, so each `MediaItem` covers one such run.

Pixels are computed here in plain torch, bit-identical to transformers' `Kimi_K25ImageProcessor` /
`Kimi_K25VideoProcessor` (tests/multimodal/test_processing.py compares them), because those processors need
torchvision, which often cannot load beside a CPU build of torch. Per image or video frame:

1. RGB: an image with alpha (or palette transparency) is composited onto white, any other converted by PIL;
2. size: the largest scale <= 1 that keeps the patch count within `max_patches` and each side within
   `max_patches_per_side` patches (`navit_size`), applied with torch's antialiased bicubic resize on the uint8
   pixels (the kernel torchvision runs on CPU, rounding and clamping included); no resize when the size is kept;
3. zero padding at the bottom and right up to whole `patch_size * merge_size` windows;
4. `(pixel - mean / rescale_factor) / (std / rescale_factor)` in float32: rescale and normalise fused, as there;
5. patch rows `[channels, patch_size, patch_size]`, frame by frame, patches in raster order of the grid.

A video without frame indices is the whole clip and is first sampled at the processor's `fps` (`sample_indices`);
every `temporal_patch_size` consecutive frames (the last chunk may have fewer) are one item with grid
`(frames, grid_h, grid_w)`, stamped with its first frame's time in the source.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from reasoning_engine.multimodal.inputs import MediaItem, content_hash

IMAGE_TOKEN = "<|media_pad|>"
VIDEO_TOKEN = "<|kimi_k25_video_placeholder|>"
MEDIA_BEGIN = "<|media_begin|>"
MEDIA_CONTENT = "<|media_content|>"
MEDIA_END = "<|media_end|>"
VIDEO_WORD = "video"  # the text between <|media_begin|> and <|media_content|> of each video chunk


@dataclass(frozen=True)
class VideoInput:
    """One decoded video: RGB frames plus what the prompt's chunk timestamps are computed from.

    `frames` is a uint8 array [T, H, W, 3]. `fps` is the source frame rate. `frame_indices` gives each row's frame
    number in the source when the frames are already sampled (the loader samples while decoding so a long video never
    sits in memory whole); the processor then keeps every row and stamps chunk `k` with
    `frame_indices[k * temporal_patch_size] / fps`. Without it the rows are the whole clip and `MediaProcessor`
    samples them at the video settings' rate (`fps`, 2 for Kimi K2.5), as transformers does.
    """

    frames: np.ndarray
    fps: float
    frame_indices: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.frames.ndim != 4 or self.frames.shape[-1] != 3 or self.frames.shape[0] == 0:
            raise ValueError(f"video frames must be a non-empty [T, H, W, 3] array, got shape {self.frames.shape}")
        if self.frames.dtype != np.uint8:
            raise ValueError(f"video frames must be uint8, got {self.frames.dtype}")
        if not self.fps > 0:
            raise ValueError(f"video fps must be positive, got {self.fps}")
        if self.frame_indices is not None and len(self.frame_indices) != len(self.frames):
            raise ValueError(f"{len(self.frame_indices)} frame indices for {len(self.frames)} frames")

    def metadata(self) -> dict[str, Any]:
        """The `video_metadata` entry transformers' video processor takes for this video (to check against it)."""
        height, width = self.frames.shape[1:3]
        if self.frame_indices is None:
            total = len(self.frames)
            return {"total_num_frames": total, "fps": self.fps, "height": height, "width": width,
                    "duration": total / self.fps}
        total = self.frame_indices[-1] + 1
        return {"total_num_frames": total, "fps": self.fps, "height": height, "width": width,
                "duration": total / self.fps, "frames_indices": list(self.frame_indices)}


@dataclass(frozen=True)
class MediaTokens:
    """Token ids of Kimi's media markers in this tokenizer; `video` is None when the tokenizer lacks the video
    placeholder (the hub's original tokenizer), and then prompts cannot carry videos."""

    image: int
    video: int | None
    begin: int
    content: int
    end: int
    video_word: tuple[int, ...]  # "video" as the tokenizer encodes it between two special tokens

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> MediaTokens:
        def lookup(token: str) -> int | None:
            token_id = tokenizer.convert_tokens_to_ids(token)
            unknown = getattr(tokenizer, "unk_token_id", None)
            return None if token_id is None or (token_id == unknown and token != tokenizer.unk_token) else token_id

        ids = {token: lookup(token) for token in (IMAGE_TOKEN, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END)}
        missing = [token for token, token_id in ids.items() if token_id is None]
        if missing:
            raise ValueError(f"tokenizer has no {', '.join(missing)} token: it is not a Kimi K2.5 tokenizer")
        return cls(image=ids[IMAGE_TOKEN], video=lookup(VIDEO_TOKEN), begin=ids[MEDIA_BEGIN],
                   content=ids[MEDIA_CONTENT], end=ids[MEDIA_END],
                   video_word=tuple(tokenizer.encode(VIDEO_WORD, add_special_tokens=False)))


@dataclass(frozen=True)
class VideoChunk:
    """One chunk of a processed video: its patches, grid and the timestamp that opens its prompt run."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    timestamp: float


@dataclass(frozen=True)
class ProcessedImage:
    """An image already cut into patch rows (`MediaProcessor.preprocess_image`); `expand` takes it in place of the
    image. The server preprocesses each image as soon as it is decoded, so a request holds model-size patches, never
    more than one full-size decode."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]


@dataclass(frozen=True)
class ProcessedVideo:
    """A video already cut into chunks (`MediaProcessor.preprocess_video`); `expand` takes it in place of the video."""

    chunks: tuple[VideoChunk, ...]


def timestamp_text(seconds: float) -> str:
    """`HH:MM:SS.mmm` exactly as the processor writes it (whole seconds as `time.gmtime` counts them, so hours wrap
    at a day, and milliseconds truncated)."""
    whole = int(seconds)
    return f"{whole // 3600 % 24:02d}:{whole // 60 % 60:02d}:{whole % 60:02d}.{int(seconds % 1 * 1000):03d}"


def sample_indices(total: int, source_fps: float, fps: float) -> list[int]:
    """Frames to keep to see `fps` frames a second: transformers' uniform rule (`total * i // count`), so the loader,
    which samples while decoding, and `process_video`, given a whole clip, pick the frames transformers would. A source
    slower than `fps` keeps every frame (transformers raises there)."""
    count = min(total, max(1, int(total / source_fps * fps)))
    return [i * total // count for i in range(count)]


@dataclass(frozen=True)
class PixelSettings:
    """How images or video frames become patch rows; the defaults are Kimi K2.5's image processor's. Sizes are in
    patches: `max_patches` in all, `max_patches_per_side` along each side (transformers' `size.max_height`)."""

    patch_size: int = 14
    merge_size: int = 2
    max_patches: int = 16384
    max_patches_per_side: int = 512
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255


@dataclass(frozen=True)
class VideoSettings:
    """Frames' pixel settings (Kimi K2.5 allows a frame 4096 patches), the sampling rate for whole clips, and the
    frames per chunk."""

    pixels: PixelSettings = field(default_factory=lambda: PixelSettings(max_patches=4096))
    fps: float = 2.0
    temporal_patch_size: int = 4


def navit_size(height: int, width: int, settings: PixelSettings) -> tuple[tuple[int, int], tuple[int, int]]:
    """(resized, padded) height and width. Kimi's rule: the patch count is taken over whole patches of the original
    size (at least one each way), the image is never enlarged, and padding completes the last merge window."""
    side = settings.max_patches_per_side * settings.patch_size
    patches = max(1, height // settings.patch_size) * max(1, width // settings.patch_size)
    scale = min(1.0, math.sqrt(settings.max_patches / patches), side / height, side / width)
    resized = (min(max(1, int(height * scale)), side), min(max(1, int(width * scale)), side))
    window = settings.patch_size * settings.merge_size
    padded = (-(-resized[0] // window) * window, -(-resized[1] // window) * window)
    return resized, padded


def rgb_pixels(image: Image.Image) -> np.ndarray:
    """[H, W, 3] uint8. Transparent pixels become white, as in transformers (a plain PIL convert would show whatever
    colour a transparent pixel happens to store)."""
    if not isinstance(image, Image.Image):
        raise TypeError(f"an image must be a PIL image, got {type(image).__name__}")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image.convert("RGBA"))
    return np.array(image.convert("RGB"))


def patch_rows(frames: torch.Tensor, settings: PixelSettings) -> tuple[torch.Tensor, int, int]:
    """uint8 frames [N, 3, H, W] (one size, any strides) to float32 patch rows [N * grid_h * grid_w, 3, patch, patch]
    and the grid; steps 2-5 of the module docstring. Pixels are padded and cut into patches while still uint8 (a
    quarter of the bytes to move) and only then normalised, element by element, so the values are those of
    normalising first."""
    count, channels, height, width = frames.shape
    (new_height, new_width), (pad_height, pad_width) = navit_size(height, width, settings)
    if (new_height, new_width) != (height, width):
        # Contiguous NCHW, the layout transformers resizes (torch picks among uint8 kernels by layout).
        frames = F.interpolate(frames.contiguous(), size=(new_height, new_width), mode="bicubic",
                               align_corners=False, antialias=True)
    canvas = frames.new_zeros(count, channels, pad_height, pad_width)
    canvas[..., :new_height, :new_width] = frames
    patch = settings.patch_size
    grid_h, grid_w = pad_height // patch, pad_width // patch
    patches = canvas.reshape(count, channels, grid_h, patch, grid_w, patch).permute(0, 2, 4, 1, 3, 5)
    rows = patches.reshape(count * grid_h * grid_w, channels, patch, patch).to(torch.float32)
    scale = 1.0 / settings.rescale_factor
    mean = (torch.tensor(settings.image_mean, dtype=torch.float32) * scale).view(-1, 1, 1)
    std = (torch.tensor(settings.image_std, dtype=torch.float32) * scale).view(-1, 1, 1)
    return rows.sub_(mean).div_(std), grid_h, grid_w


def _check_rows(rows: torch.Tensor, grid: tuple[int, int, int], settings: PixelSettings, max_frames: int) -> None:
    """Preprocessed patches must be what these settings make: one row per grid cell, patch-sized, whole merge
    windows."""
    frames, grid_h, grid_w = grid
    patch, merge = settings.patch_size, settings.merge_size
    if not 1 <= frames <= max_frames or grid_h % merge or grid_w % merge or grid_h <= 0 or grid_w <= 0:
        raise ValueError(f"preprocessed media has grid {tuple(grid)}, not one these settings make")
    if rows.dim() != 4 or rows.shape[0] != frames * grid_h * grid_w or tuple(rows.shape[2:]) != (patch, patch):
        raise ValueError(f"preprocessed media has {tuple(rows.shape)} patch rows for grid {tuple(grid)}, expected "
                         f"[{frames * grid_h * grid_w}, channels, {patch}, {patch}]")


def load_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _from_media_proc_cfg(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Image and video processor settings from the hub's remote-code `media_proc_cfg` (moonshotai/Kimi-K2.5 ships
    only that in preprocessor_config.json): the same limits under transformers' names."""
    common: dict[str, Any] = {}
    if "patch_size" in cfg:
        common["patch_size"] = cfg["patch_size"]
    if "merge_kernel_size" in cfg:
        common["merge_size"] = cfg["merge_kernel_size"]
    for key in ("image_mean", "image_std"):
        if cfg.get(key) is not None:
            common[key] = cfg[key]
    if cfg.get("patch_limit_on_one_side") is not None:
        side = cfg["patch_limit_on_one_side"]
        common["size"] = {"max_height": side, "max_width": side}
    image, video = dict(common), dict(common)
    if cfg.get("in_patch_limit") is not None:
        image["max_patches"] = cfg["in_patch_limit"]
    if cfg.get("in_patch_limit_each_frame") is not None:
        video["max_patches"] = cfg["in_patch_limit_each_frame"]
    if cfg.get("sample_fps") is not None:
        video["fps"] = cfg["sample_fps"]
    if cfg.get("temporal_merge_kernel_size") is not None:
        video["temporal_patch_size"] = cfg["temporal_merge_kernel_size"]
    return image, video


def _from_vision_config(vision: dict[str, Any]) -> dict[str, Any]:
    """Patch and merge sizes from config.json's vision_config, for a folder with no preprocessor config at all."""
    settings: dict[str, Any] = {}
    if "patch_size" in vision:
        settings["patch_size"] = vision["patch_size"]
    merge = vision.get("merge_kernel_size")
    if merge is not None:
        settings["merge_size"] = merge[0] if isinstance(merge, (list, tuple)) else merge
    return settings


def _floats(value: float | Sequence[float]) -> tuple[float, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _pixel_settings(cfg: dict[str, Any], where: str, max_patches: int) -> PixelSettings:
    """Settings from a transformers processor dict (unset or null keys take the processor's class defaults). Options
    Kimi K2.5 never changes and this module does not implement are refused rather than silently ignored."""
    for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb", "do_sample_frames"):
        if cfg.get(flag) is False:
            raise ValueError(f"{where}: {flag}=false is not supported")
    if cfg.get("resample") not in (None, 3):
        raise ValueError(f"{where}: resample={cfg['resample']} is not supported, only bicubic (3)")
    if cfg.get("num_frames") is not None:
        raise ValueError(f"{where}: num_frames is not supported, videos are sampled by fps")
    size = cfg.get("size") or {}
    side = size.get("max_height", PixelSettings.max_patches_per_side)
    if size.get("max_width", side) != side:
        raise ValueError(f"{where}: size must have equal max_height and max_width, got {size}")

    def get(key: str, default: Any) -> Any:
        return default if cfg.get(key) is None else cfg[key]

    return PixelSettings(patch_size=get("patch_size", PixelSettings.patch_size),
                         merge_size=get("merge_size", PixelSettings.merge_size),
                         max_patches=get("max_patches", max_patches), max_patches_per_side=side,
                         image_mean=_floats(get("image_mean", PixelSettings.image_mean)),
                         image_std=_floats(get("image_std", PixelSettings.image_std)),
                         rescale_factor=get("rescale_factor", PixelSettings.rescale_factor))


def _video_settings(cfg: dict[str, Any], where: str) -> VideoSettings:
    defaults = VideoSettings()
    return VideoSettings(_pixel_settings(cfg, where, defaults.pixels.max_patches),
                         fps=cfg.get("fps") or defaults.fps,
                         temporal_patch_size=cfg.get("temporal_patch_size") or defaults.temporal_patch_size)


def _check_config_ids(config: dict[str, Any], tokens: MediaTokens) -> None:
    """The model scatters features by the ids in config.json; a tokenizer disagreeing would misplace them."""
    declared = {"image_token_id": config.get("image_token_id", config.get("media_placeholder_token_id")),
                "video_token_id": config.get("video_token_id")}
    actual = {"image_token_id": tokens.image, "video_token_id": tokens.video}
    for name, value in declared.items():
        if value is not None and actual[name] is not None and value != actual[name]:
            raise ValueError(f"config.json {name}={value} but the tokenizer's placeholder is id {actual[name]}")


@dataclass
class MediaProcessor:
    """Kimi K2.5's image and video preprocessing settings plus the tokenizer's media token ids.

    Thread-safe as long as nothing reconfigures the tokenizer (truncation, padding) concurrently: the server may call
    `expand` from worker threads.
    """

    image: PixelSettings
    video: VideoSettings
    tokenizer: Any
    tokens: MediaTokens

    @classmethod
    def from_model_dir(cls, path: str | Path, tokenizer: Any | None = None) -> MediaProcessor | None:
        """None for a checkpoint that is not multimodal Kimi K2.5 (config.json's model_type is not kimi_k25, or it has
        no vision_config).

        Settings come, in the order transformers' `from_pretrained` reads them, from transformers' saved format
        (processor_config.json's `image_processor` / `video_processor`, else preprocessor_config.json with an
        `image_processor_type` / video_preprocessor_config.json), else from the hub's remote-code `media_proc_cfg`,
        else from the processors' defaults with patch and merge sizes from vision_config. Pass the engine's
        `tokenizer` to avoid loading it twice.
        """
        folder = Path(path)
        config = load_json(folder / "config.json") or {}
        if config.get("model_type") != "kimi_k25" or not config.get("vision_config"):
            return None
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(folder))

        combined = load_json(folder / "processor_config.json") or {}
        image_file = load_json(folder / "preprocessor_config.json") or {}
        video_file = load_json(folder / "video_preprocessor_config.json") or {}
        defaults = _from_vision_config(config["vision_config"])
        hub_image, hub_video = _from_media_proc_cfg(image_file.get("media_proc_cfg") or {})
        if "image_processor" in combined:
            image_cfg, image_where = combined["image_processor"], "processor_config.json image_processor"
        elif "image_processor_type" in image_file:
            image_cfg, image_where = image_file, "preprocessor_config.json"
        else:
            image_cfg, image_where = {**defaults, **hub_image}, "preprocessor_config.json media_proc_cfg"
        if "video_processor" in combined:
            video_cfg, video_where = combined["video_processor"], "processor_config.json video_processor"
        elif video_file:
            video_cfg, video_where = video_file, "video_preprocessor_config.json"
        else:
            video_cfg, video_where = {**defaults, **hub_video}, "preprocessor_config.json media_proc_cfg"
        image = _pixel_settings(image_cfg, image_where, PixelSettings.max_patches)
        video = _video_settings(video_cfg, video_where)

        tokens = MediaTokens.from_tokenizer(tokenizer)
        _check_config_ids(config, tokens)
        return cls(image, video, tokenizer, tokens)

    @property
    def draft_fit(self) -> PixelSettings:
        """What a JPEG may be decoded down to (`loading.open_image`'s `fit`): these image settings."""
        return self.image

    def num_image_tokens(self, width: int, height: int) -> int:
        """Placeholder tokens an image of this size expands to, without touching its pixels (for early limits)."""
        _, (height, width) = navit_size(height, width, self.image)
        return height * width // (self.image.patch_size * self.image.merge_size) ** 2

    def num_video_tokens(self, num_frames: int, width: int, height: int) -> int:
        """Placeholder tokens for `num_frames` processed (already sampled) frames of this size; each chunk also adds
        its timestamp text and four marker tokens."""
        pixels = self.video.pixels
        _, (height, width) = navit_size(height, width, pixels)
        per_frame = height * width // (pixels.patch_size * pixels.merge_size) ** 2
        return math.ceil(num_frames / self.video.temporal_patch_size) * per_frame

    @property
    def supports_video(self) -> bool:
        """Whether prompts may carry videos: the tokenizer has the video placeholder."""
        return self.tokens.video is not None

    def preprocess_image(self, image: Image.Image) -> ProcessedImage:
        (rows, grid), = self.process_images([image])
        return ProcessedImage(rows, grid)

    def preprocess_video(self, video: VideoInput) -> ProcessedVideo:
        return ProcessedVideo(tuple(self.process_video(video)))

    def process_images(self, images: Sequence[Image.Image]) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
        """Each image's patch rows and grid `(1, grid_h, grid_w)`."""
        processed = []
        for image in images:
            frames = torch.from_numpy(rgb_pixels(image)).permute(2, 0, 1).unsqueeze(0)
            rows, grid_h, grid_w = patch_rows(frames, self.image)
            processed.append((rows, (1, grid_h, grid_w)))
        return processed

    def process_video(self, video: VideoInput) -> list[VideoChunk]:
        """A video's chunks with their patch rows, grids and opening timestamps. Chunk by chunk, so the resize and
        padding temporaries exist for one chunk at a time, not for the whole clip."""
        if video.frame_indices is None:
            indices = sample_indices(len(video.frames), video.fps, self.video.fps)
            frames = video.frames[indices]
        else:
            indices, frames = list(video.frame_indices), video.frames
        step = self.video.temporal_patch_size
        chunks = []
        for start in range(0, len(frames), step):
            chunk = torch.from_numpy(frames[start:start + step]).permute(0, 3, 1, 2)
            rows, grid_h, grid_w = patch_rows(chunk, self.video.pixels)
            chunks.append(VideoChunk(rows, (len(chunk), grid_h, grid_w), indices[start] / video.fps))
        return chunks

    def _image_rows(self, image: Image.Image | ProcessedImage) -> tuple[torch.Tensor, tuple[int, int, int]]:
        if not isinstance(image, ProcessedImage):
            return self.process_images([image])[0]
        _check_rows(image.pixel_values, image.grid_thw, self.image, 1)
        return image.pixel_values, image.grid_thw

    def _video_chunks(self, video: VideoInput | ProcessedVideo) -> list[VideoChunk]:
        if not isinstance(video, ProcessedVideo):
            return self.process_video(video)
        for chunk in video.chunks:
            _check_rows(chunk.pixel_values, chunk.grid_thw, self.video.pixels, self.video.temporal_patch_size)
        return list(video.chunks)

    def _chunk_prefix(self, timestamp: float) -> list[int]:
        """Ids before a chunk's placeholder run. The timestamp is tokenized on its own, as the processor's text has it
        after `<|media_end|>`; for the first chunk it follows whatever preceded the video placeholder, which tokenizes
        the same way unless that is a digit (Kimi's pre-tokenizer never joins digits to a space, letter or sign)."""
        text_ids = self.tokenizer.encode(timestamp_text(timestamp), add_special_tokens=False)
        return [*text_ids, self.tokens.begin, *self.tokens.video_word, self.tokens.content]

    def expand(self, prompt_token_ids: Sequence[int], images: Sequence[Image.Image | ProcessedImage],
               videos: Sequence[VideoInput | ProcessedVideo]) -> tuple[list[int], list[MediaItem]]:
        """Replace each image / video placeholder (in order) by its token run; one `MediaItem` per image and per video
        chunk, with offsets into the returned ids. Media may come preprocessed (`preprocess_image` /
        `preprocess_video` with these settings). Raises ValueError when placeholders and media don't pair up."""
        merge = self.image.merge_size ** 2
        video_merge = self.video.pixels.merge_size ** 2
        num_image_slots = sum(1 for token in prompt_token_ids if token == self.tokens.image)
        num_video_slots = sum(1 for token in prompt_token_ids if token == self.tokens.video) if self.tokens.video else 0
        if num_image_slots != len(images):
            raise ValueError(f"the prompt has {num_image_slots} image placeholder(s) ({IMAGE_TOKEN}) but "
                             f"{len(images)} image(s) were given")
        if videos and self.tokens.video is None:
            raise ValueError(f"the tokenizer has no {VIDEO_TOKEN} token, so the prompt cannot carry videos")
        if num_video_slots != len(videos):
            raise ValueError(f"the prompt has {num_video_slots} video placeholder(s) ({VIDEO_TOKEN}) but "
                             f"{len(videos)} video(s) were given")

        processed_images = iter([self._image_rows(image) for image in images])
        processed_videos = iter([self._video_chunks(video) for video in videos])
        ids: list[int] = []
        items: list[MediaItem] = []
        for token in prompt_token_ids:
            if token == self.tokens.image:
                pixels, grid = next(processed_images)
                length = math.prod(grid) // merge
                items.append(MediaItem("image", content_hash(pixels, grid), len(ids), length, pixels, grid))
                ids.extend([token] * length)
            elif token == self.tokens.video:
                for chunk in next(processed_videos):
                    ids.extend(self._chunk_prefix(chunk.timestamp))
                    length = chunk.grid_thw[1] * chunk.grid_thw[2] // video_merge
                    items.append(MediaItem("video", content_hash(chunk.pixel_values, chunk.grid_thw), len(ids),
                                           length, chunk.pixel_values, chunk.grid_thw))
                    ids.extend([token] * length)
                    ids.append(self.tokens.end)
            else:
                ids.append(token)
        return ids, items
