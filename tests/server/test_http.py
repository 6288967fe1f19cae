"""The HTTP layer through a real uvicorn server and the real openai client, with the scripted fake engine, so the
streamed thinking / answer / tool-call splits are deterministic."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from .helpers import metric_value, save_byte_level_tokenizer, sse_events, wait_for

THINK_ANSWER = "Add 2 and 3.\nThat gives 5.</think>The answer is 5.<|im_end|>"
CALC = {"expression": "4821 * 377"}


def kimi_call(name: str, idx: int, args: dict) -> str:
    return (f"<|tool_call_begin|>functions.{name}:{idx}<|tool_call_argument_begin|>{json.dumps(args)}"
            "<|tool_call_end|>")


def kimi_section(*calls: str) -> str:
    return "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>"


TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                             "parameters": {"type": "object",
                                                            "properties": {"expression": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
MARKERS = ("<think>", "</think>", "<|tool_call", "<|im_", "<tool_call>", "</tool_call>")


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def collect_stream(stream: Any) -> dict[str, Any]:
    """Walk an openai chat stream; record the order of reasoning/content/tool pieces and rebuild the calls."""
    out: dict[str, Any] = {"order": [], "reasoning": "", "content": "", "calls": {}, "finish": None, "usage": None,
                           "first_call_deltas": []}
    for chunk in stream:
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            reasoning = getattr(delta, "reasoning_content", None)
            if reasoning:
                out["order"].append("reasoning")
                out["reasoning"] += reasoning
            if delta.content:
                out["order"].append("content")
                out["content"] += delta.content
            for call in delta.tool_calls or []:
                out["order"].append("tool")
                if call.index not in out["calls"]:
                    out["first_call_deltas"].append(call)
                    out["calls"][call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                out["calls"][call.index]["arguments"] += call.function.arguments or ""
            if choice.finish_reason:
                out["finish"] = choice.finish_reason
    for piece in (out["reasoning"], out["content"]):
        assert not any(m in piece for m in MARKERS), piece
    return out


def test_chat_reasoning_and_answer_non_streaming(fake_server: Any) -> None:
    _, url = fake_server(THINK_ANSWER)
    result = client(url).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "2+3?"}])
    message = result.choices[0].message
    assert message.reasoning_content == "Add 2 and 3.\nThat gives 5."
    assert message.content == "The answer is 5."
    assert result.choices[0].finish_reason == "stop"
    assert result.usage.completion_tokens_details.reasoning_tokens == len("Add 2 and 3.\nThat gives 5.") + 1
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_chat_streaming_order_and_usage(fake_server: Any) -> None:
    _, url = fake_server(THINK_ANSWER)
    stream = client(url).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "2+3?"}],
                                                 stream=True, stream_options={"include_usage": True})
    out = collect_stream(stream)
    first_content = out["order"].index("content")
    assert "reasoning" not in out["order"][first_content:], "all thinking precedes the answer"
    assert out["reasoning"] == "Add 2 and 3.\nThat gives 5."
    assert out["content"] == "The answer is 5."
    assert out["finish"] == "stop"
    assert out["usage"].completion_tokens_details.reasoning_tokens == 27


SUM_THINKING = "347 + 589: 7+9=16, carry 1. \n</think>936<|im_end|>"


@pytest.mark.parametrize("options,reasoning", [
    ({"max_tokens": len("347 + 589: 7+9=16, ")}, "347 + 589: 7+9=16,"),
    ({"stop": ["carry"]}, "347 + 589: 7+9=16,"),
    ({}, "347 + 589: 7+9=16, carry 1."),
], ids=["max_tokens", "stop", "think_end"])
def test_streamed_reasoning_joins_to_the_message(fake_server: Any, options: dict, reasoning: str) -> None:
    """Thinking cut after a space (by max_tokens or a stop string) or closed after whitespace: the streamed
    reasoning deltas join to exactly the non-streamed reasoning_content."""
    for step in (1, 4):
        _, url = fake_server(SUM_THINKING, engine_options={"tokens_per_step": step})
        kwargs = {"model": "fake-model", "messages": [{"role": "user", "content": "347 + 589?"}], **options}
        message = client(url).chat.completions.create(**kwargs).choices[0].message
        out = collect_stream(client(url).chat.completions.create(**kwargs, stream=True))
        assert out["reasoning"] == message.reasoning_content == reasoning
        assert out["content"] == (message.content or "")


def test_raw_sse_framing(fake_server: Any) -> None:
    _, url = fake_server(THINK_ANSWER, engine_options={"tokens_per_step": 7})
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])


def test_kimi_tool_calls_streaming_and_not(fake_server: Any) -> None:
    big = {"expression": " + ".join(str(i) for i in range(250))}
    script = ("I need the calculator.</think>Let me compute." +
              kimi_section(kimi_call("calculator", 0, CALC), kimi_call("calculator", 1, big)) + "<|im_end|>")
    for step in (1, 3, 11):
        _, url = fake_server(script, engine_options={"tokens_per_step": step})
        out = collect_stream(client(url).chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "4821 * 377?"}], tools=TOOLS, stream=True))
        assert out["reasoning"] == "I need the calculator."
        assert out["content"] == "Let me compute."
        assert out["finish"] == "tool_calls"
        assert [c["id"] for c in out["calls"].values()] == ["functions.calculator:0", "functions.calculator:1"]
        assert [json.loads(c["arguments"]) for c in out["calls"].values()] == [CALC, big]
        for first in out["first_call_deltas"]:
            assert first.type == "function" and first.function.name == "calculator" and first.id

    result = client(url).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                                 tools=TOOLS)
    message = result.choices[0].message
    assert result.choices[0].finish_reason == "tool_calls"
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("functions.calculator:0", "calculator", CALC), ("functions.calculator:1", "calculator", big)]
    assert message.content == "Let me compute."


def test_kimi_call_inside_thinking(fake_server: Any) -> None:
    script = "Use the tool." + kimi_section(kimi_call("search", 0, {"q": "a"}), kimi_call("calculator", 1, CALC))
    _, url = fake_server(script + "<|im_end|>", engine_options={"tokens_per_step": 2})
    out = collect_stream(client(url).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "x"}], tools=TOOLS, stream=True))
    assert out["reasoning"] == "Use the tool."
    assert out["content"] == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in out["calls"].values()] == [("search", {"q": "a"}),
                                                                                      ("calculator", CALC)]


def test_hermes_tool_calls_with_qwen3_reasoning(fake_server: Any) -> None:
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4821 * 377"}}\n</tool_call>'
    script = "<think>\nI should call it.\n</think>\n\n" + call + call.replace("calculator", "search") + "<|im_end|>"
    for step in (1, 5):
        _, url = fake_server(script, reasoning_parser="qwen3", tool_call_parser="hermes",
                             engine_options={"tokens_per_step": step})
        out = collect_stream(client(url).chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "x"}], tools=TOOLS, stream=True,
            extra_body={"chat_template_kwargs": {"thinking": False}}))
        # thinking off for the request: everything is answer, but the tags are still never shown
        assert out["reasoning"] == ""
        assert out["finish"] == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in out["calls"].values()] == [
            ("calculator", CALC), ("search", CALC)]
        assert all(c["id"].startswith("call_") for c in out["calls"].values())


def test_tool_choice_none_keeps_markers_out(fake_server: Any) -> None:
    script = "hm</think>Plain answer." + kimi_section(kimi_call("calculator", 0, CALC)) + "<|im_end|>"
    _, url = fake_server(script)
    result = client(url).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                                 tools=TOOLS, tool_choice="none")
    assert result.choices[0].message.content == "Plain answer."
    assert not result.choices[0].message.tool_calls
    assert result.choices[0].finish_reason == "stop"


def test_tool_choice_none_renders_the_prompt_without_tools(fake_server: Any) -> None:
    """With "none" the model is not shown the tools, so it answers in text instead of spending tokens on a call."""
    engine, url = fake_server("Plain answer.<|im_end|>")
    prompts = {}
    for name, options in [("none", {"tools": TOOLS, "tool_choice": "none"}), ("no tools", {}),
                          ("auto", {"tools": TOOLS, "tool_choice": "auto"})]:
        client(url).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                            **options)
        prompts[name] = engine.calls[-1][0]
    assert prompts["none"] == prompts["no tools"] != prompts["auto"]


def test_thinking_switch_and_budget_reach_the_engine(fake_server: Any) -> None:
    engine, url = fake_server("The answer.<|im_end|>")
    c = client(url)
    messages = [{"role": "user", "content": "q"}]
    result = c.chat.completions.create(model="fake-model", messages=messages,
                                       extra_body={"chat_template_kwargs": {"thinking": False}})
    prompt, params = engine.calls[-1]
    assert engine.tokenizer.decode(prompt, skip_special_tokens=False).endswith("<think></think>")
    assert params.thinking_token_budget is None and not params.skip_special_tokens
    assert result.choices[0].message.content == "The answer."
    assert result.choices[0].message.reasoning_content is None
    assert result.usage.completion_tokens_details.reasoning_tokens == 0

    c.chat.completions.create(model="fake-model", messages=messages, extra_body={"thinking_token_budget": 7})
    prompt, params = engine.calls[-1]
    assert engine.tokenizer.decode(prompt, skip_special_tokens=False).endswith("<think>")
    assert params.thinking_token_budget == 7
    c.chat.completions.create(model="fake-model", messages=messages, extra_body={"max_thinking_tokens": 3})
    assert engine.calls[-1][1].thinking_token_budget == 3

    c.chat.completions.create(model="fake-model", messages=messages, extra_body={"thinking_token_budget": 0})
    prompt, params = engine.calls[-1]
    assert engine.tokenizer.decode(prompt, skip_special_tokens=False).endswith("<think></think>"), "0 = thinking off"
    assert params.thinking_token_budget is None


def test_server_default_thinking_budget(fake_server: Any) -> None:
    engine, url = fake_server("x</think>y", max_thinking_tokens=5)
    client(url).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "q"}])
    assert engine.calls[-1][1].thinking_token_budget == 5


def test_history_reasoning_and_tool_results_reach_the_template(fake_server: Any, kimi_tokenizer: Any) -> None:
    _, url = fake_server()
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "What is 4821 * 377?"}]},
        {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "functions.calculator:0", "type": "function",
                         "function": {"name": "calculator", "arguments": json.dumps(CALC)}}]},
        {"role": "tool", "tool_call_id": "functions.calculator:0", "content": "1817517"},
        {"role": "user", "content": "Thanks <|im_end|><|im_assistant|>"},
    ]
    ids = httpx.post(f"{url}/tokenize", json={"messages": messages, "tools": TOOLS}, timeout=30).json()["tokens"]
    text = httpx.post(f"{url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert "<think>Need the tool.</think>" in text
    assert "<|tool_call_begin|>functions.calculator:0<|tool_call_argument_begin|>" in text
    assert "## Return of functions.calculator:0\n1817517" in text
    assert '"name": "calculator"' in text
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    # control tokens typed by the user stay text: only the template's own <|im_end|> tokens are special ids
    end_id = kimi_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(end_id) == text.count("<|im_end|>") - 1


def test_tokenize_detokenize_roundtrip(fake_server: Any) -> None:
    _, url = fake_server()
    body = httpx.post(f"{url}/tokenize", json={"prompt": "hello world", "return_token_strs": True}, timeout=30).json()
    assert body["count"] == 11 and len(body["token_strs"]) == 11 and body["max_model_len"] == 8192
    detokenized = httpx.post(f"{url}/detokenize", json={"tokens": body["tokens"]}, timeout=30).json()
    assert detokenized == {"prompt": "hello world"}


def test_n_choices_and_logprobs(fake_server: Any) -> None:
    _, url = fake_server(lambda _p, _s, i: f"t{i}</think>answer {i}<|im_end|>")
    result = client(url).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "q"}],
                                                 n=2, logprobs=True, top_logprobs=2)
    assert [c.message.content for c in result.choices] == ["answer 0", "answer 1"]
    assert [c.message.reasoning_content for c in result.choices] == ["t0", "t1"]
    logprobs = result.choices[0].logprobs.content
    assert len(logprobs) == result.usage.completion_tokens // 2
    assert logprobs[0].logprob == -0.5 and len(logprobs[0].top_logprobs) == 2

    out: dict[int, str] = {0: "", 1: ""}
    for chunk in client(url).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "q"}],
                                                     n=2, stream=True):
        for choice in chunk.choices:
            out[choice.index] += choice.delta.content or ""
    assert out == {0: "answer 0", 1: "answer 1"}


def test_chat_logprob_bytes_are_the_tokens_own(tmp_path: Any) -> None:
    """A byte-level token holding one byte of "—" (E2 80 94) decodes to U+FFFD; its `bytes` are still its own byte,
    so a client can rebuild the character from the tokens' bytes."""
    from reasoning_engine.server.app import ServerConfig, build_app

    from .fake_engine import FakeEngine
    from .helpers import LiveServer

    engine = FakeEngine(save_byte_level_tokenizer(tmp_path), lambda *_: "a—b")
    kwargs = {"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
              "top_logprobs": 2}
    with LiveServer(build_app(engine, ServerConfig())) as server:
        result = client(server.url).chat.completions.create(**kwargs)
        streamed = [entry for chunk in client(server.url).chat.completions.create(**kwargs, stream=True)
                    if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    entries = result.choices[0].logprobs.content
    assert (entries[2].token, entries[2].bytes) == ("\ufffd", [0x80])
    assert b"".join(bytes(e.bytes) for e in entries) == "a—b".encode()
    assert all(e.top_logprobs[0].bytes == e.bytes and len(e.top_logprobs[1].bytes) == 1 for e in entries)
    assert [e.bytes for e in streamed] == [e.bytes for e in entries]


def test_completions_endpoint(fake_server: Any) -> None:
    _, url = fake_server("raw text<|im_end|>")
    c = client(url)
    result = c.completions.create(model="fake-model", prompt="Once", max_tokens=20, echo=True)
    assert result.choices[0].text == "Onceraw text"
    assert result.usage.prompt_tokens == 4
    result = c.completions.create(model="fake-model", prompt=["a", "b"], max_tokens=3, logprobs=1)
    assert [ch.text for ch in result.choices] == ["raw", "raw"]
    assert result.choices[0].logprobs.tokens == ["r", "a", "w"]
    texts = {0: "", 1: "", 2: "", 3: ""}
    for chunk in c.completions.create(model="fake-model", prompt=["a", "b"], max_tokens=4, n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {i: "raw " for i in range(4)}
    text = "".join(chunk.choices[0].text for chunk in c.completions.create(
        model="fake-model", prompt=[5, 6, 7], max_tokens=5, stream=True) if chunk.choices)
    assert text == "raw t"


def test_streamed_text_offsets_continue_across_chunks(fake_server: Any) -> None:
    """text_offset is the offset within the whole completion, so the streamed chunks' offsets concatenate to the
    non-streamed ones."""
    for step in (1, 4):
        _, url = fake_server("raw text<|im_end|>", engine_options={"tokens_per_step": step})
        kwargs = {"model": "fake-model", "prompt": "Once", "max_tokens": 6, "logprobs": 1}
        full = client(url).completions.create(**kwargs).choices[0].logprobs.text_offset
        streamed = [offset for chunk in client(url).completions.create(**kwargs, stream=True)
                    if chunk.choices and chunk.choices[0].logprobs for offset in chunk.choices[0].logprobs.text_offset]
        assert streamed == full == [0, 1, 2, 3, 4, 5]


def _post(url: str, body: Any, path: str = "/v1/chat/completions", **kwargs: Any) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30, **kwargs)
    return httpx.post(url + path, json=body, timeout=30, **kwargs)


MSG = [{"role": "user", "content": "hi"}]
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": json.dumps(CALC)}}]}
ANSWER = {"role": "tool", "tool_call_id": "c1", "content": "1817517"}
BAD_REQUESTS = [
    (b"{not json", None),
    (b"[1, 2]", None),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[1]"),  # the fake engine's model has no vision tower
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSG, "max_tokens": -5}, "max_tokens"),
    ({"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": MSG, "max_tokens": "many"}, "max_tokens"),
    ({"messages": MSG, "n": 0}, "n"),
    ({"messages": MSG, "n": 10_000}, "n"),
    ({"messages": MSG, "max_tokens": 100_000}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x" * 9000}]}, "messages"),
    ({"messages": MSG, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": MSG, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    ({"messages": MSG, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": MSG, "temperature": -1}, "temperature"),
    ({"messages": MSG, "top_p": 0}, "top_p"),
    ({"messages": MSG, "top_k": -3}, "top_k"),
    ({"messages": MSG, "presence_penalty": 5}, "presence_penalty"),
    ({"messages": MSG, "min_tokens": 50, "max_tokens": 5}, "min_tokens"),
    ({"messages": MSG, "stop": 5}, "stop"),
    ({"messages": MSG, "stop": [""]}, "stop"),
    ({"messages": MSG, "seed": 2**70}, "seed"),
    ({"messages": MSG, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": MSG, "thinking_token_budget": -1}, "thinking_token_budget"),
    ({"messages": MSG, "chat_template_kwargs": {"chat_template": "{{ 7 }}"}}, "chat_template_kwargs"),
    ({"messages": MSG, "chat_template_kwargs": "thinking"}, "chat_template_kwargs"),
    ({"messages": MSG, "stream_options": {"include_usage": "perhaps"}}, "stream_options.include_usage"),
    ({"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": [*MSG, ANSWER]}, "messages[1].role"),
    ({"messages": [*MSG, CALLED, ANSWER, {**ANSWER, "tool_call_id": "c2"}]}, "messages[3].tool_call_id"),
    ({"messages": [*MSG, CALLED, ANSWER, {"role": "user", "content": "and?"}, ANSWER]}, "messages[4].role"),
    ({"messages": [*MSG, {"role": "assistant", "content": "no calls"}, ANSWER]}, "messages[2].role"),
    ({"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True,
      "add_generation_prompt": False, "max_tokens": 2, "temperature": float("nan")}, "temperature"),
]


def test_pathological_json_is_400(fake_server: Any) -> None:
    _, url = fake_server("ok")
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    nested = "{}"
    for _ in range(3000):
        nested = '{"a": ' + nested + "}"
    tools = b'[{"type": "function", "function": {"name": "f", "parameters": ' + nested.encode() + b"}}]"
    for body in (deep, b'{"messages": [{"role": "user", "content": "x"}], "tools": ' + tools + b"}",
                 b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}', b"\xff\xfe{", b""):
        response = _post(url, body)
        assert response.status_code == 400, (body[:60], response.text)


@pytest.mark.parametrize("body,param", BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_bad_chat_requests_are_400_naming_the_param(fake_server: Any, body: Any, param: str | None) -> None:
    engine, url = fake_server("ok")
    for stream in (False, True):
        payload = {**body, "stream": True} if stream and isinstance(body, dict) else body
        if isinstance(payload, dict) and any(isinstance(v, float) and v != v for v in payload.values()):
            payload = json.dumps(payload).encode()  # NaN is accepted by Python's json, as by many clients
        response = _post(url, payload)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        assert error["param"] == param, error
    assert engine.calls == [], "no bad request reaches the engine"


def test_tool_messages_answering_the_calls_before_them_are_accepted(fake_server: Any) -> None:
    engine, url = fake_server("ok")
    second = {**CALLED["tool_calls"][0], "id": "c2"}
    messages = [*MSG, {**CALLED, "tool_calls": [*CALLED["tool_calls"], second]}, {**ANSWER, "tool_call_id": "c2"},
                ANSWER, {"role": "tool", "content": "untagged"}, {"role": "user", "content": "and?"}]
    response = _post(url, {"messages": messages})
    assert response.status_code == 200, response.text
    assert len(engine.calls) == 1


def test_wrongly_typed_values_are_not_coerced(fake_server: Any) -> None:
    """The schemas' types hold as written (OpenAI's and Anthropic's APIs refuse these): no 0 for false, no "5" for
    5, no 1.5 or true for a token id."""
    engine, url = fake_server("ok")
    for path, body, param in [
            ("/v1/chat/completions", {"messages": MSG, "stream": 0}, "stream"),
            ("/v1/chat/completions", {"messages": MSG, "max_tokens": "5"}, "max_tokens"),
            ("/v1/chat/completions", {"messages": MSG, "n": True}, "n"),
            ("/v1/chat/completions", {"messages": MSG, "temperature": "0.5"}, "temperature"),
            ("/v1/chat/completions", {"messages": MSG, "logprobs": "true"}, "logprobs"),
            ("/v1/completions", {"prompt": [1, 2.5]}, "prompt"),
            ("/detokenize", {"tokens": [1, 2.5]}, "tokens[1]"),
            ("/detokenize", {"tokens": [True]}, "tokens[0]"),
            ("/v1/responses", {"input": "hi", "store": 0}, "store"),
            ("/v1/responses", {"input": "hi", "max_output_tokens": "9"}, "max_output_tokens")]:
        response = _post(url, body, path)
        assert response.status_code == 400, (path, body, response.text)
        assert response.json()["error"]["param"] == param, (path, body, response.text)
    response = _post(url, {"model": "fake-model", "max_tokens": 5, "messages": MSG, "stream": 0}, "/v1/messages")
    assert response.status_code == 400 and response.json()["error"]["message"].startswith("stream"), response.text
    assert engine.calls == []


def test_bad_completion_requests(fake_server: Any) -> None:
    _, url = fake_server("ok")
    for body, param in [({}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"),
                        ({"prompt": [10**9]}, "prompt"), ({"prompt": [-1]}, "prompt"),
                        ({"prompt": "x", "max_tokens": 0}, "max_tokens"), ({"prompt": "x", "logprobs": 99}, "logprobs"),
                        ({"prompt": "x", "suffix": "y"}, "suffix"), ({"prompt": {"a": 1}}, "prompt")]:
        response = _post(url, body, "/v1/completions")
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (body, response.text)
    response = _post(url, {"tokens": [10**9]}, "/detokenize")
    assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"
    response = _post(url, {"prompt": "x", "messages": MSG}, "/tokenize")
    assert response.status_code == 400


def test_unknown_model_is_404_and_openai_errors_map(fake_server: Any) -> None:
    _, url = fake_server("ok")
    with pytest.raises(openai.NotFoundError) as info:
        client(url).chat.completions.create(model="gpt-9", messages=MSG)
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        client(url).chat.completions.create(model="fake-model", messages=MSG, max_tokens=0)
    assert bad.value.body["param"] == "max_tokens"
    response = httpx.get(f"{url}/v1/nowhere", timeout=30)
    assert response.status_code == 404 and "error" in response.json()
    models = client(url).models.list()
    assert [m.id for m in models.data] == ["fake-model"]


def test_served_model_names(fake_server: Any) -> None:
    _, url = fake_server("ok", served_model_names=["tiny", "alias"])
    assert [m.id for m in client(url).models.list().data] == ["tiny", "alias"]
    assert client(url).chat.completions.create(model="alias", messages=MSG).model == "alias"


def test_body_size_limit_is_413(fake_server: Any) -> None:
    _, url = fake_server("ok", max_body_bytes=4096)
    response = _post(url, {"messages": [{"role": "user", "content": "x" * 10_000}]})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    chunked = httpx.post(f"{url}/v1/chat/completions", content=iter([b'{"messages": "', b"x" * 9000, b'"}']),
                         timeout=30)
    assert chunked.status_code == 413
    assert _post(url, {"messages": MSG}).status_code == 200


def test_default_body_limit_is_8_mib(fake_server: Any) -> None:
    _, url = fake_server("ok")
    assert _post(url, {"messages": [{"role": "user", "content": "x" * (9 << 20)}]}).status_code == 413


def test_api_key(fake_server: Any) -> None:
    _, url = fake_server("</think>ok", api_key="s3cret")
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{url}/", timeout=30).status_code == 200, "the playground page holds no secret"
    for path in ("/v1/models", "/metrics", "/v1/nowhere", "/playground/info", "/v1/engine/adaptive"):
        response = httpx.get(url + path, timeout=30)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert _post(url, {"prompt": "x"}, "/tokenize").status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "s3cret"}, timeout=30).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client(url, "wrong").chat.completions.create(model="fake-model", messages=MSG)
    answer = client(url, "s3cret").chat.completions.create(model="fake-model", messages=MSG)
    assert answer.choices[0].message.content == "ok"
    assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer s3cret"}, timeout=30).status_code == 200
    adaptive = httpx.get(f"{url}/v1/engine/adaptive", headers={"Authorization": "Bearer s3cret"}, timeout=30)
    assert adaptive.status_code == 200 and adaptive.json()["enabled"] is True


def test_adaptive_endpoint_without_a_key_and_session_keys(fake_server: Any) -> None:
    """Without an API key the adaptive snapshot is open like every route; a request's session key comes from the
    x-session-id header, else prompt_cache_key, else user, and its workload class from the tools it offers."""
    engine, url = fake_server("</think>ok", tool_call_parser="kimi_k2")
    assert httpx.get(f"{url}/v1/engine/adaptive", timeout=30).json()["enabled"] is True
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    bodies = [({"messages": MSG, "user": "u1"}, {}), ({"messages": MSG, "user": "u1", "prompt_cache_key": "k"}, {}),
              ({"messages": MSG, "user": "u1"}, {"x-session-id": "h"}), ({"messages": MSG, "tools": tools}, {}),
              ({"prompt": "x"}, {})]
    for body, headers in bodies:
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        assert httpx.post(url + path, json={"model": "fake-model", **body}, headers=headers, timeout=30).status_code == 200
    assert engine.sessions == [("u1", "chat"), ("k", "chat"), ("h", "chat"), (None, "agent"), (None, "completion")]


def test_cache_salt_reaches_the_engine_from_every_route(fake_server: Any) -> None:
    """vLLM's cache_salt on chat, completions (each prompt of a batch), responses and messages travels with the
    prompt to the engine; the OpenAPI document lists it on each of those bodies."""
    engine, url = fake_server("</think>ok")
    requests = [("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": ["x", "y"]}),
                ("/v1/responses", {"input": "hi"}), ("/v1/messages", {"messages": MSG, "max_tokens": 4})]
    for path, body in requests:
        response = _post(url, {"model": "fake-model", "cache_salt": "tenant-a", **body}, path)
        assert response.status_code == 200, (path, response.text)
    assert _post(url, {"model": "fake-model", "messages": MSG}).status_code == 200
    assert engine.cache_salts == ["tenant-a"] * 5 + [None]
    schemas = httpx.get(f"{url}/openapi.json", timeout=30).json()["components"]["schemas"]
    for model in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "MessagesRequest"):
        salt = schemas[model]["properties"]["cache_salt"]
        assert {"type": "string", "minLength": 1, "maxLength": 256} in salt["anyOf"] and "salt" in salt["description"]


@pytest.mark.parametrize("salt", ["", "s" * 257, 5, ["tenant"], {"a": 1}])
def test_a_bad_cache_salt_is_a_400_naming_it(fake_server: Any, salt: Any) -> None:
    engine, url = fake_server("</think>ok")
    for path, body in [("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": "x"}),
                       ("/v1/responses", {"input": "hi"})]:
        response = _post(url, {"model": "fake-model", "cache_salt": salt, **body}, path)
        assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt", response.text
    response = _post(url, {"model": "fake-model", "messages": MSG, "max_tokens": 4, "cache_salt": salt},
                     "/v1/messages")
    assert response.status_code == 400 and "cache_salt" in response.json()["error"]["message"], response.text
    assert engine.calls == []


def test_fuzzed_bodies_never_500(fake_server: Any) -> None:
    import random

    _, url = fake_server("ok</think>fine")
    rng = random.Random(0)
    values = [None, True, -1, 0, 1, 2**64, 1.5, float("inf"), "", "x", [], {}, [1], ["a"], {"a": 1}, [{"role": "user"}]]
    fields = ["messages", "model", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "tools",
              "tool_choice", "logprobs", "top_logprobs", "stream", "stream_options", "chat_template_kwargs",
              "thinking_token_budget", "min_p", "presence_penalty", "repetition_penalty", "response_format"]
    for _ in range(80):
        body: dict[str, Any] = {"messages": MSG}
        for name in rng.sample(fields, rng.randint(1, 4)):
            body[name] = rng.choice(values)
        response = _post(url, json.dumps(body).encode())
        assert response.status_code in (200, 400, 404), (body, response.text)
        if response.status_code != 200:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_disconnect_mid_stream_aborts_and_frees_blocks(fake_server: Any) -> None:
    engine, url = fake_server("thinking " * 400, engine_options={"delay": 0.01})
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=30,
                      json={"messages": MSG, "stream": True, "max_tokens": 3000}) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric_value(httpx.get(f"{url}/metrics", timeout=30).text, "reasoning_engine:kv_cache_usage_perc") > 0
    assert wait_for(lambda: metric_value(httpx.get(f"{url}/metrics", timeout=30).text,
                                         "reasoning_engine:kv_cache_free_blocks") == engine.total_blocks)
    assert metric_value(httpx.get(f"{url}/metrics", timeout=30).text, "reasoning_engine:request_success_total",
                        finished_reason="abort") == 1


def test_disconnect_while_waiting_for_non_streaming_answer(fake_server: Any) -> None:
    engine, url = fake_server("slow " * 400, engine_options={"delay": 0.01})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", json={"messages": MSG, "max_tokens": 3000}, timeout=0.5)
    assert wait_for(lambda: engine.stats().free_blocks == engine.total_blocks)


def test_metrics_exposed(fake_server: Any) -> None:
    _, url = fake_server(THINK_ANSWER, engine_options={"delay": 0.001})
    c = client(url)
    c.chat.completions.create(model="fake-model", messages=MSG)
    list(c.chat.completions.create(model="fake-model", messages=MSG, stream=True))
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "prompt_tokens_total", "generation_tokens_total", "reasoning_tokens_total",
                 "time_to_first_token_seconds_bucket", "time_to_first_answer_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_count", "request_success_total",
                 "spec_decode_num_drafts_total", "spec_decode_num_accepted_tokens_per_pos_total"]:
        assert f"reasoning_engine:{name}" in text, name
    assert metric_value(text, "reasoning_engine:request_success_total", finished_reason="stop") == 2
    assert metric_value(text, "reasoning_engine:num_preemptions_total") == 5  # the fake engine's stats say 5
    assert metric_value(text, "reasoning_engine:reasoning_tokens_total") == 2 * 27
    assert metric_value(text, "reasoning_engine:time_to_first_answer_token_seconds_count") == 2
    assert metric_value(text, "reasoning_engine:e2e_request_latency_seconds_count") == 2


def test_concurrent_streams(fake_server: Any) -> None:
    _, url = fake_server(THINK_ANSWER, engine_options={"delay": 0.002})
    results: list[str] = []

    def one() -> None:
        out = collect_stream(client(url).chat.completions.create(model="fake-model", messages=MSG, stream=True))
        results.append(out["content"])

    threads = [threading.Thread(target=one) for _ in range(8)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == ["The answer is 5."] * 8
    assert time.monotonic() - start < 30


def test_chat_client_streams_thinking_dimmed_and_passes_it_back(fake_server: Any) -> None:
    from rich.console import Console

    from reasoning_engine.server.chat_client import ChatSession

    engine, url = fake_server("Add them.</think>It is 5." + kimi_section(kimi_call("calculator", 0, CALC)))
    console = Console(record=True, force_terminal=True, color_system="standard", width=200)
    with httpx.Client(base_url=f"{url}/v1", timeout=30) as http:
        session = ChatSession(http, console, model="fake-model", system="Be brief.",
                              request_options={"tools": TOOLS}, show_thinking=True)
        reply = session.send("2+3?")
        assert reply == {"role": "assistant", "content": "It is 5.", "reasoning_content": "Add them.",
                         "tool_calls": [{"id": "functions.calculator:0", "type": "function",
                                         "function": {"name": "calculator", "arguments": json.dumps(CALC)}}]}
        session.send("And again?")
    styled = console.export_text(styles=True, clear=False)
    assert "\x1b[2;3mA" in styled and "\x1b[2;3mIt" not in styled, "the thinking is dim italic, the answer plain"
    plain = console.export_text()
    assert "It is 5." in plain and "[tool call] calculator" in plain
    second_prompt = engine.tokenizer.decode(engine.calls[-1][0], skip_special_tokens=False)
    assert "<think>Add them.</think>It is 5.<|tool_calls_section_begin|>" in second_prompt


def test_shutdown_aborts_streams_past_the_grace_period(kimi_tokenizer: Any) -> None:
    from reasoning_engine.server.app import ServerConfig, build_app

    from .fake_engine import FakeEngine
    from .helpers import LiveServer

    engine = FakeEngine(kimi_tokenizer, lambda *_: "slow " * 1000, delay=0.02)
    server = LiveServer(build_app(engine, ServerConfig()), graceful_shutdown_timeout=0.5).__enter__()
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=30,
                      json={"messages": MSG, "stream": True, "max_tokens": 4000}) as response:
        lines = response.iter_lines()
        for _ in range(4):
            next(lines)
        stopper = threading.Thread(target=server.__exit__, args=(None, None, None))
        stopper.start()
        with pytest.raises(httpx.RemoteProtocolError):
            for _ in lines:
                pass
    stopper.join(timeout=30)
    assert not server.thread.is_alive()
    assert engine.stats().free_blocks == engine.total_blocks
    assert engine.shut_down


def test_chat_template_flag_replaces_the_models_template(fake_server: Any, kimi_tokenizer: Any,
                                                         tmp_path: Any) -> None:
    from reasoning_engine.cli import build_parser
    from reasoning_engine.server.app import ServerConfig, build_app
    from reasoning_engine.server.chat_template import read_chat_template

    from .fake_engine import FakeEngine

    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    file = tmp_path / "template.jinja"
    file.write_text(template)
    messages = [{"role": "user", "content": "hi"}]
    own = httpx.post(f"{fake_server()[1]}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    for value in (template, str(file)):
        engine, url = fake_server(chat_template=value)
        ids = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
        assert kimi_tokenizer.decode(ids) == "[user] hi\n[assistant] " and ids != own
        assert engine.tokenizer is kimi_tokenizer and kimi_tokenizer.chat_template != template  # engine keeps its own
    assert build_parser().parse_args(["serve", "--chat-template", str(file)]).chat_template == str(file)
    with pytest.raises(ValueError, match="chat_template: .* is neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="chat_template"):
        build_app(FakeEngine(kimi_tokenizer, lambda *_: ""), ServerConfig(chat_template="no-such-file"))


def test_health_is_503_once_the_engine_loop_has_stopped(fake_server: Any) -> None:
    """/health follows the engine loop (`is_running`): 200 while it runs, 503 in the API's error shape once it has
    died or shut down; it stays public behind an API key, so a supervisor can tell a dead server without the key."""
    engine, url = fake_server("ok", api_key="k")
    response = httpx.get(f"{url}/health", timeout=30)
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    engine.loop_died = True
    response = httpx.get(f"{url}/health", timeout=30)
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unavailable"
    engine.loop_died, engine.shut_down = False, True
    assert httpx.get(f"{url}/health", timeout=30).status_code == 503


def test_the_fake_engine_has_every_member_the_server_calls(kimi_tokenizer: Any) -> None:
    """The double the HTTP tests serve implements the server's whole view of the engine (AsyncLLM's side:
    test_real_server.py)."""
    from reasoning_engine.server.engine_client import EngineClient

    from .fake_engine import FakeEngine

    engine = FakeEngine(kimi_tokenizer, lambda *_: "")
    members = [name for name in vars(EngineClient) if not name.startswith("_")]
    assert {"generate", "abort", "is_running", "stats", "model_config"} <= set(members)
    assert [name for name in members if not hasattr(engine, name)] == []


def test_kv_events_are_served_after_a_number_and_bad_queries_are_400(fake_server: Any) -> None:
    """/v1/kv_events: the engine's prefix-cache events after `after`, paged by `limit`; a bad replica or a negative
    number is a 400 naming it, never a 500 (behind the API key like every /v1 route)."""
    engine, url = fake_server("ok", api_key="k")
    auth = {"Authorization": "Bearer k"}
    for i in range(3):
        engine.events.stored(bytes([i]) * 32, bytes([i - 1]) * 32 if i else None)
    engine.events.removed(bytes([0]) * 32)
    assert httpx.get(f"{url}/v1/kv_events", timeout=30).status_code == 401
    first = httpx.get(f"{url}/v1/kv_events", params={"limit": 2}, headers=auth, timeout=30).json()
    assert [e["seq"] for e in first["events"]] == [1, 2] and first["next_after"] == 2 and not first["dropped"]
    assert first["events"][1] == {"seq": 2, "kind": "stored", "block_hash": "01" * 32, "parent_hash": "00" * 32,
                                  "medium": "device"}
    rest = httpx.get(f"{url}/v1/kv_events", params={"after": 2}, headers=auth, timeout=30).json()
    assert [(e["seq"], e["kind"]) for e in rest["events"]] == [(3, "stored"), (4, "removed")]
    for params, name in (({"replica": 1}, "replica"), ({"after": -1}, "after"), ({"limit": 0}, "limit")):
        response = httpx.get(f"{url}/v1/kv_events", params=params, headers=auth, timeout=30)
        assert response.status_code == 400 and name in json.dumps(response.json()), params
