"""GLM-4.5 / 4.6 / 4.7 output parsing: the XML-style tool calls (`glm45`), values typed by the tool's schema, and
`<think>` reasoning, fed every way a stream can split the text (tests/server/test_parsers.py's pattern); and round
trips through GLM-4.6's published chat template (tests/data/glm4_6_chat_template.jinja, source in
tests/data/SOURCES.md): a call rendered into the history parses back to the same call."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import pytest

from reasoning_engine.models.chat_templates import iterates_arguments
from reasoning_engine.server.chat_template import render_chat
from reasoning_engine.server.formats.glm import Glm45ToolParser
from reasoning_engine.server.formats.registry import (
    CALL_SYNTAXES,
    REASONING_FORMATS,
    TOOL_PARSERS,
    resolve_reasoning_parser,
    resolve_tool_parser,
)
from reasoning_engine.server.parsing import build_output_parser
from reasoning_engine.server.reasoning_parsers import initial_mode

from .test_parsers import Result, check_splittings, collect

TEMPLATE = Path(__file__).parent.parent / "data" / "glm4_6_chat_template.jinja"
GLM_SPECIALS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>"]
GLM_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
             "</arg_value>", "<tool_response>", "</tool_response>"]
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
           "</arg_value>", "<|user|>"]
SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                     "units": {"type": ["string", "null"]}}},
    "search": {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"},
                                                "exact": {"type": "boolean"}}},
}


def glm_call(name: str, args: dict[str, Any], newlines: bool = True) -> str:
    """A call as GLM's templates write it: 4.5 / 4.6 with newlines between the parts, 4.7 without."""
    sep = "\n" if newlines else ""
    parts = "".join(f"{sep}<arg_key>{k}</arg_key>{sep}<arg_value>{v if isinstance(v, str) else json.dumps(v)}"
                    f"</arg_value>" for k, v in args.items())
    return f"<tool_call>{name}{parts}{sep}</tool_call>"


def run(pieces: list[str], *, prompt_tail: str = "<|assistant|>", thinking: bool | None = None,
        schemas: dict[str, dict] | None = SCHEMAS, tools_active: bool = True) -> Result:
    parser = build_output_parser("glm45", "glm45", prompt_tail=prompt_tail, thinking_requested=thinking,
                                 tools_active=tools_active, drop=["<|user|>", "<|observation|>"], tool_schemas=schemas)
    return collect(parser, pieces)


def check_all(text: str, **kwargs: Any) -> Result:
    """Every splitting gives the whole text's result, every call's arguments are one JSON object, no marker leaks."""
    expected = check_splittings(text, lambda pieces: run(pieces, **kwargs), MARKERS)
    for call in expected.calls:
        assert isinstance(json.loads(call["arguments"]), dict)
    return expected


def calls(result: Result) -> list[tuple[str, Any]]:
    return [(c["name"], json.loads(c["arguments"])) for c in result.calls]


def test_glm45_calls_after_thinking_streaming() -> None:
    text = ("\n<think>Need the weather, then a search.</think>\nChecking." +
            glm_call("get_weather", {"city": 'Par"is\n<b>', "days": 3}) + "\n" +
            glm_call("search", {"query": "42", "filters": {"year": [2024, 2025]}, "exact": True}))
    r = check_all(text)
    assert r.reasoning == "Need the weather, then a search."
    assert r.content == "Checking.\n"  # text between calls is content, as for hermes
    # a string-typed "42" stays a string; the object and the boolean are decoded
    assert calls(r) == [("get_weather", {"city": 'Par"is\n<b>', "days": 3}),
                        ("search", {"query": "42", "filters": {"year": [2024, 2025]}, "exact": True})]
    assert all(c["id"].startswith("call_") for c in r.calls)


def test_glm47_compact_calls_opened_thinking_and_no_arguments() -> None:
    """GLM-4.7's prompt ends in `<think>`; its calls have no newlines; a call may have no arguments."""
    text = ("plan</think>" + glm_call("get_weather", {"city": "Oslo", "units": "metric"}, newlines=False) +
            "<tool_call>now</tool_call>")
    r = check_all(text, prompt_tail="<|assistant|><think>")
    assert (r.reasoning, r.content) == ("plan", "")
    assert calls(r) == [("get_weather", {"city": "Oslo", "units": "metric"}), ("now", {})]


def test_glm45_untyped_arguments_decode_only_non_strings() -> None:
    """A tool without a schema for the argument: JSON for numbers, objects, true/false/null; text otherwise."""
    text = glm_call("f", {"n": 7, "o": {"a": 1}, "t": "plain words", "q": '"quoted"', "b": "[1, 2"})
    r = check_all(text, schemas=None)
    assert calls(r) == [("f", {"n": 7, "o": {"a": 1}, "t": "plain words", "q": '"quoted"', "b": "[1, 2"})]


def test_glm45_call_starting_inside_thinking_and_cut_off_call() -> None:
    text = "let me call" + glm_call("get_weather", {"city": "Rome"}) + "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>cut of"
    r = check_all(text, prompt_tail="<|assistant|><think>")
    assert r.reasoning == "let me call" and r.content == ""
    assert calls(r) == [("get_weather", {"city": "Rome"}), ("search", {"query": "cut of"})]


def test_glm45_thinking_off_and_tools_inactive() -> None:
    text = "Plain answer." + glm_call("get_weather", {"city": "Rome"}) + " Done."
    r = check_all(text, prompt_tail="<|assistant|>\n<think></think>", thinking=False, tools_active=False)
    assert (r.reasoning, r.content, r.calls) == ("", "Plain answer. Done.", [])


def test_glm45_nameless_call_is_dropped() -> None:
    r = check_all("Sure.<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call> Done.")
    assert (r.content, r.calls) == ("Sure. Done.", [])


def test_auto_selection_for_glm() -> None:
    vocab = {"<think>", "</think>", "<tool_call>", "<arg_key>"}
    assert resolve_reasoning_parser("auto", "glm4_moe", vocab) == "glm45"
    assert resolve_tool_parser("auto", "glm4_moe", vocab, None) == "glm45"
    assert resolve_tool_parser("auto", "qwen3", {"<tool_call>"}, None) == "hermes"
    assert TOOL_PARSERS["glm47"] is Glm45ToolParser and "glm47" in CALL_SYNTAXES  # vLLM's name for GLM-4.7's form


@pytest.fixture(scope="module")
def glm_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return save_glm_tokenizer(tmp_path_factory.mktemp("glm_tokenizer"))


def save_glm_tokenizer(folder: Path) -> Any:
    """One token per printable character plus GLM's chat and tool tokens, with GLM-4.6's chat template; saved in
    `folder` and loaded back."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<unk>", *dict.fromkeys(string.printable)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": GLM_SPECIALS[:-1]})
    fast.add_tokens(GLM_ADDED)
    fast.chat_template = TEMPLATE.read_text()
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(str(folder))


def _render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[str, str]:
    from reasoning_engine.server.protocol import ToolDef

    tools = [ToolDef.model_validate({"type": "function", "function": {"name": n, "parameters": s}})
             for n, s in SCHEMAS.items()]
    rendered = render_chat(tokenizer, messages, tools=tools, template_kwargs=kwargs)
    return tokenizer.decode(rendered.token_ids, skip_special_tokens=False), rendered.tail


def test_template_renders_history_calls_that_parse_back(glm_tokenizer: Any) -> None:
    """OpenAI history (arguments as a JSON string) renders through the template's `_args.items()`; the rendered call
    is exactly what the model writes, and parses back to the same call."""
    arguments = {"city": "Paris", "days": 3, "units": None}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "reasoning_content": "use the tool",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text, tail = _render(glm_tokenizer, messages)
    assert '{"type": "function", "function": {"name": "get_weather"' in text  # the tools block
    written = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
               "<arg_value>3</arg_value>\n<arg_key>units</arg_key>\n<arg_value>null</arg_value>\n</tool_call>")
    assert written in text and "<|observation|>\n<tool_response>\nsunny\n</tool_response><|assistant|>" in text
    assert initial_mode(REASONING_FORMATS["glm45"], tail, None) == "detect"
    start = text.index("<|assistant|>", text.index("Weather")) + len("<|assistant|>")
    turn = text[start:text.index("<|observation|>")]  # the assistant turn as the model would have written it
    r = check_all(turn)
    assert (r.reasoning, r.content) == ("use the tool", "")  # the current turn's thinking is rendered back
    assert calls(r) == [("get_weather", arguments)]


def test_template_thinking_switch(glm_tokenizer: Any) -> None:
    _, tail = _render(glm_tokenizer, [{"role": "user", "content": "hi"}], enable_thinking=False)
    assert tail.endswith("<think></think>")
    assert initial_mode(REASONING_FORMATS["glm45"], tail, False) == "content"


def test_tool_grammar_holds_what_the_parser_reads() -> None:
    """tool_choice required / named and strict tools in GLM's format: the grammar accepts GLM-4.5's and GLM-4.7's
    calls with valid arguments (which the parser reads back), and refuses arguments outside the schema."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    from reasoning_engine.server.protocol import FunctionDef
    from reasoning_engine.server.tool_grammar import tool_call_tag
    from reasoning_engine.structured.params import StructuredOutputsParams

    parameters = {"get_weather": {"type": "object", "required": ["city", "days"], "properties": {
        "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}},
        "search": {"type": "object", "required": ["query"], "properties": {"query": {"type": "string"}}}}
    tools = [FunctionDef(name=name, parameters=schema) for name, schema in parameters.items()]

    def accepts(tag: dict[str, Any], text: str) -> bool:
        StructuredOutputsParams(structural_tag=tag)  # the server's own check passes
        return _is_grammar_accept_string(Grammar.from_structural_tag(json.dumps(tag)), text)

    required = tool_call_tag("glm45", tools, required=True, parallel=True)
    single = tool_call_tag("glm45", tools, required=True, parallel=False)
    auto = tool_call_tag("glm45", tools, required=False, parallel=True)
    for newlines in (True, False):
        good = (glm_call("get_weather", {"city": "Oslo", "days": 2}, newlines) + "\n" +
                glm_call("search", {"query": "fjords <and> \"lakes\""}, newlines))
        r = run([good], schemas=parameters)
        assert calls(r) == [("get_weather", {"city": "Oslo", "days": 2}), ("search", {"query": "fjords <and> \"lakes\""})]
        assert accepts(required, good) and accepts(auto, "Let me check. " + good)
        assert not accepts(single, good)  # parallel_tool_calls false: the second call is refused
        assert accepts(single, glm_call("get_weather", {"city": "Oslo", "days": 2}, newlines))
        bad = glm_call("get_weather", {"city": "Rome", "days": 2}, newlines)
        assert not accepts(required, bad) and not accepts(auto, bad)
        assert not accepts(required, glm_call("get_weather", {"city": "Oslo", "days": 9}, newlines))
    assert not accepts(required, "The weather is fine.")


def test_only_templates_that_walk_the_arguments_get_them_as_objects() -> None:
    assert iterates_arguments(TEMPLATE.read_text())  # `{% set _args = tc.arguments or {} %}` ... `_args.items()`
    assert iterates_arguments("{% for k, v in tool_call.arguments|items %}{{ k }}{% endfor %}")  # Qwen3-Coder's way
    # `.items()` over something else, and arguments written as the string they are: left alone
    assert not iterates_arguments("{% for k, v in tool.parameters.properties.items() %}{% endfor %}"
                                  "{{ call.function.arguments }}")
