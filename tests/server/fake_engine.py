"""A test double of AsyncLLM for HTTP-layer tests: it "generates" a scripted text token by token, so streaming
tool calls and thinking splits can be checked deterministically through the real app, server and clients.

It implements the server's whole view of the engine (server/engine_client.py `EngineClient`), for a text model.
KV blocks are simulated so aborts are visible in /metrics; stop strings end a choice as the real engine's do, and an
abort ends the stream with a final output whose unfinished choices say finish_reason "abort", as AsyncLLM's does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reasoning_engine.engine.engine import EngineStats
from reasoning_engine.engine.kv_events import KVEventLog
from reasoning_engine.outputs import CompletionOutput, Logprob, RequestOutput
from reasoning_engine.sampling_params import SamplingParams

Script = Callable[[list[int], SamplingParams, int], str]


@dataclass
class FakeModelConfig:
    max_model_len: int = 8192
    vocab_size: int = 115
    model_type: str = "deepseek_v3"
    path: Path = Path("fake-model")
    think_start_token_id: int | None = None
    think_end_token_id: int | None = None

    @property
    def name(self) -> str:
        return self.path.name


@dataclass
class FakeEngine:
    tokenizer: Any
    script: Script
    model_config: FakeModelConfig = field(default_factory=FakeModelConfig)
    tokens_per_step: int = 1
    delay: float = 0.0
    total_blocks: int = 64
    block_size: int = 16
    calls: list[tuple[list[int], SamplingParams]] = field(default_factory=list)
    sessions: list[tuple[str | None, str]] = field(default_factory=list)  # (session, workload) per call
    cache_salts: list[str | None] = field(default_factory=list)  # the prompt's cache_salt per call
    _blocks: dict[str, int] = field(default_factory=dict)
    _aborted: set[str] = field(default_factory=set)
    shut_down: bool = False
    supports_media: bool = False  # a text model
    media_processor: Any = None
    media_limits: dict[str, int] = field(default_factory=dict)
    loop_died: bool = False  # what AsyncLLM's loop thread does when a step fails past recovery
    events: KVEventLog = field(default_factory=KVEventLog)  # what /v1/kv_events reads; tests fill it

    def __post_init__(self) -> None:
        self.model_config.vocab_size = len(self.tokenizer)

    async def generate(self, prompt: list[int] | dict[str, Any], params: SamplingParams, request_id: str,
                       session_id: str | None = None, workload: str = "default") -> AsyncIterator[RequestOutput]:
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        prompt = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
        if len(prompt) + (params.max_tokens or 0) > self.model_config.max_model_len:
            raise ValueError("max_tokens: prompt + max_tokens exceeds max_model_len")
        self.calls.append((list(prompt), params))
        self.sessions.append((session_id, workload))
        self.cache_salts.append(salt)
        scripts = [self.tokenizer.encode(self.script(prompt, params, i), add_special_tokens=False)
                   for i in range(params.n)]
        self._blocks[request_id] = params.n * math.ceil((len(prompt) + max(len(s) for s in scripts)) / self.block_size)
        try:
            produced = 0
            limit = min(max(len(s) for s in scripts), params.max_tokens or 10**9)
            while True:
                await asyncio.sleep(self.delay)
                if request_id in self._aborted:
                    outputs = [o if o.finished else dataclasses.replace(o, finish_reason="abort")
                               for o in (self._output(i, s, produced, params) for i, s in enumerate(scripts))]
                    yield RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=list(prompt),
                                        outputs=outputs, finished=True)
                    return
                produced = min(produced + self.tokens_per_step, limit)
                outputs = [self._output(i, s, produced, params) for i, s in enumerate(scripts)]
                finished = all(o.finish_reason is not None for o in outputs)
                yield RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=list(prompt),
                                    outputs=outputs, finished=finished)
                if finished:
                    return
        finally:
            self._blocks.pop(request_id, None)

    @property
    def is_running(self) -> bool:
        return not (self.shut_down or self.loop_died)

    async def expand_prompt(self, prompt: list[int] | dict[str, Any]) -> tuple[list[int], tuple[Any, ...]]:
        return (prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt), ()

    async def run_media(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def _output(self, index: int, script: list[int], produced: int, params: SamplingParams) -> CompletionOutput:
        ids = script[:produced]
        text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        stop = _first_stop(text, params.stop_strings)
        reason = None
        if stop is not None or len(ids) == len(script):
            reason = "stop"
        elif params.max_tokens is not None and len(ids) >= params.max_tokens:
            reason = "length"
        text = _visible(text, stop, params, finished=reason is not None)
        logprobs = None
        if params.logprobs is not None:
            logprobs = [{t: Logprob(-0.5, 1, None), (t + 1) % len(self.tokenizer): Logprob(-1.5, 2, None)} for t in ids]
        return CompletionOutput(index=index, text=text, token_ids=ids, logprobs=logprobs, finish_reason=reason,
                                stop_reason=stop)

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)
        self._blocks.pop(request_id, None)

    def stats(self) -> EngineStats:
        used = sum(self._blocks.values())
        return EngineStats(num_requests_running=len(self._blocks), num_requests_waiting=0,
                           kv_cache_usage=used / self.total_blocks, free_blocks=self.total_blocks - used,
                           total_blocks=self.total_blocks, prefix_cache_queries=0, prefix_cache_hits=0,
                           num_preemptions=5, spec_decode={"num_drafts": 3, "num_accepted_tokens_per_pos": [2, 1]})

    def kv_events(self, after: int, replica: int, limit: int) -> dict[str, Any]:
        if replica != 0:
            raise ValueError(f"replica must be in [0, 1), got {replica}")
        return self.events.since(after, limit)

    def adaptive_snapshot(self) -> dict[str, Any]:
        return {"enabled": True, "cost_model": {"ready": False}}

    async def shutdown(self) -> None:
        self.shut_down = True


def _first_stop(text: str, stops: list[str]) -> str | None:
    found = [(text.find(stop), stop) for stop in stops if stop in text]
    return min(found)[1] if found else None


def _visible(text: str, stop: str | None, params: SamplingParams, finished: bool) -> str:
    """As the real engine shows it: cut at the stop string (kept with include_stop_str_in_output), and while running
    without a tail that may still grow into a stop string."""
    if stop is not None:
        at = text.find(stop)
        return text[:at + len(stop) if params.include_stop_str_in_output else at]
    if finished:
        return text
    held = max((size for s in params.stop_strings for size in range(1, len(s)) if text.endswith(s[:size])), default=0)
    return text[:len(text) - held]
