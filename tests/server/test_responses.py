"""The Responses API (`/v1/responses`): behaviour on the bundled tiny reasoning model (one module-scoped server,
greedy decoding), the HTTP shape and errors on the scripted fake engine, the translator and the store as units,
and the real `openai` SDK against the live server."""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from reasoning_engine.engine.async_engine import EngineDeadError
from reasoning_engine.server.app import ServerConfig, build_app
from reasoning_engine.server.protocol import NamedToolChoice
from reasoning_engine.server.responses.schema import parse_request
from reasoning_engine.server.responses.store import ResponseStore, StoredResponse
from reasoning_engine.server.responses.translate import to_chat_request

from .fake_engine import FakeEngine
from .helpers import LiveServer, bundled_model_fixtures, wait_for


def _bundled_dir() -> Path | None:
    try:
        from reasoning_engine.tiny import BUNDLED_MODEL_DIR
    except ImportError:
        return None
    return Path(BUNDLED_MODEL_DIR) if (Path(BUNDLED_MODEL_DIR) / "config.json").is_file() else None


BUNDLED = _bundled_dir()
needs_bundled = pytest.mark.skipif(BUNDLED is None, reason="the bundled tiny model's files are not present")
QUESTION = "What is 347 + 589?"
CALC_QUESTION = "What is 4821 * 377?"
CALCULATOR = {"type": "function", "name": "calculator", "description": "Evaluate an arithmetic expression.",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                             "required": ["expression"]}}
BLOCK = 16  # the engine's KV block size in these tests
CHAT_CALCULATOR = {"type": "function", "function": {k: v for k, v in CALCULATOR.items() if k != "type"}}


engine, server, client = bundled_model_fixtures()


def create(url: str, **body: Any) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/responses", json={"temperature": 0, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def error_of(url: str, body: Any, status: int = 400) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/responses", json=body, timeout=60)
    assert response.status_code == status, response.text
    return response.json()["error"]


def stream_events(url: str, **body: Any) -> list[dict[str, Any]]:
    """The SSE events of a streamed response, each checked to carry its name in both the `event:` line and `type`."""
    events: list[dict[str, Any]] = []
    name = None
    with httpx.stream("POST", f"{url}/v1/responses", json={"temperature": 0, "stream": True, **body},
                      timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["type"] == name
                events.append(event)
    return events


def items_of(response: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [item for item in response["output"] if item["type"] == kind]


def reasoning_text(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in items_of(response, "reasoning") for part in item["content"])


def answer_text(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in items_of(response, "message") for part in item["content"])


def tokenized(url: str, messages: list[dict[str, Any]], **extra: Any) -> int:
    """The prompt length the chat route renders for `messages`."""
    return httpx.post(f"{url}/tokenize", json={"messages": messages, **extra}, timeout=30).json()["count"]


def without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


# ---- the bundled model ----------------------------------------------------------------------------------------


def test_plain_string_input(server: LiveServer) -> None:
    response = create(server.url, input=QUESTION)
    assert response["object"] == "response" and response["id"].startswith("resp_")
    assert response["status"] == "completed" and response["incomplete_details"] is None
    assert response["model"] == "tiny-reasoner"
    assert [item["type"] for item in response["output"]] == ["reasoning", "message"]
    reasoning, message = response["output"]
    assert reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    assert message["id"].startswith("msg_") and message["role"] == "assistant" and message["status"] == "completed"
    assert message["content"][0]["type"] == "output_text" and message["content"][0]["annotations"] == []
    assert "936" in answer_text(response)
    usage = response["usage"]
    assert usage["input_tokens"] == tokenized(server.url, [{"role": "user", "content": QUESTION}])
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] < usage["output_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_item_input_with_instructions(server: LiveServer) -> None:
    """instructions become the system message first, developer items system messages, input_text parts the
    message text: the prompt is exactly what the chat route renders for those messages."""
    instructions = "You are a careful calculator."
    response = create(server.url, instructions=instructions, input=[
        {"type": "message", "role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert response["status"] == "completed" and response["instructions"] == instructions
    chat = [{"role": "system", "content": instructions}, {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": QUESTION}]
    assert response["usage"]["input_tokens"] == tokenized(server.url, chat)
    assert answer_text(response)


def test_stream_event_order_and_deltas_equal_the_whole(server: LiveServer) -> None:
    whole = create(server.url, input=QUESTION)
    events = stream_events(server.url, input=QUESTION)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert types[-1] == "response.completed"
    final = events[-1]["response"]
    assert without_ids(final["output"]) == without_ids(whole["output"])
    assert final["usage"] == whole["usage"]
    # each item: added, part added, deltas, text done, part done, item done; the thinking before the answer
    middle = types[2:-1]
    expected = []
    for kind, delta in (("reasoning", "response.reasoning_text.delta"), ("message", "response.output_text.delta")):
        count = sum(1 for e in events if e["type"] == delta)
        assert count > 1, kind
        done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        expected += ["response.output_item.added", "response.content_part.added", *[delta] * count, done,
                     "response.content_part.done", "response.output_item.done"]
    assert middle == expected
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert reasoning == reasoning_text(whole) and answer == answer_text(whole)
    text_done = next(e for e in events if e["type"] == "response.output_text.done")
    assert text_done["text"] == answer and text_done["item_id"] == final["output"][1]["id"]
    item_ids = {e["item_id"] for e in events if "item_id" in e}
    assert item_ids == {item["id"] for item in final["output"]}
    stored = httpx.get(f"{server.url}/v1/responses/{final['id']}", timeout=30).json()
    assert stored == final


def test_reasoning_with_thinking_on_and_not_with_minimal_effort(server: LiveServer) -> None:
    thinking = create(server.url, input=QUESTION, reasoning={"effort": "medium"})
    assert items_of(thinking, "reasoning") and reasoning_text(thinking)
    assert thinking["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    assert thinking["reasoning"]["effort"] == "medium"
    minimal = create(server.url, input=QUESTION, reasoning={"effort": "minimal"})
    assert [item["type"] for item in minimal["output"]] == ["message"]
    assert minimal["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    # rendered with thinking off, as the chat route renders it
    off = tokenized(server.url, [{"role": "user", "content": QUESTION}], chat_template_kwargs={"thinking": False})
    assert minimal["usage"]["input_tokens"] == off


def test_function_call_round_trip_and_previous_response_id(server: LiveServer) -> None:
    first = create(server.url, input=CALC_QUESTION, tools=[CALCULATOR])
    assert first["status"] == "completed"
    [call] = items_of(first, "function_call")
    assert call["name"] == "calculator" and call["call_id"].startswith("functions.calculator:")
    assert call["id"].startswith("fc_") and call["status"] == "completed"
    assert json.loads(call["arguments"]) == {"expression": "4821 * 377"}
    assert first["output"][-1]["type"] == "function_call"

    result = {"type": "function_call_output", "call_id": call["call_id"], "output": str(4821 * 377)}
    follow = create(server.url, previous_response_id=first["id"], input=[result], tools=[CALCULATOR])
    assert follow["status"] == "completed" and follow["previous_response_id"] == first["id"]
    assert "1817517" in answer_text(follow)
    # the new prompt is the previous prompt, its output, then the turn: every full block of the previous prompt
    # (16 tokens each here) comes from the prefix cache, and the generated blocks too where they rendered the same
    cached = follow["usage"]["input_tokens_details"]["cached_tokens"]
    assert first["usage"]["input_tokens"] // BLOCK * BLOCK <= cached <= first["usage"]["total_tokens"]
    chat = [{"role": "user", "content": CALC_QUESTION},
            {"role": "assistant", "content": None, "reasoning_content": reasoning_text(first),
             "tool_calls": [{"id": call["call_id"], "type": "function",
                             "function": {"name": "calculator", "arguments": call["arguments"]}}]},
            {"role": "tool", "tool_call_id": call["call_id"], "content": "1817517"}]
    assert follow["usage"]["input_tokens"] == tokenized(server.url, chat, tools=[CHAT_CALCULATOR])

    # the same conversation sent as items, without the store: the same prompt, the same answer
    replay = create(server.url, tools=[CALCULATOR], input=[
        {"role": "user", "content": CALC_QUESTION}, *first["output"], result])
    assert replay["usage"]["input_tokens"] == follow["usage"]["input_tokens"]
    assert answer_text(replay) == answer_text(follow)


def test_stored_response_get_delete_and_input_items(server: LiveServer) -> None:
    first = create(server.url, input=QUESTION, max_output_tokens=8, metadata={"case": "store"})
    second = create(server.url, input="And 2 + 2?", previous_response_id=first["id"], max_output_tokens=8)
    url = f"{server.url}/v1/responses/{second['id']}"
    assert httpx.get(url, timeout=30).json() == second
    assert httpx.get(f"{server.url}/v1/responses/{first['id']}", timeout=30).json()["metadata"] == {"case": "store"}
    # the items the prompt was made of: the first turn (its input and output), then the new input
    items = httpx.get(f"{url}/input_items", params={"order": "asc"}, timeout=30).json()
    assert items["object"] == "list" and items["has_more"] is False
    data = items["data"]
    assert [(i["type"], i.get("role")) for i in data] == [("message", "user"), *[
        (o["type"], o.get("role")) for o in first["output"]], ("message", "user")]
    assert data[0]["content"] == [{"type": "input_text", "text": QUESTION}]
    assert data[1:-1] == first["output"]
    assert data[-1]["content"] == [{"type": "input_text", "text": "And 2 + 2?"}]
    assert items["first_id"] == data[0]["id"] and items["last_id"] == data[-1]["id"]
    newest_first = httpx.get(f"{url}/input_items", timeout=30).json()["data"]
    assert newest_first == data[::-1]
    page = httpx.get(f"{url}/input_items", params={"order": "asc", "limit": 1, "after": data[0]["id"]},
                     timeout=30).json()
    assert page["data"] == [data[1]] and page["has_more"] is True
    bad = httpx.get(f"{url}/input_items", params={"limit": 0}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"

    deleted = httpx.delete(url, timeout=30)
    assert deleted.status_code == 200
    assert deleted.json() == {"id": second["id"], "object": "response", "deleted": True}
    for response in (httpx.get(url, timeout=30), httpx.delete(url, timeout=30),
                     httpx.get(f"{url}/input_items", timeout=30)):
        assert response.status_code == 404 and response.json()["error"]["param"] == "response_id"
    error = error_of(server.url, {"input": "hi", "previous_response_id": second["id"]}, 404)
    assert error["param"] == "previous_response_id"


def test_store_false_is_not_retrievable(server: LiveServer) -> None:
    response = create(server.url, input=QUESTION, store=False, max_output_tokens=4)
    assert response["store"] is False
    missing = httpx.get(f"{server.url}/v1/responses/{response['id']}", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    error = error_of(server.url, {"input": "hi", "previous_response_id": response["id"]}, 404)
    assert error["param"] == "previous_response_id"
    unknown = httpx.get(f"{server.url}/v1/responses/resp_unknown", timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "response_id"


def test_max_output_tokens_makes_an_incomplete_response(server: LiveServer) -> None:
    response = create(server.url, input=QUESTION, max_output_tokens=5)
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["usage"]["output_tokens"] == 5
    assert response["output"][-1]["status"] == "incomplete"
    events = stream_events(server.url, input=QUESTION, max_output_tokens=5)
    assert events[-1]["type"] == "response.incomplete"
    assert without_ids(events[-1]["response"]["output"]) == without_ids(response["output"])


def test_input_image_goes_through_the_media_path(server: LiveServer) -> None:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (28, 28), (200, 30, 30)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [{"type": "input_text", "text": "What is in the picture?"}, {"type": "input_image", "image_url": url}]
    response = create(server.url, input=[{"role": "user", "content": content}], max_output_tokens=4)
    assert response["usage"]["input_tokens"] > tokenized(
        server.url, [{"role": "user", "content": "What is in the picture?"}])
    broken = [content[0], {"type": "input_image", "image_url": "data:image/png;base64,bm90IGFuIGltYWdl"}]
    error = error_of(server.url, {"input": [{"role": "user", "content": "look"}, {"role": "user", "content": broken}]})
    assert error["param"] == "input[1].content[1]" and error["message"].startswith("input[1].content[1]")


def test_user_errors_name_the_parameter(server: LiveServer) -> None:
    too_long = error_of(server.url, {"input": QUESTION, "max_output_tokens": 10**6})
    assert too_long["param"] == "max_output_tokens" and too_long["code"] == "context_length_exceeded"
    assert "max_output_tokens" in too_long["message"] and "max_completion_tokens" not in too_long["message"]
    sampling = error_of(server.url, {"input": QUESTION, "temperature": -1})
    assert sampling["param"] == "temperature"
    choice = error_of(server.url, {"input": QUESTION, "tool_choice": "required"})
    assert choice["param"] == "tool_choice"
    named = error_of(server.url, {"input": QUESTION, "tools": [CALCULATOR],
                                  "tool_choice": {"type": "function", "name": "search"}})
    assert named["param"] == "tool_choice"
    model = error_of(server.url, {"input": QUESTION, "model": "gpt-4o"}, 404)
    assert model["param"] == "model"


def test_text_format_reaches_constrained_decoding(server: LiveServer) -> None:
    """text.format is the chat response_format: the answer follows the schema (the tiny model's numbers are
    nonsense, its shape is not), and a bad schema is reported under text.format."""
    schema = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"],
              "additionalProperties": False}
    response = create(server.url, input=QUESTION, max_output_tokens=12, reasoning={"effort": "minimal"},
                      text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert response["text"]["format"]["name"] == "answer"
    assert answer_text(response).replace(" ", "").startswith('{"sum":')
    error = error_of(server.url, {"input": QUESTION, "text": {"format": {"type": "json_schema", "name": "answer",
                                                                          "schema": {"type": 5}}}})
    assert error["param"] == "text.format.schema" and error["message"].startswith("text.format.schema")


# ---- the openai SDK -------------------------------------------------------------------------------------------


def test_openai_sdk_plain_and_stream(client: openai.OpenAI) -> None:
    whole = client.responses.create(model="tiny-reasoner", input=QUESTION, temperature=0)
    assert whole.status == "completed" and "936" in whole.output_text
    assert whole.usage is not None and whole.usage.output_tokens_details.reasoning_tokens > 0
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    deltas, final = [], None
    for event in client.responses.create(model="tiny-reasoner", input=QUESTION, temperature=0, stream=True):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.completed":
            final = event.response
    assert final is not None and "".join(deltas) == whole.output_text == final.output_text
    assert client.responses.retrieve(whole.id).output_text == whole.output_text
    items = client.responses.input_items.list(whole.id)
    assert [item.type for item in items.data] == ["message"]


def test_openai_sdk_function_call_round_trip(client: openai.OpenAI) -> None:
    tools: Any = [CALCULATOR]
    first = client.responses.create(model="tiny-reasoner", input=CALC_QUESTION, tools=tools, temperature=0)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "4821 * 377"}
    answer = client.responses.create(
        model="tiny-reasoner", previous_response_id=first.id, tools=tools, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": str(4821 * 377)}])
    assert "1817517" in answer.output_text
    assert answer.usage is not None and answer.usage.input_tokens_details.cached_tokens > 0
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


# ---- the HTTP shape on the fake engine ------------------------------------------------------------------------

THINK_CALL = ("Use the tool.</think>Let me compute.<|tool_calls_section_begin|><|tool_call_begin|>"
              'functions.calculator:0<|tool_call_argument_begin|>{"expression": "2 * 3"}<|tool_call_end|>'
              "<|tool_calls_section_end|><|im_end|>")


def test_streamed_items_in_the_order_written(fake_server: Any) -> None:
    _, url = fake_server(THINK_CALL)
    events = stream_events(url, input="2 * 3?", tools=[CALCULATOR])
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]
    call_events = [e["type"] for e in events if e["type"].startswith("response.function_call_arguments")]
    assert call_events[-1] == "response.function_call_arguments.done" and len(call_events) > 2
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    final = events[-1]["response"]
    [call] = items_of(final, "function_call")
    assert json.loads(arguments) == json.loads(call["arguments"]) == {"expression": "2 * 3"}
    assert call["call_id"] == "functions.calculator:0"
    assert reasoning_text(final) == "Use the tool." and answer_text(final) == "Let me compute."
    # an item is done before the next one is added
    opened: list[str] = []
    for event in events:
        if event["type"] == "response.output_item.added":
            assert not opened
            opened.append(event["item"]["id"])
        elif event["type"] == "response.output_item.done":
            assert opened == [event["item"]["id"]]
            opened.clear()


def test_function_call_outputs_answer_calls_of_the_stored_conversation(fake_server: Any) -> None:
    """A function_call_output may answer a call the previous response made; one answering no call is a 400 naming
    its call_id, and nothing reaches the engine."""
    engine, url = fake_server(THINK_CALL)
    first = create(url, input="2 * 3?", tools=[CALCULATOR])
    [call] = items_of(first, "function_call")
    follow = create(url, previous_response_id=first["id"], tools=[CALCULATOR],
                    input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "6"}])
    assert follow["status"] == "completed" and len(engine.calls) == 2
    error = error_of(url, {"previous_response_id": first["id"], "tools": [CALCULATOR], "input": [
        {"type": "function_call_output", "call_id": call["call_id"], "output": "6"},
        {"type": "function_call_output", "call_id": "functions.calculator:7", "output": "6"}]})
    assert error["param"] == "input[1].call_id" and "functions.calculator:7" in error["message"]
    assert len(engine.calls) == 2


def test_tools_and_options_reach_the_engine(fake_server: Any) -> None:
    engine, url = fake_server("Fine.<|im_end|>")
    response = create(url, input="hi", tools=[CALCULATOR], max_output_tokens=7, top_p=0.5,
                      prompt_cache_key="session-1", reasoning={"effort": "low"})
    prompt, params = engine.calls[-1]
    rendered = engine.tokenizer.decode(prompt)
    assert '"name": "calculator"' in rendered, "the flat function tool is declared to the model"
    assert params.max_tokens == 7 and params.top_p == 0.5
    assert params.thinking_token_budget == 8192 // 16, "low effort: 1/16 of the context"
    assert engine.sessions[-1] == ("session-1", "agent")
    assert response["tools"] == [CALCULATOR] and response["top_p"] == 0.5


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": 3}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": [
        {"type": "input_text", "text": "b"}, {"type": "input_audio", "data": ""}]}]}, "input[1].content[1].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "tool", "content": "a"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "5"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": "2 * 3?"},
                {"type": "function_call", "call_id": "c1", "name": "calculator", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c2", "output": "6"}]}, "input[2].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "6"},
                {"type": "function_call", "call_id": "c1", "name": "calculator", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": "a", "tools": [CALCULATOR, {"type": "web_search"}]}, "tools[1].type"),
    ({"input": "a", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "a", "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"input": "a", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "a", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "a", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "a", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "a", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "a", "temperature": "hot"}, "temperature"),
    ({"input": "a", "metadata": {"k": 1}}, "metadata.k"),
    ({"input": "a", "background": True}, "background"),
    ({"input": "a", "conversation": "conv_1"}, "conversation"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                             {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]},
     "input[0].content[1]"),
])
def test_bad_input_is_a_400_naming_the_parameter(fake_server: Any, body: dict[str, Any], param: str) -> None:
    engine, url = fake_server("ok<|im_end|>")
    error = error_of(url, body)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert not engine.calls, "nothing reached the engine"


def test_broken_json_is_a_400(fake_server: Any) -> None:
    _, url = fake_server("ok")
    response = httpx.post(f"{url}/v1/responses", content=b"{nope", headers={"content-type": "application/json"},
                          timeout=30)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_store_bounds_on_the_server(fake_server: Any) -> None:
    _, url = fake_server("ok<|im_end|>", max_stored_responses=2, stored_response_ttl_s=0.5)
    ids = [create(url, input=f"q{i}")["id"] for i in range(3)]
    found = [httpx.get(f"{url}/v1/responses/{rid}", timeout=30).status_code for rid in ids]
    assert found == [404, 200, 200], "the least recently used response went first"
    time.sleep(0.6)
    assert httpx.get(f"{url}/v1/responses/{ids[2]}", timeout=30).status_code == 404, "expired"


def test_client_disconnect_aborts_the_engine_request(fake_server: Any) -> None:
    engine, url = fake_server("word " * 400, engine_options={"delay": 0.02})
    with httpx.stream("POST", f"{url}/v1/responses", json={"input": "go", "stream": True}, timeout=30) as response:
        for line in response.iter_lines():
            if line == "event: response.reasoning_text.delta":
                break
    assert wait_for(lambda: engine._aborted and engine.stats().num_requests_running == 0)
    assert next(iter(engine._aborted)).startswith("resp_")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/responses", json={"input": "go"}, timeout=0.3)
    assert wait_for(lambda: len(engine._aborted) == 2 and engine.stats().num_requests_running == 0)


class _DyingEngine(FakeEngine):
    """Sends one output, then stops as a dead engine does."""

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:  # type: ignore[override]
        async for out in super().generate(*args, **kwargs):
            yield out
            raise EngineDeadError("the engine thread died")


def test_error_after_the_stream_started_is_an_error_event(kimi_tokenizer: Any) -> None:
    engine = _DyingEngine(kimi_tokenizer, lambda *_: "some long answer<|im_end|>")
    with LiveServer(build_app(engine, ServerConfig())) as live:
        events = stream_events(live.url, input="hi")
        whole = httpx.post(f"{live.url}/v1/responses", json={"input": "hi"}, timeout=30)
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] == "error" and events[-1]["code"] == "engine_unavailable"
    assert events[-1]["sequence_number"] == len(events) - 1
    assert not any(e["type"] == "response.completed" for e in events)
    assert whole.status_code == 503 and whole.json()["error"]["code"] == "engine_unavailable"


# ---- units ----------------------------------------------------------------------------------------------------


def test_translation_to_a_chat_request() -> None:
    req = parse_request({
        "instructions": "Be brief.", "tools": [CALCULATOR], "tool_choice": {"type": "function", "name": "calculator"},
        "text": {"format": {"type": "json_schema", "name": "answer", "strict": True,
                            "schema": {"type": "object", "properties": {"n": {"type": "integer"}}}}},
        "reasoning": {"effort": "high"}, "max_output_tokens": 50, "user": "u1", "parallel_tool_calls": False,
        "input": [{"role": "user", "content": "2 * 3?"},
                  {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                                  "text": "Use the tool."}]},
                  {"type": "function_call", "call_id": "c1", "name": "calculator", "arguments": '{"e": 1}'},
                  {"type": "function_call", "call_id": "c2", "name": "calculator", "arguments": '{"e": 2}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "6"},
                  {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "7"}]},
                  {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Got it."}]},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "6"}]},
                  {"role": "user", "content": "thanks"}]})
    chat, params = to_chat_request(req, [], max_model_len=4096)
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "assistant", "user"]
    assert params == ["instructions", "input[0]", "input[1]", "input[4]", "input[5]", "input[6]", "input[8]"]
    calls = chat.messages[2]
    assert calls.reasoning_content == "Use the tool." and calls.content is None
    assert [(c.id, c.function.arguments) for c in calls.tool_calls or []] == [("c1", '{"e": 1}'), ("c2", '{"e": 2}')]
    assert [m.tool_call_id for m in chat.messages[3:5]] == ["c1", "c2"] and chat.messages[4].text() == "7"
    assert chat.messages[5].reasoning_content == "Got it." and chat.messages[5].text() == "6"
    assert chat.response_format is not None
    assert chat.response_format.model_dump(by_alias=True, exclude_none=True) == {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": {"type": "object", "properties": {"n": {"type": "integer"}}}, "strict": True}}
    assert isinstance(chat.tool_choice, NamedToolChoice) and chat.tool_choice.function.name == "calculator"
    assert chat.tools is not None and chat.tools[0].function.name == "calculator"
    assert chat.thinking_token_budget == 2048 and chat.max_completion_tokens == 50
    assert chat.user == "u1" and chat.parallel_tool_calls is False
    minimal, _ = to_chat_request(parse_request({"input": "hi", "reasoning": {"effort": "minimal"},
                                                "text": {"format": {"type": "json_object"}}}), [], 4096)
    assert minimal.thinking_token_budget == 0 and minimal.chat_template_kwargs == {"thinking": False,
                                                                                   "enable_thinking": False}
    assert minimal.response_format is not None and minimal.response_format.type == "json_object"
    empty, _ = to_chat_request(parse_request({"input": [{"type": "reasoning", "summary": []},
                                                        {"role": "user", "content": "go on"}]}), [], 4096)
    assert [(m.role, m.content) for m in empty.messages] == [("assistant", ""), ("user", "go on")]
    history = [{"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]}]
    continued, params = to_chat_request(parse_request({"input": "next"}), history, 4096)
    assert [m.text() for m in continued.messages] == ["q", "next"] and params == ["previous_response_id", "input"]


def test_store_is_an_lru_with_expiry() -> None:
    now = [0.0]
    store = ResponseStore(max_items=2, ttl_s=10, clock=lambda: now[0])

    def stored(rid: str) -> StoredResponse:
        return StoredResponse({"id": rid, "output": []}, [])

    store.put(stored("a"))
    store.put(stored("b"))
    assert store.get("a") is not None  # now b is the least recently used
    store.put(stored("c"))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    now[0] = 9.9
    assert store.get("c") is not None
    now[0] = 10.0
    assert store.get("a") is None and store.get("c") is None and len(store) == 0
    store.put(stored("d"))
    assert store.delete("d") and not store.delete("d")
    with pytest.raises(ValueError):
        ResponseStore(max_items=0)


def test_serve_flags_size_the_response_store(capsys: pytest.CaptureFixture[str]) -> None:
    from reasoning_engine.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-stored-responses", "3", "--stored-response-ttl", "90"])
    assert (args.max_stored_responses, args.stored_response_ttl) == (3, 90.0)
    for flag, value in [("--max-stored-responses", "0"), ("--stored-response-ttl", "-1")]:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", flag, value])
        assert f"argument {flag}: must be > 0" in capsys.readouterr().err
