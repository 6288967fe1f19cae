"""Grammars that hold the answer to a tool call written the way the server's tool parser reads it.

`tool_choice: "required"` or a named function, and tools marked `"strict": true`, become an xgrammar structural tag
(`StructuredOutputsParams.structural_tag`), applied by the engine after the thinking like any other constraint:

- required: one or more calls (one when `parallel_tool_calls` is false) to any of the tools, and nothing else;
- named: exactly one call to that function;
- auto with strict tools: free text, but a call, once its opening marker is written, follows its tool's schema;
- auto with an answer format (response_format, structured_outputs, guided_*): either that answer or the calls.

Each call's arguments follow its tool's `parameters` JSON schema (no parameters: `{}`), with at most one whitespace
character in a row, so a small model cannot wander into blank space but `{"a": 1}` and `{"a":1}` both fit.
Each format's call shape (`CallSyntax`: its markers and how a call of a tool opens and ends) is declared with the
rest of the format in `formats/`; the grammar here is built the same way for all of them.
Markers are matched as text, so they fit whether the tokenizer has them as single tokens or spells them out;
the server passes the ones that are single tokens (`marker_ids`), and those are written only as their tokens.

Inside a call, no string (argument value or property name) may hold a marker the output parsers act on: the
format's own (its parser's `call_markers`), the thinking markers and the tokenizer's special tokens (the `excludes`
the server passes, which the parsers drop from the text). Otherwise a model could write `<|tool_call_end|>` inside
an argument string and the parser would cut the call there. xgrammar's `excludes` keep them out of plain strings;
`schemas.marker_free_schema` covers the strings it does not filter (length bounds become a pattern, patterns and
formats that could write a marker are refused), and `ToolSchemaError` names the tool and the keyword.

gpt-oss has no `</think>` for the engine to wait for, so its constraint holds the output from the first token and
lets the thinking through itself (`InlineThinking`): calls or an answer format come after any analysis messages,
the answer in a final message.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reasoning_engine.server.formats.registry import CALL_SYNTAXES, TOOL_PARSERS
from reasoning_engine.server.protocol import FunctionDef
from reasoning_engine.server.reasoning_parsers import InlineThinking
from reasoning_engine.structured.params import StructuredOutputsParams
from reasoning_engine.structured.schemas import SchemaError, enforceable_schema, join, marker_free_schema

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
MAX_WHITESPACE = 1


class ToolSchemaError(ValueError):
    """Tool `index` (of those passed to `tool_call_tag`) cannot be held to its call format: `where` is the field at
    fault under the tool (`function.parameters.properties.x.not`, `function.name`)."""

    def __init__(self, index: int, where: str, reason: str) -> None:
        super().__init__(f"tools[{index}].{where}: {reason}")
        self.index = index
        self.where = where
        self.reason = reason


def call_excludes(parser: str, dropped: Iterable[str] = ()) -> list[str]:
    """What no string inside a call of `parser`'s format may hold: the openings (`marker_opening`) of its parser's
    markers and of `dropped` (what the output parsers drop from the text: special tokens, the thinking markers).
    Each once, none that holds another; none with whitespace at an end, which xgrammar's XML styles refuse."""
    return list(_call_excludes(parser, tuple(dropped)))


@functools.lru_cache(maxsize=64)  # a server asks with the same few arguments, and a vocabulary may have hundreds
def _call_excludes(parser: str, dropped: tuple[str, ...]) -> tuple[str, ...]:
    openings = dict.fromkeys(marker_opening(m) for m in (*TOOL_PARSERS[parser].call_markers(), *dropped) if m)
    kept = [m for m in openings if m == m.strip()]
    return tuple(m for m in kept if not any(other != m and other in m for other in kept))


def marker_opening(marker: str) -> str:
    """A marker up to its first character after the first that is no letter, digit, `/` or space: `<|` for
    `<|tool_call_end|>` (and every `<|...|>` special token), `<tool_` for `<tool_call>`, `</think>` whole. Keeping
    the opening out keeps the marker out, and costs the grammar far less: xgrammar's compile time grows with the
    length of what it excludes (eight whole Kimi markers take about a second against a 50k vocabulary, `<|`
    almost nothing), at the price of strings that cannot hold `<|` either."""
    for i, ch in enumerate(marker[1:], 1):
        if not (ch.isalnum() or ch in "/ "):
            return marker[:i + 1]
    return marker


def arguments_format(parameters: dict[str, Any] | None, excludes: Sequence[str] = ()) -> dict[str, Any]:
    """A call's arguments held to `parameters` (no parameters: `{}`), no string holding one of `excludes`;
    SchemaError (schemas.py) naming the keyword the grammar cannot hold."""
    schema = enforceable_schema(parameters if parameters is not None else NO_PARAMETERS)
    fmt = {"type": "json_schema", "json_schema": marker_free_schema(schema, excludes),
           "max_whitespace_cnt": MAX_WHITESPACE}
    return {**fmt, "excludes": list(excludes)} if excludes else fmt


def answer_format(spec: StructuredOutputsParams) -> dict[str, Any]:
    """A request's answer constraint as a structural-tag format, to offer beside the tool calls."""
    kind = spec.kind
    if kind == "json":
        return {"type": "json_schema", "json_schema": spec.enforced_schema(), "max_whitespace_cnt": MAX_WHITESPACE}
    if kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}, "max_whitespace_cnt": MAX_WHITESPACE}
    if kind == "regex":
        return {"type": "regex", "pattern": spec.regex}
    if kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in spec.choice]}
    if kind == "grammar":
        return {"type": "grammar", "grammar": spec.grammar}
    return json.loads(spec.structural_tag_json())["format"]


def answer_tag(answer: StructuredOutputsParams, thinking: InlineThinking) -> dict[str, Any]:
    """The structural tag of an answer format for a model that thinks inside the constrained output."""
    return {"type": "structural_tag", "format": thinking.then(thinking.answer(answer_format(answer)))}


def tool_call_tag(parser: str, tools: Sequence[FunctionDef], *, required: bool, parallel: bool,
                  answer: StructuredOutputsParams | None = None, thinking: InlineThinking | None = None,
                  dropped: Iterable[str] = (), marker_ids: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The structural tag for `tools` in `parser`'s format. `required`: the output is calls only (pass just the
    named function for a named tool_choice, with `parallel` false); otherwise the calls are optional: the output is
    `answer` or calls when `answer` is given, else free text with constrained calls. `thinking`: the model's
    thinking is part of the constrained output, before the calls or the answer (free text holds it anyway).
    `dropped`: what the output parsers drop from the text (special tokens, thinking markers), kept out of the
    calls' strings with the format's markers. `marker_ids`: the markers that are single tokens of the model's
    vocabulary, by id: where the grammar writes one, it takes only that token (a marker spelled out of smaller
    tokens is text the model never learnt, and it loses its way). ToolSchemaError names a tool the calls cannot
    be held to."""
    syntax = CALL_SYNTAXES[parser]
    parallel = parallel and not syntax.ends_turn
    excludes = call_excludes(parser, dropped)
    bound = _Bound(marker_ids or {})
    arguments = []
    for i, tool in enumerate(tools):
        marker = next((m for m in excludes if m in tool.name), None)
        if marker is not None:
            raise ToolSchemaError(i, "function.name", f"the name holds {marker!r}, which opens a marker the "
                                                      "tool parser acts on")
        try:
            arguments.append(syntax.call_content(arguments_format(tool.parameters, excludes), bound.text))
        except SchemaError as exc:
            raise ToolSchemaError(i, join("function.parameters", exc.path) if exc.path else "function.parameters",
                                  exc.reason) from None

    def calls(text_begins: bool) -> dict[str, Any]:
        tags = [bound.tag(syntax.call_begin(tool.name), content, syntax.call_end, text_begin=text_begins)
                for tool, content in zip(tools, arguments, strict=True)]
        return {"type": "tags_with_separator", "tags": tags, "separator": syntax.separator, "at_least_one": True,
                "stop_after_first": not parallel}

    def block(text_begin: bool) -> dict[str, Any]:
        """The calls in their section, if the format has one; a triggered one starts at its text."""
        if not syntax.open:
            return calls(text_begin)
        return bound.tag(syntax.open, calls(False), syntax.close, text_begin=text_begin)

    whole = block(False) if not syntax.lead else {"type": "sequence", "elements": [
        {"type": "const_string", "value": syntax.lead}, block(False)]}
    if required:
        fmt = whole
    elif answer is not None:
        answered = answer_format(answer)
        fmt = {"type": "or", "elements": [answered if thinking is None else thinking.answer(answered), whole]}
    elif syntax.open:
        fmt = {"type": "triggered_tags", "triggers": [syntax.trigger], "tags": [block(True)]}
    else:
        fmt = {"type": "triggered_tags", "triggers": [syntax.trigger], "tags": calls(True)["tags"],
               "stop_after_first": not parallel}
    if thinking is not None and (required or answer is not None):
        fmt = thinking.then(fmt)
    return {"type": "structural_tag", "format": fmt}


@dataclass(frozen=True)
class _Bound:
    """Fixed text as structural-tag formats, each single-token marker in it (`marker_ids`) as its token."""

    marker_ids: Mapping[str, int]

    def pieces(self, value: str) -> list[dict[str, Any]]:
        """`value` as text and token formats, in order (nothing for "")."""
        out: list[dict[str, Any]] = []
        while value:
            found = [(value.find(m), -len(m), m) for m in self.marker_ids if m in value]
            if not found:
                out.append({"type": "const_string", "value": value})
                break
            at, _, marker = min(found)  # the first one, the longest where two start together
            if at:
                out.append({"type": "const_string", "value": value[:at]})
            out.append({"type": "token", "token": self.marker_ids[marker]})
            value = value[at + len(marker):]
        return out

    def text(self, value: str) -> dict[str, Any]:
        pieces = self.pieces(value)
        return pieces[0] if len(pieces) == 1 else {"type": "sequence", "elements": pieces}

    def tag(self, begin: str, content: dict[str, Any], end: str, *, text_begin: bool) -> dict[str, Any]:
        """A tag whose begin and end are each one piece (text or a token: what xgrammar takes), the other pieces
        moved into its content. `text_begin`: the begin stays text (a trigger in free text is found as text)."""
        head = [] if text_begin else self.pieces(begin)
        tail = self.pieces(end)
        elements = [*head[1:], content, *tail[:-1]]
        return {"type": "tag", "begin": _tag_end(head[:1]) if head else begin,
                "content": elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements},
                "end": _tag_end(tail[-1:])}


def _tag_end(piece: list[dict[str, Any]]) -> str | dict[str, Any]:
    """A tag's begin or end from its one piece: a token format, or the text."""
    if not piece:
        return ""
    return piece[0] if piece[0]["type"] == "token" else piece[0]["value"]


def bad_tool_schema(tools: Sequence[FunctionDef]) -> tuple[int, str] | None:
    """The first tool whose `parameters` is not a usable JSON schema, and why: (its index, the message)."""
    for i, tool in enumerate(tools):
        try:
            StructuredOutputsParams(structural_tag={"type": "structural_tag",
                                                    "format": arguments_format(tool.parameters)})
        except ValueError as exc:
            return i, str(exc).split(": ", 1)[-1]
    return None
