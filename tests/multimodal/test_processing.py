"""`MediaProcessor` against transformers' `Kimi_K25Processor`: same ids, bit-identical per-item pixels, same grids.

The reference is the real processor saved into a tiny model folder (byte-level BPE tokenizer with Kimi's media
tokens, 4-pixel patches, at most 8 patches a side) so most comparisons run on a few hundred patch rows; a second
pair of processors with Kimi K2.5's real defaults (14-pixel patches) checks full-size images and frames. The
reference needs torchvision (conftest.py's `torchvision_reference` makes it importable); ours never imports it.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from reasoning_engine.multimodal.processing import (
    IMAGE_TOKEN,
    MEDIA_BEGIN,
    MEDIA_CONTENT,
    MEDIA_END,
    VIDEO_TOKEN,
    MediaProcessor,
    PixelSettings,
    ProcessedImage,
    ProcessedVideo,
    VideoInput,
    VideoSettings,
    timestamp_text,
)

SPECIALS = ["<|im_end|>", "<|im_user|>", MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, IMAGE_TOKEN, VIDEO_TOKEN]
# Kimi's tiktoken split, simplified for Oniguruma: digits never take a leading space, so a video's first timestamp
# tokenizes the same after the prompt's text as on its own (the assumption `MediaProcessor._chunk_prefix` makes).
KIMI_SPLIT = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
CORPUS = ["00:00:00.000 00:00:02.333 00:00:04.000 12:34:56.789 video describe the image and the video please"] * 4


def save_tokenizer(folder: Path) -> Any:
    """A byte-level BPE with Kimi's pre-tokenizer split and a few merges (so timestamps and "video" become multi-byte
    tokens) plus Kimi's media tokens; saved and loaded back."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(KIMI_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(str(folder))


def write_config(folder: Path, tokenizer: Any, model_type: str = "kimi_k25", patch_size: int = 4) -> None:
    config = {"model_type": model_type, "vision_config": {"patch_size": patch_size, "merge_kernel_size": [2, 2]},
              "image_token_id": tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
              "video_token_id": tokenizer.convert_tokens_to_ids(VIDEO_TOKEN)}
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, torchvision_reference: Any) -> Path:
    from transformers import Kimi_K25ImageProcessor, Kimi_K25Processor, Kimi_K25VideoProcessor

    folder = tmp_path_factory.mktemp("kimi_k25_media")
    tokenizer = save_tokenizer(folder)
    small = {"size": {"max_height": 8, "max_width": 8}, "patch_size": 4}
    processor = Kimi_K25Processor(image_processor=Kimi_K25ImageProcessor(max_patches=48, **small),
                                  video_processor=Kimi_K25VideoProcessor(max_patches=16, **small), tokenizer=tokenizer)
    processor.save_pretrained(folder)
    write_config(folder, tokenizer)
    return folder


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    from transformers import Kimi_K25Processor

    return Kimi_K25Processor.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def full_size(tmp_path_factory: pytest.TempPathFactory, torchvision_reference: Any) -> tuple[MediaProcessor, Any, Any]:
    """Ours from a folder with only config.json (14-pixel patches) and transformers' processors with their defaults:
    Kimi K2.5's real limits (16384 patches an image, 4096 a frame, 512 a side)."""
    from transformers import Kimi_K25ImageProcessor, Kimi_K25VideoProcessor

    folder = tmp_path_factory.mktemp("kimi_k25_defaults")
    tokenizer = save_tokenizer(folder)
    write_config(folder, tokenizer, patch_size=14)
    media = MediaProcessor.from_model_dir(folder, tokenizer=tokenizer)
    assert media is not None
    return media, Kimi_K25ImageProcessor(), Kimi_K25VideoProcessor()


@pytest.fixture(scope="module")
def media(model_dir: Path) -> MediaProcessor:
    processor = MediaProcessor.from_model_dir(model_dir)
    assert processor is not None
    return processor


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def noise_frames(count: int, width: int, height: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def assert_runs(ids: list[int], items: list[Any], image_id: int, video_id: int) -> None:
    """Items cover exactly the placeholder positions, each run maximal and in order."""
    covered = [False] * len(ids)
    for item in items:
        token = image_id if item.kind == "image" else video_id
        assert ids[item.offset:item.end] == [token] * item.length
        for position in range(item.offset, item.end):
            covered[position] = True
    assert covered == [token in (image_id, video_id) for token in ids]


def test_one_image(media: MediaProcessor, reference: Any) -> None:
    text = f"describe {IMAGE_TOKEN} please"
    image = noise_image(30, 20, seed=0)
    expected = reference(text=text, images=[image], return_tensors="pt")
    ids, items = media.expand(media.tokenizer(text)["input_ids"], [image], [])
    assert ids == expected["input_ids"][0].tolist()
    assert len(items) == 1 and items[0].kind == "image"
    assert torch.equal(items[0].pixel_values, expected["pixel_values"])
    assert items[0].grid_thw == tuple(expected["image_grid_thw"][0].tolist())
    assert items[0].length == media.num_image_tokens(30, 20)
    assert_runs(ids, items, media.tokens.image, media.tokens.video)


def test_three_images_of_different_shapes(media: MediaProcessor, reference: Any) -> None:
    text = f"{IMAGE_TOKEN} first, then {IMAGE_TOKEN}{IMAGE_TOKEN} side by side"
    images = [noise_image(17, 41, seed=1), noise_image(100, 23, seed=2), noise_image(9, 9, seed=3)]
    expected = reference(text=text, images=images, return_tensors="pt")
    ids, items = media.expand(media.tokenizer(text)["input_ids"], images, [])
    assert ids == expected["input_ids"][0].tolist()
    assert [item.grid_thw for item in items] == [tuple(g) for g in expected["image_grid_thw"].tolist()]
    assert len({item.grid_thw for item in items}) == 3
    assert torch.equal(torch.cat([item.pixel_values for item in items]), expected["pixel_values"])
    assert [item.length for item in items] == [media.num_image_tokens(*image.size) for image in images]
    assert_runs(ids, items, media.tokens.image, media.tokens.video)


@pytest.mark.parametrize("presampled", [False, True], ids=["whole_clip", "presampled"])
def test_image_and_video(media: MediaProcessor, reference: Any, presampled: bool) -> None:
    text = f"compare {IMAGE_TOKEN} with {VIDEO_TOKEN} now"
    image = noise_image(24, 31, seed=4)
    if presampled:  # as the loader hands it over: 7 frames picked from a 3 fps source
        video = VideoInput(noise_frames(7, 30, 20, seed=5), fps=3.0, frame_indices=(0, 1, 3, 5, 7, 8, 10))
    else:  # 23 frames at 5 fps: the processor samples 9 at 2 fps, chunks of 4 + 4 + 1
        video = VideoInput(noise_frames(23, 30, 20, seed=5), fps=5.0)
    expected = reference(text=text, images=[image], videos=[video.frames], return_tensors="pt",
                         videos_kwargs={"video_metadata": [video.metadata()],
                                        "do_sample_frames": video.frame_indices is None})
    ids, items = media.expand(media.tokenizer(text)["input_ids"], [image], [video])
    assert ids == expected["input_ids"][0].tolist()

    image_item, *chunks = items
    assert image_item.kind == "image" and all(chunk.kind == "video" for chunk in chunks)
    assert torch.equal(image_item.pixel_values, expected["pixel_values"])
    assert [chunk.grid_thw for chunk in chunks] == [tuple(g) for g in expected["video_grid_thw"].tolist()]
    assert torch.equal(torch.cat([chunk.pixel_values for chunk in chunks]), expected["pixel_values_videos"])
    assert_runs(ids, items, media.tokens.image, media.tokens.video)
    text_out = media.tokenizer.decode(ids)
    stamps = ["00:00:00.000", "00:00:02.333"] if presampled else ["00:00:00.000", "00:00:02.000", "00:00:04.000"]
    assert [f"{stamp}{MEDIA_BEGIN}video{MEDIA_CONTENT}" in text_out for stamp in stamps] == [True] * len(stamps)
    assert len(chunks) == len(stamps)
    # The pieces around each run: the chunk's timestamp and markers before it, <|media_end|> right after it.
    for chunk in chunks:
        assert ids[chunk.offset - 1] == media.tokens.content and ids[chunk.end] == media.tokens.end
    frames_per_chunk = [chunk.grid_thw[0] for chunk in chunks]
    assert frames_per_chunk == ([4, 3] if presampled else [4, 4, 1])
    assert sum(chunk.length for chunk in chunks) == media.num_video_tokens(sum(frames_per_chunk), 30, 20)


def test_content_hash_follows_pixels(media: MediaProcessor) -> None:
    buffer = io.BytesIO()
    noise_image(20, 12, seed=6).save(buffer, format="PNG")
    first, second = (Image.open(io.BytesIO(buffer.getvalue())) for _ in range(2))
    other = noise_image(20, 12, seed=7)
    prompt = media.tokenizer(f"{IMAGE_TOKEN}{IMAGE_TOKEN}{IMAGE_TOKEN}")["input_ids"]
    _, items = media.expand(prompt, [first, second, other], [])
    assert items[0].content_hash == items[1].content_hash
    assert items[2].content_hash != items[0].content_hash
    _, (alone,) = media.expand(media.tokenizer(IMAGE_TOKEN)["input_ids"], [second], [])
    assert alone.content_hash == items[0].content_hash  # batching with other images does not change the pixels


def test_preprocessed_media_expand_alike(media: MediaProcessor) -> None:
    """What the server hands the engine (each item cut into patches as soon as it is decoded) expands exactly as the
    decoded media would; patches these settings could not have made are refused."""
    text = f"compare {IMAGE_TOKEN} with {VIDEO_TOKEN} now"
    image = noise_image(24, 31, seed=4)
    video = VideoInput(noise_frames(9, 30, 20, seed=5), fps=2.0, frame_indices=tuple(range(9)))
    prompt = media.tokenizer(text)["input_ids"]
    ids, items = media.expand(prompt, [image], [video])
    pre_image, pre_video = media.preprocess_image(image), media.preprocess_video(video)
    assert isinstance(pre_image, ProcessedImage) and isinstance(pre_video, ProcessedVideo)
    pre_ids, pre_items = media.expand(prompt, [pre_image], [pre_video])
    assert pre_ids == ids
    assert [(i.kind, i.content_hash, i.offset, i.length, i.grid_thw) for i in pre_items] == \
        [(i.kind, i.content_hash, i.offset, i.length, i.grid_thw) for i in items]
    one_image = media.tokenizer(IMAGE_TOKEN)["input_ids"]
    rows, grid = pre_image.pixel_values, pre_image.grid_thw
    for bad in (ProcessedImage(rows[1:], grid), ProcessedImage(rows, (1, grid[1] + 1, grid[2])),
                ProcessedImage(rows[..., :2], grid), ProcessedImage(rows, (2, grid[1], grid[2]))):
        with pytest.raises(ValueError, match="preprocessed media"):
            media.expand(one_image, [bad], [])


def test_placeholder_count_mismatch(media: MediaProcessor) -> None:
    one_image = media.tokenizer(f"look {IMAGE_TOKEN}")["input_ids"]
    image = noise_image(8, 8, seed=8)
    with pytest.raises(ValueError, match=r"1 image placeholder.*2 image"):
        media.expand(one_image, [image, image], [])
    with pytest.raises(ValueError, match=r"1 image placeholder.*0 image"):
        media.expand(one_image, [], [])
    video = VideoInput(noise_frames(2, 8, 8, seed=9), fps=2.0)
    with pytest.raises(ValueError, match=r"0 video placeholder.*1 video"):
        media.expand(one_image, [image], [video])
    with pytest.raises(ValueError, match=r"2 video placeholder.*1 video"):
        media.expand(media.tokenizer(VIDEO_TOKEN * 2)["input_ids"], [], [video])


def test_hub_media_proc_cfg_and_bare_folder(tmp_path: Path) -> None:
    """moonshotai/Kimi-K2.5 ships only a remote-code preprocessor_config.json (`media_proc_cfg`)."""
    tokenizer = save_tokenizer(tmp_path)
    write_config(tmp_path, tokenizer)
    bare = MediaProcessor.from_model_dir(tmp_path, tokenizer=tokenizer)
    assert bare is not None and bare.image == PixelSettings(patch_size=4)  # max 16384 patches, 512 a side
    assert bare.video == VideoSettings(PixelSettings(patch_size=4, max_patches=4096), fps=2.0, temporal_patch_size=4)

    cfg = {"in_patch_limit": 1000, "patch_size": 14, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
           "merge_kernel_size": 2, "patch_limit_on_one_side": 64, "in_patch_limit_each_frame": 300,
           "sample_fps": 1.0, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff"}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "auto_map": {"AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor"},
        "media_proc_cfg": cfg}))
    hub = MediaProcessor.from_model_dir(tmp_path, tokenizer=tokenizer)
    assert hub is not None
    image, video = hub.image, hub.video
    assert (image.max_patches, image.patch_size, image.merge_size, image.max_patches_per_side) == (1000, 14, 2, 64)
    assert (image.image_mean, image.image_std) == ((0.5,) * 3, (0.5,) * 3)
    assert (video.pixels.max_patches, video.pixels.max_patches_per_side, video.fps, video.temporal_patch_size) == (
        300, 64, 1.0, 4)


def test_saved_settings_match_transformers(model_dir: Path, media: MediaProcessor, reference: Any) -> None:
    """processor_config.json as `Kimi_K25Processor.save_pretrained` writes it."""
    for ours, theirs in ((media.image, reference.image_processor), (media.video.pixels, reference.video_processor)):
        assert (ours.patch_size, ours.merge_size, ours.max_patches, ours.max_patches_per_side) == (
            theirs.patch_size, theirs.merge_size, theirs.max_patches, theirs.size.max_height)
        assert (ours.image_mean, ours.image_std, ours.rescale_factor) == (
            tuple(theirs.image_mean), tuple(theirs.image_std), theirs.rescale_factor)
    assert (media.video.fps, media.video.temporal_patch_size) == (reference.video_processor.fps,
                                                                  reference.video_processor.temporal_patch_size)


def test_unsupported_settings_are_refused(tmp_path: Path) -> None:
    tokenizer = save_tokenizer(tmp_path)
    write_config(tmp_path, tokenizer)
    for bad, message in (({"do_normalize": False}, "do_normalize=false"), ({"resample": 2}, "resample=2"),
                         ({"size": {"max_height": 8, "max_width": 9}}, "equal max_height"),
                         ({"num_frames": 8}, "num_frames")):
        (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": bad}))
        with pytest.raises(ValueError, match=message):
            MediaProcessor.from_model_dir(tmp_path, tokenizer=tokenizer)


def test_not_kimi_k25(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    assert MediaProcessor.from_model_dir(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": {}}))
    assert MediaProcessor.from_model_dir(tmp_path) is None  # no vision tower


@pytest.mark.parametrize("seconds", [0.0, 0.5, 2.333333, 59.999, 61.25, 3725.007, 90000.5])
def test_timestamp_text_matches_processor_format(seconds: float) -> None:
    expected = time.strftime("%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1000):03d}"
    assert timestamp_text(seconds) == expected


def test_video_input_validation() -> None:
    with pytest.raises(ValueError, match="T, H, W, 3"):
        VideoInput(np.zeros((4, 4, 3), dtype=np.uint8), fps=2.0)
    with pytest.raises(ValueError, match="fps"):
        VideoInput(np.zeros((1, 4, 4, 3), dtype=np.uint8), fps=0.0)
    with pytest.raises(ValueError, match="2 frame indices for 1 frames"):
        VideoInput(np.zeros((1, 4, 4, 3), dtype=np.uint8), fps=2.0, frame_indices=(0, 1))
    with pytest.raises(ValueError, match="uint8"):
        VideoInput(np.zeros((1, 4, 4, 3), dtype=np.float32), fps=2.0)


def assert_image_parity(media: MediaProcessor, reference: Any, images: list[Image.Image]) -> None:
    """Ids, pixels (bit for bit), grids and token counts of one prompt with these images, ours against the
    reference `Kimi_K25Processor`."""
    text = "look " + " and ".join([IMAGE_TOKEN] * len(images)) + " now"
    expected = reference(text=text, images=images, return_tensors="pt")
    ids, items = media.expand(media.tokenizer(text)["input_ids"], images, [])
    assert ids == expected["input_ids"][0].tolist()
    assert [item.grid_thw for item in items] == [tuple(g) for g in expected["image_grid_thw"].tolist()]
    pixels = torch.cat([item.pixel_values for item in items])
    assert pixels.dtype == expected["pixel_values"].dtype == torch.float32
    assert torch.equal(pixels, expected["pixel_values"])
    assert [item.length for item in items] == [media.num_image_tokens(*image.size) for image in images]
    assert_runs(ids, items, media.tokens.image, media.tokens.video)


# (width, height) against 4-pixel patches, 8-patch windows, at most 48 patches and 8 a side: smaller than a patch,
# exactly a patch or a window, odd sizes padded up, over the patch budget, over the side limit, extreme aspect ratios.
SIZES = [(1, 1), (3, 2), (4, 4), (8, 8), (5, 13), (17, 9), (28, 27), (32, 32), (33, 17), (64, 48), (201, 150),
         (1000, 7), (7, 1000), (2, 300)]


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_image_sizes_match_transformers(media: MediaProcessor, reference: Any, size: tuple[int, int]) -> None:
    assert_image_parity(media, reference, [noise_image(*size, seed=sum(size))])


def test_same_shaped_images_batched_by_transformers(media: MediaProcessor, reference: Any) -> None:
    """transformers resizes same-shaped images as one batch; ours one by one."""
    images = [noise_image(45, 30, seed=seed) for seed in range(3)] + [noise_image(30, 45, seed=3)]
    assert_image_parity(media, reference, images)


def image_in_mode(mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    rgb = noise_image(23, 17, seed=seed)
    if mode in ("RGBA", "LA"):
        alpha = Image.fromarray(rng.integers(0, 256, (17, 23), dtype=np.uint8))
        image = rgb.convert(mode)
        image.putalpha(alpha)
        return image
    if mode == "P":
        return rgb.quantize(16)
    if mode == "P+transparency":
        image = rgb.quantize(16)
        image.info["transparency"] = 3
        return image
    if mode == "PA":
        image = rgb.quantize(16).convert("PA")
        image.putalpha(Image.fromarray(rng.integers(0, 256, (17, 23), dtype=np.uint8)))
        return image
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65536, (17, 23), dtype=np.uint16))
    return rgb.convert(mode)


MODES = ["RGBA", "LA", "L", "1", "P", "P+transparency", "PA", "CMYK", "YCbCr", "I;16"]


@pytest.mark.parametrize("mode", MODES)
def test_image_modes_match_transformers(media: MediaProcessor, reference: Any, mode: str) -> None:
    image = image_in_mode(mode, seed=len(mode))
    assert image.mode == mode.split("+")[0]
    assert_image_parity(media, reference, [image])


# Full-size images against Kimi K2.5's real limits: one under every limit (padded only), one over the patch budget,
# one over the side limit, one small and odd.
FULL_SIZES = [(1920, 1080), (4000, 3000), (9000, 60), (333, 517)]


@pytest.mark.parametrize("size", FULL_SIZES, ids=[f"{w}x{h}" for w, h in FULL_SIZES])
def test_full_size_images_match_transformers(full_size: tuple[MediaProcessor, Any, Any],
                                             size: tuple[int, int]) -> None:
    media, image_processor, _ = full_size
    image = noise_image(*size, seed=size[0])
    expected = image_processor([image], return_tensors="pt")
    ((pixels, grid),) = media.process_images([image])
    assert grid == tuple(expected["image_grid_thw"][0].tolist())
    assert torch.equal(pixels, expected["pixel_values"])
    assert media.num_image_tokens(*size) == math.prod(grid) // 4


def assert_video_parity(media: MediaProcessor, video_processor: Any, video: VideoInput) -> list[tuple[int, int, int]]:
    """Chunks' pixels (bit for bit), grids and timestamps against the reference video processor; the grids."""
    expected = video_processor([video.frames], video_metadata=[video.metadata()],
                               do_sample_frames=video.frame_indices is None, return_metadata=True,
                               return_tensors="pt")
    chunks = media.process_video(video)
    grids = [chunk.grid_thw for chunk in chunks]
    assert grids == [tuple(g) for g in expected["video_grid_thw"].tolist()]
    assert torch.equal(torch.cat([chunk.pixel_values for chunk in chunks]), expected["pixel_values_videos"])
    step = video_processor.temporal_patch_size
    assert [chunk.timestamp for chunk in chunks] == expected["video_metadata"][0].timestamps[::step]
    return grids


# (frames, fps, width, height, frame indices or None for a whole clip the processor samples at 2 fps)
VIDEOS = {
    "clip_23_at_5fps": (23, 5.0, 30, 20, None),  # 9 frames sampled: chunks of 4 + 4 + 1
    "clip_16_at_2fps": (16, 2.0, 17, 9, None),  # every frame: 4 whole chunks
    "clip_10_at_30fps": (10, 30.0, 12, 12, None),  # a third of a second: the first frame only
    "clip_7_at_2fps_tiny": (7, 2.0, 3, 2, None),  # frames smaller than a patch: 4 + 3
    "picked_7_of_11": (7, 3.0, 30, 20, (0, 1, 3, 5, 7, 8, 10)),
    "picked_6_from_12": (6, 24.0, 41, 13, (12, 13, 14, 15, 16, 17)),  # a clip that starts half a second in
    "picked_2": (2, 1.0, 8, 8, (0, 5)),
}


@pytest.mark.parametrize("case", list(VIDEOS))
def test_videos_match_transformers(media: MediaProcessor, reference: Any, case: str) -> None:
    count, fps, width, height, indices = VIDEOS[case]
    video = VideoInput(noise_frames(count, width, height, seed=count), fps=fps, frame_indices=indices)
    grids = assert_video_parity(media, reference.video_processor, video)
    assert sum(grid[0] for grid in grids) == (count if indices else max(1, int(count / fps * 2)))
    assert sum(g[1] * g[2] for g in grids) // 4 == media.num_video_tokens(sum(g[0] for g in grids), width, height)


def test_full_size_video_matches_transformers(full_size: tuple[MediaProcessor, Any, Any]) -> None:
    """720p frames over the 4096-patch frame budget, sampled from a 6 fps clip."""
    media, _, video_processor = full_size
    video = VideoInput(noise_frames(15, 1280, 720, seed=11), fps=6.0)
    assert assert_video_parity(media, video_processor, video) == [(4, 50, 86), (1, 50, 86)]


def test_preprocessing_never_imports_torchvision() -> None:
    """The engine preprocesses where torchvision is missing or broken: ours must not import it, nor transformers'
    image or video modules (which import it when installed)."""
    script = (
        "import sys\n"
        "sys.modules['torchvision'] = None\n"
        "import numpy as np\n"
        "from PIL import Image\n"
        "from reasoning_engine.multimodal.processing import MediaProcessor, PixelSettings, VideoInput, VideoSettings\n"
        "media = MediaProcessor(PixelSettings(), VideoSettings(), tokenizer=None, tokens=None)\n"
        "frames = np.zeros((5, 40, 60, 3), dtype=np.uint8)\n"
        "media.process_images([Image.fromarray(frames[0])])\n"
        "media.process_video(VideoInput(frames, fps=2.0))\n"
        "loaded = [name for name in sys.modules if name.startswith(('transformers.image', 'transformers.video'))]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parents[2], timeout=120)
