"""Chat and completion requests against the engine: validation, sampling settings, the engine request's life
(submitted, streamed, aborted whatever happens to the client), and the OpenAI response shapes.

Streaming and non-streaming share one loop over the engine's cumulative outputs; the non-streaming path simply
gathers the pieces the streaming path would send, so both report the same text, calls and usage.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from reasoning_engine.engine.async_engine import EngineDeadError
from reasoning_engine.engine.engine import PromptType
from reasoning_engine.multimodal.chat import extract_media
from reasoning_engine.multimodal.loading import Fetched, MediaLoader, is_remote
from reasoning_engine.outputs import CompletionOutput, Logprob, RequestOutput
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
from reasoning_engine.server.errors import APIError, bad_request, error_body
from reasoning_engine.server.formats.registry import CALL_SYNTAXES, REASONING_FORMATS, TOOL_PARSERS
from reasoning_engine.server.metrics import RequestTimer, ServerMetrics
from reasoning_engine.server.parsing import (
    ChatOutputParser,
    ParsedDelta,
    answer_drop,
    build_output_parser,
)
from reasoning_engine.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ImagePart,
    NamedToolChoice,
    ResponseFormat,
    VideoPart,
)
from reasoning_engine.server.reasoning_parsers import initial_mode
from reasoning_engine.server.token_bytes import TokenBytes
from reasoning_engine.server.tool_grammar import ToolSchemaError, answer_tag, bad_tool_schema, tool_call_tag
from reasoning_engine.structured.params import StructuredOutputsParams

T = TypeVar("T")
logger = logging.getLogger(__name__)
_MIN_LOGPROB = -9999.0  # JSON has no -inf
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "min_tokens")
# vLLM's older top-level spellings of structured_outputs' fields
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


async def shielded(awaitable: Awaitable[Any]) -> None:
    """Run cleanup to completion even while the calling task is being cancelled (a client that left, a
    graceful-shutdown timeout): anyio's shield covers Starlette's cancel scopes, asyncio.shield a bare cancel."""
    with anyio.CancelScope(shield=True):
        await asyncio.shield(awaitable)


class ClientGone(Exception):
    """The client disconnected before a non-streaming response was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (so its cleanup aborts the engine request) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled() or not task.done():
        raise ClientGone()
    return task.result()


class EngineStreamResponse(StreamingResponse):
    """A streaming response whose `on_close` runs however the stream ends: finished, client gone, or cancelled."""

    def __init__(self, content: AsyncGenerator[str, None], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await shielded(self._close())

    async def _close(self) -> None:
        await self.body_iterator.aclose()  # type: ignore[attr-defined]
        await self._on_close()


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _param_of(message: str) -> str | None:
    """SamplingParams and the engine start their ValueError messages with the field at fault."""
    word = message.split(" ", 1)[0].strip(":,")
    return word if word.isidentifier() else None


class EngineRequests:
    """The engine requests behind one HTTP request (one per prompt), merged into one output stream; `close`
    aborts whichever did not finish, which frees their KV blocks."""

    def __init__(self, engine: EngineClient, prompts: Sequence[PromptType], params: SamplingParams, base_id: str,
                 session: str | None = None, workload: str = "default",
                 error_param: Callable[[str], str | None] = _param_of) -> None:
        """`session` and `workload`: for the adaptive engine (KV retention, acceptance by class); `error_param`:
        the request parameter an engine ValueError's message is about."""
        self._engine = engine
        self._error_param = error_param
        self.ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
        self._gens: list[AsyncGenerator[RequestOutput, None]] = [
            engine.generate(p, params, rid, session_id=session, workload=workload)
            for p, rid in zip(prompts, self.ids, strict=True)]
        self._first: list[RequestOutput] = []
        self._finished = [False] * len(prompts)
        self._tasks: list[asyncio.Future[None]] = []

    async def start(self) -> None:
        """Submit every request and wait for its first output, so a request the engine refuses (ValueError) is a
        clean 400 before any byte of a stream is sent."""
        results = await asyncio.gather(*(anext(g) for g in self._gens), return_exceptions=True)
        for result in results:
            if isinstance(result, ValueError):
                raise bad_request(str(result), param=self._error_param(str(result))) from result
            if isinstance(result, EngineDeadError):
                raise APIError(503, f"the engine is not running: {result}", code="engine_unavailable") from result
            if isinstance(result, BaseException):
                raise result
        self._first = results

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self._gens) == 1:
            out: RequestOutput | None = self._first[0]
            while out is not None:
                self._finished[0] = out.finished
                yield 0, out
                out = None if out.finished else await anext(self._gens[0], None)
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                await queue.put((i, self._first[i]))
                if not self._first[i].finished:
                    async for item in self._gens[i]:
                        await queue.put((i, item))
                        if item.finished:
                            break
                await queue.put((i, None))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer, which reports it
                await queue.put((i, exc))

        tasks = self._tasks = [asyncio.ensure_future(pump(i)) for i in range(len(self._gens))]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    self._finished[i] = item.finished
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Stop the merge tasks, close the engine streams and abort what is unfinished; one failure does not stop
        the rest, since every unfinished request holds KV blocks."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for gen, rid, finished in zip(self._gens, self.ids, self._finished, strict=True):
            try:
                if not finished:
                    await self._engine.abort(rid)
                await gen.aclose()
            except Exception:  # cleanup goes on for the other requests
                logger.exception("closing request %s failed", rid)


@dataclass
class Prepared:
    """A validated request ready for the engine: prompts (token ids, with their images and videos for a chat with
    media), sampling settings, a per-choice parser factory, its workload class for the adaptive engine ("agent" with
    tools, "chat", "completion"), and how an engine ValueError maps to the request's parameter."""

    prompts: Sequence[PromptType]
    params: SamplingParams
    new_parser: Callable[[], ChatOutputParser | None]
    workload: str = "default"
    error_param: Callable[[str], str | None] = _param_of


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


def _prompt_ids(prompt: PromptType) -> list[int]:
    """The token ids of a prompt this module built: a list of ids, or a dict holding them beside its media."""
    return prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt  # type: ignore[return-value]


@dataclass
class Choice:
    """One choice's progress through the cumulative outputs."""

    index: int
    parser: ChatOutputParser | None = None
    text_len: int = 0
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    pending_logprobs: list[dict[str, Any]] = field(default_factory=list)
    logprob_text_len: int = 0  # the completion text the logprob tokens so far spell, for `text_offset`

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ChoiceUpdate:
    choice: Choice
    text: str  # raw new text
    parsed: ParsedDelta | None
    finished: bool


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
            param = _param_of(str(exc))
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
                            _constraint_error_param(constraint, _param_of))
        data = await self._media_data(refs)
        aliases = {"max_tokens": max_param, "prompt": "messages", "prompt_token_ids": "messages"}
        prompt = {"prompt_token_ids": rendered.token_ids, "multi_modal_data": data}
        return Prepared([_salted(prompt, req.cache_salt)], params, new_parser, workload, _constraint_error_param(
            constraint, lambda message: aliases.get(_param_of(message) or "", refs[0].param)))

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

    async def chat_stream(self, req: ChatCompletionRequest, model: str, prepared: Prepared,
                          engine_requests: EngineRequests, arrival: float) -> AsyncGenerator[str, None]:
        run = ChatRun(self, engine_requests, prepared, arrival)
        base = {"id": engine_requests.ids[0], "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        top_n = req.top_logprobs or 0

        def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: list | None = None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": {"content": logprobs} if logprobs else None,
                      "finish_reason": finish}
            return sse({**base, "choices": [choice]})

        for i in range(len(run.choices)):
            yield chunk(i, {"role": "assistant", "content": ""})
        try:
            async with aclosing(run.updates(chat_logprobs=req.logprobs, top_n=top_n)) as updates:
                async for update in updates:
                    choice, parsed = update.choice, update.parsed
                    logprobs, choice.pending_logprobs = choice.pending_logprobs, []
                    if parsed is None:
                        parsed = ParsedDelta(content=update.text)
                    if parsed.reasoning:
                        yield chunk(choice.index, {"reasoning_content": parsed.reasoning}, logprobs=logprobs)
                        logprobs = []
                    answer: dict[str, Any] = {}
                    if parsed.content:
                        answer["content"] = parsed.content
                    if parsed.tool_calls:
                        answer["tool_calls"] = _tool_call_deltas(parsed.tool_calls)
                    if answer or (logprobs and not update.finished):
                        yield chunk(choice.index, answer, logprobs=logprobs)
                        logprobs = []
                    if update.finished:
                        yield chunk(choice.index, {}, self.finish_reason(choice), logprobs=logprobs)
            if include_usage:
                yield sse({**base, "choices": [], "usage": run.usage()})
        except APIError as exc:
            yield sse(exc.body())
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band, never hang the client
            yield sse(error_body(f"generation failed: {exc}", "server_error"))
        yield SSE_DONE

    async def chat_full(self, req: ChatCompletionRequest, model: str, prepared: Prepared,
                        engine_requests: EngineRequests, arrival: float) -> dict[str, Any]:
        run = ChatRun(self, engine_requests, prepared, arrival)
        async with aclosing(run.updates(chat_logprobs=req.logprobs, top_n=req.top_logprobs or 0)) as updates:
            async for update in updates:
                choice, parsed = update.choice, update.parsed
                if parsed is None:
                    choice.content.append(update.text)
        choices = []
        for choice in run.choices:
            calls = choice.parser.tool_calls if choice.parser else []
            content = "".join(choice.content)
            message: dict[str, Any] = {
                "role": "assistant",
                "content": content if content or not calls else None,
                "reasoning_content": "".join(choice.reasoning) or None,
            }
            if calls:
                message["tool_calls"] = [{"id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            choices.append({"index": choice.index, "message": message,
                            "logprobs": {"content": choice.logprobs} if req.logprobs else None,
                            "finish_reason": self.finish_reason(choice), "stop_reason": choice.stop_reason})
        return {"id": engine_requests.ids[0], "object": "chat.completion", "created": int(time.time()),
                "model": model, "choices": choices, "usage": run.usage()}

    def finish_reason(self, choice: Choice) -> str | None:
        if choice.parser is not None and choice.parser.tool_calls and choice.finish_reason == "stop":
            return "tool_calls"
        return choice.finish_reason

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
                        _constraint_error_param(constraint, _param_of))

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

    async def completion_stream(self, req: CompletionRequest, model: str, prepared: Prepared,
                                engine_requests: EngineRequests, arrival: float) -> AsyncGenerator[str, None]:
        run = ChatRun(self, engine_requests, prepared, arrival)
        base = {"id": engine_requests.ids[0], "object": "text_completion", "created": int(time.time()),
                "model": model}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        try:
            if req.echo:
                for choice in run.choices:
                    yield sse({**base, "choices": [{"index": choice.index, "text": run.prompt_text(choice),
                                                    "logprobs": None, "finish_reason": None}]})
            async with aclosing(run.updates(completion_logprobs=req.logprobs)) as updates:
                async for update in updates:
                    choice = update.choice
                    logprobs, choice.pending_logprobs = choice.pending_logprobs, []
                    if update.text or logprobs or update.finished:
                        yield sse({**base, "choices": [{
                            "index": choice.index, "text": update.text,
                            "logprobs": _legacy_logprobs(logprobs) if req.logprobs is not None else None,
                            "finish_reason": choice.finish_reason if update.finished else None,
                            "stop_reason": choice.stop_reason if update.finished else None}]})
            if include_usage:
                yield sse({**base, "choices": [], "usage": run.usage()})
        except APIError as exc:
            yield sse(exc.body())
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band, never hang the client
            yield sse(error_body(f"generation failed: {exc}", "server_error"))
        yield SSE_DONE

    async def completion_full(self, req: CompletionRequest, model: str, prepared: Prepared,
                              engine_requests: EngineRequests, arrival: float) -> dict[str, Any]:
        run = ChatRun(self, engine_requests, prepared, arrival)
        async with aclosing(run.updates(completion_logprobs=req.logprobs)) as updates:
            async for _ in updates:
                pass
        choices = [{"index": c.index, "text": (run.prompt_text(c) if req.echo else "") + "".join(c.text),
                    "logprobs": _legacy_logprobs(c.logprobs) if req.logprobs is not None else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in run.choices]
        return {"id": engine_requests.ids[0], "object": "text_completion", "created": int(time.time()),
                "model": model, "choices": choices, "usage": run.usage()}

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

    def reasoning_tokens(self, choice: Choice) -> int:
        """Generated tokens inside the thinking, `</think>` included; by token id where the markers are single
        tokens, else by re-encoding the thinking text."""
        parser = choice.parser.reasoning if choice.parser else None
        if parser is None or not parser.had_reasoning:
            return 0
        if parser.in_reasoning:
            return len(choice.token_ids)
        for position, token in enumerate(choice.token_ids):
            if token in self._reasoning_end_ids:
                return position + (1 if token == self._think_end_id else 0)
        return len(self.tokenizer.encode("".join(choice.reasoning), add_special_tokens=False))

    def token_text(self, token_id: int, logprob: Logprob | None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)


class ChatRun:
    """One HTTP request's walk over its engine outputs: per-choice deltas, parsing, logprobs, timing, usage."""

    def __init__(self, serving: OpenAIServing, engine_requests: EngineRequests, prepared: Prepared,
                 arrival: float) -> None:
        self.serving = serving
        self.engine_requests = engine_requests
        self.prompts = prepared.prompts
        self.n = prepared.params.n
        self.choices = [Choice(index=i, parser=prepared.new_parser()) for i in range(len(self.prompts) * self.n)]
        self.timer = RequestTimer(serving.metrics, arrival)
        self.cached_tokens: dict[int, int] = {}  # per prompt
        # per prompt, updated from the engine: a media placeholder counts as its whole run of tokens
        self.prompt_tokens = [len(_prompt_ids(p)) for p in self.prompts]
        self.image_tokens: dict[int, int] = {}  # per prompt
        self.video_tokens: dict[int, int] = {}

    def prompt_text(self, choice: Choice) -> str:
        prompt = _prompt_ids(self.prompts[choice.index // self.n])
        return self.serving.tokenizer.decode(prompt) if self.serving.tokenizer is not None else ""

    async def updates(self, *, chat_logprobs: bool = False, top_n: int = 0,
                      completion_logprobs: int | None = None) -> AsyncIterator[ChoiceUpdate]:
        """Per choice and engine step: the new raw text and its parsed pieces; `finished` on the choice's last."""
        finished_ok = False
        try:
            async for prompt_index, out in self.engine_requests.outputs():
                now = time.monotonic()
                self.cached_tokens[prompt_index] = out.num_cached_tokens
                self.prompt_tokens[prompt_index] = len(out.prompt_token_ids)
                self.image_tokens[prompt_index] = out.num_image_tokens
                self.video_tokens[prompt_index] = out.num_video_tokens
                new_tokens = 0
                for completion in out.outputs:
                    choice = self.choices[prompt_index * self.n + completion.index]
                    if choice.done:
                        continue
                    update, count = self._advance(choice, completion, chat_logprobs, top_n, completion_logprobs)
                    new_tokens += count
                    parsed = update.parsed
                    if (parsed.content or parsed.tool_calls) if parsed is not None else update.text:
                        self.timer.answer(now)
                    yield update
                self.timer.tokens(now, new_tokens)
            finished_ok = True
        except EngineDeadError as exc:
            raise APIError(503, f"the engine stopped: {exc}", code="engine_unavailable") from exc
        finally:
            self._record(finished_ok)

    def _advance(self, choice: Choice, completion: CompletionOutput, chat_logprobs: bool, top_n: int,
                 completion_logprobs: int | None) -> tuple[ChoiceUpdate, int]:
        new_text = completion.text[choice.text_len:] if len(completion.text) > choice.text_len else ""
        choice.text_len = max(choice.text_len, len(completion.text))
        start = len(choice.token_ids)
        new_ids = list(completion.token_ids[start:])
        choice.token_ids.extend(new_ids)
        choice.text.append(new_text)
        if completion.logprobs is not None and (chat_logprobs or completion_logprobs is not None):
            for offset, token in enumerate(new_ids):
                entries = completion.logprobs[start + offset] if start + offset < len(completion.logprobs) else {}
                if chat_logprobs:
                    entry = self._chat_logprob(token, entries, top_n)
                else:
                    entry = self._completion_logprob(choice, token, entries)
                choice.logprobs.append(entry)
                choice.pending_logprobs.append(entry)
        finished = completion.finish_reason is not None
        parsed = None
        if choice.parser is not None:
            parsed = choice.parser.feed(new_text)
            if finished:
                tail = choice.parser.finish()
                parsed = ParsedDelta(parsed.reasoning + tail.reasoning, parsed.content + tail.content,
                                     parsed.tool_calls + tail.tool_calls)
            choice.reasoning.append(parsed.reasoning)
            choice.content.append(parsed.content)
        if finished:
            choice.finish_reason, choice.stop_reason = completion.finish_reason, completion.stop_reason
        return ChoiceUpdate(choice, new_text, parsed, finished), len(new_ids)

    def _chat_logprob(self, token: int, entries: dict[int, Logprob], top_n: int) -> dict[str, Any]:
        text = self.serving.token_text(token, entries.get(token))
        chosen = entries.get(token)
        top = sorted(entries.items(), key=lambda kv: kv[1].logprob, reverse=True)[:top_n]
        return {"token": text, "logprob": _finite(chosen.logprob if chosen else None),
                "bytes": self.serving.token_bytes(token, text),
                "top_logprobs": [{"token": (t := self.serving.token_text(tid, lp)), "logprob": _finite(lp.logprob),
                                  "bytes": self.serving.token_bytes(tid, t)} for tid, lp in top]}

    def _completion_logprob(self, choice: Choice, token: int, entries: dict[int, Logprob]) -> dict[str, Any]:
        """One token's entry; its offset counts from the start of the whole completion, so streamed chunks go on
        where the previous one stopped."""
        chosen = entries.get(token)
        text = self.serving.token_text(token, chosen)
        offset, choice.logprob_text_len = choice.logprob_text_len, choice.logprob_text_len + len(text)
        return {"token": text, "logprob": _finite(chosen.logprob if chosen else None),
                "top": {self.serving.token_text(tid, lp): _finite(lp.logprob) for tid, lp in entries.items()},
                "text_offset": offset}

    def usage(self) -> dict[str, Any]:
        prompt = sum(self.prompt_tokens)
        completion = sum(len(c.token_ids) for c in self.choices)
        details = {"cached_tokens": sum(self.cached_tokens.values())}
        for name, per_prompt in (("image_tokens", self.image_tokens), ("video_tokens", self.video_tokens)):
            if sum(per_prompt.values()):  # only for requests with media: a text request's usage is as it always was
                details[name] = sum(per_prompt.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": details,
                "completion_tokens_details": {"reasoning_tokens": sum(self.serving.reasoning_tokens(c)
                                                                      for c in self.choices)}}

    def _record(self, finished_ok: bool) -> None:
        reasons = [(self.serving.finish_reason(c) or "abort") if finished_ok or c.done else "abort"
                   for c in self.choices]
        self.timer.finish(time.monotonic(), sum(self.prompt_tokens),
                          sum(len(c.token_ids) for c in self.choices),
                          sum(self.serving.reasoning_tokens(c) for c in self.choices), reasons)


def _finite(logprob: float | None) -> float:
    return _MIN_LOGPROB if logprob is None or logprob != logprob else max(float(logprob), _MIN_LOGPROB)


def _legacy_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The completions API's column layout: tokens, token_logprobs, top_logprobs, text_offset."""
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [e["top"] for e in entries], "text_offset": [e["text_offset"] for e in entries]}


def _tool_call_deltas(deltas: list[Any]) -> list[dict[str, Any]]:
    """Parser deltas -> OpenAI's streamed `tool_calls`: the opening piece with id/type/name, then argument text;
    consecutive fragments of one call are merged."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if d.id is None and out and out[-1]["index"] == d.index:
            out[-1]["function"]["arguments"] += d.arguments
        elif d.id is not None:
            out.append({"index": d.index, "id": d.id, "type": "function",
                        "function": {"name": d.name, "arguments": d.arguments}})
        else:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out


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


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
