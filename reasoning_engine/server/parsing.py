"""The per-choice output pipeline: reasoning splitter, then tool-call extraction on the answer part; and the
`auto` choice of parsers from the model.

Text flows: engine text delta -> ReasoningParser -> (thinking, answer text) -> ToolParser -> (answer, call deltas).
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass, field

from reasoning_engine.server.reasoning_parsers import (
    REASONING_FORMATS,
    HarmonyReasoningParser,
    ReasoningParser,
    initial_mode,
)
from reasoning_engine.server.tool_parsers import TOOL_PARSERS, ToolCall, ToolCallDelta, ToolParser

_KIMI_VOCAB_MARKERS = ("<|tool_calls_section_begin|>", "<|im_middle|>")
# Qwen3-Next, Qwen3.5 / 3.6: `<think>` reasoning (their templates open it in the prompt when thinking)
_QWEN_THINKING_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# Qwen3.5 / 3.6 write Qwen3-Coder's XML calls; Qwen3-Next (and Qwen3) say which format in their template
_QWEN_XML_CALL_TYPES = ("qwen3_5", "qwen3_5_moe")
_QWEN_XML_TEMPLATE_TAGS = ("<function=", "<parameter=")


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def resolve_reasoning_parser(name: str, model_type: str, vocab: Container[str]) -> str | None:
    """`auto`: Kimi's chat tokens mean kimi_k2 (Kimi Linear included); Qwen3-Next and Qwen3.5 / 3.6 the Qwen3 one;
    otherwise any model with `</think>` in its vocabulary gets the DeepSeek-R1 parser for DeepSeek families and the
    Qwen3 one (which detects an opening `<think>`) for the rest."""
    if name != "auto":
        return None if name == "none" else name
    if model_type.startswith("kimi") or any(m in vocab for m in _KIMI_VOCAB_MARKERS):
        return "kimi_k2"
    if model_type == "gpt_oss":  # harmony: no `</think>`, the thinking is the analysis channel
        return "gpt_oss"
    if model_type in _QWEN_THINKING_TYPES:
        return "qwen3"
    if "</think>" not in vocab:
        return None
    if model_type.startswith("glm"):
        return "glm45"
    if model_type.startswith("minimax"):
        return "minimax_m2"
    if model_type == "deepseek_v32":
        return "deepseek_v3"
    return "deepseek_r1" if model_type.startswith("deepseek") else "qwen3"


def resolve_tool_parser(name: str, model_type: str, vocab: Container[str], chat_template: str | None) -> str | None:
    """`auto`: Kimi's call tokens mean kimi_k2 (Kimi Linear included), GLM's `<arg_key>` glm45, Qwen3.5 / 3.6 or a
    template that writes `<function=` and `<parameter=` (Qwen3-Coder, Qwen3-Coder-Next) qwen3_coder, a `<tool_call>` token or template
    mention hermes (Qwen3, Qwen3-Next, whose templates write JSON calls)."""
    if name != "auto":
        return None if name == "none" else name
    if model_type.startswith("kimi") or "<|tool_call_begin|>" in vocab:
        return "kimi_k2"
    if model_type == "gpt_oss":
        return "gpt_oss"
    if model_type.startswith("glm") or "<arg_key>" in vocab:
        return "glm45"
    if model_type.startswith("minimax") or "<minimax:tool_call>" in vocab:
        return "minimax_m2"
    if model_type.startswith("deepseek"):
        # V3.1's template (kept by V3.2-Exp) writes NAME<｜tool▁sep｜>{json}; V3-0324's and R1-0528's
        # `function<｜tool▁sep｜>NAME` and a json fence; V3.2 itself ships no template and writes DSML
        template = chat_template or ""
        if "<｜tool▁call▁begin｜>" in template:
            return "deepseek_v3" if "```json" in template else "deepseek_v31"
        if model_type == "deepseek_v32":
            return "deepseek_v32"
    if model_type in _QWEN_XML_CALL_TYPES or all(tag in (chat_template or "") for tag in _QWEN_XML_TEMPLATE_TAGS):
        return "qwen3_coder"
    if "<tool_call>" in vocab or "<tool_call>" in (chat_template or ""):
        return "hermes"
    return None


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
        if fmt.name == "gpt_oss":  # its constraints hold the thinking too (tool_grammar.InlineThinking)
            reasoning = HarmonyReasoningParser(fmt, mode, extra_ends=tool_cls.start_markers if tools_active else (),
                                               drop=(*drop, *tool_cls.markers))
        elif constrained:
            reasoning = ReasoningParser(fmt, mode, drop=(*drop, *tool_cls.markers, *fmt.implicit_ends), implicit=False)
        else:
            reasoning = ReasoningParser(fmt, mode, extra_ends=tool_cls.start_markers if tools_active else (),
                                        drop=(*drop, *tool_cls.markers))
    return ChatOutputParser(reasoning, tools, emit_tool_calls=tools_active and tool_name is not None)
