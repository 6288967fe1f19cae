"""One HTTP request's walk over its engine outputs, shared by every API: per choice, the new text, its parsed
thinking / answer / call pieces, logprobs, timing and usage. Streaming and non-streaming share this one loop; the
non-streaming answer gathers the pieces the stream would send, so both report the same text, calls and usage.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reasoning_engine.engine.async_engine import EngineDeadError
from reasoning_engine.engine.engine import PromptType
from reasoning_engine.outputs import CompletionOutput, Logprob
from reasoning_engine.server.engine_requests import EngineRequests
from reasoning_engine.server.errors import APIError
from reasoning_engine.server.metrics import RequestTimer
from reasoning_engine.server.parsing import ChatOutputParser, ParsedDelta

if TYPE_CHECKING:
    from reasoning_engine.server.serving import OpenAIServing, Prepared

_MIN_LOGPROB = -9999.0  # JSON has no -inf


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

    @property
    def api_finish_reason(self) -> str | None:
        """The finish reason the APIs report: "tool_calls" where a choice that stopped called tools."""
        if self.parser is not None and self.parser.tool_calls and self.finish_reason == "stop":
            return "tool_calls"
        return self.finish_reason

    def reasoning_tokens(self, serving: OpenAIServing) -> int:
        """Generated tokens inside the thinking (serving.reasoning_tokens)."""
        reasoning = self.parser.reasoning if self.parser else None
        return serving.reasoning_tokens(reasoning, self.token_ids, "".join(self.reasoning))


@dataclass
class ChoiceUpdate:
    choice: Choice
    text: str  # raw new text
    parsed: ParsedDelta | None
    finished: bool


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
                "completion_tokens_details": {"reasoning_tokens": sum(c.reasoning_tokens(self.serving)
                                                                      for c in self.choices)}}

    def _record(self, finished_ok: bool) -> None:
        reasons = [(c.api_finish_reason or "abort") if finished_ok or c.done else "abort"
                   for c in self.choices]
        self.timer.finish(time.monotonic(), sum(self.prompt_tokens),
                          sum(len(c.token_ids) for c in self.choices),
                          sum(c.reasoning_tokens(self.serving) for c in self.choices), reasons)


def _finite(logprob: float | None) -> float:
    return _MIN_LOGPROB if logprob is None or logprob != logprob else max(float(logprob), _MIN_LOGPROB)
