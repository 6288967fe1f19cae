"""What a step costs: a linear model of step time learned online from the steps the engine runs.

A step's time is, to first order, a fixed cost (launches, scheduling, sampling) plus terms proportional to the tokens
it computes, the sequences it carries (per-sequence attention and bookkeeping), the context tokens its attention reads,
the query-key pairs its attention scores (a prefill chunk's attention grows with its length times its context), the
draft tokens it verifies, the sequences that verify a draft (each is checked one by one: a cost per sequence, whatever
its draft's length), and whether the step verifies any draft at all (such a step leaves the decode fast path as a
whole: no CUDA graph or compiled decode graph, attention split into a decode part and a draft part, so the first draft
in a batch costs far more than the next: on the bundled model on 2 CPU cores, 32 decodes took 4.9 ms, with one
2-token draft among them 5.9 ms, with 32 such drafts 8.6 ms). The weights differ by model and device, and by how
loaded the machine is, so they are fitted from measurements: a short calibration at start warms the model up, then
every step refines it. Old observations fade (exponential forgetting), so the model follows a drifting machine.

Fit: weighted least squares with non-negative weights (an active-set loop over the features) on decayed sufficient
statistics, so each observation costs O(features^2) and a fit O(features^3).

A linear model fitted to noisy steps (a loaded server's step times vary by a fifth or more) with relative weighting is
biased, differently for different kinds of step (on the bundled model behind the benchmark's server it predicted
small decode batches at half their time). So each prediction is scaled by a correction per kind of step (with a
prefill chunk or not, batch size by power of two): a running mean of measured / predicted time over that kind's
recent steps. Verifying and plain steps share a correction (see `_kind`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

FEATURES = ("step", "query_tokens", "sequences", "context_tokens", "attention_pairs", "draft_tokens", "draft_sequences",
            "verify_step")


@dataclass(frozen=True)
class StepShape:
    """What a step computes, in the cost model's terms."""

    query_tokens: int  # tokens run through the model, draft tokens included
    sequences: int
    context_tokens: int  # tokens of context the step's attention reads (sum of sequence lengths)
    draft_tokens: int = 0
    attention_pairs: int = -1  # query-key pairs scored; -1: as many as a decode step's (context_tokens)
    draft_sequences: int = -1  # sequences verifying a draft; -1: one per draft token, capped at the sequences

    @property
    def pairs(self) -> int:
        return self.context_tokens if self.attention_pairs < 0 else self.attention_pairs

    @property
    def verifying(self) -> int:
        return min(self.draft_tokens, self.sequences) if self.draft_sequences < 0 else self.draft_sequences

    def features(self) -> np.ndarray:
        return np.array([1.0, self.query_tokens, self.sequences, self.context_tokens, self.pairs, self.draft_tokens,
                         self.verifying, 1.0 if self.verifying else 0.0])


CORRECTION_RATE = 0.05  # weight of each new step in its kind's correction (a memory of ~20 steps)
CORRECTION_BOUND = 5.0  # a single step moves its kind's correction as if it were at most 5x off


def _kind(shape: StepShape) -> str:
    """Which correction a step gets: with a prefill chunk or not, its batch size by power of two. Not whether it
    verifies drafts: the chooser compares a step with drafts against the same step without, and separate corrections
    for the two fed on themselves (once drafting was chosen in most steps, the rare plain steps' correction rose to
    1.4-1.8 against 0.9-1.4 for verification, so not drafting looked dearer than drafting)."""
    prefill = shape.query_tokens - shape.draft_tokens > shape.sequences
    return f"p{int(prefill)}b{shape.sequences.bit_length()}"


def chunk_pairs(tokens: int, context: int) -> int:
    """Query-key pairs of a causal chunk of `tokens` after `context` cached tokens."""
    return tokens * context + tokens * (tokens + 1) // 2


class StepCostModel:
    """Predicted seconds per step from observed (shape, seconds) pairs."""

    def __init__(self, decay: float = 0.998, ridge: float = 1e-9) -> None:
        self.decay = decay
        self.ridge = ridge
        n = len(FEATURES)
        self._xtx = np.zeros((n, n))
        self._xty = np.zeros(n)
        self.observations = 0
        self.weights = np.zeros(n)
        self.corrections: dict[str, float] = {}  # per kind of step, measured / linear prediction (running mean)

    @property
    def ready(self) -> bool:
        """Enough observations for predictions worth acting on."""
        return self.observations >= 8

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Fold one measured step in (relative weighting: a 1 ms step counts as much as a 1 s one)."""
        if seconds <= 0:
            return
        x = shape.features()
        linear = float(x @ self.weights)
        surprise = abs(linear - seconds) > 0.25 * seconds  # a kind of step it predicts badly
        if self.ready and linear > 0:
            kind = _kind(shape)
            ratio = min(max(seconds / linear, 1 / CORRECTION_BOUND), CORRECTION_BOUND)
            correction = self.corrections.get(kind, 1.0)
            self.corrections[kind] = correction + CORRECTION_RATE * (ratio - correction)
        scale = 1.0 / seconds
        self._xtx = self.decay * self._xtx + scale * scale * np.outer(x, x)
        self._xty = self.decay * self._xty + scale * scale * x * seconds
        self.observations += 1
        if self.observations <= 64 or self.observations % 16 == 0 or surprise:
            self.weights = self._solve()

    def _solve(self) -> np.ndarray:
        """Non-negative least squares by an active set: drop the most negative weight and solve again."""
        n = len(FEATURES)
        free = list(range(n))
        weights = np.zeros(n)
        scale = np.maximum(np.diag(self._xtx), 1e-30)
        while free:
            a = self._xtx[np.ix_(free, free)] + self.ridge * np.diag(scale[free])
            try:
                solved = np.linalg.solve(a, self._xty[free])
            except np.linalg.LinAlgError:
                solved = np.linalg.lstsq(a, self._xty[free], rcond=None)[0]
            if (solved >= 0).all():
                weights[:] = 0.0
                weights[free] = solved
                return weights
            free.pop(int(np.argmin(solved)))
        return weights

    def predict(self, shape: StepShape) -> float:
        return float(shape.features() @ self.weights) * self.corrections.get(_kind(shape), 1.0)

    def coefficients(self) -> dict[str, float]:
        """Seconds per unit of each feature ("step": the fixed cost)."""
        return dict(zip(FEATURES, (float(w) for w in self.weights)))

    def to_dict(self) -> dict[str, Any]:
        return {"xtx": self._xtx.tolist(), "xty": self._xty.tolist(), "observations": self.observations,
                "corrections": self.corrections}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepCostModel:
        model = cls()
        xtx, xty = np.array(data["xtx"], dtype=float), np.array(data["xty"], dtype=float)
        n = len(FEATURES)
        if xtx.shape != (n, n) or xty.shape != (n,) or not np.isfinite(xtx).all() or not np.isfinite(xty).all():
            raise ValueError("cost model statistics have the wrong shape or are not finite")
        model._xtx, model._xty, model.observations = xtx, xty, int(data["observations"])
        corrections = {str(k): float(v) for k, v in data.get("corrections", {}).items()}
        if not all(1 / CORRECTION_BOUND <= v <= CORRECTION_BOUND for v in corrections.values()):
            raise ValueError("cost model corrections out of range")
        model.corrections = corrections
        model.weights = model._solve()
        return model
