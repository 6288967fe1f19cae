"""What a chat-format module declares: its call grammar's shape (`CallSyntax`), its tool formats (parser and
syntax), and its `Family`: the reasoning and tool formats by the names the server's flags take, and how `auto`
recognises the family's models."""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from typing import Any

from reasoning_engine.server.reasoning_parsers import ReasoningFormat
from reasoning_engine.server.tool_parsers import ToolParser


#: A call's content from its arguments' format; the second argument makes a format of fixed text.
CallContent = Callable[[dict[str, Any], Callable[[str], dict[str, Any]]], dict[str, Any]]


def _arguments_alone(arguments: dict[str, Any], text: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    return arguments


@dataclass(frozen=True)
class CallSyntax:
    """One tool parser's call format: the calls sit between `open` and `close`, `separator` between two calls; a
    call is `begin(name)`, its content (`content`: what the call writes around its arguments, if anything),
    `call_end`. `trigger` starts the calls inside free text. `lead` comes before the calls where they are the whole
    answer (DeepSeek-V3.2 writes its block after a blank line, which in free text is the model's own). `ends_turn`:
    the call's end marker is a stop token, left out of the grammar, so a call ends the output and there is at most
    one (gpt-oss)."""

    trigger: str
    open: str
    close: str
    separator: str
    call_end: str
    begin: Callable[[str], str]
    content: CallContent = _arguments_alone
    lead: str = ""
    ends_turn: bool = False

    def call_begin(self, name: str) -> str:
        """What opens a call of `name`, up to its content."""
        return self.begin(name)

    def call_content(self, arguments: dict[str, Any], text: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        """A call's content around its `arguments` format; `text` makes a format of fixed text."""
        return self.content(arguments, text)


def _array_items_given(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with `items: {}` (what it means) on each array property declared without `items`."""
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return schema

    def given(prop: Any) -> Any:
        kind = prop.get("type") if isinstance(prop, dict) else None
        if "array" in (kind if isinstance(kind, list) else [kind]) and not {"items", "prefixItems"} & prop.keys():
            return {**prop, "items": {}}
        return prop

    return {**schema, "properties": {name: given(prop) for name, prop in properties.items()}}


def xml_arguments(style: str) -> CallContent:
    """A call's arguments as the schema's properties in one of xgrammar's XML renderings (`minimax_xml`,
    `deepseek_xml`, `qwen_xml`: strings raw, other values JSON). An array parameter declared without `items` gets
    `items: {}` (what the schema means), since these styles refuse every value of such a parameter."""

    def content(arguments: dict[str, Any], text: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        return {**arguments, "json_schema": _array_items_given(arguments["json_schema"]), "style": style}

    return content


@dataclass(frozen=True)
class ToolFormat:
    """One tool-call format: the parser that reads its calls and the syntax the call grammar writes them in."""

    parser: type[ToolParser]
    syntax: CallSyntax


@dataclass(frozen=True)
class ModelTraits:
    """What `auto` looks at: the checkpoint's model type, its tokenizer's vocabulary and chat template."""

    model_type: str
    vocab: Container[str]
    chat_template: str = ""


def _not_mine(_: ModelTraits) -> str | None:
    return None


@dataclass(frozen=True)
class Family:
    """One model family's chat formats, as its module declares them. `reasoning` and `tools`: the formats by the
    names `--reasoning-parser` and `--tool-call-parser` take. `auto_reasoning` / `auto_tools`: the format `auto`
    picks for a model of this family (None: not this family's model, or no such format); the registry asks the
    families in its order and takes the first answer."""

    reasoning: Mapping[str, ReasoningFormat] = field(default_factory=dict)
    tools: Mapping[str, ToolFormat] = field(default_factory=dict)
    auto_reasoning: Callable[[ModelTraits], str | None] = _not_mine
    auto_tools: Callable[[ModelTraits], str | None] = _not_mine
