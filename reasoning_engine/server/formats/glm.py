"""GLM-4.5 / 4.6 / 4.7: thinking in `<think>...</think>` (Qwen3's markers, under the name vLLM and SGLang give
it: 4.5 / 4.6 write `<think>` themselves, 4.7's prompt opens it, thinking off renders `<think></think>`) and calls as
`<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`, values typed by the tool's schema
(see `Glm45ToolParser`). `glm47` names the same tool format: the call grammar's `glm_xml` takes GLM-4.5's newlines
between the parts and GLM-4.7's compact form alike.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from reasoning_engine.server.formats.base import CallSyntax, Family, ModelTraits, ToolFormat
from reasoning_engine.server.reasoning_parsers import ReasoningFormat
from reasoning_engine.server.tool_parsers import MarkerStateParser, new_call_id, string_schema

GLM_CALL_BEGIN, GLM_CALL_END = "<tool_call>", "</tool_call>"
GLM_KEY_BEGIN, GLM_KEY_END = "<arg_key>", "</arg_key>"
GLM_VALUE_BEGIN, GLM_VALUE_END = "<arg_value>", "</arg_value>"


def _decoded(value: str, keep_strings: bool) -> object:
    """A non-string argument written raw (`42`, `true`, `{"a": 1}`); what does not parse stays the text. With
    `keep_strings`, a value that decodes to a string (`"x"`) also stays the text as written."""
    try:
        decoded = json.loads(value)
    except ValueError:
        return value
    return value if keep_strings and isinstance(decoded, str) else decoded


class Glm45ToolParser(MarkerStateParser):
    """GLM-4.5 / 4.6 / 4.7: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>` (4.5 and
    4.6 put newlines between the parts). The template writes a string value as is and anything else as JSON, so a
    value is JSON-decoded unless the tool's schema says the argument is a string (without a schema for it: when it
    decodes to something else than a string); a value's outer whitespace is dropped. The arguments stream as one
    JSON object: each key at its `</arg_key>`, string values escaped piece by piece as they arrive, other values
    whole at their `</arg_value>`.

    States: text -> header (the name) -> key -> await_value -> value -> between -> key ... -> text; `skip` drops a
    nameless call. Text between the parts (the newlines) is dropped.
    """

    start_markers = (GLM_CALL_BEGIN,)
    markers = (GLM_CALL_BEGIN, GLM_CALL_END, GLM_KEY_BEGIN, GLM_KEY_END, GLM_VALUE_BEGIN, GLM_VALUE_END)
    uses_schemas = True

    def __init__(self, drop: Iterable[str] = (), schemas: dict[str, dict] | None = None) -> None:
        """`schemas`: each offered tool's `parameters` JSON schema, by tool name."""
        super().__init__(drop)
        self._schemas = schemas or {}
        self._key = ""
        self._value = ""
        self._quoted = False  # a string value is streaming: its opening quote is out

    def _on_text(self, text: str) -> None:
        if self._state == "key":
            self._key += text
        elif self._state == "value":
            self._value_text(text)
        else:
            super()._on_text(text)  # content, or the call's name (its header)

    def _on_marker(self, marker: str) -> None:
        if marker == GLM_CALL_BEGIN:
            self._end_call()
            self._state, self._header = "header", ""
            return
        if marker == GLM_CALL_END:
            self._end_call()
            return
        if self._state in ("text", "skip") or marker not in self.markers:
            return  # a stray tag outside a call, or a dropped special token
        if self._state == "header" and not self._open_call_named():
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
        name = self._header.strip()
        if not name:
            self._state = "skip"
            return False
        self._open_call(new_call_id(), name)
        self._state = "between"
        return True

    def _string_value(self) -> bool | str | None:
        schema = self._schemas.get(self.calls[-1].name)
        properties = schema.get("properties") if isinstance(schema, dict) else None
        return string_schema(properties.get(self._key.strip()) if isinstance(properties, dict) else None)

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
        if self._state == "header":
            self._open_call_named()
        if self._state not in ("text", "skip"):
            self._end_pair()
            self._add_arguments("}" if self.calls[-1].arguments else "{}")
        self._state = "text"

    def _flush(self) -> None:
        rest, self._buf = self._buf, ""
        self._on_text(rest)
        self._end_call()


def _call_content(arguments: dict[str, Any], text: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """The schema's properties as `<arg_key>` / `<arg_value>` pairs: strings raw, other values JSON."""
    return {**arguments, "style": "glm_xml"}


def _auto_reasoning(model: ModelTraits) -> str | None:
    return "glm45" if model.model_type.startswith("glm") and "</think>" in model.vocab else None


def _auto_tools(model: ModelTraits) -> str | None:
    return "glm45" if model.model_type.startswith("glm") or GLM_KEY_BEGIN in model.vocab else None


_TOOLS = ToolFormat(Glm45ToolParser, CallSyntax(trigger=GLM_CALL_BEGIN, open="", close="", separator="\n",
                                                call_end=GLM_CALL_END, begin=lambda name: f"{GLM_CALL_BEGIN}{name}",
                                                content=_call_content))
FAMILY = Family(
    reasoning={"glm45": ReasoningFormat("glm45")},
    tools={"glm45": _TOOLS, "glm47": _TOOLS},  # glm47: vLLM's name for GLM-4.7's compact form
    auto_reasoning=_auto_reasoning,
    auto_tools=_auto_tools,
)
