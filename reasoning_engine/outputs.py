"""What the engine hands back, in vLLM's shape (RequestOutput with one CompletionOutput per sample)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock instants (time.monotonic) of a request's life, for TTFT and latency figures."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None
    spec_accepted_tokens: int = 0
    spec_draft_tokens: int = 0
    # placeholder tokens of the prompt's images and videos (OpenAI usage: prompt_tokens_details.image_tokens)
    num_image_tokens: int = 0
    num_video_tokens: int = 0
    extra: dict = field(default_factory=dict)
