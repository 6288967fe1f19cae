"""gpt-oss's harmony format (OpenAI, "OpenAI Harmony Response Format"): the output is messages
`<|start|>assistant<|channel|>CHANNEL ...<|message|>BODY` ended by `<|end|>`, `<|call|>` or `<|return|>`. The thinking
is every message on the analysis channel; a call is a commentary message with a recipient,
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{json}<|call|>`; final and preamble messages are
content. There is no `</think>` for the engine to wait for, so its constraints hold the thinking too
(`InlineThinking`): calls or an answer format come after any analysis messages, the answer in a final message.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from reasoning_engine.server.formats.base import CallSyntax, Family, ModelTraits, ToolFormat
from reasoning_engine.server.markers import MarkerSet
from reasoning_engine.server.reasoning_parsers import InlineThinking, Mode, ReasoningFormat, ReasoningParser
from reasoning_engine.server.tool_parsers import MarkerStateParser, new_call_id

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


_HARMONY_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyToolParser(MarkerStateParser):
    """gpt-oss's harmony messages (see `HarmonyReasoningParser`, which hands over every message but
    the analysis ones whole): a message with a recipient (`to=functions.NAME`, in the header before or after the
    channel) is a call whose body is its JSON arguments, streamed as they come; the final channel and commentary
    without a recipient (a preamble) are content; an analysis message (reasoning parsing off) is dropped. Text
    outside any message is content.

    States: text -> header -> args (a call's body), text (final or preamble) or skip (an analysis body, dropped)."""

    markers = HARMONY_MARKERS

    def _on_marker(self, marker: str) -> None:
        if marker == HARMONY_START or (marker == HARMONY_CHANNEL and self._state == "text"):
            self._state, self._header = "header", "" if marker == HARMONY_START else marker
        elif self._state == "header" and marker in (HARMONY_CHANNEL, HARMONY_CONSTRAIN):
            self._header += marker
        elif self._state == "header" and marker == HARMONY_MESSAGE:
            recipient = _HARMONY_RECIPIENT.search(self._header)
            if recipient:
                self._open_call(new_call_id(), recipient.group(1).removeprefix("functions."))
                self._state = "args"
            else:
                self._state = "skip" if harmony_channel(self._header) == "analysis" else "text"
        elif marker in HARMONY_ENDS:
            self._state = "text"


def _call_begin(name: str) -> str:
    """The header gpt-oss writes for a call (the one the harmony guide shows); the recipient-first form
    ` to=functions.NAME<|channel|>commentary json` is not offered."""
    return f"{HARMONY_CHANNEL}commentary to=functions.{name} {HARMONY_CONSTRAIN}json{HARMONY_MESSAGE}"


_HARMONY_END = HARMONY_ENDS[0]  # `<|end|>`: a message that does not end the turn
# the prompt ends with `<|start|>assistant`, so each message is its channel header, its body and its end, and
# `<|start|>assistant` opens the next one; an analysis body holds no other harmony marker
_THINKING = InlineThinking(
    message={"type": "sequence", "elements": [
        {"type": "tag", "begin": f"{HARMONY_CHANNEL}analysis{HARMONY_MESSAGE}",
         "content": {"type": "any_text", "excludes": [m for m in HARMONY_MARKERS if m != _HARMONY_END]},
         "end": _HARMONY_END},
        {"type": "const_string", "value": f"{HARMONY_START}assistant"}]},
    answer_begin=f"{HARMONY_CHANNEL}final{HARMONY_MESSAGE}")


def _auto(model: ModelTraits) -> str | None:
    return "gpt_oss" if model.model_type == "gpt_oss" else None


FAMILY = Family(
    reasoning={"gpt_oss": ReasoningFormat("gpt_oss", start=f"{HARMONY_CHANNEL}analysis{HARMONY_MESSAGE}",
                                          end=_HARMONY_END, parser=HarmonyReasoningParser, inline_thinking=_THINKING)},
    tools={"gpt_oss": ToolFormat(HarmonyToolParser, CallSyntax(
        trigger=f"{HARMONY_CHANNEL}commentary to=functions.", open="", close="", separator="", call_end="",
        begin=_call_begin, ends_turn=True))},
    auto_reasoning=_auto,
    auto_tools=_auto,
)
