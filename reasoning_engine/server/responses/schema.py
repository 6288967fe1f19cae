"""The Responses API's request body: input items and parts, tools, text formats, as typed models; a body that fails
them is a 400 naming its place (`input[2].content[0].type`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError, field_validator

from reasoning_engine.server.errors import APIError, bad_request, from_error_detail, param_from_loc
from reasoning_engine.server.protocol import CacheSalt, RequestBody

_UNKNOWN_TAG = "unknown_type"


def _tagged(tags: dict[str, str], default: str | None = None) -> Callable[[Any], str | None]:
    """A discriminator reading `type` (or `default` when it is absent); union tags are written `<name>` so error
    locations can tell them from field names."""
    def tag(value: Any) -> str | None:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
        return tags.get(kind) if isinstance(kind, str) else None
    return tag


def _str_or_list(value: Any) -> str:
    return "<list>" if isinstance(value, list) else "<str>"


class InputText(RequestBody):
    type: Literal["input_text"]
    text: str


class OutputText(RequestBody):
    """An earlier answer's text (annotations are not kept: this server makes none)."""

    type: Literal["output_text"]
    text: str


class InputImage(RequestBody):
    type: Literal["input_image"]
    image_url: str = Field(min_length=1)  # a data: URL, or http(s):// and file:// where the server's flags allow
    detail: Literal["auto", "low", "high"] | None = None


ContentPart = Annotated[
    Annotated[InputText, Tag("<input_text>")] | Annotated[OutputText, Tag("<output_text>")]
    | Annotated[InputImage, Tag("<input_image>")],
    Discriminator(_tagged({"input_text": "<input_text>", "output_text": "<output_text>",
                           "input_image": "<input_image>"}),
                  custom_error_type=_UNKNOWN_TAG,
                  custom_error_message="content parts are input_text, output_text or input_image")]
MessageContent = Annotated[Annotated[str, Tag("<str>")] | Annotated[list[ContentPart], Tag("<list>")],
                           Discriminator(_str_or_list)]


class MessageItem(RequestBody):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: MessageContent


class FunctionCallItem(RequestBody):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1, max_length=256)
    arguments: str


class FunctionCallOutputItem(RequestBody):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str = Field(min_length=1)
    output: Annotated[Annotated[str, Tag("<str>")] | Annotated[list[InputText], Tag("<list>")],
                      Discriminator(_str_or_list)]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ReasoningText(RequestBody):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(RequestBody):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(RequestBody):
    """Earlier thinking; `encrypted_content` (OpenAI's opaque form) is ignored, since this server never makes it."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None

    def text(self) -> str:
        """The thinking itself when the item has it, else its summary."""
        if self.content:
            return "".join(part.text for part in self.content)
        return "\n\n".join(part.text for part in self.summary)


InputItem = Annotated[
    Annotated[MessageItem, Tag("<message>")] | Annotated[FunctionCallItem, Tag("<function_call>")]
    | Annotated[FunctionCallOutputItem, Tag("<function_call_output>")] | Annotated[ReasoningItem, Tag("<reasoning>")],
    Discriminator(_tagged({"message": "<message>", "function_call": "<function_call>",
                           "function_call_output": "<function_call_output>", "reasoning": "<reasoning>"},
                          default="message"),
                  custom_error_type=_UNKNOWN_TAG,
                  custom_error_message="input items are message, function_call, function_call_output or reasoning")]
Input = Annotated[Annotated[str, Tag("<str>")] | Annotated[list[InputItem], Tag("<list>")],
                  Discriminator(_str_or_list)]
STORED_ITEMS = TypeAdapter(list[InputItem])  # a stored conversation's items (input and output) read back


class FunctionTool(RequestBody):
    """Responses function tools are flat: no nested `function` object as in chat."""

    type: str
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _function_only(cls, value: str) -> str:
        if value != "function":
            raise ValueError(f"tool type {value!r} is not supported; this server runs function tools only")
        return value


class FunctionToolChoice(RequestBody):
    type: Literal["function"]
    name: str


ToolChoice = Annotated[Annotated[Literal["none", "auto", "required"], Tag("<str>")]
                       | Annotated[FunctionToolChoice, Tag("<object>")],
                       Discriminator(lambda value: "<str>" if isinstance(value, str) else "<object>")]


class ReasoningConfig(RequestBody):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: str | None = None  # accepted; this server returns the thinking itself, never a summary


class TextFormatText(RequestBody):
    type: Literal["text"]


class TextFormatJSONObject(RequestBody):
    type: Literal["json_object"]


class TextFormatJSONSchema(RequestBody):
    model_config = ConfigDict(populate_by_name=True)  # `schema_` is taken for `schema` too

    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[
    Annotated[TextFormatText, Tag("<text>")] | Annotated[TextFormatJSONObject, Tag("<json_object>")]
    | Annotated[TextFormatJSONSchema, Tag("<json_schema>")],
    Discriminator(_tagged({"text": "<text>", "json_object": "<json_object>", "json_schema": "<json_schema>"}),
                  custom_error_type=_UNKNOWN_TAG, custom_error_message="formats are text, json_object or json_schema")]


class TextConfig(RequestBody):
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    """`POST /v1/responses`. Unknown fields are ignored, as on the chat route; fields whose silent loss would change
    what the client gets (`background`, `conversation`) are refused."""

    model: str | None = None
    input: Input
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, gt=0)
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = Field(default=None, max_length=512)
    prompt_cache_key: str | None = Field(default=None, max_length=512)
    cache_salt: CacheSalt = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    background: bool = Field(default=False, json_schema_extra={"const": False})  # documented as what is accepted
    conversation: Any = Field(default=None, json_schema_extra={"type": "null"})

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool) -> bool:
        if value:
            raise ValueError("background responses are not supported; use stream or wait for the response")
        return value

    @field_validator("conversation")
    @classmethod
    def _no_conversation(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("conversations are not supported; chain responses with previous_response_id")
        return value


def parse_request(data: dict[str, Any]) -> ResponsesRequest:
    """Validate a request body (the route reads it with routing.json_body, which words errors by `invalid`)."""
    try:
        return ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc) from exc


def invalid(exc: ValidationError) -> APIError:
    """The first validation error as every route words it (`errors.from_validation_error`), but for an item or
    part of an unknown type, which names its `type` (`input[2].content[0].type`) and the type it was."""
    first = exc.errors(include_url=False)[0]
    if first["type"] != _UNKNOWN_TAG:
        return from_error_detail(first)
    param = param_from_loc(tuple(first["loc"]))
    param = f"{param}.type" if param else "type"
    kind = first["input"].get("type") if isinstance(first["input"], dict) else None
    message = str(first["msg"]).removeprefix("Value error, ")
    message = f"unsupported type {kind!r}; {message}" if kind is not None else message
    return bad_request(f"{param}: {message}", param=param, code="invalid_value")
