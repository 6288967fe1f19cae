"""The Messages API's request bodies as typed models: content blocks told apart by their `type` (an unknown one is
reported as such, at the block), tools, tool_choice, thinking."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union, get_args

from pydantic import Discriminator, Field, Tag

from reasoning_engine.server.protocol import CacheSalt, RequestBody

MIN_THINKING_BUDGET = 1024  # Anthropic's floor for thinking.budget_tokens
_TAG = "~"  # union tags start with it (errors.UNION_TAG_MARKS), so an error's parameter leaves them out


def _one_of(*members: type[RequestBody]) -> Any:
    """A union of blocks told apart by their `type`; an unknown `type` is reported as such, at the block."""
    tags = {value: _TAG + member.__name__ for member in members
            for value in get_args(member.model_fields["type"].annotation)}

    def tag(value: Any) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return tags.get(kind) if isinstance(kind, str) else None

    union = Union[tuple(Annotated[member, Tag(_TAG + member.__name__)] for member in members)]  # noqa: UP007
    return Annotated[union, Discriminator(tag, custom_error_type="invalid_type",
                                          custom_error_message=f"type must be one of: {', '.join(tags)}")]


def _string_or_list(item: Any) -> Any:
    """A string or a list of `item`, told apart first so a bad item is reported as itself."""
    return Annotated[Annotated[str, Tag(_TAG + "str")] | Annotated[list[item], Tag(_TAG + "list")],
                     Discriminator(lambda value: _TAG + ("list" if isinstance(value, list) else "str"))]


class TextBlock(RequestBody):
    type: Literal["text"]
    text: str


class Base64Source(RequestBody):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(min_length=1)


class URLSource(RequestBody):
    type: Literal["url"]
    url: str = Field(min_length=1)


ImageSource = _one_of(Base64Source, URLSource)


class ImageBlock(RequestBody):
    type: Literal["image"]
    source: ImageSource  # type: ignore[valid-type]

    def url(self) -> str:
        """The chat image part's URL: a data URL for inline images, so the multimodal path's checks apply."""
        if isinstance(self.source, Base64Source):
            return f"data:{self.source.media_type};base64,{self.source.data}"
        return self.source.url


class ToolUseBlock(RequestBody):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


ToolResultContent = _string_or_list(_one_of(TextBlock, ImageBlock))


class ToolResultBlock(RequestBody):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: ToolResultContent = ""  # type: ignore[valid-type]
    is_error: bool = False


class ThinkingBlock(RequestBody):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(RequestBody):
    """Encrypted thinking from Anthropic's own models: opaque, so it is left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str


MessageContent = _string_or_list(_one_of(TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                                         RedactedThinkingBlock))


class MessageParam(RequestBody):
    role: Literal["user", "assistant"]
    content: MessageContent  # type: ignore[valid-type]


class ToolDefinition(RequestBody):
    """A client tool; Anthropic's server tools (web search, code execution) have other types and are refused."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoiceAuto(RequestBody):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(RequestBody):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(RequestBody):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(RequestBody):
    type: Literal["none"]


ToolChoice = _one_of(ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone)


class ThinkingEnabled(RequestBody):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=MIN_THINKING_BUDGET)
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(RequestBody):
    """The model decides how long to think (the server's default budget applies); the bundled models think at the
    start of every turn, tool turns included, so `between_tools` is served the same way."""

    type: Literal["adaptive", "between_tools"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(RequestBody):
    type: Literal["disabled"]


ThinkingConfig = _one_of(ThinkingEnabled, ThinkingAdaptive, ThinkingDisabled)
SystemContent = _string_or_list(TextBlock)


class Metadata(RequestBody):
    user_id: str | None = Field(default=None, max_length=256)


class CountTokensRequest(RequestBody):
    """What count_tokens reads: the parts of a Messages request that shape the prompt."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: SystemContent | None = None  # type: ignore[valid-type]
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None  # type: ignore[valid-type]
    thinking: ThinkingConfig | None = None  # type: ignore[valid-type]


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    stream: bool = False
    cache_salt: CacheSalt = None  # vLLM's, as on the OpenAI routes (Anthropic's API has no such field)
