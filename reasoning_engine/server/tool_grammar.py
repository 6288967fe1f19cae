"""Grammars that hold the answer to a tool call written the way the server's tool parser reads it.

`tool_choice: "required"` or a named function, and tools marked `"strict": true`, become an xgrammar structural tag
(`StructuredOutputsParams.structural_tag`), applied by the engine after the thinking like any other constraint:

- required: one or more calls (one when `parallel_tool_calls` is false) to any of the tools, and nothing else;
- named: exactly one call to that function;
- auto with strict tools: free text, but a call, once its opening marker is written, follows its tool's schema;
- auto with an answer format (response_format, structured_outputs, guided_*): either that answer or the calls.

Each call's arguments follow its tool's `parameters` JSON schema (no parameters: `{}`), with at most one whitespace
character in a row, so a small model cannot wander into blank space but `{"a": 1}` and `{"a":1}` both fit.
Formats: kimi_k2 (`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
{json}<|tool_call_end|>...<|tool_calls_section_end|>`), hermes (`<tool_call>\\n{"name": "NAME", "arguments":
{json}}\\n</tool_call>`, calls separated by a newline), glm45 (`<tool_call>NAME<arg_key>K</arg_key>` ...
`</tool_call>`, the arguments in xgrammar's `glm_xml` rendering of the schema, which takes GLM-4.5's newlines between
the parts and GLM-4.7's compact form alike) and minimax_m2 (`<minimax:tool_call>\\n<invoke name="NAME">\\n` ...
`</invoke>\\n</minimax:tool_call>`, the arguments in xgrammar's `minimax_xml` rendering), as in tool_parsers.py.
Markers are matched as text, so they fit whether the tokenizer has them as single tokens or spells them out.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from reasoning_engine.server.protocol import FunctionDef
from reasoning_engine.server.reasoning_parsers import KIMI_TOOL_SECTION_BEGINS
from reasoning_engine.server.tool_parsers import (
    GLM_CALL_BEGIN,
    GLM_CALL_END,
    HERMES_CALL_BEGIN,
    HERMES_CALL_END,
    KIMI_ARGUMENT_BEGIN,
    KIMI_CALL_BEGIN,
    KIMI_CALL_END,
    KIMI_SECTION_ENDS,
    MINIMAX_CALLS_BEGIN,
    MINIMAX_CALLS_END,
    MINIMAX_INVOKE_BEGIN,
    MINIMAX_INVOKE_END,
)
from reasoning_engine.structured.params import StructuredOutputsParams

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
MAX_WHITESPACE = 1
_KIMI_CALL_INDEX = "0|[1-9][0-9]{0,3}"  # the `:IDX` of a Kimi call id


@dataclass(frozen=True)
class CallSyntax(ABC):
    """One tool parser's call format: the calls sit between `open` and `close`, `separator` between two calls; a
    call is `call_begin(name)`, its content, `call_end`. `trigger` starts the calls inside free text."""

    trigger: str
    open: str
    close: str
    separator: str
    call_end: str

    @abstractmethod
    def call_begin(self, name: str) -> str:
        """What opens a call of `name`, up to its content."""

    def call_content(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return arguments


class KimiCallSyntax(CallSyntax):
    def call_begin(self, name: str) -> str:
        return f"{KIMI_CALL_BEGIN}functions.{name}:"

    def call_content(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The call index, then the arguments."""
        return {"type": "sequence", "elements": [{"type": "regex", "pattern": _KIMI_CALL_INDEX},
                                                 {"type": "const_string", "value": KIMI_ARGUMENT_BEGIN}, arguments]}


class HermesCallSyntax(CallSyntax):
    def call_begin(self, name: str) -> str:
        """Qwen3's template writes the name first, then the arguments object."""
        return f'{HERMES_CALL_BEGIN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


class GlmCallSyntax(CallSyntax):
    def call_begin(self, name: str) -> str:
        return f"{GLM_CALL_BEGIN}{name}"

    def call_content(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The schema's properties as `<arg_key>` / `<arg_value>` pairs: strings raw, other values JSON."""
        return {**arguments, "style": "glm_xml"}


class MiniMaxCallSyntax(CallSyntax):
    def call_begin(self, name: str) -> str:
        return f'{MINIMAX_INVOKE_BEGIN}"{name}">\n'

    def call_content(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The schema's properties as `<parameter name="K">V</parameter>` lines: strings raw, other values JSON. An
        array parameter declared without `items` gets `items: {}` (what the schema means), since xgrammar's
        `minimax_xml` refuses every value of such a parameter."""
        return {**arguments, "json_schema": _array_items_given(arguments["json_schema"]), "style": "minimax_xml"}


def _array_items_given(schema: dict[str, Any]) -> dict[str, Any]:
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return schema

    def given(prop: Any) -> Any:
        kind = prop.get("type") if isinstance(prop, dict) else None
        if "array" in (kind if isinstance(kind, list) else [kind]) and not {"items", "prefixItems"} & prop.keys():
            return {**prop, "items": {}}
        return prop

    return {**schema, "properties": {name: given(prop) for name, prop in properties.items()}}


CALL_SYNTAXES: dict[str, CallSyntax] = {
    "kimi_k2": KimiCallSyntax(trigger=KIMI_TOOL_SECTION_BEGINS[0], open=KIMI_TOOL_SECTION_BEGINS[0],
                              close=KIMI_SECTION_ENDS[0], separator="", call_end=KIMI_CALL_END),
    "hermes": HermesCallSyntax(trigger=HERMES_CALL_BEGIN, open="", close="", separator="\n",
                               call_end=f"}}\n{HERMES_CALL_END}"),
    "glm45": GlmCallSyntax(trigger=GLM_CALL_BEGIN, open="", close="", separator="\n", call_end=GLM_CALL_END),
    # vLLM's name for GLM-4.7's compact form, which glm_xml takes as well
    "glm47": GlmCallSyntax(trigger=GLM_CALL_BEGIN, open="", close="", separator="\n", call_end=GLM_CALL_END),
    "minimax_m2": MiniMaxCallSyntax(trigger=MINIMAX_CALLS_BEGIN, open=f"{MINIMAX_CALLS_BEGIN}\n",
                                    close=MINIMAX_CALLS_END, separator="", call_end=f"{MINIMAX_INVOKE_END}\n"),
}


def arguments_format(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": parameters if parameters is not None else NO_PARAMETERS,
            "max_whitespace_cnt": MAX_WHITESPACE}


def answer_format(spec: StructuredOutputsParams) -> dict[str, Any]:
    """A request's answer constraint as a structural-tag format, to offer beside the tool calls."""
    kind = spec.kind
    if kind == "json":
        return {"type": "json_schema", "json_schema": spec.schema(), "max_whitespace_cnt": MAX_WHITESPACE}
    if kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}, "max_whitespace_cnt": MAX_WHITESPACE}
    if kind == "regex":
        return {"type": "regex", "pattern": spec.regex}
    if kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in spec.choice]}
    if kind == "grammar":
        return {"type": "grammar", "grammar": spec.grammar}
    return json.loads(spec.structural_tag_json())["format"]


def tool_call_tag(parser: str, tools: Sequence[FunctionDef], *, required: bool, parallel: bool,
                  answer: StructuredOutputsParams | None = None) -> dict[str, Any]:
    """The structural tag for `tools` in `parser`'s format. `required`: the output is calls only (pass just the
    named function for a named tool_choice, with `parallel` false); otherwise the calls are optional: the output is
    `answer` or calls when `answer` is given, else free text with constrained calls."""
    syntax = CALL_SYNTAXES[parser]
    tags = [{"type": "tag", "begin": syntax.call_begin(tool.name),
             "content": syntax.call_content(arguments_format(tool.parameters)), "end": syntax.call_end}
            for tool in tools]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": syntax.separator, "at_least_one": True,
             "stop_after_first": not parallel}
    if syntax.open:
        block: dict[str, Any] = {"type": "tag", "begin": syntax.open, "content": calls, "end": syntax.close}
    else:
        block = calls
    if required:
        fmt = block
    elif answer is not None:
        fmt = {"type": "or", "elements": [answer_format(answer), block]}
    elif syntax.open:
        fmt = {"type": "triggered_tags", "triggers": [syntax.trigger], "tags": [block]}
    else:
        fmt = {"type": "triggered_tags", "triggers": [syntax.trigger], "tags": tags,
               "stop_after_first": not parallel}
    return {"type": "structural_tag", "format": fmt}


def bad_tool_schema(tools: Sequence[FunctionDef]) -> tuple[int, str] | None:
    """The first tool whose `parameters` is not a usable JSON schema, and why: (its index, the message)."""
    for i, tool in enumerate(tools):
        try:
            StructuredOutputsParams(structural_tag={"type": "structural_tag",
                                                    "format": arguments_format(tool.parameters)})
        except ValueError as exc:
            return i, str(exc).split(": ", 1)[-1]
    return None
