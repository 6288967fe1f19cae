"""The engine's parsed output as Responses output items and stream events: reasoning, message and function_call items,
their deltas as the engine writes, and the finished response (`ResponseRun`)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal

from reasoning_engine.server.chat_run import ChatRun
from reasoning_engine.server.engine_requests import EngineRequests
from reasoning_engine.server.errors import APIError
from reasoning_engine.server.parsing import OutputShaper, ParsedDelta
from reasoning_engine.server.responses.translate import new_item_id
from reasoning_engine.server.serving import OpenAIServing, Prepared
from reasoning_engine.server.tool_parsers import ToolCallDelta

@dataclass
class _OutputItem:
    kind: Literal["reasoning", "message", "function_call"]
    id: str
    output_index: int
    text: list[str] = field(default_factory=list)  # the thinking, the answer or the arguments
    call_id: str = ""
    name: str = ""
    status: str = "in_progress"

    def dump(self, full: bool = True) -> dict[str, Any]:
        """The item as the API shows it; `full=False`: as first announced, before any text."""
        text = "".join(self.text) if full else ""
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": text}] if full else [], "status": self.status}
        if self.kind == "message":
            return {"id": self.id, "type": "message", "role": "assistant", "status": self.status,
                    "content": [_output_text(text)] if full else []}
        return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                "arguments": text, "status": self.status}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseOutput(OutputShaper):
    """Output items built from one choice's parsed deltas. Each step returns the stream events it makes (without
    sequence numbers): an item opens when its first piece arrives and closes when a piece of another kind or the
    end arrives, so items appear in the order the model wrote them."""

    def __init__(self) -> None:
        self.items: list[_OutputItem] = []
        self._open: _OutputItem | None = None
        self._calls: dict[int, _OutputItem] = {}

    def thinking(self, text: str) -> list[dict[str, Any]]:
        return self._text("reasoning", text)

    def answer(self, text: str) -> list[dict[str, Any]]:
        return self._text("message", text)

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """Close the open item; it is `incomplete` when the output was cut off."""
        return self._close("incomplete" if incomplete else "completed")

    def _text(self, kind: Literal["reasoning", "message"], text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self._open
        if item is None or item.kind != kind:
            events += self._close("completed")
            item = self._start(kind, new_item_id("rs" if kind == "reasoning" else "msg"))
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else _output_text("")
            events += [self._added(item), {"type": "response.content_part.added", **self._at(item), "part": part}]
        item.text.append(text)
        if kind == "reasoning":
            return [*events, {"type": "response.reasoning_text.delta", **self._at(item), "delta": text}]
        return [*events, {"type": "response.output_text.delta", **self._at(item), "delta": text, "logprobs": []}]

    def tool_call(self, delta: ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self._calls.get(delta.index)
        if delta.id is not None or item is None:
            events += self._close("completed")
            item = self._start("function_call", new_item_id("fc"))
            item.call_id, item.name = delta.id or new_item_id("call"), delta.name or ""
            self._calls[delta.index] = item
            events.append(self._added(item))
        if delta.arguments:
            item.text.append(delta.arguments)
            events.append({"type": "response.function_call_arguments.delta", "item_id": item.id,
                           "output_index": item.output_index, "delta": delta.arguments})
        return events

    def _start(self, kind: Literal["reasoning", "message", "function_call"], item_id: str) -> _OutputItem:
        item = _OutputItem(kind, item_id, len(self.items))
        self.items.append(item)
        self._open = item
        return item

    def _added(self, item: _OutputItem) -> dict[str, Any]:
        return {"type": "response.output_item.added", "output_index": item.output_index, "item": item.dump(False)}

    @staticmethod
    def _at(item: _OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": item.output_index, "content_index": 0}

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        text = "".join(item.text)
        done = {"type": "response.output_item.done", "output_index": item.output_index, "item": item.dump()}
        if item.kind == "function_call":
            return [{"type": "response.function_call_arguments.done", "item_id": item.id,
                     "output_index": item.output_index, "arguments": text}, done]
        if item.kind == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            text_done = {"type": "response.reasoning_text.done", **self._at(item), "text": text}
        else:
            part = _output_text(text)
            text_done = {"type": "response.output_text.done", **self._at(item), "text": text, "logprobs": []}
        return [text_done, {"type": "response.content_part.done", **self._at(item), "part": part}, done]


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {
                "reasoning_tokens": chat_usage["completion_tokens_details"]["reasoning_tokens"]},
            "total_tokens": chat_usage["total_tokens"]}


class ResponseRun:
    """One Responses request through the chat path: the engine request's outputs -> output items and events."""

    def __init__(self, serving: OpenAIServing, prepared: Prepared, engine_requests: EngineRequests,
                 body: dict[str, Any], arrival: float) -> None:
        self.serving = serving
        self.run = ChatRun(serving, engine_requests, prepared, arrival)
        self.body = body
        self.output = ResponseOutput()

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Item events as the engine produces text; on the way out `body` becomes the finished response."""
        async with aclosing(self.run.updates()) as updates:
            async for update in updates:
                parsed = update.parsed if update.parsed is not None else ParsedDelta(content=update.text)
                for event in self.output.feed(parsed):
                    yield event
                if update.finished:
                    incomplete = update.choice.api_finish_reason == "length"
                    for event in self.output.finish(incomplete):
                        yield event
                    self.body["status"] = "incomplete" if incomplete else "completed"
                    if incomplete:
                        self.body["incomplete_details"] = {"reason": "max_output_tokens"}
        self.body["output"] = [item.dump() for item in self.output.items]
        self.body["usage"] = _usage(self.run.usage())


def _sse_event(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def event_stream(run: ResponseRun, body: dict[str, Any], keep: Callable[[], None]) -> AsyncGenerator[str, None]:
    """The SSE stream: created, in_progress, the item events, then completed or incomplete; a failure after the
    stream started is an `error` event. Every event carries the next `sequence_number`."""
    sequence = 0

    def event(payload: dict[str, Any]) -> str:
        nonlocal sequence
        payload["sequence_number"] = sequence
        sequence += 1
        return _sse_event(payload)

    yield event({"type": "response.created", "response": body})
    yield event({"type": "response.in_progress", "response": body})
    try:
        async for payload in run.events():
            yield event(payload)
    except APIError as exc:
        yield event({"type": "error", "code": exc.code or exc.type, "message": exc.message, "param": exc.param})
        return
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band, never hang the client
        yield event({"type": "error", "code": "server_error", "message": f"generation failed: {exc}",
                     "param": None})
        return
    keep()
    yield event({"type": f"response.{body['status']}", "response": body})
