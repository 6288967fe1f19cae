"""Preemption under memory pressure: n > 1 groups, prompt logprobs and prefix-cache statistics survive it, and random
mixes of requests always finish with every block back."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.engine.request import Request
from reasoning_engine.engine.scheduler import SchedulerStalled
from char_models import mixed_prompts

# 8 blocks of 4 tokens: two requests of 12-20 tokens do not fit together, so one is preempted and recomputed
TIGHT = dict(dtype="float32", device="cpu", block_size=4, kv_cache_blocks=8, max_model_len=32)


@pytest.fixture(scope="module")
def roomy(llama_dir: Path) -> LLM:
    return LLM(llama_dir, dtype="float32", device="cpu", block_size=4, kv_cache_blocks=64, max_model_len=32)


def _ids(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def _samples(outs) -> list[list[list[int]]]:
    return [[o.token_ids for o in out.outputs] for out in outs]


def _all_blocks_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()


def test_n_samples_finish_when_sample_0_is_preempted_mid_prefill(llama_dir: Path, roomy: LLM) -> None:
    """Sample 0 of an n = 2 group is preempted while its prompt is half computed; it used to be queued behind sample
    1, which waits for sample 0's prompt: nothing was scheduled again (a hang)."""
    prompts = _ids(mixed_prompts(2, seed=11, low=12, high=13)[:1] + mixed_prompts(1, seed=12, low=20, high=21))
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, n=2, max_tokens=4, ignore_eos=True, seed=1)]
    tight = LLM(llama_dir, max_num_batched_tokens=8, **TIGHT)
    outs = tight.generate(prompts, params)
    assert tight.engine.num_preemptions > 0
    assert _samples(outs) == _samples(roomy.generate(prompts, params))  # seeded samples do not depend on it
    assert _all_blocks_free(tight)


def test_waiting_queue_keeps_siblings_in_index_order() -> None:
    """Samples share an arrival time; a preempted sample 0 goes back ahead of its waiting siblings."""
    from reasoning_engine.engine.kv_cache import BlockManager
    from reasoning_engine.engine.scheduler import Scheduler

    scheduler = Scheduler(BlockManager(8, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32)
    params = SamplingParams(n=3, max_tokens=2)
    group = [Request(f"g#{i}", "g", i, None, [5] * 9, params, frozenset(), arrival_time=1.0) for i in range(3)]
    later = Request("h#0", "h", 0, None, [6] * 9, SamplingParams(max_tokens=2), frozenset(), arrival_time=2.0)
    for request in (*group, later):
        scheduler.add(request)
    scheduler.schedule()
    assert [r.seq_id for r in scheduler.running] == ["g#0"]  # the siblings wait for sample 0's prompt
    scheduler._preempt(group[0])
    assert [r.seq_id for r in scheduler.waiting] == ["g#0", "g#1", "g#2", "h#0"]


def test_a_stalled_scheduler_raises_instead_of_spinning(llama_dir: Path) -> None:
    llm = LLM(llama_dir, **TIGHT)
    engine = llm.engine
    request_id = engine.add_request(None, {"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=4))
    engine.block_manager.free_queue.clear()  # blocks gone by a bug: the lone request can never be admitted
    with pytest.raises(SchedulerStalled, match="no request can be scheduled"):
        engine.step()
    engine.abort_request(request_id)


def test_prompt_logprobs_are_not_repeated_after_preemption(llama_dir: Path, roomy: LLM) -> None:
    prompts = _ids(mixed_prompts(2, seed=13, low=12, high=13))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    tight = LLM(llama_dir, **TIGHT)
    outs = tight.generate(prompts, params)
    assert tight.engine.num_preemptions > 0
    reference = roomy.generate(prompts, params)
    for out, ref in zip(outs, reference):
        assert len(out.prompt_logprobs) == 12
        assert out.prompt_logprobs[0] is None
        for entry, ref_entry in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert entry.keys() == ref_entry.keys()
            for token, logprob in entry.items():
                assert logprob.logprob == pytest.approx(ref_entry[token].logprob, abs=1e-5)
    one = tight.generate(_ids([[7]]), params)[0]
    assert one.prompt_logprobs == [None]
    assert _all_blocks_free(tight)


def test_prefix_cache_statistics_count_each_prompt_once(llama_dir: Path) -> None:
    """A waiting request retried step after step and one re-admitted after preemption are each one query; its own
    blocks, cached before it was preempted, are not prefix-cache hits of the request."""
    prompts = mixed_prompts(2, seed=14, low=12, high=13)
    tight = LLM(llama_dir, max_num_batched_tokens=8, **TIGHT)
    outs = tight.generate(_ids(prompts), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert tight.engine.num_preemptions > 0
    stats = tight.engine.stats()
    assert stats.prefix_cache_queries == 24
    assert stats.prefix_cache_hits == 0
    assert [out.num_cached_tokens for out in outs] == [0, 0]
    last = max(range(2), key=lambda i: outs[i].metrics.finished_time)  # its blocks were freed last: still cached
    again = tight.generate(_ids([prompts[last]]), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    assert again.num_cached_tokens == 8  # two full blocks, leaving the last block's tokens to run
    stats = tight.engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (36, 8)


def test_random_mixes_under_memory_pressure_always_finish(llama_dir: Path, roomy: LLM) -> None:
    """Random batches of greedy and seeded requests (n up to 3, prompt logprobs, stop ids) on a cache that holds
    about two of them, with chunked prefill: every batch finishes, frees every block and gives the roomy engine's
    tokens."""
    tight = LLM(llama_dir, max_num_batched_tokens=8, **TIGHT)
    rng = random.Random(15)
    preemptions = 0
    for trial in range(12):
        count = rng.randint(2, 4)
        prompts = _ids(mixed_prompts(count, seed=100 + trial, low=1, high=18))
        params = [SamplingParams(temperature=rng.choice([0.0, 0.9]), n=rng.choice([1, 1, 2, 3]), seed=rng.randint(0, 99),
                                 max_tokens=rng.randint(1, 10), ignore_eos=True,
                                 prompt_logprobs=rng.choice([None, None, 0])) for _ in range(count)]
        outs = tight.generate(prompts, params, use_tqdm=False)
        assert _samples(outs) == _samples(roomy.generate(prompts, params, use_tqdm=False)), trial
        assert _all_blocks_free(tight), trial
        preemptions = tight.engine.num_preemptions
    assert preemptions > 0
