"""Finding marker strings (`</think>`, `<|tool_call_begin|>`, ...) in text that arrives in arbitrary pieces.

Streamed text can split a marker across deltas ("<|tool_ca" + "ll_begin|>"), so every parser holds back a tail that
could still grow into a marker and only releases it once it cannot. The same code path serves the non-streaming
case (the whole text fed at once), which keeps the two results identical.
"""

from __future__ import annotations

import re
from collections.abc import Iterable


class MarkerSet:
    """A fixed set of markers searchable in one regex pass, with the held-back tail computed from their prefixes."""

    def __init__(self, markers: Iterable[str]) -> None:
        self.markers: tuple[str, ...] = tuple(sorted({m for m in markers if m}, key=len, reverse=True))
        self._regex = re.compile("|".join(re.escape(m) for m in self.markers)) if self.markers else None
        self._prefixes = {m[:i] for m in self.markers for i in range(1, len(m))}
        self._longest = max((len(m) for m in self.markers), default=0)

    def search(self, text: str, start: int = 0) -> re.Match[str] | None:
        """The leftmost (then longest) marker occurrence at or after `start`."""
        return self._regex.search(text, start) if self._regex else None

    def held_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a marker (0 when none)."""
        for size in range(min(self._longest - 1, len(text)), 0, -1):
            if text[-size:] in self._prefixes:
                return size
        return 0

    def split(self, text: str) -> tuple[str, str | None, str]:
        """(text before the first marker, the marker, the text after it); without a complete marker:
        (the part that is safe to release, None, the tail held back because it may start a marker)."""
        match = self.search(text)
        if match:
            return text[: match.start()], match.group(0), text[match.end():]
        held = self.held_tail(text)
        if held:
            return text[:-held], None, text[-held:]
        return text, None, ""
