"""The OpenAI chat and completions responses: chunks as the engine writes (`chat.completion.chunk`,
`text_completion` events) and the whole objects (`chat.completion`, `text_completion`), both from one `ChatRun`.
The requests are prepared in serving.py and run by routing.serve_prepared.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from reasoning_engine.server.chat_run import ChatRun
from reasoning_engine.server.engine_requests import SSE_DONE, EngineRequests, sse
from reasoning_engine.server.errors import APIError, error_body
from reasoning_engine.server.parsing import ParsedDelta
from reasoning_engine.server.protocol import ChatCompletionRequest, CompletionRequest
from reasoning_engine.server.serving import OpenAIServing, Prepared


def chat_stream(serving: OpenAIServing, req: ChatCompletionRequest, model: str, prepared: Prepared,
                engine_requests: EngineRequests, arrival: float) -> AsyncGenerator[str, None]:
    run = ChatRun(serving, engine_requests, prepared, arrival)
    base = _chunk_base(engine_requests, "chat.completion.chunk", model)
    top_n = req.top_logprobs or 0

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: list | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": {"content": logprobs} if logprobs else None,
                  "finish_reason": finish}
        return sse({**base, "choices": [choice]})

    async def chunks() -> AsyncGenerator[str, None]:
        for i in range(len(run.choices)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async with aclosing(run.updates(chat_logprobs=req.logprobs, top_n=top_n)) as updates:
            async for update in updates:
                choice, parsed = update.choice, update.parsed
                logprobs, choice.pending_logprobs = choice.pending_logprobs, []
                if parsed is None:
                    parsed = ParsedDelta(content=update.text)
                if parsed.reasoning:
                    yield chunk(choice.index, {"reasoning_content": parsed.reasoning}, logprobs=logprobs)
                    logprobs = []
                answer: dict[str, Any] = {}
                if parsed.content:
                    answer["content"] = parsed.content
                if parsed.tool_calls:
                    answer["tool_calls"] = _tool_call_deltas(parsed.tool_calls)
                if answer or (logprobs and not update.finished):
                    yield chunk(choice.index, answer, logprobs=logprobs)
                    logprobs = []
                if update.finished:
                    yield chunk(choice.index, {}, choice.api_finish_reason, logprobs=logprobs)

    return _event_stream(chunks(), run, base, usage=bool(req.stream_options and req.stream_options.include_usage))


async def chat_full(serving: OpenAIServing, req: ChatCompletionRequest, model: str, prepared: Prepared,
                    engine_requests: EngineRequests, arrival: float) -> dict[str, Any]:
    run = ChatRun(serving, engine_requests, prepared, arrival)
    async with aclosing(run.updates(chat_logprobs=req.logprobs, top_n=req.top_logprobs or 0)) as updates:
        async for update in updates:
            choice, parsed = update.choice, update.parsed
            if parsed is None:
                choice.content.append(update.text)
    choices = []
    for choice in run.choices:
        calls = choice.parser.tool_calls if choice.parser else []
        content = "".join(choice.content)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if content or not calls else None,
            "reasoning_content": "".join(choice.reasoning) or None,
        }
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        choices.append({"index": choice.index, "message": message,
                        "logprobs": {"content": choice.logprobs} if req.logprobs else None,
                        "finish_reason": choice.api_finish_reason, "stop_reason": choice.stop_reason})
    return {"id": engine_requests.ids[0], "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": run.usage()}


def completion_stream(serving: OpenAIServing, req: CompletionRequest, model: str, prepared: Prepared,
                      engine_requests: EngineRequests, arrival: float) -> AsyncGenerator[str, None]:
    run = ChatRun(serving, engine_requests, prepared, arrival)
    base = _chunk_base(engine_requests, "text_completion", model)

    async def chunks() -> AsyncGenerator[str, None]:
        if req.echo:
            for choice in run.choices:
                yield sse({**base, "choices": [{"index": choice.index, "text": run.prompt_text(choice),
                                                "logprobs": None, "finish_reason": None}]})
        async with aclosing(run.updates(completion_logprobs=req.logprobs)) as updates:
            async for update in updates:
                choice = update.choice
                logprobs, choice.pending_logprobs = choice.pending_logprobs, []
                if update.text or logprobs or update.finished:
                    yield sse({**base, "choices": [{
                        "index": choice.index, "text": update.text,
                        "logprobs": _legacy_logprobs(logprobs) if req.logprobs is not None else None,
                        "finish_reason": choice.finish_reason if update.finished else None,
                        "stop_reason": choice.stop_reason if update.finished else None}]})

    return _event_stream(chunks(), run, base, usage=bool(req.stream_options and req.stream_options.include_usage))


async def completion_full(serving: OpenAIServing, req: CompletionRequest, model: str, prepared: Prepared,
                          engine_requests: EngineRequests, arrival: float) -> dict[str, Any]:
    run = ChatRun(serving, engine_requests, prepared, arrival)
    async with aclosing(run.updates(completion_logprobs=req.logprobs)) as updates:
        async for _ in updates:
            pass
    choices = [{"index": c.index, "text": (run.prompt_text(c) if req.echo else "") + "".join(c.text),
                "logprobs": _legacy_logprobs(c.logprobs) if req.logprobs is not None else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in run.choices]
    return {"id": engine_requests.ids[0], "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": run.usage()}


def _chunk_base(engine_requests: EngineRequests, kind: str, model: str) -> dict[str, Any]:
    """What every chunk of a stream carries: the request id, the object kind, when and which model."""
    return {"id": engine_requests.ids[0], "object": kind, "created": int(time.time()), "model": model}


async def _event_stream(chunks: AsyncGenerator[str, None], run: ChatRun, base: dict[str, Any], *,
                        usage: bool) -> AsyncGenerator[str, None]:
    """An OpenAI event stream: `chunks`, the usage chunk when the request asked for it, then `[DONE]`; a failure
    once the stream has started is reported in it, never left hanging. Closing the stream closes `chunks` (and the
    run's walk with it) at once."""
    try:
        async with aclosing(chunks) as events:
            async for event in events:
                yield event
        if usage:
            yield sse({**base, "choices": [], "usage": run.usage()})
    except APIError as exc:
        yield sse(exc.body())
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band, never hang the client
        yield sse(error_body(f"generation failed: {exc}", "server_error"))
    yield SSE_DONE


def _legacy_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The completions API's column layout: tokens, token_logprobs, top_logprobs, text_offset."""
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [e["top"] for e in entries], "text_offset": [e["text_offset"] for e in entries]}


def _tool_call_deltas(deltas: list[Any]) -> list[dict[str, Any]]:
    """Parser deltas -> OpenAI's streamed `tool_calls`: the opening piece with id/type/name, then argument text;
    consecutive fragments of one call are merged."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if d.id is None and out and out[-1]["index"] == d.index:
            out[-1]["function"]["arguments"] += d.arguments
        elif d.id is not None:
            out.append({"index": d.index, "id": d.id, "type": "function",
                        "function": {"name": d.name, "arguments": d.arguments}})
        else:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out
