"""What a request's prompt begins with, as chained SHA-256 hashes of fixed-size blocks, and a bounded LRU per replica
of the blocks it was sent.

The router does not tokenize: it hashes the request's prompt-bearing fields (tools, system prompt or instructions,
then messages / input / prompt, in the order a chat template renders them) serialized canonically, in blocks of
`block_chars` characters. Two requests whose messages agree up to some turn agree on the text up to there, so the
number of leading blocks they share tracks the prompt tokens the replica's prefix cache can reuse (about 4 characters
a token on English text) without the model's tokenizer, at the cost of block boundaries that are not the engine's.
Each block's hash covers every block before it (like the engine's own block hashes), so a match is always a prefix.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

DEFAULT_BLOCK_CHARS = 64
DEFAULT_MAX_BLOCKS = 65536

# the fields that carry prompt text, in the order chat templates put them into the prompt
_PROMPT_FIELDS = ("tools", "system", "instructions", "messages", "input", "prompt")


def prompt_text(body: Any) -> str:
    """The request body's prompt-bearing fields as canonical text: a message list ends where its last message ends,
    so a longer conversation's text starts with a shorter one's."""
    if not isinstance(body, dict):
        return ""
    parts: list[str] = []
    for field in _PROMPT_FIELDS:
        value = body.get(field)
        if value is None:
            continue
        if isinstance(value, list) and field in ("messages", "input", "tools"):
            parts.extend(_canonical(item) for item in value)
        else:
            parts.append(_canonical(value))
    return "".join(part + "\n" for part in parts)


def _canonical(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False,
                                                           separators=(",", ":"))


def block_hashes(text: str, block_chars: int = DEFAULT_BLOCK_CHARS) -> list[bytes]:
    """SHA-256 of each full block of `text`, each chained on the one before; a partial last block is not hashed
    (the engine caches only full blocks either)."""
    if block_chars <= 0:
        raise ValueError(f"block_chars must be > 0, got {block_chars}")
    hashes: list[bytes] = []
    previous = b""
    data = text.encode("utf-8")
    step = block_chars
    for start in range(0, len(data) - step + 1, step):
        previous = hashlib.sha256(previous + data[start:start + step]).digest()
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """The blocks one replica was sent, least recently used first out, at most `max_blocks` of them (the router's
    memory stays bounded whatever clients send)."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be > 0, got {max_blocks}")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def matched(self, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, this replica was sent (chained hashes: the first miss ends it)."""
        count = 0
        for digest in hashes:
            if digest not in self._blocks:
                break
            count += 1
        return count

    def add(self, hashes: list[bytes]) -> None:
        """Record `hashes` as sent, most recently used, the first block the most recent of all (a prefix's deeper
        blocks leave before its first ones, as leaves leave a radix tree first); evict the oldest beyond
        `max_blocks`."""
        for digest in reversed(hashes):
            self._blocks[digest] = None
            self._blocks.move_to_end(digest)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
