"""Every chat format the server reads, by the names `--reasoning-parser` and `--tool-call-parser` take, and the
`auto` choice of them from the model.

A family's formats live in one module of this package (its markers, tool-call parser, call grammar and reasoning
format); adding a family is that module plus its line in `FAMILIES`. `auto` asks the families in `FAMILIES`' order
and takes the first answer, so a family whose tokens other vocabularies may hold (Kimi's) comes first and the
catch-all `<think>` splitter (qwen3) last.
"""

from __future__ import annotations

from collections.abc import Container, Mapping

from reasoning_engine.server.formats import deepseek, glm, harmony, kimi, minimax, qwen
from reasoning_engine.server.formats.base import CallSyntax, Family, ModelTraits, ToolFormat
from reasoning_engine.server.reasoning_parsers import ReasoningFormat
from reasoning_engine.server.tool_parsers import ToolParser

FAMILIES: tuple[Family, ...] = (
    kimi.FAMILY,
    harmony.FAMILY,
    glm.FAMILY,
    minimax.FAMILY,
    deepseek.FAMILY,
    qwen.FAMILY,
)


def _by_name(formats: list[Mapping[str, object]]) -> dict[str, object]:
    merged: dict[str, object] = {}
    for named in formats:
        for name, fmt in named.items():
            if name in merged:
                raise ValueError(f"two chat formats are named {name!r}")
            merged[name] = fmt
    return merged


REASONING_FORMATS: dict[str, ReasoningFormat] = _by_name([f.reasoning for f in FAMILIES])  # type: ignore[assignment]
TOOL_FORMATS: dict[str, ToolFormat] = _by_name([f.tools for f in FAMILIES])  # type: ignore[assignment]
TOOL_PARSERS: dict[str, type[ToolParser]] = {name: fmt.parser for name, fmt in TOOL_FORMATS.items()}
CALL_SYNTAXES: dict[str, CallSyntax] = {name: fmt.syntax for name, fmt in TOOL_FORMATS.items()}
REASONING_PARSER_CHOICES = (*REASONING_FORMATS, "auto", "none")
TOOL_PARSER_CHOICES = (*TOOL_FORMATS, "auto", "none")


def resolve_reasoning_parser(name: str, model_type: str, vocab: Container[str]) -> str | None:
    """The reasoning format `name` means for this model: itself, None for `none`, and for `auto` the first family's
    pick (Kimi's chat tokens: kimi_k2, Kimi Linear included; gpt-oss: its harmony channels; GLM, MiniMax and DeepSeek
    models with `</think>` in the vocabulary: theirs; Qwen3-Next, Qwen3.5 / 3.6 and any other model with `</think>`:
    qwen3, which detects an opening `<think>`)."""
    if name != "auto":
        return None if name == "none" else name
    model = ModelTraits(model_type, vocab)
    return next((found for family in FAMILIES if (found := family.auto_reasoning(model))), None)


def resolve_tool_parser(name: str, model_type: str, vocab: Container[str], chat_template: str | None) -> str | None:
    """The tool-call format `name` means for this model: itself, None for `none`, and for `auto` the first family's
    pick by model type, vocabulary and chat template (Kimi's call tokens: kimi_k2; GLM's `<arg_key>`: glm45; a
    DeepSeek template's call markers: its DeepSeek format; Qwen3.5 / 3.6 or a template writing `<function=` and
    `<parameter=`: qwen3_coder; a `<tool_call>` token or template mention: hermes)."""
    if name != "auto":
        return None if name == "none" else name
    model = ModelTraits(model_type, vocab, chat_template or "")
    return next((found for family in FAMILIES if (found := family.auto_tools(model))), None)
