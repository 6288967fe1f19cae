"""The engine's adaptive side: what it measures each step, what it decides from that, and what it keeps.

`AdaptiveController` owns the step cost model, the draft acceptance statistics, the policy gate, the sessions' return
gaps and the decode batch-size histogram; the engine feeds it every step (`observe_step`, `record_draft`, session
arrivals and finishes) and asks it which drafting policy the next step runs (gate.py: the fixed default, adaptive
lengths or none), then for adaptive draft lengths (goodput.py), its token budget (batching.py) and how long to protect
a finished agent turn's blocks (retention.py). It counts what each step was offered, verified and accepted beside what
the fixed default would have drafted, and how far the cost model's predictions were from the measured steps. It saves
itself to the state directory now and then and when the engine shuts down, and `snapshot()` is what
`GET /v1/engine/adaptive` and the metrics show.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from reasoning_engine.adaptive.acceptance import AcceptanceModel, ProposedDrafts
from reasoning_engine.adaptive.batching import ChunkCost, LatencyTargets, token_budget
from reasoning_engine.adaptive.cost_model import StepCostModel, StepShape, chunk_pairs
from reasoning_engine.adaptive.gate import ARMS, PolicyGate
from reasoning_engine.adaptive.goodput import (DraftCandidate, choose_draft_lengths, expected_accepted,
                                               predicted_step_seconds)
from reasoning_engine.adaptive.retention import SessionRetention
from reasoning_engine.adaptive.state import load_state, save_state

logger = logging.getLogger(__name__)

SAVE_EVERY_S = 30.0
PROBE_EVERY = 8  # a request without a draft for this many steps is due a short one, to keep measuring acceptance
PROBE_LENGTH = 2
PROBE_SHARE = 0.05  # probes spend at most this share of the predicted step time, on average
PROBE_CREDIT_STEPS = 4.0  # the probe credit saved up is at most this many steps' predicted time
REALISM_DECAY = 0.99  # weight of the older drafts in the realised / expected acceptance ratio (a memory of ~100)
REALISM_BOUNDS = (0.2, 1.0)
REALISM_PRIOR = 16.0  # expected tokens' worth of drafts assumed to deliver what they said (a few drafts prove little)
TRACE_STEPS = 32  # the last steps shown one by one in the snapshot
ERROR_RATE = 0.02  # weight of each new step in its kind's prediction error (a memory of ~50 steps)


@dataclass
class StepTrace:
    """One step as the adaptive engine saw it: the policy that ran it (None: not scored), its decoding requests, the
    draft tokens the proposer offered within their caps, those verified and accepted, what the fixed default would have
    asked the proposer for, and the cost model's prediction against the measured seconds."""

    policy: str | None = None
    decodes: int = 0
    offered: int = 0
    verified: int = 0
    accepted: int = 0
    default_asked: int = 0
    predicted_s: float = 0.0
    measured_s: float = 0.0


@dataclass
class DraftAsk:
    """A decoding request that may get a draft."""

    seq_id: str
    workload: str
    limit: int  # the longest draft its budget allows (context, max_tokens, thinking budget)
    context: int = 0  # its length: what each of its draft tokens' attention reads
    probs: list[float] | None = None  # its draft's node probabilities, where the proposer has drafted and has them


class AdaptiveController:
    def __init__(self, identity: dict[str, Any], method: str | None, max_draft_tokens: int, state_dir: str | None,
                 targets: LatencyTargets) -> None:
        """`identity` names the model and device (a state learned elsewhere is not loaded); `method` the speculative
        proposer, if any."""
        self.identity = identity
        self.method = method
        self.max_draft_tokens = max_draft_tokens
        self.state_dir = state_dir
        self.targets = targets
        self.cost = StepCostModel()
        self.acceptance = AcceptanceModel()
        self.retention = SessionRetention()
        self.gate = PolicyGate()
        self.chunk_cost = ChunkCost()
        self.batch_sizes: Counter[int] = Counter()
        self.verified_lengths: Counter[int] = Counter()  # verifying steps by their longest draft (CUDA-graph buckets)
        self.warm = False
        self._saved_at = time.monotonic()
        self.last_lengths: list[int] = []
        self._undrafted: dict[str, int] = {}  # steps since each request's last draft
        self._probe_credit = 0.0  # seconds of predicted step time probes may still spend
        self._proposed: dict[str, int] = {}  # requests the last caps let the proposer draft for, and their caps
        self.proposed_drafts = ProposedDrafts(max_draft_tokens)
        self._dropped: dict[str, tuple[int, int]] = {}  # per request: proposals dropped in a row, steps left to wait
        # accepted tokens expected of each request's pending draft, and by which estimate ("proposer" or "history")
        self._expected: dict[str, tuple[str, float]] = {}
        # per estimate, decayed sums over verified drafts: [accepted, expected of them before any realism scaling]
        self._realised: dict[str, list[float]] = {"proposer": [0.0, 0.0], "history": [0.0, 0.0]}
        # over the steps decided: "steps", "verifying" (with any draft), "draft_tokens", "probes" (requests probed),
        # "plain_checks" (steps left plain to measure them, see `_may_draft`), "gated" (steps the gate kept plain)
        self.decided: Counter[str] = Counter()
        self.policy_steps: Counter[str] = Counter()  # steps run by each policy of the gate
        # draft tokens over all steps: "offered" by the proposer, "verified", "accepted", "default_asked" (what the
        # fixed default would have asked the proposer for at the same steps)
        self.draft_counts: Counter[str] = Counter()
        self.prediction_error: dict[str, list[float]] = {}  # per kind of step: decayed mean log(measured / predicted), of |.|
        self.trace: deque[StepTrace] = deque(maxlen=TRACE_STEPS)
        self.last_budget: int | None = None
        self.retention_protected = 0  # turns whose blocks were protected
        self.snapshot_data: dict[str, Any] = {}
        if state_dir:
            self._load()

    # ---- state ----
    def _load(self) -> None:
        state = load_state(self.state_dir, self.identity)
        if state is None:
            return
        try:
            cost = StepCostModel.from_dict(state["cost_model"])
            acceptance = AcceptanceModel()
            acceptance.load(state["acceptance"])
            retention = SessionRetention()
            retention.load(state["return_gaps"])
            sizes = Counter({int(k): int(v) for k, v in state["batch_sizes"].items()})
            lengths = Counter({int(k): int(v) for k, v in state.get("verified_lengths", {}).items()})  # absent before kept
            gate = PolicyGate()
            gate.load(state.get("policy_gate", {}))  # absent from states saved before it (theirs is not comparable)
            gate.temper()
            chunk_cost = ChunkCost()
            chunk_cost.load(state.get("chunk_steps", []))
            proposed_drafts = ProposedDrafts(self.max_draft_tokens)
            proposed_drafts.load(state.get("proposed_drafts", []))  # absent from states saved before it was kept
        except (KeyError, TypeError, ValueError) as exc:
            logger.warning("adaptive state in %s is malformed (%s): starting cold", self.state_dir, exc)
            return
        self.cost, self.acceptance, self.retention, self.batch_sizes = cost, acceptance, retention, sizes
        self.verified_lengths = lengths
        self.gate, self.chunk_cost, self.proposed_drafts = gate, chunk_cost, proposed_drafts
        self.warm = True
        logger.info("adaptive state loaded from %s (%d steps in the cost model)", self.state_dir, cost.observations)

    def save(self) -> None:
        """Write the state. A failed write (disk full, directory removed) is logged and tried again SAVE_EVERY_S
        later: the state is a cache of what was measured, and losing it must not fail the step that saves it."""
        if not self.state_dir:
            return
        self._saved_at = time.monotonic()
        try:
            save_state(self.state_dir, self.identity, {
                "cost_model": self.cost.to_dict(), "acceptance": self.acceptance.to_dict(),
                "return_gaps": self.retention.to_dict(),
                "batch_sizes": {str(k): v for k, v in self.batch_sizes.items()},
                "verified_lengths": {str(k): v for k, v in self.verified_lengths.items()},
                "policy_gate": self.gate.to_dict(), "chunk_steps": self.chunk_cost.to_list(),
                "proposed_drafts": self.proposed_drafts.to_list()})
        except OSError as exc:
            logger.warning("could not save the adaptive state to %s (%s): serving goes on without it", self.state_dir,
                           exc)

    def maybe_save(self) -> None:
        if self.state_dir and time.monotonic() - self._saved_at > SAVE_EVERY_S:
            self.save()

    # ---- measurements ----
    def calibrate(self, run: Callable[[StepShape], float], max_seqs: int, max_tokens: int, block_size: int) -> None:
        """Warm the cost model with steps of known shape (`run` times one and returns seconds): decodes of 1, 4
        and max_seqs sequences at short and long contexts, prefill chunks, verification steps where every sequence
        drafts and where one does. The prefill chunks also seed the chunk cost."""
        shapes = []
        for seqs in sorted({1, min(4, max_seqs), max_seqs}):
            for context in (block_size, 16 * block_size):
                shapes.append(StepShape(seqs, seqs, seqs * context))
        for chunk in sorted({min(64, max_tokens), min(512, max_tokens)}):
            shapes.append(StepShape(chunk, 1, chunk, attention_pairs=chunk_pairs(chunk, 0)))
        if self.max_draft_tokens:
            k = self.max_draft_tokens
            for seqs in sorted({1, max_seqs}):
                shapes.append(StepShape(seqs * (1 + k), seqs, seqs * (1 + k), seqs * k, draft_sequences=seqs))
            if max_seqs > 1:  # one draft among decodes: what leaving the decode path costs the whole step
                for draft in sorted({min(2, k), k}):
                    shapes.append(StepShape(max_seqs + draft, max_seqs, max_seqs * (1 + k), draft, draft_sequences=1))
        timed: dict[StepShape, float] = {}
        for warm in (False, True, True):  # a first round unobserved: first calls of a shape pay one-off setup
            for shape in shapes:
                timed[shape] = run(shape)
                if warm:
                    self.cost.observe(shape, timed[shape])
        lone = StepShape(1, 1, block_size)
        for shape, seconds in timed.items():
            if shape.sequences == 1 and shape.query_tokens > 1 and not shape.draft_tokens:
                self.chunk_cost.observe(shape.query_tokens, shape.pairs, seconds - self.cost.predict(lone))

    def observe_step(self, shape: StepShape, seconds: float, decode_batch: int, policy: str | None = None,
                     tokens: int = 0, drafting_seconds: float = 0.0, decodes: StepShape | None = None,
                     trace: StepTrace | None = None, draft_length: int = 0) -> None:
        """A step's measured `seconds` (as the cost model counts them). `policy`: the gate's arm that ran it (None:
        the gate was not asked); then the decodes' `tokens` and the step's seconds with all of the proposing and
        choosing done for it (`drafting_seconds`) score that arm, against the step predicted without its drafts.
        `decodes`: the step's decodes alone where it also carried prefill chunks. `trace`: what the engine noted of
        the step's drafts, completed here and kept. `draft_length`: the most draft nodes one of its sequences
        verified (0: none)."""
        part = decodes if decodes is not None else shape
        if policy is not None and part.sequences and part.query_tokens == part.sequences + part.draft_tokens:
            drafts = part.draft_tokens
            pairs = shape.pairs - part.pairs + part.context_tokens - drafts  # a plain decode's pairs: its context
            # the linear prediction: a plain step's correction follows plain steps, so scores against the corrected
            # one would drift towards 1 for plain steps alone while the default's older scores kept their old scale
            plain = self.cost.predict_linear(StepShape(shape.query_tokens - drafts, shape.sequences,
                                                       shape.context_tokens - drafts, attention_pairs=pairs))
            self.gate.observe(part.sequences, policy, tokens, drafting_seconds, plain, decodes is not None)
        if self.cost.ready:
            self._prediction_error(shape, seconds, trace)
        self.cost.observe(shape, seconds)
        if decode_batch:
            self.batch_sizes[decode_batch] += 1
        if draft_length:
            self.verified_lengths[draft_length] += 1

    def _prediction_error(self, shape: StepShape, seconds: float, trace: StepTrace | None) -> None:
        """The cost model's prediction for the step against its measured seconds, into its kind's running error and
        the step's trace."""
        predicted = self.cost.predict(shape)
        if predicted > 0 and seconds > 0:
            log_ratio = math.log(seconds / predicted)
            kind = self.cost.kind(shape)
            error = self.prediction_error.setdefault(kind, [log_ratio, abs(log_ratio)])
            error[0] += ERROR_RATE * (log_ratio - error[0])
            error[1] += ERROR_RATE * (abs(log_ratio) - error[1])
        if trace is not None:
            trace.predicted_s, trace.measured_s = predicted, seconds
            self.trace.append(trace)

    def observe_chunk(self, decodes: StepShape, tokens: int, pairs: int, seconds: float) -> None:
        """A step ran `decodes` (perhaps none) beside prefill chunks of `tokens` scoring `pairs` attention pairs in
        all, in `seconds` (as the cost model counts them): what the chunks cost beyond the decodes' predicted time."""
        self.chunk_cost.observe(tokens, pairs, seconds - self.cost.predict(decodes))

    def record_draft(self, seq_id: str, workload: str, draft_len: int, accepted: int) -> None:
        """A verified draft of `draft_len` tokens (its deepest node) and how many of them were accepted."""
        self.draft_counts.update(verified=draft_len, accepted=accepted)
        self.acceptance.record(seq_id, self.method or "none", workload, draft_len, accepted)
        pending = self._expected.pop(seq_id, None)
        if pending is not None:
            estimate, expected = pending
            sums = self._realised[estimate]
            sums[0] = REALISM_DECAY * sums[0] + accepted
            sums[1] = REALISM_DECAY * sums[1] + expected

    def realism(self, estimate: str) -> float:
        """Accepted tokens per token an estimate ("proposer": the drafts' own node probabilities; "history": the
        request's and its class's past acceptance) expected, over recent drafts. The chooser drafts for the requests
        whose estimated acceptance is highest, and the highest estimates are the likeliest to be too high (the
        winner's curse), so the drafts chosen deliver fewer tokens than expected. Expectations are scaled by this,
        never up; it is measured against the unscaled expectation (measured against the scaled one it would settle at
        the square root of the true ratio), and starts from REALISM_PRIOR tokens at 1, so a cold proposer's first few
        failed drafts do not put it at its floor for hundreds of steps."""
        realised, expected = self._realised[estimate]
        low, high = REALISM_BOUNDS
        return min(max((realised + REALISM_PRIOR) / (expected + REALISM_PRIOR), low), high)

    def forget(self, seq_id: str) -> None:
        self.acceptance.forget(seq_id)
        self._undrafted.pop(seq_id, None)
        self._expected.pop(seq_id, None)
        self._dropped.pop(seq_id, None)

    # ---- decisions ----
    def policy(self, decodes: int, beside_chunk: bool = False) -> str | None:
        """Which drafting policy the next step of `decodes` decoding requests (`beside_chunk`: and a prefill chunk)
        runs: "default", "adaptive" or "plain" (gate.py); None where there is nothing to choose (no proposer, or a
        cost model not ready to score steps by), and the engine runs the fixed default."""
        if self.method is None or not self.cost.ready or not decodes:
            return None
        arm = self.gate.choose(decodes, beside_chunk)
        self.policy_steps[arm] += 1
        if arm == "plain":
            self.decided.update(steps=1, gated=1)
            self.last_lengths = [0] * decodes
        return arm

    def note_offer(self, offered: int, default_asked: int) -> None:
        """The draft tokens the proposer offered for the next step, and what the fixed default would have asked it
        for."""
        self.draft_counts.update(offered=offered, default_asked=default_asked)

    def _candidate(self, ask: DraftAsk) -> tuple[DraftCandidate, str]:
        """An ask's candidate (unscaled) and which estimate its acceptance rates come from: its draft's node
        probabilities where the proposer gave them (a suffix tree knows how often this continuation followed this
        context, which the request's past drafts cannot tell), else the request's and its class's history."""
        assert self.method is not None
        limit = max(0, min(ask.limit, self.max_draft_tokens))
        if ask.probs is None:
            return DraftCandidate(self.acceptance.rates(ask.seq_id, self.method, ask.workload, limit), limit,
                                  ask.context), "history"
        rates, alive = [], 1.0
        for prob in ask.probs[:limit]:  # conditional rates whose running products are the node probabilities
            prob = min(max(prob, 0.0), alive)
            rates.append(prob / alive if alive > 0 else 0.0)
            alive = prob
        return DraftCandidate(rates, len(rates), ask.context), "proposer"

    def _candidates(self, asks: list[DraftAsk]) -> tuple[list[DraftCandidate], list[DraftCandidate], list[str]]:
        """Each ask's candidate as estimated, the same scaled by its estimate's `realism` (the first position's rate
        scales every prefix's probability), and the estimate's name."""
        raw, scaled, estimates = [], [], []
        realism = {name: self.realism(name) for name in self._realised}
        for ask in asks:
            candidate, estimate = self._candidate(ask)
            rates = list(candidate.rates)
            if rates:
                rates[0] *= realism[estimate]
            raw.append(candidate)
            scaled.append(DraftCandidate(rates, candidate.max_length, candidate.context))
            estimates.append(estimate)
        return raw, scaled, estimates

    def _other_seconds(self, step: StepShape, decodes: StepShape | None) -> float:
        """Predicted time of the step's work besides its decodes (`decodes`: the step without it)."""
        return max(0.0, self.cost.predict(step) - self.cost.predict(decodes)) if decodes is not None else 0.0

    def draft_caps(self, asks: list[DraftAsk], step: StepShape, decodes: StepShape | None = None) -> list[int]:
        """Per ask, the longest draft worth proposing (for proposers that draft first and are asked afterwards how
        much of each draft to verify): its goodput length were every request to draft its longest (real drafts
        come shorter, and `draft_lengths` then chooses within them), or a probe's length where one is due; 0 for a
        request sitting out proposals after dropped drafts (`_waits`), which is priced as drafting nothing."""
        if not self._may_draft(step):
            return [0] * len(asks)
        asks = [replace(ask, limit=0) if self._waits(ask.seq_id) else ask for ask in asks]
        candidates = [self._good_draft(c) for c in self._candidates(asks)[1]]
        lengths = choose_draft_lengths(candidates, step, self.cost, self._other_seconds(step, decodes))
        caps = [max(n, min(PROBE_LENGTH, c.max_length)) if self._undrafted.get(a.seq_id, 0) + 1 >= PROBE_EVERY else n
                for a, c, n in zip(asks, candidates, lengths)]
        self._proposed = {ask.seq_id: cap for ask, cap in zip(asks, caps) if cap}
        return caps

    def _good_draft(self, candidate: DraftCandidate) -> DraftCandidate:
        """`candidate` (from its history) at least as likely as the proposer's recent good drafts, where its drafts
        carry node probabilities (acceptance.ProposedDrafts)."""
        good = self.proposed_drafts.survival()
        if good is None or not candidate.max_length:
            return candidate
        rates, own, previous = [], 1.0, 1.0
        for i in range(candidate.max_length):
            own *= candidate.rates[i] if i < len(candidate.rates) else 0.0
            alive = max(own, good[i] if i < len(good) else 0.0)
            rates.append(alive / previous if previous > 0 else 0.0)
            previous = alive
        return DraftCandidate(rates, candidate.max_length, candidate.context)

    def _waits(self, seq_id: str) -> bool:
        """Whether a request sits out this step's proposals: after its k-th proposal in a row that `draft_lengths`
        verified none of, it is not proposed for during the next min(2^(k-1), PROBE_EVERY) steps. Proposing and
        pricing drafts is work on the driver every step, and where drafts do not pay most of it is thrown away
        (docs/measurements.md); at a small batch, where drafts are kept, the proposer still runs every step."""
        drops, wait = self._dropped.get(seq_id, (0, 0))
        if wait:
            self._dropped[seq_id] = (drops, wait - 1)
        return wait > 0

    def draft_lengths(self, asks: list[DraftAsk], step: StepShape, decodes: StepShape | None = None) -> list[int]:
        """Per ask, its draft length by goodput (all zero until the cost model is ready), plus probes (`_probe`).
        `step`: the next step without drafts; `decodes`: the same without its prefill chunks, where it has any (the
        drafts are judged by the decodes' rate, see `choose_draft_lengths`)."""
        if not self.cost.ready or self.method is None:
            return [0] * len(asks)
        if self.cost.plain_is_stale(step):
            self.decided.update(steps=1, plain_checks=1)
            return [0] * len(asks)
        raw, candidates, estimates = self._candidates(asks)
        lengths = choose_draft_lengths(candidates, step, self.cost, self._other_seconds(step, decodes))
        due = []
        for i, ask in enumerate(asks):
            waited = 0 if lengths[i] else self._undrafted.get(ask.seq_id, 0) + 1
            self._undrafted[ask.seq_id] = waited
            if waited >= PROBE_EVERY and candidates[i].max_length:
                due.append(i)
        if due:
            lengths = self._probe(asks, candidates, lengths, due, step)
        for ask, candidate, estimate, n in zip(asks, raw, estimates, lengths):
            if n:
                self._expected[ask.seq_id] = (estimate, expected_accepted(candidate, n))
            if ask.seq_id in self._proposed:
                if ask.probs is not None:
                    self.proposed_drafts.add(ask.probs, self._proposed[ask.seq_id])
                drops = 0 if n else self._dropped.get(ask.seq_id, (0, 0))[0] + 1
                self._dropped[ask.seq_id] = (drops, min(2 ** (drops - 1), PROBE_EVERY) if drops else 0)
        self._proposed = {}
        self.last_lengths = lengths
        self.decided.update(steps=1, verifying=int(any(lengths)), draft_tokens=sum(lengths))
        return lengths

    def _may_draft(self, step: StepShape) -> bool:
        """Drafts are weighed once the cost model is ready, unless a plain step of this kind is due (the chooser
        compares each step with drafts against the same step without; measured only when it runs, the plain side's
        correction would otherwise go stale while drafting wins, and an error in it go unchecked)."""
        return self.cost.ready and self.method is not None and not self.cost.plain_is_stale(step)

    def _probe(self, asks: list[DraftAsk], candidates: list[DraftCandidate], lengths: list[int], due: list[int],
               step: StepShape) -> list[int]:
        """Give requests left without a draft for PROBE_EVERY steps a short one: acceptance that was low may have
        risen (a repetitive stretch of an agent's output), and only drafting measures it. Probes are exploration paid
        out of a credit that grows by PROBE_SHARE of the predicted time of each step where one is due, spent by the
        cost model's predicted extra time: all due requests probe together once the credit covers them (at a large
        batch the step's switch to verification is the dear part, so probes are bunched into few steps), or, when the
        credit is full and still falls short, the longest-waiting as many as it covers, at least one: a model that
        believes verification far dearer than it is would otherwise never measure it again. The credit then goes
        into debt, at most as deep as it is high, so such probes come at most once per 2 x PROBE_CREDIT_STEPS /
        PROBE_SHARE due steps."""
        base = predicted_step_seconds(self.cost, step, candidates, lengths)
        self._probe_credit = min(self._probe_credit + PROBE_SHARE * base, PROBE_CREDIT_STEPS * base)
        due.sort(key=lambda i: -self._undrafted[asks[i].seq_id])

        def probing(count: int) -> tuple[list[int], float]:
            probed = list(lengths)
            for i in due[:count]:
                probed[i] = min(PROBE_LENGTH, candidates[i].max_length)
            return probed, predicted_step_seconds(self.cost, step, candidates, probed) - base

        low, high = 0, len(due)
        if probing(high)[1] <= self._probe_credit:
            low = high
        elif self._probe_credit < PROBE_CREDIT_STEPS * base:
            return lengths  # save up: probes bunched into one step share its switch to verification
        while low < high:  # the credit is full: as many as it covers (the extra time grows with the count)
            middle = (low + high + 1) // 2
            if probing(middle)[1] <= self._probe_credit:
                low = middle
            else:
                high = middle - 1
        if not low:  # a full credit short of even one probe: the model believes probes dear; one is measured anyway
            low = 1
        probed, extra = probing(low)
        self._probe_credit = max(self._probe_credit - max(extra, 0.0), -PROBE_CREDIT_STEPS * base)
        for i in due[:low]:
            self._undrafted[asks[i].seq_id] = 0
        self.decided["probes"] += low
        return probed

    def token_budget(self, decodes: StepShape, max_tokens: int, oldest_wait_s: float, waiting_tokens: int,
                     prefill_context: int) -> int:
        self.last_budget = token_budget(self.cost, decodes, max_tokens, self.targets, oldest_wait_s, waiting_tokens,
                                        prefill_context, chunk_cost=self.chunk_cost)
        return self.last_budget

    # ---- sessions ----
    def session_arrived(self, session: str, now: float) -> None:
        self.retention.arrived(session, now)

    def turn_finished(self, session: str, workload: str, now: float) -> float:
        """Seconds to protect the finished turn's blocks."""
        self.retention_protected += 1
        return self.retention.finished(session, workload, now)

    # ---- what it shows ----
    def refresh_snapshot(self, extra: dict[str, Any]) -> None:
        """Rebuild what the endpoint and metrics read (called by the engine thread; readers take the reference)."""
        lengths = self.last_lengths
        self.snapshot_data = {
            "enabled": True,
            "warm_start": self.warm,
            "state_dir": self.state_dir,
            "cost_model": {"ready": self.cost.ready, "observations": self.cost.observations,
                           "seconds_per": self.cost.coefficients(), "corrections": dict(self.cost.corrections),
                           "prediction_error": {kind: {"log_bias": round(e[0], 4), "log_abs": round(e[1], 4)}
                                                for kind, e in sorted(self.prediction_error.items())}},
            "recent_steps": [dict(vars(t)) for t in self.trace],  # plain fields: no deep copy needed
            "speculation": {"method": self.method, "max_draft_tokens": self.max_draft_tokens,
                            "last_draft_lengths": {"requests": len(lengths),
                                                   "mean": sum(lengths) / len(lengths) if lengths else 0.0,
                                                   "max": max(lengths, default=0)},
                            "decided": {"steps": self.decided["steps"], "verifying_steps": self.decided["verifying"],
                                        "draft_tokens": self.decided["draft_tokens"], "probes": self.decided["probes"],
                                        "plain_checks": self.decided["plain_checks"], "gated": self.decided["gated"]},
                            "policy_steps": {arm: self.policy_steps[arm] for arm in ARMS},
                            "draft_tokens": {key: self.draft_counts[key]
                                             for key in ("offered", "verified", "accepted", "default_asked")},
                            "gate": self.gate.summary(), "gate_surplus_seconds": round(self.gate.surplus(), 6),
                            "realism": {name: self.realism(name) for name in self._realised},
                            "acceptance_by_class": self.acceptance.summary(self.max_draft_tokens)},
            "batching": {"target_itl_ms": self.targets.itl_ms, "target_ttft_ms": self.targets.ttft_ms,
                         "last_token_budget": self.last_budget,
                         "chunk_seconds_per": {"token": float(self.chunk_cost.weights[0]),
                                                "attention_pair": float(self.chunk_cost.weights[1]),
                                                "tail": self.chunk_cost.tail}},
            "retention": {"turns_protected": self.retention_protected, "classes": self.retention.summary(), **extra},
            "decode_batch_sizes": dict(sorted(self.batch_sizes.items())),
        }


def choose_graph_batch_sizes(histogram: Counter[int], max_num_seqs: int, max_graphs: int) -> list[int]:
    """CUDA-graph buckets from observed decode batch sizes: at most `max_graphs` sizes (each graph holds memory),
    always including max_num_seqs, chosen to minimise the padding rows the observed steps would have run (a step of
    n sequences replays the smallest bucket >= n): dynamic programming over the observed sizes."""
    sizes = sorted(s for s in histogram if 1 <= s <= max_num_seqs)
    if not sizes:
        return []
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    m = len(sizes)
    steps, rows = [0] * (m + 1), [0] * (m + 1)  # prefix sums of step counts and of their rows
    for t, size in enumerate(sizes):
        steps[t + 1] = steps[t] + histogram.get(size, 0)
        rows[t + 1] = rows[t] + histogram.get(size, 0) * size

    def waste(i: int, j: int) -> int:
        """Padding rows when the steps of sizes[i..j] all replay the bucket sizes[j]."""
        return sizes[j] * (steps[j + 1] - steps[i]) - (rows[j + 1] - rows[i])

    inf = float("inf")
    # best[k][j]: least padding covering sizes[0..j] with k buckets, the last at sizes[j]
    best = [[inf] * m for _ in range(max_graphs + 1)]
    back = [[-1] * m for _ in range(max_graphs + 1)]
    for j in range(m):
        best[1][j] = waste(0, j)
    for k in range(2, max_graphs + 1):
        for j in range(m):
            for i in range(j):
                cost = best[k - 1][i] + waste(i + 1, j)
                if cost < best[k][j]:
                    best[k][j], back[k][j] = cost, i
    k = min(range(1, max_graphs + 1), key=lambda n: (best[n][m - 1], n))
    chosen, j = [], m - 1
    while j >= 0 and k >= 1:
        chosen.append(sizes[j])
        j, k = back[k][j], k - 1
    return sorted(chosen)
