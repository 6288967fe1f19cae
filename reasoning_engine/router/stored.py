"""Which replica holds a stored Responses API response: the requests that name one (`previous_response_id`, and
GET / DELETE /v1/responses/{id} with its sub-paths) must go to the replica that made it, as stored responses live in
that replica's memory. The router notes each response's id from the answer that carries it (the JSON body, or the
`response.created` event of a stream), in a bounded LRU; an id it never saw (made before the router started, or
forgotten) is looked up by asking the replicas."""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

MAX_OWNERS = 65536  # response ids remembered, least recently used forgotten first (then looked up again)
MAX_ID_CHARS = 256  # longer ids are no response's: not looked up
_PATH = re.compile(r"^/v1/responses/([^/]+)(?:/[^/]+)?$")


def referenced_response(method: str, path: str, body: bytes) -> str | None:
    """The stored response a request needs, if any: the id in /v1/responses/{id}[/...], or a POST /v1/responses
    body's `previous_response_id`."""
    match = _PATH.match(path)
    if match is not None:
        return _valid(match.group(1))
    if method == "POST" and path == "/v1/responses" and body:
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if isinstance(data, dict):
            return _valid(data.get("previous_response_id"))
    return None


def response_id(payload: bytes) -> str | None:
    """The id of the response a replica's answer (a JSON body, or one server-sent event) carries, if it is one."""
    text = payload.strip()
    if text.startswith(b"event:") or text.startswith(b"data:"):
        text = b"\n".join(line[5:].strip() for line in text.splitlines() if line.startswith(b"data:"))
    try:
        data: Any = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if isinstance(data, dict) and isinstance(data.get("response"), dict):
        data = data["response"]
    if isinstance(data, dict) and data.get("object") == "response":
        return _valid(data.get("id"))
    return None


def _valid(value: Any) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS else None


class ResponseOwners:
    """Response id -> the URL of the replica that made it, least recently used forgotten past `limit`."""

    def __init__(self, limit: int = MAX_OWNERS) -> None:
        self.limit = limit
        self._urls: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._urls)

    def get(self, response: str) -> str | None:
        url = self._urls.get(response)
        if url is not None:
            self._urls.move_to_end(response)
        return url

    def note(self, response: str, url: str) -> None:
        self._urls[response] = url
        self._urls.move_to_end(response)
        while len(self._urls) > self.limit:
            self._urls.popitem(last=False)

    def forget(self, response: str) -> None:
        self._urls.pop(response, None)
