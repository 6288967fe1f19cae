"""DeepSeek-V3.1 / V3.2 / V4 output parsers as pure units (tests/server/test_parsers.py's pattern): thinking on and
off, then V3.1's tool-call tokens or V3.2's and V4's DSML blocks, fed every way a stream can split the text."""

from __future__ import annotations

import json
from typing import Any

import pytest

from reasoning_engine.server.formats.registry import resolve_reasoning_parser, resolve_tool_parser

from . import test_parsers as parsers
from .test_parsers import Result

EOS = "<｜end▁of▁sentence｜>"
V31_MARKERS = ["<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
               "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", EOS]
DSML_MARKERS = ["<think>", "</think>", "<｜DSML｜function_calls>", "</｜DSML｜function_calls>", "<｜DSML｜invoke",
                "</｜DSML｜invoke>", "<｜DSML｜parameter", "</｜DSML｜parameter>", EOS]
DSML_V4_MARKERS = [*DSML_MARKERS[:2], "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", *DSML_MARKERS[4:]]


def v3_calls(*calls: tuple[str, str]) -> str:
    """DeepSeek-V3-0324 / R1-0528's calls as their templates write them: arguments text in a json fence."""
    body = "\n".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
                     for name, args in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>{EOS}"


def v31_calls(*calls: tuple[str, dict]) -> str:
    body = "".join(f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{json.dumps(args, ensure_ascii=False)}<｜tool▁call▁end｜>"
                   for name, args in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>{EOS}"


def dsml_invoke(name: str, **params: tuple[str, bool]) -> str:
    """params: value text and whether it is a raw string (string="true")."""
    body = "".join(f'<｜DSML｜parameter name="{k}" string="{str(raw).lower()}">{v}</｜DSML｜parameter>\n'
                   for k, (v, raw) in params.items())
    return f'<｜DSML｜invoke name="{name}">\n{body}</｜DSML｜invoke>\n'


def dsml_block(*invokes: str, block: str = "function_calls") -> str:
    """V3.2's block (`function_calls`), or V4's (`tool_calls`)."""
    return f"\n\n<｜DSML｜{block}>\n" + "".join(invokes) + f"</｜DSML｜{block}>{EOS}"


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
    assert resolve_tool_parser("auto", "deepseek_v3", vocab, v3_template) == "deepseek_v3"
    assert resolve_reasoning_parser("auto", "glm_moe_dsa", {"</think>"}) == "glm45"
    assert resolve_tool_parser("auto", "glm_moe_dsa", set(), None) == "glm45"


def test_v4_dsml_calls_in_a_tool_calls_block() -> None:
    """DeepSeek-V4 writes V3.2's invokes in a `tool_calls` block: typed the same way, however the stream splits;
    V3.2's `function_calls` block is text to V4's parser, and V4's is text to V3.2's."""
    calls = (dsml_invoke("get_weather", city=("Paris <b>\n", True), days=("2", False), tags=('["a"]', False)),
             dsml_invoke("get_time"))
    text = "Weather first.</think>Checking." + dsml_block(*calls, block="tool_calls")
    r = check_all(text, "deepseek_v4", "deepseek_v4", DSML_V4_MARKERS, prompt_tail="<｜Assistant｜><think>")
    assert (r.reasoning, r.content) == ("Weather first.", "Checking.\n\n")
    assert [(c["name"], json.loads(c["arguments"])) for c in r.calls] == [
        ("get_weather", {"city": "Paris <b>\n", "days": 2, "tags": ["a"]}), ("get_time", {})]
    v32 = "Checking." + dsml_block(*calls)
    assert run([v32], "deepseek_v4", "deepseek_v4", prompt_tail="</think>").calls == []
    assert run([text], "deepseek_v3", "deepseek_v32", prompt_tail="<think>").calls == []
    # thinking off: all content, the calls still parsed; a call cut off keeps what streamed
    r = run(["No thinking.<think>x</think>" + dsml_block(calls[1], block="tool_calls")], "deepseek_v4",
            "deepseek_v4", prompt_tail="<｜Assistant｜><think>", thinking=False)
    assert (r.reasoning, r.content, [c["name"] for c in r.calls]) == ("", "No thinking.x\n\n", ["get_time"])
    cut = '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="q" string="true">dee'
    r = run([cut], "deepseek_v4", "deepseek_v4", prompt_tail="</think>")
    assert r.calls[0]["name"] == "search" and json.loads(r.calls[0]["arguments"]) == {"q": "dee"}


def test_auto_picks_v4s_formats() -> None:
    """A deepseek_v4 checkpoint (no chat template, as released): V4's DSML calls and V3.2's thinking."""
    vocab = {"<think>", "</think>", "<｜User｜>", "<｜Assistant｜>"}
    assert resolve_reasoning_parser("auto", "deepseek_v4", vocab) == "deepseek_v4"
    assert resolve_tool_parser("auto", "deepseek_v4", vocab, None) == "deepseek_v4"
    assert resolve_tool_parser("auto", "deepseek_v32", vocab, None) == "deepseek_v32"


def test_v3_fenced_calls_stream_without_their_fences() -> None:
    """R1-0528 thinks, then calls with a json fence around each call's arguments; every split of the stream gives
    the same calls, and no fence reaches the arguments (the last characters wait in case they are the fence)."""
    text = ("Two lookups.</think>Checking." +
            v3_calls(("get_weather", '{"city": "Paris ```", "days": 2}'), ("get_time", ""), ("calc", "{}")))
    r = check_all(text, "deepseek_r1", "deepseek_v3", V31_MARKERS, prompt_tail="<｜Assistant｜><think>\n")
    assert (r.reasoning, r.content) == ("Two lookups.", "Checking.")
    assert [(c["name"], json.loads(c["arguments"])) for c in r.calls] == [
        ("get_weather", {"city": "Paris ```", "days": 2}), ("get_time", {}), ("calc", {})]
    cut = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{\"q\": \"dee"
    r = run([cut], "deepseek_r1", "deepseek_v3", prompt_tail="</think>")
    assert r.calls[0]["name"] == "search" and r.calls[0]["arguments"] == '{"q": "dee'


PARAMETERS = {"get_weather": {"type": "object", "required": ["city", "days"], "properties": {
    "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}},
    "search": {"type": "object", "required": ["query"], "properties": {"query": {"type": "string"}}}}


def written(fmt: str, *calls: tuple[str, dict]) -> str:
    """The calls as the format's encoding writes them (no end-of-sentence token: a stop token, outside the grammar);
    DSML parameters one a line, strings raw."""
    if fmt == "deepseek_v3":
        return v3_calls(*((name, json.dumps(args, ensure_ascii=False)) for name, args in calls)).removesuffix(EOS)
    if fmt == "deepseek_v31":
        return v31_calls(*calls).removesuffix(EOS)
    invokes = (dsml_invoke(name, **{key: (value, True) if isinstance(value, str) else (json.dumps(value), False)
                                    for key, value in args.items()}) for name, args in calls)
    return dsml_block(*invokes, block="tool_calls" if fmt == "deepseek_v4" else "function_calls").removesuffix(EOS)


@pytest.mark.parametrize("fmt", ["deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4"])
def test_tool_grammar_holds_what_the_parser_reads(fmt: str) -> None:
    """tool_choice required / named and strict tools: the grammar accepts two calls as the encoding writes them
    (which the parser reads back, the arguments valid), one call when parallel_tool_calls is false, the calls after
    free text under auto, and refuses arguments off the schema and a text answer."""
    import jsonschema
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    from reasoning_engine.server.protocol import FunctionDef
    from reasoning_engine.server.tool_grammar import tool_call_tag
    from reasoning_engine.structured.params import StructuredOutputsParams

    tools = [FunctionDef(name=name, parameters=schema) for name, schema in PARAMETERS.items()]

    def accepts(tag: dict[str, Any], text: str) -> bool:
        StructuredOutputsParams(structural_tag=tag)  # the server's own check passes
        return _is_grammar_accept_string(Grammar.from_structural_tag(json.dumps(tag)), text)

    required = tool_call_tag(fmt, tools, required=True, parallel=True)
    single = tool_call_tag(fmt, tools, required=True, parallel=False)
    named = tool_call_tag(fmt, tools[1:], required=True, parallel=False)
    auto = tool_call_tag(fmt, tools, required=False, parallel=True)
    weather = ("get_weather", {"city": "Oslo", "days": 2})
    search = ("search", {"query": 'fjords <b> & "lakes"\nand </b> more'})
    good = written(fmt, weather, search)
    r = run([good], "deepseek_v3", fmt, prompt_tail="<｜Assistant｜></think>")
    assert r.content == "" and [(c["name"], json.loads(c["arguments"])) for c in r.calls] == [weather, search]
    for call in r.calls:
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])
    assert accepts(required, good) and accepts(auto, "Let me check." + good)
    assert not accepts(single, good) and accepts(single, written(fmt, weather))  # parallel_tool_calls false
    assert accepts(named, written(fmt, search)) and not accepts(named, written(fmt, weather))
    for bad in ({"city": "Rome", "days": 2}, {"city": "Oslo", "days": 9}, {"city": "Oslo"}):
        assert not accepts(required, written(fmt, ("get_weather", bad)))
        assert not accepts(auto, "Let me check." + written(fmt, ("get_weather", bad)))
    assert not accepts(required, "The weather is fine.")
    # a marker the parser would end the call at stays out of a string
    marker = "</｜DSML｜invoke>" if fmt in ("deepseek_v32", "deepseek_v4") else "<｜tool▁call▁end｜>"
    assert not accepts(required, written(fmt, ("search", {"query": f"a{marker}b"})))
    if fmt in ("deepseek_v32", "deepseek_v4"):
        assert not accepts(required, good.removeprefix("\n\n"))  # the encoding's blank line opens the answer
        assert not accepts(required, good.replace('string="true">Oslo', 'string="false">"Oslo"'))
