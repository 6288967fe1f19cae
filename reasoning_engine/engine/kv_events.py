"""What a replica's prefix cache stores and evicts, as events an external cache-aware router can follow.

The events are vLLM's KV events in kind (`BlockStored` with its parent's hash, `BlockRemoved`): "stored" when a full
block gets its SHA-256 name in the device cache (computed, or copied back from a lower tier), "removed" when the
device pool reuses a named block for other tokens. One event per block name of the first cache group (the
full-attention one; a hybrid model's other groups follow its blocks but may be shorter). Events are numbered from 1
in one bounded log per data-parallel replica; a reader asks for those after the last number it saw and is told when
older ones it had not read were dropped (then it must assume nothing about what it missed).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_CAPACITY = 4096  # events kept; a router polling every second sees far fewer per replica


@dataclass(frozen=True)
class KVEvent:
    seq: int
    kind: str  # "stored" or "removed"
    block_hash: str  # the block's SHA-256 name, hex
    parent_hash: str | None  # a stored block's predecessor in its prompt (None for the first block)
    medium: str  # where the block was filled from: "device" (computed), "host" or "disk" (a lower tier)


class KVEventLog:
    """A bounded, numbered log of cache events, written by the engine thread and read by the server's."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"kv event capacity must be at least 1, got {capacity}")
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.last_seq = 0

    def stored(self, key: bytes, parent: bytes | None, medium: str = "device") -> None:
        self._add("stored", key, parent, medium)

    def removed(self, key: bytes) -> None:
        self._add("removed", key, None, "device")

    def _add(self, kind: str, key: bytes, parent: bytes | None, medium: str) -> None:
        with self._lock:
            self.last_seq += 1
            self._events.append(KVEvent(self.last_seq, kind, key.hex(), parent.hex() if parent else None, medium))

    def since(self, after: int, limit: int = DEFAULT_CAPACITY) -> dict[str, Any]:
        """The events numbered after `after` (at most `limit`), the number to ask after next, and whether events
        the reader had not seen were lost: dropped from the log, or `after` is past the last event (a number from
        before a restart: the reader starts over from the oldest event kept)."""
        if after < 0 or limit < 1:
            raise ValueError(f"after must be >= 0 and limit >= 1, got after={after}, limit={limit}")
        with self._lock:
            reset = after > self.last_seq
            if reset:
                after = 0
            oldest = self._events[0].seq if self._events else self.last_seq + 1
            start = max(0, after + 1 - oldest)  # the log's numbers are consecutive
            events = list(itertools.islice(self._events, start, start + limit))
            return {"events": [asdict(e) for e in events], "next_after": events[-1].seq if events else after,
                    "dropped": reset or after + 1 < oldest}
