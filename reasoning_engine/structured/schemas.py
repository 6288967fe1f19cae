"""JSON schemas as the grammar can hold them: what xgrammar does not enforce is rewritten or refused by name.

xgrammar 0.2.x builds a grammar from a JSON schema but silently leaves some keywords out, so an instance that breaks
them would be accepted. `enforceable_schema` returns a schema with the same instances that xgrammar enforces
exactly, or raises `SchemaError` naming the keyword (the way vLLM and OpenAI's strict mode refuse what they do not
support):

- rewritten: `allOf` (merged into one schema: properties merged, bounds tightened, types intersected), the
  assertions beside `anyOf` / `oneOf` / `$ref` (moved into each alternative / merged with the target: xgrammar
  reads only the combinator), `enum` / `const` beside other assertions (the values that break them dropped);
- refused: `not`, `if` / `then` / `else`, `uniqueItems`, `contains` / `minContains` / `maxContains`,
  `dependentRequired` / `dependentSchemas` / `dependencies`, `multipleOf` but an integer's integral one, `oneOf`
  whose alternatives may overlap (xgrammar accepts an instance matching several), a `pattern` with a lookahead or
  lookbehind, `$ref` other than a local JSON pointer, `$dynamicRef` / `$recursiveRef`, and an `allOf` that does
  not merge.

Annotations (`title`, `description`, `examples`, `default`, `$comment`, ...) and unknown keywords are kept and, as
in any validator, ignored.

`marker_free_schema` serves tool calls: xgrammar keeps excluded substrings (the tool parser's markers) out of
plain strings and property names only, so strings with length bounds become a pattern that cannot open a marker,
and patterns, formats, values and names that could write one are refused.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

Schema = Any  # a dict, or a bool schema

# the assertion keywords xgrammar reads; everything else is an annotation to it
ASSERTIONS = frozenset({
    "type", "enum", "const", "nullable", "properties", "required", "additionalProperties", "unevaluatedProperties",
    "patternProperties", "propertyNames", "minProperties", "maxProperties", "items", "prefixItems",
    "unevaluatedItems", "minItems", "maxItems", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "minLength", "maxLength", "pattern", "format", "anyOf", "oneOf", "allOf", "$ref"})
_REFUSED = {
    "not": "`not` is not enforced by the grammar",
    "contains": "`contains` is not enforced by the grammar",
    "minContains": "`minContains` is not enforced by the grammar",
    "maxContains": "`maxContains` is not enforced by the grammar",
    "dependentRequired": "`dependentRequired` is not enforced by the grammar (list the properties in `required`)",
    "dependentSchemas": "`dependentSchemas` is not enforced by the grammar",
    "dependencies": "`dependencies` is not enforced by the grammar",
    "$dynamicRef": "`$dynamicRef` is not supported (use a local `$ref`)",
    "$recursiveRef": "`$recursiveRef` is not supported (use a local `$ref`)",
}
_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SINGLES = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "unevaluatedItems")
_LOWER_BOUNDS = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_TYPES = ("null", "boolean", "object", "array", "string", "integer", "number")
_MAX_ALTERNATIVES = 64  # allOf of anyOfs multiplies out; past this the schema is refused
_MAX_MERGES = 20_000


class SchemaError(ValueError):
    """A schema keyword the grammar cannot hold: `path` is where, dotted inside the schema (`properties.x.not`)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}" if path else reason)
        self.path = path
        self.reason = reason


class Unsatisfiable(SchemaError):
    """No instance satisfies the schema (an allOf whose members contradict each other)."""


def join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def map_subschemas(schema: dict[str, Any], fn: Callable[[Schema, str], Schema], path: str) -> dict[str, Any]:
    """A copy of `schema` with each direct subschema replaced by `fn(subschema, its path)`."""
    out = dict(schema)
    for key in _MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: fn(sub, join(join(path, key), name)) for name, sub in schema[key].items()}
    for key in _LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [fn(sub, join(join(path, key), i)) for i, sub in enumerate(schema[key])]
    for key in _SINGLES:
        if isinstance(schema.get(key), (dict, bool)):
            out[key] = fn(schema[key], join(path, key))
    return out


def enforceable_schema(schema: Schema) -> Schema:
    """`schema` rewritten so xgrammar enforces all of it; SchemaError naming the keyword it cannot enforce."""
    try:
        return _Normalizer(schema).node(schema, "")
    except RecursionError:
        raise SchemaError("", "the schema is nested too deeply") from None


class _Normalizer:
    def __init__(self, root: Schema) -> None:
        self.root = root
        self.expanding: set[str] = set()  # $refs being inlined (a cycle through allOf is refused)
        self.inlined: dict[str, Schema] = {}  # each $ref's enforceable target, made once
        self.merges = 0  # work done: a schema built to multiply out is refused, not rewritten for minutes

    def node(self, schema: Schema, path: str) -> Schema:
        if not isinstance(schema, dict):
            return schema
        for key, reason in _REFUSED.items():
            if key in schema:
                raise SchemaError(join(path, key), reason)
        if "if" in schema and ("then" in schema or "else" in schema):
            raise SchemaError(join(path, "if"), "`if` / `then` / `else` are not enforced by the grammar")
        if schema.get("uniqueItems") not in (None, False) and not _at_most(schema.get("maxItems"), 1):
            raise SchemaError(join(path, "uniqueItems"), "`uniqueItems` is not enforced by the grammar")
        if "multipleOf" in schema and not _integral_multiple(schema):
            raise SchemaError(join(path, "multipleOf"), "`multipleOf` is enforced only for an integer type with an "
                                                         "integer multiple")
        patterns = [("pattern", schema["pattern"])] if isinstance(schema.get("pattern"), str) else []
        if isinstance(schema.get("patternProperties"), dict):
            patterns += [(join("patternProperties", name), name) for name in schema["patternProperties"]]
        for where, pattern in patterns:
            if has_lookaround(pattern):
                raise SchemaError(join(path, where), "a lookahead or lookbehind in a pattern is not enforced by the "
                                                     "grammar")
        if "$ref" in schema:
            self.target(schema["$ref"], join(path, "$ref"))  # refused unless it resolves
        return self.tidy(map_subschemas(schema, self.node, path), path)

    def tidy(self, schema: Schema, path: str) -> Schema:
        """A schema whose subschemas are enforceable, with its own combinators rewritten."""
        if not isinstance(schema, dict):
            return schema
        for combinator in ("allOf", "anyOf", "oneOf"):
            if combinator in schema and not (isinstance(schema[combinator], list) and schema[combinator]):
                raise SchemaError(join(path, combinator), "must be a non-empty list of schemas")
        if "allOf" in schema:
            rest = {k: v for k, v in schema.items() if k != "allOf"}
            merged: Schema = rest
            for i, member in enumerate(schema["allOf"]):
                merged = self.merge(merged, member, join(join(path, "allOf"), i))
            return merged
        if "$ref" in schema and _assertions(schema, "$ref"):
            ref = schema["$ref"]
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            return self.merge(self.resolved(ref, join(path, "$ref")), rest, path)
        for combinator in ("anyOf", "oneOf"):
            if combinator in schema and _assertions(schema, combinator):
                rest = {k: v for k, v in schema.items() if k in ASSERTIONS and k != combinator}
                kept = {k: v for k, v in schema.items() if k not in ASSERTIONS}
                alternatives = [alt for alt in (self.merge_or_false(rest, alt, join(join(path, combinator), i))
                                                for i, alt in enumerate(schema[combinator])) if alt is not False]
                if not alternatives:
                    raise Unsatisfiable(join(path, combinator), "no alternative satisfies the keywords beside it")
                return self.tidy(_alternatives(kept, combinator, alternatives), path)
        if "oneOf" in schema:
            self.check_disjoint(schema["oneOf"], join(path, "oneOf"))
        if ("enum" in schema and "const" in schema) or (("enum" in schema or "const" in schema)
                                                         and _assertions(schema, "enum", "const")):
            return _filtered_values(schema, path)
        return schema

    # ---- $ref ----

    def target(self, ref: Any, path: str) -> Schema:
        """The raw schema a local `$ref` points at."""
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise SchemaError(path, f"only local JSON-pointer references (`#/...`) are supported, got {ref!r}")
        node = self.root
        for part in ref[2:].split("/") if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise SchemaError(path, f"{ref} does not resolve")
        return node

    def resolved(self, ref: str, path: str) -> Schema:
        """The enforceable schema a `$ref` points at, inlined (to merge with what sits beside it)."""
        if ref in self.inlined:
            return self.inlined[ref]
        if ref in self.expanding:
            raise SchemaError(path, f"{ref} refers to itself through allOf / sibling keywords")
        self.expanding.add(ref)
        try:
            self.inlined[ref] = self.node(self.target(ref, path), path)
        finally:
            self.expanding.discard(ref)
        return self.inlined[ref]

    # ---- allOf ----

    def merge(self, a: Schema, b: Schema, path: str) -> Schema:
        """One schema holding exactly the instances of both (both enforceable)."""
        if a is True or a == {}:
            return b
        if b is True or b == {}:
            return a
        self.merges += 1
        if self.merges > _MAX_MERGES:
            raise SchemaError(path, "too large to rewrite into what the grammar enforces")
        if a is False or b is False:
            return False
        if not isinstance(a, dict) or not isinstance(b, dict):
            raise SchemaError(path, "a schema is an object or a boolean")
        for x, y in ((a, b), (b, a)):
            if "$ref" in x:
                rest = {k: v for k, v in x.items() if k != "$ref"}
                return self.merge(self.merge(self.resolved(x["$ref"], path), rest, path), y, path)
        for x, y in ((a, b), (b, a)):
            for combinator in ("anyOf", "oneOf"):
                if combinator in x:
                    rest = self.merge({k: v for k, v in x.items() if k != combinator}, y, path)
                    alternatives = [alt for alt in (self.merge_or_false(alt, rest, path) for alt in x[combinator])
                                    if alt is not False]
                    if combinator == "anyOf":  # an alternative that is itself only an anyOf: its alternatives
                        alternatives = [inner for alt in alternatives for inner in
                                        (alt["anyOf"] if isinstance(alt, dict) and alt.keys() == {"anyOf"} else [alt])]
                    if len(alternatives) > _MAX_ALTERNATIVES:
                        raise SchemaError(path, "too many alternatives once the allOf is multiplied out")
                    if not alternatives:
                        raise Unsatisfiable(path, "no value satisfies every member")
                    kept = {k: v for k, v in rest.items() if k not in ASSERTIONS} if isinstance(rest, dict) else {}
                    return self.tidy(_alternatives(kept, combinator, alternatives), path)
        out = dict(a)
        for key, value in b.items():
            if key not in out:
                out[key] = value
            elif out[key] != value:
                out[key] = self.merge_keyword(key, out[key], value, path)
        if "properties" in a or "properties" in b or "additionalProperties" in a or "additionalProperties" in b:
            out.update(self.merge_objects(a, b, path))
        return self.tidy(out, path)

    def merge_or_false(self, a: Schema, b: Schema, path: str) -> Schema:
        """`merge`, or False (no instance) where the two contradict each other: a dropped alternative."""
        try:
            return self.merge(a, b, path)
        except Unsatisfiable:
            return False

    def merge_keyword(self, key: str, x: Any, y: Any, path: str) -> Any:
        where = join(path, key)
        if key not in ASSERTIONS:
            return x  # an annotation: the first one
        if key == "type":
            kinds = _type_intersection(_type_list(x), _type_list(y))
            if not kinds:
                raise Unsatisfiable(where, "the members' types do not overlap")
            return kinds[0] if len(kinds) == 1 else kinds
        if key in (*_LOWER_BOUNDS, *_UPPER_BOUNDS) and _numbers(x, y):
            return max(x, y) if key in _LOWER_BOUNDS else min(x, y)
        if key == "const":
            raise Unsatisfiable(where, "the members give different `const` values")
        if key == "required" and isinstance(x, list) and isinstance(y, list):
            return list(dict.fromkeys([*x, *y]))
        if key == "enum" and isinstance(x, list) and isinstance(y, list):
            values = [v for v in x if _canonical(v) in {_canonical(w) for w in y}]
            if not values:
                raise Unsatisfiable(where, "the members' enums have no value in common")
            return values
        if key in ("items", "unevaluatedItems", "propertyNames", "unevaluatedProperties"):
            return self.merge(x, y, path)
        if key in ("properties", "additionalProperties") and all(isinstance(v, (dict, bool)) for v in (x, y)):
            return x  # merge_objects
        raise SchemaError(where, f"the members give different `{key}` values, which do not merge")

    def merge_objects(self, a: dict[str, Any], b: dict[str, Any], path: str) -> dict[str, Any]:
        """`properties` and `additionalProperties` of both: a property one side lists and the other does not
        falls under the other side's additionalProperties."""
        if "patternProperties" in a or "patternProperties" in b:
            raise SchemaError(join(path, "patternProperties"), "members with patternProperties do not merge")
        pa, pb = a.get("properties", {}), b.get("properties", {})
        if not isinstance(pa, dict) or not isinstance(pb, dict):
            raise SchemaError(join(path, "properties"), "must be an object of schemas")
        extra_a, extra_b = a.get("additionalProperties", True), b.get("additionalProperties", True)
        properties: dict[str, Any] = {}
        for name in dict.fromkeys([*pa, *pb]):
            merged = self.merge(pa.get(name, extra_a), pb.get(name, extra_b), join(join(path, "properties"), name))
            if merged is not False:
                properties[name] = merged
        out: dict[str, Any] = {"properties": properties} if properties or "properties" in a or "properties" in b \
            else {}
        extra = self.merge(extra_a, extra_b, join(path, "additionalProperties"))
        if extra is not True:
            out["additionalProperties"] = extra
        required = [n for side in (a, b) if isinstance(side.get("required"), list) for n in side["required"]]
        missing = [n for n in required if n not in properties and extra is False]
        if missing:
            raise Unsatisfiable(path, f"property {missing[0]!r} is required by one member and "
                                                   "forbidden by another")
        return out

    # ---- oneOf ----

    def check_disjoint(self, alternatives: list[Schema], path: str) -> None:
        """xgrammar takes oneOf as anyOf: fine when no instance can match two alternatives."""
        listed = [_values_of(alt) if isinstance(alt, dict) else None for alt in map(self.shallow, alternatives)]
        if all(values is not None for values in listed):  # constants: no value listed twice
            if sum(map(len, listed)) == len(set().union(*listed)):
                return
        elif len(alternatives) > _MAX_ALTERNATIVES:
            raise SchemaError(path, f"more than {_MAX_ALTERNATIVES} alternatives to tell apart")
        for i, x in enumerate(alternatives):
            for y in alternatives[i + 1:]:
                if not self.disjoint(x, y):
                    raise SchemaError(path, "the alternatives may overlap, and the grammar cannot hold an instance "
                                            "to exactly one of them (use anyOf, or tell them apart by type or by a "
                                            "required property's const)")

    def disjoint(self, x: Schema, y: Schema) -> bool:
        x, y = self.shallow(x), self.shallow(y)
        if x is False or y is False:
            return True
        if not isinstance(x, dict) or not isinstance(y, dict):
            return False
        tx, ty = _types_of(x), _types_of(y)
        if tx is not None and ty is not None and not _expand(tx) & _expand(ty):
            return True
        vx, vy = _values_of(x), _values_of(y)
        if vx is not None and vy is not None and not vx & vy:
            return True
        px, py = x.get("properties", {}), y.get("properties", {})
        for name in set(x.get("required", [])) & set(y.get("required", [])):
            if name in px and name in py:
                sx, sy = self.shallow(px[name]), self.shallow(py[name])
                vx = _values_of(sx) if isinstance(sx, dict) else None
                vy = _values_of(sy) if isinstance(sy, dict) else None
                if vx is not None and vy is not None and not vx & vy:
                    return True
        return False

    def shallow(self, schema: Schema) -> Schema:
        """A bare `$ref` followed (for reading, not inlining)."""
        seen: set[str] = set()
        while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and schema["$ref"] not in seen:
            seen.add(schema["$ref"])
            schema = self.target(schema["$ref"], "$ref")
        return schema


def _alternatives(kept: dict[str, Any], combinator: str, alternatives: list[Schema]) -> Schema:
    """`kept` (annotations) with the alternatives, an anyOf's each once (a oneOf's twice is an overlap, refused
    later); a single one stands alone."""
    unique = list({_canonical(alt): alt for alt in alternatives}.values()) if combinator == "anyOf" else alternatives
    if len(unique) == 1:
        return {**kept, **unique[0]} if isinstance(unique[0], dict) else unique[0]
    return {**kept, combinator: unique}


def _numbers(*values: Any) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _assertions(schema: dict[str, Any], *besides: str) -> bool:
    return any(k in ASSERTIONS and k not in besides for k in schema)


def _at_most(value: Any, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value <= limit


def _integral_multiple(schema: dict[str, Any]) -> bool:
    multiple = schema["multipleOf"]
    return (schema.get("type") == "integer" and isinstance(multiple, (int, float)) and not isinstance(multiple, bool)
            and float(multiple).is_integer() and multiple > 0)


def _type_list(value: Any) -> list[str]:
    return [t for t in (value if isinstance(value, list) else [value]) if isinstance(t, str)]


def _expand(kinds: Iterable[str]) -> set[str]:
    """JSON types as disjoint kinds: `number` covers the integers too."""
    out = set(kinds)
    if "number" in out:
        out.add("integer")
    return out


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _types_of(schema: dict[str, Any]) -> set[str] | None:
    """The JSON types a schema admits, None for any."""
    values = _raw_values(schema)
    if values is not None:
        return {_json_type(v) for v in values}
    if "type" not in schema:
        return None
    kinds = set(_type_list(schema["type"]))
    return kinds | {"null"} if schema.get("nullable") is True else kinds


def _raw_values(schema: dict[str, Any]) -> list[Any] | None:
    """The values `const` and `enum` allow (both: the const if the enum lists it), None when neither is given."""
    values = list(schema["enum"]) if isinstance(schema.get("enum"), list) else None
    if "const" in schema:
        listed = values is None or _canonical(schema["const"]) in {_canonical(v) for v in values}
        return [schema["const"]] if listed else []
    return values


def _canonical(value: Any) -> str:
    """JSON text that is the same for equal JSON values (1 and 1.0 alike, true and 1 not)."""

    def plain(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [plain(x) for x in v]
        return {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else v

    return json.dumps(plain(value), sort_keys=True)


def _values_of(schema: dict[str, Any]) -> set[str] | None:
    values = _raw_values(schema)
    return None if values is None else {_canonical(v) for v in values}


def _type_intersection(x: list[str], y: list[str]) -> list[str]:
    """The types in both lists (`integer` is in `number`)."""
    kinds = [t for t in x if t in y or (t == "integer" and "number" in y)]
    return kinds + [t for t in y if t == "integer" and "number" in x and t not in kinds]


def _filtered_values(schema: dict[str, Any], path: str) -> dict[str, Any]:
    """`enum` / `const` beside other assertions: xgrammar writes the listed values without checking them, so only
    the values that satisfy the rest are kept."""
    key = "const" if "const" in schema else "enum"
    rest = {k: v for k, v in schema.items() if k in ASSERTIONS and k not in ("enum", "const")}
    checkable = {"type", "nullable", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
                 "minLength", "maxLength", "pattern"}
    unchecked = sorted(set(rest) - checkable)
    if unchecked:
        raise SchemaError(join(path, unchecked[0]), f"`{unchecked[0]}` beside `{key}` is not enforced by the grammar "
                                                    f"(it writes the listed values)")
    values = _raw_values(schema) or []
    kept = [v for v in values if _satisfies(v, rest)]
    if not kept:
        raise Unsatisfiable(join(path, key), f"no value of `{key}` satisfies the schema's other keywords")
    out = {k: v for k, v in schema.items() if k not in rest and k not in ("enum", "const")}
    return {**out, "const": kept[0]} if key == "const" else {**out, "enum": kept}


def _satisfies(value: Any, rest: dict[str, Any]) -> bool:
    """Whether a listed value meets the scalar keywords beside it."""
    if "type" in rest:
        kinds = _expand(_type_list(rest["type"])) | ({"null"} if rest.get("nullable") is True else set())
        if _json_type(value) not in kinds:
            return False
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number:
        checks = (("minimum", lambda b: value >= b), ("maximum", lambda b: value <= b),
                  ("exclusiveMinimum", lambda b: value > b), ("exclusiveMaximum", lambda b: value < b),
                  ("multipleOf", lambda b: b > 0 and math.isclose(value / b, round(value / b))))
        if not all(test(rest[k]) for k, test in checks if _numbers(rest.get(k))):
            return False
    if isinstance(value, str):
        low, high = rest.get("minLength", 0), rest.get("maxLength", len(value))
        if _numbers(low, high) and not low <= len(value) <= high:
            return False
        if isinstance(rest.get("pattern"), str):
            try:
                return re.search(rest["pattern"], value) is not None
            except re.error:
                return True  # xgrammar reads the pattern; the value stays a candidate
    return True


# ---- tool calls: strings that cannot hold a parser's markers ----

# characters the strings of each xgrammar format are written with (None: anything)
FORMAT_CHARACTERS: dict[str, str | None] = {
    "date": r"[0-9\-]", "time": r"[0-9:.Z+\-]", "date-time": r"[0-9:.TZ+\-]", "duration": r"[0-9PYMWDTHS.]",
    "ipv4": r"[0-9.]", "ipv6": r"[0-9A-Fa-f:.]", "hostname": r"[a-z0-9.\-]", "uuid": r"[0-9A-Fa-f\-]",
    "uri": r"[A-Za-z0-9._~:/?#@!$&'()*+,;=%\-]", "uri-reference": r"[A-Za-z0-9._~:/?#@!$&'()*+,;=%\-]",
    "email": None, "uri-template": None, "json-pointer": None, "relative-json-pointer": None,
}


def marker_free_schema(schema: Schema, excludes: Iterable[str]) -> Schema:
    """An enforceable schema whose every string and property name is kept free of `excludes` (xgrammar's
    structural-tag `excludes` do that for plain strings; this covers the rest); SchemaError where it cannot."""
    markers = [m for m in excludes if m]
    try:
        return _marker_free(schema, markers, "") if markers else schema
    except RecursionError:
        raise SchemaError("", "the schema is nested too deeply") from None


def _marker_free(schema: Schema, markers: list[str], path: str) -> Schema:
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, lambda sub, where: _marker_free(sub, markers, where), path)
    for key in ("const", "enum"):
        marker = _marker_in(schema[key], markers) if key in schema else None
        if marker is not None:
            raise SchemaError(join(path, key), f"a value holds {marker!r}, which opens a marker the tool parser "
                                               "acts on")
    for name in schema.get("properties", {}) if isinstance(schema.get("properties"), dict) else ():
        marker = _marker_in(name, markers)
        if marker is not None:
            raise SchemaError(join(join(path, "properties"), name),
                              f"the property name holds {marker!r}, which opens a marker the tool parser acts on")
    for name in schema.get("patternProperties", {}) if isinstance(schema.get("patternProperties"), dict) else ():
        _check_pattern(name, markers, join(join(path, "patternProperties"), name))
    if isinstance(schema.get("pattern"), str):
        _check_pattern(schema["pattern"], markers, join(path, "pattern"))
    elif isinstance(schema.get("format"), str):
        fmt = schema["format"]
        if fmt not in FORMAT_CHARACTERS:
            del out["format"]  # xgrammar ignores it: a plain string, which the excludes cover
        else:
            characters = FORMAT_CHARACTERS[fmt]
            writable = (lambda ch: True) if characters is None else \
                (lambda ch: re.fullmatch(characters, ch) is not None)
            marker = _writable_marker(writable, markers)
            if marker is not None:
                raise SchemaError(join(path, "format"), f"a {fmt!r} string can hold {marker!r}, which opens a "
                                                        "marker the tool parser acts on (the grammar cannot keep "
                                                        "it out)")
    elif ("minLength" in schema or "maxLength" in schema) and _lengths(schema.get("minLength", 0),
                                                                      schema.get("maxLength", 0)):
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = _bounded_string_pattern(schema.get("minLength", 0), schema.get("maxLength"), markers)
    return out


def _lengths(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def _marker_in(value: Any, markers: list[str]) -> str | None:
    """The first marker inside a JSON value's strings (keys included)."""
    if isinstance(value, str):
        return next((m for m in markers if m in value), None)
    items: Iterable[Any] = ()
    if isinstance(value, list):
        items = value
    elif isinstance(value, dict):
        items = [*value.keys(), *value.values()]
    return next((m for m in map(lambda v: _marker_in(v, markers), items) if m is not None), None)


def _bounded_string_pattern(low: int, high: int | None, markers: list[str]) -> str:
    """A string of low..high characters that cannot hold a marker: the characters that open the markers that fit
    are left out (none when every marker is longer than `high`). xgrammar drops length bounds from a string it
    keeps markers out of, so the bounds go into the pattern instead."""
    openers = sorted({m[0] for m in markers if high is None or len(m) <= high})
    banned = "".join("\\" + ch if ch in "\\]^-[" else ch for ch in openers)
    return f"^[^\"\\\\\\x00-\\x1f{banned}]{{{low},{'' if high is None else high}}}$"


def _writable_marker(writable: Callable[[str], bool], markers: list[str]) -> str | None:
    """The first marker all of whose characters can be written."""
    chars = {ch for ch in set().union(*map(set, markers)) if writable(ch)}
    return next((m for m in markers if set(m) <= chars), None)


def _check_pattern(pattern: str, markers: list[str], path: str) -> None:
    marker = _writable_marker(_pattern_characters(pattern), markers)
    if marker is not None:
        raise SchemaError(path, f"this pattern can write {marker!r}, which opens a marker the tool parser acts on, "
                                "and the grammar cannot keep it out of a pattern (leave out the characters it needs, "
                                f"e.g. {marker[0]!r})")


def _parsed_regex(pattern: str) -> tuple[Any, Any] | None:
    """(Python's parse of the regex, the module of its opcodes); None where Python's regex parser does not take it
    (xgrammar reads it on its own terms)."""
    try:
        from re import _constants as c  # noqa: PLC0415
        from re import _parser as sre
    except ImportError:  # Python 3.10
        import sre_constants as c  # type: ignore[no-redef]  # noqa: PLC0415
        import sre_parse as sre  # type: ignore[no-redef]  # noqa: PLC0415
    try:
        return sre.parse(pattern), c
    except (re.error, ValueError, TypeError, OverflowError, RecursionError):
        return None


def _regex_nodes(nodes: Any, c: Any) -> Iterator[tuple[Any, Any]]:
    """Every (opcode, argument) of a parsed regex, those inside groups, branches and repeats included."""
    for op, av in nodes:
        yield op, av
        if op is c.BRANCH:
            for branch in av[1]:
                yield from _regex_nodes(branch, c)
        elif op is c.SUBPATTERN:
            yield from _regex_nodes(av[-1], c)
        elif op in (c.MAX_REPEAT, c.MIN_REPEAT) or op.name == "POSSESSIVE_REPEAT":
            yield from _regex_nodes(av[2], c)
        elif op.name == "ATOMIC_GROUP" or op in (c.ASSERT, c.ASSERT_NOT):
            yield from _regex_nodes(av if op.name == "ATOMIC_GROUP" else av[1], c)
        elif op is c.GROUPREF_EXISTS:
            yield from _regex_nodes(av[1], c)
            if av[2] is not None:
                yield from _regex_nodes(av[2], c)


def has_lookaround(pattern: str) -> bool:
    """Whether a regex asserts what follows or precedes (`(?=`, `(?!`, `(?<=`, `(?<!`): xgrammar leaves a
    lookahead inside a schema's `pattern` out of the grammar without a word."""
    parsed = _parsed_regex(pattern)
    return parsed is not None and any(op in (parsed[1].ASSERT, parsed[1].ASSERT_NOT)
                                      for op, _ in _regex_nodes(*parsed))


def _pattern_characters(pattern: str) -> Callable[[str], bool]:
    """Whether the regex can write a character anywhere (an over-estimate: repetition counts and context are not
    read); a pattern Python's regex parser does not take can write anything."""
    parsed = _parsed_regex(pattern)
    if parsed is None:
        return lambda ch: True
    nodes, c = parsed
    categories = {c.CATEGORY_DIGIT: str.isdecimal, c.CATEGORY_SPACE: str.isspace,
                  c.CATEGORY_WORD: lambda ch: ch.isalnum() or ch == "_"}
    negated = {c.CATEGORY_NOT_DIGIT: c.CATEGORY_DIGIT, c.CATEGORY_NOT_SPACE: c.CATEGORY_SPACE,
               c.CATEGORY_NOT_WORD: c.CATEGORY_WORD}

    def category(cat: Any, ch: str) -> bool:
        if cat in categories:
            return categories[cat](ch)
        if cat in negated:
            return not categories[negated[cat]](ch)
        return True

    def in_set(items: Any, ch: str) -> bool:
        negate = bool(items) and items[0][0] is c.NEGATE
        hit = False
        for op, av in items[1:] if negate else items:
            if op is c.LITERAL:
                hit = hit or ord(ch) == av
            elif op is c.RANGE:
                hit = hit or av[0] <= ord(ch) <= av[1]
            elif op is c.CATEGORY:
                hit = hit or category(av, ch)
        return hit != negate

    atoms: list[Callable[[str], bool]] = []
    for op, av in _regex_nodes(nodes, c):  # assertions write nothing, but reading them too over-estimates safely
        if op is c.LITERAL:
            atoms.append(lambda ch, v=av: ord(ch) == v)
        elif op is c.NOT_LITERAL:
            atoms.append(lambda ch, v=av: ord(ch) != v)
        elif op is c.ANY:
            atoms.append(lambda ch: ch != "\n")
        elif op is c.CATEGORY:
            atoms.append(lambda ch, v=av: category(v, ch))
        elif op is c.IN:
            atoms.append(lambda ch, items=av: in_set(items, ch))
    # either case: a flag like (?i) may let a literal write the other case
    return lambda ch: any(atom(x) for x in {ch, ch.lower(), ch.upper()} for atom in atoms)
