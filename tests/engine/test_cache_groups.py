"""KV cache groups: one block pool for a hybrid model's full and sliding-window layers. gpt-oss's sliding
layers give back the blocks that fell out of their window, take only the window's blocks on a prefix hit, and every
engine feature (chunked prefill, prefix caching, n > 1, preemption, aborts, speculative decoding with tree drafts)
keeps its tokens and leaks no block."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.cache_groups import CacheGroup
from reasoning_engine.engine.kv_cache import BlockManager
from reasoning_engine.engine.request import Request
from speculative.test_engine_verification import OracleTree

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# the tiny gpt_oss checkpoint: 4 layers alternating sliding (window 8) and full; blocks of 4 tokens
GPT_OSS = dict(dtype="float32", device="cpu", block_size=4)
GROUPS = [CacheGroup("full", (1, 3)), CacheGroup("sliding", (0, 2), window=8)]


def _request(seq_id: str, tokens: list[int]) -> Request:
    return Request(seq_id, seq_id, 0, None, tokens, SamplingParams(max_tokens=4), frozenset())


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _ids(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def _prompts(count: int, seed: int, low: int, high: int, vocab: int) -> list[list[int]]:
    gen = random.Random(seed)
    return [[gen.randrange(2, vocab) for _ in range(gen.randrange(low, high))] for _ in range(count)]


def _all_free(llm: LLM) -> bool:
    return all(s.blocks.num_free_blocks == s.blocks.num_blocks and not s.has_unfinished
               for s in llm.engine.schedulers)


def test_block_manager_slides_and_hits_need_only_the_window() -> None:
    bm = BlockManager(num_blocks=32, block_size=4, groups=GROUPS)
    first = _request("a", list(range(2, 32)))  # 30 tokens
    assert bm.blocks_needed(first, 30) == 16  # 8 blocks in each group
    bm.allocate(first, 30)
    first.num_computed_tokens = 30
    bm.cache_full_blocks(first)
    assert bm.group_used == [8, 8]
    # the next query sits at 30: it reads positions above 22, so blocks 0..4 (positions < 20) go back
    assert bm.slide(first) == 5
    assert first.block_tables[1][:5] == [bm.null_block] * 5 and bm.null_block not in first.block_tables[0]
    assert bm.group_used == [8, 3] and bm.held_blocks(first) == 11
    assert bm.slide(first) == 0  # nothing more until the sequence advances
    # a second prompt with the same 30 tokens and 2 more: the hit stops at 28 tokens (7 blocks) since it leaves one
    # to run; the sliding group needs blocks 5 and 6 only ((28 - 8) // 4 = 5), which it still holds
    second = _request("b", list(range(2, 32)) + [40, 41])
    bm.match_prefix(second)
    assert second.num_computed_tokens == 28
    assert second.block_tables[0] == first.block_tables[0][:7]
    assert second.block_tables[1] == [bm.null_block] * 5 + first.block_tables[1][5:7]
    bm.free(second)
    bm.free(first)
    assert bm.num_free_blocks == bm.num_blocks and bm.group_used == [0, 0]
    # the sliding blocks that went back kept their keys; evict the window blocks at 28 tokens (5 and 6) and the hit
    # falls back to the longest prefix whose window the sliding group still holds (20 tokens: blocks 3 and 4)
    sliding = bm.group_cached[1]
    keys = first.block_hashes
    for index in (5, 6):
        block = sliding.pop(keys[index])
        bm.block_keys[block] = None
    third = _request("c", list(range(2, 32)) + [40, 41])
    bm.match_prefix(third)
    assert third.num_computed_tokens == 20
    assert third.block_tables[1] == [bm.null_block] * 3 + [sliding[keys[3]], sliding[keys[4]]]
    bm.free(third)
    assert bm.num_free_blocks == bm.num_blocks


def test_admission_counts_every_group() -> None:
    """A request needs blocks in both groups: 12 tokens are 3 blocks in each, 6 in all, more than 5 free."""
    bm = BlockManager(num_blocks=5, block_size=4, groups=GROUPS)
    request = _request("a", list(range(2, 14)))
    assert bm.blocks_needed(request, 12) == 6 and not bm.can_allocate(request, 12)
    assert bm.can_allocate(request, 8)


def test_groups_in_their_own_pools_count_and_free_blocks_per_pool() -> None:
    """DeepSeek-V4's layout: the full group in pool 0, the sliding group in pool 1, each with its own block ids and
    count. Admission needs room in every pool (free blocks of the other pool do not count), a hit takes each group's
    blocks from its own pool, and freeing gives each pool back its own."""
    groups = [CacheGroup("full", (0,)), CacheGroup("sliding", (1,), window=8, pool=1)]
    bm = BlockManager([12, 4], block_size=4, groups=groups)
    assert [p.num_blocks for p in bm.pools] == [12, 4] and bm.num_blocks == 16
    assert bm.null_of(0) == 13 and bm.null_of(1) == 5
    first = _request("a", list(range(2, 22)))  # 20 tokens: 5 blocks in each group
    assert bm.blocks_needed(first, 20) == 10 and not bm.can_allocate(first, 20)  # 10 <= 16 free, but pool 1 has 4
    assert bm.can_allocate(first, 16)
    bm.allocate(first, 16)
    assert first.block_tables == [[0, 1, 2, 3], [0, 1, 2, 3]]  # the same ids, in different pools
    first.num_computed_tokens = 16
    bm.cache_full_blocks(first)
    assert [p.num_free for p in bm.pools] == [8, 0]
    assert bm.slide(first) == 2  # the next query at 16 reads positions above 8: blocks 0 and 1 of the window go
    assert first.block_tables[1] == [5, 5, 2, 3] and bm.held_blocks(first) == 6
    assert bm.can_allocate(first, 4)
    bm.allocate(first, 4)
    assert first.block_tables[1][4] in (0, 1)
    assert bm.group_usage() == [5 / 12, 3 / 4] and bm.usage == 3 / 4
    second = _request("b", list(range(2, 18)) + [40])  # shares 16 tokens: a hit of 4 blocks needs window blocks 2, 3
    bm.match_prefix(second)
    assert second.num_computed_tokens == 16
    assert second.block_tables == [[0, 1, 2, 3], [5, 5, 2, 3]]
    assert bm.pools[0].ref_counts[:4] == [2] * 4 and bm.pools[1].ref_counts[2:4] == [2, 2]
    bm.free(second)
    bm.free(first)
    assert [p.num_free for p in bm.pools] == [12, 4] and bm.group_used == [0, 0]
    with pytest.raises(ValueError, match="num_blocks: one count per cache pool"):
        BlockManager(16, block_size=4, groups=groups)


def _long_prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in (37, 23, 9)]


def test_gpt_oss_sliding_layers_free_blocks_with_the_tokens_of_transformers(
        tiny_checkpoint: Callable[[str], object]) -> None:
    """Prompts longer than the window, chunked prefill (chunks of 6), decoding past several windows: transformers'
    greedy tokens, and while the longest decodes its sliding group holds at most the window's blocks."""
    from models.test_parity import reference_greedy

    ckpt = tiny_checkpoint("gpt_oss")
    reference = ckpt.reference()
    llm = LLM(str(ckpt.path), max_num_batched_tokens=6, **GPT_OSS)
    engine = llm.engine
    bm = engine.block_manager
    assert [g.kind for g in bm.groups] == ["full", "sliding"]
    prompts = _long_prompts(ckpt.vocab_size)
    ids = [engine.add_request(None, {"prompt_token_ids": p}, GREEDY) for p in prompts]
    outputs, most_sliding = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        for request in engine.scheduler.running:
            tables = request.block_tables
            if request.num_computed_tokens > 24:  # past the first window
                assert tables[1][0] == bm.null_block
            most_sliding = max(most_sliding, sum(b != bm.null_block for b in tables[1]))
    assert most_sliding <= 8 // 4 + 2 + 2  # the window, the block it starts in, a 6-token chunk's blocks
    for prompt, request_id in zip(prompts, ids):
        assert outputs[request_id] == reference_greedy(reference, prompt, GREEDY.max_tokens)[0]
    assert _all_free(llm)
    assert set(engine.stats().kv_cache_group_usage) == {"full", "sliding"}


def test_gpt_oss_prefix_hit_past_the_window_n_samples_and_preemption(
        tiny_checkpoint: Callable[[str], object]) -> None:
    """A second prompt sharing 33 tokens hits the cache (the sliding group takes only its window's blocks), sampled
    n = 2 siblings share the prompt, and a cache too small for all at once preempts: the tokens of a roomy cache, no
    block left held."""
    ckpt = tiny_checkpoint("gpt_oss")
    shared = _long_prompts(ckpt.vocab_size)[0][:33]
    prompts = _ids([shared + [5, 6, 7], shared + [9, 10, 11, 12], _long_prompts(ckpt.vocab_size)[1]])
    params = [GREEDY, SamplingParams(temperature=0.8, n=2, seed=3, max_tokens=24, ignore_eos=True), GREEDY]
    roomy = LLM(str(ckpt.path), kv_cache_blocks=256, **GPT_OSS)
    want = [[o.token_ids for o in out.outputs] for out in roomy.generate(prompts, params)]
    roomy_hit = roomy.generate(prompts[1:2], GREEDY)[0]
    assert roomy_hit.num_cached_tokens == 36  # 9 full blocks
    bm = roomy.engine.block_manager
    assert _all_free(roomy) and len(bm.group_cached[1]) > 0  # cached sliding blocks stay hittable
    tight = LLM(str(ckpt.path), kv_cache_blocks=34, max_model_len=64, max_num_batched_tokens=16, **GPT_OSS)
    got = [[o.token_ids for o in out.outputs] for out in tight.generate(prompts, params)]
    assert got == want
    assert tight.engine.num_preemptions > 0
    assert _all_free(tight)


@pytest.mark.parametrize("method", ["ngram", "suffix", "tree"])
def test_gpt_oss_speculative_decoding_keeps_the_tokens(tiny_checkpoint: Callable[[str], object], method: str) -> None:
    """Drafts (chains, or trees whose accepted nodes move into place) verified over positions past the window."""
    ckpt = tiny_checkpoint("gpt_oss")
    base = _long_prompts(ckpt.vocab_size)[1][:7]
    prompts = _ids([base * 5, base[:5] * 4 + [3, 4], [9, 10, 11]])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = _tokens(LLM(str(ckpt.path), **GPT_OSS).generate(prompts, params))
    config = {"method": "ngram" if method == "tree" else method, "num_speculative_tokens": 6}
    llm = LLM(str(ckpt.path), adaptive=False, speculative_config=config, **GPT_OSS)
    if method == "tree":
        llm.engine.spec.proposer = OracleTree({tuple(p["prompt_token_ids"]): t for p, t in zip(prompts, plain)})
    assert _tokens(llm.generate(prompts, params)) == plain
    assert llm.engine.stats().spec_decode["accepted_tokens"] > 0
    assert _all_free(llm)


def test_random_stress_leaks_no_block_and_keeps_the_tokens(tiny_checkpoint: Callable[[str], object]) -> None:
    """Random prompt lengths and output lengths, n > 1, aborts and ngram drafts in a cache small enough to preempt:
    every request that was not aborted gets the tokens of a roomy run, and every block is free at the end."""
    ckpt = tiny_checkpoint("gpt_oss")
    gen = random.Random(17)
    prompts = _prompts(14, seed=17, low=3, high=45, vocab=ckpt.vocab_size)
    prompts = [p[:6] * 3 + p if i % 3 == 0 else p for i, p in enumerate(prompts)]  # some repeat: drafts accept
    params = [SamplingParams(temperature=0.0, max_tokens=gen.randrange(1, 30), ignore_eos=True,
                             n=2 if i % 5 == 0 else 1) for i in range(len(prompts))]
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    roomy = LLM(str(ckpt.path), kv_cache_blocks=512, adaptive=False, speculative_config=spec, **GPT_OSS)
    want = [[o.token_ids for o in out.outputs] for out in roomy.generate(_ids(prompts), params)]
    tight = LLM(str(ckpt.path), kv_cache_blocks=40, max_model_len=80, max_num_batched_tokens=20, adaptive=False,
                speculative_config=spec, **GPT_OSS)
    engine = tight.engine
    ids = [engine.add_request(None, {"prompt_token_ids": p}, sp) for p, sp in zip(prompts, params)]
    aborted = set(gen.sample(range(len(prompts)), 3))
    got: dict[str, list[list[int]]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = [o.token_ids for o in out.outputs]
        steps += 1
        for i in list(aborted):
            if steps == 3 + 2 * i % 11:
                aborted.discard(i)
                if ids[i] not in got:  # not finished yet
                    engine.abort_request(ids[i])
                    ids[i] = None
    assert engine.num_preemptions > 0
    for i, request_id in enumerate(ids):
        if request_id is not None and request_id in got:
            assert got[request_id] == want[i], i
    assert sum(request_id is not None for request_id in ids) == len(got)  # every request not aborted finished
    assert _all_free(tight)
    assert all(used == 0 for used in engine.block_manager.group_used)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_gpt_oss_padded_static_decode_reads_each_groups_tables(tiny_checkpoint: Callable[[str], object],
                                                               backend: str) -> None:
    """The CUDA-graph decode path's static buffers (run without capture, as on CPU) hold each group's slots and
    tables: the tokens and logprobs of eager decoding past the window, with sliding blocks given back."""
    from engine.test_cuda_graph import DEVICE
    from reasoning_engine.engine.cuda_graph import CudaGraphRunner

    ckpt = tiny_checkpoint("gpt_oss")
    prompts = _ids(_long_prompts(ckpt.vocab_size))
    # the 9-token prompt decodes past its window of 8 too
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in (10, 6, 8)]
    llm = LLM(str(ckpt.path), dtype="float32", device=DEVICE, kernel_backend=backend, block_size=4, max_model_len=128,
              max_num_seqs=4, enable_prefix_caching=False, enforce_eager=True)
    eager = [o.outputs[0] for o in llm.generate(prompts, params)]
    worker = llm.engine.runner.worker
    worker.decode_graphs = CudaGraphRunner(worker.model, worker.config, worker.padding_block, capture=False)
    assert len(worker.decode_graphs.group_tables) == 2
    padded = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert worker.decode_graphs.num_steps > 0
    assert [o.token_ids for o in padded] == [o.token_ids for o in eager]
    assert [o.cumulative_logprob for o in padded] == pytest.approx([o.cumulative_logprob for o in eager], abs=1e-4)
    assert _all_free(llm)


def test_kv_usage_per_group_in_metrics(tiny_checkpoint: Callable[[str], object]) -> None:
    """/metrics has each group's share of the pool: while a long prompt decodes, the sliding group holds less."""
    from reasoning_engine.server.metrics import ServerMetrics

    ckpt = tiny_checkpoint("gpt_oss")
    llm = LLM(str(ckpt.path), **GPT_OSS)
    engine = llm.engine
    engine.add_request(None, {"prompt_token_ids": _long_prompts(ckpt.vocab_size)[0]}, GREEDY)
    for _ in range(3):
        engine.step()
    usage = engine.stats().kv_cache_group_usage
    assert 0 < usage["sliding"] < usage["full"]
    text = ServerMetrics(engine.stats, "gpt").render().decode()
    for group in ("full", "sliding"):
        line = next(x for x in text.splitlines()
                    if x.startswith("reasoning_engine:kv_cache_group_usage_perc{") and f'group="{group}"' in x)
        assert float(line.rsplit(" ", 1)[1]) == pytest.approx(usage[group])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().kv_cache_group_usage == {"full": 0.0, "sliding": 0.0}
