"""Random JSON schemas of the kinds agents send (nested objects, arrays with item bounds, enums, numbers with ranges,
optional fields, strings with patterns), each with one instance that validates, for the structured-output
benchmarks (grammar_backends.py, structured_output.py). Seeded: the same seed gives the same schemas.

Objects close their properties (`additionalProperties: false`, as OpenAI's strict mode requires) and strings are
bounded, so a schema describes finite answers.
"""

from __future__ import annotations

import random
from typing import Any

WORDS = ["name", "id", "city", "score", "tags", "items", "status", "price", "count", "owner", "meta", "level",
         "color", "kind", "label", "size", "rank", "code", "note", "flag"]
ENUMS = [["red", "green", "blue"], ["low", "medium", "high"], ["open", "closed"], ["a", "b", "c", "d"],
         ["yes", "no", "maybe"]]
PATTERNS = [(r"^[a-z]{3,8}$", "abcd"), (r"^[A-Z]{2}-[0-9]{3}$", "AB-123"), (r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$", "2024-01-31"),
            (r"^(foo|bar)[0-9]?$", "foo1")]


def generate_schemas(count: int, seed: int = 0) -> list[tuple[dict[str, Any], Any]]:
    """`count` (schema, valid instance) pairs."""
    rng = random.Random(seed)
    return [_object(rng, depth=0) for _ in range(count)]


def _value(rng: random.Random, depth: int) -> tuple[dict[str, Any], Any]:
    kinds = ["string", "pattern", "integer", "number", "enum", "boolean"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "object":
        return _object(rng, depth + 1)
    if kind == "array":
        item, example = _value(rng, depth + 1)
        low = rng.randint(0, 2)
        high = low + rng.randint(1, 3)
        return {"type": "array", "items": item, "minItems": low, "maxItems": high}, [example] * max(low, 1)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(4, 16)}, "abc"
    if kind == "pattern":
        pattern, example = rng.choice(PATTERNS)
        return {"type": "string", "pattern": pattern}, example
    if kind == "integer":
        low = rng.randint(-100, 100)
        high = low + rng.randint(1, 1000)
        return {"type": "integer", "minimum": low, "maximum": high}, low
    if kind == "number":
        low = rng.randint(-10, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 100)}, low + 0.5
    if kind == "enum":
        values = rng.choice(ENUMS)
        return {"enum": list(values)}, values[0]
    return {"type": "boolean"}, True


def _object(rng: random.Random, depth: int) -> tuple[dict[str, Any], Any]:
    names = rng.sample(WORDS, rng.randint(1, 4 if depth else 5))
    properties: dict[str, Any] = {}
    example: dict[str, Any] = {}
    required = []
    for name in names:
        properties[name], example[name] = _value(rng, depth)
        if rng.random() < 0.7:
            required.append(name)
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return schema, example
