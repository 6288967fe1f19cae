"""What every tool-call parser shares: the call deltas it emits, the pass-through base, and two state machines
the formats build on (one over a format's markers, one over `<invoke name=...><parameter name=...>` tags).

Each format's own parser lives with the rest of its format in `formats/` (kimi, qwen, glm, minimax, deepseek,
harmony). A parser's contract: no marker ever reaches the content, whatever the splitting of the text into pieces.
The first delta of a call carries its id and name (arguments ""), later deltas carry argument fragments whose
concatenation is the call's arguments string.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

from reasoning_engine.server.markers import MarkerSet


def new_call_id() -> str:
    """A fresh OpenAI-style call id, for formats whose calls carry none."""
    return f"call_{uuid.uuid4().hex[:24]}"


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


class MarkerStateParser(ToolParser, ABC):
    """A format read as a state machine over its markers: the text between two markers goes to `_on_text` (what it
    means depends on the state), each marker to `_on_marker`. Starts in state "text". Unless a format says
    otherwise, text is content in "text", a call's header (`_header`) in "header" and its arguments in "args", and
    dropped in any other state."""

    def __init__(self, drop: Iterable[str] = ()) -> None:
        super().__init__(drop)
        self._markers = MarkerSet([*self.markers, *self._drop])
        self._state = "text"
        self._header = ""

    def _run(self) -> None:
        while True:
            before, marker, self._buf = self._markers.split(self._buf)
            self._on_text(before)
            if marker is None:
                return
            self._on_marker(marker)

    def _on_text(self, text: str) -> None:
        """Text between markers, by state."""
        if self._state == "text":
            self._content.append(text)
        elif self._state == "header":
            self._header += text
        elif self._state == "args":
            self._add_argument_text(text)

    def _flush(self) -> None:
        """End of output: the held-back tail (the start of a marker that never came) is read as text in the
        current state; a call cut off in its header is dropped."""
        rest, self._buf = self._buf, ""
        if self._state in ("text", "args"):
            self._on_text(rest)

    @abstractmethod
    def _on_marker(self, marker: str) -> None:
        """A marker: the state it moves to."""


def string_schema(schema: object) -> bool | str | None:
    """Whether a JSON-schema property takes strings only (True), strings or null ("nullable": the template writes
    null as `null`), something else (False), or does not say (None)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kinds = {k for k in kind if k != "null"}
        if kinds == {"string"}:
            return "nullable" if "null" in kind else True
        return False if kinds else None
    return None if kind is None else kind == "string"


def unquote(text: str) -> str:
    text = text.strip()
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'" else text


class InvokeTagsToolParser(ToolParser, ABC):
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
                self._open_call(new_call_id(), name)
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
