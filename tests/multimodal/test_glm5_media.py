"""GLM-5.3-Flash's images against transformers on one tiny checkpoint (tests/multimodal/glm5_checkpoint.py):
our preprocessing equals `Glm5NextImageProcessor` bit for bit (images under the token minimum, over the budget, with
transparency), our vision tower `Glm5NextModel.get_image_features` (torch and Triton attention), and image prompts
through the engine give transformers' expanded prompt, logits and greedy tokens, also prefilled in chunks that cut an
image, from a chat's image URL and under tensor parallelism; videos are refused with a clear error."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.models.registry import build_vision_encoder

from .glm5_checkpoint import build_glm5
from .kimi_checkpoint import MultimodalCheckpoint as Glm5Checkpoint
from .kimi_checkpoint import noise_frames, noise_image

STEPS = 8
# (width, height): under the 4-token minimum (scaled up), plain, over the 24-token budget (scaled down), tall
SIZES = [(5, 3), (30, 18), (100, 60), (14, 70)]


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> Glm5Checkpoint:
    return build_glm5(tmp_path_factory.mktemp("glm5_mm"))


@pytest.fixture(scope="module")
def llm(glm: Glm5Checkpoint) -> LLM:
    return LLM(str(glm.path), dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=20)


def _images() -> list[Image.Image]:
    images = [noise_image(width, height, seed) for seed, (width, height) in enumerate(SIZES)]
    rgba = np.random.default_rng(9).integers(0, 256, (20, 26, 4), dtype=np.uint8)
    return images + [Image.fromarray(rgba, "RGBA")]


def _prompt(glm: Glm5Checkpoint, images: int, text: str = "describe what you see") -> str:
    content: list[dict[str, Any]] = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    return glm.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)


def test_image_rows_equal_transformers(glm: Glm5Checkpoint, llm: LLM) -> None:
    ours = llm.engine.media_processor
    for image in _images():
        want = glm.processor.image_processor(images=[image], return_tensors="pt")
        got = ours.preprocess_image(image)
        assert got.grid_thw == tuple(want["image_grid_thw"][0].tolist()), image.size
        assert torch.equal(got.pixel_values, want["pixel_values"]), image.size
        assert ours.num_image_tokens(*image.size) == got.pixel_values.shape[0] // 4


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_vision_tower_matches_transformers(glm: Glm5Checkpoint, backend: str) -> None:
    """Three images of different grids in one ragged batch."""
    images = _images()[:3]
    inputs = glm.processor.image_processor(images=images, return_tensors="pt")
    encoder = build_vision_encoder(glm.path, torch.float32, "cpu", kernel_backend=backend)
    got = encoder(inputs["pixel_values"], [tuple(g) for g in inputs["image_grid_thw"].tolist()])
    with torch.no_grad():
        want = glm.model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())


def _reference(glm: Glm5Checkpoint, text: str, images: list[Image.Image]) -> tuple[list[int], torch.Tensor, list[int]]:
    """transformers: (the expanded prompt ids, last-position logits, greedy tokens)."""
    inputs = glm.processor(text=text, images=images or None, return_tensors="pt")
    extra = {k: inputs[k] for k in ("pixel_values", "image_grid_thw") if k in inputs}
    seq, tokens = inputs["input_ids"], []
    with torch.no_grad():
        for step in range(STEPS):
            logits = glm.model(input_ids=seq, **extra).logits[0, -1]
            if step == 0:
                first = logits
            tokens.append(int(logits.argmax()))
            seq = torch.cat([seq, torch.tensor([[tokens[-1]]])], dim=1)
    return inputs["input_ids"][0].tolist(), first, tokens


def test_image_prompts_match_transformers(glm: Glm5Checkpoint, llm: LLM) -> None:
    """A batch of one image, two images and text only, prefilled 20 tokens a step (chunks cut the images): the
    expanded prompts are the processor's, logits within 1e-4, greedy tokens equal."""
    images = _images()
    cases = [(_prompt(glm, 1), [images[1]]), (_prompt(glm, 2, "compare"), [images[2], images[4]]),
             (_prompt(glm, 0), [])]
    prompts = []
    for text, media in cases:
        ids = glm.tokenizer(text, add_special_tokens=False)["input_ids"]
        prompts.append({"prompt_token_ids": ids, **({"multi_modal_data": {"image": media}} if media else {})})
    wanted = [_reference(glm, text, media) for text, media in cases]
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, logits, (ids, want_logits, tokens) in zip(outs, llm.compute_logits(prompts), wanted):
        assert list(out.prompt_token_ids) == ids
        torch.testing.assert_close(logits.float().cpu(), want_logits, rtol=1e-4,
                                   atol=1e-4 * want_logits.abs().max().item())
        assert list(out.outputs[0].token_ids) == tokens


def test_chat_with_an_image_url_and_tensor_parallel(glm: Glm5Checkpoint, llm: LLM) -> None:
    """`LLM.chat` with a PNG data URL (the media loader, the chat template's placeholder) gives the tokens of the
    prompt with the decoded image; under TP 2 (the tower whole on each rank) too."""
    image = _images()[1]
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    part = {"type": "image_url", "image_url": {"url": url}}
    chat = llm.chat([{"role": "user", "content": [part, {"type": "text", "text": "describe what you see"}]}], params,
                    use_tqdm=False)[0]
    want = _reference(glm, _prompt(glm, 1), [image])[2]
    assert list(chat.outputs[0].token_ids) == want
    prompt = {"prompt": _prompt(glm, 1), "multi_modal_data": {"image": image}}
    with LLM(str(glm.path), dtype="float32", device="cpu", block_size=8, tensor_parallel_size=2) as tp:
        assert list(tp.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids) == want


def test_videos_are_refused(glm: Glm5Checkpoint, llm: LLM) -> None:
    text = _prompt(glm, 0)
    ids = glm.tokenizer(text, add_special_tokens=False)["input_ids"]
    video = {"prompt_token_ids": ids, "multi_modal_data": {"video": [noise_frames(2, 8, 8, 0)]}}
    with pytest.raises(ValueError, match="images but no video"):
        llm.generate([video], SamplingParams(max_tokens=1), use_tqdm=False)
    part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    with pytest.raises(ValueError, match="images but no video"):
        llm.chat([{"role": "user", "content": [part]}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
