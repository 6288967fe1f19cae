"""The OpenAPI document (`/openapi.json`, browsable at `/docs`): every route with its typed request body and every
status it can answer.

Routes parse their own JSON (routing.json_body), so that a bad body is a 400 naming the parameter in the route's
own error shape rather than FastAPI's 422; FastAPI therefore cannot see the bodies, and this module adds them. It
also documents what the app's layers add around every route: the API key (its schemes and 401) when the server has
one, the body-size limit and a broken Content-Length (413, 400) on routes that read a body, and the unexpected error
(500), each in the route's error shape. A route declares its own statuses in its decorator (`responses=errors(400,
404)`). No route answers 422 (query and path parameters that fail their types are 400s too: app.py), so 422 is left
out everywhere. Clients generate code from the document and schemathesis checks the server against it
(tests/server/test_openapi.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF_TEMPLATE = "#/components/schemas/{model}"
EVENT_STREAM = "text/event-stream"
# one server-sent event: `data:` a JSON chunk (or chat's `[DONE]`), `event:` its name on the Responses and Messages APIs
SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string", "minLength": 1}}}

OPENAI_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}

ERROR_DESCRIPTIONS = {400: "The request is invalid; the error names the parameter at fault.",
                      401: "A missing or wrong API key.",
                      404: "The model is not served here.",
                      413: "The body is over the server's size limit.",
                      500: "An unexpected server error.",
                      503: "The engine is not running."}
SECURITY_SCHEMES = {"bearerKey": {"type": "http", "scheme": "bearer"},  # either one: app._AuthMiddleware
                    "anthropicKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
_BODY_METHODS = frozenset({"post", "put", "patch", "delete"})  # the body-size limit reads these methods' bodies


def errors(*statuses: int, words: Mapping[int, str] | None = None) -> dict[int | str, dict[str, Any]]:
    """A route decorator's `responses` for the error statuses it answers itself; `words` describe a status for this
    route rather than as ERROR_DESCRIPTIONS does. install_openapi gives each its error body."""
    words = words or {}
    return {status: {"description": words.get(status, ERROR_DESCRIPTIONS[status])} for status in statuses}


def install_openapi(app: FastAPI, bodies: Mapping[str, type[BaseModel]], version: str, model_names: list[str], *,
                    api_key: bool = False, public_paths: Iterable[str] = (), streamed: Iterable[str] = (),
                    error_shapes: Mapping[str, tuple[str, dict[str, Any]]] | None = None) -> None:
    """Make `app.openapi()` document `bodies` (route path -> request model; every such route is a POST), with each
    body's `model` one of `model_names` (what this server accepts; clients and fuzzers then reach past the 404), and
    every operation's error statuses. With `api_key` every path but `public_paths` needs the key (`Authorization:
    Bearer` or `x-api-key`) and may answer 401; the POST routes at `streamed` may answer with an event stream;
    `error_shapes` maps a path to its error body's component name and JSON schema (default: OpenAI's)."""
    error_shapes = error_shapes or {}
    public, streams = frozenset(public_paths), frozenset(streamed)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=version, routes=app.routes,
                             description="OpenAI-compatible inference server for reasoning models.")
        refs, defs = models_json_schema([(model, "validation") for model in bodies.values()],
                                        ref_template=REF_TEMPLATE)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(defs.get("$defs", {}))
        for path, model in bodies.items():
            operation = schema["paths"][path]["post"]
            ref = refs[(model, "validation")]
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
            body = components[ref["$ref"].rsplit("/", 1)[-1]]
            if "model" in body.get("properties", {}):
                served = {"type": "string", "enum": list(model_names)}
                required = "model" in body.get("required", [])
                body["properties"]["model"] = served if required else {"anyOf": [served, {"type": "null"}]}
        if api_key:
            schema["components"]["securitySchemes"] = SECURITY_SCHEMES
        for path, operations in schema["paths"].items():
            error_name, error_schema = error_shapes.get(path, ("ErrorResponse", OPENAI_ERROR_SCHEMA))
            components[error_name] = error_schema
            keyed = api_key and path not in public
            for method, operation in operations.items():
                if keyed:
                    operation["security"] = [{name: []} for name in SECURITY_SCHEMES]
                _document_statuses(operation["responses"], error_name, layers=[
                    *([401] if keyed else []), *([400, 413] if method in _BODY_METHODS else []), 500])
                if method == "post" and path in streams:
                    operation["responses"]["200"]["content"][EVENT_STREAM] = {"schema": SSE_EVENT_SCHEMA}
        for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 bodies: never sent here
            components.pop(unused, None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _document_statuses(responses: dict[str, Any], error_name: str, layers: list[int]) -> None:
    """No 422; the statuses the app's layers add; every error status with the route's error body."""
    responses.pop("422", None)
    for status in layers:
        responses.setdefault(str(status), {"description": ERROR_DESCRIPTIONS[status]})
    error_ref = {"$ref": REF_TEMPLATE.format(model=error_name)}
    for status, response in responses.items():
        if int(status) >= 400:
            response["content"] = {"application/json": {"schema": error_ref}}
