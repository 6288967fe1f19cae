"""Extracting tool calls from the answer text, incrementally, so streamed clients see OpenAI-shaped call deltas.

Formats:
- kimi_k2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
  <|tool_call_end|>...<|tool_calls_section_end|>`; the `functions.NAME:IDX` header is kept as the call id.
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the JSON is scanned as it arrives so the
  arguments stream out character by character, and a `</tool_call>` inside an argument string is not mistaken for
  the closing tag.
- glm45 (GLM-4.5 / 4.6 / 4.7; `glm47` names the same parser): `<tool_call>NAME<arg_key>K</arg_key><arg_value>V
  </arg_value>...</tool_call>`, values typed by the tool's schema (see `Glm45ToolParser`).
- minimax_m2 (MiniMax-M2): `<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter>...</invoke>
  </minimax:tool_call>`, values typed by the tool's schema (see `MiniMaxM2ToolParser`).
- deepseek_v3 (DeepSeek-V3-0324, R1-0528): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  \n```json\n{json}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`.
- deepseek_v31 (DeepSeek-V3.1, V3.2-Exp): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`.
- deepseek_v32 (DeepSeek-V3.2's DSML): `<｜DSML｜function_calls><｜DSML｜invoke name="NAME"><｜DSML｜parameter
  name="K" string="true|false">V</｜DSML｜parameter>...</｜DSML｜invoke></｜DSML｜function_calls>`.
- qwen3_coder (Qwen3-Coder, Qwen3.5 / 3.6; `qwen3_xml` names the same parser): `<tool_call>\n<function=NAME>\n
  <parameter=K>\nV\n</parameter>\n...</function>\n</tool_call>`, values typed by the tool's schema (see
  `Qwen3CoderToolParser`).
- gpt_oss (gpt-oss's harmony format): `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json
  <|message|>{json}<|call|>`; final and preamble messages are content (see `HarmonyToolParser`).

A parser's contract: no marker ever reaches the content, whatever the splitting of the text into pieces. The first
delta of a call carries its id and name (arguments ""), later deltas carry argument fragments whose concatenation
is the call's arguments string.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

from reasoning_engine.server.markers import MarkerSet
from reasoning_engine.server.reasoning_parsers import (
    HARMONY_CHANNEL,
    HARMONY_CONSTRAIN,
    HARMONY_ENDS,
    HARMONY_MARKERS,
    HARMONY_MESSAGE,
    HARMONY_START,
    KIMI_TOOL_SECTION_BEGINS,
    harmony_channel,
)


@dataclass
class ToolCallDelta:
    """One streamed piece of call `index`: the opening piece has id and name, the rest argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


class ToolParser:
    """Content pass-through that removes `drop` markers (special tokens); subclasses also extract calls."""

    #: Markers that open a call: they also end the thinking when a call starts inside it.
    start_markers: tuple[str, ...] = ()
    #: Every marker of the format: none of them may reach the content or the thinking.
    markers: tuple[str, ...] = ()
    #: The format writes arguments untyped: the constructor takes the offered tools' schemas (`schemas=`).
    uses_schemas: bool = False

    @classmethod
    def call_markers(cls) -> tuple[str, ...]:
        """Every marker the parser acts on, inside a call included (what a call's arguments must not hold)."""
        return cls.markers

    def __init__(self, drop: Iterable[str] = ()) -> None:
        self.calls: list[ToolCall] = []
        self._drop = tuple(drop)
        self._drop_markers = MarkerSet(self._drop)
        self._buf = ""
        self._deltas: list[ToolCallDelta] = []
        self._content: list[str] = []

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Consume a piece of answer text; return (content piece, call deltas)."""
        self._buf += text
        self._run()
        return self._take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: release held-back text; a call cut off mid-way keeps what was streamed of it."""
        self._flush()
        return self._take()

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas

    def _run(self) -> None:
        while True:
            before, marker, self._buf = self._drop_markers.split(self._buf)
            self._content.append(before)
            if marker is None:
                return

    def _flush(self) -> None:
        self._content.append(self._buf)
        self._buf = ""

    def _open_call(self, call_id: str, name: str) -> None:
        self.calls.append(ToolCall(id=call_id, name=name, arguments=""))
        self._deltas.append(ToolCallDelta(index=len(self.calls) - 1, id=call_id, name=name))

    def _add_arguments(self, text: str) -> None:
        if text:
            self.calls[-1].arguments += text
            self._deltas.append(ToolCallDelta(index=len(self.calls) - 1, arguments=text))

    def _add_argument_text(self, text: str) -> None:
        """A piece of a call's arguments as the model writes them; whitespace before the first is not part of them."""
        self._add_arguments(text if self.calls[-1].arguments else text.lstrip())


class _MarkerStateParser(ToolParser, ABC):
    """A format read as a state machine over its markers: the text between two markers goes to `_on_text` (what it
    means depends on the state), each marker to `_on_marker`. Starts in state "text"."""

    def __init__(self, drop: Iterable[str] = ()) -> None:
        super().__init__(drop)
        self._markers = MarkerSet([*self.markers, *self._drop])
        self._state = "text"

    def _run(self) -> None:
        while True:
            before, marker, self._buf = self._markers.split(self._buf)
            self._on_text(before)
            if marker is None:
                return
            self._on_marker(marker)

    @abstractmethod
    def _on_text(self, text: str) -> None:
        """Text between markers, by state."""

    @abstractmethod
    def _on_marker(self, marker: str) -> None:
        """A marker: the state it moves to."""


KIMI_SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
KIMI_CALL_BEGIN = "<|tool_call_begin|>"
KIMI_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"
_KIMI_HEADER = re.compile(r"(?:functions\.)?(.+):(\d+)")


class KimiK2ToolParser(_MarkerStateParser):
    """States: text -> section (between calls) -> header (`functions.NAME:IDX`) -> args -> section -> text."""

    start_markers = (*KIMI_TOOL_SECTION_BEGINS, KIMI_CALL_BEGIN)
    markers = (*KIMI_TOOL_SECTION_BEGINS, *KIMI_SECTION_ENDS, KIMI_CALL_BEGIN, KIMI_ARGUMENT_BEGIN, KIMI_CALL_END)

    def __init__(self, drop: Iterable[str] = ()) -> None:
        super().__init__(drop)
        self._header = ""

    def _on_text(self, text: str) -> None:
        if self._state == "text":
            self._content.append(text)
        elif self._state == "header":
            self._header += text
        elif self._state == "args":
            self._add_argument_text(text)
        # in "section", text between calls is dropped

    def _on_marker(self, marker: str) -> None:
        if marker in KIMI_TOOL_SECTION_BEGINS:
            if self._state == "text":
                self._state = "section"
        elif marker == KIMI_CALL_BEGIN:
            self._state, self._header = "header", ""
        elif marker == KIMI_ARGUMENT_BEGIN:
            if self._state == "header":
                self._open_call(*self._parse_header(self._header.strip()))
                self._state = "args"
        elif marker == KIMI_CALL_END:
            if self._state in ("header", "args"):
                self._state = "section"
        elif marker in KIMI_SECTION_ENDS:
            self._state = "text"

    def _parse_header(self, header: str) -> tuple[str, str]:
        """`functions.get_weather:3` -> (id kept as written, name `get_weather`)."""
        match = _KIMI_HEADER.fullmatch(header)
        if match:
            name = match.group(1)
            return (header if header.startswith("functions.") else f"functions.{name}:{match.group(2)}"), name
        name = header.removeprefix("functions.")
        return f"functions.{name}:{len(self.calls)}", name

    def _flush(self) -> None:
        rest, self._buf = self._buf, ""
        if self._state == "text":
            self._content.append(rest)
        elif self._state == "args":
            self._add_arguments(rest)


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
            self._open_call(f"call_{uuid.uuid4().hex[:24]}", scanner.name)
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


GLM_CALL_BEGIN, GLM_CALL_END = "<tool_call>", "</tool_call>"
GLM_KEY_BEGIN, GLM_KEY_END = "<arg_key>", "</arg_key>"
GLM_VALUE_BEGIN, GLM_VALUE_END = "<arg_value>", "</arg_value>"


def _string_schema(schema: object) -> bool | str | None:
    """Whether a JSON-schema property takes strings only (True), strings or null ("nullable": the template writes
    null as `null`), something else (False), or does not say (None)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kinds = {k for k in kind if k != "null"}
        if kinds == {"string"}:
            return "nullable" if "null" in kind else True
        return False if kinds else None
    return None if kind is None else kind == "string"


def _decoded(value: str, keep_strings: bool) -> object:
    """A non-string argument written raw (`42`, `true`, `{"a": 1}`); what does not parse stays the text. With
    `keep_strings`, a value that decodes to a string (`"x"`) also stays the text as written."""
    try:
        decoded = json.loads(value)
    except ValueError:
        return value
    return value if keep_strings and isinstance(decoded, str) else decoded


class Glm45ToolParser(_MarkerStateParser):
    """GLM-4.5 / 4.6 / 4.7: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>` (4.5 and
    4.6 put newlines between the parts). The template writes a string value as is and anything else as JSON, so a
    value is JSON-decoded unless the tool's schema says the argument is a string (without a schema for it: when it
    decodes to something else than a string); a value's outer whitespace is dropped. The arguments stream as one
    JSON object: each key at its `</arg_key>`, string values escaped piece by piece as they arrive, other values
    whole at their `</arg_value>`.

    States: text -> name -> key -> await_value -> value -> between -> key ... -> text; `skip` drops a nameless call.
    Text between the parts (the newlines) is dropped.
    """

    start_markers = (GLM_CALL_BEGIN,)
    markers = (GLM_CALL_BEGIN, GLM_CALL_END, GLM_KEY_BEGIN, GLM_KEY_END, GLM_VALUE_BEGIN, GLM_VALUE_END)
    uses_schemas = True

    def __init__(self, drop: Iterable[str] = (), schemas: dict[str, dict] | None = None) -> None:
        """`schemas`: each offered tool's `parameters` JSON schema, by tool name."""
        super().__init__(drop)
        self._schemas = schemas or {}
        self._name = ""
        self._key = ""
        self._value = ""
        self._quoted = False  # a string value is streaming: its opening quote is out

    def _on_text(self, text: str) -> None:
        if self._state == "text":
            self._content.append(text)
        elif self._state == "name":
            self._name += text
        elif self._state == "key":
            self._key += text
        elif self._state == "value":
            self._value_text(text)

    def _on_marker(self, marker: str) -> None:
        if marker == GLM_CALL_BEGIN:
            self._end_call()
            self._state, self._name = "name", ""
            return
        if marker == GLM_CALL_END:
            self._end_call()
            return
        if self._state in ("text", "skip") or marker not in self.markers:
            return  # a stray tag outside a call, or a dropped special token
        if self._state == "name" and not self._open_call_named():
            return
        if marker == GLM_KEY_BEGIN:
            self._end_pair()
            self._state, self._key = "key", ""
        elif marker == GLM_KEY_END and self._state == "key":
            self._add_arguments(("{" if not self.calls[-1].arguments else ", ") + json.dumps(self._key.strip()) + ": ")
            self._state = "await_value"
        elif marker == GLM_VALUE_BEGIN and self._state == "await_value":
            self._state, self._value, self._quoted = "value", "", False
        elif marker == GLM_VALUE_END and self._state == "value":
            self._end_pair()

    def _open_call_named(self) -> bool:
        """Leaving the name: open the call, or skip a call without a name."""
        name = self._name.strip()
        if not name:
            self._state = "skip"
            return False
        self._open_call(f"call_{uuid.uuid4().hex[:24]}", name)
        self._state = "between"
        return True

    def _string_value(self) -> bool | str | None:
        schema = self._schemas.get(self.calls[-1].name)
        properties = schema.get("properties") if isinstance(schema, dict) else None
        return _string_schema(properties.get(self._key.strip()) if isinstance(properties, dict) else None)

    def _value_text(self, text: str) -> None:
        if self._string_value() is not True:
            self._value += text
            return
        # the escaped text of a JSON string is the escaped text of its pieces; its outer whitespace (which the
        # call grammar, like the reference parsers, allows around a value) is dropped: trailing whitespace waits
        text = self._value + text
        if not self._quoted:
            text = text.lstrip()
            if not text:
                return
            self._add_arguments('"')
            self._quoted = True
        kept = text.rstrip()
        self._value = text[len(kept):]
        if kept:
            self._add_arguments(json.dumps(kept, ensure_ascii=False)[1:-1])

    def _end_pair(self) -> None:
        """Finish the key-value pair in progress: close its value, or give a key without one an empty string."""
        if self._state == "await_value":
            self._add_arguments('""')
        elif self._state == "value":
            kind, text = self._string_value(), self._value.strip()
            if self._quoted:
                self._add_arguments('"')
            elif kind is True:
                self._add_arguments('""')
            else:
                value: object = _decoded(text, keep_strings=kind is None)
                if kind == "nullable":
                    value = None if text == "null" else text
                self._add_arguments(json.dumps(value, ensure_ascii=False))
        self._state, self._key, self._value, self._quoted = "between", "", "", False

    def _end_call(self) -> None:
        """Close the call in progress (if any): the pair being written, then the arguments object."""
        if self._state == "name":
            self._open_call_named()
        if self._state not in ("text", "skip"):
            self._end_pair()
            self._add_arguments("}" if self.calls[-1].arguments else "{}")
        self._state = "text"

    def _flush(self) -> None:
        rest, self._buf = self._buf, ""
        if self._state == "text":
            self._content.append(rest)
            return
        if self._state == "name":
            self._name += rest
        elif self._state == "key":
            self._key += rest
        elif self._state == "value":
            self._value_text(rest)
        self._end_call()


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


def _unquote(text: str) -> str:
    text = text.strip()
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'" else text


class _InvokeTagsToolParser(ToolParser, ABC):
    """The state machine shared by the formats that write `BLOCK<invoke name="NAME"><parameter name="KEY">VALUE
    </parameter>...</invoke>...END_BLOCK` with their own tag spellings (MiniMax-M2, DeepSeek-V3.2's DSML). The
    arguments stream as one JSON object; subclasses read an invoke's name, open a parameter from its header (the
    key, and how its value is read) and take its value.

    States: text -> calls (between invokes) -> name (`"NAME">`) -> invoke (between parameters) -> key (`"KEY"...>`)
    -> value -> invoke ... -> calls -> text; `skip` drops an invoke without a name. Outside a call block the invoke
    and parameter tags are plain text; text between the parts of a block is dropped. Class attributes: `markers`
    (block begin, end) and `_tags` (invoke begin, end, parameter begin, end)."""

    _tags: tuple[str, str, str, str]

    @classmethod
    def call_markers(cls) -> tuple[str, ...]:
        return (*cls.markers, *cls._tags)

    def __init__(self, drop: Iterable[str] = ()) -> None:
        super().__init__(drop)
        self._markers = MarkerSet([*self.markers, *self._tags, *self._drop])
        self._value_ends = (self._tags[3], self._tags[1], self.markers[1])
        self._state = "text"
        self._header = ""  # an invoke's or parameter's header as it arrives

    @abstractmethod
    def _invoke_name(self, header: str) -> str:
        """The tool name in an invoke's header (empty: the invoke is skipped)."""

    @abstractmethod
    def _open_parameter(self, header: str) -> None:
        """Write the parameter's key from its header and get ready for its value."""

    @abstractmethod
    def _value_text(self, text: str) -> None:
        """A piece of the current parameter's value."""

    @abstractmethod
    def _end_parameter(self) -> None:
        """Close the current parameter's value in the arguments."""

    def _add_key(self, key: str) -> None:
        self._add_arguments(("{" if not self.calls[-1].arguments else ", ") + json.dumps(key, ensure_ascii=False)
                            + ": ")

    def _run(self) -> None:
        while True:
            if self._state in ("name", "key"):
                end = self._buf.find(">")
                self._header += self._buf if end < 0 else self._buf[:end]
                self._buf = "" if end < 0 else self._buf[end + 1:]
                if end < 0:
                    return
                self._end_header()
                continue
            before, marker, self._buf = self._markers.split(self._buf)
            if self._state == "text":
                self._text(before)
            elif self._state == "value":
                self._value_text(before)
            elif self._state == "calls":
                self._between_invokes(before)
            if marker is None:
                return
            self._on_marker(marker)

    def _text(self, text: str) -> None:
        """Text outside call blocks: content."""
        self._content.append(text)

    def _between_invokes(self, text: str) -> None:
        """Text in a call block outside any invoke: the newlines between the parts, dropped."""

    def _on_marker(self, marker: str) -> None:
        if marker in self._drop:
            return
        block_begin, block_end = self.markers
        invoke_begin, invoke_end, parameter_begin, _ = self._tags
        if self._state == "text":
            if marker == block_begin:
                self._state = "calls"
            elif marker != block_end:
                self._text(marker)  # a tag outside a call block is text; a stray block end is dropped
            return
        if self._state == "value":
            if marker not in self._value_ends:
                self._value_text(marker)
                return
            self._end_parameter()
            self._state = "invoke"
        if marker in (invoke_begin, invoke_end, block_begin, block_end):
            self._end_invoke()
            if marker == block_end:
                self._state = "text"
            elif marker == invoke_begin:
                self._state, self._header = "name", ""
        elif marker == parameter_begin and self._state == "invoke":
            self._state, self._header = "key", ""

    def _end_header(self) -> None:
        header, self._header = self._header, ""
        if self._state == "name":
            name = self._invoke_name(header)
            if name:
                self._open_call(f"call_{uuid.uuid4().hex[:24]}", name)
            self._state = "invoke" if name else "skip"
            return
        self._open_parameter(header)
        self._state = "value"

    def _end_invoke(self) -> None:
        """Close the call in progress, if any (a parameter whose name was cut off is left out), and go between
        invokes."""
        if self._state in ("invoke", "key"):
            self._add_arguments("}" if self.calls[-1].arguments else "{}")
        self._state = "calls"

    def _flush(self) -> None:
        rest, self._buf = self._buf, ""
        if self._state == "text":
            self._text(rest)
            return
        if self._state == "value":
            self._value_text(rest)
            self._end_parameter()
            self._state = "invoke"
        self._end_invoke()


class MiniMaxM2ToolParser(_InvokeTagsToolParser):
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
        return _unquote(header)

    def _open_parameter(self, header: str) -> None:
        key = _unquote(header)
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


DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
DEEPSEEK_SEP = "<｜tool▁sep｜>"


class DeepSeekV31ToolParser(_MarkerStateParser):
    """DeepSeek-V3.1 (and V3.2-Exp, whose template keeps it): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME
    <｜tool▁sep｜>{json}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`. The JSON arguments stream as written (a call
    without any is given `{}`); text between calls is dropped.

    States: text -> calls (between calls) -> name -> args -> calls -> text; `skip` drops a call without a name."""

    start_markers = (DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALL_BEGIN)
    markers = (DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END, DEEPSEEK_CALL_BEGIN, DEEPSEEK_SEP, DEEPSEEK_CALL_END)

    def __init__(self, drop: Iterable[str] = ()) -> None:
        super().__init__(drop)
        self._name = ""

    def _on_text(self, text: str) -> None:
        if self._state == "text":
            self._content.append(text)
        elif self._state == "name":
            self._name += text
        elif self._state == "args":
            self._add_argument_text(text)

    def _on_marker(self, marker: str) -> None:
        if marker == DEEPSEEK_CALLS_BEGIN and self._state == "text":
            self._state = "calls"
        elif marker == DEEPSEEK_CALL_BEGIN:
            self._end_call()
            self._state, self._name = "name", ""
        elif marker == DEEPSEEK_SEP and self._state == "name":
            self._after_separator()
        elif marker == DEEPSEEK_CALL_END:
            self._end_call()
        elif marker == DEEPSEEK_CALLS_END:
            self._end_call()
            self._state = "text"

    def _after_separator(self) -> None:
        """The text before the separator was the name: open the call; its arguments follow."""
        name = self._name.strip()
        if name:
            self._open_call(f"call_{uuid.uuid4().hex[:24]}", name)
        self._state = "args" if name else "skip"

    def _end_call(self) -> None:
        """Close the call in progress (if any) and go between calls."""
        if self._state == "args" and not self.calls[-1].arguments:
            self._add_arguments("{}")
        if self._state != "text":
            self._state = "calls"

    def _flush(self) -> None:
        rest, self._buf = self._buf, ""
        if self._state == "text":
            self._content.append(rest)
        elif self._state == "args":
            self._add_argument_text(rest)


DSML_CALLS_BEGIN, DSML_CALLS_END = "<｜DSML｜function_calls>", "</｜DSML｜function_calls>"
DSML_INVOKE_BEGIN, DSML_INVOKE_END = "<｜DSML｜invoke name=", "</｜DSML｜invoke>"
DSML_PARAMETER_BEGIN, DSML_PARAMETER_END = "<｜DSML｜parameter name=", "</｜DSML｜parameter>"
_DSML_HEADER = re.compile(r'\s*"(?P<name>[^"]*)"(?:\s+string="(?P<string>true|false)")?\s*')


class DeepSeekV3ToolParser(DeepSeekV31ToolParser):
    """DeepSeek-V3 and R1 (V3-0324's and R1-0528's templates): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function
    <｜tool▁sep｜>NAME\n```json\n{json}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`: the call's type before the
    separator, its name on a line after it, the arguments in a json fence. The fence is stripped while the arguments
    stream, so their last few characters wait for the next piece (they may be the closing fence).

    States: text -> calls -> name (here the type) -> head (the name line) -> args -> calls -> text; `skip` drops a
    nameless call."""

    _FENCE_OPEN, _FENCE_CLOSE, _HELD_BACK = "```json\n", "```", 8

    def __init__(self, drop: Iterable[str] = ()) -> None:
        super().__init__(drop)
        self._head = ""
        self._pending = ""  # arguments text not yet sent: the fence not yet resolved, or the held-back tail
        self._fence_resolved = False

    def _on_text(self, text: str) -> None:
        if self._state == "text":
            self._content.append(text)
        elif self._state == "head":
            self._head += text
            self._name_line_done()
        elif self._state == "args":
            self._stream_arguments(text, final=False)

    def _after_separator(self) -> None:
        """The text before the separator was the call's type; its name comes next, on a line of its own."""
        self._state, self._head = "head", ""

    def _name_line_done(self) -> None:
        """Open the call once its name line is complete; what follows the line is the (fenced) arguments."""
        if "\n" not in self._head:
            return
        name, rest = self._head.split("\n", 1)
        if not name.strip():
            self._state = "skip"
            return
        self._open_call(f"call_{uuid.uuid4().hex[:24]}", name.strip())
        self._state, self._pending, self._fence_resolved = "args", "", False
        self._stream_arguments(rest, final=False)

    def _stream_arguments(self, text: str, final: bool) -> None:
        """Send what is certain to be arguments: after the opening fence (once it is known whether one comes), and
        but for the last few characters until the call ends (then without the closing fence)."""
        self._pending += text
        if not self._fence_resolved:
            head = self._pending.lstrip()
            if self._FENCE_OPEN.startswith(head) and not final:
                return  # the opening fence may still be arriving
            self._pending, self._fence_resolved = head.removeprefix(self._FENCE_OPEN), True
        if final:
            ready, self._pending = self._pending.rstrip().removesuffix(self._FENCE_CLOSE).rstrip(), ""
        else:
            cut = max(len(self._pending) - self._HELD_BACK, 0)
            ready, self._pending = self._pending[:cut], self._pending[cut:]
        self._add_arguments(ready)

    def _end_call(self) -> None:
        if self._state == "head":
            self._head += "\n"  # a call ended on its name line: no arguments
            self._name_line_done()
        if self._state == "args":
            self._stream_arguments("", final=True)
        super()._end_call()

    def _flush(self) -> None:
        if self._state == "args":
            rest, self._buf = self._buf, ""
            self._stream_arguments(rest, final=True)
        super()._flush()


class DeepSeekV32ToolParser(_InvokeTagsToolParser):
    """DeepSeek-V3.2's DSML (its released chat encoding, `encoding_dsv32.py`): `<｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME"><｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>...
    </｜DSML｜invoke>...</｜DSML｜function_calls>` (newlines between the parts). `string="true"` marks a raw string
    value, streamed escaped piece by piece; `string="false"` a JSON one, written whole at its end tag (text that does
    not parse is kept as a string)."""

    start_markers = (DSML_CALLS_BEGIN,)
    markers = (DSML_CALLS_BEGIN, DSML_CALLS_END)
    _tags = (DSML_INVOKE_BEGIN, DSML_INVOKE_END, DSML_PARAMETER_BEGIN, DSML_PARAMETER_END)

    def __init__(self, drop: Iterable[str] = ()) -> None:
        super().__init__(drop)
        self._raw_string = True
        self._value = ""  # a JSON value as it arrives

    def _invoke_name(self, header: str) -> str:
        match = _DSML_HEADER.fullmatch(header)
        return match.group("name") if match else header.strip().strip('"')

    def _open_parameter(self, header: str) -> None:
        match = _DSML_HEADER.fullmatch(header)
        self._add_key(match.group("name") if match else header.strip().strip('"'))
        self._raw_string = not match or match.group("string") != "false"
        if self._raw_string:
            self._add_arguments('"')
        self._value = ""

    def _value_text(self, text: str) -> None:
        if self._raw_string:
            self._add_arguments(json.dumps(text, ensure_ascii=False)[1:-1])
        else:
            self._value += text

    def _end_parameter(self) -> None:
        if self._raw_string:
            self._add_arguments('"')
        else:
            try:
                value: object = json.loads(self._value)
            except ValueError:
                value = self._value.strip()
            self._add_arguments(json.dumps(value, ensure_ascii=False))
        self._value = ""


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
    (`_minimax_value`: text that does not parse stays text). A parameter without a schema type is a string.
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
        self._schema = self._property(_unquote(header))
        self._streams = self._kind == "string" and not {"enum", "const"} & self._schema.keys()
        self._nullable = _string_schema(self._schema) == "nullable"

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


_HARMONY_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyToolParser(_MarkerStateParser):
    """gpt-oss's harmony messages (see `reasoning_parsers.HarmonyReasoningParser`, which hands over every message but
    the analysis ones whole): a message with a recipient (`to=functions.NAME`, in the header before or after the
    channel) is a call whose body is its JSON arguments, streamed as they come; the final channel and commentary
    without a recipient (a preamble) are content; an analysis message (reasoning parsing off) is dropped. Text
    outside any message is content."""

    markers = HARMONY_MARKERS

    def __init__(self, drop: Iterable[str] = ()) -> None:
        super().__init__(drop)
        self._header = ""

    def _on_text(self, text: str) -> None:
        if self._state == "text":
            self._content.append(text)
        elif self._state == "header":
            self._header += text
        elif self._state == "call":
            self._add_argument_text(text)
        # in "skip" (an analysis body) the text is dropped

    def _on_marker(self, marker: str) -> None:
        if marker == HARMONY_START or (marker == HARMONY_CHANNEL and self._state == "text"):
            self._state, self._header = "header", "" if marker == HARMONY_START else marker
        elif self._state == "header" and marker in (HARMONY_CHANNEL, HARMONY_CONSTRAIN):
            self._header += marker
        elif self._state == "header" and marker == HARMONY_MESSAGE:
            recipient = _HARMONY_RECIPIENT.search(self._header)
            if recipient:
                self._open_call(f"call_{uuid.uuid4().hex[:24]}", recipient.group(1).removeprefix("functions."))
                self._state = "call"
            else:
                self._state = "skip" if harmony_channel(self._header) == "analysis" else "text"
        elif marker in HARMONY_ENDS:
            self._state = "text"

    def _flush(self) -> None:
        rest, self._buf = self._buf, ""
        if self._state == "text":
            self._content.append(rest)
        elif self._state == "call":
            self._add_arguments(rest)


TOOL_PARSERS: dict[str, type[ToolParser]] = {"kimi_k2": KimiK2ToolParser, "hermes": HermesToolParser,
                                            "glm45": Glm45ToolParser, "glm47": Glm45ToolParser,
                                            "minimax_m2": MiniMaxM2ToolParser,
                                            "deepseek_v3": DeepSeekV3ToolParser, "deepseek_v31": DeepSeekV31ToolParser,
                                            "deepseek_v32": DeepSeekV32ToolParser,
                                            "qwen3_coder": Qwen3CoderToolParser, "qwen3_xml": Qwen3CoderToolParser,
                                            "gpt_oss": HarmonyToolParser}
TOOL_PARSER_CHOICES = (*TOOL_PARSERS, "auto", "none")
