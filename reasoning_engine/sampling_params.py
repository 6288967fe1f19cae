"""Per-request sampling settings, shaped like vLLM's so users can switch engines without rewriting calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from reasoning_engine.structured.params import StructuredOutputsParams


@dataclass
class SamplingParams:
    """How one request is decoded. Validated at construction: a bad value raises ValueError naming the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    thinking_token_budget: int | None = None
    # constrained decoding (vLLM's names): the output after thinking matches a grammar; logit_bias (OpenAI) adds to
    # the logits of token ids (keys may be decimal strings, as JSON sends them); allowed_token_ids restricts every
    # step to those ids; bad_words are never completed. Ids are checked against the vocabulary by the engine.
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        self._validate_constraints()

    def _validate(self) -> None:
        checks: list[tuple[str, bool, str]] = [
            ("n", _is_int(self.n) and self.n >= 1, "must be an integer >= 1"),
            ("temperature", _is_num(self.temperature) and self.temperature >= 0, "must be a number >= 0"),
            ("top_p", _is_num(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0, "must be an integer >= 0 (0 or -1 disables it)"),
            ("min_p", _is_num(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("seed", self.seed is None or _is_int(self.seed), "must be an integer"),
            ("presence_penalty", _is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", _is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", _is_num(self.repetition_penalty) and self.repetition_penalty > 0, "must be > 0"),
            ("stop", all(isinstance(s, str) and s for s in self.stop_strings), "must be a non-empty string or a list of them"),
            ("stop_token_ids", all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "must be a list of token ids"),
            ("max_tokens", self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "must be an integer >= 1"),
            ("min_tokens", _is_int(self.min_tokens) and self.min_tokens >= 0, "must be an integer >= 0"),
            ("logprobs", self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20), "must be an integer in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20), "must be an integer in [0, 20]"),
            ("thinking_token_budget", self.thinking_token_budget is None or (_is_int(self.thinking_token_budget) and self.thinking_token_budget >= 0), "must be an integer >= 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}")

    def _validate_constraints(self) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a map of token id to bias, got {type(self.logit_bias).__name__}")
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
                if not _is_int(token) or token < 0:
                    raise ValueError(f"logit_bias: key {key!r} is not a token id")
                if not _is_num(value) or not -100 <= value <= 100:
                    raise ValueError(f"logit_bias: bias of token {key} must be a number in [-100, 100], got {value!r}")
                bias[token] = float(value)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
