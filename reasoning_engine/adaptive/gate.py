"""Which drafting policy the next step runs, chosen from measured steps with the fixed default as the floor.

Three policies ("arms") compete per decode batch size (by power of two, decode-only steps apart from steps that carry a
prefill chunk):
- "default": what the engine does without the adaptive engine (each request's static draft length, speculation off
  above the batch cap): the setting a user would otherwise run;
- "adaptive": draft lengths chosen by goodput from the cost model and the acceptance estimates (goodput.py);
- "plain": no drafts.

Every step is scored by its decodes' tokens per second against the cost model's prediction for the same step without
drafts (tokens x predicted plain seconds / (decodes x seconds)), the proposing and choosing done for it included, so
steps of different contexts and arms compare on one scale. Scores are taken against the linear prediction without its
per-kind corrections (a plain step's correction follows plain steps: against it plain steps would score about 1
whatever they delivered). The arms' scores are decayed means that fade per step of the bucket, whichever arm ran, so
they cover the same stretch of time (about the last 1 / (1 - SCORE_DECAY) steps).

The choice is a discounted upper-confidence-bound rule (Garivier and Moulines, "On Upper-Confidence Bound Policies for
Switching Bandit Problems", ALT 2011) made conservative as in Wu, Shariff, Lattimore and Szepesvari ("Conservative
Bandits", ICML 2016): an arm other than the default runs only while the surplus covers its lower confidence bound
falling short of (1 - ALPHA) x the default's mean. The surplus is kept in seconds and counts each recent step at what
is known of its arm for sure, not at its score: a default step at ALPHA of its time, another arm's step at its time
times its current lower bound's margin over that floor. A step's score varies with what the drafts happened to match
(its spread is most of its mean), and a surplus of realised scores banks such luck and spends it exploring. So over
each bucket's recent steps, whatever the cost model or the acceptance estimates believe, the engine loses at most about
ALPHA of the default's time, while an arm that measures better builds the surplus and takes over. The surplus is one
for all buckets: a batch size the traffic has just reached explores at once on what the others saved (a surplus per
batch size had to save up for each try from its own few steps, and a minute at a new concurrency ended before no drafts
were tried twice). The default also runs once every DEFAULT_EVERY steps of a bucket whatever leads, so the floor is a
current measurement.

An arm never tried has the lowest score as its lower bound, except "plain": a step without drafts does a subset of the
work of the same step with drafts, so it is bounded below by the default's score over the default's tokens per
decoding request (1 if it drafted nothing), before it is measured and after (its first few measured steps give a wider
bound than that), and where drafting does not pay at a batch size, no drafts are tried after a few default steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

ARMS = ("default", "adaptive", "plain")
SCORE_DECAY = 0.995  # per scored step of a bucket, the weight left to each older score of every arm (~200 steps)
ALPHA = 0.02  # the share of the default's score that exploring other arms may cost
DEFAULT_EVERY = 16  # a bucket's steps after which the default runs again, whatever leads: the yardstick stays current
MIN_DEFAULT = 32  # the default's scores before any other arm is tried (its first ones come while the cost model is young)
CONFIDENCE = 2.0  # standard errors in the upper and lower bounds
PRIOR_DEVIATION = 0.25  # a score's assumed standard deviation, worth PRIOR_WEIGHT scores, until measured
PRIOR_WEIGHT = 2.0
LOADED_WEIGHT = 8.0  # a saved arm's scores, at a restart, count as at most this many steps (`PolicyGate.temper`)
SCORE_BOUNDS = (0.1, 10.0)  # a single step counts as if at most 10x off (a stall must not swamp the mean)


@dataclass
class ArmScore:
    """Decayed mean and variance of one arm's step scores."""

    total: float = 0.0
    squares: float = 0.0
    weight: float = 0.0
    count: int = 0
    tokens: float = 0.0  # decayed sum of each step's tokens per decoding request
    seconds: float = 0.0  # decayed sum of the steps' seconds, over `timed`
    timed: float = 0.0

    @property
    def step_seconds(self) -> float | None:
        return self.seconds / self.timed if self.timed > 0 else None

    @property
    def tokens_per_decode(self) -> float:
        return self.tokens / self.weight if self.weight > 0 else 1.0

    @property
    def mean(self) -> float:
        return self.total / self.weight if self.weight > 0 else 1.0

    def deviation(self) -> float:
        """The scores' standard deviation, shrunk towards PRIOR_DEVIATION while few were measured."""
        variance = max(self.squares / self.weight - self.mean ** 2, 0.0) if self.weight > 0 else 0.0
        prior = PRIOR_WEIGHT * PRIOR_DEVIATION ** 2
        return math.sqrt((variance * self.weight + prior) / (self.weight + PRIOR_WEIGHT))

    def error(self) -> float:
        """CONFIDENCE standard errors of the mean."""
        return CONFIDENCE * self.deviation() / math.sqrt(max(self.weight, 1e-9))

    def fade(self) -> None:
        self.total *= SCORE_DECAY
        self.squares *= SCORE_DECAY
        self.weight *= SCORE_DECAY
        self.tokens *= SCORE_DECAY
        self.seconds *= SCORE_DECAY
        self.timed *= SCORE_DECAY

    def add(self, score: float, tokens_per_decode: float, seconds: float) -> None:
        self.total += score
        self.squares += score * score
        self.weight += 1.0
        self.count += 1
        self.tokens += tokens_per_decode
        self.seconds += seconds
        self.timed += 1.0


@dataclass
class Bucket:
    """One batch size's arms."""

    arms: dict[str, ArmScore] = field(default_factory=lambda: {arm: ArmScore() for arm in ARMS})
    chosen: str = "default"
    since_default: int = 0  # scored steps since the default's last

    def upper(self, arm: str) -> float:
        score = self.arms[arm]
        return math.inf if not score.count else score.mean + score.error()

    def lower(self, arm: str) -> float:
        score = self.arms[arm]
        bound = SCORE_BOUNDS[0]
        if arm == "plain":  # a subset of a drafting step's work (module docstring), before and after it is measured
            default = self.arms["default"]
            bound = max(default.mean / max(default.tokens_per_decode, 1.0), bound)
        return max(score.mean - score.error(), bound) if score.count else bound

    def margin(self, arm: str) -> float:
        """What a second of `arm`'s steps adds to the surplus: ALPHA for the default, else its lower bound's margin
        over (1 - ALPHA) x the default's mean, relative to that mean."""
        if arm == "default":
            return ALPHA
        return (self.lower(arm) - (1 - ALPHA) * self.arms["default"].mean) / self.arms["default"].mean

    def surplus(self) -> float:
        """The seconds this bucket's recent steps leave over the floor (module docstring), over the arms' decayed
        step times."""
        return sum(score.seconds * self.margin(arm) for arm, score in self.arms.items() if score.seconds > 0)

    def choose(self, surplus: Callable[[], float], allowed: tuple[str, ...] = ARMS) -> str:
        """The arm the next step runs: the one with the highest upper bound (of arms equally unknown, the one with
        the higher lower bound; then the earlier arm, the default first) if the surplus (seconds, all buckets', asked
        only then) covers its step, else the default, which then saves up for it (a cheaper arm run instead would
        spend what the leading one needs). The default also runs until it has MIN_DEFAULT scores, and every
        DEFAULT_EVERY steps."""
        default = self.arms["default"]
        if default.count < MIN_DEFAULT or self.since_default >= DEFAULT_EVERY:
            return "default"
        lowers = {arm: self.lower(arm) for arm in allowed}
        arm = max(allowed, key=lambda a: (self.upper(a), lowers[a], -ARMS.index(a)))
        if arm == "default":
            return arm
        seconds = self.arms[arm].step_seconds or default.step_seconds  # a step's time: the arm's, else the default's
        return arm if seconds is not None and surplus() + seconds * self.margin(arm) >= 0 else "default"

    def add(self, arm: str, score: float, tokens_per_decode: float, seconds: float) -> None:
        low, high = SCORE_BOUNDS
        score = min(max(score, low), high)
        for other in self.arms.values():
            other.fade()
        self.arms[arm].add(score, tokens_per_decode, seconds)
        self.since_default = 0 if arm == "default" else self.since_default + 1
        self.chosen = self.leader()

    def leader(self) -> str:
        """The arm with the highest mean among those measured, the default unless another leads beyond its error."""
        default = self.arms["default"]
        best = "default"
        for arm in ARMS[1:]:
            score = self.arms[arm]
            if score.count >= MIN_DEFAULT and score.mean - score.error() > max(default.mean, self.arms[best].mean):
                best = arm
        return best


def bucket_of(decodes: int) -> int:
    """A batch size's bucket: its power of two (1, 2-3, 4-7, ...), as the cost model's kinds of step."""
    return decodes.bit_length()


class PolicyGate:
    """Per decode batch-size bucket, decode-only steps apart from those beside a prefill chunk, which drafting policy
    runs (`Bucket.choose`)."""

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

    def choose(self, decodes: int, beside_chunk: bool = False, allowed: tuple[str, ...] = ARMS) -> str:
        """The arm the next step of `decodes` decoding requests (`beside_chunk`: and a prefill chunk) runs, among
        `allowed` (the default always is)."""
        return self._bucket(decodes, beside_chunk).choose(self.surplus, allowed)

    def surplus(self) -> float:
        """The seconds all buckets' recent steps leave over the floor: what exploring may still spend."""
        return sum(b.surplus() for buckets in (self.buckets, self.chunk_buckets) for b in buckets.values())

    def observe(self, decodes: int, arm: str, tokens: int, seconds: float, plain_seconds: float,
                beside_chunk: bool = False) -> None:
        """A step of `decodes` decoding requests (`beside_chunk`: and a prefill chunk) run by `arm`: the decodes'
        `tokens` in `seconds` (drafting's own time included), against `plain_seconds`, the cost model's prediction
        for the step without drafts."""
        if decodes <= 0 or seconds <= 0 or plain_seconds <= 0:
            return
        self._bucket(decodes, beside_chunk).add(arm, tokens * plain_seconds / (decodes * seconds), tokens / decodes,
                                                seconds)

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per bucket (its decoding requests, as "16-31", and "16-31 beside a chunk"): each arm's mean score and
        steps and the leading arm."""
        out: dict[str, dict[str, Any]] = {}
        for buckets, suffix in ((self.buckets, ""), (self.chunk_buckets, " beside a chunk")):
            for b, bucket in sorted(buckets.items()):
                row: dict[str, Any] = {}
                for arm, score in bucket.arms.items():
                    row[arm] = round(score.mean, 4)
                    row[f"{arm}_steps"] = score.count
                row["leader"] = bucket.chosen
                out[f"{(1 << b) >> 1}-{(1 << b) - 1}{suffix}"] = row
        return out

    def to_dict(self) -> dict[str, list[float]]:
        """Bucket b under "b", and beside a chunk under "cb": per arm (ARMS order) total, squares, weight, count,
        tokens, seconds, timed."""
        return {f"{prefix}{b}": [v for arm in ARMS for v in _values(bucket.arms[arm])]
                for buckets, prefix in ((self.buckets, ""), (self.chunk_buckets, "c")) for b, bucket in buckets.items()}

    def temper(self, weight: float = LOADED_WEIGHT) -> None:
        """Make loaded scores a prior: each arm's means kept, its weight at most `weight` steps. A state learned on
        other traffic (the saved state of a server before a restart) must not outvote what this traffic measures for
        long, nor pay for exploring it with a surplus it did not earn here."""
        for bucket in (*self.buckets.values(), *self.chunk_buckets.values()):
            for score in bucket.arms.values():
                if score.weight > weight:
                    factor = weight / score.weight
                    score.total, score.squares, score.tokens = (score.total * factor, score.squares * factor,
                                                                score.tokens * factor)
                    score.seconds, score.timed = score.seconds * factor, score.timed * factor
                    score.weight = weight

    def load(self, data: dict[str, list[float]]) -> None:
        buckets: dict[int, Bucket] = {}
        chunk_buckets: dict[int, Bucket] = {}
        low, high = SCORE_BOUNDS
        for key, values in data.items():
            # states saved before had no step times (5 values per arm), some a surplus at the end
            width = 7 if len(values) == 7 * len(ARMS) else 5
            if len(values) not in (7 * len(ARMS), 5 * len(ARMS), 5 * len(ARMS) + 1):
                raise ValueError(f"policy gate bucket {key} has {len(values)} values")
            arms = {arm: ArmScore(*(float(v) for v in values[width * i:width * i + 3]), int(values[width * i + 3]),
                                  *(float(v) for v in values[width * i + 4:width * i + width]))
                    for i, arm in enumerate(ARMS)}
            if any(s.weight < 0 or s.count < 0 or s.tokens < 0 or (s.weight and not low <= s.mean <= high)
                   or not (0 <= s.seconds < math.inf and 0 <= s.timed < math.inf) for s in arms.values()):
                raise ValueError(f"policy gate bucket {key} out of range")
            bucket = Bucket(arms)
            bucket.chosen = bucket.leader()
            if key.startswith("c"):
                chunk_buckets[int(key[1:])] = bucket
            else:
                buckets[int(key)] = bucket
        self.buckets, self.chunk_buckets = buckets, chunk_buckets


def _values(score: ArmScore) -> tuple[float, float, float, int, float, float, float]:
    return score.total, score.squares, score.weight, score.count, score.tokens, score.seconds, score.timed
