"""The per-choice output pipeline: reasoning splitter, then tool-call extraction on the answer part.

Text flows: engine text delta -> ReasoningParser -> (thinking, answer text) -> ToolParser -> (answer, call deltas).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from reasoning_engine.server.formats.registry import REASONING_FORMATS, TOOL_PARSERS
from reasoning_engine.server.reasoning_parsers import ReasoningParser, initial_mode
from reasoning_engine.server.tool_parsers import ToolCall, ToolCallDelta, ToolParser


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class OutputShaper(ABC):
    """What an API makes of one choice's parsed pieces (Anthropic's content blocks, Responses' output items): `feed`
    gives the events of each piece, in the order the model wrote them."""

    def feed(self, parsed: ParsedDelta) -> list[Any]:
        events: list[Any] = []
        if parsed.reasoning:
            events += self.thinking(parsed.reasoning)
        if parsed.content:
            events += self.answer(parsed.content)
        for delta in parsed.tool_calls:
            events += self.tool_call(delta)
        return events

    @abstractmethod
    def thinking(self, text: str) -> list[Any]:
        """A piece of the thinking."""

    @abstractmethod
    def answer(self, text: str) -> list[Any]:
        """A piece of the answer text."""

    @abstractmethod
    def tool_call(self, delta: ToolCallDelta) -> list[Any]:
        """A piece of a tool call: its opening (id, name) or argument text."""


class ChatOutputParser:
    """One choice's parser chain. Leading whitespace of the thinking and of the answer is dropped (templates put
    newlines after `<think>` and `</think>`), and so is the thinking's trailing whitespace: it is held back while
    streaming until more thinking follows, so the streamed pieces join to the non-streamed text wherever the
    thinking stops. Tool calls found when tools are not offered are removed, not emitted."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, emit_tool_calls: bool) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.emit_tool_calls = emit_tool_calls
        self._reasoning_started = False
        self._content_started = False
        self._held_space = ""
        self._thinking_tags = ""  # thinking kept in the content: "" before it, "open" inside, "closed" after

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None and self.emit_tool_calls else []

    def feed(self, text: str) -> ParsedDelta:
        return self._step(text, final=False)

    def finish(self) -> ParsedDelta:
        """End of output: everything held back is released."""
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> ParsedDelta:
        if self.reasoning is None:
            return self._answer(text, final)
        thinking, answer = self.reasoning.finish() if final else self.reasoning.feed(text)
        delta = self._answer(answer, final)
        if self.reasoning.format.thinking_in_content:
            delta.content = self._thinking_as_content(thinking) + delta.content
        else:
            delta.reasoning = self._trim_reasoning(thinking, ended=final or not self.reasoning.in_reasoning)
        return delta

    def _thinking_as_content(self, text: str) -> str:
        """The thinking as written, between the format's markers (the opening one also when the prompt wrote it);
        a thinking cut off mid-way stays open."""
        fmt, out = self.reasoning.format, text
        if not self._thinking_tags and self.reasoning.had_reasoning:
            out, self._thinking_tags = fmt.start + out, "open"
        if self._thinking_tags == "open" and not self.reasoning.in_reasoning:
            out, self._thinking_tags = out + fmt.end, "closed"
        return out

    def _answer(self, text: str, final: bool) -> ParsedDelta:
        if self.tools is None:
            content, calls = text, []
        elif final:
            content, calls = self.tools.feed(text)
            more, more_calls = self.tools.finish()
            content, calls = content + more, calls + more_calls
        else:
            content, calls = self.tools.feed(text)
        if not self._content_started:
            content = content.lstrip()
            self._content_started = bool(content)
        return ParsedDelta(content=content, tool_calls=calls if self.emit_tool_calls else [])

    def _trim_reasoning(self, text: str, ended: bool) -> str:
        """The thinking piece without leading whitespace and with its trailing whitespace held back; what is still
        held when the thinking has `ended` is dropped."""
        text = self._held_space + text
        if not self._reasoning_started:
            text = text.lstrip()
            self._reasoning_started = bool(text)
        kept = text.rstrip()
        self._held_space = "" if ended else text[len(kept):]
        return kept


def answer_drop(reasoning_name: str | None, drop: Iterable[str]) -> tuple[str, ...]:
    """What the parser chain drops from the answer text (the tool parser's `drop`): the special tokens `drop` and
    the thinking markers."""
    fmt = REASONING_FORMATS[reasoning_name] if reasoning_name else None
    return (*drop, fmt.start, fmt.end) if fmt else tuple(drop)


def build_output_parser(reasoning_name: str | None, tool_name: str | None, *, prompt_tail: str,
                        thinking_requested: bool | None, tools_active: bool, drop: Iterable[str],
                        tool_schemas: dict[str, dict] | None = None, constrained: bool = False) -> ChatOutputParser:
    """A fresh parser chain for one choice of one request; `drop` are special-token strings to keep out of the text
    (the thinking markers are also kept out of the answer, and the tool format's markers out of the thinking, where
    a model may write them whether or not tools are offered). `tool_schemas` (the offered tools' parameter schemas by
    name) type the arguments of formats that write them untyped (glm45). `constrained`: the engine holds the answer
    to a grammar from `</think>` on, so the thinking ends there only (a call opener inside it is thinking text, as
    the engine took it, and the constrained calls after it are the calls)."""
    fmt = REASONING_FORMATS[reasoning_name] if reasoning_name else None
    content_drop = answer_drop(reasoning_name, drop)
    tool_cls = TOOL_PARSERS[tool_name] if tool_name else ToolParser
    schemas = {"schemas": tool_schemas} if tool_cls.uses_schemas else {}
    tools = tool_cls(drop=content_drop, **schemas) if tool_name or content_drop else None
    reasoning = None
    if fmt is not None:
        mode = initial_mode(fmt, prompt_tail, thinking_requested)
        if constrained and fmt.inline_thinking is None:
            reasoning = ReasoningParser(fmt, mode, drop=(*drop, *tool_cls.markers, *fmt.implicit_ends), implicit=False)
        else:  # an inline-thinking format's constraints hold the thinking too: it ends where the format says
            reasoning = (fmt.parser or ReasoningParser)(fmt, mode, drop=(*drop, *tool_cls.markers),
                                                        extra_ends=tool_cls.start_markers if tools_active else ())
    return ChatOutputParser(reasoning, tools, emit_tool_calls=tools_active and tool_name is not None)
