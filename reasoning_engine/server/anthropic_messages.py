"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A thin translator over the chat path, so Claude Code and Anthropic SDK clients get the same engine, parsers, limits
and metrics as OpenAI clients: a Messages request becomes a `ChatCompletionRequest`, goes through
`OpenAIServing.prepare_chat` -> `EngineRequests` -> `ChatRun.updates()`, and the parsed thinking / text / tool-call
deltas become Anthropic content blocks. Streamed and whole replies are built by the same `_ContentBlocks`, so the
streamed deltas join to the whole reply.

Where the two APIs differ:
- Tool call ids: the reply's `toolu_...` id is the model's own call id (Kimi's `functions.NAME:IDX`), base64url
  encoded, and is decoded again when the client sends it back in `tool_use` / `tool_result`, so the prompt shows the
  model the ids it was trained with; any other id is used as it is.
- `signature` of a thinking block: a SHA-256 of the thinking text, for clients that keep only signed thinking. It
  is not checked: thinking passed back is rendered as it comes, as `reasoning_content` is on the chat route.
- `usage.input_tokens` counts the prompt tokens not read from the prefix cache (`cache_read_input_tokens`), as
  Anthropic counts them; count_tokens gives the whole prompt.
- `max_tokens` past the room left in the context is cut to that room (newer Claude models do the same) and a reply
  that fills it stops with `model_context_window_exceeded`.
- Without `thinking` the chat template's default applies (the bundled model thinks). `budget_tokens` follows
  Anthropic's rules: at least 1024, and below `max_tokens` unless an interleaved-thinking beta is on.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal, Union, get_args

from fastapi import FastAPI
from pydantic import Discriminator, Field, Tag, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from reasoning_engine.server.chat_template import disable_thinking
from reasoning_engine.server.chat_run import ChatRun
from reasoning_engine.server.engine_requests import EngineRequests, new_request_id
from reasoning_engine.server.errors import APIError, bad_request, from_validation_error
from reasoning_engine.server.openapi import errors
from reasoning_engine.server.parsing import ParsedDelta
from reasoning_engine.server.protocol import CacheSalt, ChatCompletionRequest, RequestBody
from reasoning_engine.server.routing import json_body, serve_prepared, session_key
from reasoning_engine.server.serving import OpenAIServing, Prepared
from reasoning_engine.server.tool_parsers import ToolCallDelta

PATH_PREFIX = "/v1/messages"
_TOOL_ID_PREFIX = "toolu_"
MIN_THINKING_BUDGET = 1024  # Anthropic's floor for thinking.budget_tokens
INTERLEAVED_THINKING_BETA = "interleaved-thinking-"  # its `anthropic-beta` names let the budget pass max_tokens
_TAG = "~"  # union tags start with it (errors.UNION_TAG_MARKS), so an error's parameter leaves them out
_THINKING_ON = {"thinking": True, "enable_thinking": True}  # the switches chat_template.disable_thinking turns off
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error"}
# chat request parameters an error may name -> the Messages parameter the client sent
_CHAT_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "user": "metadata.user_id",
                "thinking_token_budget": "thinking.budget_tokens", "chat_template_kwargs": "thinking",
                "continue_final_message": "messages", "parallel_tool_calls": "tool_choice"}


# ---- request bodies ---------------------------------------------------------------------------------------

def _one_of(*members: type[RequestBody]) -> Any:
    """A union of blocks told apart by their `type`; an unknown `type` is reported as such, at the block."""
    tags = {value: _TAG + member.__name__ for member in members
            for value in get_args(member.model_fields["type"].annotation)}

    def tag(value: Any) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return tags.get(kind) if isinstance(kind, str) else None

    union = Union[tuple(Annotated[member, Tag(_TAG + member.__name__)] for member in members)]  # noqa: UP007
    return Annotated[union, Discriminator(tag, custom_error_type="invalid_type",
                                          custom_error_message=f"type must be one of: {', '.join(tags)}")]


def _string_or_list(item: Any) -> Any:
    """A string or a list of `item`, told apart first so a bad item is reported as itself."""
    return Annotated[Annotated[str, Tag(_TAG + "str")] | Annotated[list[item], Tag(_TAG + "list")],
                     Discriminator(lambda value: _TAG + ("list" if isinstance(value, list) else "str"))]


class TextBlock(RequestBody):
    type: Literal["text"]
    text: str


class Base64Source(RequestBody):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(min_length=1)


class URLSource(RequestBody):
    type: Literal["url"]
    url: str = Field(min_length=1)


ImageSource = _one_of(Base64Source, URLSource)


class ImageBlock(RequestBody):
    type: Literal["image"]
    source: ImageSource  # type: ignore[valid-type]

    def url(self) -> str:
        """The chat image part's URL: a data URL for inline images, so the multimodal path's checks apply."""
        if isinstance(self.source, Base64Source):
            return f"data:{self.source.media_type};base64,{self.source.data}"
        return self.source.url


class ToolUseBlock(RequestBody):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


ToolResultContent = _string_or_list(_one_of(TextBlock, ImageBlock))


class ToolResultBlock(RequestBody):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: ToolResultContent = ""  # type: ignore[valid-type]
    is_error: bool = False


class ThinkingBlock(RequestBody):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(RequestBody):
    """Encrypted thinking from Anthropic's own models: opaque, so it is left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str


MessageContent = _string_or_list(_one_of(TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                                         RedactedThinkingBlock))


class MessageParam(RequestBody):
    role: Literal["user", "assistant"]
    content: MessageContent  # type: ignore[valid-type]


class ToolDefinition(RequestBody):
    """A client tool; Anthropic's server tools (web search, code execution) have other types and are refused."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoiceAuto(RequestBody):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(RequestBody):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(RequestBody):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(RequestBody):
    type: Literal["none"]


ToolChoice = _one_of(ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone)


class ThinkingEnabled(RequestBody):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=MIN_THINKING_BUDGET)
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(RequestBody):
    """The model decides how long to think (the server's default budget applies); the bundled models think at the
    start of every turn, tool turns included, so `between_tools` is served the same way."""

    type: Literal["adaptive", "between_tools"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(RequestBody):
    type: Literal["disabled"]


ThinkingConfig = _one_of(ThinkingEnabled, ThinkingAdaptive, ThinkingDisabled)
SystemContent = _string_or_list(TextBlock)


class Metadata(RequestBody):
    user_id: str | None = Field(default=None, max_length=256)


class CountTokensRequest(RequestBody):
    """What count_tokens reads: the parts of a Messages request that shape the prompt."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: SystemContent | None = None  # type: ignore[valid-type]
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None  # type: ignore[valid-type]
    thinking: ThinkingConfig | None = None  # type: ignore[valid-type]


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    stream: bool = False
    cache_salt: CacheSalt = None  # vLLM's, as on the OpenAI routes (Anthropic's API has no such field)


# ---- request translation ----------------------------------------------------------------------------------

@dataclass
class ParamNames:
    """Where each chat parameter came from in the Messages request, so errors name what the client sent."""

    paths: dict[str, str] = field(default_factory=lambda: dict(_CHAT_PARAMS))  # chat path -> Messages path

    def error(self, exc: APIError) -> APIError:
        """`exc` naming the Messages parameter instead of the chat one (in its `param` and message)."""
        if exc.param is None:
            return exc
        param = self.param(exc.param)
        message = exc.message
        if message.startswith(exc.param):
            message = param + message[len(exc.param):]
        return APIError(exc.status, message, param=param, code=exc.code, type=exc.type)

    def param(self, chat_param: str) -> str:
        best = max((key for key in self.paths if chat_param == key or chat_param.startswith((key + ".", key + "["))),
                   key=len, default=None)
        return chat_param if best is None else self.paths[best] + chat_param[len(best):]

    def message(self, index: int, path: str, part_paths: list[str] | None = None) -> None:
        """Chat message `index` came from `path`, its content parts (if a list) from `part_paths`."""
        self.paths[f"messages[{index}]"] = path
        for p, part_path in enumerate(part_paths or []):
            self.paths[f"messages[{index}].content[{p}]"] = part_path


@dataclass
class Translation:
    """The chat request a Messages request becomes, and the names its parameters had."""

    chat: ChatCompletionRequest
    names: ParamNames


def tool_use_id(call_id: str) -> str:
    """The model's call id as an Anthropic tool_use id (`^[a-zA-Z0-9_-]+$`)."""
    return _TOOL_ID_PREFIX + base64.urlsafe_b64encode(call_id.encode()).decode().rstrip("=")


def call_id(anthropic_id: str) -> str:
    """The model's call id back from an id `tool_use_id` made; any other id (a client's own) stays as it is."""
    if not anthropic_id.startswith(_TOOL_ID_PREFIX):
        return anthropic_id
    body = anthropic_id[len(_TOOL_ID_PREFIX):]
    try:
        decoded = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode("ascii")
    except ValueError:  # not base64, or not text: not one of ours
        return anthropic_id
    ours = bool(decoded) and decoded.isprintable() and tool_use_id(decoded) == anthropic_id
    return decoded if ours else anthropic_id


def translate(req: CountTokensRequest) -> Translation:
    """The Messages request as a chat request: system first, each tool_result a tool message, the rest of a user
    turn a user message after them, an assistant turn's thinking / text / tool_use its reasoning, content and
    tool calls; a final assistant turn is a prefill the reply continues."""
    _check_tool_results(req.messages)
    names = ParamNames()
    messages: list[dict[str, Any]] = []
    if req.system:
        names.message(0, "system")
        system = req.system if isinstance(req.system, str) else "\n".join(block.text for block in req.system)
        messages.append({"role": "system", "content": system})
    for k, message in enumerate(req.messages):
        where = f"messages[{k}]"
        if isinstance(message.content, str):
            names.message(len(messages), where)
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            names.message(len(messages), where)
            messages.append(_assistant_message(message.content, where))
        else:
            for chat_message, path, part_paths in _user_messages(message.content, where):
                names.message(len(messages), path, part_paths)
                messages.append(chat_message)
    chat: dict[str, Any] = {"model": req.model, "messages": messages,
                            "continue_final_message": req.messages[-1].role == "assistant",
                            "add_generation_prompt": req.messages[-1].role != "assistant"}
    if req.tools:
        chat["tools"] = [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                            "parameters": tool.input_schema}} for tool in req.tools]
        for i in range(len(req.tools)):
            names.paths[f"tools[{i}].function"] = f"tools[{i}]"
            names.paths[f"tools[{i}].function.parameters"] = f"tools[{i}].input_schema"
    chat.update(_tool_choice(req))
    chat.update(_thinking(req.thinking))
    if isinstance(req, MessagesRequest):
        chat.update(max_tokens=None, stream=req.stream, stop=req.stop_sequences, temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k, user=req.metadata.user_id if req.metadata else None,
                    cache_salt=req.cache_salt)
    try:
        return Translation(ChatCompletionRequest.model_validate(chat), names)
    except ValidationError as exc:
        raise names.error(from_validation_error(exc)) from exc


def _check_tool_results(messages: list[MessageParam]) -> None:
    """Each tool_result answers a tool_use of the message right before it, as Anthropic requires: a 400 naming
    `messages[k].content[j].tool_use_id` otherwise."""
    for k, message in enumerate(messages):
        if isinstance(message.content, str):
            continue
        before = messages[k - 1].content if k > 0 and messages[k - 1].role == "assistant" else ""
        uses = {block.id for block in before if isinstance(block, ToolUseBlock)} if isinstance(before, list) else set()
        for j, block in enumerate(message.content):
            if isinstance(block, ToolResultBlock) and block.tool_use_id not in uses:
                param = f"messages[{k}].content[{j}].tool_use_id"
                raise bad_request(f"{param}: unexpected `tool_use_id` {block.tool_use_id[:100]!r} in a `tool_result` "
                                  "block: each `tool_result` must answer a `tool_use` block in the previous message",
                                  param=param, code="invalid_value")


def _user_messages(blocks: list[Any], where: str) -> list[tuple[dict[str, Any], str, list[str]]]:
    """A user turn's blocks in order: each tool_result its own tool message, each run of text and images a user
    message; with the Messages path of each message and of its parts."""
    out: list[tuple[dict[str, Any], str, list[str]]] = []
    parts: list[dict[str, Any]] = []
    part_paths: list[str] = []
    for j, block in enumerate(blocks):
        path = f"{where}.content[{j}]"
        if isinstance(block, (TextBlock, ImageBlock)):
            parts.append(_chat_part(block))
            part_paths.append(path)
            continue
        if not isinstance(block, ToolResultBlock):
            raise bad_request(f"{path}: a user message cannot hold a {block.type} block", param=path)
        if parts:
            out.append(({"role": "user", "content": parts}, where, part_paths))
            parts, part_paths = [], []
        content, result_paths = _tool_result_content(block, path)
        out.append(({"role": "tool", "tool_call_id": call_id(block.tool_use_id), "content": content}, path,
                    result_paths))
    if parts:
        out.append(({"role": "user", "content": parts}, where, part_paths))
    return out


def _assistant_message(blocks: list[Any], where: str) -> dict[str, Any]:
    for j, block in enumerate(blocks):
        if isinstance(block, (ImageBlock, ToolResultBlock)):
            raise bad_request(f"{where}.content[{j}]: an assistant message cannot hold a {block.type} block",
                              param=f"{where}.content[{j}]")
    text = [block.text for block in blocks if isinstance(block, TextBlock)]
    thinking = [block.thinking for block in blocks if isinstance(block, ThinkingBlock)]
    calls = [{"id": call_id(block.id), "type": "function",
              "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}
             for block in blocks if isinstance(block, ToolUseBlock)]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if thinking:
        message["reasoning_content"] = "\n\n".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _chat_part(block: TextBlock | ImageBlock) -> dict[str, Any]:
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    return {"type": "image_url", "image_url": {"url": block.url()}}


def _tool_result_content(block: ToolResultBlock, path: str) -> tuple[str | list[dict[str, Any]], list[str]]:
    """The result as the tool message's content (text joined; parts kept when it holds images), with the path of
    each part. A failed tool's result says so in its text, since chat messages have no `is_error`."""
    prefix = "Error: " if block.is_error else ""
    if isinstance(block.content, str):
        return prefix + block.content, []
    parts = [_chat_part(part) for part in block.content]
    paths = [f"{path}.content[{q}]" for q in range(len(parts))]
    if all(part["type"] == "text" for part in parts):
        return prefix + "\n".join(part["text"] for part in parts), []
    if prefix:
        parts, paths = [{"type": "text", "text": prefix.strip()}, *parts], [f"{path}.is_error", *paths]
    return parts, paths


def _tool_choice(req: CountTokensRequest) -> dict[str, Any]:
    choice = req.tool_choice
    if choice is None:
        return {}
    names = {tool.name for tool in req.tools or []}
    if isinstance(choice, (ToolChoiceAny, ToolChoiceTool)) and not names:
        raise bad_request(f"tool_choice {choice.type!r} needs tools", param="tool_choice")
    if isinstance(choice, ToolChoiceTool) and choice.name not in names:
        raise bad_request(f"tool_choice names `{choice.name}`, which is not among the tools", param="tool_choice.name")
    if isinstance(choice, ToolChoiceNone):
        return {"tool_choice": "none"}
    mapped: Any = {"auto": "auto", "any": "required"}.get(choice.type)
    if isinstance(choice, ToolChoiceTool):
        mapped = {"type": "function", "function": {"name": choice.name}}
    out: dict[str, Any] = {"tool_choice": mapped}
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


def _thinking(config: ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, ThinkingDisabled):
        return {"chat_template_kwargs": disable_thinking({})}
    out: dict[str, Any] = {"chat_template_kwargs": dict(_THINKING_ON)}
    if isinstance(config, ThinkingEnabled):
        out["thinking_token_budget"] = config.budget_tokens
    return out


async def count_prompt_tokens(serving: OpenAIServing, chat: ChatCompletionRequest) -> int:
    """The prompt's token count as prepare_chat renders it (tools unless tool_choice is none, thinking off for a zero
    budget); media are loaded, so each counts as all the tokens the engine gives it."""
    rendered, refs, _ = serving.render_prompt(chat, tools_active=bool(chat.tools) and chat.tool_choice != "none")
    return len(await serving.media_prompt_ids(rendered.token_ids, refs))


# ---- replies ----------------------------------------------------------------------------------------------

def thinking_signature(thinking: str) -> str:
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


class _ContentBlocks:
    """One choice's parsed deltas as Anthropic content blocks: the stream events that build them, and the blocks
    themselves for the whole reply. A block stays open while deltas of its kind follow; another kind closes it."""

    def __init__(self, show_thinking: bool) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._show_thinking = show_thinking
        self._open: str | None = None
        self._thinking = ""
        self._arguments = ""

    def feed(self, parsed: ParsedDelta) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        if parsed.reasoning:
            events += self._append("thinking", parsed.reasoning)
        if parsed.content:
            events += self._append("text", parsed.content)
        for call in parsed.tool_calls:
            events += self._tool_call(call)
        return events

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

    def _tool_call(self, call: ToolCallDelta) -> list[tuple[str, dict[str, Any]]]:
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
class _Reply:
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


def _stop(run: ChatRun, reply: _Reply) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of the run's one choice."""
    choice = run.choices[0]
    if choice.finish_reason == "length":
        return ("model_context_window_exceeded" if reply.clamped else "max_tokens"), None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    if run.serving.finish_reason(choice) == "tool_calls":
        return "tool_use", None
    return "end_turn", None


def _message(reply: _Reply, content: list[dict[str, Any]], usage: dict[str, Any],
             stop: tuple[str | None, str | None]) -> dict[str, Any]:
    return {"id": reply.id, "type": "message", "role": "assistant", "model": reply.model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


def _parsed(update: Any) -> ParsedDelta:
    return update.parsed if update.parsed is not None else ParsedDelta(content=update.text)


async def reply_whole(run: ChatRun, reply: _Reply) -> dict[str, Any]:
    blocks = _ContentBlocks(reply.show_thinking)
    async with aclosing(run.updates()) as updates:
        async for update in updates:
            blocks.feed(_parsed(update))
    blocks.close()
    return _message(reply, blocks.blocks, _usage(run), _stop(run, reply))


def sse_event(kind: str, data: dict[str, Any]) -> str:
    payload = json.dumps({"type": kind, **data}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {payload}\n\n"


async def reply_stream(run: ChatRun, reply: _Reply, translation: Translation) -> AsyncGenerator[str, None]:
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


# ---- errors -----------------------------------------------------------------------------------------------

ANTHROPIC_ERROR_SCHEMA: dict[str, Any] = {  # error_body's shape, for the OpenAPI document
    "type": "object",
    "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"enum": sorted({*_ERROR_TYPES.values(), "invalid_request_error", "api_error"})},
                       "message": {"type": "string"}}}},
}


def is_anthropic_path(path: str) -> bool:
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


def error_body(error: APIError) -> dict[str, Any]:
    """Anthropic's error object; it has no `param`, so the message starts with the parameter at fault."""
    kind = _ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    message = error.message
    if error.param and not message.startswith(error.param):
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


# ---- routes -----------------------------------------------------------------------------------------------

def register_anthropic_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """Add `/v1/messages` and `/v1/messages/count_tokens`. Errors on these paths take Anthropic's shape through the
    app's handlers (`is_anthropic_path`)."""

    @app.post(PATH_PREFIX, responses=errors(400, 404, 503))
    async def messages(request: Request) -> Response:
        arrival = time.monotonic()
        req = await json_body(request, MessagesRequest)
        check_thinking_budget(req, request.headers.get("anthropic-beta", ""))
        translation = translate(req)
        chat = translation.chat
        display = req.thinking.display if isinstance(req.thinking, (ThinkingEnabled, ThinkingAdaptive)) else None
        try:
            model = serving.check_model(req.model)
            prepared = await serving.prepare_chat(chat)
            clamped = _clamp_max_tokens(prepared, req.max_tokens)
            request_id = new_request_id("msg")
            reply = _Reply(_message_id(request_id), model, clamped, show_thinking=display != "omitted")

            def run(engine_requests: EngineRequests) -> ChatRun:
                return ChatRun(serving, engine_requests, prepared, arrival)

            return await serve_prepared(
                request, serving.engine, prepared, request_id, session_key(request, chat.user), stream=req.stream,
                streamed=lambda runs: reply_stream(run(runs), reply, translation),
                whole=lambda runs: reply_whole(run(runs), reply))
        except APIError as exc:
            raise translation.names.error(exc) from exc

    @app.post(PATH_PREFIX + "/count_tokens", responses=errors(400, 404))
    async def count_tokens(request: Request) -> Response:
        req = await json_body(request, CountTokensRequest)
        translation = translate(req)
        try:
            serving.check_model(req.model)
            return JSONResponse({"input_tokens": await count_prompt_tokens(serving, translation.chat)})
        except APIError as exc:
            raise translation.names.error(exc) from exc


def check_thinking_budget(req: MessagesRequest, betas: str) -> None:
    """`thinking.budget_tokens` below `max_tokens`, as Anthropic requires, unless the `anthropic-beta` header turns
    on interleaved thinking, whose budget spans all the thinking blocks of the turn and may pass max_tokens."""
    if not isinstance(req.thinking, ThinkingEnabled) or req.thinking.budget_tokens < req.max_tokens:
        return
    if any(beta.strip().startswith(INTERLEAVED_THINKING_BETA) for beta in betas.split(",")):
        return
    raise bad_request(f"thinking.budget_tokens: must be less than max_tokens ({req.max_tokens}), which counts the "
                      "thinking too", param="thinking.budget_tokens", code="invalid_value")


def _clamp_max_tokens(prepared: Prepared, requested: int) -> bool:
    """Cut `max_tokens` to the room the prompt leaves (prepare_chat was given none, so its limit is that room, or
    None with media, where only the engine knows it); True when it was cut."""
    room = prepared.params.max_tokens
    prepared.params = replace(prepared.params, max_tokens=requested if room is None else min(requested, room))
    return room is not None and requested > room


def _message_id(request_id: str) -> str:
    return "msg_" + request_id.removeprefix("msg-")
