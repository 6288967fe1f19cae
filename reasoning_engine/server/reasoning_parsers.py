"""Splitting generated text into the thinking (`reasoning_content`) and the answer (`content`).

One incremental parser serves every format; formats differ only in their markers and in where the thinking starts.
The starting state comes from the rendered prompt, not from the format's habits: Kimi's and DeepSeek-R1's templates
end the prompt with an open `<think>` (the output then begins inside the thinking and carries no opening tag),
Qwen3's model writes `<think>` itself, and a template that rendered `<think></think>` (thinking off) means everything
generated is answer. Streaming and non-streaming share this code: the full text is simply fed in one piece.

Each family's formats are declared with the rest of its chat format in `formats/`; a format whose thinking the
generic splitter cannot read (gpt-oss's harmony channels) names its own parser class.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from reasoning_engine.server.markers import MarkerSet

Mode = Literal["reasoning", "detect", "content"]


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


@dataclass(frozen=True)
class ReasoningFormat:
    """Markers of one model family's thinking section."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    # Markers that end the thinking and belong to the answer (Kimi may open a tool-call section without `</think>`).
    implicit_ends: tuple[str, ...] = ()
    # The model thinks first even when the prompt does not open `<think>` (DeepSeek-R1's older templates).
    starts_in_reasoning: bool = False
    # The thinking stays in the answer text, between its markers, instead of `reasoning_content` (vLLM's
    # `minimax_m2_append_think`): for clients that send the content back as the history, as MiniMax-M2 expects.
    thinking_in_content: bool = False
    # The parser that reads this format's thinking (None: `ReasoningParser`, the generic splitter).
    parser: type[ReasoningParser] | None = None
    # The engine cannot see where the thinking ends (no `</think>` token): a constraint holds the output from its
    # first token and lets the thinking through itself.
    inline_thinking: InlineThinking | None = None


def initial_mode(fmt: ReasoningFormat, prompt_tail: str, thinking_requested: bool | None) -> Mode:
    """Where the output starts: inside the thinking, at a possible `<think>`, or directly in the answer.

    `thinking_requested` is the request's explicit switch (chat_template_kwargs thinking/enable_thinking), None when
    the request did not say. `prompt_tail` is the end of the rendered prompt."""
    if thinking_requested is False:
        return "content"
    tail = prompt_tail.rstrip()
    if tail.endswith(fmt.start):
        return "reasoning"
    if tail.endswith(fmt.end):
        return "content"
    return "reasoning" if fmt.starts_in_reasoning else "detect"


class ReasoningParser:
    """Incremental splitter: `feed` text pieces, get (reasoning, content) pieces back; `finish` flushes.

    `extra_ends` are further markers that end the thinking and stay in the answer text (the active tool parser's
    call openers, so a call that starts inside the thinking still reaches the tool parser). `drop` are marker strings
    (special tokens) removed from the thinking. `implicit`: the format's implicit ends end the thinking too."""

    def __init__(self, fmt: ReasoningFormat, mode: Mode, extra_ends: Iterable[str] = (),
                 drop: Iterable[str] = (), implicit: bool = True) -> None:
        self.format = fmt
        self.mode: Mode = mode
        self.had_reasoning = mode == "reasoning"
        self._ends = (*(fmt.implicit_ends if implicit else ()), *extra_ends)
        self._markers = MarkerSet([fmt.start, fmt.end, *self._ends, *drop])
        self._buf = ""

    @property
    def in_reasoning(self) -> bool:
        return self.mode == "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self.mode == "detect":
                stripped = self._buf.lstrip()
                if stripped.startswith(self.format.start):
                    self._buf = stripped[len(self.format.start):]
                    self.mode = "reasoning"
                    self.had_reasoning = True
                    continue
                if not stripped or self.format.start.startswith(stripped):
                    break  # could still become `<think>`
                self.mode = "content"
            if self.mode == "content":
                content.append(self._buf)
                self._buf = ""
                break
            before, marker, after = self._markers.split(self._buf)
            reasoning.append(before)
            self._buf = after
            if marker is None:
                break
            if marker == self.format.end:
                self.mode = "content"
            elif marker in self._ends:
                self.mode = "content"
                self._buf = marker + after
            # any other marker (a repeated `<think>`, a special token) is dropped from the thinking
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Release what was held back: an unfinished thinking stays thinking, an undecided start is answer."""
        rest, self._buf = self._buf, ""
        if self.mode == "reasoning":
            return rest, ""
        return "", rest
