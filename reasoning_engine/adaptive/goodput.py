"""Draft lengths by goodput: the lengths that maximise the batch's expected tokens per second.

Verifying k draft tokens costs their share of the step (the cost model's per-token and per-draft-token terms) and
yields the expected accepted length (acceptance.expected_tokens). At batch 1 a step is mostly fixed cost, so long
drafts are nearly free; at batch 32 every draft token adds to a step that all 32 requests wait for, so only drafts
likely to be accepted pay. The chooser starts every request at no draft and adds one draft token at a time where it
raises the batch's tokens per second the most, until no addition raises it (a greedy ascent: each request's expected
tokens are concave in k when its conditional rates do not rise with the position, and the step time is linear). This only picks lengths: verification keeps the output exact.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

from reasoning_engine.adaptive.acceptance import expected_tokens
from reasoning_engine.adaptive.cost_model import StepCostModel, StepShape


@dataclass(frozen=True)
class DraftCandidate:
    """A decoding request that may get a draft: its conditional acceptance rates and its longest allowed draft."""

    rates: list[float]
    max_length: int


def choose_draft_lengths(candidates: list[DraftCandidate], step: StepShape, cost: StepCostModel) -> list[int]:
    """Draft length per candidate; `step` is the next step without drafts (the candidates' one token each and any
    other work in it). Every addition costs the same step time, so the best one is the largest marginal gain: a
    heap of those makes the ascent O(B k log B)."""
    lengths = [0] * len(candidates)
    tokens = float(len(candidates))  # expected_tokens(rates, 0) == 1 for every candidate
    heap = [(-_marginal(c, 0), i) for i, c in enumerate(candidates) if c.max_length > 0]
    heapq.heapify(heap)
    drafts = 0
    best = tokens / _predict(cost, step, drafts)
    while heap:
        negative_gain, i = heap[0]
        trial = (tokens - negative_gain) / _predict(cost, step, drafts + 1)
        if trial <= best:
            return lengths
        heapq.heappop(heap)
        tokens -= negative_gain
        drafts += 1
        best = trial
        lengths[i] += 1
        if lengths[i] < candidates[i].max_length:
            heapq.heappush(heap, (-_marginal(candidates[i], lengths[i]), i))
    return lengths


def _marginal(candidate: DraftCandidate, length: int) -> float:
    """Expected tokens the (length + 1)-th draft token adds."""
    return expected_tokens(candidate.rates, length + 1) - expected_tokens(candidate.rates, length)


def _predict(cost: StepCostModel, step: StepShape, drafts: int) -> float:
    shape = replace(step, query_tokens=step.query_tokens + drafts, draft_tokens=step.draft_tokens + drafts)
    return max(cost.predict(shape), 1e-9)
