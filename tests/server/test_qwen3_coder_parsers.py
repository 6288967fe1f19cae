"""Qwen3-Coder's XML tool calls (also Qwen3.5 / 3.6 and Qwen3-Coder-Next) as pure units (tests/server/test_parsers.py's
pattern): the thinking, then `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>...` calls whose raw
values are read by the tool's schema, fed every way a stream can split the text; and the `auto` choice of parsers
for the Qwen and Kimi Linear families."""

from __future__ import annotations

import json
import random

import pytest

from reasoning_engine.server.formats.registry import resolve_reasoning_parser, resolve_tool_parser
from reasoning_engine.server.parsing import build_output_parser

from .test_parsers import Result, check_splittings, collect

MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>"]
SCHEMAS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}, "hourly": {"type": "boolean"}, "threshold": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}}, "filters": {"type": "object"},
        "note": {"type": ["string", "null"]}, "level": {"enum": [1, 2, "max"]}, "free": {}}},
    "write_file": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}},
}
# Qwen3.5's generation prompt: its template opens the thinking, so the output starts inside it
THINKING_PROMPT = "<|im_start|>assistant\n<think>\n"


def call(name: str, **params: str) -> str:
    """One call as the chat template writes it: each value between newlines."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def run(pieces: list[str], *, tools_active: bool = True, prompt_tail: str = THINKING_PROMPT,
        reasoning: str | None = "qwen3", tool: str = "qwen3_coder", thinking: bool | None = None) -> Result:
    parser = build_output_parser(reasoning, tool, prompt_tail=prompt_tail, thinking_requested=thinking,
                                 tools_active=tools_active, drop=["<|im_end|>"], tool_schemas=SCHEMAS)
    return collect(parser, pieces)


def check_all(text: str, n_random: int = 40, **kwargs) -> Result:
    """Every splitting gives the whole text's result (content, names, arguments text), and no streamed piece holds
    a marker."""
    return check_splittings(text, lambda pieces: run(pieces, **kwargs), MARKERS, n_random)


def arguments(result: Result) -> list[tuple[str, dict]]:
    """(name, arguments) per call, each arguments string checked to be the compact JSON of its object."""
    out = []
    for c in result.calls:
        value = json.loads(c["arguments"])
        assert c["arguments"] == json.dumps(value, ensure_ascii=False)
        assert c["id"].startswith("call_")
        out.append((c["name"], value))
    return out


def test_thinking_opened_by_the_prompt_then_text_then_two_calls() -> None:
    text = ("The user wants the weather.\n</think>\n\nLet me check.\n\n"
            + call("get_weather", city="Paris", days="3") + "\n" + call("get_weather", city="Lyon", days="1")
            + "<|im_end|>")
    r = check_all(text)
    assert (r.reasoning, r.content) == ("The user wants the weather.", "Let me check.\n\n")
    assert arguments(r) == [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Lyon", "days": 1})]
    assert len({c["id"] for c in r.calls}) == 2
    for tool in ("qwen3_coder", "qwen3_xml"):  # vLLM's two names for the format
        assert arguments(run([text], tool=tool)) == arguments(r)


def test_thinking_off_is_all_content() -> None:
    text = "Sure.\n" + call("get_weather", city="Paris")
    for tail, thinking in (("<think>\n\n</think>\n\n", None), (THINKING_PROMPT, False)):
        r = check_all(text, prompt_tail=tail, thinking=thinking, n_random=10)
        assert (r.reasoning, r.content) == ("", "Sure.\n")
        assert arguments(r) == [("get_weather", {"city": "Paris"})]


def test_values_are_typed_by_the_schema() -> None:
    text = "</think>" + call(
        "get_weather", city="San Francisco, CA", unit=" celsius", days="-3", hourly="false", threshold="2.5",
        tags='["a", "b"]', filters='{"rain": false, "min": 1.5}', note="null", level="2", free="42", extra="true")
    r = check_all(text, n_random=20)
    assert arguments(r) == [("get_weather", {
        "city": "San Francisco, CA", "unit": "celsius", "days": -3, "hourly": False, "threshold": 2.5,
        "tags": ["a", "b"], "filters": {"rain": False, "min": 1.5}, "note": None, "level": 2,
        "free": "42", "extra": "true"})]  # no schema type: a string, as the template wrote it


@pytest.mark.parametrize("key,value,want", [
    ("days", "3.5", "3.5"), ("days", "many", "many"), ("days", "null", None), ("threshold", "4", 4),
    ("threshold", "1e400", "1e400"), ("threshold", "NaN", "NaN"), ("hourly", "TRUE", True),
    ("tags", "[1, 2", "[1, 2"), ("filters", "not json", "not json"), ("level", "max", "max"), ("level", "3", "3"),
    ("note", "nullable", "nullable"), ("note", "\nnull", "\nnull"), ("city", "null", "null"), ("city", "", ""),
    ("city", "café ☕", "café ☕"), ("unit", "kelvin", "kelvin"),
])
def test_values_that_do_not_fit_their_type_stay_text(key: str, value: str, want: object) -> None:
    r = check_all("</think>" + call("get_weather", **{key: value}), n_random=5)
    assert arguments(r) == [("get_weather", {key: want})]


def test_string_values_keep_their_own_whitespace_newlines_and_angle_brackets() -> None:
    """Only the template's newline on each side is dropped (stripping all whitespace breaks exact-match edit
    tools); `<`, tags that are not the format's and partial end tags are value text."""
    content = ("\n    if a < b and c > d:\n        return '<div>'  # </param\n\n"
               "<parameter x> </function <tool_ call>\n\t")
    text = "</think>" + call("write_file", path="a<b>.py", content=content)
    r = check_all(text, n_random=20)
    assert arguments(r) == [("write_file", {"path": "a<b>.py", "content": content})]


def test_a_value_without_its_end_tag_ends_at_the_next_parameter_or_the_function_end() -> None:
    text = ("</think><tool_call>\n<function=get_weather>\n<parameter=city>\nDallas\n<parameter=days>\n2\n"
            "</function>\n</tool_call>")
    assert arguments(check_all(text)) == [("get_weather", {"city": "Dallas", "days": 2})]


def test_unknown_tool_and_a_call_without_parameters() -> None:
    text = "</think>" + call("other", count="42") + "\n" + "<tool_call>\n<function=ping>\n</function>\n</tool_call>"
    assert arguments(check_all(text)) == [("other", {"count": "42"}), ("ping", {})]


def test_call_inside_thinking_ends_it() -> None:
    r = check_all("I should look it up.\n" + call("get_weather", city="Paris"))
    assert (r.reasoning, r.content) == ("I should look it up.", "")
    assert arguments(r) == [("get_weather", {"city": "Paris"})]


def test_calls_are_removed_but_not_emitted_when_tools_are_inactive() -> None:
    r = check_all("hm</think>Answer." + call("get_weather", city="Paris"), tools_active=False)
    assert (r.reasoning, r.content, r.calls) == ("hm", "Answer.", [])


def test_a_tool_call_tag_in_prose_is_text_and_the_answer_goes_on() -> None:
    """A `<tool_call>` not followed by `<function=` was mentioned, not written: the answer is not swallowed."""
    text = "</think>Qwen wraps calls in <tool_call> tags; <function=f> names the tool.\nDone."
    r = check_all(text)
    assert (r.content, r.calls) == ("Qwen wraps calls in  tags; <function=f> names the tool.\nDone.", [])


def test_whitespace_after_a_call_is_not_content_but_text_after_it_is() -> None:
    r = check_all("</think>" + call("get_weather", city="Paris") + "\n\n  ")
    assert (r.content, len(r.calls)) == ("", 1)
    r = check_all("</think>Checking." + call("get_weather", city="Paris") + "\n\nDone.")
    assert (r.content, len(r.calls)) == ("Checking.\n\nDone.", 1)


@pytest.mark.parametrize("cut,want", [
    ("<function=get_weather>\n<parameter=city>\nPar", {"city": "Par"}),
    ("<function=get_weather>\n<parameter=city>\nParis\n", {"city": "Paris"}),
    ("<function=get_weather>\n<parameter=days>\n4", {"days": 4}),
    ("<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=da", {"city": "Paris"}),
    ("<function=get_weather>\n", {}),
])
def test_output_cut_mid_call_keeps_valid_arguments(cut: str, want: dict) -> None:
    """max_tokens or a stop string inside a call: the call keeps what was written, closed as a JSON object."""
    r = check_all("</think><tool_call>\n" + cut, n_random=10)
    assert arguments(r) == [("get_weather", want)]


def test_function_without_a_name_is_dropped() -> None:
    text = "</think><tool_call>\n<function=>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>\n" + call(
        "get_weather", days="1")
    assert arguments(check_all(text)) == [("get_weather", {"days": 1})]


def test_string_values_stream_before_their_parameter_closes() -> None:
    parser = build_output_parser("qwen3", "qwen3_coder", prompt_tail=THINKING_PROMPT, thinking_requested=None,
                                 tools_active=True, drop=[], tool_schemas=SCHEMAS)
    first = parser.feed("</think><tool_call>\n<function=write_file>\n<parameter=content>\nline 1\n")
    assert [(d.id is not None, d.name, d.arguments) for d in first.tool_calls] == [
        (True, "write_file", ""), (False, None, '{"content": '), (False, None, '"'), (False, None, "line 1")]
    streamed = parser.feed("line 2")
    assert [d.arguments for d in streamed.tool_calls] == ["\\nline 2"]
    parser.feed("\n</parameter>\n</function>\n</tool_call>")
    assert parser.tool_calls[0].arguments == '{"content": "line 1\\nline 2"}'


@pytest.mark.parametrize("seed", range(4))
def test_random_calls_stream_exactly_as_they_parse(seed: int) -> None:
    """Random typed values (strings full of `<`, newlines and partial tags) in random calls: the deltas of every
    splitting add up to the whole text's calls, which hold the values written."""
    rng = random.Random(seed)
    pieces = ["a", " ", "\n", "<", " > ", "</", "<param", "</parameter", "<tool_call", "x\ny", "\t", "é", '"', "\\"]
    calls, want = [], []
    for _ in range(rng.randint(1, 3)):
        args = {"city": "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12))),
                "days": rng.randint(-5, 500), "hourly": rng.choice([True, False]),
                "tags": [rng.choice(["x", "y <z>"]) for _ in range(rng.randint(0, 2))]}
        written = {k: v if isinstance(v, str) else json.dumps(v) for k, v in args.items()}
        calls.append(call("get_weather", **written))
        want.append(("get_weather", args))
    r = check_all("Thinking.</think>Calling." + "\n".join(calls), n_random=20)
    assert (r.reasoning, r.content) == ("Thinking.", "Calling.")
    assert arguments(r) == want


QWEN_CODER_TEMPLATE = ("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
                       "{{- '<parameter=' + args_name + '>\\n' }}{{- '\\n</parameter>\\n' }}")
QWEN3_TEMPLATE = "{{- '<tool_call>\\n{\"name\": \"' }}"


def test_auto_selection() -> None:
    qwen_vocab = {"<think>", "</think>", "<tool_call>", "</tool_call>"}
    for model_type in ("qwen3_5", "qwen3_5_moe"):  # Qwen3.5 / 3.6 write XML calls whatever the template says
        assert resolve_tool_parser("auto", model_type, qwen_vocab, None) == "qwen3_coder"
        assert resolve_reasoning_parser("auto", model_type, qwen_vocab) == "qwen3"
    for model_type in ("qwen3_next", "qwen3_moe", "qwen3"):  # Qwen3-Coder(-Next) by its template, else JSON calls
        assert resolve_tool_parser("auto", model_type, qwen_vocab, QWEN_CODER_TEMPLATE) == "qwen3_coder"
        assert resolve_tool_parser("auto", model_type, qwen_vocab, QWEN3_TEMPLATE) == "hermes"
    for model_type in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):  # their thinking, even without a tokenizer
        assert resolve_reasoning_parser("auto", model_type, set()) == "qwen3"
    assert resolve_tool_parser("auto", "llama", set(), "{{- '<function=' + name + '>' }}") is None
    kimi_vocab = {"<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "</think>"}
    assert resolve_tool_parser("auto", "kimi_linear", kimi_vocab, None) == "kimi_k2"
    assert resolve_reasoning_parser("auto", "kimi_linear", kimi_vocab) == "kimi_k2"
