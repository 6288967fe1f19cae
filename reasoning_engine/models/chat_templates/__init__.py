"""Chat-template facts below the server, shared by `LLM.chat` and the OpenAI server.

- Templates for checkpoints that ship none: DeepSeek-V3.2 and DeepSeek-V4 publish their prompt formats as Python
  encoders (encoding/encoding_dsv32.py, encoding/encoding_dsv4.py) instead of Jinja templates, so
  `deepseek_v32.jinja` and `deepseek_v4.jinja` here write the same text and the tokenizer gets theirs at load (a
  template the checkpoint ships, or `--chat-template`, still wins).
- Earlier tool calls' arguments: OpenAI clients send them as JSON strings, but some templates walk them as a
  mapping (`arguments.items()`, `arguments|items`); such templates get them decoded, as vLLM passes them.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from typing import Any

_BUNDLED = {"deepseek_v32": "deepseek_v32.jinja", "deepseek_v4": "deepseek_v4.jinja"}


def bundled_chat_template(model_type: str | None) -> str | None:
    """Our template for a model type whose checkpoints ship none, else None."""
    name = _BUNDLED.get(model_type or "")
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8") if name else None


def iterates_arguments(template: str) -> bool:
    """Whether a template walks a call's arguments as a mapping: `arguments.items()` / `arguments|items`, directly
    or through a variable set from them (GLM-4.5's and MiniMax-M2's `{% set _args = tc.arguments %}` ...
    `_args.items()`). Such templates get the arguments as objects; the others keep OpenAI's JSON strings."""
    names = {"arguments", *re.findall(r"set\s+(\w+)\s*=[^%]*\barguments\b", template)}
    return any(re.search(rf"\b{re.escape(name)}\s*(?:\.items\(\)|\|\s*items\b)", template) for name in names)


def arguments_as_mappings(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier tool calls with their arguments JSON (an OpenAI string) decoded into objects; arguments that are not
    a JSON object stay as they are."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if calls:
            message = {**message, "tool_calls": [_decoded_call(call) for call in calls]}
        out.append(message)
    return out


def _decoded_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    try:
        decoded = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        decoded = None
    if not isinstance(decoded, dict):
        return call
    return {**call, "function": {**function, "arguments": decoded}}
