"""The parsed output as Anthropic content blocks: thinking (signed), text and tool_use blocks, streamed as Anthropic's
events or gathered into one message by the same `_ContentBlocks`, so the streamed deltas join to the whole reply."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from reasoning_engine.server.anthropic.errors import error_body
from reasoning_engine.server.anthropic.translate import Translation, tool_use_id
from reasoning_engine.server.chat_run import ChatRun
from reasoning_engine.server.errors import APIError
from reasoning_engine.server.parsing import OutputShaper, ParsedDelta
from reasoning_engine.server.tool_parsers import ToolCallDelta

def thinking_signature(thinking: str) -> str:
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


class _ContentBlocks(OutputShaper):
    """One choice's parsed deltas as Anthropic content blocks: the stream events that build them, and the blocks
    themselves for the whole reply. A block stays open while deltas of its kind follow; another kind closes it."""

    def __init__(self, show_thinking: bool) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._show_thinking = show_thinking
        self._open: str | None = None
        self._thinking = ""
        self._arguments = ""

    def thinking(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        return self._append("thinking", text)

    def answer(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        return self._append("text", text)

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        """End the open block: a thinking block gets its signature, a tool_use block its parsed input."""
        if self._open is None:
            return []
        index, block = len(self.blocks) - 1, self.blocks[-1]
        events: list[tuple[str, dict[str, Any]]] = []
        if self._open == "thinking":
            block["signature"] = thinking_signature(self._thinking)
            events.append(("content_block_delta", {"index": index, "delta": {"type": "signature_delta",
                                                                             "signature": block["signature"]}}))
        elif self._open == "tool_use":
            block["input"] = _tool_input(self._arguments)
        self._open, self._thinking, self._arguments = None, "", ""
        return [*events, ("content_block_stop", {"index": index})]

    def _start(self, kind: str, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events = self.close()
        self._open = kind
        self.blocks.append(block)
        return [*events, ("content_block_start", {"index": len(self.blocks) - 1, "content_block": dict(block)})]

    def _append(self, kind: str, text: str) -> list[tuple[str, dict[str, Any]]]:
        events = [] if self._open == kind else self._start(
            kind, {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else
            {"type": "text", "text": ""})
        if kind == "thinking":
            self._thinking += text
            if not self._show_thinking:
                return events
        self.blocks[-1][kind] += text
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                          "text": text}
        return [*events, ("content_block_delta", {"index": len(self.blocks) - 1, "delta": delta})]

    def tool_call(self, call: ToolCallDelta) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        if call.id is not None:
            events = self._start("tool_use", {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
                                              "input": {}})
        if call.arguments and self._open == "tool_use":
            self._arguments += call.arguments
            events.append(("content_block_delta", {"index": len(self.blocks) - 1, "delta": {
                "type": "input_json_delta", "partial_json": call.arguments}}))
        return events


def _tool_input(arguments: str) -> dict[str, Any]:
    """The call's arguments as the `input` object; arguments that are not a JSON object (a call cut off by
    max_tokens) give an empty one."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass
class Reply:
    """What a reply needs besides the run: its id, the model name, and whether max_tokens was cut to the context."""

    id: str
    model: str
    clamped: bool
    show_thinking: bool


def _usage(run: ChatRun) -> dict[str, Any]:
    usage = run.usage()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"thinking_tokens": usage["completion_tokens_details"]["reasoning_tokens"]}}


def _stop(run: ChatRun, reply: Reply) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of the run's one choice."""
    choice = run.choices[0]
    if choice.finish_reason == "length":
        return ("model_context_window_exceeded" if reply.clamped else "max_tokens"), None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    if choice.api_finish_reason == "tool_calls":
        return "tool_use", None
    return "end_turn", None


def _message(reply: Reply, content: list[dict[str, Any]], usage: dict[str, Any],
             stop: tuple[str | None, str | None]) -> dict[str, Any]:
    return {"id": reply.id, "type": "message", "role": "assistant", "model": reply.model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


def _parsed(update: Any) -> ParsedDelta:
    return update.parsed if update.parsed is not None else ParsedDelta(content=update.text)


async def reply_whole(run: ChatRun, reply: Reply) -> dict[str, Any]:
    blocks = _ContentBlocks(reply.show_thinking)
    async with aclosing(run.updates()) as updates:
        async for update in updates:
            blocks.feed(_parsed(update))
    blocks.close()
    return _message(reply, blocks.blocks, _usage(run), _stop(run, reply))


def sse_event(kind: str, data: dict[str, Any]) -> str:
    payload = json.dumps({"type": kind, **data}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {payload}\n\n"


async def reply_stream(run: ChatRun, reply: Reply, translation: Translation) -> AsyncGenerator[str, None]:
    """Anthropic's event sequence: message_start and a ping with the first output, the blocks' events, then
    message_delta (stop reason, usage) and message_stop; a failure once the stream is open is an `error` event."""
    blocks = _ContentBlocks(reply.show_thinking)
    started = False

    def start() -> str:
        """message_start once the first output is in, so its usage has the prompt's cached tokens."""
        nonlocal started
        started = True
        return (sse_event("message_start", {"message": _message(reply, [], _usage(run), (None, None))})
                + sse_event("ping", {}))

    try:
        async with aclosing(run.updates()) as updates:
            async for update in updates:
                if not started:
                    yield start()
                for kind, data in blocks.feed(_parsed(update)):
                    yield sse_event(kind, data)
        if not started:
            yield start()
        for kind, data in blocks.close():
            yield sse_event(kind, data)
        stop_reason, stop_sequence = _stop(run, reply)
        yield sse_event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                          "usage": _usage(run)})
        yield sse_event("message_stop", {})
    except APIError as exc:
        yield sse_event("error", error_body(translation.names.error(exc)))
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band, never hang the client
        yield sse_event("error", error_body(APIError(500, f"generation failed: {exc}")))
