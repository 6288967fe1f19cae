"""Structured output through the HTTP server with the real engine and the bundled tiny reasoning model: response_format,
structured_outputs and the guided_* aliases on chat and completions, tool_choice "required" / named and strict tools
held to their schemas, logit_bias / allowed_token_ids, 400s naming the field, the length case, and the one-time
warning for unknown fields. Greedy decoding, one server for the module.

The bundled model learnt JSON only as tool-call arguments: in a free-form JSON string it never writes the closing
quote, so schemas here bound their strings and numbers (as a schema for a small model should), and `json_object`
(no bounds) is checked as what it can be with this model: a valid prefix when max_tokens runs out.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from reasoning_engine.server.app import ServerConfig, build_app
from reasoning_engine.structured.params import StructuredOutputsParams

from .helpers import LiveServer, bundled_model_fixtures, stream_chat
from .test_real_server import BUNDLED

pytestmark = pytest.mark.skipif(BUNDLED is None, reason="needs the bundled model's files")

PLAYER = {"type": "object", "additionalProperties": False, "required": ["name", "level"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "level": {"type": "integer", "minimum": 1, "maximum": 9}}}
PLAYER_FORMAT = {"type": "json_schema", "json_schema": {"name": "player", "schema": PLAYER, "strict": True}}
CONVERT = {"type": "function", "function": {
    "name": "convert", "description": "Convert a length.",
    "parameters": {"type": "object", "required": ["unit", "n"],
                   "properties": {"unit": {"enum": ["m", "km"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city", "days"],
                   "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TOOLS = [CONVERT, WEATHER]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def calculator(strict: bool) -> dict[str, Any]:
    """A calculator whose schema the bundled model's habit (`{"expression": "4821 * 377"}`) does not satisfy."""
    return {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.", "strict": strict,
        "parameters": {"type": "object", "required": ["expression"],
                       "properties": {"expression": {"enum": ["4821*377"]}}}}}


NO_TOOL_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CALC_QUESTION = [{"role": "user", "content": "What is 4821 * 377?"}]
PLAYER_QUESTION = [{"role": "user", "content": "Describe a player as JSON"}]
THINKING_OFF = {"chat_template_kwargs": {"thinking": False}}


engine, server, client = bundled_model_fixtures(str(BUNDLED))


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model="tiny-reasoner", temperature=0, **kwargs)


def valid_prefix(engine: Any, spec: dict[str, Any], text: str) -> bool:
    """Whether `text` is a prefix the grammar allows (retokenized: the grammar reads characters, not tokens)."""
    matcher = engine.engine.grammars.matcher(StructuredOutputsParams(**spec))
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    return matcher.accept_prefix(ids) == len(ids)


def token_id(http: httpx.Client, text: str) -> int:
    ids = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1, (text, ids)
    return ids[0]


def check_calls(calls: list[Any], parameters: dict[str, dict[str, Any]]) -> list[str]:
    """Every call names a known tool and its arguments validate against that tool's parameters; the names."""
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
    return [call.function.name for call in calls]


def test_json_schema_answers_validate_thinking_stays_free_and_stream_matches(client: openai.OpenAI) -> None:
    kwargs = {"messages": PLAYER_QUESTION, "max_tokens": 200, "response_format": PLAYER_FORMAT}
    full = chat(client, **kwargs)
    choice = full.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PLAYER)
    assert choice.message.reasoning_content, "the thinking before the answer is not constrained"
    assert full.usage.completion_tokens_details.reasoning_tokens > 0
    streamed = stream_chat(client, model="tiny-reasoner", temperature=0, **kwargs)
    assert (streamed["content"], streamed["reasoning"], streamed["finish"]) == (
        choice.message.content, choice.message.reasoning_content, "stop")

    off = chat(client, **kwargs, extra_body=THINKING_OFF).choices[0]
    assert off.message.reasoning_content is None and off.finish_reason == "stop"
    jsonschema.validate(json.loads(off.message.content), PLAYER)


class Player(pydantic.BaseModel):
    """PLAYER as a pydantic model, the way `openai`'s `chat.completions.parse` users write their schema."""

    name: str = pydantic.Field(max_length=8)
    level: int = pydantic.Field(ge=1, le=9)


def test_openai_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    """The SDK turns the model into a strict json_schema response_format and parses the answer back into it."""
    completion = client.chat.completions.parse(model="tiny-reasoner", messages=PLAYER_QUESTION, temperature=0,
                                               max_tokens=200, response_format=Player)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop" and message.refusal is None
    assert isinstance(message.parsed, Player)
    assert message.parsed == Player.model_validate_json(message.content)


def test_max_tokens_too_small_ends_with_length_and_a_valid_prefix(client: openai.OpenAI, engine: Any) -> None:
    cut = chat(client, messages=PLAYER_QUESTION, max_tokens=6, response_format=PLAYER_FORMAT,
               extra_body=THINKING_OFF).choices[0]
    assert cut.finish_reason == "length"
    assert cut.message.content and valid_prefix(engine, {"json": PLAYER}, cut.message.content)
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.message.content)
    # json_object: unbounded strings, which this model never closes; the answer is a JSON-object prefix
    kwargs = {"messages": PLAYER_QUESTION, "max_tokens": 100, "response_format": {"type": "json_object"}}
    obj = chat(client, **kwargs).choices[0]
    assert obj.finish_reason == "length" and obj.message.reasoning_content
    assert obj.message.content.startswith("{") and valid_prefix(engine, {"json_object": True}, obj.message.content)
    assert stream_chat(client, model="tiny-reasoner", temperature=0, **kwargs)["content"] == obj.message.content
    # a tool call cut off inside its arguments is a length finish, not a crash
    call = chat(client, messages=NO_TOOL_QUESTION, max_tokens=20, tools=TOOLS, tool_choice="required",
                extra_body=THINKING_OFF).choices[0]
    assert call.finish_reason == "length"


def test_structured_outputs_and_guided_aliases_on_chat(client: openai.OpenAI) -> None:
    options = ["yes", "no", "maybe not"]
    picked = chat(client, messages=NO_TOOL_QUESTION, max_tokens=120,
                  extra_body={"structured_outputs": {"choice": options}}).choices[0]
    assert picked.message.content in options and picked.message.reasoning_content
    pattern = "[0-9]{2,4}(-[a-z]{2})?"
    matched = chat(client, messages=CALC_QUESTION, max_tokens=20,
                   extra_body={"guided_regex": pattern, **THINKING_OFF}).choices[0]
    assert matched.finish_reason == "stop" and re.fullmatch(pattern, matched.message.content)
    schema = chat(client, messages=PLAYER_QUESTION, max_tokens=200,
                  extra_body={"guided_json": PLAYER, **THINKING_OFF}).choices[0]
    jsonschema.validate(json.loads(schema.message.content), PLAYER)


def test_structured_outputs_on_completions(http: httpx.Client) -> None:
    body = {"prompt": "Describe a player as JSON:", "max_tokens": 60, "temperature": 0,
            "structured_outputs": {"json": PLAYER}}
    out = http.post("/v1/completions", json=body).json()["choices"][0]
    assert out["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["text"]), PLAYER)
    choice = http.post("/v1/completions", json={**body, "structured_outputs": None,
                                                "guided_choice": ["left", "right"]}).json()["choices"][0]
    assert choice["text"] in ("left", "right")
    formatted = http.post("/v1/completions", json={**body, "structured_outputs": None,
                                                   "response_format": PLAYER_FORMAT}).json()["choices"][0]
    jsonschema.validate(json.loads(formatted["text"]), PLAYER)
    # the same schema with its properties in the other order is another grammar (not a compile-cache hit)
    reordered = {**PLAYER, "properties": dict(reversed(PLAYER["properties"].items()))}
    out = http.post("/v1/completions", json={**body, "structured_outputs": {"json": reordered}}).json()["choices"][0]
    assert list(json.loads(out["text"])) == list(reordered["properties"])


def test_tool_choice_required_and_named_give_valid_calls(client: openai.OpenAI) -> None:
    assert not chat(client, messages=NO_TOOL_QUESTION, max_tokens=120, tools=TOOLS).choices[0].message.tool_calls
    kwargs = {"messages": NO_TOOL_QUESTION, "max_tokens": 150, "tools": TOOLS, "tool_choice": "required",
              "parallel_tool_calls": False}
    full = chat(client, **kwargs).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.reasoning_content
    assert len(check_calls(full.message.tool_calls, PARAMETERS)) == 1
    streamed = stream_chat(client, model="tiny-reasoner", temperature=0, **kwargs)
    assert streamed["finish"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == [
        (c.function.name, c.function.arguments) for c in full.message.tool_calls]

    off = chat(client, **kwargs, extra_body=THINKING_OFF).choices[0]
    assert off.finish_reason == "tool_calls" and len(check_calls(off.message.tool_calls, PARAMETERS)) == 1

    # the forced call alone is ~120 of this vocabulary's tokens, after the thinking
    named = chat(client, messages=NO_TOOL_QUESTION, max_tokens=300, tools=TOOLS,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert named.finish_reason == "tool_calls"
    assert check_calls(named.message.tool_calls, PARAMETERS) == ["get_weather"]


def test_strict_tool_arguments_follow_the_schema_under_auto(client: openai.OpenAI) -> None:
    schema = calculator(True)["function"]["parameters"]
    loose = chat(client, messages=CALC_QUESTION, max_tokens=120, tools=[calculator(False)]).choices[0]
    with pytest.raises(jsonschema.ValidationError):  # the model's own habit breaks the schema
        jsonschema.validate(json.loads(loose.message.tool_calls[0].function.arguments), schema)
    strict = chat(client, messages=CALC_QUESTION, max_tokens=120, tools=[calculator(True)]).choices[0]
    assert strict.finish_reason == "tool_calls"
    assert check_calls(strict.message.tool_calls, {"calculator": schema}) == ["calculator"]
    # free text stays free when the model does not call
    text = chat(client, messages=NO_TOOL_QUESTION, max_tokens=120, tools=[calculator(True)]).choices[0]
    assert text.finish_reason == "stop" and text.message.content and not text.message.tool_calls
    # an answer format beside tools: the answer or the calls, each valid
    either = chat(client, messages=CALC_QUESTION, max_tokens=150, tools=[calculator(False)],
                  response_format=PLAYER_FORMAT).choices[0]
    if either.message.tool_calls:
        assert either.finish_reason == "tool_calls"
        check_calls(either.message.tool_calls, {"calculator": schema})
    else:
        jsonschema.validate(json.loads(either.message.content), PLAYER)


def test_logit_bias_and_allowed_token_ids(client: openai.OpenAI, http: httpx.Client) -> None:
    kwargs = {"messages": CALC_QUESTION, "max_tokens": 6, "logprobs": True, "extra_body": THINKING_OFF}
    tokens = [e.token for e in chat(client, **kwargs).choices[0].logprobs.content]
    first = token_id(http, tokens[0])
    banned = [e.token for e in chat(client, **kwargs, logit_bias={str(first): -100}).choices[0].logprobs.content]
    assert tokens[0] not in banned
    seven = token_id(http, "7")
    assert chat(client, **kwargs, logit_bias={str(seven): 100}).choices[0].message.content == "7" * 6
    eight = token_id(http, "8")
    only = chat(client, messages=CALC_QUESTION, max_tokens=6,
                extra_body={"allowed_token_ids": [seven, eight], **THINKING_OFF}).choices[0].message.content
    assert len(only) == 6 and set(only) <= {"7", "8"}


CALL_TEXTS = {  # one call of get_weather and one of convert, as each format's chat template writes them
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
               '{ARGS}<|tool_call_end|><|tool_call_begin|>functions.convert:1<|tool_call_argument_begin|>'
               '{"unit": "km", "n": 3}<|tool_call_end|><|tool_calls_section_end|>',
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {ARGS}}\n</tool_call>\n'
              '<tool_call>\n{"name": "convert", "arguments": {"unit": "km", "n": 3}}\n</tool_call>',
}


@pytest.mark.parametrize("fmt", sorted(CALL_TEXTS))
def test_tool_grammars_hold_what_the_parsers_read(engine: Any, fmt: str) -> None:
    """The grammar of each format accepts exactly the calls its tool parser extracts, with valid arguments."""
    from reasoning_engine.server.protocol import FunctionDef
    from reasoning_engine.server.formats.registry import TOOL_PARSERS
    from reasoning_engine.server.tool_grammar import tool_call_tag

    tools = [FunctionDef(**t["function"]) for t in TOOLS]
    required = {"structural_tag": tool_call_tag(fmt, tools, required=True, parallel=True)}
    single = {"structural_tag": tool_call_tag(fmt, tools, required=True, parallel=False)}
    auto = {"structural_tag": tool_call_tag(fmt, tools, required=False, parallel=True)}
    good = CALL_TEXTS[fmt].replace("{ARGS}", '{"city": "Oslo", "days": 2}')
    parser = TOOL_PARSERS[fmt]()
    parser.feed(good)
    parser.finish()
    assert [c.name for c in parser.calls] == ["get_weather", "convert"]
    for call in parser.calls:
        jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
    assert valid_prefix(engine, required, good) and valid_prefix(engine, auto, "Let me check. " + good)
    assert not valid_prefix(engine, single, good)  # parallel_tool_calls false: the second call is refused
    bad = CALL_TEXTS[fmt].replace("{ARGS}", '{"city": "Rome", "days": 2}')
    assert not valid_prefix(engine, required, bad) and not valid_prefix(engine, auto, bad)
    assert not valid_prefix(engine, required, "The weather is fine.")


CALCULATE = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "required": ["expression"], "properties": {"expression": {"type": "string"}}}}}
SORT = {"type": "function", "function": {
    "name": "sort_numbers", "description": "Sort numbers.",
    "parameters": {"type": "object", "required": ["numbers"],
                   "properties": {"numbers": {"type": "array", "items": {"type": "number"}}}}}}
# what a call's strings must not hold: the Kimi parser's markers, the thinking markers, a special token
CALL_MARKERS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>", "<|im_end|>")


def forced_tag(*tools: dict[str, Any]) -> dict[str, Any]:
    from reasoning_engine.server.protocol import FunctionDef
    from reasoning_engine.server.tool_grammar import tool_call_tag

    return {"structural_tag": tool_call_tag("kimi_k2", [FunctionDef(**t["function"]) for t in tools], required=True,
                                            parallel=True)}


def test_forced_calls_hold_what_the_model_wrote_and_nothing_else(http: httpx.Client, engine: Any) -> None:
    """A forced call's strings took any marker, and the model (which would not call a tool here) wrote
    `</think>` inside its argument string: the parser dropped it, or at `<|tool_call_end|>` cut the call and spilled
    the rest as content and a second call. Now the arguments are exactly what the model wrote (the raw tokens),
    with no marker, nothing is outside the calls, and a call cut by max_tokens is a prefix the grammar allows."""
    cases = [([CALCULATE], "required", "What is 12 + 5?"),
             ([CALCULATE, SORT], {"type": "function", "function": {"name": "sort_numbers"}},
              "Sort these numbers: 42, 7, 19")]
    for tools, choice, question in cases:
        out = http.post("/v1/chat/completions", json={
            "model": "tiny-reasoner", "temperature": 0, "max_tokens": 48, "logprobs": True, "tools": tools,
            "tool_choice": choice, "messages": [{"role": "user", "content": question}], **THINKING_OFF}).json()
        choice_out = out["choices"][0]
        raw = "".join(entry["token"] for entry in choice_out["logprobs"]["content"])
        message = choice_out["message"]
        assert message["content"] is None and len(message["tool_calls"]) == 1, message
        call = message["tool_calls"][0]["function"]
        assert raw.startswith(f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{call['name']}:"), raw
        written = raw.split("<|tool_call_argument_begin|>", 1)[1].split("<|tool_call_end|>")[0]
        assert not any(marker in written for marker in CALL_MARKERS), written
        assert call["arguments"] == written
        offered = [t for t in tools if t["function"]["name"] == call["name"]]
        if choice_out["finish_reason"] == "tool_calls":
            jsonschema.validate(json.loads(call["arguments"]), offered[0]["function"]["parameters"])
        else:
            assert choice_out["finish_reason"] == "length" and valid_prefix(engine, forced_tag(*offered), raw)


def test_forced_call_markers_are_the_tokens_the_model_learnt(http: httpx.Client) -> None:
    """After its thinking the model would answer, not call: the grammar wrote the section's markers as text, the
    model spelled them out of characters (`<`, `|`, `t`, ...), text it never saw, and lost its way. Now a marker
    that is one token is written as that token."""
    out = http.post("/v1/chat/completions", json={
        "model": "tiny-reasoner", "temperature": 0, "max_tokens": 100, "logprobs": True, "tools": [CALCULATE],
        "tool_choice": "required", "messages": [{"role": "user", "content": "What is 12 + 5?"}]}).json()["choices"][0]
    tokens = [entry["token"] for entry in out["logprobs"]["content"]]
    assert out["message"]["reasoning_content"] and out["message"]["content"] is None
    after = tokens[tokens.index("</think>") + 1:]
    assert after[:2] == ["<|tool_calls_section_begin|>", "<|tool_call_begin|>"], after
    header = "".join(after[2:after.index("<|tool_call_argument_begin|>")])
    assert re.fullmatch(r"functions\.calculator:\d+", header), header


def test_forced_calls_in_responses_and_messages_are_calls_only(http: httpx.Client) -> None:
    """The Responses API's tool_choice "required" and Anthropic's {"type": "any"} go through the same grammar: the
    call the model completes is the whole answer, arguments valid against the schema, and the turn ends there
    (was: a second half-call and text up to max_tokens). A random model sampled at random: test_tool_grammar.py."""
    parameters = CALCULATE["function"]["parameters"]
    response = http.post("/v1/responses", json={
        "model": "tiny-reasoner", "temperature": 0, "max_output_tokens": 60, "input": "What is 1234 * 5678?",
        "tools": [{"type": "function", "name": "calculator", "parameters": parameters}], "tool_choice": "required",
        "reasoning": {"effort": "minimal"}}).json()
    assert response["status"] == "completed", response
    assert [item["type"] for item in response["output"]] == ["function_call"], response["output"]
    arguments = json.loads(response["output"][0]["arguments"])
    assert arguments == {"expression": "1234 * 5678"}
    message = http.post("/v1/messages", json={
        "model": "tiny-reasoner", "temperature": 0, "max_tokens": 60, "tool_choice": {"type": "any"},
        "tools": [{"name": "calculator", "input_schema": parameters}], "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "What is 1234 * 5678?"}]}).json()
    assert message["stop_reason"] == "tool_use", message
    assert [block["type"] for block in message["content"]] == ["tool_use"], message["content"]
    assert message["content"][0]["input"] == arguments


BAD_REQUESTS = [
    ("/v1/chat/completions", {"logit_bias": {"92500": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"one": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/chat/completions", {"allowed_token_ids": [3, 92500]}, "allowed_token_ids"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strng"}}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("/v1/chat/completions", {"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
    ("/v1/chat/completions", {"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
     "guided_json"),
    ("/v1/chat/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/chat/completions", {"structured_outputs": {"structural_tag": {
        "type": "structural_tag", "format": {"type": "token", "token": 92500}}}}, "structured_outputs.structural_tag"),
    ("/v1/chat/completions", {"tools": [CONVERT, {"type": "function", "function": {
        "name": "broken", "parameters": {"type": "objct"}}}], "tool_choice": "required"}, "tools[1].function.parameters"),
    # keywords the grammar cannot enforce are named, under the field they came in
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}},
     "response_format.json_schema.schema.properties.x.uniqueItems"),
    ("/v1/chat/completions", {"guided_json": {"type": "integer", "not": {"const": 3}}}, "guided_json.not"),
    ("/v1/chat/completions", {"structured_outputs": {"json": {"oneOf": [{"type": "integer"}, {"minimum": 0}]}}},
     "structured_outputs.json.oneOf"),
    ("/v1/chat/completions", {"tools": [CONVERT, {"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"xs": {"type": "array", "contains": {}}}}}}],
        "tool_choice": "required"}, "tools[1].function.parameters.properties.xs.contains"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "object", "properties": {
            "q": {"type": "string", "pattern": "^.*$"}}}}}]}, "tools[0].function.parameters.properties.q.pattern"),
    ("/v1/completions", {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ("/v1/completions", {"allowed_token_ids": [-1]}, "allowed_token_ids"),
]


def test_bad_ids_and_schemas_are_400s_naming_the_field(http: httpx.Client) -> None:
    for path, extra, param in BAD_REQUESTS:
        base = {"messages": NO_TOOL_QUESTION} if path.endswith("chat/completions") else {"prompt": "Hi"}
        response = http.post(path, json={**base, "max_tokens": 4, **extra})
        assert response.status_code == 400, (extra, response.text)
        error = response.json()["error"]
        assert error["param"] == param, (extra, error)
        assert error["message"].startswith(param), error


def test_unknown_fields_are_logged_once_per_name(http: httpx.Client, caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from reasoning_engine.server import protocol

    # earlier fuzzing in the session may have filled the bounded set of logged names
    monkeypatch.setattr(protocol, "_logged_unknown_fields", set())
    name = f"x_unknown_{uuid.uuid4().hex[:8]}"
    caplog.set_level(logging.WARNING, logger="reasoning_engine.server.protocol")
    for _ in range(3):
        body = {"messages": NO_TOOL_QUESTION, "max_tokens": 1, name: True}
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert sum(name in record.getMessage() for record in caplog.records) == 1


def test_a_constraint_opens_the_thinking_a_template_leaves_to_the_model(tmp_path: Any) -> None:
    """Qwen3-style templates end at the assistant header and the model writes `<think>` itself; the engine starts a
    constraint at once unless the prompt is inside the thinking, so the server opens it, and thinking stays free."""
    from .fake_engine import FakeEngine
    from .helpers import KIMI_TEMPLATE, save_kimi_tokenizer

    tokenizer = save_kimi_tokenizer(tmp_path)
    tokenizer.chat_template = KIMI_TEMPLATE.replace(
        "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}", "")
    engine = FakeEngine(tokenizer, lambda prompt, _params, _index: (
        "I count.</think>" if prompt[-1] == opener else "<think>I count.</think>") + '{"n":3}<|im_end|>')
    opener = tokenizer.convert_tokens_to_ids("<think>")
    with LiveServer(build_app(engine, ServerConfig(reasoning_parser="qwen3"))) as server:
        chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        for response_format, opened in [({"type": "json_object"}, True), ({"type": "text"}, False), (None, False)]:
            extra = {"response_format": response_format} if response_format else {}
            message = chat.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}],
                                                   **extra).choices[0].message
            assert (engine.calls[-1][0][-1] == opener) is opened, response_format
            assert (message.reasoning_content, message.content) == ("I count.", '{"n":3}')
