"""DeepSeek-V4 through what the engine does: prefix hits at block boundaries inside unfinished compressed
windows, preemption and recompute in a cache too small for the batch, n > 1, and lossless speculative decoding
(chains; trees are cut to their first path). Every run is checked against the same model run plainly (one request
at a time, no prefix cache, no drafts), which tests/models/test_deepseek_v4.py checks against transformers."""

from __future__ import annotations

import pytest
import torch

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.speculative.draft import Draft

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
V4 = dict(dtype="float32", device="cpu", block_size=8)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("deepseek_v4").path)


@pytest.fixture(scope="module")
def plain(path: str):
    llm = LLM(path, enable_prefix_caching=False, max_num_seqs=1, **V4)
    cache: dict[tuple[int, ...], list[int]] = {}

    def get(ids: list[int], params: SamplingParams = GREEDY) -> list[int]:
        key = (*ids, params.max_tokens)
        if key not in cache:
            cache[key] = list(llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids)
        return cache[key]

    return get


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _assert_no_leak(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prefix_hits_inside_unfinished_windows(path: str, plain) -> None:
    """A repeated prompt hits at 40 tokens, where a rate-16 window is half done (its first 8 tokens' projections
    come from the cached blocks), and an agent's next turn (the first turn's text, its answer, then more) at 64:
    the tokens of a plain run."""
    llm = LLM(path, **V4)
    first, other = _prompts(1, (45, 30))
    assert _generate(llm, [first]) == [plain(first)]
    again = llm.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 40 and list(again.outputs[0].token_ids) == plain(first)
    turn = first + plain(first) + other[:11]  # 80 tokens: rows of rate 16 closed at 63 and 79
    out = llm.generate([{"prompt_token_ids": turn}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 64 and list(out.outputs[0].token_ids) == plain(turn)
    _assert_no_leak(llm)


def test_preemption_and_n_samples_keep_the_tokens(path: str, plain) -> None:
    """A cache too small for the batch preempts and recomputes; greedy n = 2 samples share their prompt: each
    sequence's tokens are the plain run's."""
    prompts = _prompts(2, (70, 37, 52, 9))
    llm = LLM(path, kv_cache_blocks=40, max_model_len=128, max_num_batched_tokens=32, **V4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert [list(o.token_ids) for o in out.outputs] == [plain(ids)] * 2
    assert llm.engine.num_preemptions > 0
    _assert_no_leak(llm)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_decoding_is_lossless(path: str, plain, method: str) -> None:
    """Drafts verified across row boundaries (repetitive prompts so drafts get accepted): the plain tokens."""
    base = _prompts(3, (7,))[0]
    prompts = [base * 6, base[:5] * 5 + [3, 4], _prompts(4, (20,))[0]]
    llm = LLM(path, adaptive=False, speculative_config={"method": method, "num_speculative_tokens": 5}, **V4)
    assert _generate(llm, prompts) == [plain(p) for p in prompts]
    assert llm.engine.stats().spec_decode["accepted_tokens"] > 0
    _assert_no_leak(llm)


def test_draft_trees_are_cut_to_their_first_path() -> None:
    tree = Draft([5, 6, 7, 8, 9], [-1, 0, -1, 1, 0])  # 5 -> 6 -> 8 is the first path; 7 and 9 branch off
    chain = tree.first_path()
    assert chain.token_ids == [5, 6, 8] and chain.parents == [-1, 0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(data_parallel_size=2, enable_expert_parallel=True)],
                         ids=["tp2", "dp2_ep"])
def test_tensor_and_data_parallel_equal_one_process(path: str, plain, parallel: dict) -> None:
    """TP 2 (each rank half the heads, sinks and output groups; the latent row, compressors and indexer whole) and
    DP 2 with expert parallelism (hash-routed layers gather the replicas' token ids with their rows)."""
    prompts = _prompts(5, (3, 17, 40, 70))
    llm = LLM(path, **V4, **parallel)
    try:
        assert _generate(llm, prompts) == [plain(p) for p in prompts]
    finally:
        llm.shutdown()
