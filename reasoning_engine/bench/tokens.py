"""Token counting for the client side of a benchmark.

A benchmark against a remote server still needs token counts (synthetic prompt lengths, outputs when the server
reports no usage). The model's own tokenizer gives exact counts; without one, counts are a labelled estimate so a
reader never mistakes them for measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHARS_PER_TOKEN = 4.0  # the usual English rule of thumb for BPE vocabularies, used only without a tokenizer


@dataclass
class TokenCounter:
    """Counts tokens with `tokenizer`, or estimates them from characters when it is None."""

    tokenizer: Any | None
    source: str  # where the tokenizer came from, or "estimate (~4 characters per token, no tokenizer)"

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def count(self, text: str) -> int:
        if not text:
            return 0
        if self.tokenizer is None:
            return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def truncate(self, text: str, max_tokens: int) -> str:
        """The longest prefix of `text` with at most `max_tokens` tokens (prompts longer than a model's context)."""
        if self.tokenizer is None:
            return text[: int(max_tokens * CHARS_PER_TOKEN)]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= max_tokens:
            return text
        return self.tokenizer.decode(ids[:max_tokens])


def _load(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def resolve_counter(tokenizer_path: str | None, served_roots: list[str]) -> TokenCounter:
    """`--tokenizer` when given (an error if it does not load); else the served model's folder when the server
    reports one that exists on this machine (our server and vLLM report it as `root` in /v1/models); else an
    estimate."""
    if tokenizer_path:
        return TokenCounter(_load(tokenizer_path), f"tokenizer {tokenizer_path}")
    failures = []
    for root in served_roots:
        if root and Path(root).is_dir():
            try:
                return TokenCounter(_load(root), f"tokenizer of the served model ({root})")
            except Exception as exc:  # noqa: BLE001 - best-effort discovery: any failure means "estimate instead"
                failures.append(f"{root}: {type(exc).__name__}")
    why = f"; the served model's tokenizer did not load ({', '.join(failures)})" if failures else ""
    return TokenCounter(None, f"estimate (~{CHARS_PER_TOKEN:g} characters per token, no tokenizer{why})")
