"""OpenAI-style error objects: `{"error": {"message", "type", "param", "code"}}`, so clients raise their usual
exception classes (openai.BadRequestError, AuthenticationError, NotFoundError) with a useful message."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
#: How request models write the tags of their discriminated unions (`<list>`, `~TextBlock`), so that an error's
#: parameter leaves them out.
UNION_TAG_MARKS = ("<", "~")


class APIError(Exception):
    """An error the client caused (4xx) or that the server reports cleanly (5xx), with the parameter at fault."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def param_from_loc(loc: tuple[int | str, ...]) -> str | None:
    """pydantic's error location -> `messages[0].content`, for every API's request models. Union tags marked as
    UNION_TAG_MARKS says are left out (`input[2].content`, not `input.<list>[2].<message>.content`); any other
    member name pydantic puts in a location ("str", "list[TextPart]", "NamedToolChoice") ends the path, since
    fields are snake_case."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item.startswith(UNION_TAG_MARKS):
            continue
        elif _FIELD.fullmatch(item) and item not in _TYPE_NAMES:
            parts.append(("." if parts else "") + item)
        else:
            break
    return "".join(parts) or None


def from_validation_error(exc: ValidationError) -> APIError:
    """The first error, as a 400 naming its field: how every route words a body that fails its model."""
    return from_error_detail(exc.errors(include_url=False)[0])


def from_error_detail(detail: Mapping[str, Any]) -> APIError:
    """One of pydantic's error details (`loc`, `msg`) as a 400 naming its field."""
    param = param_from_loc(tuple(detail["loc"]))
    message = str(detail["msg"]).removeprefix("Value error, ")
    return bad_request(f"{param}: {message}" if param else message, param=param, code="invalid_value")
