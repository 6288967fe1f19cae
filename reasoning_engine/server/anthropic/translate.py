"""A Messages request as the one chat request every API shares: content blocks to chat messages (tool ids decoded back
to the model's own), tool_choice and thinking to their chat forms; `ParamNames` restates chat-path errors in
Messages terms."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from reasoning_engine.server.anthropic.schema import (
    CountTokensRequest,
    ImageBlock,
    MessageParam,
    MessagesRequest,
    TextBlock,
    ThinkingAdaptive,
    ThinkingBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from reasoning_engine.server.chat_template import disable_thinking
from reasoning_engine.server.errors import APIError, bad_request, from_validation_error
from reasoning_engine.server.protocol import ChatCompletionRequest
from reasoning_engine.server.serving import OpenAIServing

_TOOL_ID_PREFIX = "toolu_"
_THINKING_ON = {"thinking": True, "enable_thinking": True}  # the switches chat_template.disable_thinking turns off


# chat request parameters an error may name -> the Messages parameter the client sent
_CHAT_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "user": "metadata.user_id",
                "thinking_token_budget": "thinking.budget_tokens", "chat_template_kwargs": "thinking",
                "continue_final_message": "messages", "parallel_tool_calls": "tool_choice"}


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
