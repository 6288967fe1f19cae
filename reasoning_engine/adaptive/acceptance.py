"""How much of a draft the target accepts: per draft position, per proposer and workload class, and per request.

A verified draft of length L with a accepted tokens says, for each position i <= min(a + 1, L), whether the target
took it given that it took positions 1..i-1: positions 1..a yes, position a + 1 no. Counting those gives the
conditional acceptance rate p_i of each position, from which a draft of length k is worth
E(k) = 1 + sum_{i<=k} prod_{j<=i} p_j tokens (the 1 is the token the target adds after any draft). Speculative
sampling's analysis (Leviathan et al., 2023, arXiv:2211.17192) uses one rate for all positions; measuring each
position keeps the estimate honest for proposers whose later positions are weaker.

A request's own counts start from its class's (proposer method and workload class, e.g. agentic tool use vs plain
chat) scaled down to a prior of `PRIOR_WEIGHT` drafts, so a new request of a known kind starts where its kind stands
and its own history takes over after a few steps. Counts fade (exponential forgetting) to follow a changing workload.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

PRIOR_WEIGHT = 4.0  # drafts' worth of class statistics a request starts from
UNSEEN_RATE = 0.5  # the conditional rate assumed with no observation at all


@dataclass
class PositionCounts:
    """Decayed trials and acceptances per draft position (index 0 = the first draft token)."""

    trials: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def record(self, draft_len: int, accepted: int, decay: float = 1.0) -> None:
        if decay != 1.0:
            self.trials = [t * decay for t in self.trials]
            self.accepted = [a * decay for a in self.accepted]
        seen = min(accepted + 1, draft_len)
        while len(self.trials) < seen:
            self.trials.append(0.0)
            self.accepted.append(0.0)
        for i in range(seen):
            self.trials[i] += 1.0
            if i < accepted:
                self.accepted[i] += 1.0

    def rates(self, length: int, prior: PositionCounts | None = None, prior_weight: float = PRIOR_WEIGHT) -> list[float]:
        """Conditional acceptance rate of positions 1..length: own counts plus the prior's, rescaled to at most
        `prior_weight` trials at its first position (Beta-Bernoulli smoothing towards the class; a class of one draft
        counts as one, not as `prior_weight` copies of it)."""
        rates = []
        scale = 0.0
        if prior is not None and prior.trials and prior.trials[0] > 0:
            scale = min(1.0, prior_weight / prior.trials[0])
        for i in range(length):
            trials = self.trials[i] if i < len(self.trials) else 0.0
            accepted = self.accepted[i] if i < len(self.accepted) else 0.0
            if prior is not None and i < len(prior.trials):
                trials += scale * prior.trials[i]
                accepted += scale * prior.accepted[i]
            previous = rates[-1] if rates else UNSEEN_RATE
            rates.append((accepted + previous) / (trials + 1.0))  # one pseudo-trial at the previous position's rate
        return rates

    def to_dict(self) -> dict[str, list[float]]:
        return {"trials": self.trials, "accepted": self.accepted}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PositionCounts:
        trials, accepted = [float(v) for v in data["trials"]], [float(v) for v in data["accepted"]]
        if len(trials) != len(accepted) or any(a > t + 1e-9 or a < 0 for a, t in zip(accepted, trials)):
            raise ValueError("acceptance counts are inconsistent")
        return cls(trials, accepted)


class AcceptanceModel:
    """Position counts per (method, workload class) and per running request."""

    def __init__(self, decay: float = 0.999) -> None:
        self.decay = decay
        self.classes: dict[str, PositionCounts] = {}
        self.requests: dict[str, PositionCounts] = {}

    @staticmethod
    def class_key(method: str, workload: str) -> str:
        return f"{method}/{workload}"

    def record(self, seq_id: str, method: str, workload: str, draft_len: int, accepted: int) -> None:
        if draft_len <= 0:
            return
        self.classes.setdefault(self.class_key(method, workload), PositionCounts()).record(draft_len, accepted,
                                                                                           self.decay)
        self.requests.setdefault(seq_id, PositionCounts()).record(draft_len, accepted, 0.9)

    def rates(self, seq_id: str, method: str, workload: str, length: int) -> list[float]:
        prior = self.classes.get(self.class_key(method, workload))
        own = self.requests.get(seq_id, PositionCounts())
        return own.rates(length, prior)

    def forget(self, seq_id: str) -> None:
        self.requests.pop(seq_id, None)

    def summary(self, length: int) -> dict[str, dict[str, Any]]:
        """Per class: drafts seen (decayed) and the conditional rate of each position."""
        return {key: {"drafts": round(counts.trials[0], 1) if counts.trials else 0.0,
                      "rates": [round(r, 3) for r in counts.rates(min(length, len(counts.trials)))]}
                for key, counts in sorted(self.classes.items())}

    def to_dict(self) -> dict[str, Any]:
        return {key: counts.to_dict() for key, counts in self.classes.items()}

    def load(self, data: dict[str, Any]) -> None:
        self.classes = {str(key): PositionCounts.from_dict(value) for key, value in data.items()}


class ProposedDrafts:
    """How likely the proposer's good drafts are, per node, before it drafts: the QUANTILE-th of its recent drafts'
    node probabilities.

    Where a proposer says how likely each drafted node is, the controller caps what it is asked for before it
    drafts (`AdaptiveController.draft_caps`), so the caps cannot use the probabilities of the drafts to come. A
    request's acceptance history averages over all its drafts, while the chooser verifies only the likely ones: on
    the agent traces at one request the history fell below 0.1 after the first failed drafts, the caps to 0, and the
    proposer was asked again only by probes, while a fifth of its drafts started at 0.6 or more and delivered 0.8-0.9
    tokens each. So caps assume a draft as likely as the recent good ones. A node past a draft's cap was never asked
    for: it is unknown, and an unknown node is taken to be as likely as the one before it, so caps grow again after a
    stretch of short ones. Kept across restarts: until a fresh process had SIZE drafts of its own, the caps came from
    request histories again, the very estimate they replace."""

    QUANTILE = 0.9
    SIZE = 64

    def __init__(self, length: int) -> None:
        self.probs = np.full((self.SIZE, length), np.nan)
        self.count = 0
        self._survival: list[float] | None = None

    def add(self, probs: list[float], cap: int) -> None:
        """A draft proposed under `cap` nodes and its nodes' probabilities (fewer than `cap`: the rest were zero)."""
        length = self.probs.shape[1]
        row = np.full(length, np.nan)
        known = min(cap, length)
        row[:known] = 0.0
        row[:min(len(probs), known)] = probs[:known]
        self.probs[self.count % self.SIZE] = row
        self.count += 1
        self._survival = None

    def to_list(self) -> list[list[float | None]]:
        """The kept drafts' node probabilities, oldest first (None: a node not asked for)."""
        kept = min(self.count, self.SIZE)
        rows = [self.probs[(self.count - kept + i) % self.SIZE] for i in range(kept)]
        return [[None if np.isnan(v) else float(v) for v in row] for row in rows]

    def load(self, rows: list[list[float | None]]) -> None:
        """Drafts saved by `to_list`, perhaps under another draft length: nodes past the saved length are unknown,
        those past this one dropped."""
        length = self.probs.shape[1]
        parsed = []
        for row in rows:
            if not isinstance(row, list) or not all(
                    v is None or (isinstance(v, (int, float)) and 0.0 <= v <= 1.0) for v in row):
                raise ValueError("proposed drafts must be lists of node probabilities in [0, 1] or null")
            values = np.full(length, np.nan)
            values[:min(len(row), length)] = [np.nan if v is None else float(v) for v in row[:length]]
            parsed.append(values)
        self.probs[:] = np.nan
        self.count = 0
        for values in parsed[-self.SIZE:]:
            self.probs[self.count] = values
            self.count += 1
        self._survival = None

    def survival(self) -> list[float] | None:
        """Per node, the probability that a good draft's nodes up to it are accepted (non-increasing); None before
        any draft."""
        if not self.count or not self.probs.shape[1]:
            return None
        if self._survival is None:
            rows = self.probs[:min(self.count, self.SIZE)]
            known = ~np.isnan(rows).all(axis=0)
            quantiles = np.ones(rows.shape[1])
            if known.any():
                quantiles[known] = column_quantiles(rows[:, known], self.QUANTILE)
            first_unknown = int(np.argmin(known)) if not known.all() else len(known)
            if first_unknown:
                quantiles[first_unknown:] = quantiles[first_unknown - 1]
            self._survival = np.minimum.accumulate(np.clip(quantiles, 0.0, 1.0)).tolist()
        return self._survival


def column_quantiles(values: np.ndarray, q: float) -> np.ndarray:
    """Each column's q-th quantile over its non-NaN values (each column has one), interpolated linearly as
    `np.nanquantile` does, in one pass over all columns: `np.nanquantile` goes column by column where there are NaNs,
    and this runs at every step that proposes."""
    ordered = np.sort(values, axis=0)  # NaNs last
    counts = (~np.isnan(values)).sum(axis=0)
    position = (counts - 1) * q
    low = np.floor(position).astype(np.int64)
    high = np.minimum(low + 1, counts - 1)
    below = np.take_along_axis(ordered, low[None, :], axis=0)[0]
    above = np.take_along_axis(ordered, high[None, :], axis=0)[0]
    return below + (position - low) * (above - below)
