"""The step's token budget under latency targets.

Every running request waits for the whole step, so a prefill chunk added to a step of decoding requests is paid in
their inter-token latency. With `target_itl_ms` the budget is the most tokens whose predicted step time stays under 80% of
the target (never below `min_chunk`, so a prefill always progresses); with `target_ttft_ms` a waiting request whose first
token is at risk raises it again, up to what its prefill needs within the time it has left. Without targets, or before
the cost model has seen enough steps, the budget is the configured maximum (throughput first).

The chunk under `target_itl_ms` is sized by what chunks have cost beyond their step's decodes (`ChunkCost`: a
per-token and a per-attention-pair cost fitted to recent chunk steps, first to calibration's), not by the step cost
model: that model is fitted mostly to decode steps, where query tokens, sequences, context and attention pairs move
together, so it cannot tell them apart and errs most on chunk steps (docs/measurements.md). A latency target is a
tail figure, so the fit's prediction is scaled by a high quantile of its own recent errors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from reasoning_engine.adaptive.cost_model import StepCostModel, StepShape, chunk_pairs

MARGIN = 0.8  # aim below the target: the step also streams its tokens, and predictions err
CHUNK_WINDOW = 32  # chunk steps the chunk cost is fitted to
TAIL_QUANTILE = 0.9
MIN_CHUNK_TOKENS = 32  # shorter chunks' cost is mostly their step's noise


@dataclass(frozen=True)
class LatencyTargets:
    itl_ms: float | None = None
    ttft_ms: float | None = None


class ChunkCost:
    """What prefill chunks cost beyond their step's decodes: seconds = a * tokens + b * attention pairs, fitted to the
    recent steps that carried a chunk, times a high quantile of the fit's own recent errors. The fit is redone when
    read after new steps, not at each chunk step: only latency targets (and the snapshot) read it."""

    def __init__(self) -> None:
        self.steps: deque[tuple[float, float, float]] = deque(maxlen=CHUNK_WINDOW)  # (tokens, pairs, seconds)
        self._fit: tuple[np.ndarray, float] | None = None  # (weights, tail) of the current steps, once read

    @property
    def ready(self) -> bool:
        return bool(self.weights.any())

    @property
    def weights(self) -> np.ndarray:
        return self._fitted()[0]

    @property
    def tail(self) -> float:
        return self._fitted()[1]

    def observe(self, tokens: int, pairs: int, extra_seconds: float) -> None:
        if tokens < MIN_CHUNK_TOKENS or extra_seconds <= 0:
            return
        self.steps.append((float(tokens), float(pairs), extra_seconds))
        self._fit = None

    def _fitted(self) -> tuple[np.ndarray, float]:
        if self._fit is None:
            self._fit = self._refit()
        return self._fit

    def _refit(self) -> tuple[np.ndarray, float]:
        if not self.steps:
            return np.zeros(2), 1.0
        x = np.array([(t, p) for t, p, _ in self.steps]) / np.array([[e] for _, _, e in self.steps])
        fits = [np.linalg.lstsq(x, np.ones(len(x)), rcond=None)[0]]  # relative errors: a short chunk counts as much
        fits += [np.array([1.0 / np.mean(x[:, 0]), 0.0]), np.array([0.0, 1.0 / np.mean(x[:, 1])])]
        fits = [w for w in fits if (w >= 0).all() and np.isfinite(w).all()]
        weights = min(fits, key=lambda w: float(np.sum((x @ w - 1.0) ** 2)))
        ratios = sorted(1.0 / max(float(r), 1e-9) for r in x @ weights)  # measured / fitted
        return weights, max(1.0, ratios[min(len(ratios) - 1, int(TAIL_QUANTILE * len(ratios)))])

    def predict(self, tokens: int, context: int) -> float:
        """Seconds a chunk of `tokens` after `context` cached tokens adds to a step, at the tail of recent errors."""
        return self.tail * float(self.weights @ np.array([tokens, chunk_pairs(tokens, context)]))

    def to_list(self) -> list[list[float]]:
        return [list(step) for step in self.steps]

    def load(self, steps: list[list[float]]) -> None:
        if not all(len(step) == 3 and all(isinstance(v, (int, float)) and 0 <= v < float("inf") for v in step)
                   for step in steps):
            raise ValueError("chunk steps must be [tokens, pairs, seconds] triples of non-negative numbers")
        for tokens, pairs, seconds in steps:
            self.observe(int(tokens), int(pairs), float(seconds))


def token_budget(cost: StepCostModel, decodes: StepShape, max_tokens: int, targets: LatencyTargets,
                 oldest_wait_s: float = 0.0, waiting_tokens: int = 0, prefill_context: int = 0,
                 min_chunk: int = 16, chunk_cost: ChunkCost | None = None) -> int:
    """Tokens the next step may schedule: `decodes` is the running decodes' part of it (one token each plus drafts),
    `waiting_tokens` the prompt tokens left of the next prefill, `prefill_context` what of it is already cached,
    `oldest_wait_s` how long the oldest waiting request has waited, `chunk_cost` what chunks add to a step (until
    it is fitted the cost model sizes the chunk)."""
    if not cost.ready or (targets.itl_ms is None and targets.ttft_ms is None):
        return max_tokens
    budget = max_tokens
    if targets.itl_ms is not None and decodes.sequences:
        seconds = MARGIN * targets.itl_ms / 1e3
        most = max(0, max_tokens - decodes.query_tokens)
        if chunk_cost is not None and chunk_cost.ready:
            left = seconds - cost.predict(decodes)
            chunk = _largest(lambda t: chunk_cost.predict(t, prefill_context) <= left, most)
        else:
            chunk = _largest(lambda t: cost.predict(_with_chunk(decodes, t, prefill_context)) <= seconds, most)
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


def _largest(fits: Callable[[int], bool], most: int) -> int:
    """The largest chunk in [0, most] that `fits` (binary search: a chunk's time grows with its length)."""
    low, high = 0, max(0, most)
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low
