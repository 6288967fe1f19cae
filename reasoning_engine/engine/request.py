"""One sequence being generated: its tokens, KV blocks, decoding state and text."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from reasoning_engine.layers.sampler import stream_seed
from reasoning_engine.multimodal.inputs import MediaItem
from reasoning_engine.outputs import Logprob, RequestMetrics
from reasoning_engine.sampling_params import SamplingParams
from reasoning_engine.speculative.draft import Draft
from reasoning_engine.structured.matcher import StructuredMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """A single sequence. A prompt with n > 1 becomes n Requests sharing `group_id`; sample i has `index` i."""

    seq_id: str
    group_id: str
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.monotonic)
    queue_key: tuple[float, int] = (0.0, 0)  # the waiting queue's order, set by the scheduler (arrival, then added)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # per KV cache group (engine/kv_cache.py), its block ids by block index; a sliding group's blocks that fell
    # out of its window are the null block
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache keys of the full blocks seen so far
    state_slot: int | None = None  # linear-attention models: its live state slot while running (engine/state_cache.py)
    state_restore: int | None = None  # a prefix hit's state snapshot, copied into the live slot at its next step
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float = 0.0
    stream_seed: int | None = None  # seeded sampling: its draws' random stream (layers/sampler.py stream_seed)
    thinking: bool = False  # inside a <think> section: counts against thinking_token_budget
    thinking_tokens: int = 0
    grammar: StructuredMatcher | None = None  # structured output: constrains every token emitted outside thinking
    bad_word_ids: list[list[int]] = field(default_factory=list)  # bad_words as token sequences (both spacings)
    draft: Draft | None = None  # speculative tokens to verify in the next step
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    capture_logits: bool = False
    captured_logits: torch.Tensor | None = None
    replica: int = 0  # the data-parallel replica whose scheduler and KV cache hold it
    session: str | None = None  # an agent's conversation (adaptive KV retention)
    workload: str = "default"  # its class, for the adaptive engine's statistics
    media: tuple[MediaItem, ...] = ()  # images and video chunks, by their placeholders' offset in the prompt
    cache_salt: str | None = None  # mixed into its prefix-cache keys: only prompts with the same salt share blocks
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob
        if self.params.seed is not None:
            self.stream_seed = stream_seed(self.params.seed, self.index)

    @property
    def block_table(self) -> list[int]:
        """KV cache group 0's blocks (the only group's, for a model with one kind of attention layer)."""
        return self.block_tables[0]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    @property
    def constrained(self) -> bool:
        """The grammar applies to the next token: thinking is free, the constraint starts after `</think>`."""
        return self.grammar is not None and not self.thinking

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1
