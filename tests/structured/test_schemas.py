"""JSON-schema keywords xgrammar does not enforce are no longer accepted silently: each is rewritten into a schema the
grammar holds exactly (checked: the grammar accepts a valid instance and refuses a violating one, as jsonschema
judges them), or refused with a ValueError naming the keyword's path. Tokenizer-free (xgrammar's front end)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from xgrammar import Grammar
from xgrammar.testing import _is_grammar_accept_string

from reasoning_engine.structured.params import JSON_SEPARATORS, StructuredOutputsParams

INTEGERS = {"type": "array", "items": {"type": "integer"}}
A_B = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
KIND_A = {"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "integer"}}, "required": ["kind"]}
KIND_B = {"type": "object", "properties": {"kind": {"enum": ["b", "c"]}}, "required": ["kind"]}

REFUSED = [  # (schema, the path the error names)
    ({"type": "integer", "not": {"const": 3}}, "not"),
    ({**A_B, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ({**INTEGERS, "uniqueItems": True}, "uniqueItems"),
    ({**INTEGERS, "contains": {"const": 5}}, "contains"),
    ({**A_B, "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({**A_B, "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas"),
    ({"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 0}]}, "oneOf"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"$defs": {"n": {"$anchor": "n", "type": "integer"}}, "$ref": "#n"}, "$ref"),
    ({"type": "object", "properties": {"xs": {**INTEGERS, "uniqueItems": True}}}, "properties.xs.uniqueItems"),
    ({"type": "array", "items": {"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]}}, "items.anyOf[1].not"),
    ({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]}, "allOf[1].pattern"),
    ({"type": "string", "pattern": "^(?!admin).*$"}, "pattern"),  # xgrammar drops the lookahead
    ({"type": "object", "patternProperties": {"^(?=x)": {"type": "integer"}}}, "patternProperties.^(?=x)"),
]


@pytest.mark.parametrize(("schema", "path"), REFUSED, ids=[p for _, p in REFUSED])
def test_keywords_the_grammar_cannot_enforce_are_refused_by_path(schema: dict[str, Any], path: str) -> None:
    with pytest.raises(ValueError) as error:
        StructuredOutputsParams(json=schema)
    assert str(error.value).startswith(f"structured_outputs.json.{path}: "), error.value
    with pytest.raises(ValueError) as error:  # a JSON schema inside a structural tag as well
        StructuredOutputsParams(structural_tag={"type": "structural_tag",
                                                "format": {"type": "json_schema", "json_schema": schema}})
    assert str(error.value).startswith(f"structured_outputs.structural_tag.format.json_schema.{path}: "), error.value


REWRITTEN = [  # (schema, valid instances, violating instances): xgrammar alone accepts the violating ones
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
     [{"a": 1, "b": 2}], [{"a": 1}, {"b": 1}]),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
                {"properties": {"a": {"minimum": 3}, "b": {"type": "string"}}}]},
     [{"a": 4}, {}], [{"a": 1}, {"a": 4, "b": "x"}]),
    ({"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 5}]}, [0, 5], [-1, 7]),
    ({"type": "integer", "maximum": 5, "allOf": [{"minimum": 2}]}, [2, 5], [1, 6]),
    ({"allOf": [{"anyOf": [{"type": "integer"}, {"type": "string"}]}, {"type": "integer"}]}, [1], ["x"]),
    ({"type": "integer", "maximum": 5, "anyOf": [{"minimum": 2}, {"minimum": 4}]}, [2, 5], [1, 7]),
    ({"type": "integer", "maximum": 5, "oneOf": [{"type": "integer"}, {"type": "string"}]}, [3], [7, "x"]),
    ({"type": "string", "enum": ["a", 1, "bb"], "maxLength": 1}, ["a"], [1, "bb"]),
    ({"type": "object", "$defs": {"n": {"type": "integer"}},
      "properties": {"a": {"$ref": "#/$defs/n", "minimum": 3}}}, [{"a": 4}], [{"a": 1}, {"a": "x"}]),
]


KEPT = [  # a oneOf whose alternatives cannot overlap (told apart by a required const) is xgrammar's to enforce
    ({"oneOf": [KIND_A, KIND_B]}, [{"kind": "a", "n": 1}, {"kind": "c"}], [{"kind": "d"}, {"kind": "a", "n": "x"}]),
    ({"$defs": {"A": KIND_A, "B": KIND_B}, "oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]},
     [{"kind": "b"}], [{"kind": "d"}]),
]


def grammar_accepts(spec: StructuredOutputsParams, value: Any) -> bool:
    return _is_grammar_accept_string(spec.frontend_grammar(), json.dumps(value, separators=JSON_SEPARATORS))


def xgrammar_alone_accepts(schema: dict[str, Any], value: Any) -> bool:
    grammar = Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=JSON_SEPARATORS)
    return _is_grammar_accept_string(grammar, json.dumps(value, separators=JSON_SEPARATORS))


@pytest.mark.parametrize(("schema", "good", "bad", "rewritten"),
                         [(*case, True) for case in REWRITTEN] + [(*case, False) for case in KEPT])
def test_rewritten_keywords_hold_every_instance(schema: dict[str, Any], good: list[Any], bad: list[Any],
                                                rewritten: bool) -> None:
    assert any(xgrammar_alone_accepts(schema, value) for value in bad) == rewritten  # what the rewriting is for
    spec = StructuredOutputsParams(json=schema)
    for value in good:
        jsonschema.validate(value, schema)
        assert grammar_accepts(spec, value), value
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
        assert not grammar_accepts(spec, value), value


def test_annotations_and_enforced_keywords_keep_working() -> None:
    schema = {"type": "object", "title": "T", "description": "d", "$comment": "c", "examples": [{"when": "2024-01-02"}],
              "required": ["when"], "properties": {
                  "when": {"type": "string", "format": "date", "default": "2024-01-01", "deprecated": True},
                  "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2, "uniqueItems": False},
                  "n": {"type": "integer", "multipleOf": 3, "readOnly": True, "x-vendor": {"not": 1}}}}
    spec = StructuredOutputsParams(json=schema)
    assert spec.enforced_schema() == schema  # nothing to rewrite
    assert grammar_accepts(spec, {"when": "2024-01-02", "tags": ["a"], "n": 6})
    for bad in ({"when": "soon"}, {"when": "2024-01-02", "n": 4}, {"when": "2024-01-02", "tags": ["a", "b", "a"]}):
        assert not grammar_accepts(spec, bad)
    # the same schema with its keys in another order is another grammar, as before
    assert StructuredOutputsParams(json=schema).key() == spec.key()
    assert StructuredOutputsParams(json=json.dumps(schema)).key() == spec.key()


def test_hostile_schemas_are_value_errors_and_quick() -> None:
    """Schemas built to blow the rewriting up (an allOf of anyOfs multiplies out, nesting past the recursion limit,
    references fanning out) or malformed ones are a ValueError naming the field, in well under a second."""
    import time

    fan: dict[str, Any] = {"$defs": {f"d{k}": {"allOf": [{"$ref": f"#/$defs/d{k + 1}"}, {"$ref": f"#/$defs/d{k + 1}"},
                                                        {"minimum": k}]} for k in range(40)}}
    fan["$defs"]["d40"] = {"type": "integer"}
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(3000):
        deep = {"allOf": [deep]}
    hostile = [{"allOf": [{"anyOf": [{"type": "integer", "minimum": i} for i in range(64)]} for _ in range(4)]}, deep,
               {"type": [["integer"]], "const": {"a": [1]}, "minLength": "x", "allOf": 3}]
    start = time.perf_counter()
    for schema in hostile:
        with pytest.raises(ValueError, match=r"^structured_outputs\.json"):
            StructuredOutputsParams(json=schema)
    spec = StructuredOutputsParams(json={**fan, "$ref": "#/$defs/d0"})  # each reference inlined once
    assert grammar_accepts(spec, 39) and not grammar_accepts(spec, 38)  # the largest minimum: 39
    assert time.perf_counter() - start < 2
