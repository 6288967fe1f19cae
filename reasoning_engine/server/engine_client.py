"""The engine as the server sees it: every member the HTTP layer calls, as a Protocol. `AsyncLLM` is the engine
that serves; tests serve a scripted double (tests/server/fake_engine.py) through the same app, so this is the whole
contract between them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar

from reasoning_engine.engine.engine import EngineStats, PromptType
from reasoning_engine.multimodal.inputs import MediaItem
from reasoning_engine.multimodal.processing import MediaProcessor
from reasoning_engine.outputs import RequestOutput
from reasoning_engine.sampling_params import SamplingParams

T = TypeVar("T")


class ServedModelConfig(Protocol):
    """What the server reads of the model's config (`path`, the checkpoint folder, too where it has one)."""

    @property
    def name(self) -> str: ...

    @property
    def model_type(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...


class EngineClient(Protocol):
    """The engine behind the routes. `generate` yields cumulative outputs (the last one finished) and raises
    ValueError for a request it refuses and `EngineDeadError` once the engine has died; `abort` ends a stream with a
    final output (finish_reason "abort") and frees its KV blocks; `is_running` is False once the engine loop has
    stopped (the server's /health then answers 503). The playground also reads `engine.config.speculative_config`
    where the engine has them (AsyncLLM's `engine`, its LLMEngine)."""

    @property
    def tokenizer(self) -> Any:
        """The HF tokenizer, or None for a model served by token ids."""

    @property
    def model_config(self) -> ServedModelConfig: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def supports_media(self) -> bool: ...

    @property
    def media_processor(self) -> MediaProcessor | None: ...

    @property
    def media_limits(self) -> dict[str, int]: ...

    def generate(self, prompt: PromptType, params: SamplingParams, request_id: str, session_id: str | None = None,
                 workload: str = "default") -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def expand_prompt(self, prompt: PromptType) -> tuple[list[int], tuple[MediaItem, ...]]: ...

    async def run_media(self, fn: Callable[..., T], *args: Any) -> T: ...

    def stats(self) -> EngineStats: ...

    def adaptive_snapshot(self) -> dict[str, Any]: ...

    def kv_events(self, after: int, replica: int, limit: int) -> dict[str, Any]: ...

    async def shutdown(self) -> None: ...
