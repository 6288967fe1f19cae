"""Hybrid models (linear-attention state slots beside the paged KV cache, engine/state_cache.py) through everything the
engine does: chunked prefill, prefix hits restored from state snapshots (a repeated prompt, an agent's next turn),
preemption and recompute, n > 1, aborts, batch invariance and lossless speculative decoding. Every run is checked
against the same model run plainly (one request at a time, no prefix cache, no drafts), which test_parity.py checks
against transformers."""

from __future__ import annotations

import random

import pytest
import torch

from reasoning_engine import LLM, SamplingParams


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
BS = 8


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module", params=["qwen3_next", "kimi_linear"])
def path(tiny_checkpoint, request) -> str:
    """Gated DeltaNet (one decay per head, GQA beside it) and Kimi Delta Attention (one per key channel, MLA)."""
    return str(tiny_checkpoint(request.param).path)


@pytest.fixture(scope="module")
def plain(path: str):
    """Greedy continuations of the model run one request at a time, without prefix caching: the reference."""
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS, enable_prefix_caching=False, max_num_seqs=1)
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
    states = engine.scheduler.states
    assert len(states.free) + states.num_snapshots == states.num_slots  # every live slot given back
    assert not states.pending


def test_chunked_prefill_and_a_mixed_batch_give_the_plain_tokens(path: str, plain) -> None:
    """Prompts of many blocks, prefilled in chunks of 24 tokens beside each other's decodes."""
    prompts = _prompts(0, (5, 37, 70, 101))
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS, max_num_batched_tokens=24)
    assert _generate(llm, prompts) == [plain(p) for p in prompts]
    _assert_no_leak(llm)


def test_prefix_hits_restore_the_state_at_a_snapshot(path: str, plain) -> None:
    """A repeated prompt hits at its last block boundary; a longer prompt sharing it and an agent's next turn
    (prompt + answer + more) hit too, and all give the plain tokens."""
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS)
    first = _prompts(1, (45,))[0]
    answer = _generate(llm, [first])[0]
    assert answer == plain(first)
    blocks = llm.engine.block_manager
    again = _generate(llm, [first])[0]
    assert again == answer
    repeated_hits = blocks.prefix_hits
    assert repeated_hits == (len(first) - 1) // BS * BS  # the prompt's last boundary
    turn = first + answer + _prompts(2, (11,))[0]
    assert _generate(llm, [turn])[0] == plain(turn)
    # the state after the previous turn's last full block was kept while it decoded
    assert blocks.prefix_hits - repeated_hits == (len(first) + len(answer) - 1) // BS * BS
    _assert_no_leak(llm)


def test_a_hit_needs_a_snapshot_and_shorter_prefixes_fall_back(path: str, plain) -> None:
    """A prompt sharing only part of another's blocks hits at the last snapshot at or below the shared part (every
    `interval` blocks), or computes from the start: never a wrong state."""
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS)
    llm.engine.scheduler.states.interval_blocks = 2
    base = _prompts(3, (60,))[0]
    _generate(llm, [base])
    other = base[:37] + _prompts(4, (20,))[0]  # shares 4 full blocks; snapshots at 16 and 32 tokens (and 56)
    before = llm.engine.block_manager.prefix_hits
    assert _generate(llm, [other])[0] == plain(other)
    assert llm.engine.block_manager.prefix_hits - before == 32
    _assert_no_leak(llm)


def test_preemption_recomputes_and_gives_the_plain_tokens(path: str, plain) -> None:
    prompts = _prompts(5, (30, 41, 52, 63))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS, kv_cache_blocks=24, max_model_len=128)
    assert _generate(llm, prompts, params) == [plain(p, params) for p in prompts]
    assert llm.engine.num_preemptions > 0
    _assert_no_leak(llm)


def test_n_samples_fork_the_prompt_state(path: str, plain) -> None:
    """n > 1: the samples after the first start from the prompt's snapshot; greedy samples all equal the plain run,
    and seeded samples equal the same seeds run alone."""
    prompt = _prompts(6, (50,))[0]
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(n=3, temperature=0.0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [list(c.token_ids) for c in out.outputs] == [plain(prompt)] * 3
    assert llm.engine.block_manager.prefix_hits > 0
    seeded = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    together = [list(c.token_ids) for c in llm.generate([{"prompt_token_ids": prompt}], seeded, use_tqdm=False)[0].outputs]
    alone = LLM(path, dtype="float32", device="cpu", block_size=BS, enable_prefix_caching=False)
    apart = [list(c.token_ids) for c in alone.generate([{"prompt_token_ids": prompt}], seeded, use_tqdm=False)[0].outputs]
    assert together == apart
    _assert_no_leak(llm)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_decoding_is_lossless(path: str, plain, method: str) -> None:
    motif = _prompts(7, (9,))[0]
    prompts = [motif * 6, motif[:5] * 9 + [3], _prompts(8, (33,))[0]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS,
              speculative_config={"method": method, "num_speculative_tokens": 4}, adaptive=False)
    assert _generate(llm, prompts, params) == [plain(p, params) for p in prompts]
    assert llm.engine.spec.stats.verify_steps > 0
    _assert_no_leak(llm)


class TreeDrafts:
    """Draft trees that know the plain continuation: below the root a wrong token (with a wrong child), beside it the
    right tokens, the last of them wrong every third step; so some drafts are accepted whole, some in part, and
    the accepted branch is never the first."""

    method = "oracle"

    def __init__(self, expected: list[list[int]]) -> None:
        self.expected = expected
        self.calls = 0

    def start_request(self, request_id, prompt_token_ids) -> None:
        pass

    def propose(self, request_id, token_ids, max_draft_tokens: int):
        from reasoning_engine.speculative.draft import Draft

        seq = next((e for e in self.expected if e[: len(token_ids)] == list(token_ids)), None)
        if seq is None or max_draft_tokens < 3:
            return Draft.empty()
        right = seq[len(token_ids) : len(token_ids) + max_draft_tokens - 2]
        self.calls += 1
        if right and self.calls % 3 == 0:
            right[-1] = (right[-1] + 1) % 256
        wrong = (seq[len(token_ids)] + 7) % 256 if len(seq) > len(token_ids) else 5
        tokens = [wrong, (wrong + 1) % 256] + right
        parents = [-1, 0] + [-1 if i == 0 else 1 + i for i in range(len(right))]
        return Draft(tokens, parents)

    def on_tokens_accepted(self, request_id, new_token_ids) -> None:
        pass

    def finish_request(self, request_id, learn: bool = True, token_ids=None) -> None:
        pass


def test_accepted_tree_branches_carry_their_state(path: str, plain) -> None:
    """The accepted node's state becomes the live one (also when a boundary falls inside the accepted path, where
    a snapshot is taken from the node's scratch slot): the tokens equal the plain run, and a later prompt that hits
    such a snapshot does too."""
    prompts = _prompts(10, (13, 29))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [p + plain(p, params) for p in prompts]
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS,
              speculative_config={"method": "ngram", "num_speculative_tokens": 6}, adaptive=False)
    llm.engine.spec.proposer = TreeDrafts(expected)
    assert _generate(llm, prompts, params) == [plain(p, params) for p in prompts]
    stats = llm.engine.spec.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    turn = expected[0] + _prompts(11, (5,))[0]
    before = llm.engine.block_manager.prefix_hits
    assert _generate(llm, [turn], GREEDY) == [plain(turn)]
    assert llm.engine.block_manager.prefix_hits - before == (len(expected[0]) - 1) // BS * BS
    _assert_no_leak(llm)


def test_random_stress_with_aborts_preemption_and_drafts(path: str, plain) -> None:
    """Random lengths, arrivals between steps, aborts, a small cache and drafts: every finished request has the plain
    tokens and nothing leaks."""
    rng = random.Random(0)
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS, kv_cache_blocks=40, max_model_len=160,
              max_num_batched_tokens=32, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              adaptive=False)
    engine = llm.engine
    motif = _prompts(9, (7,))[0]
    wanted: dict[str, list[int]] = {}
    aborted: set[str] = set()
    done: dict[str, list[int]] = {}
    for i in range(14):
        length = rng.randint(3, 60)
        prompt = (motif * 10)[:length] if i % 2 else _prompts(100 + i, (length,))[0]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 30), ignore_eos=True)
        rid = f"r{i}"
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        wanted[rid] = plain(prompt, params)
        for _ in range(rng.randint(0, 3)):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        if rng.random() < 0.2:
            engine.abort_request(rid)
            aborted.add(rid)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    for rid, tokens in done.items():
        if rid not in aborted:
            assert tokens == wanted[rid], rid
    assert set(wanted) - aborted <= set(done)
    _assert_no_leak(llm)


def test_state_group_usage_in_stats_and_metrics(path: str) -> None:
    from reasoning_engine.server.metrics import _EngineCollector

    llm = LLM(path, dtype="float32", device="cpu", block_size=BS)
    _generate(llm, _prompts(12, (40,)))
    stats = llm.engine.stats()
    states = llm.engine.scheduler.states
    assert stats.state_cache_snapshots == states.num_snapshots > 0
    assert stats.state_cache_usage == pytest.approx(states.num_snapshots / states.num_slots)
    samples = {s.name: s.value for family in _EngineCollector(llm.engine.stats, "m").collect() for s in family.samples}
    assert samples["reasoning_engine:state_cache_snapshots"] == states.num_snapshots
    assert samples["reasoning_engine:state_cache_usage_perc"] == pytest.approx(stats.state_cache_usage)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "kimi_linear"])
def test_prompts_of_many_blocks_match_transformers(tiny_checkpoint, name: str) -> None:
    """Parity on prompts many blocks long, prefilled in chunks that end mid-block (test_parity.py's prompts are
    shorter than two blocks): last-position logits within 1e-4 and 32-token greedy continuations of a mixed-length
    batch equal transformers'."""
    ckpt = tiny_checkpoint(name)
    reference = ckpt.reference()
    prompts = _prompts(20, (3, 45, 83, 130))
    llm = LLM(str(ckpt.path), dtype="float32", device="cpu", block_size=BS, max_num_batched_tokens=36)
    for ids, got in zip(prompts, llm.compute_logits(prompts)):
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(got.float().cpu(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for ids, tokens in zip(prompts, _generate(llm, prompts, params)):
        seq = list(ids)
        with torch.no_grad():  # the whole sequence recomputed each step, as test_parity.py's reference does
            for _ in range(32):
                seq.append(int(reference(torch.tensor([seq])).logits[0, -1].argmax()))
        assert tokens == seq[len(ids):], f"{name}, prompt of {len(ids)} tokens"
