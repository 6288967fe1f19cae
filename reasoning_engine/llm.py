"""The offline API, shaped like vLLM's `LLM` so users can switch engines without rewriting their scripts."""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from reasoning_engine.config import (DEFAULT_LIMIT_MM_PER_PROMPT, EngineConfig, ParallelConfig, load_model_config,
                                     parse_dtype, parse_memory)
from reasoning_engine.engine.engine import LLMEngine, PromptType, default_device
from reasoning_engine.kernels import triton_available
from reasoning_engine.models.chat_templates import arguments_as_mappings, iterates_arguments
from reasoning_engine.multimodal.chat import extract_media
from reasoning_engine.multimodal.loading import MediaLoader
from reasoning_engine.outputs import RequestOutput
from reasoning_engine.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]
MEDIA_MAX_BYTES = 64 << 20  # an image or video a chat message may fetch
MEDIA_TIMEOUT_S = 20.0


def bundled_model_dir() -> str:
    """The tiny reasoning model shipped inside the package: the default when no model is given."""
    from reasoning_engine.tiny import BUNDLED_MODEL_DIR

    if not (BUNDLED_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the bundled tiny model is missing from {BUNDLED_MODEL_DIR}; "
                                "regenerate it with `python -m reasoning_engine.tiny.train` or pass a model path")
    return str(BUNDLED_MODEL_DIR)


def build_engine_config(model: str | os.PathLike | None = None, *, dtype: str | torch.dtype | None = None,
                        device: str | torch.device | None = None, max_model_len: int | None = None,
                        block_size: int = 16, kv_cache_blocks: int | None = None, kv_cache_memory: str | int | None = None,
                        enable_prefix_caching: bool = True, max_num_seqs: int = 64, max_num_batched_tokens: int | None = None,
                        seed: int = 0, kernel_backend: str | None = None, speculative_config: dict[str, Any] | None = None,
                        speculative_state_dir: str | None = None, tokenizer: str | None = None,
                        enforce_eager: bool = False, compile_decode: bool = False,
                        load_format: str = "auto", tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                        enable_expert_parallel: bool = False, distributed_executor_backend: str | None = None,
                        nnodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1",
                        master_port: int | None = None, adaptive: bool = True, state_dir: str | None = None,
                        target_itl_ms: float | None = None, target_ttft_ms: float | None = None,
                        limit_mm_per_prompt: dict[str, int] | None = None,
                        encoder_cache_tokens: int = 16384) -> EngineConfig:
    """Resolve LLM(...) keyword arguments into an EngineConfig; defaults come from the checkpoint and the machine."""
    model_config = load_model_config(model if model is not None else bundled_model_dir())
    if kernel_backend == "triton" and not triton_available():
        raise ValueError("kernel_backend='triton' needs the triton package (pip install triton)")
    resolved_device = torch.device(device) if device is not None else default_device()
    if dtype is None or dtype == "auto":
        resolved_dtype = model_config.torch_dtype
        if resolved_device.type == "cpu" and resolved_dtype == torch.float16:
            resolved_dtype = torch.float32
    else:
        resolved_dtype = parse_dtype(dtype)
    limit = model_config.max_position_embeddings
    if max_model_len is not None:
        if max_model_len < 2 or max_model_len > limit:
            raise ValueError(f"max_model_len must be in [2, {limit}] for this model, got {max_model_len}")
        limit = max_model_len
    if speculative_state_dir is not None:
        if not speculative_config:
            raise ValueError("speculative_state_dir needs a speculative_config (the suffix method learns across requests)")
        speculative_config = {**speculative_config, "state_dir": speculative_state_dir}
    elif state_dir is not None and speculative_config and "state_dir" not in speculative_config:
        speculative_config = {**speculative_config, "state_dir": state_dir}  # one directory for all learned state
    return EngineConfig(
        model=model_config, dtype=resolved_dtype, device=resolved_device, max_model_len=limit, block_size=block_size,
        kv_cache_blocks=kv_cache_blocks, kv_cache_memory=parse_memory(kv_cache_memory) if kv_cache_memory is not None else None,
        enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or max(2048, min(limit, 8192)), seed=seed,
        kernel_backend=kernel_backend or ("triton" if resolved_device.type == "cuda" and triton_available() else "torch"),
        speculative_config=speculative_config, tokenizer=tokenizer, enforce_eager=enforce_eager,
        compile_decode=compile_decode, load_format=load_format,
        parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size,
                                enable_expert_parallel=enable_expert_parallel,
                                distributed_executor_backend=distributed_executor_backend or "mp", nnodes=nnodes,
                                node_rank=node_rank, master_addr=master_addr, master_port=master_port),
        adaptive=adaptive, state_dir=state_dir, target_itl_ms=target_itl_ms, target_ttft_ms=target_ttft_ms,
        limit_mm_per_prompt=parse_media_limits(limit_mm_per_prompt), encoder_cache_tokens=encoder_cache_tokens)


def _refuse_video(url: str) -> Any:
    raise ValueError("this model takes images but no video")


def parse_media_limits(limits: dict[str, int] | None) -> dict[str, int]:
    """vLLM's limit_mm_per_prompt: {"image": N, "video": M}; a kind left out keeps its default
    (DEFAULT_LIMIT_MM_PER_PROMPT)."""
    limits = dict(limits or {})
    for kind, value in limits.items():
        if kind not in ("image", "video"):
            raise ValueError(f"limit_mm_per_prompt: unknown media kind {kind!r} (image, video)")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"limit_mm_per_prompt: {kind} must be a count >= 0, got {value!r}")
    return {**DEFAULT_LIMIT_MM_PER_PROMPT, **limits}


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
