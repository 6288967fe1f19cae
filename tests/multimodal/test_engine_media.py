"""Images and video through the engine against transformers' `Kimi_K25ForConditionalGeneration` on one tiny
checkpoint (tests/multimodal/kimi_checkpoint.py): greedy tokens equal, logprobs close; the same under chunked
prefill that splits an image, under preemption, with tensor parallelism; prefix-cache keys that follow the media;
the encoder cache; `LLM.chat` with image parts; clear errors for bad media."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest
import torch

from reasoning_engine import LLM, SamplingParams

from .kimi_checkpoint import KimiK25Checkpoint, build_kimi_k25, noise_frames, noise_image

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> KimiK25Checkpoint:
    return build_kimi_k25(tmp_path_factory.mktemp("kimi_k25_mm"))


def engine_for(kimi: KimiK25Checkpoint, **options: Any) -> LLM:
    return LLM(str(kimi.path), dtype="float32", device="cpu", max_model_len=256, **options)


@pytest.fixture(scope="module")
def llm(kimi: KimiK25Checkpoint) -> LLM:
    return engine_for(kimi, kv_cache_blocks=64, block_size=8, adaptive=False)


def user(*parts: Any) -> list[dict[str, Any]]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [{"role": "user", "content": content}]


IMAGE = {"type": "image"}
VIDEO = {"type": "video"}


def rendered(kimi: KimiK25Checkpoint, messages: list[dict[str, Any]]) -> str:
    return kimi.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def reference(kimi: KimiK25Checkpoint, text: str, images: list | None = None, videos: list | None = None
              ) -> tuple[list[int], list[int], list[float]]:
    """transformers: (prompt ids, greedy tokens, each token's logprob)."""
    kwargs: dict[str, Any] = {}
    if videos:
        kwargs["videos"] = [v.frames for v in videos]
        kwargs["videos_kwargs"] = {"video_metadata": [v.metadata() for v in videos], "do_sample_frames": False}
    inputs = kimi.processor(text=text, images=images or None, return_tensors="pt", **kwargs)
    with torch.no_grad():
        out = kimi.model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True)
    prompt = inputs["input_ids"][0].tolist()
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return prompt, tokens, logprobs


def ours(llm: LLM, prompts: list[tuple[str, list | None, list | None]]) -> list[tuple[list[int], list[int], list[float]]]:
    """Our engine, every prompt in one batch: (prompt ids, greedy tokens, each token's logprob) per prompt."""
    requests = []
    for text, images, videos in prompts:
        data: dict[str, Any] = {}
        if images:
            data["image"] = images
        if videos:
            data["video"] = videos
        requests.append({"prompt": text, "multi_modal_data": data})
    outs = llm.generate(requests, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0))
    results = []
    for out in outs:
        completion = out.outputs[0]
        logprobs = [entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids)]
        results.append((out.prompt_token_ids, completion.token_ids, logprobs))
    return results


def assert_same(got: tuple, want: tuple) -> None:
    assert got[0] == want[0], "prompt ids differ from the processor's"
    assert got[1] == want[1]
    assert got[2] == pytest.approx(want[2], abs=1e-4)


def test_mixed_batch_matches_transformers(kimi: KimiK25Checkpoint, llm: LLM) -> None:
    """One image, two images of different sizes and aspect ratios, a short video and a text-only prompt, in one
    batch (prefix and encoder caches on; the last prompt repeats the first image): each equals transformers alone."""
    from reasoning_engine.multimodal.processing import VideoInput

    first = noise_image(40, 28, seed=1)
    video = VideoInput(noise_frames(6, 24, 16, seed=4), fps=2.0, frame_indices=tuple(range(6)))
    prompts = [
        (rendered(kimi, user(IMAGE, "what is it?")), [first], None),
        (rendered(kimi, user("compare", IMAGE, "and", IMAGE)), [noise_image(24, 24, seed=2), noise_image(20, 44, seed=3)], None),
        (rendered(kimi, user(VIDEO, "describe the clip")), None, [video]),
        (rendered(kimi, user("what colour is red?")), None, None),
        (rendered(kimi, user(IMAGE, "what colour is it?")), [first], None),
    ]
    misses_before = llm.engine.runner.encoder_caches[0].misses
    for got, (text, images, videos) in zip(ours(llm, prompts), prompts):
        assert_same(got, reference(kimi, text, images, videos))
    plan = llm.engine.runner.encoder_caches[0]
    assert plan.misses - misses_before == 5  # 1 + 2 images, 2 video chunks: the repeated image encoded once


def test_batch_chunked_prefill_and_preemption_keep_the_tokens(kimi: KimiK25Checkpoint, llm: LLM) -> None:
    """Several media prompts at once; 16-token steps split each image's placeholder run; a cache of 14 blocks of 8
    preempts (prompts of ~60 tokens, room for 112). Tokens equal the roomy engine's, one prompt at a time."""
    prompts = [({"prompt": rendered(kimi, user(IMAGE, "what is it?")), "multi_modal_data": {"image": img}})
               for img in (noise_image(40, 28, seed=5), noise_image(28, 40, seed=6), noise_image(36, 36, seed=7))]
    prompts.append({"prompt": rendered(kimi, user("no image here")), "multi_modal_data": {}})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    tight = LLM(str(kimi.path), dtype="float32", device="cpu", max_model_len=112, kv_cache_blocks=14, block_size=8,
                max_num_batched_tokens=16, adaptive=False)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert got == want
    assert tight.engine.num_preemptions > 0


def test_prefix_cache_keys_follow_the_media(kimi: KimiK25Checkpoint) -> None:
    engine = engine_for(kimi, kv_cache_blocks=64, block_size=4, adaptive=False)
    text = rendered(kimi, user("a long shared instruction before the picture", IMAGE, "what is it?"))
    params = SamplingParams(temperature=0, max_tokens=2)
    red, blue = noise_image(32, 32, seed=8), noise_image(32, 32, seed=9)

    def cached(image: Any) -> int:
        out = engine.generate({"prompt": text, "multi_modal_data": {"image": image}}, params)[0]
        return out.num_cached_tokens

    assert cached(red) == 0
    start = text.index("<|media_pad|>")
    text_before = len(kimi.tokenizer(text[:start])["input_ids"])
    other = cached(blue)
    assert 0 < other <= text_before, "a different image must not reuse the first image's blocks"
    again = cached(red)
    assert again > text_before + 8, "the same image again hits its blocks"
    plan = engine.engine.runner.encoder_caches[0]
    assert plan.misses == 2  # red and blue encoded once each; red's second prompt hit its blocks or its outputs


def test_encoder_cache_reuses_outputs_without_prefix_cache(kimi: KimiK25Checkpoint) -> None:
    engine = engine_for(kimi, kv_cache_blocks=64, block_size=8,
                 enable_prefix_caching=False, adaptive=False)
    image = noise_image(32, 32, seed=10)
    params = SamplingParams(temperature=0, max_tokens=3)
    outs = [engine.generate({"prompt": rendered(kimi, user(IMAGE, question)), "multi_modal_data": {"image": image}},
                            params)[0] for question in ("what is it?", "what colour is it?")]
    plan = engine.engine.runner.encoder_caches[0]
    assert (plan.misses, plan.hits) == (1, 1)
    assert engine.engine.runner.worker.encoder_seconds > 0
    assert all(o.outputs[0].token_ids for o in outs)


def test_chat_with_image_parts_equals_generate(kimi: KimiK25Checkpoint, llm: LLM) -> None:
    image = noise_image(36, 28, seed=11)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    chat = llm.chat(user({"type": "image_url", "image_url": {"url": url}}, "what is it?"), params)[0]
    pil = llm.chat(user({"type": "image_pil", "image_pil": image}, "what is it?"), params)[0]
    direct = llm.generate({"prompt": rendered(kimi, user(IMAGE, "what is it?")), "multi_modal_data": {"image": image}},
                          params)[0]
    assert chat.outputs[0].token_ids == pil.outputs[0].token_ids == direct.outputs[0].token_ids


def test_tensor_parallel_gives_one_process_tokens(kimi: KimiK25Checkpoint, llm: LLM) -> None:
    prompts = [{"prompt": rendered(kimi, user(IMAGE, "what is it?")), "multi_modal_data": {"image": noise_image(40, 28, seed=s)}}
               for s in (12, 13)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with engine_for(kimi, kv_cache_blocks=64, block_size=8, adaptive=False,
             tensor_parallel_size=2) as tp:
        assert [o.outputs[0].token_ids for o in tp.generate(prompts, params)] == want


def test_bad_media_is_a_value_error_naming_it(kimi: KimiK25Checkpoint, llm: LLM, tmp_path: Path) -> None:
    text = rendered(kimi, user(IMAGE, "what is it?"))
    image = noise_image(24, 24, seed=14)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": [image, image]}}, params)
    with pytest.raises(ValueError, match="multi_modal_data: unknown media kind 'audio'"):
        llm.generate({"prompt": text, "multi_modal_data": {"audio": b""}}, params)
    limited = engine_for(kimi, kv_cache_blocks=16, adaptive=False,
                  limit_mm_per_prompt={"image": 1})
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        limited.generate({"prompt": rendered(kimi, user(IMAGE, IMAGE)), "multi_modal_data": {"image": [image, image]}},
                         params)
    many = [image] * 17  # past the default limit_mm_per_prompt (16 images), refused before any is processed
    with pytest.raises(ValueError, match="17 images in one prompt, at most 16"):
        llm.generate({"prompt": rendered(kimi, user(*[IMAGE] * 17)), "multi_modal_data": {"image": many}}, params)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]"):
        llm.chat(user({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}), params)
    with pytest.raises(ValueError, match="not allowed|allowed"):
        llm.chat(user({"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}), params)
    assert llm.engine.runner.worker.vision is not None and not llm.engine.has_unfinished_requests()


def test_text_model_refuses_media(tiny_checkpoint) -> None:
    path = tiny_checkpoint("deepseek_v3_mtp").path
    with LLM(str(path), dtype="float32", device="cpu", max_model_len=256, kv_cache_blocks=16,
             adaptive=False) as text_only:
        with pytest.raises(ValueError, match="has no vision tower"):
            text_only.generate({"prompt_token_ids": [1, 2, 3],
                                "multi_modal_data": {"image": noise_image(8, 8, seed=0)}})
