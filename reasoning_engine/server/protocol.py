"""Request bodies of the OpenAI-compatible API, validated by pydantic.

Unknown fields are ignored (clients and agent frameworks send many: metadata, store, ...) and each unknown name is
logged once per process, so a misspelt parameter is visible without flooding the log; known fields are typed, and
strictly, as OpenAI's schema is (no 0 for false, no "5" for 5), so a wrong type becomes a 400 naming the field.
Sampling ranges are left to SamplingParams, whose ValueError already names the field, so there is one source of
truth for them.
"""

from __future__ import annotations

import json
import logging
import threading
from functools import cache
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from reasoning_engine.engine.kv_cache import MAX_CACHE_SALT_LENGTH

logger = logging.getLogger(__name__)
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1
TOOL_CHOICE_MODES = ("none", "auto", "required")
MAX_LOGGED_UNKNOWN_FIELDS = 256  # distinct names; a client inventing new ones per request cannot grow the set further
_logged_unknown_fields: set[str] = set()
_logged_lock = threading.Lock()
# vLLM's `cache_salt` (chat, completions, responses, messages): prompts share prefix-cache blocks only with equal salts
CacheSalt = Annotated[str | None, Field(
    min_length=1, max_length=MAX_CACHE_SALT_LENGTH,
    description="Mixed into the prompt's prefix-cache keys: cached KV is shared only between requests with the same "
                "salt (e.g. one per tenant), so other requests cannot read or time this request's prefix.")]


class RequestBody(BaseModel):
    """The base of every API's request models (chat, completions, Responses, Anthropic Messages): unknown fields
    are ignored, each name logged once per process; types are strict (no "1" for 1, no 0 for false) and numbers
    finite."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _log_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = _known_names(cls)
            for name in data:
                if isinstance(name, str) and name not in known:
                    _log_unknown_field(cls.__name__, name)
        return data


@cache
def _known_names(model: type[BaseModel]) -> frozenset[str]:
    """Field names and every alias they accept."""
    names: set[str] = set()
    for name, info in model.model_fields.items():
        names.add(name)
        for alias in (info.alias, info.validation_alias):
            if isinstance(alias, str):
                names.add(alias)
            elif isinstance(alias, AliasChoices):
                names.update(choice for choice in alias.choices if isinstance(choice, str))
    return frozenset(names)


def _log_unknown_field(model: str, name: str) -> None:
    """One WARNING per field name per process, as vLLM does, up to MAX_LOGGED_UNKNOWN_FIELDS names."""
    with _logged_lock:
        if name in _logged_unknown_fields or len(_logged_unknown_fields) >= MAX_LOGGED_UNKNOWN_FIELDS:
            return
        _logged_unknown_fields.add(name)
        last = len(_logged_unknown_fields) == MAX_LOGGED_UNKNOWN_FIELDS
    logger.warning("ignoring unknown request field %r (in %s); it is logged once", name[:100], model)
    if last:
        logger.warning("%d unknown request field names logged; further ones are not", MAX_LOGGED_UNKNOWN_FIELDS)


class TextPart(RequestBody):
    type: Literal["text"]
    text: str


class ImageURL(RequestBody):
    url: str = Field(min_length=1)  # data:, or http(s):// and file:// where the server's flags allow them
    detail: Literal["auto", "low", "high"] | None = None  # accepted for OpenAI clients; images keep their resolution


class ImagePart(RequestBody):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(RequestBody):
    url: str = Field(min_length=1)


class VideoPart(RequestBody):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]
# A string or a list of parts, told apart before validating, so a bad part is reported as itself rather than beside
# "Input should be a valid string"; the tags are the type names errors.param_from_loc stops at.
Content = Annotated[Annotated[str, Tag("str")] | Annotated[list[ContentPart], Tag("list")],
                    Discriminator(lambda value: "list" if isinstance(value, list) else "str")]


class FunctionCall(RequestBody):
    name: str
    arguments: Annotated[str, WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "object"}]})] = "{}"

    @field_validator("arguments", mode="before")
    @classmethod
    def _arguments_as_json_text(cls, value: Any) -> Any:
        """Some clients send the arguments as an object; templates expect OpenAI's JSON string."""
        return json.dumps(value) if isinstance(value, dict) else value


class ToolCallIn(RequestBody):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestBody):
    # _content_required's rule, for the OpenAPI document: content, unless an assistant message has calls or thinking
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        *({"required": ["role", field], "properties": {"role": {"const": "assistant"}, field: schema}}
          for field, schema in (("tool_calls", {"type": "array", "minItems": 1}),
                                ("reasoning_content", {"type": "string", "minLength": 1}),
                                ("reasoning", {"type": "string", "minLength": 1})))]})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # Earlier turns' thinking, passed back for interleaved thinking; `reasoning` is the newer spelling of the field.
    reasoning_content: str | None = Field(default=None, validation_alias=AliasChoices("reasoning_content", "reasoning"))

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.reasoning_content)):
            raise ValueError(f"a {self.role} message needs content")
        return self

    @property
    def has_media(self) -> bool:
        return isinstance(self.content, list) and any(not isinstance(part, TextPart) for part in self.content)

    def text(self) -> str:
        """The text parts joined (a message with media keeps its parts instead: chat_template.template_messages)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""


class FunctionDef(RequestBody):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(RequestBody):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(RequestBody):
    include_usage: bool = False


class JSONSchemaSpec(RequestBody):
    """`response_format.json_schema`. Every schema is enforced, `strict` or not (it is accepted for OpenAI clients);
    `schema` is required here, since a json_schema format without one constrains nothing."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestBody):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching `json_schema.schema`; vLLM's
    `structural_tag` type takes an xgrammar structural-tag `format`. One model rather than a union by `type`, so a
    wrong shape is reported at its own path (`response_format.json_schema.schema`)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JSONSchemaSpec | None = None
    format: dict[str, Any] | None = None


class StructuredOutputsSpec(RequestBody):
    """vLLM's `structured_outputs`: exactly one of these (checked by StructuredOutputsParams, which names the
    field)."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None


class _SamplingFields(RequestBody):
    """Fields shared by chat and completions; None means the SamplingParams default."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=128)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=UINT64_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=512)  # OpenAI's end-user id: a session key for KV retention
    prompt_cache_key: str | None = Field(default=None, max_length=512)  # OpenAI's cache-routing key: the same
    cache_salt: CacheSalt = None
    # constrained decoding: one of response_format (json_object / json_schema), structured_outputs or a guided_*
    # field (vLLM's older names) per request
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsSpec | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as JSON object keys are: a decimal string) -> [-100, 100]
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, gt=0)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # the chat template's `reasoning_effort` (gpt-oss renders it into its system message); chat_template_kwargs wins
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    thinking_token_budget: int | None = Field(
        default=None, ge=0, validation_alias=AliasChoices("thinking_token_budget", "max_thinking_tokens"))
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _known_tool_choice(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in TOOL_CHOICE_MODES:
            raise ValueError(f"unknown tool_choice {value!r}; use 'none', 'auto', 'required' or "
                             '{"type": "function", "function": {"name": ...}}')
        return value


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, gt=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    skip_special_tokens: bool = True


class TokenizeRequest(RequestBody):
    """Either a raw `prompt` or chat `messages` (rendered through the chat template, as the chat endpoint would)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [  # the rule _one_input checks, for the OpenAPI document
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]
