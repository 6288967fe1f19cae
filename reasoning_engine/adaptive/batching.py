"""The step's token budget under latency targets.

Every running request waits for the whole step, so a prefill chunk added to a step of decoding requests is paid in
their inter-token latency. With `target_itl_ms` the budget is the most tokens whose predicted step time stays under the
target (never below `min_chunk`, so a prefill always progresses); with `target_ttft_ms` a waiting request whose first
token is at risk raises it again, up to what its prefill needs within the time it has left. Without targets, or before
the cost model has seen enough steps, the budget is the configured maximum (throughput first).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from reasoning_engine.adaptive.cost_model import StepCostModel, StepShape


@dataclass(frozen=True)
class LatencyTargets:
    itl_ms: float | None = None
    ttft_ms: float | None = None


def token_budget(cost: StepCostModel, decodes: StepShape, max_tokens: int, targets: LatencyTargets,
                 oldest_wait_s: float = 0.0, waiting_tokens: int = 0, min_chunk: int = 16) -> int:
    """Tokens the next step may schedule: `decodes` is the running decodes' part of it (one token each plus drafts),
    `oldest_wait_s` how long the oldest waiting request has waited, `waiting_tokens` its prompt tokens left."""
    if not cost.ready or (targets.itl_ms is None and targets.ttft_ms is None):
        return max_tokens
    per_token = cost.coefficients()["query_tokens"] + cost.coefficients()["context_tokens"]
    budget = max_tokens
    if targets.itl_ms is not None and decodes.sequences:
        room = targets.itl_ms / 1e3 - cost.predict(decodes)
        extra = int(room / per_token) if per_token > 0 else max_tokens
        budget = max(decodes.query_tokens + min_chunk, decodes.query_tokens + extra)
    if targets.ttft_ms is not None and waiting_tokens:
        left = targets.ttft_ms / 1e3 - oldest_wait_s
        prefill = replace(decodes, query_tokens=decodes.query_tokens + waiting_tokens,
                          sequences=decodes.sequences + 1, context_tokens=decodes.context_tokens + waiting_tokens)
        if cost.predict(prefill) >= left * 0.5:  # at risk: let it through in as few steps as the budget allows
            budget = max(budget, decodes.query_tokens + waiting_tokens)
    return max(1, min(budget, max_tokens))
