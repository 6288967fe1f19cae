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
the parts and GLM-4.7's compact form alike), minimax_m2 (`<minimax:tool_call>\\n<invoke name="NAME">\\n` ...
`</invoke>\\n</minimax:tool_call>`, the arguments in xgrammar's `minimax_xml` rendering), deepseek_v3
(`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{json}\\n```<｜tool▁call▁end｜>`,
calls separated by a newline), deepseek_v31
(`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`),
deepseek_v32 (`\\n\\n<｜DSML｜function_calls>\\n<｜DSML｜invoke name="NAME">\\n` ... `</｜DSML｜invoke>\\n
</｜DSML｜function_calls>`, the arguments in xgrammar's `deepseek_xml` rendering: `<｜DSML｜parameter name="K"
string="true">raw string</｜DSML｜parameter>` or `string="false">JSON`), qwen3_coder / qwen3_xml
(`<tool_call>\\n<function=NAME>\\n` ... `</function>\\n</tool_call>`, calls separated by a newline, the arguments in
xgrammar's `qwen_xml` rendering: `<parameter=K>V</parameter>`) and gpt_oss (harmony: `<|channel|>commentary
to=functions.NAME <|constrain|>json<|message|>{json}`; the `<|call|>` after it is a stop token, so a call ends the
output and there is at most one), as in tool_parsers.py.
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
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reasoning_engine.server.protocol import FunctionDef
from reasoning_engine.server.reasoning_parsers import (
    HARMONY_CHANNEL,
    HARMONY_CONSTRAIN,
    HARMONY_ENDS,
    HARMONY_MARKERS,
    HARMONY_MESSAGE,
    HARMONY_START,
    KIMI_TOOL_SECTION_BEGINS,
)
from reasoning_engine.server.tool_parsers import (
    DEEPSEEK_CALL_BEGIN,
    DEEPSEEK_CALL_END,
    DEEPSEEK_CALLS_BEGIN,
    DEEPSEEK_CALLS_END,
    DEEPSEEK_SEP,
    DSML_CALLS_BEGIN,
    DSML_CALLS_END,
    DSML_INVOKE_BEGIN,
    DSML_INVOKE_END,
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
    QWEN_FUNCTION_BEGIN,
    QWEN_FUNCTION_END,
    TOOL_PARSERS,
)
from reasoning_engine.structured.params import StructuredOutputsParams
from reasoning_engine.structured.schemas import SchemaError, enforceable_schema, join, marker_free_schema

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
MAX_WHITESPACE = 1
_KIMI_CALL_INDEX = "0|[1-9][0-9]{0,3}"  # the `:IDX` of a Kimi call id


@dataclass(frozen=True)
class CallSyntax(ABC):
    """One tool parser's call format: the calls sit between `open` and `close`, `separator` between two calls; a
    call is `call_begin(name)`, its content, `call_end`. `trigger` starts the calls inside free text. `lead` comes
    before the calls where they are the whole answer (DeepSeek-V3.2 writes its block after a blank line, which in
    free text is the model's own). `ends_turn`: the call's end marker is a stop token, left out of the grammar, so a
    call ends the output and there is at most one (gpt-oss)."""

    trigger: str
    open: str
    close: str
    separator: str
    call_end: str
    lead: str = ""
    ends_turn: bool = False

    @abstractmethod
    def call_begin(self, name: str) -> str:
        """What opens a call of `name`, up to its content."""

    def call_content(self, arguments: dict[str, Any], text: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        """A call's content around its `arguments` format; `text` makes a format of fixed text."""
        return arguments


class KimiCallSyntax(CallSyntax):
    def call_begin(self, name: str) -> str:
        return f"{KIMI_CALL_BEGIN}functions.{name}:"

    def call_content(self, arguments: dict[str, Any], text: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        """The call index, then the arguments."""
        return {"type": "sequence", "elements": [{"type": "regex", "pattern": _KIMI_CALL_INDEX},
                                                 text(KIMI_ARGUMENT_BEGIN), arguments]}


class HermesCallSyntax(CallSyntax):
    def call_begin(self, name: str) -> str:
        """Qwen3's template writes the name first, then the arguments object."""
        return f'{HERMES_CALL_BEGIN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


class GlmCallSyntax(CallSyntax):
    def call_begin(self, name: str) -> str:
        return f"{GLM_CALL_BEGIN}{name}"

    def call_content(self, arguments: dict[str, Any], text: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        """The schema's properties as `<arg_key>` / `<arg_value>` pairs: strings raw, other values JSON."""
        return {**arguments, "style": "glm_xml"}


class MiniMaxCallSyntax(CallSyntax):
    def call_begin(self, name: str) -> str:
        return f'{MINIMAX_INVOKE_BEGIN}"{name}">\n'

    def call_content(self, arguments: dict[str, Any], text: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        """The schema's properties as `<parameter name="K">V</parameter>` lines: strings raw, other values JSON. An
        array parameter declared without `items` gets `items: {}` (what the schema means), since xgrammar's
        `minimax_xml` refuses every value of such a parameter."""
        return {**arguments, "json_schema": _array_items_given(arguments["json_schema"]), "style": "minimax_xml"}


class DeepSeekV3CallSyntax(CallSyntax):
    def call_begin(self, name: str) -> str:
        """V3-0324's and R1-0528's header: the call's type, the name on its own line, a json fence."""
        return f"{DEEPSEEK_CALL_BEGIN}function{DEEPSEEK_SEP}{name}\n```json\n"


class DeepSeekV31CallSyntax(CallSyntax):
    def call_begin(self, name: str) -> str:
        return f"{DEEPSEEK_CALL_BEGIN}{name}{DEEPSEEK_SEP}"


class DsmlCallSyntax(CallSyntax):
    def call_begin(self, name: str) -> str:
        return f'{DSML_INVOKE_BEGIN}"{name}">\n'

    def call_content(self, arguments: dict[str, Any], text: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        """The schema's properties as `<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>` lines:
        strings raw (`true`), other values JSON (`false`); an array without `items` as for MiniMax-M2."""
        return {**arguments, "json_schema": _array_items_given(arguments["json_schema"]), "style": "deepseek_xml"}


class QwenCoderCallSyntax(CallSyntax):
    def call_begin(self, name: str) -> str:
        return f"{HERMES_CALL_BEGIN}\n{QWEN_FUNCTION_BEGIN}{name}>\n"

    def call_content(self, arguments: dict[str, Any], text: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        """The schema's properties as `<parameter=K>V</parameter>` lines (xgrammar's `qwen_xml`): strings raw,
        other values JSON; an array without `items` as for MiniMax-M2. `qwen_xml` allows one whitespace character
        around each value where the template writes a newline; the parser drops that newline from a string (and
        any whitespace around other values), so a length-bounded string with a space or tab there reads one or two
        characters longer than the grammar held it to."""
        return {**arguments, "json_schema": _array_items_given(arguments["json_schema"]), "style": "qwen_xml"}


class HarmonyCallSyntax(CallSyntax):
    def call_begin(self, name: str) -> str:
        """The header gpt-oss writes for a call (the one the harmony guide shows); the recipient-first form
        ` to=functions.NAME<|channel|>commentary json` is not offered."""
        return f"{HARMONY_CHANNEL}commentary to=functions.{name} {HARMONY_CONSTRAIN}json{HARMONY_MESSAGE}"


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
    "deepseek_v3": DeepSeekV3CallSyntax(trigger=DEEPSEEK_CALLS_BEGIN, open=DEEPSEEK_CALLS_BEGIN,
                                        close=DEEPSEEK_CALLS_END, separator="\n", call_end=f"\n```{DEEPSEEK_CALL_END}"),
    "deepseek_v31": DeepSeekV31CallSyntax(trigger=DEEPSEEK_CALLS_BEGIN, open=DEEPSEEK_CALLS_BEGIN,
                                          close=DEEPSEEK_CALLS_END, separator="", call_end=DEEPSEEK_CALL_END),
    # as DeepSeek-V3.2's encoding writes it: parameters and invokes one a line
    "deepseek_v32": DsmlCallSyntax(trigger=DSML_CALLS_BEGIN, open=f"{DSML_CALLS_BEGIN}\n",
                                   close=f"\n{DSML_CALLS_END}", separator="\n", call_end=f"\n{DSML_INVOKE_END}",
                                   lead="\n\n"),
    # as Qwen3-Coder's and Qwen3.5's templates write them: one call per `<tool_call>`, a newline between calls
    "qwen3_coder": QwenCoderCallSyntax(trigger=HERMES_CALL_BEGIN, open="", close="", separator="\n",
                                       call_end=f"{QWEN_FUNCTION_END}\n{HERMES_CALL_END}"),
    "qwen3_xml": QwenCoderCallSyntax(trigger=HERMES_CALL_BEGIN, open="", close="", separator="\n",
                                     call_end=f"{QWEN_FUNCTION_END}\n{HERMES_CALL_END}"),
    "gpt_oss": HarmonyCallSyntax(trigger=f"{HARMONY_CHANNEL}commentary to=functions.", open="", close="",
                                 separator="", call_end="", ends_turn=True),
}


@dataclass(frozen=True)
class InlineThinking:
    """A reasoning format whose end the engine cannot see (no `</think>` token), so a constraint holds the output
    from its first token and must let the thinking through itself: any number of `message`s (a thinking message and
    what opens the next one) come first, and `answer_begin` opens an answer format's answer."""

    message: dict[str, Any]
    answer_begin: str

    def then(self, fmt: dict[str, Any]) -> dict[str, Any]:
        """`fmt` after the thinking."""
        return {"type": "sequence", "elements": [{"type": "star", "content": self.message}, fmt]}

    def answer(self, fmt: dict[str, Any]) -> dict[str, Any]:
        """An answer format's answer in its own message."""
        return {"type": "sequence", "elements": [{"type": "const_string", "value": self.answer_begin}, fmt]}


_HARMONY_END = HARMONY_ENDS[0]  # `<|end|>`: a message that does not end the turn
# gpt-oss: the prompt ends with `<|start|>assistant`, so each message is its channel header, its body and its end,
# and `<|start|>assistant` opens the next one; an analysis body holds no other harmony marker
INLINE_THINKING: dict[str, InlineThinking] = {
    "gpt_oss": InlineThinking(
        message={"type": "sequence", "elements": [
            {"type": "tag", "begin": f"{HARMONY_CHANNEL}analysis{HARMONY_MESSAGE}",
             "content": {"type": "any_text", "excludes": [m for m in HARMONY_MARKERS if m != _HARMONY_END]},
             "end": _HARMONY_END},
            {"type": "const_string", "value": f"{HARMONY_START}assistant"}]},
        answer_begin=f"{HARMONY_CHANNEL}final{HARMONY_MESSAGE}"),
}


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
