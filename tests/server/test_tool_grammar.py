"""The tool-call grammars of every format keep the markers their parsers act on out of a call's strings: the
format's own markers, the thinking markers and the tokenizer's special tokens (which the parser chain drops from
the text). A model that writes `<|tool_call_end|>` inside an argument string would otherwise end the call there
and spill the rest into the content. Strings xgrammar cannot filter (length bounds, patterns, formats, listed
values, names) are rewritten or refused by name, and markers that are single tokens are written as those tokens.
Tokenizer-free (xgrammar's front end) but for the token test."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from xgrammar import Grammar
from xgrammar.testing import _is_grammar_accept_string

from reasoning_engine.server.app import ServerConfig, build_app
from reasoning_engine.server.protocol import FunctionDef
from reasoning_engine.server.formats.registry import CALL_SYNTAXES, TOOL_PARSERS
from reasoning_engine.server.tool_grammar import ToolSchemaError, tool_call_tag
from reasoning_engine.structured.compiler import GrammarCompiler
from reasoning_engine.structured.params import StructuredOutputsParams

from .helpers import LiveServer, save_random_checkpoint, sse_events

SEARCH = {"type": "object", "required": ["query"],
          "properties": {"query": {"type": "string"}, "note": {"type": "string", "maxLength": 40},
                         "code": {"type": "string", "maxLength": 5}, "sign": {"type": "string", "maxLength": 1}}}
TOOLS = [FunctionDef(name="search", parameters=SEARCH)]
# what the server's parser chain drops from the answer: special tokens and the thinking markers
DROPPED = ("<|im_end|>", "<|im_user|>", "<think>", "</think>")


def written(fmt: str, args: dict[str, str]) -> str:
    """One call of `search` with string arguments, as `fmt`'s model writes it."""
    syntax = CALL_SYNTAXES[fmt]
    if fmt in ("glm45", "glm47"):
        body = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in args.items())
    elif fmt == "minimax_m2":
        body = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in args.items())
    elif fmt in ("qwen3_coder", "qwen3_xml"):
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    elif fmt in ("deepseek_v32", "deepseek_v4"):
        body = "\n".join(f'<｜DSML｜parameter name="{k}" string="true">{v}</｜DSML｜parameter>' for k, v in args.items())
    else:
        body = json.dumps(args, ensure_ascii=False)
    if fmt == "kimi_k2":
        body = "0<|tool_call_argument_begin|>" + body
    return syntax.lead + syntax.open + syntax.call_begin("search") + body + syntax.call_end + syntax.close


def accepts(tag: dict[str, Any], text: str) -> bool:
    StructuredOutputsParams(structural_tag=tag)  # the server's own check passes
    return _is_grammar_accept_string(Grammar.from_structural_tag(json.dumps(tag)), text)


def parsed(fmt: str, text: str) -> tuple[str, list[tuple[str, Any]]]:
    """What the format's parser makes of `text`: the content (the chain strips its outer whitespace) and the
    calls."""
    cls = TOOL_PARSERS[fmt]
    parser = cls(drop=DROPPED, **({"schemas": {"search": SEARCH}} if cls.uses_schemas else {}))
    content = parser.feed(text)[0] + parser.finish()[0]

    def arguments(text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            return text

    return content.strip(), [(c.name, arguments(c.arguments)) for c in parser.calls]


# the marker that ends a call in each format (hermes scans its JSON, so only the grammar keeps its tag out)
CALL_ENDS = {"kimi_k2": "<|tool_call_end|>", "glm45": "</tool_call>", "glm47": "</tool_call>",
             "minimax_m2": "</invoke>", "deepseek_v3": "<｜tool▁call▁end｜>", "deepseek_v31": "<｜tool▁call▁end｜>",
             "deepseek_v32": "</｜DSML｜invoke>", "deepseek_v4": "</｜DSML｜invoke>", "gpt_oss": "<|call|>",
             "qwen3_coder": "</parameter>", "qwen3_xml": "</function>"}


@pytest.mark.parametrize("fmt", sorted(CALL_SYNTAXES))
def test_no_string_in_a_call_holds_a_marker_the_parsers_act_on(fmt: str) -> None:
    required = tool_call_tag(fmt, TOOLS, required=True, parallel=True, dropped=DROPPED)
    strict = tool_call_tag(fmt, TOOLS, required=False, parallel=True, dropped=DROPPED)
    clean = {"query": "fjords <b> | lakes", "note": "a (i) b", "code": "x|y"}
    assert parsed(fmt, written(fmt, clean)) == ("", [("search", clean)])
    assert accepts(required, written(fmt, clean)) and accepts(strict, "Let me look. " + written(fmt, clean))
    markers = {*TOOL_PARSERS[fmt].call_markers(), *DROPPED}
    for marker in markers:
        for args in ({"query": f"a{marker}b"}, {"query": marker}, {"query": "x", "note": f"{marker}!"}):
            assert not accepts(required, written(fmt, args)), (marker, args)
            assert not accepts(strict, "Let me look. " + written(fmt, args)), (marker, args)
    if fmt in CALL_ENDS:  # why: the parser would end the call inside the string
        args = {"query": f"a{CALL_ENDS[fmt]}b"}
        assert parsed(fmt, written(fmt, args)) != ("", [("search", args)])


@pytest.mark.parametrize("fmt", ["kimi_k2", "hermes", "glm45", "minimax_m2", "deepseek_v32", "deepseek_v4",
                                 "qwen3_coder"])
def test_length_bounds_hold_beside_the_marker_exclusion(fmt: str) -> None:
    """xgrammar drops a filtered string's length bounds: they become a pattern that cannot open a marker (the
    characters that start a marker that fits are left out; a string shorter than every marker keeps them)."""
    tag = tool_call_tag(fmt, TOOLS, required=True, parallel=True, dropped=DROPPED)
    assert accepts(tag, written(fmt, {"query": "q", "note": "n" * 40, "code": "abcde", "sign": "<"}))
    assert not accepts(tag, written(fmt, {"query": "q", "note": "n" * 41}))
    assert not accepts(tag, written(fmt, {"query": "q", "code": "abcdef"}))
    assert not accepts(tag, written(fmt, {"query": "q", "sign": "<<"}))
    assert not accepts(tag, written(fmt, {"query": "q", "note": "a<b"}))


QWEN_TOOLS = {
    "get_weather": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer"},
        "hourly": {"type": "boolean"}, "threshold": {"type": "number"}, "note": {"type": ["string", "null"]},
        "tags": {"type": "array", "items": {"type": "string"}}, "raw": {"type": "array"},
        "filters": {"type": "object", "properties": {"rain": {"type": "boolean"}}}}},
    "ping": {"type": "object", "properties": {}},
}


def qwen_call(name: str, args: dict[str, Any], around: str = "\n") -> str:
    """A call as Qwen3-Coder's template writes it (`around` each value: the template's newline)."""
    body = "".join(f"<parameter={k}>{around}{v if isinstance(v, str) else json.dumps(v)}{around}</parameter>\n"
                   for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def qwen_parsed(text: str) -> tuple[str, list[tuple[str, Any]]]:
    parser = TOOL_PARSERS["qwen3_coder"](drop=DROPPED, schemas=QWEN_TOOLS)
    content = parser.feed(text)[0] + parser.finish()[0]
    return content.strip(), [(c.name, json.loads(c.arguments)) for c in parser.calls]


@pytest.mark.parametrize("seed", range(3))
def test_qwen3_coder_grammar_accepts_what_the_parser_reads_as_valid_calls(seed: int) -> None:
    """Constrained Qwen3-Coder calls: the template's text of random valid calls is accepted by the required, named
    and strict-auto grammars and parses back to the arguments written (so to the schema's types); a value of the
    wrong type, a string holding `</parameter>` or a missing required parameter is refused."""
    rng = random.Random(seed)
    tools = [FunctionDef(name=n, parameters=p) for n, p in QWEN_TOOLS.items()]
    required = tool_call_tag("qwen3_coder", tools, required=True, parallel=True, dropped=DROPPED)
    strict = tool_call_tag("qwen3_coder", tools, required=False, parallel=True, dropped=DROPPED)
    named = tool_call_tag("qwen3_coder", tools[:1], required=True, parallel=False, dropped=DROPPED)
    texts = ["x", "a < b", "  indented\n\tcode\n", "<b>bold</b>", "line\n\nline", "é ☕ \\ \"q\""]
    calls = []
    for _ in range(rng.randint(1, 3)):
        args: dict[str, Any] = {"city": rng.choice(texts)}
        optional = {"unit": rng.choice(["celsius", "fahrenheit"]), "days": rng.randint(-9, 999),
                    "hourly": rng.choice([True, False]), "threshold": rng.choice([0.5, -2, 1e-3]),
                    "note": rng.choice([None, "n <1>"]), "tags": rng.sample(texts, 2), "raw": [1, "two", None],
                    "filters": {"rain": rng.choice([True, False])}}
        args |= {k: v for k, v in optional.items() if rng.random() < 0.6}
        args = {k: args[k] for k in QWEN_TOOLS["get_weather"]["properties"] if k in args}  # the schema's order
        calls.append(("get_weather", args))
    text = "\n".join(qwen_call(n, {k: "null" if v is None else v for k, v in a.items()}) for n, a in calls)
    for value in calls:
        jsonschema.validate(value[1], QWEN_TOOLS["get_weather"])
    assert accepts(required, text) and accepts(strict, "Let me look.\n\n" + text)
    assert qwen_parsed(text) == ("", calls)
    assert accepts(named, qwen_call(*calls[0])) and not accepts(named, text if len(calls) > 1 else text + "\n" + text)
    assert accepts(required, qwen_call("ping", {})) and qwen_parsed(qwen_call("ping", {})) == ("", [("ping", {})])
    # one whitespace character around a value is what the grammar allows: where it is not the template's newline
    # a listed or typed value still parses to itself
    spaced = qwen_call("get_weather", {"city": "x", "unit": "celsius", "days": 3}, around=" ")
    assert accepts(required, spaced) and qwen_parsed(spaced)[1] == [
        ("get_weather", {"city": " x ", "unit": "celsius", "days": 3})]
    for bad in ({"city": "x", "days": "3.5"}, {"city": "x", "hourly": "yes"}, {"city": "x", "unit": "kelvin"},
                {"city": "a</parameter>b"}, {"days": 3}, {"city": "x", "filters": {"rain": 1}}):
        assert not accepts(required, qwen_call("get_weather", bad)), bad


def refusal(parameters: dict[str, Any], name: str = "search") -> str:
    with pytest.raises(ToolSchemaError) as error:
        tool_call_tag("kimi_k2", [FunctionDef(name=name, parameters=parameters)], required=True, parallel=False,
                      dropped=DROPPED)
    assert error.value.index == 0 and str(error.value).startswith(f"tools[0].{error.value.where}: ")
    return error.value.where


def string_parameter(**schema: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"q": {"type": "string", **schema}}, "required": ["q"]}


def test_strings_the_grammar_cannot_filter_are_refused_by_name() -> None:
    assert refusal(string_parameter(pattern="^.*$")) == "function.parameters.properties.q.pattern"
    assert refusal(string_parameter(pattern=r"^[^,]+$")) == "function.parameters.properties.q.pattern"
    assert refusal(string_parameter(format="email")) == "function.parameters.properties.q.format"
    assert refusal({"type": "object", "properties": {"q": {"enum": ["ok", "a</think>"]}}}) == \
        "function.parameters.properties.q.enum"
    assert refusal({"type": "object", "properties": {"a<|tool_call_end|>": {"type": "integer"}}}) == \
        "function.parameters.properties.a<|tool_call_end|>"
    assert refusal({"type": "object"}, name="f<|tool_call_begin|>") == "function.name"
    # patterns and formats that cannot write a marker, and formats xgrammar ignores, stay as they are
    for fine in (string_parameter(pattern=r"^[0-9 +*/()-]+$"), string_parameter(format="date"),
                 string_parameter(pattern=r"^<[0-9]+>$"), string_parameter(format="password")):
        tag = tool_call_tag("kimi_k2", [FunctionDef(name="f", parameters=fine)], required=True, parallel=False,
                            dropped=DROPPED)
        StructuredOutputsParams(structural_tag=tag)


def test_markers_that_are_tokens_are_written_as_tokens(kimi_tokenizer: Any) -> None:
    """A marker spelled out of characters is text the model never learnt: where the grammar writes a marker that
    is one token, it takes only that token."""
    ids = {m: kimi_tokenizer.convert_tokens_to_ids(m) for m in TOOL_PARSERS["kimi_k2"].call_markers()
           if len(kimi_tokenizer.encode(m, add_special_tokens=False)) == 1}
    assert {"<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_end|>"} <= set(ids)
    end = kimi_tokenizer.convert_tokens_to_ids("<|im_end|>")
    compiler = GrammarCompiler(kimi_tokenizer, len(kimi_tokenizer), [end])
    for required in (True, False):
        spec = StructuredOutputsParams(structural_tag=tool_call_tag(
            "kimi_k2", TOOLS, required=required, parallel=True, dropped=DROPPED, marker_ids=ids))
        call = written("kimi_k2", {"query": "fjords"})
        tokens = kimi_tokenizer.encode(call, add_special_tokens=False)
        assert compiler.matcher(spec).accept_prefix(tokens) == len(tokens)
        spelled = [kimi_tokenizer.convert_tokens_to_ids(ch) for ch in call.removeprefix("<|tool_calls_section_begin|>")]
        head = [ids["<|tool_calls_section_begin|>"]]
        if required:  # the section's first marker spelled out is refused; under auto the model's own text starts it
            assert compiler.matcher(spec).accept_prefix([kimi_tokenizer.convert_tokens_to_ids("<")]) == 0
        matcher = compiler.matcher(spec)
        assert matcher.accept_prefix(head) == 1 and matcher.accept_prefix(spelled) == 0  # `<` of `<|tool_call_begin|>`


# ---- end to end: a tiny random model forced to call, sampled at random ----

# bounded values only: a random model writes strings and numbers for as long as the grammar lets it
CONVERT = {"type": "object", "additionalProperties": False, "required": ["unit", "n"],
           "properties": {"unit": {"enum": ["m", "km"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                          "note": {"type": "string", "maxLength": 24}, "exact": {"type": "boolean"}}}
LABEL = {"type": "object", "additionalProperties": False, "required": ["text"],
         "properties": {"text": {"type": "string", "minLength": 1, "maxLength": 30}}}
FORCED_TOOLS = {"convert": CONVERT, "label": LABEL}
FORCED_FORMATS = ["kimi_k2", "hermes", "glm45", "minimax_m2"]  # the formats the test tokenizer can spell
SEEDS = range(6)


@pytest.fixture(scope="module")
def random_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from reasoning_engine.engine.async_engine import AsyncLLM

    model = save_random_checkpoint(tmp_path_factory.mktemp("random_kimi_llama"))
    config = json.loads((model / "config.json").read_text())  # room for the tools' schemas, one token a character
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    engine = AsyncLLM(model=str(model), device="cpu", kv_cache_blocks=512, block_size=16, max_model_len=2048,
                      max_num_seqs=8)
    yield engine
    engine.shutdown_sync()


@pytest.fixture(scope="module", params=FORCED_FORMATS)
def forced(request: pytest.FixtureRequest, random_engine: Any) -> Iterator[tuple[str, httpx.Client]]:
    """(the call format, a client of a server around the random model speaking it)."""
    config = ServerConfig(shutdown_engine=False, tool_call_parser=request.param, served_model_names=["m"])
    with LiveServer(build_app(random_engine, config)) as live, httpx.Client(base_url=live.url, timeout=300) as http:
        yield request.param, http


def valid_call(name: str, arguments: Any) -> None:
    assert name in FORCED_TOOLS, name
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, FORCED_TOOLS[name])
    text = json.dumps(arguments)
    assert not any(marker in text for marker in ("<|", "</think>", "<think>", "</tool_call>", "<tool_call>")), text


def chat_tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": n, "description": n, "parameters": p}}
            for n, p in FORCED_TOOLS.items()]


@pytest.mark.slow
def test_forced_chat_calls_of_a_random_model_are_calls_only_and_end(forced: tuple[str, httpx.Client]) -> None:
    """Under tool_choice "required" or a named tool, every choice of a randomly sampled random model (n=3,
    several seeds, parallel calls on and off, thinking on and off) is calls only: each parses, its arguments valid
    against its tool's schema, no content, and the turn ends after them (finish_reason "tool_calls", not the token
    limit). A call opener the model writes inside its thinking is thinking: the engine holds only what follows
    `</think>`. Streamed, the same seed gives the same calls."""
    fmt, http = forced
    for seed in SEEDS:
        named = seed % 3 == 2
        choice = {"type": "function", "function": {"name": "label"}} if named else "required"
        body = {"model": "m", "temperature": 1.0, "seed": seed, "n": 3, "max_tokens": 700, "tools": chat_tools(),
                "tool_choice": choice, "parallel_tool_calls": seed % 2 == 0,
                "messages": [{"role": "user", "content": "Convert 5 km."}],
                "chat_template_kwargs": {"thinking": seed % 4 >= 2}}
        out = http.post("/v1/chat/completions", json=body).json()
        assert len(out.get("choices", ())) == 3, out
        for c in out["choices"]:
            message = c["message"]
            assert c["finish_reason"] == "tool_calls" and not message["content"], (fmt, seed, c)
            calls = message["tool_calls"]
            assert calls and (body["parallel_tool_calls"] or len(calls) == 1), calls
            for call in calls:
                valid_call(call["function"]["name"], call["function"]["arguments"])
                assert not named or call["function"]["name"] == "label"
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            events = [e for e in sse_events(response) if isinstance(e, dict)]
        streamed: dict[int, dict[int, dict[str, str]]] = {}
        for event in events:
            for c in event["choices"]:
                assert not c["delta"].get("content"), c
                for delta in c["delta"].get("tool_calls") or []:
                    call = streamed.setdefault(c["index"], {}).setdefault(delta["index"], {"name": "", "arguments": ""})
                    call["name"] += delta.get("function", {}).get("name") or ""
                    call["arguments"] += delta.get("function", {}).get("arguments") or ""
        whole = {c["index"]: {i: {"name": t["function"]["name"], "arguments": t["function"]["arguments"]}
                              for i, t in enumerate(c["message"]["tool_calls"])} for c in out["choices"]}
        assert streamed == whole, (fmt, seed)


@pytest.mark.slow
def test_forced_responses_and_messages_calls_of_a_random_model_end(forced: tuple[str, httpx.Client]) -> None:
    """The Responses API's tool_choice "required" / named function and Anthropic's {"type": "any"} / {"type":
    "tool"}: the output is function calls / tool_use blocks only, valid against the schema, and the turn ends."""
    _, http = forced
    for seed in SEEDS:
        named = seed % 2 == 1
        response = http.post("/v1/responses", json={
            "model": "m", "temperature": 1.0, "seed": seed, "max_output_tokens": 700, "input": "Convert 5 km.",
            "tools": [{"type": "function", "name": n, "parameters": p} for n, p in FORCED_TOOLS.items()],
            "tool_choice": {"type": "function", "name": "convert"} if named else "required",
            "reasoning": {"effort": "minimal"}}).json()
        assert response["status"] == "completed", response
        assert {item["type"] for item in response["output"]} == {"function_call"}, response["output"]
        for item in response["output"]:
            valid_call(item["name"], item["arguments"])
            assert not named or item["name"] == "convert"
        message = http.post("/v1/messages", json={
            "model": "m", "temperature": 1.0, "metadata": {}, "max_tokens": 700,
            "tools": [{"name": n, "input_schema": p} for n, p in FORCED_TOOLS.items()],
            "tool_choice": {"type": "tool", "name": "label"} if named else {"type": "any"},
            "thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "Convert 5 km."}]}).json()
        assert message["stop_reason"] == "tool_use", message
        assert {block["type"] for block in message["content"]} == {"tool_use"}, message["content"]
        for block in message["content"]:
            valid_call(block["name"], block["input"])
            assert not named or block["name"] == "label"


UNIQUE = {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}
WHERE = "properties.xs.uniqueItems"


def test_unenforceable_schemas_are_400s_naming_the_keyword_on_every_api(fake_server: Any) -> None:
    """A schema keyword the grammar does not enforce is refused wherever a schema constrains the output, the
    error naming the keyword's path in each API's own terms (Responses' flat tools, Anthropic's input_schema)."""
    _, url = fake_server("hi")
    user = [{"role": "user", "content": "x"}]
    chat_tool = {"type": "function", "function": {"name": "f", "parameters": UNIQUE}}
    cases = [
        ("/v1/chat/completions", {"messages": user, "tools": [chat_tool], "tool_choice": "required"},
         f"tools[0].function.parameters.{WHERE}"),
        ("/v1/chat/completions", {"messages": user, "tools": [
            {"type": "function", "function": {"name": "f", "parameters": UNIQUE, "strict": True}}]},
         f"tools[0].function.parameters.{WHERE}"),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
            "name": "a", "schema": UNIQUE}}}, f"response_format.json_schema.schema.{WHERE}"),
        ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": UNIQUE}],
                           "tool_choice": "required"}, f"tools[0].parameters.{WHERE}"),
        ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": UNIQUE}}},
         f"text.format.schema.{WHERE}"),
        ("/v1/messages", {"max_tokens": 5, "messages": user, "tool_choice": {"type": "tool", "name": "g"},
                          "tools": [{"name": "f", "input_schema": {"type": "object"}},
                                    {"name": "g", "input_schema": UNIQUE}]}, f"tools[1].input_schema.{WHERE}"),
    ]
    for path, body, param in cases:
        response = httpx.post(f"{url}{path}", json={"model": "fake-model", **body}, timeout=30)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["message"].startswith(f"{param}: `uniqueItems` is not enforced"), (path, error)
        assert path == "/v1/messages" or error["param"] == param
    # a tool that is offered but neither strict nor forced constrains nothing: its schema is the client's business
    plain = httpx.post(f"{url}/v1/chat/completions", json={"messages": user, "tools": [chat_tool]}, timeout=30)
    assert plain.status_code == 200
