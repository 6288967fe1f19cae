"""LLM(...) and AsyncLLM(...) keyword arguments resolved into an EngineConfig: defaults from the checkpoint and the
machine, each argument checked (ValueError naming it). The offline API re-exports these names."""

from __future__ import annotations

import os
from typing import Any

import torch

from reasoning_engine.config import (BUNDLED_MODEL_DIR, DEFAULT_LIMIT_MM_PER_PROMPT, EngineConfig, ParallelConfig,
                                     load_model_config, parse_dtype, parse_memory)
from reasoning_engine.engine.engine import default_device
from reasoning_engine.kernels import triton_available


def bundled_model_dir() -> str:
    """The tiny reasoning model shipped inside the package: the default when no model is given."""
    if not (BUNDLED_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the bundled tiny model is missing from {BUNDLED_MODEL_DIR}; "
                                "regenerate it with `python -m reasoning_engine.tiny.train` or pass a model path")
    return str(BUNDLED_MODEL_DIR)


def build_engine_config(model: str | os.PathLike | None = None, *, dtype: str | torch.dtype | None = None,
                        device: str | torch.device | None = None, max_model_len: int | None = None,
                        block_size: int = 16, kv_cache_blocks: int | None = None, kv_cache_memory: str | int | None = None,
                        kv_cache_dtype: str = "auto",
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
                        encoder_cache_tokens: int = 16384, kv_offload_size: str | int = 0,
                        kv_offload_dir: str | os.PathLike | None = None,
                        kv_offload_dir_size: str | int = 16 << 30) -> EngineConfig:
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
        kv_cache_dtype=kv_cache_dtype,
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
        limit_mm_per_prompt=parse_media_limits(limit_mm_per_prompt), encoder_cache_tokens=encoder_cache_tokens,
        kv_offload_size=parse_memory(kv_offload_size, "kv_offload_size"),
        kv_offload_dir=str(kv_offload_dir) if kv_offload_dir is not None else None,
        kv_offload_dir_size=parse_memory(kv_offload_dir_size, "kv_offload_dir_size"))


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
