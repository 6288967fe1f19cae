"""Hybrid models (linear-attention state slots beside the paged KV cache, engine/state_cache.py) through everything the
engine does: chunked prefill, prefix hits restored from state snapshots (a repeated prompt, an agent's next turn),
preemption and recompute, n > 1, aborts, batch invariance and lossless speculative decoding, decode steps through the
CUDA-graph runner's static padded path (compile_decode's graphs are checked at the layer level,
tests/layers/test_linear_attention.py: compiling an engine's took minutes on 2 cores). Every run is checked against
the same model run plainly (one request at a time, no prefix cache, no drafts), which test_parity.py checks against
transformers."""

from __future__ import annotations

import random

import pytest
import torch

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.engine.cuda_graph import CudaGraphRunner
from reasoning_engine.engine.worker import StepInput

from .family_engines import assert_no_leak, generate_ids, one_at_a_time, random_prompts
from .test_cuda_graph import _record_buckets, _record_sizes

pytestmark = pytest.mark.slow  # whole hybrid-model engines


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
BS = 8


@pytest.fixture(scope="module", params=["qwen3_next", "kimi_linear"])
def path(tiny_checkpoint, request) -> str:
    """Gated DeltaNet (one decay per head, GQA beside it) and Kimi Delta Attention (one per key channel, MLA)."""
    return str(tiny_checkpoint(request.param).path)


@pytest.fixture(scope="module")
def plain(path: str):
    """Greedy continuations of the model run one request at a time, without prefix caching: the reference."""
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS, enable_prefix_caching=False, max_num_seqs=1)
    return one_at_a_time(llm, GREEDY)


def test_chunked_prefill_and_a_mixed_batch_give_the_plain_tokens(path: str, plain) -> None:
    """Prompts of many blocks, prefilled in chunks of 24 tokens beside each other's decodes."""
    prompts = random_prompts(0, (5, 37, 70, 101))
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS, max_num_batched_tokens=24)
    assert generate_ids(llm, prompts, GREEDY) == [plain(p) for p in prompts]
    assert_no_leak(llm, states=True, pending=True)


def test_prefix_hits_restore_the_state_at_a_snapshot(path: str, plain) -> None:
    """A repeated prompt hits at its last block boundary; a longer prompt sharing it and an agent's next turn
    (prompt + answer + more) hit too, and all give the plain tokens."""
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS)
    first = random_prompts(1, (45,))[0]
    answer = generate_ids(llm, [first], GREEDY)[0]
    assert answer == plain(first)
    blocks = llm.engine.block_manager
    again = generate_ids(llm, [first], GREEDY)[0]
    assert again == answer
    repeated_hits = blocks.prefix_hits
    assert repeated_hits == (len(first) - 1) // BS * BS  # the prompt's last boundary
    turn = first + answer + random_prompts(2, (11,))[0]
    assert generate_ids(llm, [turn], GREEDY)[0] == plain(turn)
    # the state after the previous turn's last full block was kept while it decoded
    assert blocks.prefix_hits - repeated_hits == (len(first) + len(answer) - 1) // BS * BS
    assert_no_leak(llm, states=True, pending=True)


def test_a_hit_needs_a_snapshot_and_shorter_prefixes_fall_back(path: str, plain) -> None:
    """A prompt sharing only part of another's blocks hits at the last snapshot at or below the shared part (every
    `interval` blocks), or computes from the start: never a wrong state."""
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS)
    llm.engine.scheduler.states.interval_blocks = 2
    base = random_prompts(3, (60,))[0]
    generate_ids(llm, [base], GREEDY)
    other = base[:37] + random_prompts(4, (20,))[0]  # shares 4 full blocks; snapshots at 16 and 32 tokens (and 56)
    before = llm.engine.block_manager.prefix_hits
    assert generate_ids(llm, [other], GREEDY)[0] == plain(other)
    assert llm.engine.block_manager.prefix_hits - before == 32
    assert_no_leak(llm, states=True, pending=True)


def test_preemption_recomputes_and_gives_the_plain_tokens(path: str, plain) -> None:
    prompts = random_prompts(5, (30, 41, 52, 63))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS, kv_cache_blocks=24, max_model_len=128)
    assert generate_ids(llm, prompts, params) == [plain(p, params) for p in prompts]
    assert llm.engine.num_preemptions > 0
    assert_no_leak(llm, states=True, pending=True)


def test_n_samples_fork_the_prompt_state(path: str, plain) -> None:
    """n > 1: the samples after the first start from the prompt's snapshot; greedy samples all equal the plain run,
    and seeded samples equal the same seeds run alone."""
    prompt = random_prompts(6, (50,))[0]
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
    assert_no_leak(llm, states=True, pending=True)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_decoding_is_lossless(path: str, plain, method: str) -> None:
    motif = random_prompts(7, (9,))[0]
    prompts = [motif * 6, motif[:5] * 9 + [3], random_prompts(8, (33,))[0]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS,
              speculative_config={"method": method, "num_speculative_tokens": 4}, adaptive=False)
    assert generate_ids(llm, prompts, params) == [plain(p, params) for p in prompts]
    assert llm.engine.spec.stats.verify_steps > 0
    assert_no_leak(llm, states=True, pending=True)


class TreeDrafts:
    """Draft trees that know the plain continuation: below the root a wrong token (with a wrong child), beside it the
    right tokens, the last of them wrong every third step; so some drafts are accepted whole, some in part, and
    the accepted branch is never the first. Below three draft tokens: a chain of the right tokens, the last wrong
    every third step."""

    method = "oracle"

    def __init__(self, expected: list[list[int]]) -> None:
        self.expected = expected
        self.calls = 0

    def start_request(self, request_id, prompt_token_ids) -> None:
        pass

    def propose(self, request_id, token_ids, max_draft_tokens: int):
        from reasoning_engine.speculative.draft import Draft

        seq = next((e for e in self.expected if e[: len(token_ids)] == list(token_ids)), None)
        if seq is None or max_draft_tokens < 1:
            return Draft.empty()
        if max_draft_tokens < 3:
            chain = seq[len(token_ids) : len(token_ids) + max_draft_tokens]
            self.calls += 1
            if chain and self.calls % 3 == 0:
                chain[-1] = (chain[-1] + 1) % 256
            return Draft.path(chain) if chain else Draft.empty()
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
    prompts = random_prompts(10, (13, 29))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [p + plain(p, params) for p in prompts]
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS,
              speculative_config={"method": "ngram", "num_speculative_tokens": 6}, adaptive=False)
    llm.engine.spec.proposer = TreeDrafts(expected)
    assert generate_ids(llm, prompts, params) == [plain(p, params) for p in prompts]
    stats = llm.engine.spec.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    turn = expected[0] + random_prompts(11, (5,))[0]
    before = llm.engine.block_manager.prefix_hits
    assert generate_ids(llm, [turn], GREEDY) == [plain(turn)]
    assert llm.engine.block_manager.prefix_hits - before == (len(expected[0]) - 1) // BS * BS
    assert_no_leak(llm, states=True, pending=True)


def test_random_stress_with_aborts_preemption_and_drafts(path: str, plain) -> None:
    """Random lengths, arrivals between steps, aborts, a small cache and drafts: every finished request has the plain
    tokens and nothing leaks."""
    rng = random.Random(0)
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS, kv_cache_blocks=40, max_model_len=160,
              max_num_batched_tokens=32, speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              adaptive=False)
    engine = llm.engine
    motif = random_prompts(9, (7,))[0]
    wanted: dict[str, list[int]] = {}
    aborted: set[str] = set()
    done: dict[str, list[int]] = {}
    for i in range(14):
        length = rng.randint(3, 60)
        prompt = (motif * 10)[:length] if i % 2 else random_prompts(100 + i, (length,))[0]
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
    assert_no_leak(llm, states=True, pending=True)


def test_state_group_usage_in_stats_and_metrics(path: str) -> None:
    from reasoning_engine.server.metrics import _EngineCollector

    llm = LLM(path, dtype="float32", device="cpu", block_size=BS)
    generate_ids(llm, random_prompts(12, (40,)), GREEDY)
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
    prompts = random_prompts(20, (3, 45, 83, 130))
    llm = LLM(str(ckpt.path), dtype="float32", device="cpu", block_size=BS, max_num_batched_tokens=36)
    for ids, got in zip(prompts, llm.compute_logits(prompts)):
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0, -1].float()
        torch.testing.assert_close(got.float().cpu(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for ids, tokens in zip(prompts, generate_ids(llm, prompts, params)):
        seq = list(ids)
        with torch.no_grad():  # the whole sequence recomputed each step, as test_parity.py's reference does
            for _ in range(32):
                seq.append(int(reference(torch.tensor([seq])).logits[0, -1].argmax()))
        assert tokens == seq[len(ids):], f"{name}, prompt of {len(ids)} tokens"


def test_padded_static_decode_matches_eager(path: str, plain) -> None:
    """Decode steps through the CUDA-graph runner's static buffers with padding rows (capture=False: the path a graph
    replays, with the forward called directly; that is how it is checked without a GPU): the plain tokens, snapshots
    taken at decode boundaries (copied after the step) that a next turn hits, and a padded step that leaves every
    state slot but the padding slot as the eager step leaves it."""
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS, max_num_seqs=8, enforce_eager=True)
    worker = llm.engine.runner.worker
    assert worker.decode_graphs is None
    graphs = CudaGraphRunner(worker.model, worker.config, worker.padding_block, capture=False,
                             state_padding_slot=worker.state_padding_slot)
    worker.decode_graphs = graphs
    sizes = _record_sizes(graphs)
    prompts = random_prompts(30, (5, 19, 33, 12, 41))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 19, 2, 12, 9)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    answers = [list(o.outputs[0].token_ids) for o in outs]
    assert answers == [plain(p, sp) for p, sp in zip(prompts, params)]
    assert {5, 3} <= set(sizes), f"expected decode steps that need padding, got sizes {sizes}"
    assert graphs.num_steps == len(sizes)
    turn = prompts[1] + answers[1] + random_prompts(31, (6,))[0]
    before = llm.engine.block_manager.prefix_hits
    assert generate_ids(llm, [turn], GREEDY) == [plain(turn)]
    assert llm.engine.block_manager.prefix_hits - before == (len(prompts[1]) + len(answers[1]) - 1) // BS * BS
    assert_no_leak(llm, states=True, pending=True)

    # one step of three sequences (one from zeros) padded to four, eager and static, from the same states
    pad = worker.padding_block
    step = StepInput([3, 4, 5], [6, 6, 6], [pad * BS + 6] * 3, [1, 1, 1], [7, 7, 7], [[pad]] * 3, [0, 1, 2],
                     state_slots=[4, 0, 2], state_fresh=[False, True, False], state_saves=[[], [], []])
    for tensors in worker.state_caches:
        for tensor in tensors:
            tensor.copy_(torch.randn_like(tensor))
    start = [t.clone() for tensors in worker.state_caches for t in tensors]
    worker.decode_graphs = None
    want = worker.execute_model([step])[0]
    want_states = [t.clone() for tensors in worker.state_caches for t in tensors]
    for tensor, saved in zip((t for tensors in worker.state_caches for t in tensors), start):
        tensor.copy_(saved)
    worker.decode_graphs = graphs
    steps = graphs.num_steps
    got = worker.execute_model([step])[0]
    assert graphs.num_steps == steps + 1 and sizes[-1] == 3 and 3 not in graphs.batch_sizes  # padded
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    others = [s for s in range(worker.state_padding_slot + 1) if s != worker.state_padding_slot]
    for tensor, expected in zip((t for tensors in worker.state_caches for t in tensors), want_states):
        torch.testing.assert_close(tensor[others], expected[others], rtol=1e-5, atol=1e-5)
        assert torch.equal(tensor[worker.state_padding_slot + 1:], expected[worker.state_padding_slot + 1:])


def test_padded_static_verify_matches_eager(path: str, plain) -> None:
    """Verification steps through the runner's static buffers (capture=False), every sequence padded to the bucket's
    query length and the batch to its size: each node's state goes to its scratch slot and the accepted one's is
    committed, a decode among verifications writes its live slot; the plain tokens, and a next turn hits a snapshot
    taken on an accepted path."""
    prompts = random_prompts(10, (13, 29, 21))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [p + plain(p, params) for p in prompts]
    llm = LLM(path, dtype="float32", device="cpu", block_size=BS, max_num_seqs=8, enforce_eager=True, adaptive=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 6})
    worker = llm.engine.runner.worker
    graphs = CudaGraphRunner(worker.model, worker.config, worker.padding_block, capture=False,
                             max_draft_tokens=worker.max_draft_tokens, state_padding_slot=worker.state_padding_slot)
    assert {q for _, q in graphs.verify_buckets} == {2, 3, 5, 7}
    worker.decode_graphs = graphs
    llm.engine.spec.proposer = TreeDrafts(expected)
    served = _record_buckets(graphs)
    assert generate_ids(llm, prompts, params) == [plain(p, params) for p in prompts]
    verified = [step for step in served if step[1] > 1]
    assert graphs.num_verify_steps == len(verified) >= 3
    assert any(bucket[0] > n for n, _, _, bucket in verified), f"no step padded in sequences: {verified}"
    assert any(shortest < q for _, q, shortest, _ in verified), f"no step of unequal queries: {verified}"
    assert any(bucket[1] > q for _, q, _, bucket in verified), f"no step padded to a longer query: {verified}"
    stats = llm.engine.spec.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    turn = expected[0] + random_prompts(11, (5,))[0]
    before = llm.engine.block_manager.prefix_hits
    assert generate_ids(llm, [turn], GREEDY) == [plain(turn)]
    assert llm.engine.block_manager.prefix_hits - before == (len(expected[0]) - 1) // BS * BS
    assert_no_leak(llm, states=True, pending=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_graphs_match_eager_on_gpu(path: str) -> None:
    """Captured decode and verification graphs of a hybrid model give the eager steps' tokens."""
    motif = random_prompts(7, (9,))[0]
    prompts = [motif * 4, random_prompts(40, (21,))[0], motif[:5] * 6, random_prompts(41, (3,))[0], random_prompts(42, (33,))[0]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    common = dict(dtype="float32", device="cuda", kernel_backend="triton", block_size=BS, max_num_seqs=8,
                  adaptive=False, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    eager = LLM(path, enforce_eager=True, **common)
    want = generate_ids(eager, prompts, params)
    del eager
    llm = LLM(path, **common)
    graphs = llm.engine.runner.worker.decode_graphs
    assert graphs.captured_batch_sizes == [1, 2, 4, 8] and graphs.captured_verify_buckets
    assert generate_ids(llm, prompts, params) == want
    assert graphs.num_steps > graphs.num_verify_steps > 0
    assert_no_leak(llm, states=True, pending=True)
