"""What a step costs: a linear model of step time learned online from the steps the engine runs.

A step's time is, to first order, a fixed cost (launches, scheduling, sampling) plus terms proportional to the tokens
it computes, the sequences it carries (per-sequence attention and bookkeeping), the context tokens its attention reads,
the query-key pairs its attention scores (a prefill chunk's attention grows with its length times its context), the
draft tokens it verifies, the sequences that verify a draft (each is checked one by one: a cost per sequence, whatever
its draft's length), and whether the step verifies any draft at all (such a step leaves the decode fast path as a
whole: no CUDA graph or compiled decode graph, attention split into a decode part and a draft part, so the first draft
in a batch costs far more than the next). The weights differ by model and device, and by how loaded the machine is, so they are fitted from measurements: a short calibration at start warms the model up, then
every step refines it. Old observations fade (exponential forgetting), so the model follows a drifting machine.

Fit: weighted least squares with non-negative weights (an active-set loop over the features) on decayed sufficient
statistics, so each observation costs O(features^2) and a fit O(features^3); steps are folded in at each fit.

A linear model fitted to noisy steps with relative weighting is biased, differently for different kinds of step. So
each prediction is scaled by a correction per kind of step (with a prefill chunk or not, verifying drafts or not,
batch size by power of two): a running mean of measured / predicted time over that kind's recent steps. Verifying and
plain steps need their own: the chooser weighs a step with drafts against the same step without, and the linear fit
errs differently for the two, so one shared correction would misprice drafts (docs/measurements.md). Where one side
is rarely run, its correction goes stale; `plain_is_stale` tells the chooser when a plain step is due to measure it
again.
"""

from __future__ import annotations

import functools
import operator
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

    def values(self) -> tuple[float, ...]:
        """The features as plain floats: a prediction is a dot product of 8, which numpy makes dearer than Python.
        Built once per shape (a step's shape is priced and observed several times)."""
        cached = self.__dict__.get("_values")
        if cached is None:
            verifying = self.verifying
            cached = (1.0, float(self.query_tokens), float(self.sequences), float(self.context_tokens),
                      float(self.pairs), float(self.draft_tokens), float(verifying), 1.0 if verifying else 0.0)
            object.__setattr__(self, "_values", cached)  # frozen: a cache, not a field (not in eq or hash)
        return cached

    def features(self) -> np.ndarray:
        return np.array(self.values())


CORRECTION_RATE = 0.05  # weight of each new step in its kind's correction (a memory of ~20 steps)
CORRECTION_BOUND = 5.0  # a single step moves its kind's correction as if it were at most 5x off
PLAIN_EVERY = 32  # verifying steps of a kind after which a plain one is due, to keep its correction current
REFIT_EVERY = 16  # steps between fits once the model is warm
SURPRISE_REFIT_AFTER = 4  # a surprising step refits at once, but at most once per this many steps


def _dot(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return sum(map(operator.mul, a, b))


def _solve_over(a: np.ndarray, b: np.ndarray, free: list[int]) -> np.ndarray:
    """Least squares over the `free` features of the normal equations `a w = b`, the others zero."""
    w = np.zeros(len(b))
    if free:
        try:
            w[free] = np.linalg.solve(a[free][:, free], b[free])
        except np.linalg.LinAlgError:
            w[free] = np.linalg.lstsq(a[free][:, free], b[free], rcond=None)[0]
    return w


def _kind(shape: StepShape) -> str:
    """Which correction a step gets: with a prefill chunk or not, its batch size by power of two, and a "v" if it
    verifies drafts."""
    return _kind_name(shape.query_tokens - shape.draft_tokens > shape.sequences, shape.sequences.bit_length(),
                      shape.verifying > 0)


@functools.lru_cache(maxsize=256)
def _kind_name(prefill: bool, batch_bits: int, verifying: bool) -> str:
    """The few kinds' names, built once each (asked for several times a step)."""
    return f"p{int(prefill)}b{batch_bits}" + ("v" if verifying else "")


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
        self._pending: list[tuple[tuple[float, ...], float]] = []  # (features, seconds) of steps not folded in yet
        self.observations = 0
        self.weights = np.zeros(n)
        self._coefficients = (0.0,) * n  # `weights` as floats, for `predict`
        self._free: tuple[int, ...] = tuple(range(n))  # the features the last fit left free (non-zero)
        self.corrections: dict[str, float] = {}  # per kind of step, measured / linear prediction (running mean)
        self._verified_since_plain: dict[str, int] = {}  # per kind of plain step: verifying steps since the last plain

    @property
    def ready(self) -> bool:
        """Enough observations for predictions worth acting on."""
        return self.observations >= 8

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Take one measured step (relative weighting: a 1 ms step counts as much as a 1 s one); it joins the
        statistics at the next fit."""
        if seconds <= 0:
            return
        values = shape.values()
        linear = _dot(values, self._coefficients)
        kind = _kind(shape)
        # a kind of step it predicts badly even after its kind's correction; on a loaded machine most steps are, and a
        # fit after each would cost a few percent of a small model's step, so they refit at most every few steps
        surprise = abs(linear * self._correction(kind) - seconds) > 0.25 * seconds
        if self.ready and linear > 0:
            ratio = min(max(seconds / linear, 1 / CORRECTION_BOUND), CORRECTION_BOUND)
            correction = self.corrections.get(kind, 1.0)
            self.corrections[kind] = correction + CORRECTION_RATE * (ratio - correction)
        plain = kind.removesuffix("v")
        self._verified_since_plain[plain] = self._verified_since_plain.get(plain, 0) + 1 if shape.verifying else 0
        self._pending.append((values, seconds))
        self.observations += 1
        due = len(self._pending) >= (SURPRISE_REFIT_AFTER if surprise else REFIT_EVERY)
        if self.observations <= 64 or due:
            self._set_weights(self._solve())

    def _fold(self) -> None:
        """Fold the steps observed since the last fit into the decayed statistics, in one product: numpy calls on
        small arrays right after a forward (cold caches) cost far more per step than one batched product."""
        if not self._pending:
            return
        x = np.array([values for values, _ in self._pending])
        seconds = np.array([t for _, t in self._pending])
        fade = self.decay ** np.arange(len(x) - 1, -1, -1)  # the newest step is not faded yet
        weight = fade / (seconds * seconds)
        fold = self.decay ** len(x)
        self._xtx = fold * self._xtx + (x * weight[:, None]).T @ x
        self._xty = fold * self._xty + x.T @ (weight * seconds)
        self._pending.clear()

    def _set_weights(self, weights: np.ndarray) -> None:
        self.weights = weights
        self._coefficients = tuple(float(w) for w in weights)

    def _solve(self) -> np.ndarray:
        """The non-negative least-squares weights of the decayed statistics by Lawson and Hanson's active-set method
        ("Solving Least Squares Problems", 1974, ch. 23), on features scaled to a unit diagonal so one tolerance fits
        them all. It starts from the last fit's free features (dropping any that now come out negative): between
        fits the statistics move little, so one solve and the optimality check usually settle it."""
        self._fold()
        n = len(FEATURES)
        scale = 1.0 / np.sqrt(np.maximum(self._xtx.diagonal(), 1e-30))
        a = self._xtx * scale * scale[:, None]
        a.flat[::n + 1] += self.ridge
        b = self._xty * scale
        tolerance = 1e-10 * max(float(np.abs(b).max()), 1e-30)
        free = list(self._free)
        while True:  # a feasible start: every free weight positive
            w = _solve_over(a, b, free)
            values = w.tolist()
            if all(values[j] > 0.0 for j in free):
                break
            free = [j for j in free if values[j] > 0.0]
        for _ in range(4 * n):
            gradient = (b - a @ w).tolist()  # what raising each weight would still gain
            fixed = [j for j in range(n) if j not in free and gradient[j] > tolerance]
            if not fixed:
                break
            free.append(max(fixed, key=lambda j: gradient[j]))
            while free:  # each pass ends or fixes at least one more feature at zero: at most n passes
                z = _solve_over(a, b, free)
                values = z.tolist()
                if all(values[j] > 0.0 for j in free):
                    w = z
                    break
                # move towards z only as far as the first free weight reaching zero, which then leaves the set (set
                # to zero exactly: rounding could leave it a hair above, and the same pass would repeat forever)
                current = w.tolist()
                step, first = min(((current[j] / (current[j] - values[j]) if current[j] > values[j] else 0.0), j)
                                  for j in free if values[j] <= 0.0)
                w = w + step * (z - w)
                w[first] = 0.0
                free = [j for j in free if j != first and w[j] > 0.0]
                w[[j for j in range(n) if j not in free]] = 0.0
        self._free = tuple(sorted(free))
        return w * scale

    def predict(self, shape: StepShape) -> float:
        """Linear prediction times the kind's correction (a kind not seen yet borrows the other side's: verifying
        for plain or plain for verifying, at the same batch size)."""
        return _dot(shape.values(), self._coefficients) * self._correction(_kind(shape))

    def predict_linear(self, shape: StepShape) -> float:
        """The linear prediction alone, without the kind's correction: a yardstick that no kind of step moves towards
        itself (the gate scores every policy against it)."""
        return _dot(shape.values(), self._coefficients)

    @staticmethod
    def kind(shape: StepShape) -> str:
        """The kind of step `shape` is, as corrections are kept."""
        return _kind(shape)

    def _correction(self, kind: str) -> float:
        other = kind.removesuffix("v") if kind.endswith("v") else kind + "v"
        return self.corrections.get(kind, self.corrections.get(other, 1.0))

    def predict_with_drafts(self, step: StepShape, drafts: np.ndarray, verifying: np.ndarray,
                            pairs: np.ndarray) -> np.ndarray:
        """Predicted seconds of `step` with drafts added, one option per element: draft tokens, sequences verifying
        them, attention pairs they score (the chooser prices all its options at once)."""
        base = step.features()
        options = np.tile(base, (len(drafts), 1))
        options[:, 1] += drafts
        options[:, 4] += pairs
        options[:, 5] += drafts
        options[:, 6] = max(step.draft_sequences, 0) + verifying
        options[:, 7] = options[:, 6] > 0
        plain = _kind(step).removesuffix("v")
        corrections = np.where(options[:, 6] > 0, self._correction(plain + "v"), self._correction(plain))
        return np.maximum(options @ self.weights * corrections, 1e-9)

    def plain_is_stale(self, shape: StepShape) -> bool:
        """Whether this plain step's kind has run PLAIN_EVERY verifying steps since its last plain one: its
        correction is then old, and an error in it would keep the chooser drafting (or not) unchecked."""
        return self._verified_since_plain.get(_kind(shape), 0) >= PLAIN_EVERY

    def coefficients(self) -> dict[str, float]:
        """Seconds per unit of each feature ("step": the fixed cost)."""
        return dict(zip(FEATURES, (float(w) for w in self.weights)))

    def to_dict(self) -> dict[str, Any]:
        self._fold()
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
        model._set_weights(model._solve())
        return model
