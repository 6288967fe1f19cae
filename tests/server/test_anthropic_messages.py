"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the real `anthropic` SDK.

The HTTP shape (events, errors, auth, what reaches the engine) runs against the scripted fake engine; what needs a
model that answers (greedy stream == whole reply, thinking on and off, the calculator round trip, stop reasons,
token counts) runs against one module-scoped server of the bundled tiny model. The newest SDK has no `temperature`
argument any more (newer Claude models fix it), so greedy decoding goes in `extra_body`, as the API still takes it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from reasoning_engine.outputs import CompletionOutput, RequestOutput
from reasoning_engine.server.anthropic.translate import call_id, tool_use_id
from reasoning_engine.server.app import ServerConfig, build_app

from .fake_engine import FakeEngine, FakeModelConfig
from .helpers import LiveServer, wait_for
from .test_real_server import BUNDLED, context_length

THINK_CALL = ("Add them.</think>Let me compute.<|tool_calls_section_begin|><|tool_call_begin|>functions.calculator:0"
              '<|tool_call_argument_begin|>{"expression": "2 + 3"}<|tool_call_end|><|tool_calls_section_end|>'
              "<|im_end|>")
CALCULATOR = [{"name": "calculator", "description": "Evaluate an arithmetic expression.",
               "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}},
                                "required": ["expression"]}}]
GREEDY = {"extra_body": {"temperature": 0}}
QUESTION = [{"role": "user", "content": "What is 347 + 589?"}]
USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "calculator",
                                         "input": {"expression": "347 + 589"}}]}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "936"}


def sdk(url: str, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def raw_events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event; every event's name must equal its data's `type`."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            assert data["type"] == name, (name, data)
            events.append((name, data))
    return events


def blocks(message: Any) -> list[dict[str, Any]]:
    return [block.to_dict() for block in message.content]


def test_tool_ids_round_trip_and_foreign_ids_pass_through() -> None:
    for native in ("functions.calculator:0", "functions.get-weather_2:13", f"call_{'ab' * 12}"):
        anthropic_id = tool_use_id(native)
        assert anthropic_id.startswith("toolu_") and anthropic_id[6:].replace("-", "").replace("_", "").isalnum()
        assert call_id(anthropic_id) == native
    for foreign in ("toolu_01A09q90qw90lq917835lq9", "toolu_", "toolu_abc", "call_42"):
        assert call_id(foreign) == foreign


# ---- HTTP shape, with the fake engine ---------------------------------------------------------------------

def test_whole_and_streamed_reply_with_thinking_text_and_tool_use(fake_server: Any) -> None:
    _, url = fake_server(THINK_CALL, engine_options={"tokens_per_step": 3})
    kwargs = {"model": "fake-model", "max_tokens": 200, "messages": [{"role": "user", "content": "2 + 3?"}],
              "tools": CALCULATOR}
    whole = sdk(url).messages.create(**kwargs)
    assert [b["type"] for b in blocks(whole)] == ["thinking", "text", "tool_use"]
    thinking, text, call = blocks(whole)
    assert thinking["thinking"] == "Add them." and thinking["signature"]
    assert text["text"] == "Let me compute."
    assert call["name"] == "calculator" and call["input"] == {"expression": "2 + 3"}
    assert call["id"].startswith("toolu_") and call_id(call["id"]) == "functions.calculator:0"
    assert whole.id.startswith("msg_") and whole.stop_reason == "tool_use" and whole.stop_sequence is None
    assert whole.usage.output_tokens > whole.usage.output_tokens_details.thinking_tokens > 0

    with sdk(url).messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert blocks(streamed) == blocks(whole)
    assert streamed.stop_reason == "tool_use"
    assert streamed.usage.to_dict() == whole.usage.to_dict()

    with httpx.stream("POST", f"{url}/v1/messages", json={**kwargs, "stream": True}, timeout=30) as response:
        events = raw_events(response)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert events[0][1]["message"]["content"] == [] and events[0][1]["message"]["stop_reason"] is None
    deltas = [data["delta"]["type"] for name, data in events if name == "content_block_delta"]
    assert {"thinking_delta", "signature_delta", "text_delta", "input_json_delta"} == set(deltas)
    starts = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert [s["type"] for s in starts] == ["thinking", "text", "tool_use"] and starts[2]["input"] == {}
    assert names.count("content_block_stop") == 3
    arguments = "".join(data["delta"]["partial_json"] for name, data in events
                        if name == "content_block_delta" and data["delta"]["type"] == "input_json_delta")
    assert json.loads(arguments) == {"expression": "2 + 3"}
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_request_translation_reaches_the_template_and_the_engine(fake_server: Any, kimi_tokenizer: Any) -> None:
    engine, url = fake_server("Retry.</think>Done.<|im_end|>")
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Compute 2 + 3."}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
            {"type": "tool_use", "id": tool_use_id("functions.calculator:0"), "name": "calculator",
             "input": {"expression": "2 + 3"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": tool_use_id("functions.calculator:0"), "is_error": True,
             "content": [{"type": "text", "text": "boom"}]},
            {"type": "text", "text": "Try again."}]},
    ]
    reply = sdk(url).messages.create(
        model="fake-model", max_tokens=50, system=[{"type": "text", "text": "Be brief.", "cache_control":
                                                    {"type": "ephemeral"}}],
        messages=history, tools=CALCULATOR, stop_sequences=["STOP"], metadata={"user_id": "session-7"},
        thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7},
        extra_headers={"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"})
    assert [b["type"] for b in blocks(reply)] == ["thinking", "text"] and reply.content[1].text == "Done."
    assert reply.stop_reason == "end_turn"
    prompt_ids, params = engine.calls[-1]
    prompt = kimi_tokenizer.decode(prompt_ids)
    assert prompt.startswith('<|im_system|>tool_declare<|im_middle|>[{"type": "function"')
    assert "<|im_system|>system<|im_middle|>Be brief.<|im_end|>" in prompt
    assert ("<think>Use the tool.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.calculator:0"
            '<|tool_call_argument_begin|>{"expression": "2 + 3"}<|tool_call_end|>') in prompt
    assert "## Return of functions.calculator:0\nError: boom<|im_end|>" in prompt
    assert prompt.endswith("<|im_user|>user<|im_middle|>Try again.<|im_end|><|im_assistant|>assistant<|im_middle|>"
                           "<think>")
    assert (params.temperature, params.top_p, params.top_k, params.stop_strings) == (0.5, 0.9, 7, ["STOP"])
    assert params.max_tokens == 50 and params.thinking_token_budget == 1024  # interleaved: the budget may pass it
    assert engine.sessions[-1] == ("session-7", "agent")

    sdk(url).messages.create(model="fake-model", max_tokens=5, messages=QUESTION, tools=CALCULATOR,
                             tool_choice={"type": "none"}, thinking={"type": "disabled"})
    prompt = kimi_tokenizer.decode(engine.calls[-1][0])
    assert "tool_declare" not in prompt and prompt.endswith("<think></think>")


def test_final_assistant_message_is_a_prefill(fake_server: Any, kimi_tokenizer: Any) -> None:
    engine, url = fake_server(" 936.<|im_end|>")
    reply = sdk(url).messages.create(model="fake-model", max_tokens=20, messages=[
        *QUESTION, {"role": "assistant", "content": "The sum is"}])
    assert kimi_tokenizer.decode(engine.calls[-1][0]).endswith("<think></think>The sum is")
    assert blocks(reply) == [{"type": "text", "text": "936."}]


def test_max_tokens_past_the_context_is_cut_to_it(fake_server: Any) -> None:
    engine, url = fake_server("x" * 100, engine_options={"model_config": FakeModelConfig(max_model_len=64)})
    reply = sdk(url).messages.create(model="fake-model", max_tokens=10_000, messages=[{"role": "user", "content": "hi"}],
                                     thinking={"type": "disabled"})
    prompt_ids, params = engine.calls[-1]
    assert params.max_tokens == 64 - len(prompt_ids)
    assert reply.stop_reason == "model_context_window_exceeded" and reply.usage.output_tokens == params.max_tokens
    short = sdk(url).messages.create(model="fake-model", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


BAD_BODIES = [
    ({"messages": QUESTION}, "max_tokens"),
    ({"max_tokens": 0, "messages": QUESTION}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "calculator", "input": {}}]}]}, "messages[0].content[0]"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, {
        "type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     "messages[0].content[1]"),
    ({"max_tokens": 5, "messages": QUESTION, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 5, "messages": QUESTION, "top_p": 0}, "top_p"),
    ({"max_tokens": 5, "messages": QUESTION, "stop_sequences": [""]}, "stop_sequences"),
    ({"max_tokens": 5, "messages": QUESTION, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 5, "messages": QUESTION, "tools": CALCULATOR, "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice.name"),
    ({"max_tokens": 5, "messages": QUESTION, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0]"),
    ({"max_tokens": 5, "messages": QUESTION, "thinking": {"type": "enabled", "budget_tokens": 0}},
     "thinking.budget_tokens"),
    ({"max_tokens": 2000, "messages": QUESTION, "thinking": {"type": "enabled", "budget_tokens": 1023}},
     "thinking.budget_tokens"),
    ({"max_tokens": 1024, "messages": QUESTION, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "thinking.budget_tokens"),
    ({"max_tokens": 5, "messages": QUESTION, "metadata": {"user_id": "u" * 300}}, "metadata.user_id"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [RESULT]}]}, "messages[0].content[0].tool_use_id"),
    ({"max_tokens": 5, "messages": [*QUESTION, USE, {"role": "user", "content": [RESULT, {**RESULT, "tool_use_id":
                                                                                         "toolu_other"}]}]},
     "messages[2].content[1].tool_use_id"),
    ({"max_tokens": 5, "messages": [*QUESTION, USE, {"role": "user", "content": [RESULT]},
                                    {"role": "assistant", "content": "Done."}, {"role": "user", "content": [RESULT]}]},
     "messages[4].content[0].tool_use_id"),
]


@pytest.mark.parametrize(("body", "param"), BAD_BODIES, ids=[p for _, p in BAD_BODIES])
def test_bad_requests_are_400_in_anthropic_shape_naming_the_param(fake_server: Any, body: dict[str, Any],
                                                                   param: str) -> None:
    engine, url = fake_server("ok")
    response = httpx.post(f"{url}/v1/messages", json={"model": "fake-model", **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(param), (param, error)
    assert not engine.calls


def test_error_statuses_and_sdk_exceptions(fake_server: Any) -> None:
    _, url = fake_server("ok")
    with pytest.raises(anthropic.NotFoundError) as not_found:
        sdk(url).messages.create(model="claude-sonnet-4-5", max_tokens=5, messages=QUESTION)
    assert not_found.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        sdk(url).messages.count_tokens(model="fake-model", messages=[])
    broken = httpx.post(f"{url}/v1/messages", content=b"{not json", timeout=30)
    assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"
    for method, path, status in [("GET", "/v1/messages", 405), ("POST", "/v1/messages/batches", 404)]:
        response = httpx.request(method, f"{url}{path}", timeout=30)
        assert response.status_code == status and response.json()["type"] == "error", response.text
    assert "error" in httpx.post(f"{url}/v1/chat/completions", json={}, timeout=30).json()  # OpenAI's shape there


def test_count_tokens_checks_tool_results_and_the_thinking_floor(fake_server: Any) -> None:
    """count_tokens has no max_tokens, so only the budget's floor applies there; a tool_result still needs its
    tool_use in the message before."""
    _, url = fake_server("ok")
    for body, param in [({"messages": [{"role": "user", "content": [RESULT]}]}, "messages[0].content[0].tool_use_id"),
                        ({"messages": QUESTION, "thinking": {"type": "enabled", "budget_tokens": 1000}},
                         "thinking.budget_tokens")]:
        response = httpx.post(f"{url}/v1/messages/count_tokens", json={"model": "fake-model", **body}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["message"].startswith(param), response.text
    answered = {"model": "fake-model", "messages": [*QUESTION, USE, {"role": "user", "content": [RESULT]}],
                "thinking": {"type": "enabled", "budget_tokens": 50_000}}
    assert httpx.post(f"{url}/v1/messages/count_tokens", json=answered, timeout=30).json()["input_tokens"] > 0


def test_x_api_key_and_bearer(fake_server: Any) -> None:
    _, url = fake_server("ok<|im_end|>", api_key="s3cret")
    ok = sdk(url, "s3cret").messages.create(model="fake-model", max_tokens=5, messages=QUESTION)
    assert ok.stop_reason == "end_turn"
    with pytest.raises(anthropic.AuthenticationError) as denied:
        sdk(url, "wrong").messages.create(model="fake-model", max_tokens=5, messages=QUESTION)
    assert denied.value.status_code == 401 and denied.value.body["error"]["type"] == "authentication_error"
    bearer = httpx.post(f"{url}/v1/messages/count_tokens", json={"model": "fake-model", "messages": QUESTION},
                        headers={"Authorization": "Bearer s3cret"}, timeout=30)
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0
    for headers in ({"Authorization": "Bearer s3cret"}, {"x-api-key": "s3cret"}):
        assert httpx.get(f"{url}/v1/models", headers=headers, timeout=30).status_code == 200
    openai_denied = httpx.get(f"{url}/v1/models", headers={"x-api-key": "wrong"}, timeout=30)
    assert openai_denied.status_code == 401 and openai_denied.json()["error"]["code"] == "invalid_api_key"


class _FailingEngine(FakeEngine):
    """Generates two tokens of a thinking, then fails as an engine step could."""

    async def generate(self, prompt: list[int], params: Any, request_id: str, session_id: str | None = None,
                       workload: str = "default") -> Any:
        for text in ("Think", "Thinking"):  # cumulative, as the engine's outputs are
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            yield RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=list(prompt), finished=False,
                                outputs=[CompletionOutput(index=0, text=text, token_ids=ids, finish_reason=None)])
        raise RuntimeError("the step failed")


def test_failure_after_the_stream_started_is_an_error_event(kimi_tokenizer: Any) -> None:
    engine = _FailingEngine(kimi_tokenizer, lambda *_: "")
    with LiveServer(build_app(engine, ServerConfig())) as live:
        body = {"model": "fake-model", "max_tokens": 20, "messages": QUESTION, "stream": True}
        with httpx.stream("POST", f"{live.url}/v1/messages", json=body, timeout=30) as response:
            events = raw_events(response)
        assert [name for name, _ in events][:2] == ["message_start", "ping"]
        assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "api_error"
        assert "the step failed" in events[-1][1]["error"]["message"]
        with pytest.raises(anthropic.APIStatusError), sdk(live.url).messages.stream(**{
                k: v for k, v in body.items() if k != "stream"}) as stream:
            stream.get_final_message()


def test_client_disconnect_aborts_the_engine_request(fake_server: Any) -> None:
    engine, url = fake_server("y" * 4000, engine_options={"delay": 0.01})
    body = {"model": "fake-model", "max_tokens": 4000, "messages": QUESTION, "stream": True}
    with httpx.stream("POST", f"{url}/v1/messages", json=body, timeout=30) as response:
        lines = response.iter_lines()
        for _ in range(12):
            next(lines)
        assert engine.stats().num_requests_running == 1
    assert wait_for(lambda: engine.stats().num_requests_running == 0)
    assert engine._aborted, "the engine request was aborted"


# ---- the bundled model ------------------------------------------------------------------------------------

needs_bundled = pytest.mark.skipif(BUNDLED is None, reason="the bundled tiny model's files are not present")


@pytest.fixture(scope="module")
def model_server() -> Iterator[str]:
    from reasoning_engine.engine.async_engine import AsyncLLM

    assert BUNDLED is not None
    llm = AsyncLLM(model=str(BUNDLED), device="cpu", max_model_len=context_length(BUNDLED), kv_cache_blocks=128,
                   block_size=16, max_num_seqs=4)
    try:
        with LiveServer(build_app(llm, ServerConfig(shutdown_engine=False))) as live:
            yield live.url
    finally:
        llm.shutdown_sync()


@pytest.fixture(scope="module")
def client(model_server: str) -> anthropic.Anthropic:
    return sdk(model_server)


@needs_bundled
def test_create_and_stream_agree(client: anthropic.Anthropic) -> None:
    kwargs = {"model": "tiny-reasoner", "max_tokens": 200, "messages": QUESTION, **GREEDY}
    whole = client.messages.create(**kwargs)
    assert [b["type"] for b in blocks(whole)] == ["thinking", "text"]
    assert whole.stop_reason == "end_turn" and "936" in whole.content[1].text
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens > 0
    assert 0 < whole.usage.output_tokens_details.thinking_tokens < whole.usage.output_tokens
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert text == whole.content[1].text
    assert blocks(streamed) == blocks(whole) and streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens


@needs_bundled
def test_thinking_enabled_and_disabled(client: anthropic.Anthropic) -> None:
    base = {"model": "tiny-reasoner", "max_tokens": 200, "messages": QUESTION, **GREEDY}
    on = client.messages.create(**{**base, "max_tokens": 1025}, thinking={"type": "enabled", "budget_tokens": 1024})
    assert on.content[0].type == "thinking" and on.content[0].thinking and on.content[0].signature
    off = client.messages.create(**base, thinking={"type": "disabled"})
    assert all(block.type == "text" for block in off.content) and off.content
    assert off.usage.output_tokens_details.thinking_tokens == 0
    omitted = client.messages.create(**base, thinking={"type": "adaptive", "display": "omitted"})
    assert omitted.content[0].type == "thinking" and omitted.content[0].thinking == ""
    assert omitted.content[0].signature == on.content[0].signature  # the same thinking, not shown


@needs_bundled
def test_calculator_round_trip(client: anthropic.Anthropic) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 4821 * 377?"}]
    kwargs = {"model": "tiny-reasoner", "max_tokens": 300, "tools": CALCULATOR, **GREEDY}
    call = client.messages.create(messages=messages, **kwargs)
    assert call.stop_reason == "tool_use"
    use = call.content[-1]
    assert use.type == "tool_use" and use.name == "calculator" and use.input == {"expression": "4821 * 377"}
    with client.messages.stream(messages=messages, **kwargs) as stream:
        assert blocks(stream.get_final_message()) == blocks(call)
    messages += [{"role": "assistant", "content": blocks(call)},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": str(4821 * 377)}]}]
    answer = client.messages.create(messages=messages, **kwargs)
    assert answer.stop_reason == "end_turn"
    assert "1817517" in "".join(block.text for block in answer.content if block.type == "text")
    counted = client.messages.count_tokens(model="tiny-reasoner", messages=messages, tools=CALCULATOR)
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert answer.usage.cache_read_input_tokens > 0, "the earlier turns came from the prefix cache"
    without_tools = client.messages.count_tokens(model="tiny-reasoner", messages=messages)
    assert without_tools.input_tokens < counted.input_tokens


@needs_bundled
def test_stop_sequence_and_max_tokens(client: anthropic.Anthropic) -> None:
    base = {"model": "tiny-reasoner", "messages": QUESTION, **GREEDY}
    full = client.messages.create(max_tokens=200, **base)
    thinking = full.content[0].thinking
    stop = thinking[10:14]
    stopped = client.messages.create(max_tokens=200, stop_sequences=[stop], **base)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].thinking == thinking[:thinking.index(stop)].rstrip()
    short = client.messages.create(max_tokens=4, **base)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 4
