"""`bench serve`: streaming chat completions against any OpenAI-compatible server, timed per request the way the
public leaderboards time providers.

Definitions (per request, clocks start when the request is sent):
- ttft_s: time to the first streamed token of any kind, thinking included.
- ttfa_s: time to the first answer token (the first `content` or tool-call delta after the thinking); None when the
  request produced no answer.
- e2e_s: time to the end of the stream.
- output_speed_tps: output tokens / (e2e_s - ttft_s), the leaderboard's "output speed": generation speed once tokens
  flow, so queueing and prefill do not count against it.
- inter_token_s: the gaps between consecutive streamed deltas (a delta may carry several tokens, as after an accepted
  draft: this is the stall a reader sees).
With `turn_gap_s` a multi-turn session waits an exponentially distributed time (that mean, seeded by the session) before
each turn after the first, as an agent waits on its tool; with `session_key` every request carries its session's id
as `prompt_cache_key`, as agent frameworks do.
Token counts come from the server's usage (`stream_options.include_usage`) when it reports them, else from the
client's token counter, and every record says which.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from reasoning_engine.bench.datasets import Message, Session, Workload
from reasoning_engine.bench.tokens import TokenCounter

WARMUP_MESSAGES: list[Message] = [{"role": "user", "content": "Say hello."}]
_MESSAGE_OVERHEAD = 8  # tokens a chat template adds around one message, for the client-side context check


class BenchError(Exception):
    """A request that failed: HTTP status, error event, or broken stream."""


@dataclass
class ServeConfig:
    """Everything one `bench serve` run sends, resolved from the command line and the preset."""

    base_url: str
    model: str
    output_tokens: int
    concurrency: list[int]
    api_key: str | None = None
    max_turns: int | None = None
    ignore_eos: bool = False
    reasoning_history: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0
    max_model_len: int | None = None
    turn_gap_s: float = 0.0  # mean tool-execution gap before each later turn of a session (exponential); 0: none
    session_key: bool = False  # send the session id as prompt_cache_key
    # each turn's max_tokens drawn uniformly within output_tokens x (1 +- output_spread), seeded by session and turn:
    # with EOS ignored and one fixed length, closed-loop sessions finish, and send their next prompts, in lockstep
    output_spread: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.output_spread < 1:
            raise ValueError(f"output_spread (--output-spread) must be in [0, 1), got {self.output_spread}")

    def turn_output_tokens(self, session: str, turn: int) -> int:
        """The max_tokens of a session's turn (the same on every run)."""
        if not self.output_spread:
            return self.output_tokens
        low = max(1, round(self.output_tokens * (1 - self.output_spread)))
        high = max(low, round(self.output_tokens * (1 + self.output_spread)))
        return random.Random(f"{session}/{turn}/output").randint(low, high)


@dataclass
class StreamResult:
    """What one streamed completion produced and when."""

    reasoning: str = ""
    content: str = ""
    tool_text: str = ""
    ttft_s: float | None = None
    ttfa_s: float | None = None
    e2e_s: float = 0.0
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    delta_times: list[float] = field(default_factory=list)


@dataclass
class RequestRecord:
    """One request's figures, as written to the JSON."""

    concurrency: int
    session: str
    turn: int
    start_s: float  # since the start of its concurrency level
    ttft_s: float | None = None
    ttfa_s: float | None = None
    e2e_s: float | None = None
    output_speed_tps: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    reasoning_tokens: int | None = None
    answer_tokens: int | None = None
    token_source: str | None = None  # "usage", "usage+counted" (reasoning split counted) or "counted"
    finish_reason: str | None = None
    error: str | None = None
    inter_token_s: list[float] = field(default_factory=list)


def api_root(base_url: str) -> str:
    """The OpenAI-style root (`.../v1`): a bare `http://host:port` gets `/v1`, any explicit path is kept."""
    url = base_url.rstrip("/")
    return url if httpx.URL(url).path not in ("", "/") else url + "/v1"


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def list_models(client: httpx.AsyncClient, root: str, api_key: str | None) -> list[dict[str, Any]]:
    response = await client.get(f"{root}/models", headers=headers(api_key))
    if response.status_code != 200:
        raise BenchError(f"GET {root}/models: HTTP {response.status_code}: {_error_text(response.text)}")
    return list(response.json().get("data") or [])


def _error_text(body: str) -> str:
    try:
        error = json.loads(body).get("error", body)
    except (json.JSONDecodeError, AttributeError):
        return body[:300]
    return str(error.get("message", error) if isinstance(error, dict) else error)[:300]


def request_body(config: ServeConfig, messages: list[Message], max_tokens: int,
                 session: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": config.model, "messages": messages, "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.session_key and session is not None:
        body["prompt_cache_key"] = session
    body.update(config.extra_body)
    return body


async def stream_chat(client: httpx.AsyncClient, config: ServeConfig, messages: list[Message],
                      max_tokens: int, session: str | None = None) -> StreamResult:
    """One streaming chat completion within the request timeout (httpx's own timeouts bound each read, not the
    whole stream)."""
    try:
        return await asyncio.wait_for(_stream_chat(client, config, messages, max_tokens, session), config.timeout_s)
    except asyncio.TimeoutError:
        raise BenchError(f"no complete response within {config.timeout_s:g} s") from None


async def _stream_chat(client: httpx.AsyncClient, config: ServeConfig, messages: list[Message],
                       max_tokens: int, session: str | None) -> StreamResult:
    """Send one streaming chat completion and timestamp its deltas as they arrive."""
    out = StreamResult()
    start = time.perf_counter()
    body = request_body(config, messages, max_tokens, session)
    async with client.stream("POST", f"{api_root(config.base_url)}/chat/completions",
                             json=body, headers=headers(config.api_key)) as response:
        if response.status_code != 200:
            raise BenchError(f"HTTP {response.status_code}: {_error_text((await response.aread()).decode(errors='replace'))}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("error"):
                raise BenchError(f"error event: {_error_text(data)}")
            now = time.perf_counter() - start
            if event.get("usage"):
                out.usage = event["usage"]
            for choice in event.get("choices") or []:
                if choice.get("index", 0) != 0:
                    continue
                delta = choice.get("delta") or {}
                # `reasoning_content` (ours, DeepSeek, SGLang) or `reasoning` (newer vLLM, OpenRouter)
                reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
                content = delta.get("content") or ""
                functions = [call.get("function") or {} for call in delta.get("tool_calls") or []]
                tools = "".join((f.get("name") or "") + (f.get("arguments") or "") for f in functions)
                if reasoning or content or tools:
                    out.delta_times.append(now)
                if (reasoning or content or tools) and out.ttft_s is None:
                    out.ttft_s = now
                if (content or tools) and out.ttfa_s is None:
                    out.ttfa_s = now
                out.reasoning += reasoning
                out.content += content
                out.tool_text += tools
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
    out.e2e_s = time.perf_counter() - start
    return out


def _context_tokens(messages: list[Message], counter: TokenCounter) -> int:
    return sum(counter.count(str(m.get("content") or "")) + counter.count(str(m.get("reasoning_content") or ""))
               + _MESSAGE_OVERHEAD for m in messages)


def fill_tokens(record: RequestRecord, result: StreamResult, messages: list[Message], counter: TokenCounter) -> None:
    """Token counts from usage where the server gave them, counted otherwise; then the output speed. Counting runs
    on the event loop while other requests stream, so it happens only when the usage lacks the figure."""
    usage = result.usage or {}
    details = usage.get("completion_tokens_details") or {}
    if isinstance(usage.get("completion_tokens"), int):
        record.output_tokens = usage["completion_tokens"]
        if isinstance(details.get("reasoning_tokens"), int):
            record.reasoning_tokens, record.token_source = details["reasoning_tokens"], "usage"
        elif not result.reasoning:
            record.reasoning_tokens, record.token_source = 0, "usage"
        else:
            record.reasoning_tokens = min(counter.count(result.reasoning), record.output_tokens)
            record.token_source = "usage+counted"
        record.answer_tokens = record.output_tokens - record.reasoning_tokens
    else:
        record.reasoning_tokens = counter.count(result.reasoning)
        record.answer_tokens = counter.count(result.content + result.tool_text)
        record.output_tokens = record.reasoning_tokens + record.answer_tokens
        record.token_source = "counted"
    record.prompt_tokens = usage["prompt_tokens"] if isinstance(usage.get("prompt_tokens"), int) \
        else _context_tokens(messages, counter)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    record.cached_tokens = cached if isinstance(cached, int) else None
    if result.ttft_s is not None and result.e2e_s > result.ttft_s and record.output_tokens:
        record.output_speed_tps = record.output_tokens / (result.e2e_s - result.ttft_s)
    record.inter_token_s = [b - a for a, b in zip(result.delta_times, result.delta_times[1:])]


@dataclass
class LevelRun:
    """The raw outcome of one concurrency level."""

    concurrency: int
    records: list[RequestRecord]
    duration_s: float
    sessions_cut_short: int  # sessions stopped before their last turn because the context would overflow


class Runner:
    """Replays a workload at each concurrency level: `concurrency` sessions in flight, each turn after the last."""

    def __init__(self, config: ServeConfig, counter: TokenCounter, progress: Any | None = None) -> None:
        self.config = config
        self.counter = counter
        self.progress = progress

    def turns(self, session: Session) -> list[list[Message]]:
        return session.turns[: self.config.max_turns] if self.config.max_turns else session.turns

    async def warmup(self, client: httpx.AsyncClient, count: int) -> None:
        """Requests outside the measurement, so one-time costs (lazy init, first allocations) do not land on the
        first measured request. A failure here stops the run: the server is not answering."""
        for _ in range(count):
            await stream_chat(client, self.config, WARMUP_MESSAGES, min(16, self.config.output_tokens))

    async def run_level(self, client: httpx.AsyncClient, concurrency: int, sessions: list[Session]) -> LevelRun:
        records: list[RequestRecord] = []
        pending = list(reversed(sessions))
        cut_short = 0
        task = None
        if self.progress is not None:
            task = self.progress.add_task(f"concurrency {concurrency}", total=sum(len(self.turns(s)) for s in sessions))
        level_start = time.perf_counter()

        async def replay(session: Session) -> None:
            nonlocal cut_short
            history: list[Message] = []
            context = 0  # the previous turn's prompt + output tokens: what this turn's prompt starts with
            turns = self.turns(session)
            limit = self.config.max_model_len
            gaps = random.Random(f"{session.id}/gaps")
            for index, turn in enumerate(turns):
                if index and self.config.turn_gap_s:
                    await asyncio.sleep(gaps.expovariate(1.0 / self.config.turn_gap_s))  # the tool runs
                messages = history + turn
                max_tokens = self.config.turn_output_tokens(session.id, index)
                if index > 0 and limit and context + _context_tokens(turn, self.counter) + max_tokens > limit:
                    cut_short += 1
                    self._advance(task, len(turns) - index)
                    return
                record = RequestRecord(concurrency, session.id, index, time.perf_counter() - level_start)
                try:
                    result = await stream_chat(client, self.config, messages, max_tokens, session.id)
                except (BenchError, httpx.HTTPError, json.JSONDecodeError) as exc:
                    record.error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, BenchError) else str(exc)
                    records.append(record)
                    self._advance(task, len(turns) - index)
                    return
                record.ttft_s, record.ttfa_s, record.e2e_s = result.ttft_s, result.ttfa_s, result.e2e_s
                record.finish_reason = result.finish_reason
                fill_tokens(record, result, messages, self.counter)
                records.append(record)
                self._advance(task, 1)
                reply: Message = {"role": "assistant", "content": result.content}
                if result.reasoning and self.config.reasoning_history:
                    reply["reasoning_content"] = result.reasoning
                history = messages + [reply]
                context = (record.prompt_tokens or 0) + (record.output_tokens or 0) + _MESSAGE_OVERHEAD

        async def worker() -> None:
            while pending:
                await replay(pending.pop())

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(sessions)))))
        duration = time.perf_counter() - level_start
        records.sort(key=lambda r: r.start_s)
        return LevelRun(concurrency, records, duration, cut_short)

    def _advance(self, task: Any, steps: int) -> None:
        if self.progress is not None and task is not None:
            self.progress.advance(task, steps)

    async def run(self, workload: Workload, warmup: int) -> list[LevelRun]:
        limits = httpx.Limits(max_connections=max(self.config.concurrency) + 4, max_keepalive_connections=None)
        timeout = httpx.Timeout(self.config.timeout_s, connect=30.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            await self.warmup(client, warmup)
            return [await self.run_level(client, c, sessions)
                    for c, sessions in zip(self.config.concurrency, workload.levels)]
