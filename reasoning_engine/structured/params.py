"""What a request asks its output to match: vLLM's `StructuredOutputsParams` shape (exactly one of json, regex, choice,
grammar, json_object, structural_tag).

Checked at construction, without a tokenizer: the shape of each field, whether the schema, regex or grammar
parses at all (xgrammar's tokenizer-free front end), and whether the grammar can enforce every keyword of a JSON
schema (schemas.py: rewritten where it can be, else refused), so a bad request fails with a ValueError naming the
field (and the keyword's path in the schema) before it reaches the engine. The engine compiles it against its
vocabulary (compiler.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from reasoning_engine.structured.schemas import SchemaError, enforceable_schema, join

FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

# compact JSON (no free whitespace): a small model cannot wander into endless spaces, and answers are shorter
JSON_SEPARATORS = (",", ":")


@dataclass
class StructuredOutputsParams:
    """`json`: a JSON schema (a dict or its JSON text); `regex`: a regular expression the whole output matches;
    `choice`: the output is exactly one of these strings; `grammar`: an EBNF grammar (GBNF dialect, rule `root`);
    `json_object`: any JSON object; `structural_tag`: an xgrammar structural tag (`{"type": "structural_tag",
    "format": {...}}`, a dict or its JSON text), how the server constrains tool calls to each tool's schema."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        chosen = [name for name in FIELDS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(f"structured_outputs: exactly one of {', '.join(FIELDS)} must be set, got "
                             f"{', '.join(chosen) or 'none'}")
        self._check_shape()
        self._enforced = self._enforced_text()
        self.frontend_grammar()

    @classmethod
    def from_value(cls, value: StructuredOutputsParams | dict[str, Any]) -> StructuredOutputsParams:
        """A dict (as it arrives in a request body) or an instance."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(FIELDS))
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0]}: unknown field ({', '.join(FIELDS)})")
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(name for name in FIELDS if getattr(self, name) not in (None, False))

    def key(self) -> tuple[str, str]:
        """Hashable and canonical (a schema dict and its JSON text are the same key): the compile cache's key. Key
        order is kept: a schema's property order is the order the grammar writes the properties in."""
        kind = self.kind
        if kind in ("json", "structural_tag"):
            return kind, self._enforced
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)

    def schema(self) -> dict[str, Any] | bool:
        """The JSON schema as given."""
        return json.loads(self.json) if isinstance(self.json, str) else self.json

    def enforced_schema(self) -> dict[str, Any] | bool:
        """The JSON schema as the grammar holds it (schemas.enforceable_schema): what xgrammar compiles."""
        return json.loads(self._enforced)

    def structural_tag_json(self) -> str:
        """The structural tag as JSON text (what xgrammar parses), the same for a dict and its JSON text; its JSON
        schemas as the grammar holds them."""
        return self._enforced

    def _enforced_text(self) -> str:
        """The schema (json) or the structural tag with its schemas, rewritten so the grammar enforces every
        keyword; ValueError naming the field and the keyword's path."""
        if self.kind == "json":
            try:
                return json.dumps(enforceable_schema(self.schema()))
            except SchemaError as e:
                raise ValueError(f"{join('structured_outputs.json', e.path) if e.path else 'structured_outputs.json'}"
                                 f": {e.reason}") from None
        if self.kind == "structural_tag":
            value = json.loads(self.structural_tag) if isinstance(self.structural_tag, str) else self.structural_tag
            try:
                return json.dumps(_enforced_formats(value, "structured_outputs.structural_tag"))
            except RecursionError:
                raise ValueError("structured_outputs.structural_tag: nested too deeply") from None
        return ""

    def ebnf(self) -> str:
        """`choice` as a grammar: one alternative per string (JSON string escapes are the GBNF literal's)."""
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)

    def _check_shape(self) -> None:
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from None
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(f"structured_outputs.json: a JSON schema is an object, got {type(parsed).__name__}")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_outputs.{kind}: must be a non-empty string")
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty strings")
        elif kind == "structural_tag":
            try:
                parsed = json.loads(value) if isinstance(value, str) else value
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.structural_tag: not valid JSON: {e}") from None
            if not isinstance(parsed, dict):
                raise ValueError("structured_outputs.structural_tag: must be an object "
                                 '{"type": "structural_tag", "format": {...}}')
        elif value is not True:
            raise ValueError("structured_outputs.json_object: must be true")

    def frontend_grammar(self) -> Any:
        """The tokenizer-free xgrammar Grammar; raises ValueError naming the field when it does not parse."""
        import xgrammar

        kind = self.kind
        try:
            if kind == "json":
                return xgrammar.Grammar.from_json_schema(self._enforced, any_whitespace=False,
                                                         separators=JSON_SEPARATORS)
            if kind == "json_object":
                return xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                                         separators=JSON_SEPARATORS, strict_mode=False)
            if kind == "regex":
                return xgrammar.Grammar.from_regex(self.regex)
            if kind == "structural_tag":
                return xgrammar.Grammar.from_structural_tag(self.structural_tag_json())
            return xgrammar.Grammar.from_ebnf(self.ebnf() if kind == "choice" else self.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{kind}: {short_error(e)}") from None


def _enforced_formats(value: Any, path: str) -> Any:
    """A structural tag (or a part of one) with each `json_schema` format's schema made enforceable."""
    if isinstance(value, list):
        return [_enforced_formats(item, join(path, i)) for i, item in enumerate(value)]
    if not isinstance(value, dict):
        return value
    out = {key: _enforced_formats(item, join(path, key)) for key, item in value.items() if key != "json_schema"}
    if "json_schema" in value:
        schema = value["json_schema"]
        if value.get("type") == "json_schema" and isinstance(schema, (dict, bool)):
            try:
                schema = enforceable_schema(schema)
            except SchemaError as e:
                where = join(join(path, "json_schema"), e.path) if e.path else join(path, "json_schema")
                raise ValueError(f"{where}: {e.reason}") from None
        out["json_schema"] = schema
    return {key: out[key] for key in value}  # the keys in their order


def short_error(error: Exception) -> str:
    """xgrammar's messages start with a timestamp and a C++ source location: keep what a user can act on."""
    text = str(error).strip()
    head, sep, rest = text.partition(": ")
    return rest if sep and head.startswith("[") and ".cc:" in head else text
