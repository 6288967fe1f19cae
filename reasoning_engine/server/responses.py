"""The OpenAI Responses API: `POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`, `GET .../input_items`.

A thin translator over the chat path, so every rule of chat requests (template, thinking switch and budget, tools,
media and their 400s, sampling checks) applies unchanged: a Responses request becomes a `ChatCompletionRequest`
(`to_chat_request`), goes through `OpenAIServing.prepare_chat` -> `EngineRequests` -> `ChatRun.updates()`, and the
parsed reasoning / content / tool-call deltas become output items and stream events (`ResponseOutput`). The
non-streaming response is built by the same `ResponseOutput` with its events dropped, so both report the same items.

Stored responses (`store`, default true) are kept in memory (`ResponseStore`: LRU, bounded in count, each entry
expiring a fixed time after it was stored). A stored response keeps the items its prompt was made of plus its output,
so `previous_response_id` prepends exactly the earlier conversation: the new prompt renders as the previous prompt
plus the new turn, and the engine's prefix cache serves the shared part. `instructions` are not carried over (as in
OpenAI's API): each request sends its own.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query
from pydantic import ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from reasoning_engine.server.chat_template import disable_thinking
from reasoning_engine.server.chat_run import ChatRun
from reasoning_engine.server.engine_requests import EngineRequests
from reasoning_engine.server.errors import APIError, bad_request, from_error_detail, param_from_loc
from reasoning_engine.server.openapi import errors
from reasoning_engine.server.parsing import ParsedDelta
from reasoning_engine.server.protocol import (
    CacheSalt,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDef,
    ImagePart,
    ImageURL,
    NamedFunction,
    NamedToolChoice,
    RequestBody,
    TextPart,
    ToolCallIn,
    ToolDef,
)
from reasoning_engine.server.routing import json_body, serve_prepared, session_key
from reasoning_engine.server.serving import OpenAIServing, Prepared
from reasoning_engine.server.tool_parsers import ToolCallDelta

DEFAULT_MAX_STORED_RESPONSES = 1024
DEFAULT_STORED_RESPONSE_TTL_S = 3600.0
# Thinking budget per effort, as a share of the server's max context: the model needs room left to answer.
_EFFORT_CONTEXT_DIVISOR = {"low": 16, "medium": 4, "high": 2}
_MESSAGE_PARAM = re.compile(r"^messages\[(\d+)\](.*)$", re.S)
# chat parameters (and their sub-paths) -> the Responses ones, longer names first
_CHAT_PARAMS = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
                ("thinking_token_budget", "reasoning.effort"))
_CHAT_TOOL = re.compile(r"\btools\[(\d+)\]\.function\b")  # chat's tools[i].function.x is the flat tools[i].x
_UNKNOWN_TAG = "unknown_type"


# ---- request models -------------------------------------------------------------------------------------------


def _tagged(tags: dict[str, str], default: str | None = None) -> Callable[[Any], str | None]:
    """A discriminator reading `type` (or `default` when it is absent); union tags are written `<name>` so error
    locations can tell them from field names."""
    def tag(value: Any) -> str | None:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
        return tags.get(kind) if isinstance(kind, str) else None
    return tag


def _str_or_list(value: Any) -> str:
    return "<list>" if isinstance(value, list) else "<str>"


class InputText(RequestBody):
    type: Literal["input_text"]
    text: str


class OutputText(RequestBody):
    """An earlier answer's text (annotations are not kept: this server makes none)."""

    type: Literal["output_text"]
    text: str


class InputImage(RequestBody):
    type: Literal["input_image"]
    image_url: str = Field(min_length=1)  # a data: URL, or http(s):// and file:// where the server's flags allow
    detail: Literal["auto", "low", "high"] | None = None


ContentPart = Annotated[
    Annotated[InputText, Tag("<input_text>")] | Annotated[OutputText, Tag("<output_text>")]
    | Annotated[InputImage, Tag("<input_image>")],
    Discriminator(_tagged({"input_text": "<input_text>", "output_text": "<output_text>",
                           "input_image": "<input_image>"}),
                  custom_error_type=_UNKNOWN_TAG,
                  custom_error_message="content parts are input_text, output_text or input_image")]
MessageContent = Annotated[Annotated[str, Tag("<str>")] | Annotated[list[ContentPart], Tag("<list>")],
                           Discriminator(_str_or_list)]


class MessageItem(RequestBody):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: MessageContent


class FunctionCallItem(RequestBody):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1, max_length=256)
    arguments: str


class FunctionCallOutputItem(RequestBody):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    output: Annotated[Annotated[str, Tag("<str>")] | Annotated[list[InputText], Tag("<list>")],
                      Discriminator(_str_or_list)]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningText(RequestBody):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(RequestBody):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(RequestBody):
    """Earlier thinking; `encrypted_content` (OpenAI's opaque form) is ignored, since this server never makes it."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None

    def text(self) -> str:
        """The thinking itself when the item has it, else its summary."""
        if self.content:
            return "".join(part.text for part in self.content)
        return "\n\n".join(part.text for part in self.summary)


InputItem = Annotated[
    Annotated[MessageItem, Tag("<message>")] | Annotated[FunctionCallItem, Tag("<function_call>")]
    | Annotated[FunctionCallOutputItem, Tag("<function_call_output>")] | Annotated[ReasoningItem, Tag("<reasoning>")],
    Discriminator(_tagged({"message": "<message>", "function_call": "<function_call>",
                           "function_call_output": "<function_call_output>", "reasoning": "<reasoning>"},
                          default="message"),
                  custom_error_type=_UNKNOWN_TAG,
                  custom_error_message="input items are message, function_call, function_call_output or reasoning")]
Input = Annotated[Annotated[str, Tag("<str>")] | Annotated[list[InputItem], Tag("<list>")],
                  Discriminator(_str_or_list)]
_STORED_ITEMS = TypeAdapter(list[InputItem])  # a stored conversation's items (input and output) read back


class FunctionTool(RequestBody):
    """Responses function tools are flat: no nested `function` object as in chat."""

    type: str
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _function_only(cls, value: str) -> str:
        if value != "function":
            raise ValueError(f"tool type {value!r} is not supported; this server runs function tools only")
        return value


class FunctionToolChoice(RequestBody):
    type: Literal["function"]
    name: str


ToolChoice = Annotated[Annotated[Literal["none", "auto", "required"], Tag("<str>")]
                       | Annotated[FunctionToolChoice, Tag("<object>")],
                       Discriminator(lambda value: "<str>" if isinstance(value, str) else "<object>")]


class ReasoningConfig(RequestBody):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None  # accepted; this server returns the thinking itself, never a summary


class TextFormatText(RequestBody):
    type: Literal["text"]


class TextFormatJSONObject(RequestBody):
    type: Literal["json_object"]


class TextFormatJSONSchema(RequestBody):
    model_config = ConfigDict(populate_by_name=True)  # `schema_` is taken for `schema` too

    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[
    Annotated[TextFormatText, Tag("<text>")] | Annotated[TextFormatJSONObject, Tag("<json_object>")]
    | Annotated[TextFormatJSONSchema, Tag("<json_schema>")],
    Discriminator(_tagged({"text": "<text>", "json_object": "<json_object>", "json_schema": "<json_schema>"}),
                  custom_error_type=_UNKNOWN_TAG, custom_error_message="formats are text, json_object or json_schema")]


class TextConfig(RequestBody):
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    """`POST /v1/responses`. Unknown fields are ignored, as on the chat route; fields whose silent loss would change
    what the client gets (`background`, `conversation`) are refused."""

    model: str | None = None
    input: Input
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, gt=0)
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = Field(default=None, max_length=512)
    prompt_cache_key: str | None = Field(default=None, max_length=512)
    cache_salt: CacheSalt = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    background: bool = Field(default=False, json_schema_extra={"const": False})  # documented as what is accepted
    conversation: Any = Field(default=None, json_schema_extra={"type": "null"})

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool) -> bool:
        if value:
            raise ValueError("background responses are not supported; use stream or wait for the response")
        return value

    @field_validator("conversation")
    @classmethod
    def _no_conversation(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("conversations are not supported; chain responses with previous_response_id")
        return value


def parse_request(data: dict[str, Any]) -> ResponsesRequest:
    """Validate a request body (the route reads it with routing.json_body, which words errors by `invalid`)."""
    try:
        return ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc) from exc


def invalid(exc: ValidationError) -> APIError:
    """The first validation error as every route words it (`errors.from_validation_error`), but for an item or
    part of an unknown type, which names its `type` (`input[2].content[0].type`) and the type it was."""
    first = exc.errors(include_url=False)[0]
    if first["type"] != _UNKNOWN_TAG:
        return from_error_detail(first)
    param = param_from_loc(tuple(first["loc"]))
    param = f"{param}.type" if param else "type"
    kind = first["input"].get("type") if isinstance(first["input"], dict) else None
    message = str(first["msg"]).removeprefix("Value error, ")
    message = f"unsupported type {kind!r}; {message}" if kind is not None else message
    return bad_request(f"{param}: {message}", param=param, code="invalid_value")


# ---- translation to a chat request ----------------------------------------------------------------------------


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def stored_item(item: MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem) -> dict[str, Any]:
    """An input item as `input_items` lists it: with an id, and a message's text as a list of parts."""
    data = item.model_dump(exclude_none=True, by_alias=True)
    data.setdefault("id", new_item_id(_ITEM_ID_PREFIX[item.type]))
    if isinstance(item, MessageItem) and isinstance(item.content, str):
        part_type = "output_text" if item.role == "assistant" else "input_text"
        data["content"] = [{"type": part_type, "text": item.content}]
    if isinstance(item, FunctionCallItem | FunctionCallOutputItem):
        data.setdefault("status", "completed")
    return data


def input_items(req: ResponsesRequest) -> list[tuple[Any, str]]:
    """The request's own input as items, each with the parameter that names it in errors."""
    if isinstance(req.input, str):
        return [(MessageItem(role="user", content=req.input), "input")]
    return [(item, f"input[{i}]") for i, item in enumerate(req.input)]


def thinking_budget(effort: str | None, max_model_len: int) -> int | None:
    """`reasoning.effort` -> the chat thinking budget. none/minimal: 0, so the prompt is rendered with thinking off;
    low: 1/16 of the server's max context, medium: 1/4, high: 1/2; xhigh/max: the whole context (no cap); absent:
    None, the server's default budget."""
    if effort is None:
        return None
    if effort in ("none", "minimal"):
        return 0
    divisor = _EFFORT_CONTEXT_DIVISOR.get(effort)
    return max_model_len // divisor if divisor else max_model_len


class _Turn:
    """One assistant turn being rebuilt from consecutive reasoning / message / function_call items."""

    def __init__(self, param: str) -> None:
        self.param = param
        self.reasoning: list[str] = []
        self.content: str | list[TextPart | ImagePart] | None = None
        self.calls: list[ToolCallIn] = []

    def message(self) -> ChatMessage:
        reasoning = "".join(self.reasoning)
        content = self.content
        if content is None and not self.calls and not reasoning:
            content = ""  # only empty reasoning items: an empty turn, which chat messages spell with content ""
        return ChatMessage(role="assistant", content=content, reasoning_content=reasoning if self.reasoning else None,
                           tool_calls=self.calls or None)


def _chat_content(content: str | list[Any]) -> str | list[TextPart | ImagePart]:
    if isinstance(content, str):
        return content
    return [ImagePart(type="image_url", image_url=ImageURL(url=part.image_url, detail=part.detail))
            if isinstance(part, InputImage) else TextPart(type="text", text=part.text) for part in content]


def to_messages(items: list[tuple[Any, str]]) -> tuple[list[ChatMessage], list[str]]:
    """Items -> chat messages, and for each message the request parameter it came from. A reasoning item, an
    assistant message and the function calls after it make one assistant message (thinking, answer, tool_calls),
    as the model produced them; function_call_output items become tool messages."""
    messages: list[ChatMessage] = []
    params: list[str] = []
    turn: _Turn | None = None

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(turn.message())
            params.append(turn.param)
            turn = None

    for item, param in items:
        answering = isinstance(item, MessageItem) and item.role == "assistant"
        if isinstance(item, FunctionCallItem):
            turn = turn or _Turn(param)
            turn.calls.append(ToolCallIn(id=item.call_id, function=FunctionCall(name=item.name,
                                                                               arguments=item.arguments)))
            continue
        if isinstance(item, ReasoningItem) or answering:
            if turn is not None and (turn.calls or turn.content is not None):
                flush()  # thinking or an answer after an answer: the next assistant turn
            turn = turn or _Turn(param)
            if isinstance(item, ReasoningItem):
                turn.reasoning.append(item.text())
            else:
                turn.content = _chat_content(item.content)
            continue
        flush()
        if isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.text()))
        else:
            messages.append(ChatMessage(role=item.role, content=_chat_content(item.content)))
        params.append(param)
    flush()
    return messages, params


def _check_outputs(items: list[tuple[Any, str]]) -> None:
    """Every function_call_output answers a function_call earlier in the conversation (this input, or the stored
    one `previous_response_id` continues), as OpenAI requires: a 400 naming `input[i].call_id` otherwise."""
    calls: set[str] = set()
    for item, param in items:
        if isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in calls:
            raise bad_request(f"{param}.call_id: no function_call found for the function_call_output with call_id "
                              f"{item.call_id[:100]!r}", param=f"{param}.call_id", code="invalid_value")


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or isinstance(fmt, TextFormatText):
        return None
    if isinstance(fmt, TextFormatJSONObject):
        return {"type": "json_object"}
    schema = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def to_chat_request(req: ResponsesRequest, history: list[dict[str, Any]],
                    max_model_len: int) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request this Responses request means, and the Responses parameter behind each of its messages
    (`instructions`, `previous_response_id` for the stored conversation, `input[i]`)."""
    items: list[tuple[Any, str]] = []
    if req.instructions:
        items.append((MessageItem(role="system", content=req.instructions), "instructions"))
    items.extend((item, "previous_response_id") for item in _STORED_ITEMS.validate_python(history))
    items.extend(input_items(req))
    _check_outputs(items)
    messages, params = to_messages(items)
    if not messages:
        raise bad_request("input is empty: send at least one item", param="input")
    tool_choice: Any = req.tool_choice
    if isinstance(tool_choice, FunctionToolChoice):
        tool_choice = NamedToolChoice(type="function", function=NamedFunction(name=tool_choice.name))
    effort = req.reasoning.effort if req.reasoning else None
    budget = thinking_budget(effort, max_model_len)
    chat = ChatCompletionRequest(
        model=req.model, messages=messages, temperature=req.temperature, top_p=req.top_p,
        max_completion_tokens=req.max_output_tokens, user=req.user, prompt_cache_key=req.prompt_cache_key,
        cache_salt=req.cache_salt,
        tools=[ToolDef(type="function", function=FunctionDef(name=t.name, description=t.description,
                                                              parameters=t.parameters, strict=t.strict))
               for t in req.tools] if req.tools else None,
        tool_choice=tool_choice, parallel_tool_calls=req.parallel_tool_calls, thinking_token_budget=budget,
        chat_template_kwargs=disable_thinking({}) if budget == 0 else None,
        reasoning_effort=effort if effort in ("low", "medium", "high") else None,  # the template's own (gpt-oss)
        response_format=_response_format(req.text))
    return chat, params


def renamed(error: APIError, message_params: list[str]) -> APIError:
    """A chat-path error restated in Responses terms: `messages[3].content[1]` -> `input[2].content[1]` (or the
    `instructions` / `previous_response_id` the message came from), `max_completion_tokens` -> `max_output_tokens`,
    `response_format.json_schema.schema` -> `text.format.schema`, `tools[0].function.parameters` ->
    `tools[0].parameters`; the message says the same names."""
    old = error.param
    if old is None:
        return error
    message = error.message
    match = _MESSAGE_PARAM.match(old)
    if old == "messages":
        new = "input"
    elif match is not None and int(match.group(1)) < len(message_params):
        source = message_params[int(match.group(1))]
        new = source + match.group(2) if source.startswith("input[") else source
        message = message.replace(old, new)
    else:
        new = old
        for chat, ours in _CHAT_PARAMS:
            if new == chat or new.startswith((f"{chat}.", f"{chat}[")):
                new = ours + new[len(chat):]
            message = message.replace(chat, ours)
        new, message = _CHAT_TOOL.sub(r"tools[\1]", new), _CHAT_TOOL.sub(r"tools[\1]", message)
    if new == old:
        return error
    return APIError(error.status, message, param=new, code=error.code, type=error.type)


# ---- output items and stream events ---------------------------------------------------------------------------


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


class ResponseOutput:
    """Output items built from one choice's parsed deltas. Each step returns the stream events it makes (without
    sequence numbers): an item opens when its first piece arrives and closes when a piece of another kind or the
    end arrives, so items appear in the order the model wrote them."""

    def __init__(self) -> None:
        self.items: list[_OutputItem] = []
        self._open: _OutputItem | None = None
        self._calls: dict[int, _OutputItem] = {}

    def feed(self, parsed: ParsedDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if parsed.reasoning:
            events += self._text("reasoning", parsed.reasoning)
        if parsed.content:
            events += self._text("message", parsed.content)
        for delta in parsed.tool_calls:
            events += self._call(delta)
        return events

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

    def _call(self, delta: ToolCallDelta) -> list[dict[str, Any]]:
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


# ---- the stored responses -------------------------------------------------------------------------------------


@dataclass
class StoredResponse:
    """A finished response: its body as returned, and every item its prompt was made of (the stored conversation
    before it, then its own input), each with an id."""

    body: dict[str, Any]
    input_items: list[dict[str, Any]]

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a follow-up's `previous_response_id` prepends: the input, then the output."""
        return [*self.input_items, *self.body["output"]]


class ResponseStore:
    """Stored responses in memory: least recently used first out past `max_items`, and each gone `ttl_s` after it
    was stored. Items are shared between a conversation's responses, so a chain costs one list of references per
    response on top of its items."""

    def __init__(self, max_items: int = DEFAULT_MAX_STORED_RESPONSES, ttl_s: float = DEFAULT_STORED_RESPONSE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_items < 1 or ttl_s <= 0:
            raise ValueError("the response store needs max_items >= 1 and ttl_s > 0")
        self.max_items = max_items
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response: StoredResponse) -> None:
        self._expire()
        self._entries[response.body["id"]] = (self._clock() + self.ttl_s, response)
        self._entries.move_to_end(response.body["id"])
        while len(self._entries) > self.max_items:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry[1]

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        now = self._clock()
        for response_id in [rid for rid, (deadline, _) in self._entries.items() if deadline <= now]:
            del self._entries[response_id]


# ---- the routes -----------------------------------------------------------------------------------------------


_NO_STORED_RESPONSE = errors(404, words={404: "No stored response has this id (never stored, deleted or expired)."})


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"No stored response with id '{response_id}' (never stored, deleted or expired).",
                    param=param, code="not_found")


def _response_body(req: ResponsesRequest, response_id: str, model: str, created_at: int) -> dict[str, Any]:
    """The response object before its output: the request's settings echoed as OpenAI's API does."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else TextFormatText(type="text")
    tool_choice = req.tool_choice if req.tool_choice is not None else "auto"
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": "in_progress",
        "error": None, "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "model": model, "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
        "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
        "tools": [tool.model_dump(exclude_none=True) for tool in req.tools or []],
        "truncation": "disabled", "usage": None, "user": req.user, "prompt_cache_key": req.prompt_cache_key,
        "metadata": req.metadata or {},
    }


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
                    incomplete = self.serving.finish_reason(update.choice) == "length"
                    for event in self.output.finish(incomplete):
                        yield event
                    self.body["status"] = "incomplete" if incomplete else "completed"
                    if incomplete:
                        self.body["incomplete_details"] = {"reason": "max_output_tokens"}
        self.body["output"] = [item.dump() for item in self.output.items]
        self.body["usage"] = _usage(self.run.usage())


def _sse_event(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def register_responses_routes(app: FastAPI, serving: OpenAIServing, *,
                              max_stored: int = DEFAULT_MAX_STORED_RESPONSES,
                              stored_ttl_s: float = DEFAULT_STORED_RESPONSE_TTL_S) -> ResponseStore:
    """Add the Responses routes to `app`; returns their store (also `app.state.responses`)."""
    store = ResponseStore(max_stored, stored_ttl_s)
    app.state.responses = store

    @app.post("/v1/responses", responses=errors(400, 404, 503, words={
        404: "The model is not served here, or previous_response_id names no stored response."}))
    async def create_response(request: Request) -> Response:
        arrival = time.monotonic()
        req = await json_body(request, ResponsesRequest, invalid)
        model = serving.check_model(req.model)
        history = _history(store, req.previous_response_id)
        chat, message_params = to_chat_request(req, history, serving.max_model_len)
        try:
            prepared = await serving.prepare_chat(chat)
        except APIError as exc:
            raise renamed(exc, message_params) from exc
        error_param = prepared.error_param

        def param_of(message: str) -> str | None:
            param = error_param(message)
            return renamed(APIError(400, message, param=param), message_params).param if param else None

        prepared.error_param = param_of
        response_id = new_item_id("resp")
        body = _response_body(req, response_id, model, int(time.time()))
        own_items = [stored_item(item) for item, _ in input_items(req)]

        def keep() -> None:
            if req.store:
                store.put(StoredResponse(body, [*history, *own_items]))

        def run(engine_requests: EngineRequests) -> ResponseRun:
            return ResponseRun(serving, prepared, engine_requests, body, arrival)

        async def whole(engine_requests: EngineRequests) -> dict[str, Any]:
            async for _ in run(engine_requests).events():
                pass
            keep()
            return body

        try:  # errors after the stream started are events of it, in Responses terms already
            return await serve_prepared(request, serving.engine, prepared, response_id,
                                        session_key(request, req.prompt_cache_key, req.user), stream=req.stream,
                                        streamed=lambda runs: _stream(run(runs), body, keep), whole=whole)
        except APIError as exc:
            raise renamed(exc, message_params) from exc

    @app.get("/v1/responses/{response_id}", responses=_NO_STORED_RESPONSE)
    async def get_response(response_id: str) -> Response:
        stored = store.get(response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        return JSONResponse(stored.body)

    @app.delete("/v1/responses/{response_id}", responses=_NO_STORED_RESPONSE)
    async def delete_response(response_id: str) -> Response:
        if not store.delete(response_id):
            raise _not_found(response_id, "response_id")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.get("/v1/responses/{response_id}/input_items", responses={**_NO_STORED_RESPONSE, **errors(400)})
    async def list_input_items(
            response_id: str,
            order: Annotated[Literal["asc", "desc"], Query(description="asc: oldest item first")] = "desc",
            limit: Annotated[int, Query(ge=1, le=100, description="items in one page")] = 20,
            after: Annotated[str | None, Query(description="the page starts after this item id")] = None) -> Response:
        """The items a stored response's prompt was made of, paged as OpenAI's API pages them; parameters that fail
        their types are 400s (app.py)."""
        stored = store.get(response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        return JSONResponse(_items_page(stored.input_items, order, limit, after))

    return store


def _history(store: ResponseStore, previous_response_id: str | None) -> list[dict[str, Any]]:
    """The conversation a request continues: the stored one `previous_response_id` names (404 if none), or none."""
    if previous_response_id is None:
        return []
    previous = store.get(previous_response_id)
    if previous is None:
        raise _not_found(previous_response_id, "previous_response_id")
    return previous.conversation


def _items_page(items: list[dict[str, Any]], order: str, limit: int, after: str | None) -> dict[str, Any]:
    """One page of a stored response's input items, as OpenAI's API pages them."""
    items = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"after: no input item with id {after[:100]!r} in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}


async def _stream(run: ResponseRun, body: dict[str, Any], keep: Callable[[], None]) -> AsyncGenerator[str, None]:
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
