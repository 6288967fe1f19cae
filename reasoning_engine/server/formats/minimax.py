"""MiniMax-M2: thinking in `<think>...</think>` (the prompt opens it: the output starts inside the thinking) and
calls as `<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter>...</invoke></minimax:tool_call>`,
values typed by the tool's schema (see `MiniMaxM2ToolParser`). `minimax_m2_append_think` keeps the thinking in the
answer text, between its markers (vLLM's name): for clients that send the content back as the history, as MiniMax-M2
expects.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

from reasoning_engine.server.formats.base import CallSyntax, Family, ModelTraits, ToolFormat, xml_arguments
from reasoning_engine.server.reasoning_parsers import ReasoningFormat
from reasoning_engine.server.tool_parsers import InvokeTagsToolParser, unquote

MINIMAX_CALLS_BEGIN, MINIMAX_CALLS_END = "<minimax:tool_call>", "</minimax:tool_call>"
MINIMAX_INVOKE_BEGIN, MINIMAX_INVOKE_END = "<invoke name=", "</invoke>"
MINIMAX_PARAMETER_BEGIN, MINIMAX_PARAMETER_END = "<parameter name=", "</parameter>"
_MINIMAX_TYPE_ALIASES = {"str": "string", "text": "string", "int": "integer", "float": "number", "bool": "boolean"}


def _minimax_kind(schema: object) -> str:
    """The type a MiniMax-M2 parameter value is read as: its JSON-schema property's `type` (the first one but
    "null" when it lists several); "string" when the schema does not say, as MiniMax's reference parser reads it."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return _MINIMAX_TYPE_ALIASES.get(kind.lower(), kind.lower()) if isinstance(kind, str) else "string"


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _minimax_value(text: str, kind: str) -> object:
    """A whole (stripped) parameter value read as `kind`, following MiniMax's reference parser: `null` is None,
    integers / numbers / booleans are parsed (a number with an integral value becomes an integer, booleans are
    "true" or "1"), objects, arrays and other types are read as JSON; a value that does not parse stays text."""
    if text.lower() == "null":
        return None
    if kind == "string":
        return text
    if kind == "boolean":
        return text.lower() in ("true", "1")
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            number = float(text)
            if not math.isfinite(number):
                return text
            return int(number) if number.is_integer() else number
        return json.loads(text, parse_constant=_no_constant)
    except ValueError:
        return text


class MiniMaxM2ToolParser(InvokeTagsToolParser):
    """MiniMax-M2: `<minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter>...</invoke>...
    </minimax:tool_call>` (newlines between the parts). Values are untyped text read by the tool's schema
    (`_minimax_value`): each key goes out when its `<parameter name="KEY">` closes, string values escaped piece by
    piece as they arrive (their outer whitespace dropped, as the reference parser strips them; held while they could
    still be `null`), other values whole at their `</parameter>`."""

    start_markers = (MINIMAX_CALLS_BEGIN,)
    markers = (MINIMAX_CALLS_BEGIN, MINIMAX_CALLS_END)
    uses_schemas = True
    _tags = (MINIMAX_INVOKE_BEGIN, MINIMAX_INVOKE_END, MINIMAX_PARAMETER_BEGIN, MINIMAX_PARAMETER_END)

    def __init__(self, drop: Iterable[str] = (), schemas: dict[str, dict] | None = None) -> None:
        """`schemas`: each offered tool's `parameters` JSON schema, by tool name."""
        super().__init__(drop)
        self._schemas = schemas or {}
        self._kind = "string"
        self._value = ""  # a non-string value, or a string's held whitespace (or its possible `null`)
        self._quoted = False  # a string value is streaming: its opening quote is out

    def _invoke_name(self, header: str) -> str:
        return unquote(header)

    def _open_parameter(self, header: str) -> None:
        key = unquote(header)
        self._add_key(key)
        self._kind = _minimax_kind(self._property(key))
        self._value, self._quoted = "", False

    def _property(self, key: str) -> dict:
        """The schema of the current call's parameter `key` ({} where the tool's schema says nothing)."""
        schema = self._schemas.get(self.calls[-1].name)
        properties = schema.get("properties") if isinstance(schema, dict) else None
        prop = properties.get(key) if isinstance(properties, dict) else None
        return prop if isinstance(prop, dict) else {}

    def _value_text(self, text: str) -> None:
        if self._kind != "string":
            self._value += text
            return
        text = self._value + text
        if not self._quoted:
            text = text.lstrip()
            if "null".startswith(text.rstrip().lower()):
                self._value = text  # nothing yet, or it may still be `null`
                return
            self._add_arguments('"')
            self._quoted = True
        kept = text.rstrip()  # trailing whitespace waits: it is dropped if the value ends here
        self._value = text[len(kept):]
        if kept:
            self._add_arguments(json.dumps(kept, ensure_ascii=False)[1:-1])

    def _end_parameter(self) -> None:
        if self._quoted:
            self._add_arguments('"')
        else:
            self._add_arguments(json.dumps(self._whole_value(), ensure_ascii=False))
        self._value, self._quoted = "", False

    def _whole_value(self) -> object:
        """A value that did not stream, read whole."""
        return _minimax_value(self._value.strip(), self._kind)


def _auto_reasoning(model: ModelTraits) -> str | None:
    return "minimax_m2" if model.model_type.startswith("minimax") and "</think>" in model.vocab else None


def _auto_tools(model: ModelTraits) -> str | None:
    return "minimax_m2" if model.model_type.startswith("minimax") or MINIMAX_CALLS_BEGIN in model.vocab else None


FAMILY = Family(
    reasoning={"minimax_m2": ReasoningFormat("minimax_m2"),
               "minimax_m2_append_think": ReasoningFormat("minimax_m2_append_think", thinking_in_content=True)},
    # the arguments as `<parameter name="K">V</parameter>` lines
    tools={"minimax_m2": ToolFormat(MiniMaxM2ToolParser, CallSyntax(
        trigger=MINIMAX_CALLS_BEGIN, open=f"{MINIMAX_CALLS_BEGIN}\n", close=MINIMAX_CALLS_END, separator="",
        call_end=f"{MINIMAX_INVOKE_END}\n", begin=lambda name: f'{MINIMAX_INVOKE_BEGIN}"{name}">\n',
        content=xml_arguments("minimax_xml")))},
    auto_reasoning=_auto_reasoning,
    auto_tools=_auto_tools,
)
