"""Incremental detokenization and stop strings.

Decoding token by token is wrong for byte-level and sentencepiece tokenizers (a character can span tokens, a leading
space depends on the previous token), so each new piece is the difference between decoding a short window with and
without the new tokens; a window that ends in an incomplete character (U+FFFD) waits for more tokens. Stop strings are
searched only in the newly affected tail, and text that could still become a stop string is held back from streaming.
"""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT = 6  # prompt tokens that seed the window, so the first output token gets its leading space right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop_strings: list[str], include_stop_str_in_output: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop_strings = stop_strings
        self.include_stop = include_stop_str_in_output
        self.window = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.window)
        self.text = ""
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_ids: list[int], check_stop: bool = True) -> str | None:
        """Add new tokens; return the stop string that ended the text, if one did. With `check_stop` False (before
        min_tokens) stop strings are not looked for in the new text, and are not found in it later either."""
        if self.tokenizer is None or self.stopped:
            return None
        self.window.extend(token_ids)
        before = self._decode(self.window[self.prefix_offset : self.read_offset])
        after = self._decode(self.window[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        delta = after[len(before) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.window)
        if len(self.window) > 4 * _PROMPT_CONTEXT + 64:  # keep the window short: decoding cost stays constant
            drop = self.prefix_offset
            del self.window[:drop]
            self.prefix_offset, self.read_offset = 0, self.read_offset - drop
        start = len(self.text)
        self.text += delta
        return self._check_stop(start) if check_stop else None

    def _check_stop(self, new_start: int) -> str | None:
        """The earliest stop string that ends in the new text (from `new_start` on). Each is looked for from
        len(stop) - 1 characters back, so one that completes only now is found, and one that was complete before
        (while stop checks were off) is not."""
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            pos = self.text.find(stop, max(0, new_start - len(stop) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return None
        pos, stop = best
        self.text = self.text[: pos + len(stop)] if self.include_stop else self.text[:pos]
        self.stopped = True
        return stop

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: while running, hold back a tail that may be the start of a stop string."""
        if finished or not self.stop_strings:
            return self.text
        hold = 0
        for stop in self.stop_strings:
            for size in range(min(len(stop) - 1, len(self.text)), hold, -1):
                if self.text.endswith(stop[:size]):
                    hold = size
                    break
        return self.text[: len(self.text) - hold] if hold else self.text
