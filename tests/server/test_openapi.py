"""The OpenAPI document and a bounded schemathesis run against it.

Schemathesis draws requests from `/openapi.json` (valid ones and, in its negative mode, ones that break the schema:
wrong types, missing fields, bad query parameters, undeclared methods) and sends them through the real app over ASGI,
around the fake engine so a few hundred cases take seconds. Every response is checked by schemathesis' default
checks: no 5xx, every status, content type, header and body as documented (errors included, in the route's own error
shape), schema-breaking data refused, 405s with their `Allow` header. The full run (thousands of cases, against a
live server of the bundled model) is scripts/fuzz_api.sh.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from reasoning_engine.server.app import ServerConfig, build_app

from .fake_engine import FakeEngine
from .helpers import save_kimi_tokenizer

pytestmark = pytest.mark.slow  # schemathesis over every operation

CASES_PER_ROUTE = 30
# Left out: whether every schema-valid request is accepted. The APIs' rules across fields and messages (a tool result
# answers a call, prompt plus max_tokens fit the context, the chat template's own rules) have no JSON Schema, so a
# schema-valid request can rightly be a 400; what JSON Schema can say, the document says.
EXCLUDED_CHECKS = [positive_data_acceptance]


def _reply(_prompt: list[int], _params: Any, _index: int) -> str:
    return "<think>thinking</think>the answer"


def _app(config: ServerConfig) -> Any:
    tokenizer = save_kimi_tokenizer(Path(tempfile.mkdtemp(prefix="openapi_tokenizer")))
    return build_app(FakeEngine(tokenizer, _reply), config)


# built at import: schemathesis parametrizes the tests by operation at collection time. Its ASGI calls start and stop
# the app's lifespan, so the engine must outlive the app (a stopped engine makes /health a 503).
schema = schemathesis.openapi.from_asgi("/openapi.json", _app(ServerConfig(shutdown_engine=False)))
KEY_HEADERS = {"Authorization": "Bearer sekret"}
keyed_schema = schemathesis.openapi.from_asgi("/openapi.json", _app(ServerConfig(api_key="sekret",
                                                                                 shutdown_engine=False)),
                                              headers=KEY_HEADERS)


def check_error_shape(path: str, status: int, body: Any) -> None:
    """OpenAI's error object, {"error": {"message": str, "type": str, "param": ..., "code": ...}}, or on Anthropic's
    routes Anthropic's, {"type": "error", "error": {"type": str, "message": str}}."""
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), (path, status, body)
    if path.startswith("/v1/messages"):
        assert body["type"] == "error", (path, status, body)
    assert isinstance(body["error"].get("message"), str) and body["error"]["message"], (path, status, body)
    assert isinstance(body["error"].get("type"), str), (path, status, body)


@schema.parametrize()
@settings(max_examples=CASES_PER_ROUTE, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_every_operation_answers_as_documented(case: Any) -> None:
    response = case.call_and_validate(excluded_checks=EXCLUDED_CHECKS)
    if response.status_code >= 400:
        check_error_shape(case.path, response.status_code, response.json())


@keyed_schema.parametrize()
@settings(max_examples=CASES_PER_ROUTE // 3, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_with_an_api_key_every_operation_needs_it_as_documented(case: Any) -> None:
    """The key's schemes and 401s are documented, and schemathesis' ignored_auth check sends each request without
    the key too."""
    case.call_and_validate(headers=KEY_HEADERS, excluded_checks=EXCLUDED_CHECKS)


def test_openapi_documents_every_json_route(fake_server: Any) -> None:
    _, url = fake_server("hi")
    document = httpx.get(f"{url}/openapi.json").json()
    schemas = document["components"]["schemas"]
    for path, model, error in [
            ("/v1/chat/completions", "ChatCompletionRequest", "ErrorResponse"),
            ("/v1/completions", "CompletionRequest", "ErrorResponse"),
            ("/v1/responses", "ResponsesRequest", "ErrorResponse"),
            ("/v1/messages", "MessagesRequest", "AnthropicError"),
            ("/v1/messages/count_tokens", "CountTokensRequest", "AnthropicError"),
            ("/tokenize", "TokenizeRequest", "ErrorResponse"), ("/detokenize", "DetokenizeRequest", "ErrorResponse")]:
        operation = document["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert "422" not in operation["responses"]  # bad bodies are 400s in the route's error shape
        assert operation["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(error)
    chat = schemas["ChatCompletionRequest"]
    assert "messages" in chat["required"] and chat["properties"]["messages"]["minItems"] == 1
    assert "ChatMessage" in schemas and "ToolDef" in schemas
    # content may be left out only by an assistant message with calls or thinking, as the server checks
    assert {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}} in schemas["ChatMessage"][
        "anyOf"]
    # what the server accepts: a call's arguments as OpenAI's JSON text or, as some clients send them, an object
    assert schemas["FunctionCall"]["properties"]["arguments"]["anyOf"] == [{"type": "string"}, {"type": "object"}]
    docs = httpx.get(f"{url}/docs")
    assert docs.status_code == 200 and "/openapi.json" in docs.text


def test_openapi_documents_every_status_sent(fake_server: Any) -> None:
    """No 422 anywhere (never sent); the stored-response routes' 404s; input_items' paging parameters; event streams
    beside JSON where a route streams; /metrics as text; the API key's 401 and schemes only when there is a key."""
    _, url = fake_server("hi")
    document = httpx.get(f"{url}/openapi.json").json()
    operations = [(path, method, op) for path, ops in document["paths"].items() for method, op in ops.items()]
    assert all("422" not in op["responses"] and "401" not in op["responses"] for _, _, op in operations)
    assert "HTTPValidationError" not in document["components"]["schemas"]
    assert "securitySchemes" not in document["components"]
    item = "/v1/responses/{response_id}"
    for path, method in [(item, "get"), (item, "delete"), (item + "/input_items", "get")]:
        assert document["paths"][path][method]["responses"]["404"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    parameters = {p["name"]: p for p in document["paths"][item + "/input_items"]["get"]["parameters"]}
    assert parameters["order"]["schema"]["enum"] == ["asc", "desc"] and parameters["order"]["in"] == "query"
    assert (parameters["limit"]["schema"]["minimum"], parameters["limit"]["schema"]["maximum"]) == (1, 100)
    assert "after" in parameters
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
        assert set(document["paths"][path]["post"]["responses"]["200"]["content"]) == {
            "application/json", "text/event-stream"}
    assert set(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert {"400", "413"} <= set(document["paths"][item]["delete"]["responses"])  # it has a body limit too
    keyed = httpx.get(f"{fake_server('hi', api_key='k')[1]}/openapi.json", headers={"x-api-key": "k"}).json()
    assert set(keyed["components"]["securitySchemes"]) == {"bearerKey", "anthropicKey"}
    assert "401" in keyed["paths"]["/v1/models"]["get"]["responses"]
    health = keyed["paths"]["/health"]["get"]
    assert "401" not in health["responses"] and "security" not in health


def test_405_allows_every_method_of_its_path_and_bad_parameters_are_400s(fake_server: Any) -> None:
    _, url = fake_server("hi")
    for method, path, allow in [("PUT", "/v1/responses/resp_1", "DELETE, GET"), ("GET", "/v1/chat/completions", "POST"),
                                ("POST", "/v1/models", "GET"), ("DELETE", "/v1/messages", "POST")]:
        response = httpx.request(method, f"{url}{path}")
        assert response.status_code == 405 and response.headers["allow"] == allow, (method, path, response.headers)
        assert "error" in response.json()
    for query, param in [("limit=0", "limit"), ("limit=abc", "limit"), ("limit=101", "limit"), ("order=up", "order")]:
        response = httpx.get(f"{url}/v1/responses/resp_1/input_items?{query}")
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert httpx.get(f"{url}/v1/responses/resp_1/input_items?limit=5&order=asc").status_code == 404


def test_openapi_and_docs_need_the_api_key(fake_server: Any) -> None:
    _, url = fake_server("hi", api_key="sekret")
    for path in ("/openapi.json", "/docs"):
        assert httpx.get(f"{url}{path}").status_code == 401
        assert httpx.get(f"{url}{path}", headers={"Authorization": "Bearer sekret"}).status_code == 200


def test_each_body_names_the_served_models(fake_server: Any) -> None:
    _, url = fake_server("hi", served_model_names=["a", "b"])
    schemas = httpx.get(f"{url}/openapi.json").json()["components"]["schemas"]
    assert schemas["MessagesRequest"]["properties"]["model"] == {"type": "string", "enum": ["a", "b"]}
    assert schemas["ChatCompletionRequest"]["properties"]["model"] == {
        "anyOf": [{"type": "string", "enum": ["a", "b"]}, {"type": "null"}]}
