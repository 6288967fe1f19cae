"""A Responses request as the one chat request every API shares: input items (with a stored conversation's) to chat
messages, `text.format` to `response_format`, `reasoning.effort` to a thinking budget; and chat-path errors restated
in Responses terms."""

from __future__ import annotations

import re
import uuid
from typing import Any

from reasoning_engine.server.chat_template import disable_thinking
from reasoning_engine.server.errors import APIError, bad_request
from reasoning_engine.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDef,
    ImagePart,
    ImageURL,
    NamedFunction,
    NamedToolChoice,
    TextPart,
    ToolCallIn,
    ToolDef,
)
from reasoning_engine.server.responses.schema import (
    STORED_ITEMS,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    InputImage,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextConfig,
    TextFormatJSONObject,
    TextFormatText,
)

# Thinking budget per effort, as a share of the server's max context: the model needs room left to answer.
_EFFORT_CONTEXT_DIVISOR = {"low": 16, "medium": 4, "high": 2}


_MESSAGE_PARAM = re.compile(r"^messages\[(\d+)\](.*)$", re.S)


# chat parameters (and their sub-paths) -> the Responses ones, longer names first
_CHAT_PARAMS = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
                ("thinking_token_budget", "reasoning.effort"))


_CHAT_TOOL = re.compile(r"\btools\[(\d+)\]\.function\b")  # chat's tools[i].function.x is the flat tools[i].x


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
    items.extend((item, "previous_response_id") for item in STORED_ITEMS.validate_python(history))
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
