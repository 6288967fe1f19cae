"""Rendering OpenAI messages through the checkpoint's own chat template.

transformers renders templates in jinja2's ImmutableSandboxedEnvironment, so a template cannot reach Python
internals. We also render with `sanitize_control_tokens=True`: control tokens typed inside user text (`<|im_end|>`,
`<|tool_call_begin|>`) are encoded as plain text, so a message cannot forge a turn boundary or a tool call.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reasoning_engine.models.chat_templates import arguments_as_mappings, iterates_arguments
from reasoning_engine.server.errors import bad_request
from reasoning_engine.server.protocol import ChatMessage, ToolDef

# Keyword names of apply_chat_template itself: a request's chat_template_kwargs must not override how we render
# (a client-supplied `chat_template` or `tokenize=False`), only feed template variables.
_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
_THINKING_SWITCHES = ("thinking", "enable_thinking")
_TAIL_TOKENS = 16


@dataclass
class RenderedChat:
    token_ids: list[int]
    tail: str  # the prompt's last few tokens as text, to tell whether it ends inside an open `<think>`
    thinking_requested: bool | None  # the request's explicit thinking switch, None when it did not set one


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages -> the dicts chat templates read (text parts joined, earlier thinking passed back). A message
    with images or videos keeps its list of parts, for multimodal.chat.extract_media to load and normalise."""
    out: list[dict[str, Any]] = []
    for message in messages:
        content: Any = message.text()
        if message.has_media:
            content = [part.model_dump(exclude_none=True) for part in message.content]  # type: ignore[union-attr]
        item: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                "content": content}
        if message.name is not None:
            item["name"] = message.name
        if message.role == "assistant":
            if message.reasoning_content is not None:
                item["reasoning_content"] = message.reasoning_content
                item["thinking"] = message.reasoning_content  # the key gpt-oss's template reads
            elif isinstance(content, str) and "</think>" in content:
                item["reasoning_content"], item["content"] = _inline_thinking(content)
            if message.tool_calls:
                item["tool_calls"] = [{"id": call.id, "type": "function",
                                       "function": {"name": call.function.name, "arguments": call.function.arguments}}
                                      for call in message.tool_calls]
        if message.role == "tool" and message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        out.append(item)
    return out


def _inline_thinking(content: str) -> tuple[str, str]:
    """(thinking, answer) of an assistant message that carries its thinking in the content (`<think>...</think>
    answer`, as MiniMax-M2's API returns it and tells OpenAI clients to send it back). Templates split this
    themselves, but rendering marks the control tokens typed in messages (to encode them as text), which defeats
    their stripping of the newlines around the markers (MiniMax-M2's then renders `<think>\n\n...`); split here, the
    template writes the turn as the model wrote it."""
    before, after = content.split("</think>")[0], content.split("</think>")[-1]
    return before.split("<think>")[-1].strip("\n"), after.lstrip("\n")


def thinking_switch(kwargs: dict[str, Any]) -> bool | None:
    """The request's explicit thinking on/off (Kimi and DeepSeek say `thinking`, Qwen3 `enable_thinking`)."""
    for key in _THINKING_SWITCHES:
        if isinstance(kwargs.get(key), bool):
            return kwargs[key]
    return None


def disable_thinking(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {**kwargs, **{key: False for key in _THINKING_SWITCHES}}


def check_template_kwargs(kwargs: dict[str, Any], param: str = "chat_template_kwargs") -> dict[str, Any]:
    reserved = sorted(_RESERVED_KWARGS & kwargs.keys())
    if reserved:
        raise bad_request(f"{param} may not set {', '.join(reserved)}", param=param)
    return kwargs


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[ToolDef] | None,
                template_kwargs: dict[str, Any], add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> RenderedChat:
    """Token ids of the conversation (`template_messages` dicts) as the model was trained to see it; template
    failures are the request's fault (a role order the template refuses, a missing field), so they become 400s
    naming `messages`."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions with a raw prompt", param="messages")
    if continue_final_message and messages[-1]["role"] != "assistant":
        raise bad_request("continue_final_message needs a final assistant message", param="continue_final_message")
    if iterates_arguments(str(tokenizer.chat_template)):
        messages = arguments_as_mappings(messages)
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            tools=[tool.model_dump(exclude_none=True) for tool in tools] if tools else None,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tokenize=True,
            return_dict=False,
            **({"sanitize_control_tokens": True} if supports_sanitizing(tokenizer) else {}),
            **template_kwargs,
        )
    except Exception as exc:  # any template failure comes from what the request put in it
        raise bad_request(f"the chat template could not render these messages: {exc}", param="messages") from exc
    ids = list(ids)
    if not ids:
        raise bad_request("the rendered prompt is empty", param="messages")
    tail = tokenizer.decode(ids[-_TAIL_TOKENS:], skip_special_tokens=False)
    return RenderedChat(token_ids=ids, tail=tail, thinking_requested=thinking_switch(template_kwargs))


def read_chat_template(value: str) -> str:
    """`--chat-template`: a file holding a Jinja template, or the template itself (vLLM's flag takes both); for
    checkpoints whose template is missing or wrong."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")


def with_chat_template(tokenizer: Any, template: str) -> Any:
    """A shallow copy of the tokenizer rendering with `template`; the engine's own tokenizer keeps the
    checkpoint's (other apps on the same engine, offline `LLM.chat`)."""
    if tokenizer is None:
        raise ValueError("chat_template: this model has no tokenizer to render it with")
    copied = copy.copy(tokenizer)
    copied.chat_template = template
    return copied


def supports_sanitizing(tokenizer: Any) -> bool:
    """Whether this transformers version can encode user-typed control tokens as text (5.x can; 4.x renders
    without it)."""
    return "sanitize_control_tokens" in inspect.signature(tokenizer.apply_chat_template).parameters
