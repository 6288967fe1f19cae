"""DeepSeek-V3.1 / V3.2 output parsers as pure units (tests/server/test_parsers.py's pattern): thinking on and off,
then V3.1's tool-call tokens or V3.2's DSML blocks, fed every way a stream can split the text."""

from __future__ import annotations

import json
from typing import Any

from reasoning_engine.server.parsing import resolve_reasoning_parser, resolve_tool_parser

from . import test_parsers as parsers
from .test_parsers import Result

EOS = "<｜end▁of▁sentence｜>"
V31_MARKERS = ["<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
               "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", EOS]
DSML_MARKERS = ["<think>", "</think>", "<｜DSML｜function_calls>", "</｜DSML｜function_calls>", "<｜DSML｜invoke",
                "</｜DSML｜invoke>", "<｜DSML｜parameter", "</｜DSML｜parameter>", EOS]


def v31_calls(*calls: tuple[str, dict]) -> str:
    body = "".join(f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{json.dumps(args, ensure_ascii=False)}<｜tool▁call▁end｜>"
                   for name, args in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>{EOS}"


def dsml_invoke(name: str, **params: tuple[str, bool]) -> str:
    """params: value text and whether it is a raw string (string="true")."""
    body = "".join(f'<｜DSML｜parameter name="{k}" string="{str(raw).lower()}">{v}</｜DSML｜parameter>\n'
                   for k, (v, raw) in params.items())
    return f'<｜DSML｜invoke name="{name}">\n{body}</｜DSML｜invoke>\n'


def dsml_block(*invokes: str) -> str:
    return "\n\n<｜DSML｜function_calls>\n" + "".join(invokes) + f"</｜DSML｜function_calls>{EOS}"


def run(pieces: list[str], reasoning: str, tool: str, **kwargs: Any) -> Result:
    return parsers.run(pieces, reasoning, tool, drop=(EOS,), **kwargs)


def check_all(text: str, reasoning: str, tool: str, markers: list[str], **kwargs: Any) -> Result:
    return parsers.check_all(text, reasoning, tool, markers, drop=(EOS,), **kwargs)


def test_v31_thinking_then_two_calls() -> None:
    text = ("The user wants weather for two cities.</think>Let me check." +
            v31_calls(("get_weather", {"city": "杭州", "unit": "celsius"}), ("get_time", {})))
    r = check_all(text, "deepseek_v3", "deepseek_v31", V31_MARKERS, prompt_tail="<｜Assistant｜><think>")
    assert r.reasoning == "The user wants weather for two cities."
    assert r.content == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in r.calls] == [
        ("get_weather", {"city": "杭州", "unit": "celsius"}), ("get_time", {})]
    assert all(c["id"].startswith("call_") for c in r.calls)


def test_v31_thinking_off_is_all_content() -> None:
    text = "No need to think: 4.<think>not thinking</think>" + v31_calls(("calc", {"x": 1}))
    for tail, thinking in (("<｜Assistant｜></think>", None), ("<｜Assistant｜><think>", False)):
        r = check_all(text, "deepseek_v3", "deepseek_v31", V31_MARKERS, prompt_tail=tail, thinking=thinking)
        assert r.reasoning == ""
        assert r.content == "No need to think: 4.not thinking"
        assert [c["name"] for c in r.calls] == ["calc"]


def test_v31_call_starting_inside_thinking_and_without_tools() -> None:
    text = "I will call it" + v31_calls(("calc", {"expression": "2+2"}))
    r = check_all(text, "deepseek_v3", "deepseek_v31", V31_MARKERS, prompt_tail="<think>")
    assert (r.reasoning, r.content) == ("I will call it", "")
    assert r.calls[0]["arguments"] == '{"expression": "2+2"}'
    r = run([text], "deepseek_v3", "deepseek_v31", prompt_tail="</think>", tools_active=False)
    assert (r.content, r.calls) == ("I will call it", [])


def test_v32_dsml_calls_typed_by_the_string_attribute() -> None:
    text = ("Weather first.</think>I'll look it up." + dsml_block(
        dsml_invoke("get_weather", location=('He said "hi"\n<b>', True), days=("3", False), hourly=("true", False),
                    filters=('{"min": 1.5, "tags": ["a", "b"]}', False), note=("not json {", False)),
        dsml_invoke("get_time")))
    r = check_all(text, "deepseek_v3", "deepseek_v32", DSML_MARKERS, prompt_tail="<｜Assistant｜><think>")
    assert r.reasoning == "Weather first."
    assert r.content == "I'll look it up.\n\n"  # the encoding's blank line before the block is the model's text
    assert [c["name"] for c in r.calls] == ["get_weather", "get_time"]
    assert json.loads(r.calls[0]["arguments"]) == {"location": 'He said "hi"\n<b>', "days": 3, "hourly": True,
                                                   "filters": {"min": 1.5, "tags": ["a", "b"]}, "note": "not json {"}
    assert r.calls[1]["arguments"] == "{}"


def test_v32_dsml_tags_outside_a_block_are_text_and_cut_calls_keep_what_streamed() -> None:
    r = check_all('Use <｜DSML｜invoke name="x"> like this.', "deepseek_v3", "deepseek_v32", [],
                  prompt_tail="</think>")
    assert r.content == 'Use <｜DSML｜invoke name="x"> like this.' and r.calls == []
    cut = '<｜DSML｜function_calls>\n<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="q" string="true">dee'
    r = run([cut], "deepseek_v3", "deepseek_v32", prompt_tail="</think>")
    assert r.calls[0]["name"] == "search" and json.loads(r.calls[0]["arguments"]) == {"q": "dee"}


def test_auto_selection() -> None:
    vocab = {"<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"}
    v31_template = "{{'<｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>'}}"
    v3_template = "{{'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n```json\\n'}}"
    assert resolve_reasoning_parser("auto", "deepseek_v32", vocab) == "deepseek_v3"
    assert resolve_reasoning_parser("auto", "deepseek_v3", vocab) == "deepseek_r1"
    assert resolve_tool_parser("auto", "deepseek_v3", vocab, v31_template) == "deepseek_v31"
    assert resolve_tool_parser("auto", "deepseek_v32", vocab, v31_template) == "deepseek_v31"  # V3.2-Exp
    assert resolve_tool_parser("auto", "deepseek_v32", vocab, None) == "deepseek_v32"
    assert resolve_tool_parser("auto", "deepseek_v3", vocab, v3_template) is None
    assert resolve_reasoning_parser("auto", "glm_moe_dsa", {"</think>"}) == "glm45"
    assert resolve_tool_parser("auto", "glm_moe_dsa", set(), None) == "glm45"
