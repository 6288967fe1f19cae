"""Engine core: batching, preemption, chunked prefill, prefix caching, aborts, n > 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from reasoning_engine import LLM, SamplingParams
from char_models import mixed_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _ids(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.mark.parametrize("family", ["llama_dir", "deepseek_dir"])
def test_batch_invariance_48_mixed_requests(family: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(family)
    llm = LLM(path, dtype="float32", device="cpu")
    prompts = mixed_prompts(48, seed=3)
    batched = _tokens(llm.generate(_ids(prompts), GREEDY))
    for i in (0, 17, 47):
        alone = _tokens(llm.generate(_ids([prompts[i]]), GREEDY))[0]
        assert alone == batched[i], f"request {i} differs alone vs in a batch of 48"


def test_preemption_keeps_outputs_and_frees_every_block(llama_dir: Path) -> None:
    prompts = mixed_prompts(48, seed=4)
    reference = _tokens(LLM(llama_dir, dtype="float32", device="cpu", enable_prefix_caching=False).generate(_ids(prompts), GREEDY))
    # 64 blocks of 16 tokens hold ~12 of these requests at once: the scheduler must preempt and recompute
    small = LLM(llama_dir, dtype="float32", device="cpu", kv_cache_blocks=64, block_size=16, max_model_len=1024)
    outs = _tokens(small.generate(_ids(prompts), GREEDY))
    assert small.engine.num_preemptions > 0
    assert outs == reference
    bm = small.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_chunked_prefill_matches_one_shot(deepseek_dir: Path) -> None:
    prompts = mixed_prompts(6, seed=5, low=90, high=200)
    one_shot = _tokens(LLM(deepseek_dir, dtype="float32", device="cpu").generate(_ids(prompts), GREEDY))
    chunked = LLM(deepseek_dir, dtype="float32", device="cpu", max_num_batched_tokens=37)
    assert _tokens(chunked.generate(_ids(prompts), GREEDY)) == one_shot


def test_shared_prefix_is_cached(llama_dir: Path) -> None:
    llm = LLM(llama_dir, dtype="float32", device="cpu")
    prefix = mixed_prompts(1, seed=6, low=80, high=81)[0]
    first = llm.generate(_ids([prefix + [7, 8, 9]]), GREEDY)[0]
    second = llm.generate(_ids([prefix + [10, 11]]), GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 64
    fresh = LLM(llama_dir, dtype="float32", device="cpu", enable_prefix_caching=False)
    assert fresh.generate(_ids([prefix + [10, 11]]), GREEDY)[0].outputs[0].token_ids == second.outputs[0].token_ids


def test_abort_mid_generation_frees_blocks(llama_dir: Path) -> None:
    llm = LLM(llama_dir, dtype="float32", device="cpu")
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    ids = [engine.add_request(None, {"prompt_token_ids": p}, params) for p in mixed_prompts(5, seed=7)]
    for _ in range(10):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    for request_id in ids:
        engine.abort_request(request_id)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_n_samples_share_prompt_blocks(llama_dir: Path) -> None:
    llm = LLM(llama_dir, dtype="float32", device="cpu")
    prompt = mixed_prompts(1, seed=8, low=70, high=71)[0]
    out = llm.generate(_ids([prompt]), SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=16, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    queries, hits = llm.engine.block_manager.prefix_queries, llm.engine.block_manager.prefix_hits
    assert hits >= 3 * 64, (queries, hits)  # samples 1..3 reuse sample 0's four full prompt blocks


def test_generate_accepts_text_and_ids_and_param_list(llama_dir: Path) -> None:
    llm = LLM(llama_dir, dtype="float32", device="cpu")
    outs = llm.generate(["hello world", {"prompt_token_ids": [5, 6, 7]}],
                        [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                         SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)])
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("hello world")
    assert len(outs[0].outputs[0].token_ids) == 5 and len(outs[1].outputs[0].token_ids) == 3
    assert outs[0].outputs[0].text == llm.tokenizer.decode(outs[0].outputs[0].token_ids)
    assert outs[1].outputs[0].finish_reason == "length"


def test_bad_requests_raise_value_errors_naming_the_field(llama_dir: Path) -> None:
    llm = LLM(llama_dir, dtype="float32", device="cpu", max_model_len=256)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(_ids([[5] * 200]), SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(_ids([[5, 100000]]), GREEDY)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(_ids([[]]), GREEDY)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert not llm.engine.has_unfinished_requests()


def test_a_block_freed_without_a_key_is_reused_before_a_cached_prefix() -> None:
    from reasoning_engine.engine.kv_cache import BlockManager
    from reasoning_engine.engine.request import Request

    bm = BlockManager(num_blocks=3, block_size=2)
    turn = Request("turn", "turn", 0, None, [1, 2, 3, 4], SamplingParams(max_tokens=1), frozenset())
    bm.allocate(turn, 4)
    turn.num_computed_tokens = 4
    bm.cache_full_blocks(turn)
    keys = bm.full_block_keys(turn)
    bm.free(turn)
    drafting = Request("draft", "draft", 0, None, [9], SamplingParams(max_tokens=8), frozenset())
    bm.allocate(drafting, 3)  # the root token and two draft tokens: two blocks, the never-used one and a cached one
    bm.truncate(drafting, 1)  # both drafts rejected: the second block goes back without a key
    assert sum(key in bm.cached for key in keys) == 1
    bm.allocate(drafting, 3)  # the next verification takes that block again, evicting nothing more
    assert sum(key in bm.cached for key in keys) == 1


class WrongDrafts:
    """Drafts a chain of token 0 as long as allowed, nearly always rejected: verifications grow the block table and
    give blocks back."""

    method = "wrong"

    def start_request(self, request_id: str, prompt_token_ids) -> None:
        pass

    def propose(self, request_id: str, token_ids, max_draft_tokens: int):
        from reasoning_engine.speculative.draft import Draft

        return Draft([0] * max_draft_tokens, list(range(-1, max_draft_tokens - 1)))

    def on_tokens_accepted(self, request_id: str, new_token_ids) -> None:
        pass

    def finish_request(self, request_id: str, learn: bool = True, token_ids=None) -> None:
        pass


def test_verification_does_not_evict_a_cached_prefix_it_has_free_room_beside(llama_dir: Path) -> None:
    """A cache with room for a 40-token prefix and a 48-token decode beside it: the decode verifies a rejected draft
    token every step, and the prefix is still cached afterwards (a block that held only a rejected draft went back to
    the back of the free queue, so the next block the decode needed evicted a prefix block instead)."""
    llm = LLM(llama_dir, dtype="float32", device="cpu", block_size=4, kv_cache_blocks=26, max_model_len=96,
              adaptive=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    llm.engine.spec.proposer = WrongDrafts()
    prefix = mixed_prompts(1, seed=8, low=40, high=41)[0]
    llm.generate(_ids([prefix + [7]]), SamplingParams(temperature=0.0, max_tokens=1))
    decode = llm.generate(_ids([[5, 6, 7, 8, 9, 10, 11, 12]]), SamplingParams(temperature=0.0, max_tokens=40,
                                                                               ignore_eos=True))[0]
    assert decode.spec_draft_tokens >= 39 and decode.spec_accepted_tokens < decode.spec_draft_tokens
    again = llm.generate(_ids([prefix + [9]]), SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert again.num_cached_tokens == 40
