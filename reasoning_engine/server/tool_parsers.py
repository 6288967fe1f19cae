"""Extracting tool calls from the answer text, incrementally, so streamed clients see OpenAI-shaped call deltas.

Formats:
- kimi_k2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
  <|tool_call_end|>...<|tool_calls_section_end|>`; the `functions.NAME:IDX` header is kept as the call id.
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the JSON is scanned as it arrives so the
  arguments stream out character by character, and a `</tool_call>` inside an argument string is not mistaken for
  the closing tag.

A parser's contract: no marker ever reaches the content, whatever the splitting of the text into pieces. The first
delta of a call carries its id and name (arguments ""), later deltas carry argument fragments whose concatenation
is the call's arguments string.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from reasoning_engine.server.markers import MarkerSet
from reasoning_engine.server.reasoning_parsers import KIMI_TOOL_SECTION_BEGINS


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


KIMI_SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
KIMI_CALL_BEGIN = "<|tool_call_begin|>"
KIMI_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"
_KIMI_HEADER = re.compile(r"(?:functions\.)?(.+):(\d+)")


class KimiK2ToolParser(ToolParser):
    """States: text -> section (between calls) -> header (`functions.NAME:IDX`) -> args -> section -> text."""

    start_markers = (*KIMI_TOOL_SECTION_BEGINS, KIMI_CALL_BEGIN)
    markers = (*KIMI_TOOL_SECTION_BEGINS, *KIMI_SECTION_ENDS, KIMI_CALL_BEGIN, KIMI_ARGUMENT_BEGIN, KIMI_CALL_END)

    def __init__(self, drop: Iterable[str] = ()) -> None:
        super().__init__(drop)
        self._markers = MarkerSet([*self.markers, *self._drop])
        self._state = "text"
        self._header = ""

    def _run(self) -> None:
        while True:
            before, marker, self._buf = self._markers.split(self._buf)
            if self._state == "text":
                self._content.append(before)
            elif self._state == "header":
                self._header += before
            elif self._state == "args":
                self._add_arguments(before.lstrip() if not self.calls[-1].arguments else before)
            # in "section", text between calls is dropped
            if marker is None:
                return
            self._on_marker(marker)

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


TOOL_PARSERS: dict[str, type[ToolParser]] = {"kimi_k2": KimiK2ToolParser, "hermes": HermesToolParser}
TOOL_PARSER_CHOICES = (*TOOL_PARSERS, "auto", "none")
