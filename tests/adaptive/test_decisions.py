"""The adaptive engine's parts on their own: cost model, acceptance, goodput draft lengths, token budgets, return-gap
retention, CUDA-graph buckets and the state file."""

from __future__ import annotations

import json
import logging
import random
import statistics
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from reasoning_engine.adaptive.acceptance import AcceptanceModel, PositionCounts, ProposedDrafts, column_quantiles
from reasoning_engine.adaptive.batching import ChunkCost, LatencyTargets, token_budget
from reasoning_engine.adaptive.controller import (PROBE_EVERY, PROBE_LENGTH, PROBE_SHARE, REALISM_PRIOR,
                                                  AdaptiveController, DraftAsk, choose_graph_batch_sizes)
from reasoning_engine.adaptive.cost_model import FEATURES, PLAIN_EVERY, StepCostModel, StepShape, chunk_pairs
from reasoning_engine.adaptive.gate import LOADED_WEIGHT
from reasoning_engine.adaptive.goodput import DraftCandidate, choose_draft_lengths, predicted_step_seconds
from reasoning_engine.adaptive.retention import DEFAULT_HOLD_S, SessionRetention
from reasoning_engine.adaptive.state import STATE_FILE

TRUE = {"step": 2e-3, "query_tokens": 5e-5, "sequences": 1e-5, "context_tokens": 1e-7, "attention_pairs": 2e-9,
        "draft_tokens": 3e-5, "verify_step": 1e-3}


def _true_time(shape: StepShape) -> float:
    return (TRUE["step"] + TRUE["query_tokens"] * shape.query_tokens + TRUE["sequences"] * shape.sequences
            + TRUE["context_tokens"] * shape.context_tokens + TRUE["attention_pairs"] * shape.pairs
            + TRUE["draft_tokens"] * shape.draft_tokens + TRUE["verify_step"] * (shape.verifying > 0))


def _random_shapes(rng: random.Random, count: int) -> list[StepShape]:
    """Decode batches, some verifying drafts, some with a prefill chunk after a cached context."""
    shapes = []
    for _ in range(count):
        seqs = rng.randint(1, 64)
        drafts = rng.choice([0, 0, rng.randint(1, 4 * seqs)])
        verifying = rng.randint(1, min(drafts, seqs)) if drafts else 0
        contexts = seqs * rng.randint(16, 4096)
        chunk, cached = rng.choice([(0, 0), (0, 0), (rng.randint(16, 2048), rng.randint(0, 8192))])
        shapes.append(StepShape(seqs + drafts + chunk, seqs + (chunk > 0), contexts + cached + chunk, drafts,
                                contexts + chunk_pairs(chunk, cached), verifying))
    return shapes


def test_cost_model_recovers_synthetic_step_times() -> None:
    rng = random.Random(0)
    model = StepCostModel()
    for shape in _random_shapes(rng, 400):
        model.observe(shape, _true_time(shape) * rng.uniform(0.97, 1.03))  # 3% noise
    for name, value in TRUE.items():
        assert model.coefficients()[name] == pytest.approx(value, rel=0.15), name
    for shape in _random_shapes(rng, 50):
        assert model.predict(shape) == pytest.approx(_true_time(shape), rel=0.05)


def test_steps_folded_in_at_each_fit_give_the_per_step_decayed_statistics() -> None:
    """Observed steps wait until the next fit to join the statistics; folded in one product, they must equal the
    textbook per-step update (decay everything, add the new step's outer product with relative weight)."""
    rng = random.Random(7)
    model = StepCostModel()
    n = len(FEATURES)
    xtx, xty = np.zeros((n, n)), np.zeros(n)
    for shape in _random_shapes(rng, 300):
        seconds = _true_time(shape) * rng.uniform(0.7, 1.4)  # noisy: surprises fit at irregular steps
        model.observe(shape, seconds)
        x = shape.features()
        xtx = model.decay * xtx + np.outer(x, x) / seconds ** 2
        xty = model.decay * xty + x / seconds
    assert model._pending  # the last steps since a fit are still waiting
    saved = model.to_dict()
    assert not model._pending
    np.testing.assert_allclose(np.array(saved["xtx"]), xtx, rtol=1e-9)
    np.testing.assert_allclose(np.array(saved["xty"]), xty, rtol=1e-9)
    model._set_weights(model._solve())
    reloaded = StepCostModel.from_dict(saved)
    for shape in _random_shapes(rng, 20):
        assert reloaded.predict(shape) == pytest.approx(model.predict(shape), rel=1e-9)


def test_cost_model_follows_a_slower_machine_and_stays_non_negative() -> None:
    rng = random.Random(1)
    model = StepCostModel()
    for shape in _random_shapes(rng, 300):
        model.observe(shape, _true_time(shape))
    for shape in _random_shapes(rng, 1500):  # the machine got twice as slow
        model.observe(shape, 2 * _true_time(shape))
    shape = StepShape(32, 32, 32 * 1000)
    assert model.predict(shape) == pytest.approx(2 * _true_time(shape), rel=0.1)
    assert all(value >= 0 for value in model.coefficients().values())


def test_each_fit_is_the_non_negative_least_squares_optimum() -> None:
    """Fits start from the last fit's free features; every fit is still the exact non-negative optimum of the decayed
    statistics (checked against all 256 subsets of free features), through noise and features that are truly zero."""
    from itertools import combinations

    def objective(model: StepCostModel, w: np.ndarray) -> float:
        a = model._xtx + model.ridge * np.diag(np.maximum(np.diag(model._xtx), 1e-30))
        return float(w @ a @ w - 2 * w @ model._xty)  # the quadratic the fit minimises

    def optimum(model: StepCostModel) -> float:
        n = len(FEATURES)
        a = model._xtx + model.ridge * np.diag(np.maximum(np.diag(model._xtx), 1e-30))
        best = 0.0
        for size in range(1, n + 1):
            for free in combinations(range(n), size):
                w = np.zeros(n)
                w[list(free)] = np.linalg.lstsq(a[np.ix_(free, free)], model._xty[list(free)], rcond=None)[0]
                if (w >= 0).all():
                    best = min(best, objective(model, w))
        return best

    rng = random.Random(4)
    model = StepCostModel()
    checked = 0
    for i, shape in enumerate(_random_shapes(rng, 400)):
        slow = 1.6 if 150 <= i < 250 else 1.0  # the machine slows for a while: the free set moves
        model.observe(shape, slow * _true_time(shape) * rng.uniform(0.8, 1.25))
        if not model._pending and i % 5 == 0:  # just refitted
            assert (model.weights >= 0).all()
            best = optimum(model)
            assert objective(model, model.weights) <= best + 1e-9 * abs(best)
            checked += 1
    assert checked > 10


def test_every_fit_ends_on_degenerate_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps make features collinear (context read = attention pairs) and drafts come and go: a fit's
    active-set pass whose blocking weight rounded to a hair above zero repeated forever (an engine step hung in the
    cost model). Every fit now ends within a bounded number of solves."""
    import reasoning_engine.adaptive.cost_model as cost_model

    solves = [0]
    solve_over = cost_model._solve_over

    def counted(*args):  # type: ignore[no-untyped-def]
        solves[0] += 1
        return solve_over(*args)

    monkeypatch.setattr(cost_model, "_solve_over", counted)
    n = len(FEATURES)
    for seed in range(280, 300):  # 290 hung
        rng = random.Random(seed)
        model = StepCostModel()
        for _ in range(120):
            batch = rng.choice([1, 1, 2, 3])
            context = rng.randint(5, 60) * batch
            drafts = rng.choice([0, 0, 0, batch * rng.randint(1, 4)])
            shape = StepShape(batch + drafts, batch, context + drafts, drafts, draft_sequences=batch if drafts else 0)
            solves[0] = 0
            model.observe(shape, rng.choice([0.002, 0.0021, 0.0035, 0.004, 0.02]) * rng.uniform(0.5, 2.0))
            assert solves[0] <= (n + 1) * (4 * n + 1), seed
            assert (model.weights >= 0).all()


def test_cost_model_tells_a_steps_switch_to_verification_from_its_drafts() -> None:
    """The first draft in a batch costs the whole step's switch off the decode path; the next ones cost little."""
    rng = random.Random(5)
    model = StepCostModel()
    for shape in _random_shapes(rng, 400):
        model.observe(shape, _true_time(shape))
    decode = StepShape(32, 32, 32 * 300, draft_sequences=0)
    one = StepShape(34, 32, 32 * 300, 2, draft_sequences=1)
    every = StepShape(96, 32, 32 * 300, 64, draft_sequences=32)
    for shape in (decode, one, every):
        assert model.predict(shape) == pytest.approx(_true_time(shape), rel=0.02)
    first = model.predict(one) - model.predict(decode)
    next_ones = (model.predict(every) - model.predict(one)) / 31
    assert first > 4 * next_ones


def _serving_steps(rng: random.Random, count: int) -> list[StepShape]:
    """A busy server's steps: 16-31 decoding requests, half the steps verifying drafts of 1-8 of them."""
    shapes = []
    for _ in range(count):
        seqs = rng.randint(16, 31)
        context = seqs * rng.randint(300, 600)
        if rng.random() < 0.5:
            shapes.append(StepShape(seqs, seqs, context, draft_sequences=0))
        else:
            verifying = rng.randint(1, 8)
            drafts = sum(rng.randint(2, 8) for _ in range(verifying))
            shapes.append(StepShape(seqs + drafts, seqs, context + drafts, drafts, draft_sequences=verifying))
    return shapes


def _serving_time(shape: StepShape) -> float:
    """A serving step's time: a fixed cost, per sequence and per context token; verification adds its switch and a
    cost per draft token."""
    work = 10e-3 + 0.5e-3 * shape.sequences + 2e-6 * shape.context_tokens
    return work + 3e-3 + 0.3e-3 * shape.draft_tokens if shape.verifying else work


def test_cost_model_corrects_its_bias_by_kind_of_step() -> None:
    """Step times measured with 30% noise: the relative-error fit predicts them low; the corrections remove that
    bias, for plain and verifying steps alike."""

    measured = _serving_time
    rng = random.Random(8)
    model = StepCostModel()
    for shape in _serving_steps(rng, 600):
        model.observe(shape, measured(shape) * rng.uniform(0.7, 1.3))
    fresh = _serving_steps(random.Random(9), 400)
    for verifying in (False, True):
        kind = [shape for shape in fresh if bool(shape.verifying) == verifying]
        corrected = statistics.fmean(model.predict(shape) / measured(shape) for shape in kind)
        linear = statistics.fmean(float(shape.features() @ model.weights) / measured(shape) for shape in kind)
        assert corrected == pytest.approx(1.0, abs=0.03) and abs(linear - 1.0) > 0.04, (verifying, corrected, linear)
    restored = StepCostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert restored.corrections == model.corrections
    assert restored.predict(fresh[0]) == pytest.approx(model.predict(fresh[0]), rel=0.01)  # weights refitted on load


def test_verifying_steps_that_run_slower_do_not_move_the_plain_steps_prediction() -> None:
    """The chooser weighs a step with drafts against the same step without, so an error found in one must not be
    carried into the other: when verifying steps start taking a fifth longer than the model says, its prediction
    for them follows and its prediction for plain steps stays (with one correction shared by both, it rose 9%)."""

    work = _serving_time
    rng = random.Random(8)
    model = StepCostModel()
    for shape in _serving_steps(rng, 400):
        model.observe(shape, work(shape))
    plain = StepShape(24, 24, 24 * 450, draft_sequences=0)
    verifying = StepShape(40, 24, 24 * 450 + 16, 16, draft_sequences=4)
    before = model.predict(plain)
    for shape in _serving_steps(rng, 400):
        if shape.verifying:
            model.observe(shape, 1.2 * work(shape))
    assert model.predict(plain) == pytest.approx(before, rel=0.02)
    assert model.predict(verifying) == pytest.approx(1.2 * work(verifying), rel=0.03)


def test_a_plain_step_is_due_when_drafting_has_won_for_a_while() -> None:
    """Each side's correction is measured only when that side runs: after PLAIN_EVERY verifying steps of a kind the
    chooser leaves one step plain whatever the drafts promise (and the proposer is not asked for them), then drafts
    again once that step is measured."""
    controller = _controller(None)
    controller.cost = _cost(fixed=10e-3, per_token=0.1e-3)
    asks = [DraftAsk("r0", "agent", 8, 300, probs=[0.95 ** (j + 1) for j in range(8)])]
    step = StepShape(1, 1, 301, draft_sequences=0)
    for _ in range(PLAIN_EVERY):
        assert controller.draft_lengths(asks, step) == [8]
        controller.observe_step(StepShape(9, 1, 309, 8, draft_sequences=1), 11e-3, 1)
    assert controller.draft_caps(asks, step) == [0]
    assert controller.draft_lengths(asks, step) == [0]
    assert controller.draft_lengths(asks, StepShape(40, 40, 40 * 301, draft_sequences=0))  # other kinds draft on
    controller.observe_step(step, 10e-3, 1)
    assert controller.draft_lengths(asks, step) == [8]
    assert controller.decided["plain_checks"] == 1


def test_a_request_whose_drafts_are_dropped_is_proposed_for_less_often() -> None:
    """Caps come from the class's history, drafts' lengths from the drafts' own probabilities: a request whose drafts
    the chooser drops (their probabilities are low) is proposed for after waits that double up to PROBE_EVERY
    steps, not every step; once its drafts are kept again, it is proposed for every step."""
    controller = _controller(None)
    controller.cost = _cost(fixed=10e-3, per_token=0.5e-3)
    for _ in range(50):
        controller.record_draft("earlier", "agent", 8, 8)  # the class's history promises long drafts
    step = StepShape(4, 4, 4 * 301, draft_sequences=0)

    def run(steps: int, prob: float) -> list[bool]:
        proposed = []
        for _ in range(steps):
            caps = controller.draft_caps([DraftAsk(f"r{i}", "agent", 8, 300) for i in range(4)], step)
            proposed.append(caps[0] > 0)
            drafts = [DraftAsk(f"r{i}", "agent", cap, 300, probs=[prob ** (j + 1) for j in range(cap)])
                      for i, cap in enumerate(caps)]
            for ask, n in zip(drafts, controller.draft_lengths(drafts, step)):
                if n:
                    controller.record_draft(ask.seq_id, ask.workload, n, n if prob > 0.5 else 0)
        return proposed

    dropped = run(64, 0.02)
    assert dropped[:4] == [True, False, True, False]  # dropped once: one step's wait, twice: two steps'
    assert 64 // PROBE_EVERY <= sum(dropped) <= 64 // PROBE_EVERY + 8
    kept = run(40, 0.95)
    assert all(kept[-30:])


def test_acceptance_counts_per_position_and_prior_from_the_class() -> None:
    counts = PositionCounts()
    for accepted in (3, 3, 1, 0):  # drafts of 3: positions seen 3, 3, 2, 1 times
        counts.record(3, accepted)
    assert counts.trials == [4.0, 3.0, 2.0] and counts.accepted == [3.0, 2.0, 2.0]
    model = AcceptanceModel()
    for _ in range(50):
        model.record("old", "suffix", "agent", 4, 4)
    fresh = model.rates("new", "suffix", "agent", 4)
    assert all(rate > 0.75 for rate in fresh)  # a new request of a known kind starts high
    assert model.rates("new", "suffix", "chat", 4)[0] == pytest.approx(0.5)  # an unknown kind: no prior


def test_a_class_of_one_failed_draft_weighs_as_one_draft() -> None:
    """The class prior is scaled down to PRIOR_WEIGHT drafts, never up: one failed draft of a cold proposer counted
    as four had put every new request of its kind at 0.08."""
    model = AcceptanceModel()
    model.record("first", "suffix", "agent", 2, 0)
    assert model.rates("new", "suffix", "agent", 1)[0] == pytest.approx(0.25)  # (0 + 0.5) / (1 + 1)


def _cost(fixed: float, per_token: float) -> StepCostModel:
    """A model fitted to steps costing `fixed` plus `per_token` per token run (draft tokens included)."""
    model = StepCostModel()
    for shape in _random_shapes(random.Random(4), 200):
        model.observe(shape, fixed + per_token * shape.query_tokens)
    return model


def test_goodput_drafts_long_when_cheap_and_likely() -> None:
    cost = _cost(fixed=10e-3, per_token=0.1e-3)  # batch 1 decode: a step is its fixed cost
    high = DraftCandidate([0.9] * 8, 8)
    assert choose_draft_lengths([high], StepShape(1, 1, 500), cost) == [8]


def test_goodput_gives_no_draft_when_acceptance_is_low_or_the_batch_is_large() -> None:
    cost = _cost(fixed=10e-3, per_token=0.1e-3)
    low = DraftCandidate([0.005] * 8, 8)  # below the 1% a draft token adds to the step
    assert choose_draft_lengths([low], StepShape(1, 1, 500), cost) == [0]
    compute_bound = _cost(fixed=1e-3, per_token=1e-3)  # a large batch: every token costs
    batch = [DraftCandidate([0.6] * 8, 8) for _ in range(64)]
    lengths = choose_draft_lengths(batch, StepShape(64, 64, 64 * 500), compute_bound)
    assert lengths == [0] * 64
    mixed = [DraftCandidate([0.95] * 8, 8), DraftCandidate([0.1] * 8, 8)]
    long, short = choose_draft_lengths(mixed, StepShape(2, 2, 1000), cost)
    assert long > short  # the likely request gets the longer draft


def test_drafts_predicted_to_gain_less_than_the_margin_are_not_verified() -> None:
    """One decode, a step of 11 ms, a draft token adding 1 ms: a token accepted at 0.12 would make the step 2.7%
    more productive, within the cost model's errors (such drafts delivered less than plain steps), at 0.25 14.6%."""
    cost = _cost(fixed=10e-3, per_token=1e-3)
    step = StepShape(1, 1, 100, draft_sequences=0)
    assert choose_draft_lengths([DraftCandidate([0.12], 1, 100)], step, cost) == [0]
    assert choose_draft_lengths([DraftCandidate([0.25], 1, 100)], step, cost) == [1]


def test_a_prefill_chunk_beside_the_decodes_does_not_lower_the_bar_for_drafts() -> None:
    """16 decodes whose drafts are accepted at 0.3 per token do not pay at this batch; a 1000-token chunk in the same
    step makes the step 3x longer, and counted in the decodes' rate, it would make the drafts look worth it. Judged
    against the step less the chunk's predicted time, the choice is the decodes' own."""
    cost = _cost(fixed=10e-3, per_token=1e-3)
    batch = [DraftCandidate([0.3] * 8, 8, context=500) for _ in range(16)]
    decodes = StepShape(16, 16, 16 * 500, draft_sequences=0)
    with_chunk = StepShape(16 + 1000, 17, 16 * 500 + 1000, attention_pairs=16 * 500 + chunk_pairs(1000, 0),
                           draft_sequences=0)
    assert choose_draft_lengths(batch, decodes, cost) == [0] * 16
    assert sum(choose_draft_lengths(batch, with_chunk, cost)) > 0  # the chunk's time diluting the decodes' rate
    other = cost.predict(with_chunk) - cost.predict(decodes)
    assert choose_draft_lengths(batch, with_chunk, cost, other) == [0] * 16
    controller = AdaptiveController({"model": "m"}, "suffix", 8, None, LatencyTargets())
    controller.cost = cost
    asks = [DraftAsk(f"r{i}", "agent", 8, 500, probs=[0.3 ** (j + 1) for j in range(8)]) for i in range(16)]
    assert controller.draft_lengths(asks, with_chunk, decodes) == [0] * 16


def test_a_step_beside_a_chunk_scores_its_decodes_against_the_whole_step_predicted_without_drafts() -> None:
    """The gate scores a step by its decodes' tokens per second against the cost model's plain prediction; beside a
    prefill chunk that prediction must include the chunk (else the step would look several times slower than plain)
    and leave out the drafts (else a drafted step's own cost would excuse it). Such steps go to the buckets beside
    a chunk."""
    controller = _controller(None)
    controller.cost = _cost(fixed=10e-3, per_token=1e-3)
    decodes = StepShape(16 + 32, 16, 16 * 500 + 32, draft_tokens=32, draft_sequences=4)
    step = StepShape(decodes.query_tokens + 400, 17, decodes.context_tokens + 400,
                     attention_pairs=decodes.pairs + chunk_pairs(400, 0), draft_tokens=32, draft_sequences=4)
    plain = controller.cost.predict(StepShape(16 + 400, 17, 16 * 500 + 400,
                                              attention_pairs=16 * 500 + chunk_pairs(400, 0)))
    for _ in range(3):  # 24 tokens from 16 decodes in the time the plain step was predicted to take: 1.5
        controller.observe_step(step, plain, 16, policy="adaptive", tokens=24, drafting_seconds=plain,
                                decodes=decodes)
    summary = controller.gate.summary()
    assert "8-15" not in summary and "16-31" not in summary
    assert summary["16-31 beside a chunk"]["adaptive"] == pytest.approx(1.5)
    assert summary["16-31 beside a chunk"]["adaptive_steps"] == 3


def test_token_budget_keeps_decodes_under_the_itl_target() -> None:
    cost = _cost(fixed=5e-3, per_token=0.2e-3)
    decodes = StepShape(16, 16, 16 * 100)
    free = token_budget(cost, decodes, 2048, LatencyTargets())
    assert free == 2048  # no target: the configured budget
    budget = token_budget(cost, decodes, 2048, LatencyTargets(itl_ms=20.0))
    chunk = budget - 16
    assert cost.predict(StepShape(budget, 17, 16 * 100 + chunk, 0, 16 * 100 + chunk_pairs(chunk, 0))) <= 0.0201
    assert 16 + 16 <= budget < 2048  # a prefill still moves forward
    at_risk = token_budget(cost, decodes, 2048, LatencyTargets(itl_ms=20.0, ttft_ms=200.0), oldest_wait_s=0.19,
                           waiting_tokens=1000)
    assert at_risk >= 1016  # the waiting prompt's first token is due: it goes through


def test_chunk_cost_learns_tokens_and_attention_pairs_and_plans_for_its_tail() -> None:
    """Chunks cost a * tokens + b * pairs beyond their decodes; with noise the fit's tail factor covers the slow
    steps, so a chunk sized by it stays within its time."""
    rng = random.Random(5)
    exact = ChunkCost()
    for _ in range(20):
        tokens, context = rng.randint(64, 1024), rng.randint(0, 1500)
        exact.observe(tokens, chunk_pairs(tokens, context), 1e-4 * tokens + 1e-7 * chunk_pairs(tokens, context))
    assert list(exact.weights) == pytest.approx([1e-4, 1e-7], rel=1e-6) and exact.tail == pytest.approx(1.0)
    noisy = ChunkCost()
    times = []
    for _ in range(32):
        tokens, context = rng.randint(64, 1024), rng.randint(0, 1500)
        seconds = (1e-4 * tokens + 1e-7 * chunk_pairs(tokens, context)) * rng.uniform(0.8, 1.3)
        noisy.observe(tokens, chunk_pairs(tokens, context), seconds)
        times.append((tokens, context, seconds))
    within = sum(seconds <= noisy.predict(tokens, context) * (1 + 1e-9) for tokens, context, seconds in times)
    assert noisy.tail > 1.1 and within >= 0.85 * len(times)
    ignored = ChunkCost()
    ignored.observe(8, 36, 0.01)  # a handful of tokens: the step's noise, not the chunk's cost
    assert not ignored.ready


def test_chunk_cost_read_between_steps_fits_as_if_read_once_at_the_end() -> None:
    """The fit is redone when read after new steps (not at each chunk step), so reading it never gives a stale one."""
    rng = random.Random(6)
    read_often, read_once = ChunkCost(), ChunkCost()
    for _ in range(40):  # past CHUNK_WINDOW: the oldest steps leave the fit
        tokens, context = rng.randint(64, 1024), rng.randint(0, 1500)
        seconds = (2e-4 * tokens + 3e-7 * chunk_pairs(tokens, context)) * rng.uniform(0.8, 1.3)
        for cost in (read_often, read_once):
            cost.observe(tokens, chunk_pairs(tokens, context), seconds)
        read_often.predict(tokens, context)
    assert list(read_often.weights) == list(read_once.weights) and read_often.tail == read_once.tail
    reloaded = ChunkCost()
    reloaded.load(read_once.to_list())
    assert list(reloaded.weights) == list(read_once.weights) and reloaded.tail == read_once.tail


def test_the_itl_budget_sizes_chunks_by_what_chunks_cost_not_by_the_decode_fitted_model() -> None:
    """The step cost model here has never seen a chunk and thinks tokens nearly free; the chunk cost has measured
    them, and the budget follows it."""
    cost = _cost(fixed=5e-3, per_token=0.01e-3)
    decodes = StepShape(16, 16, 16 * 100)
    chunk_cost = ChunkCost()
    for tokens in (64, 256, 512, 1024):
        chunk_cost.observe(tokens, chunk_pairs(tokens, 0), 0.2e-3 * tokens)
    from_model = token_budget(cost, decodes, 4096, LatencyTargets(itl_ms=100.0)) - 16
    chunk = token_budget(cost, decodes, 4096, LatencyTargets(itl_ms=100.0), chunk_cost=chunk_cost) - 16
    allowance = 0.8 * 0.1 - cost.predict(decodes)
    assert chunk_cost.predict(chunk, 0) <= allowance < chunk_cost.predict(chunk + 1, 0)
    assert chunk == pytest.approx(allowance / 0.2e-3, abs=2) and from_model > 2 * chunk


def test_return_gaps_set_the_hold_time() -> None:
    retention = SessionRetention()
    assert retention.finished("s0", "agent/tool_call", 0.0) == DEFAULT_HOLD_S
    now = 0.0
    for i in range(20):
        retention.finished(f"s{i}", "agent/tool_call", now)
        now += 3.0 + i % 3  # tools take 3-5 s
        assert retention.arrived(f"s{i}", now) is not None
    hold = retention.hold_seconds("agent/tool_call")
    assert 5.0 <= hold <= 5.0 * 1.5 + 1e-9
    assert retention.arrived("never-finished", now) is None


def test_graph_buckets_follow_the_observed_batch_sizes() -> None:
    seen = Counter({1: 500, 3: 200, 24: 300, 25: 10, 60: 5})
    sizes = choose_graph_batch_sizes(seen, 64, 4)
    assert sizes[-1] == 64 and len(sizes) <= 4
    assert {1, 3, 25} <= set(sizes)  # the common sizes get their own bucket
    assert choose_graph_batch_sizes(Counter(), 64, 4) == []


def _controller(state_dir: Path | None, model: str = "m") -> AdaptiveController:
    return AdaptiveController({"model": model, "device": "cpu"}, "suffix", 8, str(state_dir) if state_dir else None,
                              LatencyTargets())


def _probe_run(controller: AdaptiveController, batch: int, steps: int) -> tuple[list[list[int]], float]:
    """`steps` decode steps of `batch` requests whose drafts are never accepted: each step's lengths, and the predicted
    time the probes added over those steps (as a share of the predicted time without them)."""
    asks = [DraftAsk(f"r{i}", "agent", 8, 300) for i in range(batch)]
    step = StepShape(batch, batch, batch * 301, draft_sequences=0)
    chosen, plain, extra = [], 0.0, 0.0
    for _ in range(steps):
        lengths = controller.draft_lengths(asks, step)
        candidates = [DraftCandidate([0.0] * 8, 8, 300)] * batch
        base = predicted_step_seconds(controller.cost, step, candidates, [0] * batch)
        plain += base
        extra += predicted_step_seconds(controller.cost, step, candidates, lengths) - base
        for ask, n in zip(asks, lengths):
            if n:
                controller.record_draft(ask.seq_id, ask.workload, n, 0)
        chosen.append(lengths)
    return chosen, extra / plain


def test_probes_stay_within_their_share_and_bunch_where_the_switch_is_dear() -> None:
    """Requests whose drafts fail still get probed now and then (acceptance may rise), but exploration costs at most
    PROBE_SHARE of the time: at batch 32, where a step's switch to verification is dear, the probes of many requests
    share few steps; at batch 1, where a probe costs almost nothing, every request is probed every PROBE_EVERY steps."""
    dear_switch = {"step": 4e-3, "sequences": 3e-5, "draft_tokens": 3e-5, "verify_step": 1e-3}
    controller = _controller(None)
    for shape in _random_shapes(random.Random(6), 300):
        controller.observe_step(shape, sum(dear_switch.get(name, 0.0) * value
                                           for name, value in zip(FEATURES, shape.features())), shape.sequences)
    for i in range(32):
        for _ in range(20):
            controller.record_draft(f"r{i}", "agent", 2, 0)
    chosen, share = _probe_run(controller, 32, 400)
    probe_steps = [lengths for lengths in chosen if any(lengths)]
    assert all(n in (0, PROBE_LENGTH) for lengths in chosen for n in lengths)  # nothing but probes
    assert 0 < share <= PROBE_SHARE * 1.05
    assert sum(map(sum, probe_steps)) / len(probe_steps) >= 16 * PROBE_LENGTH  # many requests per probe step
    for i in range(32):  # nobody is starved of probes
        assert sum(1 for lengths in chosen if lengths[i]) >= 3

    cheap = _controller(None)
    cheap.cost = _cost(fixed=10e-3, per_token=1e-6)
    for _ in range(20):
        cheap.record_draft("r0", "agent", 2, 0)
    chosen, share = _probe_run(cheap, 1, 80)
    probed_at = [t for t, lengths in enumerate(chosen) if lengths[0]]
    assert probed_at and all(b - a == PROBE_EVERY for a, b in zip(probed_at, probed_at[1:]))
    assert share <= PROBE_SHARE


def test_state_round_trips(tmp_path: Path) -> None:
    first = _controller(tmp_path)
    rng = random.Random(2)
    for shape in _random_shapes(rng, 50):
        first.observe_step(shape, _true_time(shape), decode_batch=shape.sequences, draft_length=shape.draft_tokens)
    assert first.verified_lengths and 0 not in first.verified_lengths
    for _ in range(10):
        first.record_draft("r", "agent", 4, 3)
    first.retention.finished("s", "agent/tool_call", 0.0)
    first.retention.arrived("s", 4.0)
    for arm in ("default", "adaptive", "plain") * 10:
        first.gate.observe(24, arm, 30 if arm == "adaptive" else 24, 0.03, 0.028)
        first.gate.observe(12, arm, 14 if arm == "default" else 12, 0.03, 0.03, beside_chunk=True)
    for tokens in (100, 300, 900):
        first.observe_chunk(StepShape(8, 8, 800), tokens, chunk_pairs(tokens, 50), 0.005 + 2e-4 * tokens)
    assert first.chunk_cost.ready
    for i in range(10):
        first.proposed_drafts.add([0.9, 0.7] if i % 3 == 0 else [0.2], cap=4)
    first.save()
    second = _controller(tmp_path)
    assert second.warm
    assert second.cost.coefficients() == pytest.approx(first.cost.coefficients())
    assert second.acceptance.to_dict() == first.acceptance.to_dict()
    assert second.retention.to_dict() == first.retention.to_dict()
    assert second.batch_sizes == first.batch_sizes
    assert second.verified_lengths == first.verified_lengths
    # the gate's scores come back as a prior: the same means, steps and step times, at most LOADED_WEIGHT steps'
    # weight (so the surplus they give counts as many steps at most)
    loaded, saved = second.gate.summary(), first.gate.summary()
    for b, bucket in first.gate.buckets.items():
        for arm, score in bucket.arms.items():
            again = second.gate.buckets[b].arms[arm]
            assert again.timed <= LOADED_WEIGHT and again.step_seconds == pytest.approx(score.step_seconds)
    assert loaded == saved and loaded["16-31"]["adaptive_steps"] == 10
    assert loaded["8-15 beside a chunk"]["plain_steps"] == 10
    assert all(score.weight <= LOADED_WEIGHT for bucket in second.gate.buckets.values()
               for score in bucket.arms.values())
    assert list(second.chunk_cost.weights) == pytest.approx(list(first.chunk_cost.weights))
    assert second.proposed_drafts.survival() == pytest.approx(first.proposed_drafts.survival())
    assert second.proposed_drafts.survival()[:2] == pytest.approx([0.9, 0.7])


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign", "wrong_shape", "bad_gate", "bad_chunks",
                                    "bad_drafts", "not_finite"])
def test_bad_state_starts_cold_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    first = _controller(tmp_path)
    for shape in _random_shapes(random.Random(3), 20):
        first.observe_step(shape, _true_time(shape), decode_batch=1)
    first.save()
    path = tmp_path / STATE_FILE
    text = path.read_text()
    if damage == "corrupt":
        path.write_text("{not json")
    elif damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "wrong_shape":
        data = json.loads(text)
        data["state"]["cost_model"]["xtx"] = [[1.0]]
        path.write_text(json.dumps(data))
    elif damage == "bad_gate":
        data = json.loads(text)
        data["state"]["policy_gate"] = {"5": [1e9, 3, 1.0]}
        path.write_text(json.dumps(data))
    elif damage == "bad_chunks":
        data = json.loads(text)
        data["state"]["chunk_steps"] = [[100, -5]]
        path.write_text(json.dumps(data))
    elif damage == "bad_drafts":
        data = json.loads(text)
        data["state"]["proposed_drafts"] = [[0.5, 7.0]]
        path.write_text(json.dumps(data))
    elif damage == "not_finite":  # every part checks its ranges, but NaN passes comparisons: the parser refuses it
        data = json.loads(text)
        data["state"]["return_gaps"] = {"default": [float("nan")]}
        data["state"]["acceptance"] = {key: {"trials": [float("inf")], "accepted": [1.0]}
                                       for key in data["state"]["acceptance"]}
        path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING):
        second = _controller(tmp_path, model="another" if damage == "foreign" else "m")
    assert not second.warm and second.cost.observations == 0
    assert "starting cold" in caplog.text


def test_drafts_that_deliver_less_than_expected_shrink_the_next_ones() -> None:
    """The chooser drafts where estimated acceptance is highest, and those estimates run high (the winner's curse):
    when verified drafts deliver fewer tokens than expected, expectations are scaled down (never up) and drafts get
    shorter or vanish."""
    controller = _controller(None)
    controller.cost = _cost(fixed=10e-3, per_token=0.5e-3)
    asks = [DraftAsk(f"r{i}", "agent", 8, 300) for i in range(4)]
    step = StepShape(4, 4, 4 * 301, draft_sequences=0)
    for i in range(4):
        for _ in range(10):
            controller.record_draft(f"r{i}", "agent", 8, 6)
    first = controller.draft_lengths(asks, step)
    assert sum(first) > 0 and controller.realism("history") == 1.0
    for _ in range(30):  # every verified draft delivers a quarter of what was expected
        lengths = controller.draft_lengths(asks, step)
        for ask, n in zip(asks, lengths):
            if n:
                expected = controller._expected[ask.seq_id][1]
                controller.record_draft(ask.seq_id, ask.workload, n, int(expected / 4))
    assert controller.realism("history") < 0.5
    assert sum(controller.draft_lengths(asks, step)) < sum(first)
    for _ in range(50):  # better than expected: the scale comes back to 1, not above
        lengths = controller.draft_lengths(asks, step)
        for ask, n in zip(asks, lengths):
            if n:
                controller.record_draft(ask.seq_id, ask.workload, n, n)
    assert controller.realism("history") == 1.0


def test_drafts_own_probabilities_decide_over_the_requests_history() -> None:
    """Where the proposer says how likely each drafted node is (a suffix tree: how often the continuation followed
    this context), that, not the request's past acceptance, decides: a likely draft is verified for a request with a
    poor record, an unlikely one is not for a request with a good record, and only as far as its nodes stay likely.
    Its expectations have their own realism, measured against what they said before any scaling."""
    controller = _controller(None)
    controller.cost = _cost(fixed=10e-3, per_token=1e-3)
    for _ in range(20):
        controller.record_draft("poor", "agent", 8, 0)
        controller.record_draft("good", "agent", 8, 8)
    asks = [DraftAsk("poor", "agent", 8, 300, [0.97, 0.95, 0.93, 0.9, 0.5, 0.2, 0.05, 0.01]),
            DraftAsk("good", "agent", 8, 300, [0.05, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01])]
    lengths = controller.draft_lengths(asks, StepShape(2, 2, 602, draft_sequences=0))
    assert 4 <= lengths[0] < 8 and lengths[1] == 0
    assert controller._expected["poor"] == ("proposer", pytest.approx(sum(asks[0].probs[:lengths[0]])))
    for _ in range(100):  # the proposer's drafts deliver half of what it said
        controller._expected["poor"] = ("proposer", 4.0)
        controller.record_draft("poor", "agent", 4, 2)
    assert controller.realism("proposer") == pytest.approx(0.5, abs=0.03)
    assert controller.realism("history") == 1.0


def test_draft_caps_spare_the_proposer_where_no_draft_would_pay() -> None:
    """A text proposer is asked only for what could be verified: nothing for a request whose drafts would not pay,
    a probe's length once one is due, and asking changes no state."""
    controller = _controller(None)
    controller.cost = _cost(fixed=10e-3, per_token=1e-3)
    asks = [DraftAsk("likely", "agent", 8, 300), DraftAsk("unlikely", "chat", 8, 300)]
    for _ in range(20):
        controller.record_draft("likely", "agent", 8, 8)
        controller.record_draft("unlikely", "chat", 8, 0)
    step = StepShape(2, 2, 602, draft_sequences=0)
    caps = controller.draft_caps(asks, step)
    assert caps[0] > 0 and caps[1] == 0
    assert controller.draft_caps(asks, step) == caps  # no side effects
    for _ in range(PROBE_EVERY - 1):
        controller.draft_lengths([asks[1]], StepShape(1, 1, 301, draft_sequences=0))
    assert controller.draft_caps(asks, step)[1] == PROBE_LENGTH


def test_proposed_drafts_say_how_likely_the_good_drafts_are_and_nodes_never_asked_for_stay_open() -> None:
    drafts = ProposedDrafts(4)
    assert drafts.survival() is None
    for i in range(20):  # one in five drafts is good
        drafts.add([0.9, 0.8] if i % 5 == 0 else [0.3], cap=2)
    good = drafts.survival()
    assert good[0] == pytest.approx(0.9) and good[1] == pytest.approx(0.8)
    assert good[2:] == [good[1], good[1]]  # never asked past 2 nodes: as likely as the second, so caps may grow
    for _ in range(ProposedDrafts.SIZE):  # the proposer now drafts short and unlikely: the old drafts are forgotten
        drafts.add([0.2], cap=4)
    assert drafts.survival() == pytest.approx([0.2, 0.0, 0.0, 0.0])


def test_column_quantiles_match_numpy_over_the_values_each_column_has() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows, columns = int(rng.integers(1, 65)), int(rng.integers(1, 9))
        values = rng.random((rows, columns))
        values[rng.random((rows, columns)) < rng.random()] = np.nan
        values[int(rng.integers(0, rows))] = rng.random(columns)  # each column has a value
        for q in (0.0, 0.5, 0.9, 1.0):
            assert column_quantiles(values, q) == pytest.approx(np.nanquantile(values, q, axis=0))


def test_proposed_drafts_reload_in_order_under_another_draft_length() -> None:
    """Saved after wrapping around, the drafts reload oldest first (so the next ones replace the oldest); under a
    longer draft length the nodes past the saved one are unknown, under a shorter one they are dropped."""
    drafts = ProposedDrafts(2)
    for i in range(ProposedDrafts.SIZE + 5):
        drafts.add([i / 100, i / 200], cap=2)
    saved = drafts.to_list()
    assert len(saved) == ProposedDrafts.SIZE and saved[0] == [0.05, 0.025] and saved[-1][0] == pytest.approx(0.68)
    longer = ProposedDrafts(4)
    longer.load(saved)
    assert longer.to_list() == [row + [None, None] for row in saved]
    assert longer.survival()[2:] == [longer.survival()[1]] * 2
    longer.add([1.0], cap=1)
    assert longer.to_list()[0] == saved[1] + [None, None] and longer.to_list()[-1] == [1.0, None, None, None]
    shorter = ProposedDrafts(1)
    shorter.load(saved)
    assert shorter.to_list() == [row[:1] for row in saved]


def test_draft_caps_follow_the_proposers_good_drafts_not_a_requests_failed_one() -> None:
    """A request whose first drafts failed has a history of 0.07 per position, so its caps were 0 and its proposer
    was not asked again, although the drafts verified on the agent traces were the likely ones; now caps assume a
    draft as likely as the proposer's recent good ones, and stay 0 where even those would not pay."""
    controller = _controller(None)
    controller.cost = _cost(fixed=10e-3, per_token=1e-3)
    ask = DraftAsk("failed", "agent", 8, 300)
    for _ in range(3):
        controller.record_draft("failed", "agent", 4, 0)
    step = StepShape(1, 1, 301, draft_sequences=0)
    assert controller.draft_caps([ask], step) == [0]
    others = [DraftAsk(f"r{i}", "agent", 8, 300) for i in range(10)]
    for i in range(10):  # the proposer's drafts for others: one in three is likely
        controller._proposed = {f"r{i}": 8}
        probs = [0.95 ** (j + 1) for j in range(8)] if i % 3 == 0 else [0.3, 0.1]
        controller.draft_lengths([replace(others[i], probs=probs)], step)
    assert controller.draft_caps([ask], step)[0] >= 4
    controller.cost = _cost(fixed=1e-3, per_token=1e-3)  # a large batch where every drafted token costs
    batch = [DraftAsk(f"b{i}", "agent", 8, 300) for i in range(64)]
    assert controller.draft_caps(batch, StepShape(64, 64, 64 * 301, draft_sequences=0)) == [0] * 64


def test_a_few_failed_drafts_do_not_condemn_a_proposer() -> None:
    """Realism starts from REALISM_PRIOR expected tokens delivered as said: a cold proposer's first three drafts,
    expecting 3 tokens each and getting none, leave its next likely draft verified."""
    controller = _controller(None)
    controller.cost = _cost(fixed=10e-3, per_token=1e-3)
    for _ in range(3):
        controller._expected["r"] = ("proposer", 3.0)
        controller.record_draft("r", "agent", 4, 0)
    assert controller.realism("proposer") == pytest.approx(REALISM_PRIOR / (9.0 + REALISM_PRIOR), rel=0.05)
    likely = DraftAsk("r", "agent", 8, 300, [0.9, 0.85, 0.8, 0.75])
    assert controller.draft_lengths([likely], StepShape(1, 1, 301, draft_sequences=0))[0] >= 2
