"""The adaptive engine in the engine: exact outputs, KV retention for agent sessions,
latency-aware budgets, state across restarts."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.adaptive.cost_model import StepShape
from reasoning_engine.engine import tuning
from reasoning_engine.engine.kv_cache import BlockManager
from reasoning_engine.engine.request import Request
from reasoning_engine.llm import build_engine_config
from char_models import mixed_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _ids(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def _request(name: str, tokens: list[int]) -> Request:
    return Request(name, name, 0, None, tokens, SamplingParams(max_tokens=1), frozenset())


def test_protected_blocks_go_after_unprotected_ones_and_never_block_admission() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    turn = _request("turn", [1, 2, 3, 4, 5])
    bm.allocate(turn, 5)
    turn.num_computed_tokens = 5
    bm.cache_full_blocks(turn)
    keys = bm.full_block_keys(turn)
    other = _request("other", [9, 9, 9, 9, 9])
    bm.allocate(other, 5)
    other.num_computed_tokens = 5
    bm.cache_full_blocks(other)
    bm.free(other)
    bm.free(turn)
    assert bm.protect(keys, until=time.monotonic() + 60, origin="session-1") == 2
    assert bm.num_free_blocks == 6  # protected blocks still count as free
    newcomer = _request("new", [7] * 10)
    assert bm.can_allocate(newcomer, 10)
    bm.allocate(newcomer, 8)  # four blocks: "other"'s three and the turn's partial one, not a protected one
    assert all(key in bm.cached for key in keys)
    bm.allocate(newcomer, 10)  # a fifth: now a protected block must go, and it does
    assert sum(key in bm.cached for key in keys) == 1
    follow_up = _request("follow", [1, 2, 3, 4, 5, 6])
    bm.match_prefix(follow_up)
    assert bm.record_prefix_lookup(follow_up) == ["session-1"] and bm.retention_hits == 2


def test_an_expired_protection_leaves_its_block_cached_behind_blocks_that_hold_nothing() -> None:
    """When a turn's hold runs out its blocks are ordinary cached blocks again: allocations take the blocks that hold
    nothing first, and the prefix still hits (put first in line for eviction, it was lost with the cache nearly
    empty, and the adaptive server's prefix hit rate fell below plain LRU's)."""
    bm = BlockManager(num_blocks=4, block_size=2)
    turn = _request("turn", [1, 2, 3])
    bm.allocate(turn, 3)
    turn.num_computed_tokens = 3
    bm.cache_full_blocks(turn)
    full_block = turn.block_table[0]
    bm.free(turn)
    bm.protect(bm.full_block_keys(turn), until=1.0, origin="s")
    assert full_block in bm.protected_free
    bm.expire(now=0.5)
    assert full_block in bm.protected_free  # not yet
    bm.expire(now=2.0)
    assert not bm.protected and not bm.protected_free
    newcomer = _request("new", [7] * 6)
    bm.allocate(newcomer, 6)  # three blocks: the turn's partial tail and the two never used
    assert full_block not in newcomer.block_table
    follow_up = _request("follow", [1, 2, 3])
    bm.match_prefix(follow_up)
    assert follow_up.block_table == [full_block] and follow_up.num_computed_tokens == 2


def test_a_step_is_charged_the_proposing_of_the_drafts_it_verifies_and_no_other(
        llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step proposes the next step's drafts; that time belongs to the next step if it verifies them. If the chooser
    then verifies none, no choice saved the proposing, and charged to the plain step it would make plain steps look
    dearer the more the proposer works. The drafting gate, which weighs drafting as a whole, sees every step with
    the proposing done for it."""
    tuner = tuning.EngineTuner(build_engine_config(str(llama_dir), dtype="float32", device="cpu"), None, set())
    seen: list[float] = []
    gated: list[float] = []

    def observe(shape: StepShape, seconds: float, batch: int, policy: str | None, tokens: int,
                drafting_seconds: float, decodes: StepShape | None, trace: object, draft_length: int = 0) -> None:
        seen.append(round(seconds, 6))
        gated.append(round(drafting_seconds, 6))
    monkeypatch.setattr(tuner.controller, "observe_step", observe)
    clock = iter([0.0, 0.010, 1.0, 1.012, 2.0, 2.011])
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: next(clock))
    plain = StepShape(4, 4, 400, draft_sequences=0)
    verifying = StepShape(8, 4, 404, 4, draft_sequences=2)
    for shape, proposing in ((plain, 0.003), (plain, 0.002), (verifying, 0.001)):
        tuner.begin_step()
        tuner.end_step([], shape, proposing)
    assert seen == [0.007, 0.010, 0.012]  # 10-3; 12-2 (not the 3 before it); 11-1 plus the 2 that drafted for it
    assert gated == [0.007, 0.013, 0.012]  # 10-3; 12-2 plus the 3 proposed for it; 11-1 plus 2


@pytest.fixture(scope="module")
def plain(llama_dir: Path) -> list[list[int]]:
    prompts = mixed_prompts(10, seed=21, low=5, high=40)
    outs = LLM(llama_dir, dtype="float32", device="cpu", adaptive=False).generate(_ids(prompts), GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_outputs_with_adaptive_on_equal_plain_decoding(llama_dir: Path, plain: list[list[int]],
                                                              tmp_path: Path) -> None:
    prompts = mixed_prompts(10, seed=21, low=5, high=40)
    llm = LLM(llama_dir, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=64,
              speculative_config={"method": "suffix", "num_speculative_tokens": 8}, target_itl_ms=50.0,
              target_ttft_ms=500.0, state_dir=str(tmp_path))
    engine = llm.engine
    ids = [engine.add_request(None, p, GREEDY, session_id=f"s{i % 3}", workload="agent")
           for i, p in enumerate(_ids(prompts))]
    done = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    assert [done[i].outputs[0].token_ids for i in ids] == plain
    snapshot = engine.adaptive_snapshot()
    assert snapshot["cost_model"]["ready"] and snapshot["batching"]["last_token_budget"] is not None
    assert snapshot["retention"]["turns_protected"] == 10
    stats = engine.stats()
    assert stats.adaptive["protected_blocks"] > 0
    decided = snapshot["speculation"]["decided"]
    counters = stats.adaptive_counters
    assert counters["protected_turns"] == 10 and counters["decided_steps"] == decided["steps"]
    assert counters["verifying_steps"] + counters["gated_steps"] + counters["plain_check_steps"] <= decided["steps"]
    # what each step was offered, verified and accepted beside the fixed default's ask, and the policy that ran it
    drafts = snapshot["speculation"]["draft_tokens"]
    assert drafts["verified"] <= drafts["offered"] and drafts["accepted"] <= drafts["verified"]
    assert drafts["default_asked"] > 0
    assert counters["verified_draft_tokens"] == drafts["verified"]
    policy_steps = snapshot["speculation"]["policy_steps"]
    assert sum(policy_steps.values()) > 0 and counters["adaptive_policy_steps"] == policy_steps["adaptive"]
    assert decided["steps"] >= policy_steps["adaptive"]  # the adaptive policy's steps, and the chooser's probes
    recent = snapshot["recent_steps"]
    assert recent and all(step["measured_s"] > 0 and step["predicted_s"] > 0 for step in recent)
    assert all(step["accepted"] <= step["verified"] for step in recent)
    assert snapshot["cost_model"]["prediction_error"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_where_the_gate_chooses_no_drafts_nothing_drafts(llama_dir: Path, plain: list[list[int]]) -> None:
    """With the policy gate choosing plain steps the proposer is asked for nothing, and outputs stay exact: greedy
    ones, and a seeded sampled one (its draws do not depend on drafts, so it needs no drafts of its own)."""
    prompts = mixed_prompts(10, seed=21, low=5, high=40)
    seeded_params = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
    seeded_prompt = {"prompt_token_ids": prompts[0] * 3}
    reference = LLM(llama_dir, dtype="float32", device="cpu", adaptive=False).generate(seeded_prompt, seeded_params)
    llm = LLM(llama_dir, dtype="float32", device="cpu",
              speculative_config={"method": "suffix", "num_speculative_tokens": 8})
    engine = llm.engine
    controller = engine.tuner.controller
    gate_asked: list[int] = []
    controller.gate.choose = lambda decodes, beside_chunk: gate_asked.append(decodes) or "plain"
    asked: list[str] = []
    propose_batch = engine.spec.propose_batch

    def recording(items: list[tuple], keep: Callable | None = None) -> list:
        asked.extend(seq_id for seq_id, _, n in items if n > 0)
        return propose_batch(items, keep)
    engine.spec.propose_batch = recording
    ids = [engine.add_request(None, p, GREEDY) for p in _ids(prompts)]
    seeded = engine.add_request(None, seeded_prompt, seeded_params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    assert [done[i].outputs[0].token_ids for i in ids] == plain
    assert done[seeded].outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert gate_asked and controller.decided["gated"] == len(gate_asked)
    assert not asked
    assert engine.adaptive_snapshot()["speculation"]["decided"]["gated"] > 0


def test_an_agents_next_turn_finds_its_blocks_despite_pressure(llama_dir: Path) -> None:
    """A turn with a session key keeps its blocks while other requests cycle the cache (each fits in the
    unprotected blocks, so protection costs them nothing); plain LRU loses them."""
    first, crowd = mixed_prompts(1, seed=22, low=40, high=41)[0], mixed_prompts(6, seed=23, low=40, high=41)
    cached = {}
    for adaptive in (True, False):
        llm = LLM(llama_dir, dtype="float32", device="cpu", block_size=4, kv_cache_blocks=40, max_model_len=128,
                  adaptive=adaptive)
        engine = llm.engine
        turn = engine.add_request(None, {"prompt_token_ids": first}, GREEDY, session_id="agent-7")
        answer = None
        while engine.has_unfinished_requests():
            answer = next((o for o in engine.step() if o.request_id == turn and o.finished), answer)
        for prompt in crowd:  # 6 x 64 tokens, one after another, through a 160-token cache: LRU cycles it
            llm.generate(_ids([prompt]), GREEDY)
        follow = first + answer.outputs[0].token_ids + [5, 6, 7]
        cached[adaptive] = llm.generate(_ids([follow]), GREEDY)[0].num_cached_tokens
        if adaptive:
            assert engine.adaptive_snapshot()["retention"]["retention_hit_tokens"] >= 56
    assert cached[True] >= 56 and cached[False] == 0


def test_learned_state_survives_a_restart(llama_dir: Path, tmp_path: Path) -> None:
    spec = {"method": "suffix", "num_speculative_tokens": 4}
    prompts = _ids(mixed_prompts(4, seed=24, low=5, high=30))
    with LLM(llama_dir, dtype="float32", device="cpu", speculative_config=spec, state_dir=str(tmp_path)) as first:
        first.generate(prompts, GREEDY)
        steps = first.engine.tuner.controller.cost.observations
        verified = first.engine.tuner.controller.verified_lengths.copy()  # verifying steps by longest draft
        assert first.engine.stats().spec_decode["draft_tokens"] == 0 or verified
    assert (tmp_path / "adaptive_state.json").is_file() and (tmp_path / "suffix_state.json").is_file()
    second = LLM(llama_dir, dtype="float32", device="cpu", speculative_config=spec, state_dir=str(tmp_path))
    controller = second.engine.tuner.controller
    assert controller.warm and controller.cost.observations == steps  # no calibration over a warm model
    assert controller.verified_lengths == verified
    cold = LLM(llama_dir, dtype="float32", device="cpu", speculative_config=spec, adaptive=False)
    assert cold.engine.tuner is None and cold.engine.adaptive_snapshot() == {"enabled": False}


def test_a_state_dir_that_cannot_be_written_is_refused_at_start_and_a_failing_save_never_fails_a_request(
        llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A state directory that cannot be made is a ValueError naming the setting, before the model loads; one that
    goes away while serving (disk full, removed) costs a warning at each save, and requests and shutdown go on."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    spec = {"method": "suffix", "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="state_dir .*a_file/state.* is not a writable directory"):
        LLM(llama_dir, dtype="float32", device="cpu", speculative_config=spec, state_dir=str(blocker / "state"))
    with pytest.raises(ValueError, match="speculative_config.state_dir .* is not a writable directory"):
        LLM(llama_dir, dtype="float32", device="cpu", speculative_config={**spec, "state_dir": str(blocker / "s")},
            adaptive=False)
    state_dir = tmp_path / "state"
    prompts = _ids(mixed_prompts(3, seed=26, low=5, high=30))
    llm = LLM(llama_dir, dtype="float32", device="cpu", speculative_config=spec, state_dir=str(state_dir))
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    for child in state_dir.iterdir():
        child.unlink()
    state_dir.rmdir()
    state_dir.write_text("the directory is gone")  # every save from here on fails
    monkeypatch.setattr("reasoning_engine.adaptive.controller.SAVE_EVERY_S", 0.0)
    monkeypatch.setattr(tuning, "REFRESH_S", 0.0)  # refresh, and so try to save, at every step
    with caplog.at_level("WARNING"):
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        llm.shutdown()
    assert again == expected
    saves = [r.getMessage() for r in caplog.records if "could not save" in r.getMessage()]
    assert any("adaptive state" in m for m in saves) and any("suffix proposer" in m for m in saves)


def test_drafting_time_counts_in_the_step_that_verifies_the_drafts(llama_dir: Path) -> None:
    """A step proposes the next step's drafts; the cost model sees that time in the step that verifies them (or in
    none, if that step verifies none), so a plain step among drafted ones does not look dear for drafting it never
    verified."""
    llm = LLM(llama_dir, dtype="float32", device="cpu", speculative_config={"method": "suffix",
                                                                            "num_speculative_tokens": 4})
    engine = llm.engine
    controller = engine.tuner.controller
    seen: list[float] = []
    verified: list[bool] = []
    observe, propose = controller.observe_step, engine._propose_drafts

    def observe_step(shape: StepShape, seconds: float, decode_batch: int, *gated: object) -> None:
        seen.append(seconds)
        verified.append(shape.verifying > 0)
        observe(shape, seconds, decode_batch, *gated)

    proposals: list[None] = []

    def slow_proposals() -> None:
        proposals.append(None)
        if len(proposals) == 3:
            time.sleep(0.3)
        propose()

    controller.observe_step, engine._propose_drafts = observe_step, slow_proposals
    engine.add_request(None, {"prompt_token_ids": mixed_prompts(1, seed=25, low=10, high=11)[0]}, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(seen) > 4
    assert seen[2] < 0.3 and (seen[3] >= 0.3) == verified[3]
    assert max(seen[:3] + seen[4:]) < 0.3


def test_draft_decisions_expect_the_next_steps_prefill_chunk(llama_dir: Path) -> None:
    """Drafts are chosen for a step the scheduler has not built yet; a prompt waiting (or mid-prefill) will add its
    chunk beside the decodes, and the step the chooser prices includes it."""
    llm = LLM(llama_dir, dtype="float32", device="cpu", max_num_batched_tokens=32,
              speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    engine = llm.engine
    first, second = mixed_prompts(2, seed=26, low=50, high=51)
    engine.add_request(None, {"prompt_token_ids": first}, GREEDY)
    while not engine.schedulers[0].running or engine.schedulers[0].running[0].is_prefilling:
        engine.step()
    decoding = list(engine.schedulers[0].running)
    alone = engine.tuner.expected_step(decoding, engine.schedulers)
    assert (alone.query_tokens, alone.sequences) == (1, 1)
    engine.add_request(None, {"prompt_token_ids": second}, GREEDY)
    with_prompt = engine.tuner.expected_step(decoding, engine.schedulers)
    assert (with_prompt.query_tokens, with_prompt.sequences) == (1 + 31, 2)  # the budget less the decode
    assert with_prompt.pairs == alone.pairs + 31 * 32 // 2


def test_a_learned_policy_made_wrong_on_purpose_falls_back_to_the_fixed_default(llama_dir: Path) -> None:
    """The safety net (adaptive/gate.py): the gate starts out believing the adaptive policy far ahead of the fixed
    default at one request (a learned state), while the cost model is forced to price every draft as a thousand times
    dearer than it is, so the adaptive policy verifies nothing on outputs where drafting pays (the random model's
    greedy outputs repeat). Its measured steps lower the surplus that lets it run, and the engine runs the
    fixed default for the rest, within a bounded number of steps; greedy outputs stay exact."""
    import numpy as np

    from reasoning_engine.adaptive.gate import ArmScore, Bucket

    prompts = _ids(mixed_prompts(3, seed=5, low=5, high=20))
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    plain = LLM(llama_dir, dtype="float32", device="cpu", adaptive=False, max_num_seqs=1).generate(prompts, params)
    llm = LLM(llama_dir, dtype="float32", device="cpu", max_num_seqs=1,
              speculative_config={"method": "suffix", "num_speculative_tokens": 8})
    controller = llm.engine.tuner.controller
    cost = controller.cost
    real = cost.predict_with_drafts
    cost.predict_with_drafts = lambda step, drafts, verifying, pairs: (
        real(step, drafts, verifying, pairs) * np.where(verifying > 0, 1000.0, 1.0))

    def believed(mean: float) -> ArmScore:  # 40 steps of 2 ms each
        return ArmScore(mean * 40, (mean * mean + 0.01) * 40, 40.0, 40, 40.0, 40 * 0.002, 40.0)
    controller.gate.buckets[1] = Bucket({"default": believed(1.2), "adaptive": believed(4.0), "plain": believed(1.0)})
    chosen: list[str] = []
    choose = controller.gate.choose
    controller.gate.choose = lambda *args: chosen.append(choose(*args)) or chosen[-1]
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert chosen[0] == "adaptive"  # what it had learned
    first_default = chosen.index("default")
    assert first_default < 150  # the surplus its believed scores give pays for a bounded loss
    late = chosen[len(chosen) // 2:]
    assert late.count("default") >= 0.75 * len(late)
    assert controller.gate.summary()["1-1"]["leader"] == "default"
    adaptive_steps = [s for s in controller.trace if s.policy == "adaptive"]
    assert all(s.verified == 0 for s in adaptive_steps)
