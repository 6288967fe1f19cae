"""Draft lengths by goodput: the lengths that maximise the batch's expected tokens per second.

Verifying a draft costs its share of the step (the cost model's per-token, per-draft-token and per-verifying-sequence
terms) and yields the expected accepted length (the sum over its positions of the probability that the draft is
accepted up to there). At batch 1 a step is mostly fixed cost,
so long drafts are nearly free; at batch 32 every draft token adds to a step that all 32 requests wait for, and every
verifying sequence adds its fixed verification cost, so only drafts likely to be accepted pay. Because of that fixed
cost per verifying sequence, a request's value is not concave in its length (its first draft token is the dearest),
and a greedy token-by-token ascent would stop too early. The chooser instead scans a threshold on the probability
that the whole prefix is accepted: at threshold t each request drafts the positions whose cumulative acceptance
prod_{j<=i} p_j is at least t (the drafts a stopping rule would make, as in SpecDec++, Huang et al., 2024,
arXiv:2405.19715), and the threshold with the highest predicted tokens per second wins, "no drafts" included and
preferred unless beaten by DRAFT_MARGIN. This only picks lengths: verification keeps the output exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reasoning_engine.adaptive.cost_model import StepCostModel, StepShape

THRESHOLDS = (0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05)
# Drafts must beat no drafts by this much. Choosing the best of predictions that err picks the options whose errors
# flatter them (the optimizer's curse, Smith and Winkler, Management Science 52(3), 2006); drafts predicted only a
# little faster than none delivered less than plain steps (docs/measurements.md).
DRAFT_MARGIN = 0.05


@dataclass(frozen=True)
class DraftCandidate:
    """A decoding request that may get a draft: its conditional acceptance rates, its longest allowed draft and its
    context length (what each of its draft tokens' attention reads)."""

    rates: list[float]
    max_length: int
    context: int = 0


def choose_draft_lengths(candidates: list[DraftCandidate], step: StepShape, cost: StepCostModel,
                         other_seconds: float = 0.0) -> list[int]:
    """Draft length per candidate; `step` is the next step without drafts (the candidates' one token each and any
    other work in it), `other_seconds` the predicted time of that other work (a prefill chunk). The decodes' tokens
    are weighed against the step's time less that work: the chunk must be computed anyway, and counted in, its time
    would lower the bar a draft must clear to the decodes' rate diluted by it, so nearly any draft would look worth
    verifying. The thresholds are scanned as one array computation: the chooser runs every step, for every decoding
    request."""
    if not candidates:
        return []
    survival = _survival_matrix(candidates)  # (requests, positions)
    kept = survival[None, :, :] >= np.array(THRESHOLDS)[:, None, None]  # (thresholds, requests, positions)
    lengths = np.concatenate([np.zeros((1, len(candidates)), dtype=np.int64), kept.sum(axis=2)])  # option 0: none
    tokens = len(candidates) + np.concatenate([[0.0], (survival[None] * kept).sum(axis=(1, 2))])
    seconds = np.maximum(_predict(cost, step, candidates, lengths) - other_seconds, 1e-9)
    rates = tokens / seconds
    rates[0] *= 1 + DRAFT_MARGIN
    best = int(np.argmax(rates))  # the first of equals: no drafts, then the highest threshold
    return [int(n) for n in lengths[best]]


def expected_accepted(candidate: DraftCandidate, length: int) -> float:
    """Draft tokens a draft of `length` is expected to get accepted (the sum of its prefixes' probabilities)."""
    return float(_survival_matrix([candidate])[0, :length].sum())


def _survival_matrix(candidates: list[DraftCandidate]) -> np.ndarray:
    """Per candidate, the probability that draft positions 1..i are all accepted, for each i up to its longest draft
    (zero beyond it)."""
    width = max((min(len(c.rates), c.max_length) for c in candidates), default=0)
    rates = np.zeros((len(candidates), width))
    for i, c in enumerate(candidates):
        n = min(len(c.rates), c.max_length)
        rates[i, :n] = c.rates[:n]
    return np.cumprod(rates, axis=1)


def _predict(cost: StepCostModel, step: StepShape, candidates: list[DraftCandidate], lengths: np.ndarray) -> np.ndarray:
    """Predicted seconds of `step` with each row of `lengths` (one draft length per candidate) verified."""
    contexts = np.array([c.context for c in candidates], dtype=float)
    return cost.predict_with_drafts(step, lengths.sum(axis=1), (lengths > 0).sum(axis=1), lengths @ contexts)


def predicted_step_seconds(cost: StepCostModel, step: StepShape, candidates: list[DraftCandidate],
                           lengths: list[int]) -> float:
    """The cost model's time for `step` with each candidate verifying a draft of its length."""
    return float(_predict(cost, step, candidates, np.array([lengths], dtype=np.int64).reshape(1, len(candidates)))[0])
