"""The OpenAPI document and a bounded schemathesis run against it.

Schemathesis draws request bodies from `/openapi.json` (valid ones and, in its negative mode, bodies that break the
schema) and sends them through the real app over ASGI, around the fake engine so a few hundred cases take seconds.
Every response must be below 500, and every error must be in its route's error shape. The full run (thousands of
cases, against a live server of the bundled model) is scripts/fuzz_api.py.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, settings

from reasoning_engine.server.app import ServerConfig, build_app

from .fake_engine import FakeEngine
from .helpers import save_kimi_tokenizer

CASES_PER_ROUTE = 30


def _reply(_prompt: list[int], _params: Any, _index: int) -> str:
    return "<think>thinking</think>the answer"


# built at import: schemathesis parametrizes the test by operation at collection time
schema = schemathesis.openapi.from_asgi("/openapi.json", build_app(
    FakeEngine(save_kimi_tokenizer(Path(tempfile.mkdtemp(prefix="openapi_tokenizer"))), _reply), ServerConfig()))


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
def test_fuzzed_requests_get_no_server_error(case: Any) -> None:
    response = case.call()
    assert response.status_code < 500, (case.path, case.body, response.text[:500])
    if response.status_code >= 400:
        check_error_shape(case.path, response.status_code, response.json())


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
    docs = httpx.get(f"{url}/docs")
    assert docs.status_code == 200 and "/openapi.json" in docs.text


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
