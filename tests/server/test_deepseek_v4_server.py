"""A DeepSeek-V4 model served end to end: the tiny random deepseek_v4 checkpoint with a DeepSeek-format tokenizer and
no chat template, as V4 is released. `auto` picks the deepseek_v4 formats and the engine renders V4's prompt itself
(thinking on unless switched off); a named tool_choice holds the random model to a valid call in V4's DSML, which
the OpenAI and Anthropic APIs return as calls, streamed and not alike."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from models.test_chat_templates import save_deepseek_v32_tokenizer
from reasoning_engine.server.app import ServerConfig, build_app

from .helpers import LiveServer, sse_events, stream_chat, tiny_chat_engine

pytestmark = pytest.mark.slow  # a whole family served

CONVERT = {"type": "function", "function": {
    "name": "convert", "description": "Convert a length.",
    "parameters": {"type": "object", "required": ["unit", "n"],
                   "properties": {"unit": {"enum": ["m", "km"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "required": ["q"], "properties": {"q": {"type": "string"}}}}}
QUESTION = [{"role": "user", "content": "3 km in m?"}]
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def live(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from transformers import AutoTokenizer

    def save_tokenizer(folder: Path) -> int:
        return AutoTokenizer.from_pretrained(str(save_deepseek_v32_tokenizer(folder))).eos_token_id

    engine = tiny_chat_engine(tiny_checkpoint("deepseek_v4").path,
                              Path(tmp_path_factory.mktemp("dsv4_served")) / "dsv4", save_tokenizer)
    app = build_app(engine, ServerConfig(shutdown_engine=False))
    with LiveServer(app) as server:
        server.app = app  # type: ignore[attr-defined]
        yield server
    engine.shutdown_sync()


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_auto_picks_v4s_formats_and_renders_its_prompt(live: LiveServer) -> None:
    """No template in the checkpoint: the engine renders V4's prompt, thinking on by default and off on request."""
    serving = live.app.state.serving  # type: ignore[attr-defined]
    assert (serving.reasoning_parser, serving.tool_parser) == ("deepseek_v4", "deepseek_v4")

    def prompt(**extra: Any) -> str:
        body = httpx.post(f"{live.url}/tokenize", json={"messages": QUESTION, **extra}, timeout=60).json()
        return httpx.post(f"{live.url}/detokenize", json={"tokens": body["tokens"]}, timeout=60).json()["prompt"]

    assert prompt() == "<｜begin▁of▁sentence｜><｜User｜>3 km in m?<｜Assistant｜><think>"
    assert prompt(**NO_THINKING).endswith("<｜User｜>3 km in m?<｜Assistant｜></think>")
    with_tools = prompt(tools=[CONVERT])
    assert '"<｜DSML｜tool_calls>" block' in with_tools and with_tools.endswith("<｜Assistant｜><think>")


def test_a_named_tool_comes_back_as_an_openai_call(client: openai.OpenAI) -> None:
    kwargs = dict(model="dsv4", messages=QUESTION, tools=[CONVERT, SEARCH], parallel_tool_calls=False,
                  tool_choice={"type": "function", "function": {"name": "convert"}}, temperature=0, max_tokens=300,
                  extra_body=NO_THINKING)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "convert"
    jsonschema.validate(json.loads(call.function.arguments), CONVERT["function"]["parameters"])
    streamed = stream_chat(client, **kwargs)
    assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
        (call.function.name, call.function.arguments)]


def test_a_named_tool_comes_back_as_an_anthropic_tool_use(live: LiveServer) -> None:
    body = {"model": "dsv4", "max_tokens": 300, "temperature": 0, "messages": QUESTION,
            "tools": [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                      for t in (CONVERT, SEARCH)],
            "tool_choice": {"type": "tool", "name": "convert", "disable_parallel_tool_use": True},
            "thinking": {"type": "disabled"}}
    reply = httpx.post(f"{live.url}/v1/messages", json=body, timeout=300).json()
    assert reply["stop_reason"] == "tool_use"
    (use,) = [block for block in reply["content"] if block["type"] == "tool_use"]
    assert use["name"] == "convert"
    jsonschema.validate(use["input"], CONVERT["function"]["parameters"])
    with httpx.stream("POST", f"{live.url}/v1/messages", json={**body, "stream": True}, timeout=300) as response:
        events = list(sse_events(response))
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e.get("type") == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == use["input"]


def test_thinking_by_default_is_reasoning_content(client: openai.OpenAI) -> None:
    """No switch: the prompt opens `<think>`, so what the model writes first is its reasoning, streamed and not;
    switched off, it is the answer."""
    kwargs = dict(model="dsv4", messages=QUESTION, temperature=0, max_tokens=16)
    message = client.chat.completions.create(**kwargs).choices[0].message
    streamed = stream_chat(client, **kwargs)
    assert message.reasoning_content and streamed["order"][0] == "reasoning"
    assert (streamed["reasoning"], streamed["content"]) == (message.reasoning_content, message.content or "")
    off = client.chat.completions.create(**kwargs, extra_body=NO_THINKING).choices[0].message
    assert off.content and not getattr(off, "reasoning_content", None)
