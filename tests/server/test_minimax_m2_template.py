"""MiniMax-M2's published chat template (tests/data/minimax_m2_chat_template.jinja, see tests/data/SOURCES.md) through
the server's rendering path: interleaved thinking (an assistant message's `reasoning_content` is rendered back inside
the current turn, as the model expects), and history calls that render exactly as the model writes them and parse
back to the same calls."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import pytest

from reasoning_engine.server.chat_template import render_chat, template_messages
from reasoning_engine.server.protocol import ChatMessage, ToolDef
from reasoning_engine.server.formats.registry import REASONING_FORMATS
from reasoning_engine.server.reasoning_parsers import initial_mode

from .test_minimax_m2_parsers import SCHEMAS, arguments, block, check_all, invoke

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "minimax_m2_chat_template.jinja"
SPECIALS = ["]~!b[", "]~b]", "[e~["]  # begin of text, role marker, end of message (the EOS)
ADDED = ["<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"]
WEATHER = {"location": "Paris", "days": 3, "tags": ["rain", "wind"]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One token per printable character plus MiniMax-M2's chat and tool tokens, with its chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<unk>", *dict.fromkeys(string.printable)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="[e~[")
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[:2]})
    fast.add_tokens(ADDED)
    fast.chat_template = TEMPLATE.read_text(encoding="utf-8")
    folder = tmp_path_factory.mktemp("minimax_tokenizer")
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(str(folder))


def render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[str, str, list[int]]:
    """What the server renders for a request's messages (validated as the API validates them) and tools: the text,
    its tail and the token ids."""
    tools = [ToolDef.model_validate({"type": "function", "function": {"name": n, "parameters": s}})
             for n, s in SCHEMAS.items()]
    parsed = template_messages([ChatMessage.model_validate(m) for m in messages])
    rendered = render_chat(tokenizer, parsed, tools=tools, template_kwargs=kwargs)
    return tokenizer.decode(rendered.token_ids, skip_special_tokens=False), rendered.tail, rendered.token_ids


def agent_turn() -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are a weather bot."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "reasoning_content": "I need the weather tool.",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": json.dumps(WEATHER)}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]


def test_thinking_of_the_current_turn_is_rendered_back(tokenizer: Any) -> None:
    text, tail, _ = render(tokenizer, agent_turn())
    assert text.startswith("]~!b[]~b]system\nYou are a weather bot.\n\n# Tools\n")
    assert '<tool>{"name": "get_weather", "parameters": {"type": "object"' in text
    written = ("]~b]ai\n<think>\nI need the weather tool.\n</think>\n\n\n<minimax:tool_call>\n"
               '<invoke name="get_weather">\n<parameter name="location">Paris</parameter>\n'
               '<parameter name="days">3</parameter>\n<parameter name="tags">["rain", "wind"]</parameter>\n'
               "</invoke>\n</minimax:tool_call>[e~[\n]~b]tool\n<response>sunny, 21C</response>[e~[\n"
               "]~b]ai\n<think>\n")
    assert text.endswith(written)
    assert initial_mode(REASONING_FORMATS["minimax_m2"], tail, None) == "reasoning"


def test_history_call_parses_back_to_the_same_call(tokenizer: Any) -> None:
    """The rendered assistant turn is what the model wrote: parsed, it gives back its thinking and typed call."""
    text, _, _ = render(tokenizer, agent_turn())
    start = text.index("]~b]ai\n", text.index("Weather in Paris?")) + len("]~b]ai\n")
    turn = text[start:text.index("[e~[", start)]
    r = check_all(turn, n_random=10, prompt_tail="]~b]ai\n")
    assert (r.reasoning, r.content) == ("I need the weather tool.", "")
    assert arguments(r) == [("get_weather", WEATHER)]


def test_thinking_of_earlier_turns_is_dropped_and_content_think_tags_are_read(tokenizer: Any) -> None:
    """The template keeps thinking only after the last user message; a client that sends the thinking back inside
    the content (`<think>...</think>answer`, MiniMax's advice for OpenAI clients) gets it rendered as the model wrote
    it (the template's own split would keep extra newlines: the server marks control tokens typed in messages)."""
    earlier = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
               {"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "<think>\ncheck it\n</think>\n\nLet me look."}]
    text, _, _ = render(tokenizer, earlier)
    assert "greet back" not in text
    assert "]~b]ai\nHello![e~[\n" in text
    assert "]~b]ai\n<think>\ncheck it\n</think>\n\nLet me look.[e~[\n" in text


def test_tool_grammar_holds_what_the_template_writes_and_the_parser_reads(tokenizer: Any) -> None:
    """tool_choice required / auto with strict tools: xgrammar's `minimax_xml` calls accept the template's rendering
    of a call (which the parser reads back) and refuse arguments off the schema."""
    from reasoning_engine.server.protocol import FunctionDef
    from reasoning_engine.server.tool_grammar import tool_call_tag
    from reasoning_engine.structured.compiler import GrammarCompiler
    from reasoning_engine.structured.params import StructuredOutputsParams

    text, _, _ = render(tokenizer, agent_turn())
    start = text.index("<minimax:tool_call>", text.index("Weather in Paris?"))
    rendered = text[start:text.index("[e~[", start)]
    assert rendered == block(invoke("get_weather", location="Paris", days="3", tags='["rain", "wind"]'))
    two = block(invoke("get_weather", location="Paris"), invoke("search_web", query_list='["x"]'))
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.convert_tokens_to_ids("[e~[")])
    tools = [FunctionDef(name=name, parameters=schema) for name, schema in SCHEMAS.items()]

    def accepts(required: bool, parallel: bool, output: str, offered: list[FunctionDef] = tools) -> bool:
        spec = StructuredOutputsParams(structural_tag=tool_call_tag("minimax_m2", offered, required=required,
                                                                    parallel=parallel))
        ids = tokenizer.encode(output, add_special_tokens=False)
        return compiler.matcher(spec).accept_prefix(ids) == len(ids)

    assert accepts(True, True, rendered) and accepts(True, True, two) and accepts(False, True, "Let me see.\n" + two)
    assert not accepts(True, False, two)  # parallel_tool_calls false: one call
    assert not accepts(True, True, rendered.replace(">3<", ">three<"))  # days is an integer
    assert not accepts(True, True, "It is sunny.")
    loose = [FunctionDef(name="f", parameters={"type": "object", "properties": {"p": {"type": "array"}}})]
    assert accepts(True, True, block(invoke("f", p='["x", 1]')), loose)  # an array without `items`: any items
    assert arguments(check_all("</think>" + two, n_random=5)) == [("get_weather", {"location": "Paris"}),
                                                                  ("search_web", {"query_list": ["x"]})]


MODEL_OUTPUT = ("I need the weather tool.\n</think>\n\n" + block(invoke("get_weather", location="Paris", days="3",
                                                                       tags='["rain", "wind"]')) + "[e~[")
OPENAI_TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]


def test_server_parses_minimax_calls_and_renders_the_thinking_back(tokenizer: Any) -> None:
    """Through the real app (a scripted engine for model_type minimax_m2, parsers left on `auto`): the thinking and
    typed tool calls come back the same streamed or not, and the next turn's prompt renders that thinking back."""
    import openai

    from reasoning_engine.server.app import ServerConfig, build_app

    from .fake_engine import FakeEngine, FakeModelConfig
    from .helpers import LiveServer, stream_chat

    engine = FakeEngine(tokenizer, lambda _prompt, _params, _index: MODEL_OUTPUT,
                        model_config=FakeModelConfig(model_type="minimax_m2"))
    with LiveServer(build_app(engine, ServerConfig())) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        request = {"model": "fake-model", "messages": agent_turn()[:2], "tools": OPENAI_TOOLS}
        choice = client.chat.completions.create(**request).choices[0]
        streamed = stream_chat(client, **request)
        assert choice.finish_reason == streamed["finish"] == "tool_calls"
        assert choice.message.reasoning_content == streamed["reasoning"] == "I need the weather tool."
        assert not choice.message.content and not streamed["content"]
        (call,) = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", WEATHER)
        assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
            ("get_weather", call.function.arguments)]
        history = [*agent_turn()[:2], choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
        client.chat.completions.create(**{**request, "messages": history})
    prompt = tokenizer.decode(engine.calls[-1][0], skip_special_tokens=False)
    assert prompt.endswith("]~b]ai\n<think>\nI need the weather tool.\n</think>\n\n\n" + block(invoke(
        "get_weather", location="Paris", days="3", tags='["rain", "wind"]')) + "[e~[\n]~b]tool\n<response>sunny, 21C"
        "</response>[e~[\n]~b]ai\n<think>\n")


def test_append_think_content_goes_back_into_the_history(tokenizer: Any) -> None:
    """`--reasoning-parser minimax_m2_append_think`: the answer's content carries the thinking, and a client that
    appends that message as is gets the turn rendered back as the model wrote it."""
    import openai

    from reasoning_engine.server.app import ServerConfig, build_app

    from .fake_engine import FakeEngine, FakeModelConfig
    from .helpers import LiveServer

    engine = FakeEngine(tokenizer, lambda _prompt, _params, _index: MODEL_OUTPUT,
                        model_config=FakeModelConfig(model_type="minimax_m2"))
    config = ServerConfig(reasoning_parser="minimax_m2_append_think")
    with LiveServer(build_app(engine, config)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        request = {"model": "fake-model", "messages": agent_turn()[:2], "tools": OPENAI_TOOLS}
        message = client.chat.completions.create(**request).choices[0].message
        assert message.content == "<think>I need the weather tool.\n</think>"  # as written after the prompt's
        assert getattr(message, "reasoning_content", None) is None
        history = [*agent_turn()[:2], message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny, 21C"}]
        client.chat.completions.create(**{**request, "messages": history})
    prompt = tokenizer.decode(engine.calls[-1][0], skip_special_tokens=False)
    assert "]~b]ai\n<think>\nI need the weather tool.\n</think>\n\n\n<minimax:tool_call>\n" in prompt
