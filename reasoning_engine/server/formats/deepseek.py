"""DeepSeek's formats. Thinking: `deepseek_r1` (R1: the model thinks first even when the prompt does not open
`<think>`) and `deepseek_v3` (V3.1 / V3.2: the prompt opens `<think>` when thinking, `thinking: true` in
chat_template_kwargs, or ends with `</think>`, their default; the output is never assumed to start thinking).
Calls:
- deepseek_v3 (DeepSeek-V3-0324, R1-0528): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  \n```json\n{json}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`, calls a newline apart in the grammar.
- deepseek_v31 (DeepSeek-V3.1, V3.2-Exp): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`.
- deepseek_v32 (DeepSeek-V3.2's DSML): `\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="NAME">\n<｜DSML｜parameter
  name="K" string="true|false">V</｜DSML｜parameter>...</｜DSML｜invoke>\n</｜DSML｜function_calls>`: a raw string value
  (`true`) or JSON (`false`); the grammar writes parameters and invokes one a line, as V3.2's encoding does.
- deepseek_v4 (DeepSeek-V4-Flash / Pro): V3.2's DSML invokes and parameters in a `<｜DSML｜tool_calls>` block instead
  of `<｜DSML｜function_calls>` (the release's encoding/encoding_dsv4.py and its README; vLLM's `deepseek_v4` tool
  parser says the same). Its thinking is V3.2's: `deepseek_v4` names the same reasoning format as `deepseek_v3`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from reasoning_engine.server.formats.base import CallSyntax, Family, ModelTraits, ToolFormat, xml_arguments
from reasoning_engine.server.reasoning_parsers import ReasoningFormat
from reasoning_engine.server.tool_parsers import InvokeTagsToolParser, MarkerStateParser, new_call_id

DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
DEEPSEEK_SEP = "<｜tool▁sep｜>"


class DeepSeekV31ToolParser(MarkerStateParser):
    """DeepSeek-V3.1 (and V3.2-Exp, whose template keeps it): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME
    <｜tool▁sep｜>{json}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`. The JSON arguments stream as written (a call
    without any is given `{}`); text between calls is dropped.

    States: text -> calls (between calls) -> header (the name) -> args -> calls -> text; `skip` drops a call
    without a name."""

    start_markers = (DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALL_BEGIN)
    markers = (DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END, DEEPSEEK_CALL_BEGIN, DEEPSEEK_SEP, DEEPSEEK_CALL_END)

    def _on_marker(self, marker: str) -> None:
        if marker == DEEPSEEK_CALLS_BEGIN and self._state == "text":
            self._state = "calls"
        elif marker == DEEPSEEK_CALL_BEGIN:
            self._end_call()
            self._state, self._header = "header", ""
        elif marker == DEEPSEEK_SEP and self._state == "header":
            self._after_separator()
        elif marker == DEEPSEEK_CALL_END:
            self._end_call()
        elif marker == DEEPSEEK_CALLS_END:
            self._end_call()
            self._state = "text"

    def _after_separator(self) -> None:
        """The text before the separator was the name: open the call; its arguments follow."""
        name = self._header.strip()
        if name:
            self._open_call(new_call_id(), name)
        self._state = "args" if name else "skip"

    def _end_call(self) -> None:
        """Close the call in progress (if any) and go between calls."""
        if self._state == "args" and not self.calls[-1].arguments:
            self._add_arguments("{}")
        if self._state != "text":
            self._state = "calls"

DSML_CALLS_BEGIN, DSML_CALLS_END = "<｜DSML｜function_calls>", "</｜DSML｜function_calls>"
DSML_INVOKE_BEGIN, DSML_INVOKE_END = "<｜DSML｜invoke name=", "</｜DSML｜invoke>"
DSML_PARAMETER_BEGIN, DSML_PARAMETER_END = "<｜DSML｜parameter name=", "</｜DSML｜parameter>"
DSML_V4_CALLS_BEGIN, DSML_V4_CALLS_END = "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"
_DSML_HEADER = re.compile(r'\s*"(?P<name>[^"]*)"(?:\s+string="(?P<string>true|false)")?\s*')


class DeepSeekV3ToolParser(DeepSeekV31ToolParser):
    """DeepSeek-V3 and R1 (V3-0324's and R1-0528's templates): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function
    <｜tool▁sep｜>NAME\n```json\n{json}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`: the call's type before the
    separator, its name on a line after it, the arguments in a json fence. The fence is stripped while the arguments
    stream, so their last few characters wait for the next piece (they may be the closing fence).

    States: text -> calls -> header (here the type) -> head (the name line) -> args -> calls -> text; `skip` drops a
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
        self._open_call(new_call_id(), name.strip())
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


class DeepSeekV32ToolParser(InvokeTagsToolParser):
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


class DeepSeekV4ToolParser(DeepSeekV32ToolParser):
    """DeepSeek-V4's DSML: V3.2's invokes and parameters, read the same way, in a `<｜DSML｜tool_calls>` ...
    `</｜DSML｜tool_calls>` block."""

    start_markers = (DSML_V4_CALLS_BEGIN,)
    markers = (DSML_V4_CALLS_BEGIN, DSML_V4_CALLS_END)


def _auto_reasoning(model: ModelTraits) -> str | None:
    if not model.model_type.startswith("deepseek") or "</think>" not in model.vocab:
        return None
    return {"deepseek_v32": "deepseek_v3", "deepseek_v4": "deepseek_v4"}.get(model.model_type, "deepseek_r1")


def _auto_tools(model: ModelTraits) -> str | None:
    """V3.1's template (kept by V3.2-Exp) writes NAME<｜tool▁sep｜>{json}; V3-0324's and R1-0528's
    `function<｜tool▁sep｜>NAME` and a json fence; V3.2 and V4 ship no template and write DSML, V4 in a
    `tool_calls` block."""
    if not model.model_type.startswith("deepseek"):
        return None
    if DEEPSEEK_CALL_BEGIN in model.chat_template:
        return "deepseek_v3" if "```json" in model.chat_template else "deepseek_v31"
    return {"deepseek_v32": "deepseek_v32", "deepseek_v4": "deepseek_v4"}.get(model.model_type)


def _dsml_syntax(block_begin: str, block_end: str) -> CallSyntax:
    """DSML calls in a block between these tags: the arguments as `<｜DSML｜parameter name="K" string="true|false">V
    </｜DSML｜parameter>` lines, strings raw (`true`), other values JSON (`false`); the block after a blank line."""
    return CallSyntax(trigger=block_begin, open=f"{block_begin}\n", close=f"\n{block_end}", separator="\n",
                      call_end=f"\n{DSML_INVOKE_END}", begin=lambda name: f'{DSML_INVOKE_BEGIN}"{name}">\n',
                      content=xml_arguments("deepseek_xml"), lead="\n\n")


FAMILY = Family(
    reasoning={"deepseek_r1": ReasoningFormat("deepseek_r1", starts_in_reasoning=True),
               "deepseek_v3": ReasoningFormat("deepseek_v3"),
               "deepseek_v4": ReasoningFormat("deepseek_v4")},  # V3.2's thinking, by the name vLLM's flag takes
    tools={
        # V3-0324's and R1-0528's header: the call's type, the name on its own line, a json fence
        "deepseek_v3": ToolFormat(DeepSeekV3ToolParser, CallSyntax(
            trigger=DEEPSEEK_CALLS_BEGIN, open=DEEPSEEK_CALLS_BEGIN, close=DEEPSEEK_CALLS_END, separator="\n",
            call_end=f"\n```{DEEPSEEK_CALL_END}",
            begin=lambda name: f"{DEEPSEEK_CALL_BEGIN}function{DEEPSEEK_SEP}{name}\n```json\n")),
        "deepseek_v31": ToolFormat(DeepSeekV31ToolParser, CallSyntax(
            trigger=DEEPSEEK_CALLS_BEGIN, open=DEEPSEEK_CALLS_BEGIN, close=DEEPSEEK_CALLS_END, separator="",
            call_end=DEEPSEEK_CALL_END, begin=lambda name: f"{DEEPSEEK_CALL_BEGIN}{name}{DEEPSEEK_SEP}")),
        "deepseek_v32": ToolFormat(DeepSeekV32ToolParser, _dsml_syntax(DSML_CALLS_BEGIN, DSML_CALLS_END)),
        "deepseek_v4": ToolFormat(DeepSeekV4ToolParser, _dsml_syntax(DSML_V4_CALLS_BEGIN, DSML_V4_CALLS_END)),
    },
    auto_reasoning=_auto_reasoning,
    auto_tools=_auto_tools,
)
