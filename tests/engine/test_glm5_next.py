"""GLM-5.3-Flash through what the engine does: prefix hits at block boundaries inside unfinished index
pools (blocks of 2 tokens, pools of 4) with the KDA state restored from a snapshot, preemption and recompute in a
cache too small for the batch, n > 1, lossless speculative decoding (chains), aborts, tensor and data parallelism.
Every run is checked against the same model run plainly (one request at a time, no prefix cache, no drafts), which
tests/models/test_glm5_next.py checks against transformers."""

from __future__ import annotations

import random

import pytest

from reasoning_engine import LLM, SamplingParams

from .family_engines import assert_no_leak, generate_ids, one_at_a_time, random_prompts

pytestmark = pytest.mark.slow  # whole engines of one family

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
GLM = dict(dtype="float32", device="cpu", block_size=2)


@pytest.fixture(scope="module")
def path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("glm5_next").path)


@pytest.fixture(scope="module")
def plain(path: str):
    llm = LLM(path, enable_prefix_caching=False, max_num_seqs=1, **GLM)
    return one_at_a_time(llm, GREEDY)


def test_prefix_hits_inside_unfinished_pools(path: str, plain) -> None:
    """A repeated prompt of 43 tokens hits at 42, half-way through a pool (its first two tokens' keys and gates come
    from the cached blocks), and an agent's next turn (the first turn, its answer, then more) at a later boundary:
    the tokens of a plain run, chunked prefill beside them ending mid-pool."""
    llm = LLM(path, max_num_batched_tokens=18, **GLM)
    first, other = random_prompts(1, (43, 30))
    assert generate_ids(llm, [first], GREEDY) == [plain(first)]
    again = llm.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 42 and list(again.outputs[0].token_ids) == plain(first)
    turn = first + plain(first) + other[:9]
    out = llm.generate([{"prompt_token_ids": turn}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens > len(first) and list(out.outputs[0].token_ids) == plain(turn)
    assert_no_leak(llm, states=True)


def test_preemption_and_n_samples_keep_the_tokens(path: str, plain) -> None:
    """A cache too small for the batch preempts and recomputes; greedy n = 2 samples share their prompt: each
    sequence's tokens are the plain run's."""
    prompts = random_prompts(2, (70, 37, 52, 9))
    llm = LLM(path, kv_cache_blocks=120, max_model_len=128, max_num_batched_tokens=32, **GLM)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert [list(o.token_ids) for o in out.outputs] == [plain(ids)] * 2
    assert llm.engine.num_preemptions > 0
    assert_no_leak(llm, states=True)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_decoding_is_lossless(path: str, plain, method: str) -> None:
    """Drafts verified across pool boundaries: the plain tokens. The tiny model's own continuations do not repeat, so
    n-gram drafts from repetitive prompts are rejected (each step's KDA state and pooled keys rolled back); the
    suffix store drafts a prompt's earlier continuation when it comes again, and those drafts are accepted."""
    base = random_prompts(3, (7,))[0]
    prompts = [base * 6, base[:5] * 5 + [3, 4], random_prompts(4, (20,))[0]]
    llm = LLM(path, adaptive=False, speculative_config={"method": method, "num_speculative_tokens": 5}, **GLM)
    assert generate_ids(llm, prompts, GREEDY) == [plain(p) for p in prompts]
    assert llm.engine.stats().spec_decode["draft_tokens"] > 0
    if method == "suffix":
        assert generate_ids(llm, prompts, GREEDY) == [plain(p) for p in prompts]
        assert llm.engine.stats().spec_decode["accepted_tokens"] > 0
    assert_no_leak(llm, states=True)


def test_steps_stay_eager_under_compile_decode(path: str, plain) -> None:
    """The pool addressing is built on the host each step: no compiled decode graphs (nor CUDA graphs) are made for
    this model, and its tokens are the plain run's."""
    llm = LLM(path, compile_decode=True, **GLM)
    assert llm.engine.runner.worker.compiled_decode is None and llm.engine.runner.worker.decode_graphs is None
    prompt = random_prompts(6, (30,))[0]
    assert generate_ids(llm, [prompt], GREEDY) == [plain(prompt)]


def test_random_stress_with_aborts_preemption_hits_and_drafts(path: str, plain) -> None:
    """Random lengths, prompts extending earlier ones (prefix hits), arrivals between steps, aborts, a small cache and
    suffix drafts: every finished request has the plain tokens and nothing leaks. The prompts never repeat a stretch
    of text: pools of equal text score within rounding of each other, and which one wins then follows the batch's
    rounding (as for any top-k sparse attention), so such prompts are not batch-invariant."""
    rng = random.Random(1)
    llm = LLM(path, kv_cache_blocks=100, max_model_len=160, max_num_batched_tokens=30, adaptive=False,
              speculative_config={"method": "suffix", "num_speculative_tokens": 3}, **GLM)
    engine = llm.engine
    wanted: dict[str, list[int]] = {}
    aborted: set[str] = set()
    done: dict[str, list[int]] = {}
    earlier: list[list[int]] = []

    def step() -> None:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)

    for i in range(16):
        if earlier and rng.random() < 0.4:
            base = rng.choice(earlier)
            prompt = base[: rng.randint(1, len(base))] + random_prompts(200 + i, (rng.randint(1, 10),))[0]
        else:
            prompt = random_prompts(100 + i, (rng.randint(3, 70),))[0]
        earlier.append(prompt)
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 30), ignore_eos=True)
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        wanted[f"r{i}"] = plain(prompt, params)
        for _ in range(rng.randint(0, 3)):
            step()
        if rng.random() < 0.2:
            engine.abort_request(f"r{i}")
            aborted.add(f"r{i}")
    while engine.has_unfinished_requests():
        step()
    assert {rid: tokens for rid, tokens in done.items() if rid not in aborted} == {
        rid: tokens for rid, tokens in wanted.items() if rid not in aborted}
    assert engine.num_preemptions > 0 and engine.block_manager.prefix_hits > 0
    assert_no_leak(llm, states=True)


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(data_parallel_size=2, enable_expert_parallel=True)], ids=["tp2", "dp2_ep"])
def test_tensor_and_data_parallel_equal_one_process(path: str, plain, parallel: dict) -> None:
    """TP 2 (each rank half the KDA heads with their state, half the MLA heads; the latent, the indexer and the
    hyper-connections whole) and DP 2 with expert parallelism."""
    prompts = random_prompts(5, (3, 17, 40, 70))
    llm = LLM(path, **GLM, **parallel)
    try:
        assert generate_ids(llm, prompts, GREEDY) == [plain(p) for p in prompts]
    finally:
        llm.shutdown()
