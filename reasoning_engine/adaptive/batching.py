"""The step's token budget under latency targets.

Every running request waits for the whole step, so a prefill chunk added to a step of decoding requests is paid in
their inter-token latency. With `target_itl_ms` the budget is the most tokens whose predicted step time stays under 80% of
the target (never below `min_chunk`, so a prefill always progresses); with `target_ttft_ms` a waiting request whose first
token is at risk raises it again, up to what its prefill needs within the time it has left. Without targets, or before
the cost model has seen enough steps, the budget is the configured maximum (throughput first).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from reasoning_engine.adaptive.cost_model import StepCostModel, StepShape, chunk_pairs

MARGIN = 0.8  # aim below the target: the step also streams its tokens, and predictions err


@dataclass(frozen=True)
class LatencyTargets:
    itl_ms: float | None = None
    ttft_ms: float | None = None


def token_budget(cost: StepCostModel, decodes: StepShape, max_tokens: int, targets: LatencyTargets,
                 oldest_wait_s: float = 0.0, waiting_tokens: int = 0, prefill_context: int = 0,
                 min_chunk: int = 16) -> int:
    """Tokens the next step may schedule: `decodes` is the running decodes' part of it (one token each plus drafts),
    `waiting_tokens` the prompt tokens left of the next prefill, `prefill_context` what of it is already cached,
    `oldest_wait_s` how long the oldest waiting request has waited."""
    if not cost.ready or (targets.itl_ms is None and targets.ttft_ms is None):
        return max_tokens
    budget = max_tokens
    if targets.itl_ms is not None and decodes.sequences:
        seconds = MARGIN * targets.itl_ms / 1e3
        chunk = _largest_chunk(cost, decodes, prefill_context, max_tokens - decodes.query_tokens, seconds)
        budget = decodes.query_tokens + max(min_chunk, chunk)
    if targets.ttft_ms is not None and waiting_tokens:
        left = targets.ttft_ms / 1e3 - oldest_wait_s
        if cost.predict(_with_chunk(decodes, waiting_tokens, prefill_context)) >= left * 0.5:
            budget = max(budget, decodes.query_tokens + waiting_tokens)  # at risk: through in as few steps as allowed
    return max(1, min(budget, max_tokens))


def _with_chunk(decodes: StepShape, tokens: int, context: int) -> StepShape:
    """The decodes' step plus a prefill chunk of `tokens` after `context` cached tokens."""
    return replace(decodes, query_tokens=decodes.query_tokens + tokens, sequences=decodes.sequences + 1,
                   context_tokens=decodes.context_tokens + context + tokens,
                   attention_pairs=decodes.pairs + chunk_pairs(tokens, context))


def _largest_chunk(cost: StepCostModel, decodes: StepShape, context: int, most: int, seconds: float) -> int:
    """The longest chunk whose step is predicted within `seconds` (binary search: the time grows with the chunk)."""
    low, high = 0, max(0, most)
    while low < high:
        mid = (low + high + 1) // 2
        if cost.predict(_with_chunk(decodes, mid, context)) <= seconds:
            low = mid
        else:
            high = mid - 1
    return low
