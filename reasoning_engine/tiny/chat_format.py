"""Kimi's chat format for the tiny reasoner: special tokens, the Jinja chat template and an in-process renderer.

The template follows Kimi K2's layout (tool declarations as a ``tool_declare`` system turn, ``<|im_*|>`` role headers,
tool results as ``## Return of ID`` turns, tool calls in Kimi's section/call/argument tokens) with K2.5's ``thinking``
switch: the generation prompt ends with ``<think>`` (default) or ``<think></think>``; image parts render as K2.5's
placeholder (``IMAGE_PLACEHOLDER``). Every assistant turn in the history renders its ``reasoning_content`` inside
``<think>...</think>``, so interleaved thinking round-trips and the training data (rendered with this very template)
matches what a server renders. Whitespace control is explicit on
every tag, so the output is the same under transformers' sandbox (trim_blocks/lstrip_blocks) and plain Jinja.
"""

from __future__ import annotations

import json
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

IM_END = "<|im_end|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_SYSTEM = "<|im_system|>"
IM_MIDDLE = "<|im_middle|>"
PAD = "<|pad|>"
THINK_BEGIN = "<think>"
THINK_END = "</think>"
TOOL_CALLS_BEGIN = "<|tool_calls_section_begin|>"
TOOL_CALLS_END = "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN = "<|tool_call_begin|>"
TOOL_CALL_ARG_BEGIN = "<|tool_call_argument_begin|>"
TOOL_CALL_END = "<|tool_call_end|>"
MEDIA_BEGIN = "<|media_begin|>"
MEDIA_CONTENT = "<|media_content|>"
MEDIA_END = "<|media_end|>"
MEDIA_PAD = "<|media_pad|>"
# Kimi K2.5's image placeholder; the engine widens the pad token to one per merged image patch.
IMAGE_PLACEHOLDER = f"{MEDIA_BEGIN}image{MEDIA_CONTENT}{MEDIA_PAD}{MEDIA_END}"

# Lower-case words that start a segment right after a special token in rendered chats.
BARE_WORDS = ["user", "assistant", "system", "tool", "functions"]
# Removed by skip_special_tokens: the turn structure.
SPECIAL_TOKENS = [PAD, IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE]
# Added (special) by the vision training to the text model's tokenizer, after all the others.
MEDIA_TOKENS = [MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD]
# Single tokens that stay in decoded text, so reasoning and tool-call parsers see them whatever skip_special_tokens is.
TEXT_CONTROL_TOKENS = [
    THINK_BEGIN,
    THINK_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_CALL_BEGIN,
    TOOL_CALL_ARG_BEGIN,
    TOOL_CALL_END,
]

CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is iterable and content is not mapping -%}"
    "{%- for part in content -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url', 'image_pil') -%}"
    "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- elif content is not none -%}{{ content }}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if thinking is defined -%}{%- set think = thinking -%}"
    "{%- elif enable_thinking is defined -%}{%- set think = enable_thinking -%}"
    "{%- else -%}{%- set think = true -%}{%- endif -%}"
    "{%- if tools -%}"
    "<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = message['role'] -%}"
    "{%- if role == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>{{ role }}<|im_middle|>"
    "{%- endif -%}"
    "{%- if role == 'assistant' -%}"
    "<think>{{ message.get('reasoning_content') or '' }}</think>"
    "{{- render_content(message.get('content')) -}}"
    "{%- if message.get('tool_calls') -%}"
    "<|tool_calls_section_begin|>"
    "{%- for tool_call in message['tool_calls'] -%}"
    "{%- set function = tool_call['function'] if tool_call.get('function') else tool_call -%}"
    "{%- set call_id = tool_call.get('id') or ('functions.' ~ function['name'] ~ ':' ~ loop.index0) -%}"
    "<|tool_call_begin|>{{ call_id }}<|tool_call_argument_begin|>"
    "{%- if function['arguments'] is string -%}{{ function['arguments'] }}"
    "{%- else -%}{{ function['arguments'] | tojson }}{%- endif -%}"
    "<|tool_call_end|>"
    "{%- endfor -%}"
    "<|tool_calls_section_end|>"
    "{%- endif -%}"
    "{%- elif role == 'tool' -%}"
    "## Return of {{ message.get('tool_call_id') or '' }}\n{{ render_content(message.get('content')) }}"
    "{%- else -%}"
    "{{- render_content(message.get('content')) -}}"
    "{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "<|im_assistant|>assistant<|im_middle|>"
    "{%- if think -%}<think>{%- else -%}<think></think>{%- endif -%}"
    "{%- endif -%}"
)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' tojson filter (plain json.dumps, no HTML escaping)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
_env.filters["tojson"] = _tojson
_template = _env.from_string(CHAT_TEMPLATE)


def render_chat(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    thinking: bool = True,
) -> str:
    """Render like ``tokenizer.apply_chat_template(..., tokenize=False)`` without loading a tokenizer."""
    return _template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                            thinking=thinking)
