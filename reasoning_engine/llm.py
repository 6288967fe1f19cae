"""The offline API, shaped like vLLM's `LLM` so users can switch engines without rewriting their scripts."""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

# the engine's argument handling, importable from here as well (the offline API's names)
from reasoning_engine.engine.arguments import build_engine_config, bundled_model_dir, parse_media_limits  # noqa: F401
from reasoning_engine.engine.engine import LLMEngine, PromptType
from reasoning_engine.models.chat_templates import arguments_as_mappings, iterates_arguments
from reasoning_engine.multimodal.chat import extract_media
from reasoning_engine.multimodal.loading import MediaLoader
from reasoning_engine.outputs import RequestOutput
from reasoning_engine.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]
MEDIA_MAX_BYTES = 64 << 20  # an image or video a chat message may fetch
MEDIA_TIMEOUT_S = 20.0


def _refuse_video(url: str) -> Any:
    raise ValueError("this model takes images but no video")


class LLM:
    """Generate from a checkpoint folder in-process: `LLM(path).generate(prompts, SamplingParams(...))`. With
    tensor_parallel_size or data_parallel_size > 1 the other ranks run in child processes (or Ray actors) until
    `shutdown()`, which a `with LLM(...) as llm:` block calls on leaving; an LLM dropped without it (`del llm`)
    stops them when it is collected."""

    def __init__(self, model: str | os.PathLike | None = None, *, allowed_local_media_path: str | None = None,
                 allowed_media_domains: list[str] | None = None, **kwargs: Any) -> None:
        """Media in `chat` messages: data URLs always; http(s) URLs only from `allowed_media_domains`, `file://`
        only under `allowed_local_media_path` (as the server's flags)."""
        self.engine = LLMEngine(build_engine_config(model, **kwargs))
        # at once when the last reference goes (the engine itself lives on until a garbage collection)
        weakref.finalize(self, self.engine.runner.executor.shutdown)
        local = Path(allowed_local_media_path).resolve() if allowed_local_media_path else None
        self.media_loader = MediaLoader.for_model(self.engine.media_processor, list(allowed_media_domains or []),
                                                  local, MEDIA_MAX_BYTES, MEDIA_TIMEOUT_S)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the other ranks' processes (nothing to do with one process)."""
        self.engine.shutdown()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs come back in prompt order. A prompt dict may carry a
        `cache_salt` ({"prompt_token_ids": [...], "cache_salt": "tenant-a"}): it shares prefix-cache blocks only with
        prompts of the same salt."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        return self._run(prompts, params, use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False,
             cache_salt: str | None = None) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template, then generate (`cache_salt`: see
        `generate`)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this checkpoint has none")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = []
        walks_arguments = iterates_arguments(str(self.tokenizer.chat_template or ""))
        processor = self.engine.media_processor
        load_video = self.media_loader.load_video
        if processor is not None and not processor.supports_video:
            load_video = _refuse_video  # before fetching and decoding it
        for conversation in conversations:
            media = extract_media(conversation, self.media_loader.load_image, load_video)
            turns = arguments_as_mappings(media.messages) if walks_arguments else media.messages
            ids = self.tokenizer.apply_chat_template(turns, tools=tools, add_generation_prompt=add_generation_prompt,
                                                     tokenize=True, return_dict=False, **(chat_template_kwargs or {}))
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompt: dict[str, Any] = {"prompt_token_ids": list(ids)}
            if media.images or media.videos:
                prompt["multi_modal_data"] = media.multi_modal_data()
            if cache_salt is not None:
                prompt["cache_salt"] = cache_salt
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def compute_logits(self, prompt_token_ids: list[list[int] | dict[str, Any]]) -> list[torch.Tensor]:
        """Last-position logits (float32) of each prompt (token ids, or a prompt dict with its `multi_modal_data`):
        the engine's full forward path, for parity checks."""
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        ids = [self.engine.add_request(None, p if isinstance(p, dict) else {"prompt_token_ids": p}, params,
                                       capture_logits=True) for p in prompt_token_ids]
        results = self._drain(set(ids), use_tqdm=False)
        return [results[i].extra["logits"] for i in ids]

    def _run(self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(None, prompt, p))
            results = self._drain(set(ids), use_tqdm)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return [results[i] for i in ids]

    def _drain(self, pending: set[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(pending), desc="generating", disable=not use_tqdm)
        while pending:
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    results[out.request_id] = out
                    pending.discard(out.request_id)
                    bar.update(1)
        bar.close()
        return results

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
