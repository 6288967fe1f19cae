"""Qwen's formats. Thinking: `qwen3`, `<think>...</think>` that the model may open itself (detected) or the
prompt opens (Qwen3-Next, Qwen3.5 / 3.6 when thinking); `auto` also gives it to any other model with `</think>` in
its vocabulary. Calls:
- hermes (Qwen3, Qwen3-Next, whose templates write JSON calls): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`; the JSON is scanned as it arrives so the arguments stream out character by character, and a
  `</tool_call>` inside an argument string is not mistaken for the closing tag. The grammar writes
  `<tool_call>\n{"name": "NAME", "arguments": {json}}\n</tool_call>`, calls a newline apart.
- qwen3_coder (Qwen3-Coder, Qwen3-Coder-Next, Qwen3.5 / 3.6; `qwen3_xml` names the same format): `<tool_call>\n
  <function=NAME>\n<parameter=K>\nV\n</parameter>\n...</function>\n</tool_call>`, one call per `<tool_call>`,
  values typed by the tool's schema (see `Qwen3CoderToolParser`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from reasoning_engine.server.formats.base import CallSyntax, Family, ModelTraits, ToolFormat, xml_arguments
from reasoning_engine.server.formats.minimax import MiniMaxM2ToolParser
from reasoning_engine.server.markers import MarkerSet
from reasoning_engine.server.reasoning_parsers import ReasoningFormat
from reasoning_engine.server.tool_parsers import ToolParser, new_call_id, string_schema, unquote

# Qwen3-Next, Qwen3.5 / 3.6: `<think>` reasoning (their templates open it in the prompt when thinking)
_QWEN_THINKING_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# Qwen3.5 / 3.6 write Qwen3-Coder's XML calls; Qwen3-Next (and Qwen3) say which format in their template
_QWEN_XML_CALL_TYPES = ("qwen3_5", "qwen3_5_moe")
HERMES_CALL_BEGIN = "<tool_call>"
HERMES_CALL_END = "</tool_call>"
_ARGUMENT_KEYS = ("arguments", "parameters")


class _JsonCallScanner:
    """Scans `{"name": "...", "arguments": {...}}` one character at a time as text arrives.

    It records the name and the span of the arguments value in the raw text (so argument text can be released while
    the object is still open) and where the object ends; nested strings are tracked so brackets or tags inside them
    do not count."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.state = "start"
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.args_kind: str | None = None  # "nested" | "string" | "scalar"
        self.end: int | None = None
        self._key = ""
        self._key_start = 0
        self._value_start = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def failed(self) -> bool:
        return self.state == "failed"

    def feed(self, text: str) -> None:
        self.text += text
        while self.pos < len(self.text) and self.state not in ("done", "failed"):
            self._step(self.text[self.pos])

    def _step(self, ch: str) -> None:
        state = self.state
        if state in ("start", "key_or_close", "colon", "value", "comma_or_close") and ch.isspace():
            self.pos += 1
            return
        if state == "start":
            self.state = "key_or_close" if ch == "{" else "failed"
        elif state == "key_or_close":
            if ch == '"':
                self.state, self._key_start = "key", self.pos
            else:
                self.state = "done" if ch == "}" else "failed"
        elif state == "key":
            if self._string_closed(ch):
                self._key = json.loads(self.text[self._key_start:self.pos + 1])
                self.state = "colon"
        elif state == "colon":
            self.state = "value" if ch == ":" else "failed"
        elif state == "value":
            self._value_start = self.pos
            kind = "nested" if ch in "{[" else "string" if ch == '"' else "scalar"
            self.state = {"nested": "nested", "string": "vstring", "scalar": "scalar"}[kind]
            self._depth = 1 if kind == "nested" else 0
            if self._key in _ARGUMENT_KEYS:
                self.args_start, self.args_kind = self.pos, kind
            if kind == "scalar":
                return  # re-read this character as part of the scalar
        elif state == "nested":
            if self._in_string:
                self._in_string = not self._string_closed(ch)
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._end_value(self.pos + 1)
        elif state == "vstring":
            if self._string_closed(ch):
                self._end_value(self.pos + 1)
        elif state == "scalar":
            if ch in ",}" or ch.isspace():
                self._end_value(self.pos)
                return  # the delimiter is read again by comma_or_close
        elif state == "comma_or_close":
            if ch == ",":
                self.state = "key_or_close"
            elif ch == "}":
                self.state, self.end = "done", self.pos + 1
            else:
                self.state = "failed"
        self.pos += 1

    def _string_closed(self, ch: str) -> bool:
        """Inside a string: True at its closing quote; tracks backslash escapes."""
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            return True
        return False

    def _end_value(self, end: int) -> None:
        raw = self.text[self._value_start:end]
        if self._key == "name" and self.state == "vstring":
            self.name = json.loads(raw)
        if self._key in _ARGUMENT_KEYS:
            self.args_end = end
        self.state = "comma_or_close"


class HermesToolParser(ToolParser):
    """States: text -> call (JSON being scanned, then the closing tag awaited) -> text."""

    start_markers = (HERMES_CALL_BEGIN,)
    markers = (HERMES_CALL_BEGIN, HERMES_CALL_END)

    def __init__(self, drop: Iterable[str] = ()) -> None:
        super().__init__(drop)
        self._markers = MarkerSet([*self.markers, *self._drop])
        self._tags = MarkerSet(self.markers)
        self._scanner: _JsonCallScanner | None = None
        self._opened = False
        self._args_sent = 0

    def _run(self) -> None:
        while True:
            if self._scanner is None:
                before, marker, self._buf = self._markers.split(self._buf)
                self._content.append(before)
                if marker is None:
                    return
                if marker == HERMES_CALL_BEGIN:
                    self._scanner, self._opened, self._args_sent = _JsonCallScanner(), False, 0
                continue
            scanner = self._scanner
            if not (scanner.done or scanner.failed):
                scanner.feed(self._buf)
                self._buf = ""
                self._release(scanner)
                if not (scanner.done or scanner.failed):
                    return
                self._buf = scanner.text[scanner.pos:]
            # the JSON is complete (or broken): wait for the closing tag, dropping anything before it
            before, marker, self._buf = self._tags.split(self._buf)
            if marker is None:
                return
            self._close_call()
            if marker == HERMES_CALL_BEGIN:
                self._scanner, self._opened, self._args_sent = _JsonCallScanner(), False, 0

    def _release(self, scanner: _JsonCallScanner) -> None:
        """Emit the call's opening delta once the name is known, then any argument text scanned since last time."""
        if scanner.name is None:
            return
        if not self._opened:
            self._open_call(new_call_id(), scanner.name)
            self._opened = True
        if scanner.args_start is None:
            return
        if scanner.args_kind == "nested":
            upto = scanner.args_end if scanner.args_end is not None else scanner.pos
            self._add_arguments(scanner.text[scanner.args_start + self._args_sent:upto])
            self._args_sent = upto - scanner.args_start
        elif scanner.args_end is not None and not self._args_sent:
            raw = scanner.text[scanner.args_start:scanner.args_end]
            value = json.loads(raw) if scanner.args_kind == "string" else raw
            self._add_arguments(value if isinstance(value, str) and value != "null" else "{}")
            self._args_sent = len(raw)

    def _close_call(self) -> None:
        if self._opened and not self.calls[-1].arguments:
            self._add_arguments("{}")
        self._scanner = None

    def _flush(self) -> None:
        if self._scanner is None:
            self._content.append(self._buf)
        elif self._scanner.done or self._opened:
            self._close_call()
        self._buf = ""


QWEN_FUNCTION_BEGIN, QWEN_FUNCTION_END = "<function=", "</function>"
QWEN_PARAMETER_BEGIN, QWEN_PARAMETER_END = "<parameter=", "</parameter>"


def _template_newlines_off(text: str) -> str:
    """A Qwen3-Coder value without the newline the template writes after `<parameter=KEY>` and the one before
    `</parameter>`: one each, so a value's own indentation and blank lines stay."""
    return text.removeprefix("\n").removesuffix("\n")


def _listed_value(text: str, schema: dict) -> tuple[bool, object]:
    """(True, the value) when the raw `text` is one of the values the schema lists (`enum`, `const`), written as the
    template writes it (a string as is, anything else as JSON), with or without whitespace around it."""
    values = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else []
    for candidate in (_template_newlines_off(text), text.strip()):
        for value in values:
            if candidate == (value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)):
                return True, value
    return False, None


class Qwen3CoderToolParser(MiniMaxM2ToolParser):
    """Qwen3-Coder, Qwen3-Coder-Next, Qwen3.5 / 3.6: `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n
    </parameter>\n...</function>\n</tool_call>`, one call per `<tool_call>`, calls a newline apart. The template
    writes a string value as is and anything else as JSON, so each value is read by the tool's schema: a string is
    the text less the template's newline on each side (`_template_newlines_off`), streamed escaped piece by piece
    (held while it could still be `null`, where the schema allows null); a value the schema lists is matched to the
    list; integers, numbers, booleans, null, objects and arrays are parsed whole at their end tag
    (`minimax._minimax_value`: text that does not parse stays text). A parameter without a schema type is a string.
    A value also ends at the next `<parameter=` (a model that left out `</parameter>`), `</function>` or
    `</tool_call>`. A `<tool_call>` followed by prose rather than `<function=` was the tag mentioned in the text:
    the tag is dropped and the prose stays content. Whitespace after a call (the newline between calls, or before
    the end) is not content; text after it is, whitespace included."""

    start_markers = (HERMES_CALL_BEGIN,)
    markers = (HERMES_CALL_BEGIN, HERMES_CALL_END)
    _tags = (QWEN_FUNCTION_BEGIN, QWEN_FUNCTION_END, QWEN_PARAMETER_BEGIN, QWEN_PARAMETER_END)

    def __init__(self, drop: Iterable[str] = (), schemas: dict[str, dict] | None = None) -> None:
        """`schemas`: each offered tool's `parameters` JSON schema, by tool name."""
        super().__init__(drop, schemas)
        self._value_ends = (*self._value_ends, QWEN_PARAMETER_BEGIN)
        self._schema: dict = {}  # the current parameter's
        self._streams = False  # a plain string value: it goes out as it arrives
        self._nullable = False
        self._opening = False  # a `<tool_call>` was just written: a function or prose follows
        self._after_call = False  # a `</tool_call>` was: whitespace after it is the separator, not content
        self._held_space = ""  # whitespace after either, until what follows shows what it is

    def _on_marker(self, marker: str) -> None:
        if marker not in self._drop:
            opening = self._state == "text" and marker == HERMES_CALL_BEGIN
            closing = self._state != "text" and marker == HERMES_CALL_END
            if opening or closing:
                self._held_space = ""
            self._opening = opening
            self._after_call = self._after_call or closing
        super()._on_marker(marker)

    def _text(self, text: str) -> None:
        if not self._after_call:
            self._content.append(text)
            return
        self._held_space += text
        if self._held_space.strip():
            self._content.append(self._held_space)
            self._after_call, self._held_space = False, ""

    def _between_invokes(self, text: str) -> None:
        if not self._opening:
            return
        self._held_space += text
        if self._held_space.strip():  # prose: the tag was text
            self._content.append(self._held_space)
            self._state, self._opening, self._after_call, self._held_space = "text", False, False, ""

    def _open_parameter(self, header: str) -> None:
        super()._open_parameter(header)
        self._schema = self._property(unquote(header))
        self._streams = self._kind == "string" and not {"enum", "const"} & self._schema.keys()
        self._nullable = string_schema(self._schema) == "nullable"

    def _value_text(self, text: str) -> None:
        if not self._streams:
            self._value += text
            return
        text = self._value + text
        if not self._quoted:
            body = text.removeprefix("\n")
            if not body or (self._nullable and ("null".startswith(body) or body == "null\n")):
                self._value = text  # nothing yet, or it may still be `null`
                return
            self._add_arguments('"')
            self._quoted, text = True, body
        kept = text.removesuffix("\n")  # a last newline waits: it is the template's if the value ends here
        self._value = text[len(kept):]
        if kept:
            self._add_arguments(json.dumps(kept, ensure_ascii=False)[1:-1])

    def _whole_value(self) -> object:
        listed, value = _listed_value(self._value, self._schema)
        if listed:
            return value
        if self._kind == "string":
            text = _template_newlines_off(self._value)
            return None if self._nullable and text == "null" else text
        return super()._whole_value()


def _hermes_call_begin(name: str) -> str:
    """Qwen3's template writes the name first, then the arguments object."""
    return f'{HERMES_CALL_BEGIN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


def _auto_reasoning(model: ModelTraits) -> str | None:
    """Asked last: the `<think>` splitter also serves any model with `</think>` in its vocabulary."""
    return "qwen3" if model.model_type in _QWEN_THINKING_TYPES or "</think>" in model.vocab else None


def _auto_tools(model: ModelTraits) -> str | None:
    """Qwen3.5 / 3.6, or a template that writes `<function=` and `<parameter=` (Qwen3-Coder, Qwen3-Coder-Next):
    qwen3_coder; a `<tool_call>` token or template mention: hermes."""
    xml_tags = QWEN_FUNCTION_BEGIN in model.chat_template and QWEN_PARAMETER_BEGIN in model.chat_template
    if model.model_type in _QWEN_XML_CALL_TYPES or xml_tags:
        return "qwen3_coder"
    if HERMES_CALL_BEGIN in model.vocab or HERMES_CALL_BEGIN in model.chat_template:
        return "hermes"
    return None


# as Qwen3-Coder's and Qwen3.5's templates write them: one call per `<tool_call>`, a newline between calls, the
# arguments as `<parameter=K>V</parameter>` lines. `qwen_xml` allows one whitespace character around each value
# where the template writes a newline; the parser drops that newline from a string (and any whitespace around other
# values), so a length-bounded string with a space or tab there reads one or two characters longer than the grammar
# held it to.
_CODER = ToolFormat(Qwen3CoderToolParser, CallSyntax(
    trigger=HERMES_CALL_BEGIN, open="", close="", separator="\n", call_end=f"{QWEN_FUNCTION_END}\n{HERMES_CALL_END}",
    begin=lambda name: f"{HERMES_CALL_BEGIN}\n{QWEN_FUNCTION_BEGIN}{name}>\n", content=xml_arguments("qwen_xml")))
FAMILY = Family(
    reasoning={"qwen3": ReasoningFormat("qwen3")},
    tools={"hermes": ToolFormat(HermesToolParser, CallSyntax(
               trigger=HERMES_CALL_BEGIN, open="", close="", separator="\n", call_end=f"}}\n{HERMES_CALL_END}",
               begin=_hermes_call_begin)),
           "qwen3_coder": _CODER, "qwen3_xml": _CODER},
    auto_reasoning=_auto_reasoning,
    auto_tools=_auto_tools,
)
