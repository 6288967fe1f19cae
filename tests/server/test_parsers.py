"""Reasoning and tool-call parsers as pure units, fed every way a stream can split the text."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from reasoning_engine.server.markers import MarkerSet
from reasoning_engine.server.formats.registry import resolve_reasoning_parser, resolve_tool_parser
from reasoning_engine.server.parsing import ChatOutputParser, build_output_parser

KIMI_MARKERS = ["<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|im_end|>"]
HERMES_MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>"]


def kimi_call(name: str, idx: int, args: dict) -> str:
    return (f"<|tool_call_begin|>functions.{name}:{idx}<|tool_call_argument_begin|>{json.dumps(args)}"
            "<|tool_call_end|>")


def kimi_section(*calls: str) -> str:
    return "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>"


def hermes_call(name: str, args: dict, indent: bool = False) -> str:
    body = json.dumps({"name": name, "arguments": args}, indent=2 if indent else None)
    return f"<tool_call>\n{body}\n</tool_call>"


@dataclass
class Result:
    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # every reasoning/content piece, for the leak check


def collect(parser: ChatOutputParser, pieces: list[str]) -> Result:
    """Feed the pieces, finish, and join the deltas; each call's streamed fragments add up to its final arguments."""
    result = Result()
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        result.reasoning += delta.reasoning
        result.content += delta.content
        result.pieces += [delta.reasoning, delta.content]
        for call in delta.tool_calls:
            if call.id is not None:
                assert call.index == len(result.calls), "a call opens with the next index"
                assert call.name and call.arguments == ""
                result.calls.append({"id": call.id, "name": call.name, "arguments": ""})
            else:
                assert call.index == len(result.calls) - 1, "fragments belong to the call opened last"
                result.calls[call.index]["arguments"] += call.arguments
    assert [c["arguments"] for c in result.calls] == [c.arguments for c in parser.tool_calls]
    return result


def run(pieces: list[str], reasoning: str | None, tool: str | None, *, prompt_tail: str = "<think>",
        thinking: bool | None = None, tools_active: bool = True, drop: tuple[str, ...] = ("<|im_end|>",)) -> Result:
    return collect(build_output_parser(reasoning, tool, prompt_tail=prompt_tail, thinking_requested=thinking,
                                       tools_active=tools_active, drop=drop), pieces)


def splittings(text: str, seed: int = 0, n_random: int = 40) -> list[list[str]]:
    """Whole, char by char, every two-piece split, and random multi-piece splits."""
    out = [[text], list(text)]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    rng = random.Random(seed)
    for _ in range(n_random):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


def check_splittings(text: str, run_pieces: Callable[[list[str]], Result], markers: list[str],
                     n_random: int = 40) -> Result:
    """Every splitting gives the same result as the whole text, and no piece holds a marker."""
    expected = run_pieces([text])
    for pieces in splittings(text, n_random=n_random):
        got = run_pieces(pieces)
        assert (got.reasoning, got.content) == (expected.reasoning, expected.content), pieces
        assert [(c["name"], c["arguments"]) for c in got.calls] == [(c["name"], c["arguments"]) for c in expected.calls]
        for piece in got.pieces:
            assert not any(m in piece for m in markers), (piece, pieces)
    return expected


def check_all(text: str, reasoning: str | None, tool: str | None, markers: list[str], **kwargs: Any) -> Result:
    return check_splittings(text, lambda pieces: run(pieces, reasoning, tool, **kwargs), markers)


def test_marker_set_holds_back_partial_markers() -> None:
    markers = MarkerSet(["</think>", "<tool_call>"])
    assert markers.split("abc</th") == ("abc", None, "</th")
    assert markers.split("abc</think>def") == ("abc", "</think>", "def")
    assert markers.split("a < b") == ("a < b", None, "")
    assert markers.split("x<") == ("x", None, "<")


def test_kimi_reasoning_then_answer() -> None:
    text = "Let me add 2 and 3.\nThat is 5.</think>The answer is 5.<|im_end|>"
    r = check_all(text, "kimi_k2", "kimi_k2", KIMI_MARKERS)
    assert r.reasoning == "Let me add 2 and 3.\nThat is 5."
    assert r.content == "The answer is 5."
    assert r.calls == []


def test_kimi_tool_call_after_thinking() -> None:
    text = ("I need the calculator.</think>Computing." +
            kimi_section(kimi_call("calculator", 0, {"expression": "4821 * 377"})))
    r = check_all(text, "kimi_k2", "kimi_k2", KIMI_MARKERS)
    assert r.reasoning == "I need the calculator."
    assert r.content == "Computing."
    assert r.calls == [{"id": "functions.calculator:0", "name": "calculator",
                        "arguments": '{"expression": "4821 * 377"}'}]


def test_kimi_tool_call_starting_inside_thinking() -> None:
    text = "Use the tool." + kimi_section(kimi_call("calculator", 3, {"expression": "12 * 34"})) + "</think>"
    r = check_all(text, "kimi_k2", "kimi_k2", KIMI_MARKERS)
    assert r.reasoning == "Use the tool."
    assert r.content == ""
    assert r.calls[0]["id"] == "functions.calculator:3"
    assert json.loads(r.calls[0]["arguments"]) == {"expression": "12 * 34"}


def test_kimi_several_calls_and_large_arguments() -> None:
    big = {"code": "x = '<|tool_call_end' + '|>'\n" * 200, "n": list(range(300))}
    calls = [kimi_call("run", 0, big), kimi_call("get_weather", 1, {"city": "Paris"}), kimi_call("run", 2, {})]
    text = "plan</think>" + kimi_section(*calls)
    expected = run([text], "kimi_k2", "kimi_k2")
    for pieces in splittings(text, n_random=15)[::37]:
        got = run(pieces, "kimi_k2", "kimi_k2")
        assert got.calls == expected.calls and got.content == "" and got.reasoning == "plan"
    assert [json.loads(c["arguments"]) for c in expected.calls] == [big, {"city": "Paris"}, {}]
    assert [c["id"] for c in expected.calls] == ["functions.run:0", "functions.get_weather:1", "functions.run:2"]


def test_kimi_two_calls_one_delta_holds_end_and_next_start() -> None:
    first, second = kimi_call("a", 0, {"x": 1}), kimi_call("b", 1, {"y": 2})
    text = "</think>" + kimi_section(first, second)
    boundary = text.index(second)
    pieces = [text[: boundary - 5], text[boundary - 5: boundary + 25], text[boundary + 25:]]
    r = run(pieces, "kimi_k2", "kimi_k2")
    assert [(c["name"], json.loads(c["arguments"])) for c in r.calls] == [("a", {"x": 1}), ("b", {"y": 2})]


def test_kimi_thinking_off_is_all_content() -> None:
    r = check_all("The answer is 5.", "kimi_k2", "kimi_k2", KIMI_MARKERS, prompt_tail="<think></think>")
    assert (r.reasoning, r.content) == ("", "The answer is 5.")
    r = run(["Just ", "an answer"], "kimi_k2", "kimi_k2", thinking=False)
    assert (r.reasoning, r.content) == ("", "Just an answer")


def test_kimi_unfinished_thinking_stays_reasoning() -> None:
    r = check_all("still thinking about it", "kimi_k2", "kimi_k2", KIMI_MARKERS)
    assert (r.reasoning, r.content) == ("still thinking about it", "")


@pytest.mark.parametrize("text,reasoning,content", [
    ("347 + 589: 7+9=16, ", "347 + 589: 7+9=16,", ""),  # cut mid-thinking: max_tokens, a stop string
    ("  a \n\n b \t \n</think>  The answer. ", "a \n\n b", "The answer. "),
    ("plan \n" + kimi_section(kimi_call("f", 0, {})), "plan", ""),  # a call ends the thinking
    (" \n ", "", ""),
], ids=["cut", "think_end", "call", "only_space"])
def test_thinking_trailing_whitespace_is_dropped_however_split(text: str, reasoning: str, content: str) -> None:
    """Trailing whitespace of the thinking is held back while streaming and dropped where the thinking ends, so every
    splitting joins to the same stripped thinking, whatever ends it."""
    r = check_all(text, "kimi_k2", "kimi_k2", KIMI_MARKERS)
    assert (r.reasoning, r.content) == (reasoning, content)


@pytest.mark.parametrize("tools_active", [True, False])
def test_kimi_call_markers_inside_thinking_are_dropped(tools_active: bool) -> None:
    """Markers a model writes inside its thinking (high temperature) never reach it, tools offered or not."""
    text = ("Maybe<|tool_call_end|> call<|tool_call_argument_begin|> it<|tool_calls_section_end|> later."
            "<|tool_call_section_end|></think>Answer.")
    r = check_all(text, "kimi_k2", "kimi_k2", KIMI_MARKERS, tools_active=tools_active)
    assert (r.reasoning, r.content, r.calls) == ("Maybe call it later.", "Answer.", [])


def test_kimi_call_opener_inside_thinking_is_dropped_when_tools_inactive() -> None:
    r = check_all("a<|tool_call_begin|>b</think>c", "kimi_k2", "kimi_k2", KIMI_MARKERS, tools_active=False)
    assert (r.reasoning, r.content, r.calls) == ("ab", "c", [])


def test_tool_calls_removed_but_not_emitted_when_tools_inactive() -> None:
    text = "hm</think>Answer." + kimi_section(kimi_call("calculator", 0, {"expression": "1"}))
    r = check_all(text, "kimi_k2", "kimi_k2", KIMI_MARKERS, tools_active=False)
    assert (r.reasoning, r.content, r.calls) == ("hm", "Answer.", [])


def test_qwen3_detects_opening_think() -> None:
    r = check_all("<think>\nreason here\n</think>\n\nThe answer.", "qwen3", "hermes", HERMES_MARKERS,
                  prompt_tail="<|im_start|>assistant\n")
    assert (r.reasoning, r.content) == ("reason here", "The answer.")
    r = check_all("No thinking here.", "qwen3", "hermes", HERMES_MARKERS, prompt_tail="<|im_start|>assistant\n")
    assert (r.reasoning, r.content) == ("", "No thinking here.")
    r = check_all("<thin", "qwen3", None, ["<think>"], prompt_tail="assistant\n")
    assert (r.reasoning, r.content) == ("", "<thin")


def test_deepseek_r1_starts_in_reasoning_with_or_without_tag() -> None:
    for text in ("<think>\nsteps\n</think>\n\nanswer", "steps\n</think>\n\nanswer"):
        r = check_all(text, "deepseek_r1", None, ["<think>", "</think>"], prompt_tail="<\uff5cAssistant\uff5c>")
        assert (r.reasoning, r.content) == ("steps", "answer")


def test_hermes_calls_streaming() -> None:
    text = ("<think>need weather</think>Let me check." + hermes_call("get_weather", {"city": "Paris"}) +
            "\n" + hermes_call("calc", {"expression": "</tool_call> {[\"x\"]}"}, indent=True))
    r = check_all(text, "qwen3", "hermes", ["<think>", "</think>", "<|im_end|>"], prompt_tail="assistant\n")
    assert r.reasoning == "need weather"
    assert r.content == "Let me check.\n"
    assert [(c["name"], json.loads(c["arguments"])) for c in r.calls] == [
        ("get_weather", {"city": "Paris"}), ("calc", {"expression": "</tool_call> {[\"x\"]}"})]
    assert all(c["id"].startswith("call_") for c in r.calls)


def test_hermes_call_inside_thinking_and_odd_shapes() -> None:
    text = ('thinking <tool_call>{"arguments": {"a": [1, 2]}, "name": "f"}</tool_call>'
            '<tool_call>{"name": "g", "arguments": "{\\"b\\": 1}"}</tool_call>'
            '<tool_call>{"name": "h"}</tool_call><tool_call>{"name": "i", "arguments": {"c": 3}}')
    r = check_all(text, "deepseek_r1", "hermes", HERMES_MARKERS, prompt_tail="<think>\n")
    assert r.reasoning == "thinking"
    assert [(c["name"], json.loads(c["arguments"])) for c in r.calls] == [
        ("f", {"a": [1, 2]}), ("g", {"b": 1}), ("h", {}), ("i", {"c": 3})]


def test_hermes_broken_json_is_dropped_without_leaking() -> None:
    r = check_all("Sure.<tool_call>not json at all</tool_call> Done.", None, "hermes", HERMES_MARKERS)
    assert (r.content, r.calls) == ("Sure. Done.", [])


def test_auto_selection() -> None:
    kimi_vocab = {"<|im_middle|>", "<|tool_call_begin|>", "</think>"}
    assert resolve_reasoning_parser("auto", "deepseek_v3", kimi_vocab) == "kimi_k2"
    assert resolve_tool_parser("auto", "deepseek_v3", kimi_vocab, None) == "kimi_k2"
    assert resolve_reasoning_parser("auto", "deepseek_v3", {"</think>"}) == "deepseek_r1"
    assert resolve_reasoning_parser("auto", "qwen3", {"</think>", "<tool_call>"}) == "qwen3"
    assert resolve_tool_parser("auto", "qwen3", {"<tool_call>"}, None) == "hermes"
    assert resolve_reasoning_parser("auto", "llama", set()) is None
    assert resolve_tool_parser("auto", "llama", set(), "no tools") is None
    assert resolve_reasoning_parser("none", "kimi_k2", kimi_vocab) is None


@pytest.mark.parametrize("seed", range(3))
def test_random_mixtures_never_leak(seed: int) -> None:
    rng = random.Random(seed)
    parts = ["some thought ", "<", "|", "a < b > c ", "{}", "</thin", "x"]
    thinking = "".join(rng.choice(parts) for _ in range(20))
    answer = "".join(rng.choice(parts[2:]) for _ in range(10)).replace("</thin", "")
    calls = [kimi_call(rng.choice(["f", "g"]), i, {"k": "v" * rng.randint(0, 40)}) for i in range(rng.randint(1, 3))]
    text = thinking.replace("</thin", "") + "</think>" + answer + kimi_section(*calls)
    r = check_all(text, "kimi_k2", "kimi_k2", KIMI_MARKERS)
    assert len(r.calls) == len(calls)


def test_serve_offers_every_registered_parser() -> None:
    from reasoning_engine.cli import build_parser
    from reasoning_engine.server.formats.registry import REASONING_FORMATS, TOOL_PARSERS

    for name in REASONING_FORMATS:
        assert build_parser().parse_args(["serve", "--reasoning-parser", name]).reasoning_parser == name
    for name in TOOL_PARSERS:
        assert build_parser().parse_args(["serve", "--tool-call-parser", name]).tool_call_parser == name
