"""Whether drafting pays at all at a batch size: measured on the steps themselves, not predicted.

The goodput chooser (goodput.py) prices each step's drafts with the cost model, but drafting costs more than the
verification it prices: the proposer drafts for requests whose drafts are then dropped, the chooser itself runs for
every decoding request, and the step's Python work competes with the server for the interpreter. On the bundled model
at 20-31 decoding requests on 2 CPU cores, that came to 1.4-1.8 ms of a ~32 ms plain step (5%), while the steps that
did verify drafts delivered about the tokens per second of the plain steps they replaced: the server with drafting ran
at 0.93x one without speculation. The gate measures what drafting delivers, overhead and mispricing included, per
decode batch size (by power of two, like the cost model's kinds), and turns it off where it does not pay.

Each decode-only step is scored by its tokens per second relative to the cost model's prediction for the same step
without drafts: tokens x predicted plain seconds / (decodes x seconds), the seconds of a step decided with drafting on
including the proposing and choosing done for it. A step run without drafting scores about 1 (the prediction's noise);
one with drafting scores its real gain. Per bucket the gate keeps a decayed mean of each mode's score and runs
drafting unless off scores higher beyond the noise, trying the other mode every EXPLORE_EVERY steps of the bucket
(every EXPLORE_EVERY_CLEAR once one leads by CLEAR_LEAD), so a change in the workload's acceptance or in the machine's
load is noticed. A new bucket alternates the two until both have MIN_SCORES scores, and so does one whose losing mode
has the higher mean but not yet by SIGNIFICANCE while its own mean's variance is the larger part of the comparison's
error (more of its scores are what would decide): tried once in 32 steps, its decayed weight settles near 6, its
standard error stays too wide to ever clear the bar, and drafting stayed on at 0.85x (16 agentic requests on the
bundled model: off scored 1.07 against drafting's 0.90 for 300 steps). Where the winner's scores are the noisy ones
(drafting at one request), trying the loser more often would not narrow the error and only cost steps. A try of the
losing mode that scores above both the winner's mean and its own by SIGNIFICANCE of their scores' standard deviations
(it beats the winner, and the losing mode itself has changed: a drafted step's score swings with its acceptance, so
beating the plain steps' noise alone happens by chance at large batches) is repeated at the next step, and when
RESET_AFTER tries in a row do so, the bucket forgets both modes and measures them afresh: the first drafts of a cold
proposer, and the first verification steps of a fresh process (on the bundled model at one request 8-10 ms against 2.8
ms for a plain step), had turned drafting off, and with the winner scored ~30 times as often as the loser, the decayed
means needed hundreds of steps to let the loser's better scores count. This only decides whether drafts are
considered; verification keeps the output exact either way.

Steps that carry a prefill chunk beside their decodes have buckets of their own, scored the same way (the decodes'
tokens per second against the cost model's plain prediction for the whole step): drafting beside a chunk costs and
delivers differently, and at 8-15 decodes, where requests come and go, most steps carry one. Decided by the
decode-only buckets and never scored, they drafted wherever plain's lead there was still within the noise: in-process
at 16 reasoning requests, 51 of the 83 steps the gate opened carried a chunk, none of them scored. Measured apart,
behind the server at 16 reasoning requests the gate kept 80-94% of the steps plain against 54-66% (one run 95%),
and adaptive / static k=0 went from 0.89-0.91x to 0.96-0.97x (medians of 7 rounds side by side).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SCORE_DECAY = 0.995  # per scored step of a bucket, the weight left to each older score of either mode (~200 steps)
MIN_SCORES = 8  # scores of each mode before the gate acts on their comparison
FIRST_EXPLORE_EVERY = 2  # until both modes are measured (or see above), every other step tries the loser
EXPLORE_EVERY = 8  # steps of a bucket between tries of the losing mode
EXPLORE_EVERY_CLEAR = 32  # the same once the winner leads by CLEAR_LEAD
CLEAR_LEAD = 0.10
SIGNIFICANCE = 2.0  # standard errors by which off must lead to turn drafting off
SCORE_BOUNDS = (0.1, 10.0)  # a single step counts as if at most 10x off (a stall must not swamp the mean)
RESET_AFTER = 2  # tries in a row of the losing mode well above both modes' means


@dataclass
class ModeScore:
    """Decayed mean and variance of one mode's step scores."""

    total: float = 0.0
    squares: float = 0.0
    weight: float = 0.0
    count: int = 0

    @property
    def mean(self) -> float:
        return self.total / self.weight if self.weight > 0 else 1.0

    @property
    def deviation(self) -> float:
        """The scores' standard deviation."""
        if self.weight <= 0:
            return 0.0
        return math.sqrt(max(self.squares / self.weight - self.mean ** 2, 0.0))

    def mean_variance(self) -> float:
        """The variance of `mean` (the scores' variance over their weight)."""
        return self.deviation ** 2 / self.weight if self.weight > 0 else 0.0


@dataclass
class Bucket:
    """One batch size's scores. Both modes' scores fade per step of the bucket, whichever mode it ran, so the two
    means cover the same stretch of time although the losing mode is scored only once in EXPLORE_EVERY steps (faded
    per own score, its mean would reach back eight times as far, into a machine or workload that has moved on)."""

    on: ModeScore = field(default_factory=ModeScore)
    off: ModeScore = field(default_factory=ModeScore)
    decisions: int = 0
    surprises: int = 0  # tries of the losing mode in a row that scored well above both modes' means
    bar: float = 0.0  # the score those tries had to beat
    resets: int = 0

    def add(self, drafting: bool, score: float) -> None:
        low, high = SCORE_BOUNDS
        score = min(max(score, low), high)
        winner, loser = (self.off, self.on) if drafting else (self.on, self.off)
        trailing = self.measured and drafting != self.winner() and winner.mean > loser.mean  # a try of a mode behind
        if not self.surprises:  # the bar a repeated try must clear is the first's: that try itself widened it
            self.bar = max(winner.mean + SIGNIFICANCE * winner.deviation, loser.mean + SIGNIFICANCE * loser.deviation)
        if trailing and score > self.bar:
            self.surprises += 1
        else:
            self.surprises = 0
        if self.surprises >= RESET_AFTER:
            self.on, self.off, self.surprises = ModeScore(), ModeScore(), 0
            self.resets += 1
        for mode in (self.on, self.off):
            mode.total *= SCORE_DECAY
            mode.squares *= SCORE_DECAY
            mode.weight *= SCORE_DECAY
        mode = self.on if drafting else self.off
        mode.total += score
        mode.squares += score * score
        mode.weight += 1.0
        mode.count += 1

    @property
    def measured(self) -> bool:
        """Both modes have MIN_SCORES scores."""
        return min(self.on.count, self.off.count) >= MIN_SCORES

    def winner(self) -> bool:
        """Drafting on, unless both modes are measured and off scores higher by SIGNIFICANCE standard errors. At a
        small batch a drafted step's score swings with its acceptance (on the bundled model at one request, a
        standard deviation of 0.8 around 1.4) and the first drafts of a cold proposer are poor, so a plain lead in
        the means would turn drafting off on noise where it pays most."""
        if not self.measured:
            return True
        error = math.sqrt(self.on.mean_variance() + self.off.mean_variance())
        return self.off.mean - self.on.mean <= SIGNIFICANCE * error


def bucket_of(decodes: int) -> int:
    """A batch size's bucket: its power of two (1, 2-3, 4-7, ...), as the cost model's kinds of step."""
    return decodes.bit_length()


class DraftingGate:
    """Per decode batch-size bucket, decode-only steps apart from those beside a prefill chunk, whether drafting is on
    (`Bucket.winner`), the other mode tried now and then."""

    def __init__(self) -> None:
        self.buckets: dict[int, Bucket] = {}
        self.chunk_buckets: dict[int, Bucket] = {}

    def _bucket(self, decodes: int, beside_chunk: bool) -> Bucket:
        """The step's bucket, made on first use (not `setdefault`, which would build a Bucket at every step)."""
        buckets, key = (self.chunk_buckets if beside_chunk else self.buckets), bucket_of(decodes)
        bucket = buckets.get(key)
        if bucket is None:
            bucket = buckets[key] = Bucket()
        return bucket

    def open(self, decodes: int, beside_chunk: bool = False) -> bool:
        """Whether the next step of `decodes` decoding requests (`beside_chunk`: and a prefill chunk) considers
        drafts."""
        bucket = self._bucket(decodes, beside_chunk)
        bucket.decisions += 1
        if bucket.surprises:  # the losing mode's last try scored well above the winner: try it again at once
            return not bucket.winner()
        drafting = bucket.winner()
        winner, loser = (bucket.on, bucket.off) if drafting else (bucket.off, bucket.on)
        if not bucket.measured or loser.mean > winner.mean and loser.mean_variance() > winner.mean_variance():
            every = FIRST_EXPLORE_EVERY
        else:
            lead = (winner.mean - loser.mean) / max(loser.mean, 1e-9)
            every = EXPLORE_EVERY_CLEAR if lead > CLEAR_LEAD else EXPLORE_EVERY
        return drafting != (bucket.decisions % every == 0)

    def observe(self, decodes: int, drafting: bool, tokens: int, seconds: float, plain_seconds: float,
                beside_chunk: bool = False) -> None:
        """A step of `decodes` decoding requests (`beside_chunk`: and a prefill chunk) decided with drafting on or
        off: the decodes' `tokens` in `seconds` (drafting's own time included), against `plain_seconds`, the cost
        model's prediction for the step without drafts."""
        if decodes <= 0 or seconds <= 0 or plain_seconds <= 0:
            return
        self._bucket(decodes, beside_chunk).add(drafting, tokens * plain_seconds / (decodes * seconds))

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per bucket (its decoding requests, as "16-31", and "16-31 beside a chunk"): each mode's mean score and
        count, and the winner."""
        return {f"{(1 << b) >> 1}-{(1 << b) - 1}{suffix}": {
                    "on": round(s.on.mean, 4), "on_steps": s.on.count, "off": round(s.off.mean, 4),
                    "off_steps": s.off.count, "drafting": s.winner(), "resets": s.resets}
                for buckets, suffix in ((self.buckets, ""), (self.chunk_buckets, " beside a chunk"))
                for b, s in sorted(buckets.items())}

    def to_dict(self) -> dict[str, list[float]]:
        """Bucket b's scores under "b", and those beside a chunk under "cb"."""
        return {f"{prefix}{b}": [value for m in (s.on, s.off) for value in (m.total, m.squares, m.weight, m.count)]
                for buckets, prefix in ((self.buckets, ""), (self.chunk_buckets, "c")) for b, s in buckets.items()}

    def load(self, data: dict[str, list[float]]) -> None:
        buckets: dict[int, Bucket] = {}
        chunk_buckets: dict[int, Bucket] = {}
        for key, values in data.items():
            on, off = (ModeScore(float(t), float(q), float(w), int(c)) for t, q, w, c in (values[:4], values[4:]))
            low, high = SCORE_BOUNDS
            if any(m.weight < 0 or m.count < 0 or (m.weight and not low <= m.mean <= high) for m in (on, off)):
                raise ValueError(f"drafting gate bucket {key} out of range")
            if key.startswith("c"):
                chunk_buckets[int(key[1:])] = Bucket(on, off)
            else:
                buckets[int(key)] = Bucket(on, off)
        self.buckets, self.chunk_buckets = buckets, chunk_buckets
