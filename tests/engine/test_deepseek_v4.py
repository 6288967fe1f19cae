"""DeepSeek-V4 through what the engine does: prefix hits at block boundaries inside unfinished compressed
windows, preemption and recompute in a cache too small for the batch, n > 1, and lossless speculative decoding
(chains; trees are cut to their first path). Every run is checked against the same model run plainly (one request
at a time, no prefix cache, no drafts), which tests/models/test_deepseek_v4.py checks against transformers."""

from __future__ import annotations

import pytest

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.speculative.draft import Draft

from .family_engines import assert_no_leak, generate_ids, one_at_a_time, random_prompts

pytestmark = pytest.mark.slow  # whole engines of one family

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
V4 = dict(dtype="float32", device="cpu", block_size=8)


@pytest.fixture(scope="module")
def path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("deepseek_v4").path)


@pytest.fixture(scope="module")
def plain(path: str):
    llm = LLM(path, enable_prefix_caching=False, max_num_seqs=1, **V4)
    return one_at_a_time(llm, GREEDY)


def test_prefix_hits_inside_unfinished_windows(path: str, plain) -> None:
    """A repeated prompt hits at 40 tokens, where a rate-16 window is half done (its first 8 tokens' projections
    come from the cached blocks), and an agent's next turn (the first turn's text, its answer, then more) at 64:
    the tokens of a plain run."""
    llm = LLM(path, **V4)
    first, other = random_prompts(1, (45, 30))
    assert generate_ids(llm, [first], GREEDY) == [plain(first)]
    again = llm.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 40 and list(again.outputs[0].token_ids) == plain(first)
    turn = first + plain(first) + other[:11]  # 80 tokens: rows of rate 16 closed at 63 and 79
    out = llm.generate([{"prompt_token_ids": turn}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 64 and list(out.outputs[0].token_ids) == plain(turn)
    assert_no_leak(llm)


def test_preemption_and_n_samples_keep_the_tokens(path: str, plain) -> None:
    """A cache too small for the batch preempts and recomputes; greedy n = 2 samples share their prompt: each
    sequence's tokens are the plain run's."""
    prompts = random_prompts(2, (70, 37, 52, 9))
    llm = LLM(path, kv_cache_blocks=40, max_model_len=128, max_num_batched_tokens=32, **V4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert [list(o.token_ids) for o in out.outputs] == [plain(ids)] * 2
    assert llm.engine.num_preemptions > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_decoding_is_lossless(path: str, plain, method: str) -> None:
    """Drafts verified across row boundaries (repetitive prompts so drafts get accepted): the plain tokens."""
    base = random_prompts(3, (7,))[0]
    prompts = [base * 6, base[:5] * 5 + [3, 4], random_prompts(4, (20,))[0]]
    llm = LLM(path, adaptive=False, speculative_config={"method": method, "num_speculative_tokens": 5}, **V4)
    assert generate_ids(llm, prompts, GREEDY) == [plain(p) for p in prompts]
    assert llm.engine.stats().spec_decode["accepted_tokens"] > 0
    assert_no_leak(llm)


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
    prompts = random_prompts(5, (3, 17, 40, 70))
    llm = LLM(path, **V4, **parallel)
    try:
        assert generate_ids(llm, prompts, GREEDY) == [plain(p) for p in prompts]
    finally:
        llm.shutdown()


def test_released_fp4_experts_under_tensor_parallel_equal_one_process(tiny_checkpoint) -> None:
    """The release's format (block FP8, FP4 experts kept packed, its MTP layer quantized alike) under TP 2, drafting
    with the MTP layer: each rank reads its half of every expert's 64 intermediate channels (one whole scale group
    of 32) and its share of the FP8 blocks; the tokens of one process without drafts."""
    path = str(tiny_checkpoint("deepseek_v4_fp4").path)
    prompts = random_prompts(7, (9, 40, 70))
    want = generate_ids(LLM(path, **V4), prompts, GREEDY)
    llm = LLM(path, tensor_parallel_size=2, adaptive=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **V4)
    try:
        assert generate_ids(llm, prompts, GREEDY) == want
        assert llm.engine.stats().spec_decode["draft_tokens"] > 0
    finally:
        llm.shutdown()


def test_compressed_rows_cost_their_own_bytes_per_block(path: str, plain) -> None:
    """The compressed rows and the per-token window live in block pools of their own: a row block costs the rows it
    holds (block_size / rate rows per compressed layer), not a window block's block_size tokens of every layer, so a
    2 MiB cache holds over 10x the context a pool priced at the window's block would. A long sequence holds one row
    block per 8 tokens of context and only its window's blocks of the other pool, and gives the plain tokens."""
    llm = LLM(path, kv_cache_memory=2 * 2**20, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, **V4)
    worker, bm = llm.engine.runner.worker, llm.engine.block_manager
    # float32, blocks of 8 tokens; CSA layers 1 and 3: 2 rows of a 32-wide row and a 16-wide index key; HCA layer 2:
    # max(1, 8 // 16) = 1 row of 32; window: per token every layer's 32-wide row, CSA's projections (2 x 2 x 32 and
    # 2 x 2 x 16 wide), HCA's (2 x 32)
    row_block, window_block = 4 * (2 * 48 + 32 + 2 * 48), 4 * 8 * (32 + 2 * (32 + 128 + 64) + (32 + 64))
    assert worker.pool_bytes_per_block() == [row_block, window_block] == [896, 18432]
    assert [g.pool for g in bm.groups] == [0, 1] and [p.num_blocks for p in bm.pools] == worker.pool_blocks
    kv_bytes = worker.memory_report()["kv_cache_bytes"]
    assert kv_bytes == sum((n + 2) * b for n, b in zip(worker.pool_blocks, [row_block, window_block]))
    assert kv_bytes <= 2 * 2**20 + 2 * (row_block + window_block)  # the budget, and each pool's padding and null blocks
    context = worker.pool_blocks[0] * 8
    assert context > 10 * (2 * 2**20 // window_block) * 8
    # the window pool: twice what 4 sequences' 16-token windows and a 64-token step need
    assert worker.pool_blocks[1] == 2 * (4 * (16 // 8 + 2) + 64 // 8)
    prompt = random_prompts(6, (70,))[0]
    engine = llm.engine
    request_id = engine.add_request(None, {"prompt_token_ids": prompt}, GREEDY)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
        for request in engine.scheduler.running:
            rows, window = request.block_tables
            assert len(rows) == -(-request.num_computed_tokens // 8)
            if not request.is_prefilling:
                assert sum(b != bm.null_of(1) for b in window) <= 16 // 8 + 2
                assert bm.null_of(0) not in rows
    assert request_id is not None and tokens == plain(prompt)
    assert_no_leak(llm)
