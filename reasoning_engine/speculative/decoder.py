"""The engine's side of speculative decoding: which proposer, how long a draft, and the acceptance statistics.

Draft length adapts per request: it doubles (up to num_speculative_tokens) while whole drafts are accepted and drops
to one more than what was accepted after a rejection. Speculation backs off entirely when the running batch is larger
than `max_batch_size`: verification then costs more than the extra tokens save.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from reasoning_engine.speculative.draft import Draft, Proposer

METHODS = ("ngram", "lookup", "suffix")


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 8
    max_batch_size: int = 16
    state_dir: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        raw = dict(raw)
        method = raw.pop("method", None)
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {method!r}")
        k = raw.pop("num_speculative_tokens", 8)
        if not isinstance(k, int) or not 1 <= k <= 64:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in [1, 64], got {k!r}")
        max_batch = raw.pop("max_batch_size", 16)
        state_dir = raw.pop("state_dir", None)
        return cls(method=method, num_speculative_tokens=k, max_batch_size=max_batch, state_dir=state_dir, options=raw)


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        from reasoning_engine.speculative.ngram import NgramProposer

        return NgramProposer(**config.options)
    if config.method == "lookup":
        from reasoning_engine.speculative.lookup import LookupProposer

        return LookupProposer(**config.options)
    from reasoning_engine.speculative.suffix_tree import SuffixConfig, SuffixProposer

    proposer = SuffixProposer(SuffixConfig(**config.options))
    if config.state_dir:
        proposer.load(config.state_dir)
    return proposer


@dataclass
class SpecStats:
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def as_dict(self, method: str) -> dict[str, Any]:
        steps = max(self.verify_steps, 1)
        return {"method": method, "drafts": self.drafts, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "accepted_per_position": list(self.accepted_per_position),
                "mean_acceptance_length": (self.accepted_tokens + self.verify_steps) / steps if self.verify_steps else 0.0,
                "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0}


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = make_proposer(config)
        self.stats = SpecStats()
        self.draft_len: dict[str, int] = {}

    def start(self, seq_id: str, prompt_token_ids: Sequence[int]) -> None:
        self.proposer.start_request(seq_id, prompt_token_ids)
        self.draft_len[seq_id] = max(1, self.config.num_speculative_tokens // 2)

    def propose(self, seq_id: str, token_ids: Sequence[int], limit: int) -> Draft:
        length = min(self.draft_len.get(seq_id, 1), limit)
        if length <= 0:
            return Draft.empty()
        draft = self.proposer.propose(seq_id, token_ids, length)
        if len(draft):
            self.stats.drafts += 1
            self.stats.draft_tokens += len(draft)
        return draft

    def record(self, seq_id: str, draft: Draft, accepted: list[int], new_tokens: Sequence[int]) -> None:
        """After verification: update statistics, the adaptive length and the proposer's view of the sequence."""
        self.stats.verify_steps += 1
        self.stats.accepted_tokens += len(accepted)
        per_position = self.stats.accepted_per_position
        while len(per_position) < len(accepted):
            per_position.append(0)
        for depth in range(len(accepted)):
            per_position[depth] += 1
        current = self.draft_len.get(seq_id, 1)
        reached_bottom = bool(accepted) and len(accepted) == max(draft.depths())
        grown = min(self.config.num_speculative_tokens, current * 2)
        self.draft_len[seq_id] = grown if reached_bottom else max(1, len(accepted) + 1)
        self.proposer.on_tokens_accepted(seq_id, new_tokens)

    def finish(self, seq_id: str, learn: bool) -> None:
        self.proposer.finish_request(seq_id, learn=learn)
        self.draft_len.pop(seq_id, None)

    def save_state(self) -> None:
        if self.config.state_dir and hasattr(self.proposer, "save"):
            self.proposer.save(self.config.state_dir)
