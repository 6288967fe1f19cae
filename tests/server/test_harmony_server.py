"""gpt-oss over HTTP with the fake engine: a harmony tokenizer (one token per character plus the harmony special
tokens) and a harmony-shaped template; the parsers are chosen automatically from model_type, the analysis channel
comes back as reasoning_content, the final one as content, a commentary call as tool_calls, streamed or not,
`reasoning_effort` reaches the template, and tool_choice / response_format grammars let the analysis through."""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reasoning_engine.sampling_params import SamplingParams
from reasoning_engine.server.app import ServerConfig, build_app
from reasoning_engine.server.formats.harmony import HARMONY_MARKERS

from .fake_engine import FakeEngine
from .helpers import LiveServer
from .test_http import client, collect_stream

TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% for m in messages %}{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}"
    "<|end|>{% endif %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
ANSWER = ("<|channel|>analysis<|message|>The user greets me.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>")
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
JSON_ANSWER = ("<|channel|>analysis<|message|>They want JSON.<|end|>"
               '<|start|>assistant<|channel|>final<|message|>{"a": 1}<|return|>')


def _harmony_tokenizer(folder: Path) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<unk>", *dict.fromkeys(string.printable)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": [m for m in HARMONY_MARKERS if m != "<|return|>"]})
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture
def harmony_server(tmp_path: Path) -> Iterator[tuple[FakeEngine, str]]:
    def script(prompt: list[int], params: SamplingParams, i: int) -> str:
        if "weather" in engine.tokenizer.decode(prompt):
            return CALL
        return ANSWER if params.structured_outputs is None else JSON_ANSWER

    engine = FakeEngine(_harmony_tokenizer(tmp_path / "tok"), script)
    engine.model_config.model_type = "gpt_oss"
    with LiveServer(build_app(engine, ServerConfig())) as server:
        yield engine, server.url


def test_analysis_final_and_reasoning_effort(harmony_server: tuple[FakeEngine, str]) -> None:
    engine, url = harmony_server
    messages = [{"role": "user", "content": "hi"}]
    result = client(url).chat.completions.create(model="fake-model", messages=messages,
                                                 extra_body={"reasoning_effort": "high"})
    message = result.choices[0].message
    assert (message.reasoning_content, message.content) == ("The user greets me.", "Hello there!")
    prompt = engine.tokenizer.decode(engine.calls[-1][0], skip_special_tokens=False)
    assert "Reasoning: high" in prompt and prompt.endswith("<|start|>assistant")
    client(url).chat.completions.create(model="fake-model", messages=messages)
    assert "Reasoning: medium" in engine.tokenizer.decode(engine.calls[-1][0], skip_special_tokens=False)
    out = collect_stream(client(url).chat.completions.create(model="fake-model", messages=messages, stream=True))
    assert (out["reasoning"], out["content"]) == ("The user greets me.", "Hello there!")
    assert out["order"].index("content") > out["order"].index("reasoning")
    for piece in (out["reasoning"], out["content"]):
        assert not any(m in piece for m in HARMONY_MARKERS)


def test_commentary_call_is_a_tool_call(harmony_server: tuple[FakeEngine, str]) -> None:
    _, url = harmony_server
    messages = [{"role": "user", "content": "weather in Paris?"}]
    result = client(url).chat.completions.create(model="fake-model", messages=messages, tools=TOOLS)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "Need the weather."
    assert not choice.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    out = collect_stream(client(url).chat.completions.create(model="fake-model", messages=messages, tools=TOOLS,
                                                             stream=True))
    assert out["finish"] == "tool_calls" and out["reasoning"] == "Need the weather." and out["content"] == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in out["calls"].values()] == [("get_weather", {"city": "Paris"})]


def test_reasoning_effort_outside_low_medium_high_is_400(harmony_server: tuple[FakeEngine, str]) -> None:
    import openai

    _, url = harmony_server
    with pytest.raises(openai.BadRequestError) as err:
        client(url).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                            extra_body={"reasoning_effort": "extreme"})
    assert "reasoning_effort" in str(err.value)


def test_earlier_analysis_reaches_the_template(harmony_server: tuple[FakeEngine, str]) -> None:
    """An assistant turn's reasoning_content comes back as `thinking`, the message key gpt-oss's template reads."""
    engine, url = harmony_server
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Hello there!", "reasoning_content": "They greet me."},
                {"role": "user", "content": "again"}]
    client(url).chat.completions.create(model="fake-model", messages=messages)
    prompt = engine.tokenizer.decode(engine.calls[-1][0], skip_special_tokens=False)
    assert "<|channel|>analysis<|message|>They greet me.<|end|><|start|>assistant<|message|>Hello there!" in prompt


def _accepts_through_the_stop_token(engine: FakeEngine, output: str) -> bool:
    """The last request's constraint takes the scripted output whole, its closing `<|call|>` / `<|return|>` (the
    engine's EOS ids, outside the grammar) included, and is then finished."""
    from reasoning_engine.structured.compiler import GrammarCompiler

    tokenizer = engine.tokenizer
    spec = engine.calls[-1][1].structured_outputs
    assert spec is not None and spec.kind == "structural_tag"
    stops = tokenizer.convert_tokens_to_ids(["<|call|>", "<|return|>"])
    matcher = GrammarCompiler(tokenizer, len(tokenizer), stops).matcher(spec)
    ids = tokenizer.encode(output, add_special_tokens=False)
    return matcher.accept_prefix(ids) == len(ids) and matcher.is_terminated


def test_required_and_named_tool_choice_hold_the_call_after_the_analysis(
        harmony_server: tuple[FakeEngine, str]) -> None:
    """gpt-oss's harmony calls can be constrained: the grammar (applied from the first output token, as gpt-oss has
    no `</think>`) lets the analysis message through, then holds one call."""
    engine, url = harmony_server
    messages = [{"role": "user", "content": "weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        result = client(url).chat.completions.create(model="fake-model", messages=messages, tools=TOOLS,
                                                     tool_choice=choice)
        message = result.choices[0].message
        assert result.choices[0].finish_reason == "tool_calls" and message.reasoning_content == "Need the weather."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            ("get_weather", {"city": "Paris"})]
        assert _accepts_through_the_stop_token(engine, CALL)


def test_response_format_lets_the_analysis_come_first(harmony_server: tuple[FakeEngine, str]) -> None:
    """An answer format on gpt-oss holds the final message, not the first token: the analysis comes first."""
    engine, url = harmony_server
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    result = client(url).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "json please"}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    message = result.choices[0].message
    assert (message.reasoning_content, message.content) == ("They want JSON.", '{"a": 1}')
    assert _accepts_through_the_stop_token(engine, JSON_ANSWER)
    assert not _accepts_through_the_stop_token(engine, '{"a": 1}<|return|>')  # no longer the first token
