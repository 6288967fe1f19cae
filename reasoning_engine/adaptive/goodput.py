"""Draft lengths by goodput: the lengths that maximise the batch's expected tokens per second.

Verifying a draft costs its share of the step (the cost model's per-token, per-draft-token and per-verifying-sequence
terms) and yields the expected accepted length (acceptance.expected_tokens). At batch 1 a step is mostly fixed cost,
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

from dataclasses import dataclass, replace

from reasoning_engine.adaptive.cost_model import StepCostModel, StepShape

THRESHOLDS = (0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05)
# Drafts must beat no drafts by this much. Choosing the best of predictions that err picks the options whose errors
# flatter them (the optimizer's curse, Smith and Winkler, Management Science 52(3), 2006): in five logged runs of the
# bundled model at 32 requests, the drafted steps predicted under 5% faster than without drafts delivered 0.72-0.87x
# the tokens per second of plain steps, those predicted 5% or more 0.99-1.11x.
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
    lowers the bar a draft must clear to the decodes' rate diluted by it (beside a 1000-token chunk on the bundled
    model, a tenth of their own rate), so nearly any draft looked worth verifying."""
    survival = [_survival(c) for c in candidates]
    best_lengths = [0] * len(candidates)

    def seconds(lengths: list[int]) -> float:
        return max(predicted_step_seconds(cost, step, candidates, lengths) - other_seconds, 1e-9)

    best = (1 + DRAFT_MARGIN) * len(candidates) / seconds(best_lengths)
    for threshold in THRESHOLDS:
        lengths = [sum(1 for s in alive if s >= threshold) for alive in survival]
        tokens = len(candidates) + sum(sum(alive[:n]) for alive, n in zip(survival, lengths))
        rate = tokens / seconds(lengths)
        if rate > best:
            best, best_lengths = rate, lengths
    return best_lengths


def expected_accepted(candidate: DraftCandidate, length: int) -> float:
    """Draft tokens a draft of `length` is expected to get accepted (the sum of its prefixes' probabilities)."""
    return sum(_survival(candidate)[:length])


def _survival(candidate: DraftCandidate) -> list[float]:
    """Probability that draft positions 1..i are all accepted, for each i up to the candidate's longest draft."""
    alive, out = 1.0, []
    for rate in candidate.rates[: candidate.max_length]:
        alive *= rate
        out.append(alive)
    return out


def predicted_step_seconds(cost: StepCostModel, step: StepShape, candidates: list[DraftCandidate],
                           lengths: list[int]) -> float:
    """The cost model's time for `step` with each candidate verifying a draft of its length."""
    drafts = sum(lengths)
    shape = replace(step, query_tokens=step.query_tokens + drafts, draft_tokens=step.draft_tokens + drafts,
                    draft_sequences=max(step.draft_sequences, 0) + sum(1 for n in lengths if n),
                    attention_pairs=step.pairs + sum(n * c.context for n, c in zip(lengths, candidates)))
    return max(cost.predict(shape), 1e-9)
