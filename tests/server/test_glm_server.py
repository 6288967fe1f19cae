"""A GLM-4.5 model served end to end: the tiny random glm4_moe checkpoint with a GLM-format tokenizer and GLM-4.6's
chat template. `auto` picks the glm45 parsers; tool_choice "required" / named hold the random model to a valid call
in GLM's XML format (the glm_xml grammar), which the server returns as OpenAI tool calls, streamed and not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from reasoning_engine.server.app import ServerConfig, build_app

from .helpers import LiveServer, stream_chat, tiny_chat_engine
from .test_glm_parsers import save_glm_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city", "days"],
                   "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CONVERT = {"type": "function", "function": {
    "name": "convert", "description": "Convert a length.",
    "parameters": {"type": "object", "required": ["unit", "n"],
                   "properties": {"unit": {"enum": ["m", "km"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CONVERT)}
QUESTION = [{"role": "user", "content": "Weather in Oslo for 2 days?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    llm = tiny_chat_engine(tiny_checkpoint("glm4_moe").path, Path(tmp_path_factory.mktemp("glm_served")) / "glm",
                           lambda folder: save_glm_tokenizer(folder).convert_tokens_to_ids("<|endoftext|>"))
    yield llm
    llm.shutdown_sync()


@pytest.fixture(scope="module")
def client(engine: Any) -> Iterator[openai.OpenAI]:
    with LiveServer(build_app(engine, ServerConfig(shutdown_engine=False))) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "convert"}}])
def test_forced_tool_calls_come_back_as_openai_calls(client: openai.OpenAI, tool_choice: Any) -> None:
    kwargs = dict(model="glm", messages=QUESTION, tools=[WEATHER, CONVERT], tool_choice=tool_choice,
                  parallel_tool_calls=False, temperature=0, max_tokens=200, extra_body=NO_THINKING)
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    if isinstance(tool_choice, dict):
        assert call.function.name == "convert"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    streamed = stream_chat(client, **kwargs)
    assert streamed["finish"] == "tool_calls" and streamed["content"] == ""
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
        (call.function.name, call.function.arguments)]
