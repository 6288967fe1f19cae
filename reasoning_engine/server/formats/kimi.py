"""Kimi K2 / K2.5 / Kimi Linear: thinking in `<think>...</think>` (the prompt opens it) and calls as
`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>
...<|tool_calls_section_end|>`; the `functions.NAME:IDX` header is kept as the call id. The model may open the
section without closing its thinking, and some checkpoints spell the section markers `tool_call_section`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from reasoning_engine.server.formats.base import CallSyntax, Family, ModelTraits, ToolFormat
from reasoning_engine.server.reasoning_parsers import ReasoningFormat
from reasoning_engine.server.tool_parsers import MarkerStateParser

IM_MIDDLE = "<|im_middle|>"  # Kimi's chat tokens: between a turn's role and its content
KIMI_TOOL_SECTION_BEGINS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
KIMI_SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
KIMI_CALL_BEGIN = "<|tool_call_begin|>"
KIMI_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"
_KIMI_HEADER = re.compile(r"(?:functions\.)?(.+):(\d+)")
_KIMI_CALL_INDEX = "0|[1-9][0-9]{0,3}"  # the `:IDX` of a Kimi call id, as the call grammar writes it


class KimiK2ToolParser(MarkerStateParser):
    """States: text -> section (between calls, whose text is dropped) -> header (`functions.NAME:IDX`) -> args ->
    section -> text."""

    start_markers = (*KIMI_TOOL_SECTION_BEGINS, KIMI_CALL_BEGIN)
    markers = (*KIMI_TOOL_SECTION_BEGINS, *KIMI_SECTION_ENDS, KIMI_CALL_BEGIN, KIMI_ARGUMENT_BEGIN, KIMI_CALL_END)

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


def _call_content(arguments: dict[str, Any], text: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """The call index, then the arguments."""
    return {"type": "sequence", "elements": [{"type": "regex", "pattern": _KIMI_CALL_INDEX},
                                             text(KIMI_ARGUMENT_BEGIN), arguments]}


def _auto_reasoning(model: ModelTraits) -> str | None:
    """A Kimi model type or Kimi's chat tokens in the vocabulary (Kimi Linear's checkpoints say another type)."""
    kimi_vocab = KIMI_TOOL_SECTION_BEGINS[0] in model.vocab or IM_MIDDLE in model.vocab
    return "kimi_k2" if model.model_type.startswith("kimi") or kimi_vocab else None


def _auto_tools(model: ModelTraits) -> str | None:
    return "kimi_k2" if model.model_type.startswith("kimi") or KIMI_CALL_BEGIN in model.vocab else None


FAMILY = Family(
    reasoning={"kimi_k2": ReasoningFormat("kimi_k2", implicit_ends=KIMI_TOOL_SECTION_BEGINS)},
    tools={"kimi_k2": ToolFormat(KimiK2ToolParser, CallSyntax(
        trigger=KIMI_TOOL_SECTION_BEGINS[0], open=KIMI_TOOL_SECTION_BEGINS[0], close=KIMI_SECTION_ENDS[0],
        separator="", call_end=KIMI_CALL_END, begin=lambda name: f"{KIMI_CALL_BEGIN}functions.{name}:",
        content=_call_content))},
    auto_reasoning=_auto_reasoning,
    auto_tools=_auto_tools,
)
