"""Chat and completion requests made ready for the engine, shared by every API: validation, the rendered prompt
and its media, sampling settings, answer and tool-call constraints, and a parser chain per choice (`Prepared`).
What runs them is routing.serve_prepared; what walks their outputs, chat_run.py; the OpenAI response shapes,
openai_chat.py.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from reasoning_engine.engine.engine import PromptType
from reasoning_engine.multimodal.chat import extract_media
from reasoning_engine.multimodal.loading import Fetched, MediaLoader, is_remote
from reasoning_engine.outputs import Logprob
from reasoning_engine.sampling_params import SamplingParams
from reasoning_engine.server.chat_template import (
    RenderedChat,
    check_template_kwargs,
    disable_thinking,
    render_chat,
    template_messages,
    thinking_switch,
)
from reasoning_engine.server.engine_client import EngineClient
from reasoning_engine.server.engine_requests import param_of
from reasoning_engine.server.errors import APIError, bad_request
from reasoning_engine.server.formats.registry import CALL_SYNTAXES, REASONING_FORMATS, TOOL_PARSERS
from reasoning_engine.server.metrics import ServerMetrics
from reasoning_engine.server.parsing import ChatOutputParser, answer_drop, build_output_parser
from reasoning_engine.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ImagePart,
    NamedToolChoice,
    ResponseFormat,
    VideoPart,
)
from reasoning_engine.server.reasoning_parsers import ReasoningParser, initial_mode
from reasoning_engine.server.token_bytes import TokenBytes
from reasoning_engine.server.tool_grammar import ToolSchemaError, answer_tag, bad_tool_schema, tool_call_tag
from reasoning_engine.structured.params import StructuredOutputsParams

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "min_tokens")
# vLLM's older top-level spellings of structured_outputs' fields
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass
class Prepared:
    """A validated request ready for the engine: prompts (token ids, with their images and videos for a chat with
    media), sampling settings, a per-choice parser factory, its workload class for the adaptive engine ("agent" with
    tools, "chat", "completion"), and how an engine ValueError maps to the request's parameter."""

    prompts: Sequence[PromptType]
    params: SamplingParams
    new_parser: Callable[[], ChatOutputParser | None]
    workload: str = "default"
    error_param: Callable[[str], str | None] = param_of


@dataclass(frozen=True)
class Constraint:
    """A request's structured-output spec and the request parameter its errors are about."""

    spec: StructuredOutputsParams
    param: str


def _constraint_error_param(constraint: Constraint | None,
                            fallback: Callable[[str], str | None]) -> Callable[[str], str | None]:
    """An engine error about the grammar (`structured_outputs...: why`) names the request field it came from."""
    if constraint is None:
        return fallback
    return lambda message: constraint.param if message.startswith("structured_outputs") else fallback(message)


def _structured_spec(fields: dict[str, Any], param: str | None) -> StructuredOutputsParams:
    """StructuredOutputsParams from request fields; its ValueError (`structured_outputs.json: why`) becomes a 400
    naming `param`, or the field the message names when `param` is None (the request's own structured_outputs)."""
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as exc:
        path, _, detail = str(exc).partition(": ")
        if param is not None:  # `structured_outputs.json.properties.x.not` -> `{param}.properties.x.not`
            field = re.match(r"structured_outputs\.\w+", path)
            param += path[field.end():] if field else ""
        raise bad_request(f"{param or path}: {detail}", param=param or path, code="invalid_value") from exc


def _response_format_constraint(fmt: ResponseFormat) -> Constraint:
    """A json_object / json_schema / structural_tag response_format as a constraint."""
    if fmt.type == "json_object":
        return Constraint(_structured_spec({"json_object": True}, "response_format"), "response_format")
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_request("response_format: type json_schema needs a json_schema object", param="response_format",
                              code="invalid_value")
        param = "response_format.json_schema.schema"
        return Constraint(_structured_spec({"json": fmt.json_schema.schema_}, param), param)
    if fmt.format is None:
        raise bad_request("response_format: type structural_tag needs a format object", param="response_format",
                          code="invalid_value")
    param = "response_format.format"
    return Constraint(_structured_spec({"structural_tag": {"type": "structural_tag", "format": fmt.format}}, param),
                      param)


def placeholder_messages(messages: list[ChatMessage], refs: list[MediaRef]) -> list[dict[str, Any]]:
    """The messages as the chat template reads them, media parts as the template's own image / video parts (the
    URLs are loaded separately)."""
    rendered = template_messages(messages)
    return extract_media(rendered, lambda url: url, lambda url: url).messages if refs else rendered


@dataclass(frozen=True)
class MediaRef:
    """An image or video part of a chat request: where it is (the error `param`), its kind and URL."""

    param: str
    kind: str
    url: str


def _salted(prompt: PromptType, cache_salt: str | None) -> PromptType:
    """The prompt carrying its request's `cache_salt`, where the engine reads it (a prompt dict's, as in vLLM)."""
    if cache_salt is None:
        return prompt
    return {**(prompt if isinstance(prompt, dict) else {"prompt_token_ids": prompt}), "cache_salt": cache_salt}


class OpenAIServing:
    """Request handling shared by the HTTP routes; holds what is resolved once per server (parsers, limits)."""

    def __init__(self, engine: EngineClient, metrics: ServerMetrics, *, model_names: list[str],
                 reasoning_parser: str | None, tool_parser: str | None, max_thinking_tokens: int | None,
                 media_loader: MediaLoader, media_timeout: float, tokenizer: Any) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_names = model_names
        self.tokenizer = tokenizer  # the engine's, or a copy with the server's --chat-template
        self.max_model_len: int = engine.model_config.max_model_len
        self.vocab_size: int = engine.model_config.vocab_size
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.max_thinking_tokens = max_thinking_tokens
        self.special_tokens = _special_token_strings(self.tokenizer)
        self.token_bytes = TokenBytes(self.tokenizer)
        self._reasoning_end_ids, self._think_end_id = self._marker_ids()
        # what the parsers drop from the answer, kept out of tool calls' strings; the call markers that are tokens
        self._answer_drop = answer_drop(self.reasoning_parser, self.special_tokens)
        self._call_marker_ids = self._call_markers()
        self.media_loader = media_loader
        self.media_timeout = media_timeout  # seconds for all of a request's media: fetch, decode, preprocess
        self.vision: bool = engine.supports_media
        self.media_processor = engine.media_processor if self.vision else None
        self.media_limits: dict[str, int] = engine.media_limits

    # ---- shared validation -------------------------------------------------------------------------------

    def check_model(self, name: str | None) -> str:
        if name is None:
            return self.model_names[0]
        if name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist. Available: {', '.join(self.model_names)}.",
                           param="model", code="model_not_found")
        return name

    def _max_tokens(self, requested: int | None, prompt_len: int, param: str, prompt_param: str) -> int:
        if prompt_len >= self.max_model_len:
            raise bad_request(f"The prompt has {prompt_len} tokens, which leaves no room to generate within the "
                              f"model's maximum context length of {self.max_model_len} tokens.",
                              param=prompt_param, code="context_length_exceeded")
        room = self.max_model_len - prompt_len
        if requested is None:
            return room
        if requested > room:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                              f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
                              f"in the completion). Reduce the prompt or {param}.",
                              param=param, code="context_length_exceeded")
        return requested

    def _sampling_params(self, req: ChatCompletionRequest | CompletionRequest, *, max_tokens: int | None,
                         max_tokens_param: str, logprobs: int | None, logprobs_param: str, skip_special_tokens: bool,
                         thinking_token_budget: int | None, constraint: Constraint | None) -> SamplingParams:
        overrides = {name: getattr(req, name) for name in _SAMPLING_FIELDS if getattr(req, name) is not None}
        try:
            return SamplingParams(n=req.n, stop=req.stop, stop_token_ids=req.stop_token_ids, max_tokens=max_tokens,
                                  ignore_eos=req.ignore_eos, logprobs=logprobs, skip_special_tokens=skip_special_tokens,
                                  include_stop_str_in_output=req.include_stop_str_in_output,
                                  thinking_token_budget=thinking_token_budget,
                                  structured_outputs=constraint.spec if constraint is not None else None,
                                  **self._token_constraints(req), **overrides)
        except ValueError as exc:
            param = param_of(str(exc))
            param = {"max_tokens": max_tokens_param, "logprobs": logprobs_param,
                     "thinking_token_budget": "thinking_token_budget"}.get(param or "", param)
            raise bad_request(str(exc), param=param, code="invalid_value") from exc

    def _token_constraints(self, req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
        """logit_bias, allowed_token_ids and bad_words for SamplingParams, every token id checked against the
        vocabulary here, so a bad id is a 400 naming its parameter before the engine sees the request."""
        out: dict[str, Any] = {}
        if req.logit_bias:
            bias: dict[int, float] = {}
            for key, value in req.logit_bias.items():
                digits = key.strip()
                if not (digits.isascii() and digits.isdigit()) or int(digits) >= self.vocab_size:
                    raise bad_request(f"logit_bias: key {key[:40]!r} is not a token id in [0, {self.vocab_size})",
                                      param="logit_bias", code="invalid_value")
                if not -100 <= value <= 100:
                    raise bad_request(f"logit_bias: the bias of token {digits} must be in [-100, 100], got {value}",
                                      param="logit_bias", code="invalid_value")
                bias[int(digits)] = value
            out["logit_bias"] = bias
        if req.allowed_token_ids is not None:
            outside = [t for t in req.allowed_token_ids if not 0 <= t < self.vocab_size]
            if not req.allowed_token_ids or outside:
                detail = f"token id {outside[0]} is outside" if outside else "must list token ids from"
                raise bad_request(f"allowed_token_ids: {detail} the vocabulary [0, {self.vocab_size})",
                                  param="allowed_token_ids", code="invalid_value")
            out["allowed_token_ids"] = req.allowed_token_ids
        if req.bad_words is not None:
            out["bad_words"] = req.bad_words
        return out

    def _answer_constraint(self, req: ChatCompletionRequest | CompletionRequest) -> Constraint | None:
        """The grammar the answer must match, from response_format, structured_outputs or a guided_* field (at most
        one of them), with the parameter its errors name."""
        given: list[Constraint] = []
        if req.response_format is not None and req.response_format.type != "text":
            given.append(_response_format_constraint(req.response_format))
        if req.structured_outputs is not None:
            fields = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            spec = _structured_spec(fields, None)
            given.append(Constraint(spec, f"structured_outputs.{spec.kind}"))
        for name, kind in _GUIDED_FIELDS.items():
            if getattr(req, name) is not None:
                given.append(Constraint(_structured_spec({kind: getattr(req, name)}, name), name))
        if len(given) > 1:
            first, second = (c.param.split(".", 1)[0] for c in given[:2])
            raise bad_request(f"{second}: one structured-output constraint per request, and {first} is already one",
                              param=second, code="invalid_value")
        return given[0] if given else None

    def _tool_constraint(self, req: ChatCompletionRequest, tools_active: bool,
                         answer: Constraint | None) -> Constraint | None:
        """tool_choice "required" or named: the answer is calls (an answer format waits for a later turn); under
        "auto", strict tools or an answer format: free text or that answer, with each call held to its tool's
        schema. None when the tools need no grammar. A model that thinks inside the constrained output (gpt-oss:
        no `</think>` for the engine to wait for) may think before the calls or the answer."""
        thinking = REASONING_FORMATS[self.reasoning_parser].inline_thinking if self.reasoning_parser else None
        if not tools_active or not req.tools:
            if answer is None or thinking is None:
                return answer
            return Constraint(_structured_spec({"structural_tag": answer_tag(answer.spec, thinking)}, answer.param),
                              answer.param)
        choice = req.tool_choice
        named = isinstance(choice, NamedToolChoice)
        required = named or choice == "required"
        if not required and answer is None and not any(t.function.strict for t in req.tools):
            return None
        if self.tool_parser not in CALL_SYNTAXES:
            raise bad_request(f"the {self.tool_parser} tool-call format cannot be constrained", param="tool_choice")
        if named:  # _check_tools made sure it is among the tools
            indices = [next(i for i, t in enumerate(req.tools) if t.function.name == choice.function.name)]
        else:
            indices = list(range(len(req.tools)))
        tools = [req.tools[i].function for i in indices]
        try:
            tag = tool_call_tag(self.tool_parser, tools, required=required,
                                parallel=not named and req.parallel_tool_calls is not False,
                                answer=None if required or answer is None else answer.spec, thinking=thinking,
                                dropped=self._answer_drop, marker_ids=self._call_marker_ids)
        except ToolSchemaError as exc:
            param = f"tools[{indices[exc.index]}].{exc.where}"
            raise bad_request(f"{param}: {exc.reason}", param=param, code="invalid_value") from exc
        try:
            return Constraint(StructuredOutputsParams(structural_tag=tag), "tools")
        except ValueError as exc:
            bad = bad_tool_schema(tools)
            if bad is None:  # the answer format cannot sit beside the calls
                param = answer.param if answer is not None else "tools"
                detail = str(exc).partition(": ")[2]
                raise bad_request(f"{param}: {detail}", param=param, code="invalid_value") from exc
            param = f"tools[{indices[bad[0]]}].function.parameters"
            raise bad_request(f"{param}: {bad[1]}", param=param, code="invalid_value") from exc

    # ---- chat -------------------------------------------------------------------------------------------

    async def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        """Render the prompt, build the sampling settings and a per-choice parser factory, and load the images and
        videos (last, once everything cheaper is checked); every user error surfaces here as an APIError, before the
        engine sees the request."""
        tools_active = self._check_tools(req)
        constraint = self._tool_constraint(req, tools_active, self._answer_constraint(req))
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        rendered, refs, budget = self.render_prompt(req, tools_active)
        thinking_on = False
        if self.reasoning_parser:
            fmt = REASONING_FORMATS[self.reasoning_parser]
            mode = initial_mode(fmt, rendered.tail, rendered.thinking_requested)
            thinking_on = mode != "content"
            opener = _single_token_id(self.tokenizer, fmt.start)
            if mode == "detect" and constraint is not None and opener is not None:
                # the template leaves `<think>` to the model (Qwen3), but the engine starts a constraint at once
                # unless the prompt is inside the thinking: open it here, so thinking stays free
                rendered = replace(rendered, token_ids=[*rendered.token_ids, opener], tail=rendered.tail + fmt.start)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens: int | None = self._max_tokens(requested, len(rendered.token_ids), max_param, "messages")
        if refs and requested is None:
            max_tokens = None  # the engine expands each placeholder for its media: only it knows the room left
        parsing = bool(self.reasoning_parser or self.tool_parser)
        params = self._sampling_params(
            req, max_tokens=max_tokens, max_tokens_param=max_param,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None, logprobs_param="top_logprobs",
            skip_special_tokens=not parsing, thinking_token_budget=budget if thinking_on else None,
            constraint=constraint)

        tool_schemas = {tool.function.name: tool.function.parameters or {} for tool in req.tools or ()}

        def new_parser() -> ChatOutputParser | None:
            if not parsing:
                return None
            return build_output_parser(self.reasoning_parser, self.tool_parser, prompt_tail=rendered.tail,
                                       thinking_requested=rendered.thinking_requested, tools_active=tools_active,
                                       drop=self.special_tokens, tool_schemas=tool_schemas,
                                       constrained=constraint is not None)

        workload = "agent" if tools_active else "chat"
        if not refs:
            return Prepared([_salted(rendered.token_ids, req.cache_salt)], params, new_parser, workload,
                            _constraint_error_param(constraint, param_of))
        data = await self._media_data(refs)
        aliases = {"max_tokens": max_param, "prompt": "messages", "prompt_token_ids": "messages"}
        prompt = {"prompt_token_ids": rendered.token_ids, "multi_modal_data": data}
        return Prepared([_salted(prompt, req.cache_salt)], params, new_parser, workload, _constraint_error_param(
            constraint, lambda message: aliases.get(param_of(message) or "", refs[0].param)))

    def render_prompt(self, req: ChatCompletionRequest,
                      tools_active: bool) -> tuple[RenderedChat, list[MediaRef], int | None]:
        """The chat rendered as the engine will see it (media parts as the template's placeholders, loaded later),
        its media, and the thinking budget; shared with Anthropic's count_tokens, so a count is the real prompt's."""
        kwargs = check_template_kwargs(dict(req.chat_template_kwargs or {}))
        if req.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        budget = req.thinking_token_budget if req.thinking_token_budget is not None else self.max_thinking_tokens
        if budget == 0 and thinking_switch(kwargs) is not False:
            kwargs = disable_thinking(kwargs)  # a zero budget means no thinking: render the prompt that way
        refs = self.media_refs(req.messages)
        # with tool_choice "none" the prompt offers no tools, so the model answers in text instead of a call
        rendered = render_chat(self.tokenizer, placeholder_messages(req.messages, refs),
                               tools=req.tools if tools_active else None, template_kwargs=kwargs,
                               add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message)
        return rendered, refs, budget

    def media_refs(self, messages: list[ChatMessage]) -> list[MediaRef]:
        """The messages' image and video parts in prompt order, after the checks that need no fetching: the model
        has a vision tower (and a video placeholder, for a video), and no kind is over its `--limit-mm-per-prompt`."""
        refs: list[MediaRef] = []
        counts = {"image": 0, "video": 0}
        for i, message in enumerate(messages):
            if not message.has_media:
                continue
            for j, part in enumerate(message.content):  # type: ignore[arg-type]
                if isinstance(part, ImagePart):
                    ref = MediaRef(f"messages[{i}].content[{j}]", "image", part.image_url.url)
                elif isinstance(part, VideoPart):
                    ref = MediaRef(f"messages[{i}].content[{j}]", "video", part.video_url.url)
                else:
                    continue
                if not self.vision:
                    raise bad_request(f"{ref.param}: the model `{self.model_names[0]}` has no vision tower; it takes "
                                      "text only", param=ref.param, code="media_not_supported")
                if ref.kind == "video" and not self.media_processor.supports_video:
                    raise bad_request(f"{ref.param}: the model `{self.model_names[0]}` takes images but no video",
                                      param=ref.param, code="media_not_supported")
                counts[ref.kind] += 1
                limit = self.media_limits.get(ref.kind)
                if limit is not None and counts[ref.kind] > limit:
                    raise bad_request(f"{ref.param}: at most {limit} {ref.kind}(s) per request on this server "
                                      "(--limit-mm-per-prompt)", param=ref.param, code="too_many_media")
                refs.append(ref)
        return refs

    async def media_prompt_ids(self, token_ids: list[int], refs: list[MediaRef]) -> list[int]:
        """The prompt's token ids as the engine runs them: its media loaded as for a chat and each placeholder
        widened to its item's tokens; what /tokenize and count_tokens count."""
        if not refs:
            return token_ids
        prompt = {"prompt_token_ids": token_ids, "multi_modal_data": await self._media_data(refs)}
        try:
            ids, _ = await self.engine.expand_prompt(prompt)
        except ValueError as exc:
            raise bad_request(str(exc), param="messages", code="invalid_media") from exc
        return ids

    async def _media_data(self, refs: list[MediaRef]) -> dict[str, list[Any]]:
        """vLLM's multi_modal_data for the parts: each kind's items in prompt order."""
        data: dict[str, list[Any]] = {}
        for ref, item in zip(refs, await self._load_media(refs), strict=True):
            data.setdefault(ref.kind, []).append(item)
        return data

    async def _load_media(self, refs: list[MediaRef]) -> list[Any]:
        """Every item preprocessed, within the request's media deadline: http(s) fetches start at once and run on the
        event loop (no thread waits on a slow host); then, in prompt order, each item is decoded and preprocessed on
        the engine's media pool, one at a time, so the request holds one full-size decode at most. The first bad
        item (in prompt order) is a 400 naming its part."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.media_timeout
        fetches = [loop.create_task(self.media_loader.afetch(ref.url)) if is_remote(ref.url) else None
                   for ref in refs]
        items: list[Any] = []
        try:
            async with asyncio.timeout(self.media_timeout):
                for ref, fetch in zip(refs, fetches, strict=True):
                    try:
                        source = await fetch if fetch is not None else ref.url
                        items.append(await self.engine.run_media(self._preprocess, source, ref.kind, deadline))
                    except ValueError as exc:
                        raise bad_request(f"{ref.param}: {exc}", param=ref.param, code="invalid_media") from exc
        except TimeoutError as exc:
            late = refs[min(len(items), len(refs) - 1)]
            raise bad_request(f"{late.param}: loading the request's media took longer than {self.media_timeout:g} s",
                              param=late.param, code="media_timeout") from exc
        finally:
            for fetch in fetches:
                if fetch is None:
                    continue
                if fetch.done() and not fetch.cancelled():
                    fetch.exception()  # retrieved: a fetch failed after an earlier part's error is not logged
                fetch.cancel()
        return items

    def _preprocess(self, source: str | Fetched, kind: str, deadline: float) -> Any:
        """Decode an item and cut it into the model's patches (on the media pool): the full-size pixels live only
        here."""
        decoded = self.media_loader.decode(source, kind, deadline)
        if kind == "image":
            return self.media_processor.preprocess_image(decoded)
        return self.media_processor.preprocess_video(decoded)

    def _check_tools(self, req: ChatCompletionRequest) -> bool:
        """Whether the prompt offers the tools and calls are parsed into `tool_calls` for this request."""
        choice = req.tool_choice
        if not req.tools:
            if choice == "required" or isinstance(choice, NamedToolChoice):
                raise bad_request("tool_choice needs tools", param="tool_choice")
            return False
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in req.tools}:
            raise bad_request(f"tool_choice names `{choice.function.name}`, which is not among the tools",
                              param="tool_choice")
        if choice != "none" and self.tool_parser is None:
            raise bad_request("this server has no tool-call parser; start it with --tool-call-parser",
                              param="tools")
        return choice != "none"

    # ---- completions ------------------------------------------------------------------------------------

    def prepare_completion(self, req: CompletionRequest) -> Prepared:
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported", param="echo")
        prompts = self._completion_prompts(req.prompt)
        longest = max(len(p) for p in prompts)
        max_tokens = self._max_tokens(req.max_tokens, longest, "max_tokens", "prompt")
        constraint = self._answer_constraint(req)
        params = self._sampling_params(req, max_tokens=max_tokens, max_tokens_param="max_tokens",
                                       logprobs=req.logprobs, logprobs_param="logprobs",
                                       skip_special_tokens=req.skip_special_tokens, thinking_token_budget=None,
                                       constraint=constraint)
        return Prepared([_salted(p, req.cache_salt) for p in prompts], params, lambda: None, "completion",
                        _constraint_error_param(constraint, param_of))

    def _completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            items: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]  # type: ignore[list-item]
        else:
            items = list(prompt)  # type: ignore[arg-type]
        if not items:
            raise bad_request("prompt must not be empty", param="prompt")
        out = []
        for item in items:
            if isinstance(item, str):
                if self.tokenizer is None:
                    raise bad_request("this model has no tokenizer; send token ids", param="prompt")
                ids = self.tokenizer.encode(item, add_special_tokens=True)
            else:
                ids = list(item)
                if any(t < 0 or t >= self.vocab_size for t in ids):
                    raise bad_request(f"token ids must be in [0, {self.vocab_size})", param="prompt")
            if not ids:
                raise bad_request("prompt must not be empty", param="prompt")
            out.append(ids)
        return out

    # ---- helpers ----------------------------------------------------------------------------------------

    def _marker_ids(self) -> tuple[set[int], int | None]:
        """Token ids that end the thinking when they are single tokens: `</think>` and the tool-call openers."""
        if self.tokenizer is None or self.reasoning_parser is None:
            return set(), None
        fmt = REASONING_FORMATS[self.reasoning_parser]
        openers = TOOL_PARSERS[self.tool_parser].start_markers if self.tool_parser else ()
        ids = {m: _single_token_id(self.tokenizer, m) for m in (fmt.end, *fmt.implicit_ends, *openers)}
        return {i for i in ids.values() if i is not None}, ids[fmt.end]

    def _call_markers(self) -> dict[str, int]:
        """The tool-call format's markers that are single tokens, by id: a constrained call writes them as such."""
        if self.tokenizer is None or self.tool_parser not in TOOL_PARSERS:
            return {}
        ids = {m: _single_token_id(self.tokenizer, m) for m in TOOL_PARSERS[self.tool_parser].call_markers()}
        return {m: i for m, i in ids.items() if i is not None}

    def reasoning_tokens(self, parser: ReasoningParser | None, token_ids: list[int], reasoning: str) -> int:
        """Generated tokens inside the thinking, `</think>` included: by token id where the markers are single
        tokens, else by re-encoding the thinking text (`reasoning`)."""
        if parser is None or not parser.had_reasoning:
            return 0
        if parser.in_reasoning:
            return len(token_ids)
        for position, token in enumerate(token_ids):
            if token in self._reasoning_end_ids:
                return position + (1 if token == self._think_end_id else 0)
        return len(self.tokenizer.encode(reasoning, add_special_tokens=False))

    def token_text(self, token_id: int, logprob: Logprob | None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)


def _single_token_id(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _special_token_strings(tokenizer: Any) -> tuple[str, ...]:
    """Every special token's text, kept out of the answer and the thinking when we decode with special tokens."""
    if tokenizer is None:
        return ()
    specials = set(tokenizer.all_special_tokens)
    specials.update(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
    return tuple(sorted(specials))


def check_tool_results(messages: Sequence[ChatMessage]) -> None:
    """Every `tool` message answers a call of the assistant message its run of tool messages follows, as OpenAI
    requires (a 400 otherwise, naming `messages[i].role` or `messages[i].tool_call_id`). A tool message without a
    `tool_call_id` is matched by position, as templates render it."""
    calls: set[str | None] | None = None  # the ids the current run of tool messages may answer
    for i, message in enumerate(messages):
        if message.role == "assistant":
            calls = {call.id for call in message.tool_calls} if message.tool_calls else None
        elif message.role != "tool":
            calls = None
        elif calls is None:
            raise bad_request(f"messages[{i}].role: a 'tool' message must answer a preceding assistant message with "
                              "'tool_calls'", param=f"messages[{i}].role", code="invalid_value")
        elif message.tool_call_id is not None and message.tool_call_id not in calls:
            raise bad_request(f"messages[{i}].tool_call_id: {message.tool_call_id[:100]!r} answers none of the "
                              "tool_calls of the preceding assistant message", param=f"messages[{i}].tool_call_id",
                              code="invalid_value")
