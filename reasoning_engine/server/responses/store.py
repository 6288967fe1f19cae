"""Stored responses (`store: true`), which `previous_response_id` continues and GET returns: in memory, bounded in
count and age, least recently used first out."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_STORED_RESPONSES = 1024
DEFAULT_STORED_RESPONSE_TTL_S = 3600.0


@dataclass
class StoredResponse:
    """A finished response: its body as returned, and every item its prompt was made of (the stored conversation
    before it, then its own input), each with an id."""

    body: dict[str, Any]
    input_items: list[dict[str, Any]]

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a follow-up's `previous_response_id` prepends: the input, then the output."""
        return [*self.input_items, *self.body["output"]]


class ResponseStore:
    """Stored responses in memory: least recently used first out past `max_items`, and each gone `ttl_s` after it
    was stored. Items are shared between a conversation's responses, so a chain costs one list of references per
    response on top of its items."""

    def __init__(self, max_items: int = DEFAULT_MAX_STORED_RESPONSES, ttl_s: float = DEFAULT_STORED_RESPONSE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_items < 1 or ttl_s <= 0:
            raise ValueError("the response store needs max_items >= 1 and ttl_s > 0")
        self.max_items = max_items
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response: StoredResponse) -> None:
        self._expire()
        self._entries[response.body["id"]] = (self._clock() + self.ttl_s, response)
        self._entries.move_to_end(response.body["id"])
        while len(self._entries) > self.max_items:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry[1]

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        now = self._clock()
        for response_id in [rid for rid, (deadline, _) in self._entries.items() if deadline <= now]:
            del self._entries[response_id]
