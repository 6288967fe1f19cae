"""gpt-oss's harmony format through the parser chain: analysis -> reasoning_content, final -> content, commentary
with a recipient -> tool_calls, fed every way a stream can split the text (the pattern of test_parsers.py)."""

from __future__ import annotations

import json
from typing import Any

from reasoning_engine.server.formats.harmony import HARMONY_MARKERS
from reasoning_engine.server.formats.registry import resolve_reasoning_parser, resolve_tool_parser

from .test_parsers import check_all, run

TAIL = "<|start|>assistant"
MARKERS = [*HARMONY_MARKERS, "<|im_end|>"]


def final(text: str) -> str:
    return f"<|start|>assistant<|channel|>final<|message|>{text}<|return|>"


def analysis(text: str, first: bool = True) -> str:
    return ("" if first else "<|start|>assistant") + f"<|channel|>analysis<|message|>{text}<|end|>"


def call(name: str, args: dict, recipient_first: bool = False) -> str:
    if recipient_first:
        return f"<|start|>assistant to=functions.{name}<|channel|>commentary json<|message|>{json.dumps(args)}<|call|>"
    return f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{json.dumps(args)}<|call|>"


def test_analysis_is_reasoning_and_final_is_content() -> None:
    text = analysis("The user asks 2 + 3.\nThat is 5.") + final("The answer is **5**.")
    r = check_all(text, "gpt_oss", "gpt_oss", MARKERS, prompt_tail=TAIL)
    assert r.reasoning == "The user asks 2 + 3.\nThat is 5."
    assert r.content == "The answer is **5**."
    assert r.calls == []


def test_commentary_call_after_analysis() -> None:
    text = analysis("Need the weather tool.") + call("get_weather", {"city": "Paris", "unit": "c"})
    r = check_all(text, "gpt_oss", "gpt_oss", MARKERS, prompt_tail=TAIL)
    assert r.reasoning == "Need the weather tool."
    assert r.content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in r.calls] == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert r.calls[0]["id"].startswith("call_")


def test_recipient_before_channel_preamble_and_two_calls() -> None:
    """The recipient may sit in the role part of the header; a commentary message without one is a preamble
    (user-visible content); analysis between the calls stays reasoning."""
    text = (analysis("Plan: look up both.") + "<|start|>assistant<|channel|>commentary<|message|>Checking two sources."
            "<|end|>" + call("lookup", {"q": "a<b"}, recipient_first=True) + analysis("Now the second.", first=False)
            + call("lookup", {"q": "x"}))
    r = check_all(text, "gpt_oss", "gpt_oss", MARKERS, prompt_tail=TAIL)
    assert r.reasoning == "Plan: look up both.\n\nNow the second."
    assert r.content == "Checking two sources."
    assert [(c["name"], json.loads(c["arguments"])) for c in r.calls] == [("lookup", {"q": "a<b"}), ("lookup", {"q": "x"})]


def test_reasoning_parsing_off_drops_analysis() -> None:
    text = analysis("private thoughts") + final("Hello!")
    r = check_all(text, None, "gpt_oss", MARKERS, prompt_tail=TAIL)
    assert (r.reasoning, r.content) == ("", "Hello!")


def test_calls_are_content_free_when_tools_are_not_offered() -> None:
    r = run([analysis("hm") + call("f", {"a": 1})], "gpt_oss", "gpt_oss", prompt_tail=TAIL, tools_active=False)
    assert (r.reasoning, r.content, r.calls) == ("hm", "", [])


def test_cut_off_outputs() -> None:
    """max_tokens in the analysis keeps it reasoning; in a header drops the header; in arguments keeps what came."""
    assert run([analysis("still thinking")[:-len("<|end|>")]], "gpt_oss", "gpt_oss", prompt_tail=TAIL).reasoning == "still thinking"
    r = run([analysis("done") + "<|start|>assistant<|channel|>fin"], "gpt_oss", "gpt_oss", prompt_tail=TAIL)
    assert (r.reasoning, r.content) == ("done", "")
    r = run([call("f", {"a": 1})[: -len('1}<|call|>')]], "gpt_oss", "gpt_oss", prompt_tail=TAIL)
    assert r.calls[0]["arguments"] == '{"a": '


def test_text_without_harmony_markers_is_content() -> None:
    r = check_all("just text, no channels", "gpt_oss", "gpt_oss", MARKERS, prompt_tail=TAIL)
    assert (r.reasoning, r.content) == ("", "just text, no channels")


def test_auto_selects_harmony_for_gpt_oss() -> None:
    assert resolve_reasoning_parser("auto", "gpt_oss", set()) == "gpt_oss"
    assert resolve_tool_parser("auto", "gpt_oss", set(), None) == "gpt_oss"


def test_output_ending_at_the_stop_token_without_its_text() -> None:
    """The engine stops at `<|return|>` / `<|call|>` (EOS ids) and may leave their text out."""
    r = check_all(analysis("x") + final("Done.")[: -len("<|return|>")], "gpt_oss", "gpt_oss", MARKERS, prompt_tail=TAIL)
    assert (r.reasoning, r.content) == ("x", "Done.")
    r = check_all(call("f", {"a": [1, 2]})[: -len("<|call|>")], "gpt_oss", "gpt_oss", MARKERS, prompt_tail=TAIL)
    assert [(c["name"], json.loads(c["arguments"])) for c in r.calls] == [("f", {"a": [1, 2]})]


PARAMETERS = {"get_weather": {"type": "object", "required": ["city", "days"], "properties": {
    "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}},
    "search": {"type": "object", "required": ["query"], "properties": {"query": {"type": "string"}}}}


def constrained(*messages: str) -> str:
    """Messages as the constrained output holds them: after the prompt's `<|start|>assistant` (so the first one
    without it), up to the stop token that ends the turn."""
    return "".join(messages).removeprefix(TAIL).removesuffix("<|call|>").removesuffix("<|return|>")


def test_tool_grammar_lets_the_analysis_through_and_holds_the_call() -> None:
    """gpt-oss's constraint starts at the first output token. required / named: analysis messages, then one call
    (a call ends the turn); auto with strict tools: free harmony, a call held to its schema; an answer format: the
    analysis, then the answer in a final message (or, tools under auto, a call). What the grammar accepts, the
    parsers read back."""
    import jsonschema
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    from reasoning_engine.server.protocol import FunctionDef
    from reasoning_engine.server.formats.registry import REASONING_FORMATS
    from reasoning_engine.server.tool_grammar import answer_tag, tool_call_tag
    from reasoning_engine.structured.params import StructuredOutputsParams

    def accepts(tag: dict[str, Any], text: str) -> bool:
        StructuredOutputsParams(structural_tag=tag)  # the server's own check passes
        return _is_grammar_accept_string(Grammar.from_structural_tag(json.dumps(tag)), text)

    tools = [FunctionDef(name=name, parameters=schema) for name, schema in PARAMETERS.items()]
    thinking = REASONING_FORMATS["gpt_oss"].inline_thinking
    required = tool_call_tag("gpt_oss", tools, required=True, parallel=True, thinking=thinking)
    named = tool_call_tag("gpt_oss", tools[1:], required=True, parallel=False, thinking=thinking)
    auto = tool_call_tag("gpt_oss", tools, required=False, parallel=True, thinking=thinking)
    weather = ("get_weather", {"city": "Oslo", "days": 2})
    search = ("search", {"query": 'fjords <b> & "lakes"\nmore'})
    good = constrained(analysis("Need the weather.\n<b>?"), analysis("Oslo it is.", first=False), call(*weather))
    r = run([good], "gpt_oss", "gpt_oss", prompt_tail=TAIL)
    assert (r.reasoning, r.content) == ("Need the weather.\n<b>?\n\nOslo it is.", "")
    assert [(c["name"], json.loads(c["arguments"])) for c in r.calls] == [weather]
    jsonschema.validate(json.loads(r.calls[0]["arguments"]), PARAMETERS["get_weather"])
    assert accepts(required, good) and accepts(required, constrained(call(*weather)))
    assert not accepts(required, constrained(call(*weather), call(*search)))  # parallel or not: one call
    assert accepts(named, constrained(analysis("x"), call(*search))) and not accepts(named, constrained(call(*weather)))
    assert not accepts(required, constrained(analysis("x"), final("It is sunny.")))
    assert not accepts(required, "It is sunny.")
    for bad in ({"city": "Rome", "days": 2}, {"city": "Oslo", "days": 9}, {"city": "Oslo"}):
        assert not accepts(required, constrained(call("get_weather", bad)))
        assert not accepts(auto, constrained(analysis("x"), call("get_weather", bad)))
    assert not accepts(required, constrained(call("search", {"query": "a<|call|>b"})))  # a marker ends the call
    preamble = "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    assert accepts(auto, constrained(analysis("hm"), final("Hi!"))) and accepts(auto, constrained(final("Hi!")))
    assert accepts(auto, constrained(analysis("hm"), preamble, call(*search)))
    assert not accepts(auto, constrained(analysis("hm"), call(*search)) + "<|end|>")  # the stop token ends it

    spec = StructuredOutputsParams(json={"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}})
    answer = answer_tag(spec, thinking)
    answered = constrained(analysis("Give JSON."), final('{"a": 1}'))
    r = run([answered], "gpt_oss", "gpt_oss", prompt_tail=TAIL)
    assert (r.reasoning, r.content, r.calls) == ("Give JSON.", '{"a": 1}', [])
    assert accepts(answer, answered) and accepts(answer, constrained(final('{"a": 1}')))
    assert not accepts(answer, '{"a": 1}') and not accepts(answer, constrained(analysis("x"), final('{"a": "1"}')))
    either = tool_call_tag("gpt_oss", tools, required=False, parallel=True, answer=spec, thinking=thinking)
    assert accepts(either, answered) and accepts(either, good)
    assert not accepts(either, constrained(analysis("x"), final("Hi!")))
