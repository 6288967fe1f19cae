"""The policy gate (reasoning_engine/adaptive/gate.py): per batch size, the fixed default, adaptive lengths or no
drafts, whichever measures best, never costing more than about ALPHA of what the default scores."""

from __future__ import annotations

import random

from reasoning_engine.adaptive.gate import ALPHA, MIN_DEFAULT, PolicyGate


YIELDS = {"default": 2.0, "adaptive": 2.0, "plain": 1.0}  # tokens per decoding request per step


def _run(gate: PolicyGate, decodes: int, steps: int, scores: dict[str, float], rng: random.Random,
         noise: float = 0.1, beside_chunk: bool = False) -> list[str]:
    """`steps` steps of `decodes` requests: each the gate's choice, then a step whose tokens per second are
    `scores[arm]` times the plain prediction, with `noise` (relative standard deviation)."""
    chosen = []
    for _ in range(steps):
        arm = gate.choose(decodes, beside_chunk)
        chosen.append(arm)
        score = max(scores[arm] * rng.gauss(1.0, noise), 0.05)
        tokens = int(decodes * YIELDS[arm])
        gate.observe(decodes, arm, tokens, 0.030, 0.030 * score * decodes / tokens, beside_chunk)
    return chosen


def _mean_score(chosen: list[str], scores: dict[str, float]) -> float:
    return sum(scores[arm] for arm in chosen) / len(chosen)


def test_the_default_runs_first_and_a_worse_learned_policy_costs_at_most_alpha() -> None:
    for seed in range(4):
        scores = {"default": 1.3, "adaptive": 0.5, "plain": 1.0}  # a learned policy made wrong on purpose
        gate = PolicyGate()
        chosen = _run(gate, 1, 1500, scores, random.Random(seed), noise=0.4)
        assert chosen[:MIN_DEFAULT] == ["default"] * MIN_DEFAULT
        assert _mean_score(chosen, scores) >= (1 - ALPHA) * scores["default"]
        assert 0 < chosen.count("adaptive") < 40  # still tried now and then: the workload may change
        assert gate.summary()["1-1"]["leader"] == "default"


def test_lucky_scores_do_not_pay_for_exploring() -> None:
    """A step's score swings with what its drafts happened to match (its spread is most of its mean): a surplus of
    realised scores banked that luck and spent it on a policy a little worse than the default, losing several times
    ALPHA over a few hundred steps. Counted at the arms' lower bounds, every run stays within about ALPHA."""
    scores = {"default": 1.0, "adaptive": 0.93, "plain": 0.55}
    for seed in range(20):
        chosen = _run(PolicyGate(), 1, 300, scores, random.Random(seed), noise=0.6)
        assert _mean_score(chosen, scores) >= 1 - 1.5 * ALPHA, seed


def test_a_better_policy_takes_over_and_the_default_is_still_measured() -> None:
    scores = {"default": 1.0, "adaptive": 1.4, "plain": 0.9}
    means = []
    for seed in range(1, 4):
        gate = PolicyGate()
        chosen = _run(gate, 24, 1500, scores, random.Random(seed), noise=0.3)
        late = chosen[500:]
        assert late.count("adaptive") > 0.9 * len(late)
        assert 0 < late.count("default")
        assert gate.summary()["16-31"]["leader"] == "adaptive"
        means.append(_mean_score(chosen, scores))
    assert sum(means) / len(means) > 1.3


def test_no_drafts_win_where_drafting_costs_more_than_it_gives() -> None:
    scores = {"default": 0.8, "adaptive": 0.85, "plain": 1.0}
    gate = PolicyGate()
    chosen = _run(gate, 24, 1500, scores, random.Random(2))
    assert chosen[500:].count("plain") > 0.85 * 1000
    assert gate.summary()["16-31"]["leader"] == "plain"


def test_the_gate_follows_a_change_in_what_a_policy_delivers_and_keeps_batch_sizes_apart() -> None:
    gate = PolicyGate()
    rng = random.Random(3)
    _run(gate, 24, 600, {"default": 1.0, "adaptive": 0.7, "plain": 0.95}, rng)
    _run(gate, 2, 600, {"default": 1.0, "adaptive": 1.3, "plain": 0.8}, rng)
    assert gate.summary()["16-31"]["leader"] == "default" and gate.summary()["2-3"]["leader"] == "adaptive"
    # the agents reach a repetitive stretch: the learned lengths now pay at 24 requests, seen through its tries
    chosen = _run(gate, 24, 1500, {"default": 1.0, "adaptive": 1.4, "plain": 0.95}, rng)
    assert chosen[-300:].count("adaptive") > 250
    assert gate.summary()["16-31"]["leader"] == "adaptive" and gate.summary()["2-3"]["leader"] == "adaptive"


def test_steps_beside_a_prefill_chunk_are_measured_apart_from_decode_only_steps() -> None:
    gate = PolicyGate()
    rng = random.Random(4)
    _run(gate, 12, 600, {"default": 1.0, "adaptive": 1.3, "plain": 0.9}, rng)
    _run(gate, 12, 600, {"default": 1.0, "adaptive": 0.6, "plain": 1.2}, rng, beside_chunk=True)
    summary = gate.summary()
    assert summary["8-15"]["leader"] == "adaptive" and summary["8-15 beside a chunk"]["leader"] == "plain"


def test_a_stalled_step_moves_the_score_only_so_far() -> None:
    gate = PolicyGate()
    _run(gate, 8, 200, {"default": 1.0, "adaptive": 1.0, "plain": 1.0}, random.Random(5))
    arm = gate.choose(8)
    gate.observe(8, arm, 8, 30.0, 0.030)  # a thousand times slower than predicted (a paused machine)
    assert gate.summary()["8-15"][arm] > 0.9


def test_the_gate_round_trips_and_rejects_a_damaged_bucket() -> None:
    gate = PolicyGate()
    _run(gate, 4, 300, {"default": 1.0, "adaptive": 1.2, "plain": 0.9}, random.Random(6))
    _run(gate, 4, 100, {"default": 1.0, "adaptive": 1.2, "plain": 0.9}, random.Random(6), beside_chunk=True)
    again = PolicyGate()
    again.load(gate.to_dict())
    assert again.summary() == gate.summary()
    assert [again.choose(4) for _ in range(50)] == [gate.choose(4) for _ in range(50)]
    damaged = gate.to_dict()
    damaged["3"] = damaged["3"][:-2]
    try:
        PolicyGate().load(damaged)
    except ValueError as exc:
        assert "bucket 3" in str(exc)
    else:
        raise AssertionError("a bucket with missing values was loaded")


def test_no_drafts_are_tried_early_where_drafting_does_not_pay() -> None:
    """Drafting at 16 requests costs more than it gives: a step without drafts does less work than the default's, so
    its lower bound is the default's score over its tokens per request (0.2 here, not the lowest score, 0.1): it is
    tried after a few default steps rather than the ~50 the surplus would need, and takes over."""
    gate = PolicyGate()
    chosen = _run(gate, 16, 200, {"default": 0.4, "adaptive": 0.45, "plain": 1.1}, random.Random(6))
    assert chosen.index("plain") <= 3 * MIN_DEFAULT
    assert chosen[50:].count("plain") > 0.8 * 150
    assert _mean_score(chosen, {"default": 0.4, "adaptive": 0.45, "plain": 1.1}) > 0.9


def test_a_state_learned_on_other_traffic_yields_to_what_this_traffic_measures() -> None:
    """Loaded scores are a prior (`temper`): a gate that learned adaptive lengths pay, restarted on traffic where they
    do not, is back on the default at once and loses a fraction of what the untempered state loses (which runs the
    old leader for ~40 steps, paid by the surplus its heavy weights give it)."""
    learned = PolicyGate()
    _run(learned, 1, 1500, {"default": 1.0, "adaptive": 1.6, "plain": 0.9}, random.Random(7))
    now = {"default": 1.0, "adaptive": 0.6, "plain": 0.9}
    back, lost = {}, {}
    for tempered in (True, False):
        gate = PolicyGate()
        gate.load(learned.to_dict())
        if tempered:
            gate.temper()
        chosen = _run(gate, 1, 400, now, random.Random(8))
        back[tempered] = next(i for i in range(len(chosen)) if chosen[i:i + 20].count("default") >= 15)
        lost[tempered] = sum(now["default"] - now[arm] for arm in chosen)
    assert back[True] <= 10 < 30 < back[False]
    assert lost[True] < 0.5 * lost[False]


def test_a_batch_size_just_reached_explores_on_what_the_others_saved() -> None:
    """Traffic moves from one request to 24: the surplus the single-request steps saved (the default was best there)
    pays for trying no drafts at 24 at once, where they are better, within the minute a benchmark level lasts; with
    a surplus per batch size, the 24-request bucket saved up for each try from its own steps first."""
    shares = []
    for seed in range(4):
        gate = PolicyGate()
        rng = random.Random(seed)
        _run(gate, 1, 340, {"default": 1.3, "adaptive": 0.8, "plain": 0.85}, rng, noise=0.3)
        chosen = _run(gate, 24, 150, {"default": 0.62, "adaptive": 0.6, "plain": 0.76}, rng, noise=0.3)
        shares.append(chosen[75:].count("plain") / 75)
    assert sum(shares) / len(shares) > 0.5


def test_what_one_batch_size_saved_is_spent_within_alpha_of_all_steps() -> None:
    """The other side of one surplus for all batch sizes: where no drafts and adaptive lengths are worse at the new
    batch size too, exploring them there spends what the first saved, and over both the loss stays within about
    ALPHA of the default's score."""
    first = {"default": 1.3, "adaptive": 0.8, "plain": 0.85}
    second = {"default": 1.0, "adaptive": 0.7, "plain": 0.75}
    for seed in range(10):
        gate = PolicyGate()
        rng = random.Random(seed)
        a = _run(gate, 1, 340, first, rng, noise=0.3)
        b = _run(gate, 24, 300, second, rng, noise=0.3)
        lost = sum(first["default"] - first[arm] for arm in a) + sum(second["default"] - second[arm] for arm in b)
        assert lost <= 1.5 * ALPHA * (len(a) * first["default"] + len(b) * second["default"]), seed
