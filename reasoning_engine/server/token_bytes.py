"""The bytes of one token, for the `bytes` of chat logprobs.

A token may hold part of a character (a byte-level vocabulary spells "—" as three one-byte tokens); its decoded text
is then U+FFFD, whose UTF-8 is not the token. Clients join `bytes` to rebuild such characters, so they must be the
token's own bytes, which the vocabulary's spelling of the token gives.
"""

from __future__ import annotations

import re
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """Token id -> its bytes: an added token's text, or what its spelling encodes (a GPT-2-style byte-level alphabet,
    sentencepiece's `<0xHH>` byte fallback), else the UTF-8 of the decoded text; spellings are read once per id."""

    def __init__(self, tokenizer: Any | None) -> None:
        self._tokenizer = tokenizer
        self._byte_of = _byte_level_alphabet(tokenizer) if tokenizer is not None else None
        added = tokenizer.added_tokens_decoder if tokenizer is not None else {}
        self._added = {token_id: token.content.encode() for token_id, token in added.items()}
        self._spelled: dict[int, bytes | None] = {}

    def __call__(self, token_id: int, text: str) -> list[int]:
        """`text` is the token's decoded text, used where the spelling encodes no bytes."""
        if token_id not in self._spelled:
            self._spelled[token_id] = self._from_spelling(token_id)
        own = self._spelled[token_id]
        return list(own if own is not None else text.encode())

    def _from_spelling(self, token_id: int) -> bytes | None:
        """None where the vocabulary spells text, not bytes."""
        if token_id in self._added:
            return self._added[token_id]
        if self._tokenizer is None:
            return None
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not piece:
            return None  # an id past the tokenizer's vocabulary (padded embedding rows)
        if self._byte_of is not None:
            return bytes(self._byte_of[c] for c in piece) if all(c in self._byte_of for c in piece) else None
        match = _BYTE_FALLBACK.fullmatch(piece)
        return bytes([int(match.group(1), 16)]) if match else None


def _byte_level_alphabet(tokenizer: Any) -> dict[str, int] | None:
    """Character -> byte of GPT-2's byte-level alphabet when the vocabulary spells in it (a space is `Ġ`), else
    None."""
    char_of = bytes_to_unicode()
    space = tokenizer.convert_ids_to_tokens(tokenizer.encode(" ", add_special_tokens=False))
    return {c: b for b, c in char_of.items()} if space == [char_of[ord(" ")]] else None
