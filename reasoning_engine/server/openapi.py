"""The OpenAPI document (`/openapi.json`, browsable at `/docs`): every JSON route with its typed request body.

Routes parse their own JSON (app.py's `_json_body`), so that a bad body is a 400 naming the parameter in the route's
own error shape rather than FastAPI's 422; FastAPI therefore cannot see the bodies, and this module adds them, with
the error responses each route can give. Clients generate code from it and schemathesis fuzzes the server with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF_TEMPLATE = "#/components/schemas/{model}"

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

ERROR_STATUSES = {"400": "The request is invalid; `error.param` names the field at fault.",
                  "401": "A missing or wrong API key.",
                  "404": "An unknown model or resource.",
                  "413": "The body is over the server's size limit.",
                  "503": "The engine is not running."}


def install_openapi(app: FastAPI, bodies: Mapping[str, type[BaseModel]], version: str, model_names: list[str],
                    error_shapes: Mapping[str, tuple[str, dict[str, Any]]] | None = None) -> None:
    """Make `app.openapi()` document `bodies` (route path -> request model; every such route is a POST), with each
    body's `model` one of `model_names` (what this server accepts; clients and fuzzers then reach past the 404).
    `error_shapes` maps a path to its error body's component name and JSON schema (default: OpenAI's)."""
    error_shapes = error_shapes or {}

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
            error_name, error_schema = error_shapes.get(path, ("ErrorResponse", OPENAI_ERROR_SCHEMA))
            components[error_name] = error_schema
            error_ref = {"$ref": REF_TEMPLATE.format(model=error_name)}
            operation["responses"].pop("422", None)
            operation["responses"].update({
                status: {"description": text, "content": {"application/json": {"schema": error_ref}}}
                for status, text in ERROR_STATUSES.items()})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
