"""Checks shared by the structured-output engine tests: the answer after thinking, and whether it matches."""

from __future__ import annotations

import json
from typing import Any

from reasoning_engine import LLM
from reasoning_engine.structured.params import StructuredOutputsParams

try:
    import jsonschema
except ImportError:  # structural check only
    jsonschema = None


def answer_ids(llm: LLM, token_ids: list[int], thinking: bool) -> list[int]:
    """The output after the end of thinking (all of it when the prompt did not open a think section)."""
    if not thinking:
        return list(token_ids)
    end = llm.engine.think_end_id
    assert end in token_ids, "the thinking section never ended"
    return list(token_ids[token_ids.index(end) + 1:])


def grammar_accepts(llm: LLM, spec: dict[str, Any], tokens: list[int]) -> tuple[bool, bool]:
    """(every token is allowed in order, the grammar is complete after them): a valid prefix, a valid whole."""
    matcher = llm.engine.grammars.matcher(StructuredOutputsParams(**spec))
    body = [t for t in tokens if t not in llm.engine.eos_token_ids]
    prefix = matcher.accept_prefix(body) == len(body)
    return prefix, prefix and matcher.accept(next(iter(llm.engine.eos_token_ids))) and matcher.is_terminated


def check_json(text: str, schema: dict[str, Any]) -> Any:
    value = json.loads(text)
    if jsonschema is not None:
        jsonschema.validate(value, schema)
    else:
        assert isinstance(value, dict) and set(schema.get("required", [])) <= set(value)
    return value
