"""Our Kimi K2.5 vision encoder + projector (`models/kimi_vision.py`) against transformers' `Kimi_K25Model`.

A tiny random `Kimi_K25ForConditionalGeneration` (4-pixel patches, a 6 x 6 learned position table, 2 layers of 4 heads
of 12 channels) is saved with `save_pretrained` once per module; our encoder is built from that folder and must
give the reference's `get_image_features` / `get_video_features` rows for images that need the position table
resized (up, down, non-square) and for a video's chunks (4 frames, then a single one). The same weights saved under
transformers' module names and under Moonshot's names (fused, rotary-interleaved wqkv) must load to the same
encoder. Pixels come from the patch layout the Kimi K2.5 processors return (`patchify`); the tests that run the
processors themselves needs torchvision (tests/reference_torchvision.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from reasoning_engine.models.kimi_vision import KimiVisionEncoder, VisionConfig, build_vision_encoder

try:
    from .. import reference_torchvision
except ImportError:  # tests/ itself is on sys.path
    import reference_torchvision

PATCH = 4
HEADS = 4
VISION = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=HEADS, patch_size=PATCH,
              pos_emb_height=6, pos_emb_width=6, pos_emb_time=4, merge_kernel_size=[2, 2])
TEXT = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=40, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, first_k_dense_replace=1, n_group=1, topk_group=1)
# (frames, height, width) in pixels: a grid of 12 x 8 patches (table resized up and non-square), 6 x 6 (the table
# itself), 4 x 10 (down in one axis, up in the other)
IMAGES = [(1, 48, 32), (1, 24, 24), (1, 16, 40)]
VIDEO = (5, 16, 24)  # chunks of 4 frames and of 1


def patchify(frames: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[t, 3, H, W] -> ([t * h * w, 3, P, P], (t, h, w)): patches frame by frame, row-major, as the processors
    lay them out."""
    t, channels, height, width = frames.shape
    h, w = height // PATCH, width // PATCH
    patches = frames.reshape(t, channels, h, PATCH, w, PATCH).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(t * h * w, channels, PATCH, PATCH), (t, h, w)


def media(shapes: list[tuple[int, int, int]], seed: int) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Random normalised pixels for items of the given (frames, height, width), concatenated, and their grids."""
    gen = torch.Generator().manual_seed(seed)
    items = [patchify(torch.randn(t, 3, height, width, generator=gen)) for t, height, width in shapes]
    return torch.cat([pixels for pixels, _ in items]), [grid for _, grid in items]


def video_chunks(seed: int) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """`VIDEO` cut into chunks of at most 4 frames, as the video processor cuts it."""
    frames, height, width = VIDEO
    video = torch.randn(frames, 3, height, width, generator=torch.Generator().manual_seed(seed))
    chunks = [patchify(chunk) for chunk in video.split(4)]
    return torch.cat([pixels for pixels, _ in chunks]), [grid for _, grid in chunks]


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial weights for the vision tower and projector: LayerNorms away from (1, 0), unit-scale linears and
    position table, so every term reaches the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.startswith(("model.vision_tower.", "model.mm_projector.")):
                continue
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.3 * noise)
            elif name.endswith("bias"):
                param.copy_(0.2 * noise)
            elif param.dim() >= 2 and "position_embeddings" not in name:
                param.copy_(noise / param[0].numel() ** 0.5)
            else:
                param.copy_(0.5 * noise)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(folder written by save_pretrained, the transformers model it holds)."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    torch.manual_seed(0)
    config = Kimi_K25Config(text_config=TEXT, vision_config=VISION, projection_hidden_size=VISION["hidden_size"],
                            tie_word_embeddings=False)
    model = Kimi_K25ForConditionalGeneration(config).eval()
    randomize(model, seed=1)
    folder = tmp_path_factory.mktemp("kimi_k25_vision")
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def encoder(reference: tuple[Path, Any]) -> KimiVisionEncoder:
    encoder = build_vision_encoder(reference[0], torch.float32, "cpu")
    assert encoder is not None
    return encoder


@pytest.fixture(scope="module")
def module_names_dir(reference: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights under transformers' module names (separate q/k/v, rotary pairs (i, i + half))."""
    folder = tmp_path_factory.mktemp("kimi_k25_module_names")
    reference[1].save_pretrained(folder, save_original_format=False)
    return folder


def assert_matches(ours: list[torch.Tensor], expected: tuple[torch.Tensor, ...]) -> None:
    assert len(ours) == len(expected)
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_three_images_match_transformers(encoder: KimiVisionEncoder, reference: tuple[Path, Any]) -> None:
    pixels, grids = media(IMAGES, seed=2)
    with torch.no_grad():
        ours = encoder(pixels, grids)
        expected = reference[1].model.get_image_features(pixels, torch.tensor(grids)).pooler_output
    assert [o.shape for o in ours] == [(h * w // 4, TEXT["hidden_size"]) for _, h, w in grids]
    assert_matches(ours, expected)


def test_video_chunks_match_transformers(encoder: KimiVisionEncoder, reference: tuple[Path, Any]) -> None:
    pixels, grids = video_chunks(seed=3)
    assert grids == [(4, 4, 6), (1, 4, 6)]
    with torch.no_grad():
        ours = encoder(pixels, grids)
        expected = reference[1].model.get_video_features(pixels, torch.tensor(grids)).pooler_output
    assert [o.shape[0] for o in ours] == [6, 6]  # frames are pooled: one frame's worth of tokens per chunk
    assert_matches(ours, expected)


def test_items_together_equal_each_alone(encoder: KimiVisionEncoder) -> None:
    image_pixels, image_grids = media(IMAGES, seed=4)
    video_pixels, video_grids = video_chunks(seed=5)
    pixels, grids = torch.cat([image_pixels, video_pixels]), image_grids + video_grids
    with torch.no_grad():
        together = encoder(pixels, grids)
        alone = [encoder(item, [grid])[0]
                 for item, grid in zip(pixels.split([t * h * w for t, h, w in grids]), grids)]
    for joint, single in zip(together, alone):
        torch.testing.assert_close(joint, single, atol=1e-5, rtol=1e-5)


def test_triton_backend_matches_torch(reference: tuple[Path, Any], encoder: KimiVisionEncoder) -> None:
    pytest.importorskip("triton")
    triton_encoder = build_vision_encoder(reference[0], torch.float32, "cpu", kernel_backend="triton")
    pixels, grids = media(IMAGES[1:], seed=6)
    with torch.no_grad():
        assert_matches(triton_encoder(pixels, grids), tuple(encoder(pixels, grids)))


def _interleave_rotary(rows: torch.Tensor) -> torch.Tensor:
    """transformers' q/k rows (rotary pairs (i, i + half) per head) -> Moonshot's (pairs (2i, 2i + 1))."""
    return rows.reshape(HEADS, 2, -1, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


# transformers module names -> Moonshot's; the first matching rule applies
_TO_OFFICIAL = [
    (r"model\.vision_tower\.layers\.(\d+)\.norm1\.", r"vision_tower.encoder.blocks.\1.norm0."),
    (r"model\.vision_tower\.layers\.(\d+)\.norm2\.", r"vision_tower.encoder.blocks.\1.norm1."),
    (r"model\.vision_tower\.layers\.(\d+)\.attn\.proj\.", r"vision_tower.encoder.blocks.\1.wo."),
    (r"model\.vision_tower\.layers\.(\d+)\.mlp\.fc1\.", r"vision_tower.encoder.blocks.\1.mlp.fc0."),
    (r"model\.vision_tower\.layers\.(\d+)\.mlp\.fc2\.", r"vision_tower.encoder.blocks.\1.mlp.fc1."),
    (r"model\.vision_tower\.patch_embed\.pos_emb\.position_embeddings", "vision_tower.patch_embed.pos_emb.weight"),
    (r"model\.vision_tower\.patch_embed\.proj\.", "vision_tower.patch_embed.proj."),
    (r"model\.vision_tower\.final_layernorm\.", "vision_tower.encoder.final_layernorm."),
    (r"model\.mm_projector\.pre_norm\.", "mm_projector.pre_norm."),
    (r"model\.mm_projector\.in_proj\.", "mm_projector.proj.0."),
    (r"model\.mm_projector\.out_proj\.", "mm_projector.proj.2."),
]


def official_tensors(module_names_dir: Path) -> dict[str, torch.Tensor]:
    """Moonshot's published layout of the vision tensors, built from the module-name checkpoint: renamed, and each
    layer's q/k/v fused into wqkv with q and k rows interleaved for Moonshot's complex rotary."""
    tensors = {k: v for k, v in load_file(module_names_dir / "model.safetensors").items()
               if k.startswith(("model.vision_tower.", "model.mm_projector."))}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if match := re.fullmatch(r"model\.vision_tower\.layers\.(\d+)\.attn\.q_proj\.(weight|bias)", name):
            layer, kind = match.groups()
            q, k, v = (tensors[f"model.vision_tower.layers.{layer}.attn.{p}_proj.{kind}"] for p in "qkv")
            out[f"vision_tower.encoder.blocks.{layer}.wqkv.{kind}"] = torch.cat(
                [_interleave_rotary(q), _interleave_rotary(k), v])
            continue
        if re.search(r"attn\.[kv]_proj", name):
            continue
        renamed = next(re.sub(f"^{old}", new, name) for old, new in _TO_OFFICIAL if re.match(old, name))
        out[renamed] = tensor
    return out


def official_config() -> dict[str, Any]:
    """config.json as Moonshot publishes it for Kimi K2.5 (vt_* names, projector fields inside vision_config)."""
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": dict(TEXT),
        "vision_config": {
            "init_pos_emb_height": VISION["pos_emb_height"], "init_pos_emb_width": VISION["pos_emb_width"],
            "init_pos_emb_time": VISION["pos_emb_time"], "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
            "mm_hidden_size": VISION["hidden_size"], "mm_projector_type": "patchmerger", "model_type": "",
            "patch_size": PATCH, "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu",
            "projector_ln_eps": 1e-05, "text_hidden_size": TEXT["hidden_size"], "video_attn_type": "spatial_temporal",
            "vt_hidden_size": VISION["hidden_size"], "vt_intermediate_size": VISION["intermediate_size"],
            "vt_num_attention_heads": HEADS, "vt_num_hidden_layers": VISION["num_hidden_layers"],
        },
    }


def test_official_config_parses_like_transformers(reference: tuple[Path, Any]) -> None:
    saved = json.loads((reference[0] / "config.json").read_text())
    assert VisionConfig.from_config(official_config()) == VisionConfig.from_config(saved)


def test_official_wqkv_is_what_transformers_saves(reference: tuple[Path, Any], module_names_dir: Path) -> None:
    """transformers 5.24's save_pretrained writes Moonshot's fused, interleaved wqkv: the layout we permute on load."""
    saved = load_file(reference[0] / "model.safetensors")
    official = official_tensors(module_names_dir)
    for layer in range(VISION["num_hidden_layers"]):
        for kind in ("weight", "bias"):
            name = f"vision_tower.encoder.blocks.{layer}.wqkv.{kind}"
            assert torch.equal(saved[name], official[name])


@pytest.mark.parametrize("layout", ["official", "module_names"])
def test_checkpoint_layouts_load_the_same_weights(layout: str, encoder: KimiVisionEncoder, module_names_dir: Path,
                                                  tmp_path: Path) -> None:
    if layout == "official":
        save_file(official_tensors(module_names_dir), tmp_path / "model.safetensors")
        (tmp_path / "config.json").write_text(json.dumps(official_config()))
        folder = tmp_path
    else:
        folder = module_names_dir
    other = build_vision_encoder(folder, torch.float32, "cpu")
    assert other is not None
    ours = encoder.state_dict()
    for name, tensor in other.state_dict().items():
        assert torch.equal(tensor, ours[name]), name
    pixels, grids = media(IMAGES[:2], seed=7)
    with torch.no_grad():
        for got, want in zip(other(pixels, grids), encoder(pixels, grids)):
            assert torch.equal(got, want)


def _vision_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(folder / "model.safetensors").items()
            if k.removeprefix("model.").startswith(("vision_tower.", "mm_projector."))}


@pytest.mark.parametrize("dropped", ["vision_tower.encoder.blocks.1.wqkv.bias", "mm_projector.proj.2.weight",
                                     "vision_tower.encoder.patch_embed.proj.weight"])
def test_missing_tensor_is_named(dropped: str, encoder: KimiVisionEncoder, reference: tuple[Path, Any]) -> None:
    tensors = _vision_checkpoint(reference[0])
    del tensors[dropped]
    fresh = KimiVisionEncoder(encoder.config)
    official = dropped.replace("encoder.patch_embed", "patch_embed")  # the error names Moonshot's tensor
    with pytest.raises(ValueError, match=re.escape(official)):
        fresh.load_weights(tensors.items())


def test_missing_part_of_split_qkv_is_named(encoder: KimiVisionEncoder, module_names_dir: Path) -> None:
    tensors = _vision_checkpoint(module_names_dir)
    del tensors["model.vision_tower.layers.0.attn.k_proj.weight"]
    with pytest.raises(ValueError, match=re.escape("vision_tower.encoder.blocks.0.wqkv.weight")):
        KimiVisionEncoder(encoder.config).load_weights(tensors.items())


@pytest.mark.parametrize("extra", ["vision_tower.encoder.blocks.2.wo.weight", "mm_projector.proj.1.weight",
                                   "vision_tower.encoder.blocks.0.attn.rope.weight"])
def test_unexpected_tensor_is_named(extra: str, encoder: KimiVisionEncoder, reference: tuple[Path, Any]) -> None:
    tensors = _vision_checkpoint(reference[0])
    tensors[extra] = torch.zeros(1)
    with pytest.raises(ValueError, match=re.escape(extra)):
        KimiVisionEncoder(encoder.config).load_weights(tensors.items())


def test_tensor_given_twice_is_named(encoder: KimiVisionEncoder, reference: tuple[Path, Any]) -> None:
    tensors = list(_vision_checkpoint(reference[0]).items())
    pos = next(t for n, t in tensors if n.endswith("pos_emb.weight"))
    tensors.append(("vision_tower.patch_embed.pos_emb.position_embeddings", pos))
    with pytest.raises(ValueError, match=re.escape("vision_tower.patch_embed.pos_emb.position_embeddings")):
        KimiVisionEncoder(encoder.config).load_weights(tensors)


def test_wrong_shape_is_named(encoder: KimiVisionEncoder, reference: tuple[Path, Any]) -> None:
    tensors = _vision_checkpoint(reference[0])
    tensors["vision_tower.encoder.blocks.0.wo.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=re.escape("vision_tower.encoder.blocks.0.wo.weight")):
        KimiVisionEncoder(encoder.config).load_weights(tensors.items())


def test_model_without_vision_tower_has_no_encoder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TEXT))
    assert build_vision_encoder(tmp_path, torch.float32, "cpu") is None


@pytest.mark.parametrize("field", ["num_attention_heads", "patch_size", "merge_kernel_size"])
def test_missing_config_field_is_named(field: str, reference: tuple[Path, Any]) -> None:
    config = json.loads((reference[0] / "config.json").read_text())
    del config["vision_config"][field]
    with pytest.raises(ValueError, match=field):
        VisionConfig.from_config(config)


def test_bad_grids_are_refused(encoder: KimiVisionEncoder) -> None:
    pixels, grids = media(IMAGES[1:2], seed=8)
    with pytest.raises(ValueError, match="patches"):
        encoder(pixels[1:], grids)
    with pytest.raises(ValueError, match="merge kernel"):
        encoder(pixels, [(1, 9, 4)])
    with pytest.raises(ValueError, match="frames"):
        encoder(torch.cat([pixels] * 5), [(5, 6, 6)])


def test_processor_outputs_match_transformers(encoder: KimiVisionEncoder, reference: tuple[Path, Any]) -> None:
    """Pixels straight from transformers' Kimi_K25 image and video processors, encoded together."""
    reference_torchvision.require()
    from PIL import Image
    from transformers import Kimi_K25ImageProcessor, Kimi_K25VideoProcessor

    small = {"size": {"max_height": 12, "max_width": 12}, "patch_size": PATCH, "merge_size": 2}
    rng = np.random.default_rng(9)
    images = [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
              for height, width in [(40, 28), (24, 24), (13, 45)]]
    frames = rng.integers(0, 256, (5, 20, 30, 3), dtype=np.uint8)
    image_out = Kimi_K25ImageProcessor(max_patches=64, **small)(images, return_tensors="pt")
    video_out = Kimi_K25VideoProcessor(max_patches=32, **small)([frames], do_sample_frames=False, return_tensors="pt")
    image_grids = [tuple(g) for g in image_out["image_grid_thw"].tolist()]
    video_grids = [tuple(g) for g in video_out["video_grid_thw"].tolist()]
    assert len(set(image_grids)) == 3 and [g[0] for g in video_grids] == [4, 1]
    with torch.no_grad():
        ours = encoder(torch.cat([image_out["pixel_values"], video_out["pixel_values_videos"]]),
                       image_grids + video_grids)
        model = reference[1].model
        expected_images = model.get_image_features(image_out["pixel_values"], image_out["image_grid_thw"]).pooler_output
        expected_video = model.get_video_features(video_out["pixel_values_videos"],
                                                  video_out["video_grid_thw"]).pooler_output
    assert_matches(ours, (*expected_images, *expected_video))
