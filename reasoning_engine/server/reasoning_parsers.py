"""Splitting generated text into the thinking (`reasoning_content`) and the answer (`content`).

One incremental parser serves every format; formats differ only in their markers and in where the thinking starts.
The starting state comes from the rendered prompt, not from the format's habits: Kimi's and DeepSeek-R1's templates
end the prompt with an open `<think>` (the output then begins inside the thinking and carries no opening tag),
Qwen3's model writes `<think>` itself, and a template that rendered `<think></think>` (thinking off) means everything
generated is answer. Streaming and non-streaming share this code: the full text is simply fed in one piece.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from reasoning_engine.server.markers import MarkerSet

Mode = Literal["reasoning", "detect", "content"]

KIMI_TOOL_SECTION_BEGINS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")


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


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "kimi_k2": ReasoningFormat("kimi_k2", implicit_ends=KIMI_TOOL_SECTION_BEGINS),
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_in_reasoning=True),
    "qwen3": ReasoningFormat("qwen3"),
    # GLM-4.5 / 4.6 write `<think>` themselves (detected), GLM-4.7's prompt opens it; thinking off renders
    # `<think></think>`: Qwen3's markers, under the name vLLM and SGLang give it
    "glm45": ReasoningFormat("glm45"),
    # MiniMax-M2's prompt opens `<think>`: the output starts inside the thinking
    "minimax_m2": ReasoningFormat("minimax_m2"),
    "minimax_m2_append_think": ReasoningFormat("minimax_m2_append_think", thinking_in_content=True),
    # DeepSeek-V3.1 / V3.2: the prompt opens `<think>` (thinking, `thinking: true` in chat_template_kwargs) or ends
    # with `</think>` (thinking off, their default); unlike R1 the output is never assumed to start thinking
    "deepseek_v3": ReasoningFormat("deepseek_v3"),
    # gpt-oss's harmony format: the thinking is every message on the analysis channel (`HarmonyReasoningParser`)
    "gpt_oss": ReasoningFormat("gpt_oss", start="<|channel|>analysis<|message|>", end="<|end|>"),
}

REASONING_PARSER_CHOICES = (*REASONING_FORMATS, "auto", "none")


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


HARMONY_START, HARMONY_CHANNEL, HARMONY_MESSAGE, HARMONY_CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
HARMONY_MARKERS = (HARMONY_START, HARMONY_CHANNEL, HARMONY_MESSAGE, HARMONY_CONSTRAIN, *HARMONY_ENDS)
_HARMONY_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([^\s<]+)")


def harmony_channel(header: str) -> str:
    """The channel a harmony message header names (`assistant<|channel|>commentary to=functions.f <|constrain|>json`
    -> "commentary"); "" when it names none."""
    match = _HARMONY_CHANNEL_NAME.search(header)
    return match.group(1) if match else ""


class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss's harmony output (OpenAI, "OpenAI Harmony Response Format"): messages `<|start|>ROLE<|channel|>CH ...
    <|message|>BODY` ended by `<|end|>`, `<|call|>` or `<|return|>`; the prompt ends with `<|start|>assistant`, so
    the output opens with the first message's header. Bodies on the analysis channel are the thinking, wherever they
    come; every other message (final answer, commentary preamble or tool call) goes to the answer side whole, header
    and end marker included, for the tool parser to read. The openai-harmony package would do this with the model's
    o200k vocabulary, which it downloads on first use; this parser needs only the text."""

    def __init__(self, fmt: ReasoningFormat, mode: Mode, extra_ends: Iterable[str] = (),
                 drop: Iterable[str] = ()) -> None:
        super().__init__(fmt, mode, extra_ends, drop)
        self._markers = MarkerSet([*HARMONY_MARKERS, *drop])
        # a prompt that opened an analysis body (continue_final_message) starts in it; otherwise at a header
        self._state = "analysis" if mode == "reasoning" else "header"
        self._header = ""
        self._plain = True  # no marker seen yet: a model that writes no harmony at all gives plain answer text

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            before, marker, self._buf = self._markers.split(self._buf)
            if self._state == "header":
                self._header += before
            else:
                (reasoning if self._state == "analysis" else content).append(before)
            if marker is None:
                break
            self._on_marker(marker, reasoning, content)
        return "".join(reasoning), "".join(content)

    def _on_marker(self, marker: str, reasoning: list[str], content: list[str]) -> None:
        self._plain = False
        if marker == HARMONY_START:
            self._state, self._header, self.mode = "header", "", "detect"
        elif self._state == "header" and marker in (HARMONY_CHANNEL, HARMONY_CONSTRAIN):
            self._header += marker
        elif self._state == "header" and marker == HARMONY_MESSAGE:
            if harmony_channel(self._header) == "analysis":
                if self.had_reasoning:  # a later analysis message: its own paragraph
                    reasoning.append("\n\n")
                self._state, self.mode, self.had_reasoning = "analysis", "reasoning", True
            else:
                self._state, self.mode = "other", "content"
                content.append(HARMONY_START + self._header + HARMONY_MESSAGE)
        elif marker in HARMONY_ENDS and self._state != "header":
            if self._state == "other":
                content.append(marker)
            self._state, self._header, self.mode = "header", "", "detect"
        # anything else (a special token, a header marker inside a body) is dropped

    def finish(self) -> tuple[str, str]:
        """An unfinished analysis body stays thinking; text that never became a header (no harmony markers at all)
        is answer; a header cut off before its body is dropped."""
        rest, self._buf = self._buf, ""
        if self._state == "analysis":
            return rest, ""
        if self._state == "header":
            header, self._header = self._header + rest, ""
            return "", header if self._plain else ""
        return "", rest
