"""MiniMax-M2's output parsers as pure units (tests/server/test_parsers.py's pattern): the thinking, then XML tool
calls whose untyped values are read by the tool's schema, fed every way a stream can split the text."""

from __future__ import annotations

import json

import pytest

from reasoning_engine.server.formats.registry import resolve_reasoning_parser, resolve_tool_parser
from reasoning_engine.server.parsing import build_output_parser

from .test_parsers import Result, check_splittings, collect, splittings

MARKERS = ["<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>", "[e~["]
SCHEMAS = {
    "get_weather": {"type": "object", "properties": {
        "location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}, "hourly": {"type": "boolean"}, "threshold": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}}, "filters": {"type": "object"},
        "note": {"type": ["string", "null"]}}},
    "search_web": {"type": "object", "properties": {"query_list": {"type": "array", "items": {"type": "string"}},
                                                    "query_tag": {"type": "array", "items": {"type": "string"}}}},
}


def invoke(name: str, **params: str) -> str:
    body = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in params.items())
    return f'<invoke name="{name}">\n{body}</invoke>\n'


def block(*invokes: str) -> str:
    return "<minimax:tool_call>\n" + "".join(invokes) + "</minimax:tool_call>"


def run(pieces: list[str], *, tools_active: bool = True, prompt_tail: str = "]~b]ai\n<think>\n",
        reasoning: str = "minimax_m2") -> Result:
    parser = build_output_parser(reasoning, "minimax_m2", prompt_tail=prompt_tail, thinking_requested=None,
                                 tools_active=tools_active, drop=["[e~["], tool_schemas=SCHEMAS)
    return collect(parser, pieces)


def check_all(text: str, n_random: int = 40, **kwargs) -> Result:
    """Every splitting gives the whole text's result, and no streamed piece holds a marker."""
    return check_splittings(text, lambda pieces: run(pieces, **kwargs), MARKERS, n_random)


def arguments(result: Result) -> list[tuple[str, dict]]:
    """(name, arguments) per call, each arguments string checked to be the compact JSON of its object."""
    out = []
    for call in result.calls:
        value = json.loads(call["arguments"])
        assert call["arguments"] == json.dumps(value, ensure_ascii=False)
        assert call["id"].startswith("call_")
        out.append((call["name"], value))
    return out


def test_thinking_then_text_then_two_calls() -> None:
    """The tool calling guide's example: two invokes in one block, array values as JSON."""
    text = ("The user wants news.\n</think>\n\nLet me search.\n" + block(
        invoke("search_web", query_tag='["technology", "events"]', query_list='["\\"OpenAI\\" \\"latest\\""]'),
        invoke("search_web", query_tag='["technology", "events"]', query_list='["\\"Gemini\\" \\"latest\\""]'))
        + "[e~[")
    r = check_all(text)
    assert (r.reasoning, r.content) == ("The user wants news.", "Let me search.\n")
    assert arguments(r) == [
        ("search_web", {"query_tag": ["technology", "events"], "query_list": ['"OpenAI" "latest"']}),
        ("search_web", {"query_tag": ["technology", "events"], "query_list": ['"Gemini" "latest"']})]


def test_values_are_typed_by_the_schema() -> None:
    text = "plan</think>" + block(invoke(
        "get_weather", location="\n San Francisco, CA \n", unit="celsius", days="3", hourly="True", threshold="2.0",
        tags='["a", "b"]', filters='{"rain": false, "min": 1.5}', note="null", extra="  free text <b> & \"q\" ",
        city="null"))
    r = check_all(text, n_random=20)
    assert arguments(r) == [("get_weather", {
        "location": "San Francisco, CA", "unit": "celsius", "days": 3, "hourly": True, "threshold": 2,
        "tags": ["a", "b"], "filters": {"rain": False, "min": 1.5}, "note": None,
        "extra": 'free text <b> & "q"', "city": None})]


@pytest.mark.parametrize("value,kind,want", [
    ("3.5", "days", "3.5"), ("x", "days", "x"), ("0.25", "threshold", 0.25), ("1e400", "threshold", "1e400"),
    ("NaN", "tags", "NaN"), ("[1, 2", "tags", "[1, 2"), ("1", "hourly", True), ("no", "hourly", False),
    ("nullable", "location", "nullable"), (" NULL ", "location", None), ("", "location", ""),
    ('<parameter name="x">inner', "location", '<parameter name="x">inner'), ("café ☕", "location", "café ☕"),
])
def test_values_that_do_not_fit_their_type_stay_text(value: str, kind: str, want: object) -> None:
    r = check_all("</think>" + block(invoke("get_weather", **{kind: value})), n_random=5)
    assert arguments(r) == [("get_weather", {kind: want})]


def test_unknown_tool_and_untyped_parameters_are_strings() -> None:
    text = "</think>" + block(invoke("other", count="42", flag="true"), "<invoke name='no_params'>\n</invoke>\n")
    r = check_all(text)
    assert arguments(r) == [("other", {"count": "42", "flag": "true"}), ("no_params", {})]


def test_call_inside_thinking_ends_it() -> None:
    text = "I should look it up.\n" + block(invoke("get_weather", location="Paris")) + "</think>"
    r = check_all(text)
    assert (r.reasoning, r.content) == ("I should look it up.", "")
    assert arguments(r) == [("get_weather", {"location": "Paris"})]


def test_calls_are_removed_but_not_emitted_when_tools_are_inactive() -> None:
    r = check_all("hm</think>Answer." + block(invoke("get_weather", location="Paris")), tools_active=False)
    assert (r.reasoning, r.content, r.calls) == ("hm", "Answer.", [])


def test_tags_outside_a_call_block_are_text() -> None:
    text = '</think>Use <invoke name="f"> and </parameter> in XML.'
    r = check_all(text)
    assert (r.content, r.calls) == ('Use <invoke name="f"> and </parameter> in XML.', [])


@pytest.mark.parametrize("cut,want", [
    ('<invoke name="get_weather">\n<parameter name="location">Par', {"location": "Par"}),
    ('<invoke name="get_weather">\n<parameter name="days">4', {"days": 4}),
    ('<invoke name="get_weather">\n<parameter name="location">Paris</parameter>\n<parameter na', {"location": "Paris"}),
    ('<invoke name="get_weather">\n', {}),
])
def test_output_cut_mid_call_keeps_valid_arguments(cut: str, want: dict) -> None:
    """max_tokens or a stop string inside a call: the call keeps what was written, closed as a JSON object."""
    r = check_all("</think><minimax:tool_call>\n" + cut, n_random=10)
    assert arguments(r) == [("get_weather", want)]


def test_invoke_without_a_name_is_dropped() -> None:
    text = "</think>" + block('<invoke name="">\n<parameter name="a">1</parameter>\n</invoke>\n',
                              invoke("get_weather", days="1"))
    assert arguments(check_all(text)) == [("get_weather", {"days": 1})]


def test_string_values_stream_before_their_parameter_closes() -> None:
    parser = build_output_parser("minimax_m2", "minimax_m2", prompt_tail="<think>\n", thinking_requested=None,
                                 tools_active=True, drop=[], tool_schemas=SCHEMAS)
    parser.feed('</think><minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="location">San ')
    streamed = parser.feed("Francisco")
    assert [d.arguments for d in streamed.tool_calls] == [" Francisco"]
    assert parser.tool_calls[0].arguments == '{"location": "San Francisco'


@pytest.mark.parametrize("prompt_tail,written", [("]~b]ai\n<think>\n", ""), ("]~b]ai\n", "<think>")])
def test_append_think_keeps_the_thinking_in_the_content(prompt_tail: str, written: str) -> None:
    """vLLM's `minimax_m2_append_think` (MiniMax's recommended flag): the thinking stays in `content` between its
    markers, as clients send it back; calls are still extracted. The same however the text is split."""
    text = written + "\nI need the weather.\n</think>\n\nChecking.\n" + block(invoke("get_weather", days="2")) + "[e~["
    expected = run([text], reasoning="minimax_m2_append_think", prompt_tail=prompt_tail)
    assert (expected.reasoning, expected.content) == ("", "<think>\nI need the weather.\n</think>Checking.\n")
    assert arguments(expected) == [("get_weather", {"days": 2})]
    for pieces in splittings(text, n_random=20):
        got = run(pieces, reasoning="minimax_m2_append_think", prompt_tail=prompt_tail)
        assert (got.reasoning, got.content, got.calls[0]["arguments"]) == ("", expected.content, '{"days": 2}')
        assert not any("minimax:tool_call" in piece or "[e~[" in piece for piece in got.pieces), pieces
    cut = run([written + "still thinking"], reasoning="minimax_m2_append_think", prompt_tail=prompt_tail)
    assert cut.content == "<think>still thinking"  # a thinking cut off stays open


def test_auto_selection() -> None:
    vocab = {"<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"}
    assert resolve_reasoning_parser("auto", "minimax_m2", vocab) == "minimax_m2"
    assert resolve_tool_parser("auto", "minimax_m2", vocab, None) == "minimax_m2"
    assert resolve_tool_parser("auto", "llama", {"<minimax:tool_call>"}, None) == "minimax_m2"
