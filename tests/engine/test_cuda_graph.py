"""CUDA graphs for decode batches and verification batches: bucket sizes, when graphs are used,
and that the padded static-buffer decode and verification paths give the same greedy tokens as eager steps.

The padded path also runs without capture (`CudaGraphRunner(..., capture=False)`): the same static buffers, padding
rows and static-shape attention metadata, with the forward called directly instead of replayed; that is how it is
checked without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import pytest
import torch

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.batch import ForwardBatch
from reasoning_engine.engine.cuda_graph import CudaGraphRunner, choose_bucket, decode_batch_sizes, verify_buckets
from reasoning_engine.engine.tuning import MAX_DRAFT_LENGTH_BUCKETS, EngineTuner
from reasoning_engine.llm import build_engine_config
from reasoning_engine.server.cli import _engine_kwargs, register_cli
from reasoning_engine.speculative.decoder import SpeculativeConfig
from reasoning_engine.speculative.draft import Draft
from char_models import mixed_prompts

# Triton kernels run compiled on a GPU, else interpreted on CPU tensors (as in tests/kernels)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
# Five requests finishing at different steps: decode batches of 5 (padded to 8), 4, 3 (padded to 4) and 2. Rows
# shift when an earlier request finishes, so a padding row that kept its previous step's slot would overwrite a live
# request's cache entry.
MAX_TOKENS = [3, 6, 2, 6, 4]
PROMPTS = [{"prompt_token_ids": p} for p in mixed_prompts(len(MAX_TOKENS), seed=11, low=3, high=30)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_TOKENS]


# verification: longer outputs, so that drafts of several shapes meet in a step
VERIFY_PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in (9, 16, 6, 14, 11)]


def _generate(llm: LLM, params: list[SamplingParams] = PARAMS) -> tuple[list[list[int]], list[float]]:
    """Greedy tokens and their summed logprobs (these catch a corrupted cache that leaves the argmax unchanged)."""
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    return [o.token_ids for o in outs], [o.cumulative_logprob for o in outs]


def _assert_same(got: tuple[list[list[int]], list[float]], want: tuple[list[list[int]], list[float]]) -> None:
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-4)


def _record_sizes(graphs: CudaGraphRunner) -> list[int]:
    """Wrap `graphs.run` to record the batch size of every step it serves."""
    sizes: list[int] = []
    run = graphs.run

    def recording(batch: ForwardBatch) -> torch.Tensor:
        sizes.append(batch.num_seqs)
        return run(batch)

    graphs.run = recording
    return sizes


def test_decode_batch_sizes() -> None:
    assert decode_batch_sizes(1) == [1]
    assert decode_batch_sizes(8) == [1, 2, 4, 8]
    assert decode_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


def test_verification_buckets_and_choice() -> None:
    # query length k + 1 per draft-length bucket, within the padded-token bound
    assert verify_buckets([1, 2, 4, 8], [1, 2, 4], max_tokens=24) == [
        (1, 2), (1, 3), (1, 5), (2, 2), (2, 3), (2, 5), (4, 2), (4, 3), (4, 5), (8, 2), (8, 3)]
    buckets = verify_buckets([1, 2, 4, 8], [1, 2, 4], max_tokens=24)
    assert choose_bucket(buckets, 1, 2) == (1, 2)
    assert choose_bucket(buckets, 3, 2) == (4, 2)
    assert choose_bucket(buckets, 2, 4) == (2, 5)
    assert choose_bucket(buckets, 5, 3) == (8, 3)
    assert choose_bucket(buckets, 5, 4) is None  # (8, 5) would exceed the bound: eager
    assert choose_bucket(buckets, 9, 2) is None
    # fewest padded tokens, not the smallest batch first
    assert choose_bucket([(1, 9), (4, 2)], 1, 2) == (4, 2)
    assert choose_bucket([(2, 3), (3, 2)], 2, 2) == (2, 3)  # a tie: fewer sequences


def test_graph_bucket_config_is_validated(llama_dir: Path) -> None:
    config = build_engine_config(llama_dir, dtype="float32", device="cpu")
    for bad in ((2, 1), (0, 4), (1, 1)):
        with pytest.raises(ValueError, match="cuda_graph_draft_lengths"):
            dataclasses.replace(config, cuda_graph_draft_lengths=bad)
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        dataclasses.replace(config, cuda_graph_batch_sizes=(4, 2))
    assert dataclasses.replace(config, cuda_graph_draft_lengths=()).cuda_graph_draft_lengths == ()


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.slow), "torch"])
@pytest.mark.parametrize("family", ["llama_dir", "deepseek_dir"])
def test_padded_static_decode_matches_eager(family: str, backend: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(family)
    # block_size 4: tables span several blocks; max_model_len 512: the static launch covers 2 context slices where
    # the eager one covers 1 (for these short contexts), so static-shape attention is exercised
    llm = LLM(path, dtype="float32", device=DEVICE, kernel_backend=backend, block_size=4, max_model_len=512,
              max_num_seqs=8, enable_prefix_caching=False, enforce_eager=True)
    runner = llm.engine.runner.worker
    assert runner.decode_graphs is None
    eager = _generate(llm)

    graphs = CudaGraphRunner(runner.model, runner.config, runner.padding_block, capture=False)
    runner.decode_graphs = graphs
    sizes = _record_sizes(graphs)
    padded = _generate(llm)
    _assert_same(padded, eager)
    assert [len(t) for t in padded[0]] == MAX_TOKENS
    assert {5, 3} <= set(sizes), f"expected decode steps that need padding, got sizes {sizes}"
    assert graphs.num_steps == len(sizes)
    assert runner.cuda_graph_batch_sizes == []  # nothing was captured


class VariedTrees:
    """Draft trees that know the eager continuation, of a shape that changes with the request and the step: none (a
    decode among verifications), a chain whose last node is wrong (partly accepted), a tree whose first sibling is
    wrong, a single right node, and a long chain wrong at its root (nothing accepted)."""

    method = "varied"

    def __init__(self, answers: dict[tuple[int, ...], list[int]]) -> None:
        self.answers = answers
        self.prompts: dict[str, tuple[int, ...]] = {}

    def start_request(self, request_id: str, prompt_token_ids) -> None:
        self.prompts[request_id] = tuple(prompt_token_ids)

    def propose(self, request_id: str, token_ids, max_draft_tokens: int) -> Draft:
        prompt = self.prompts[request_id]
        done = len(token_ids) - len(prompt)
        truth = self.answers[prompt][done:]
        shape = (len(prompt) + done) % 5
        if shape == 0 or len(truth) < 3:
            return Draft.empty()
        wrong = [(t + 1) % 100 for t in truth]
        if shape == 1:
            draft = Draft.path([truth[0], truth[1], wrong[2]])
        elif shape == 2:
            draft = Draft([wrong[0], truth[0], truth[1]], [-1, -1, 1])
        elif shape == 3:
            draft = Draft.path(truth[:1])
        else:
            draft = Draft.path([wrong[0], *truth[1:3]])
        return draft.truncated(max_draft_tokens)

    def on_tokens_accepted(self, request_id: str, new_token_ids) -> None:
        pass

    def finish_request(self, request_id: str, learn: bool = True, token_ids=None) -> None:
        self.prompts.pop(request_id, None)


def _record_buckets(graphs: CudaGraphRunner) -> list[tuple[int, int, int, tuple[int, int] | None]]:
    """Wrap `graphs.run` to record (sequences, longest query, shortest query, bucket) of every step it serves."""
    served: list[tuple[int, int, int, tuple[int, int] | None]] = []
    run = graphs.run

    def recording(batch: ForwardBatch) -> torch.Tensor:
        served.append((batch.num_seqs, batch.max_query_len, min(batch.query_lens_cpu), graphs.bucket(batch)))
        return run(batch)

    graphs.run = recording
    return served


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.slow), "torch"])
@pytest.mark.parametrize("family", ["llama_dir", "deepseek_dir"])
def test_padded_static_verify_matches_eager(family: str, backend: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(family)
    plain = _generate(LLM(path, dtype="float32", device="cpu", max_num_seqs=8), VERIFY_PARAMS)
    answers = {tuple(p["prompt_token_ids"]): out for p, out in zip(PROMPTS, plain[0])}
    # adaptive=False: drafts verified every step; num_speculative_tokens 4: draft-length buckets 1, 2, 4 (query
    # lengths 2, 3, 5), so a step's sequences are padded both in number and in query rows
    llm = LLM(path, dtype="float32", device=DEVICE, kernel_backend=backend, block_size=4, max_model_len=512,
              max_num_seqs=8, enable_prefix_caching=False, enforce_eager=True, adaptive=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    runner = llm.engine.runner.worker
    assert runner.decode_graphs is None
    llm.engine.spec.proposer = VariedTrees(answers)
    eager = _generate(llm, VERIFY_PARAMS)
    _assert_same(eager, plain)

    graphs = CudaGraphRunner(runner.model, runner.config, runner.padding_block, capture=False,
                             max_draft_tokens=runner.max_draft_tokens)
    assert {q for _, q in graphs.verify_buckets} == {2, 3, 5}
    runner.decode_graphs = graphs
    llm.engine.spec.proposer = VariedTrees(answers)
    served = _record_buckets(graphs)
    padded = _generate(llm, VERIFY_PARAMS)
    _assert_same(padded, eager)
    verified = [(n, q, shortest, bucket) for n, q, shortest, bucket in served if q > 1]
    assert graphs.num_verify_steps == len(verified) >= 3
    assert any(bucket[0] > n for n, _, _, bucket in verified), f"no step padded in sequences: {verified}"
    assert any(bucket[1] > q for _, q, _, bucket in verified), f"no step padded to a longer query: {verified}"
    assert any(shortest < q for _, q, shortest, _ in verified), f"no step of unequal trees: {verified}"
    assert llm.engine.stats().spec_decode["accepted_tokens"] > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_cpu_never_captures_and_enforce_eager_is_accepted(llama_dir: Path) -> None:
    for backend in ("triton", "torch") if DEVICE == "cpu" else ("torch",):  # compiled Triton needs GPU tensors
        llm = LLM(llama_dir, dtype="float32", device="cpu", kernel_backend=backend)
        assert llm.engine.runner.worker.decode_graphs is None
        assert llm.engine.runner.worker.cuda_graph_batch_sizes == []
    llm = LLM(llama_dir, dtype="float32", device="cpu", enforce_eager=True)
    assert llm.engine.config.enforce_eager is True
    assert llm.engine.runner.worker.decode_graphs is None
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                       SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_serve_enforce_eager_flag() -> None:
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers(dest="command"))
    assert _engine_kwargs(parser.parse_args(["serve", "--enforce-eager"]))["enforce_eager"] is True
    assert "enforce_eager" not in _engine_kwargs(parser.parse_args(["serve"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama_dir", "deepseek_dir"])
def test_captured_graphs_match_eager_on_gpu(family: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(family)
    common = dict(dtype="float32", device="cuda", kernel_backend="triton", block_size=4, max_model_len=512,
                  max_num_seqs=8, enable_prefix_caching=False)
    eager_llm = LLM(path, enforce_eager=True, **common)
    assert eager_llm.engine.runner.worker.cuda_graph_batch_sizes == []
    eager = _generate(eager_llm)
    del eager_llm

    llm = LLM(path, **common)
    runner = llm.engine.runner.worker
    assert runner.cuda_graph_batch_sizes == [1, 2, 4, 8]
    sizes = _record_sizes(runner.decode_graphs)
    _assert_same(_generate(llm), eager)
    assert {5, 3} <= set(sizes)
    assert runner.decode_graphs.num_steps == len(sizes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama_dir", "deepseek_dir"])
def test_captured_verify_graphs_match_eager_on_gpu(family: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(family)
    common = dict(dtype="float32", device="cuda", kernel_backend="triton", block_size=4, max_model_len=512,
                  max_num_seqs=8, enable_prefix_caching=False, adaptive=False,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    plain = _generate(LLM(path, **{**common, "speculative_config": None}, enforce_eager=True), VERIFY_PARAMS)
    answers = {tuple(p["prompt_token_ids"]): out for p, out in zip(PROMPTS, plain[0])}
    eager_llm = LLM(path, enforce_eager=True, **common)
    eager_llm.engine.spec.proposer = VariedTrees(answers)
    eager = _generate(eager_llm, VERIFY_PARAMS)
    del eager_llm

    llm = LLM(path, **common)
    runner = llm.engine.runner.worker
    assert runner.cuda_graph_batch_sizes == [1, 2, 4, 8]
    assert runner.cuda_graph_verify_buckets == [(b, k) for b in (1, 2, 4, 8) for k in (1, 2, 4)]
    llm.engine.spec.proposer = VariedTrees(answers)
    served = _record_buckets(runner.decode_graphs)
    _assert_same(_generate(llm, VERIFY_PARAMS), eager)
    assert runner.decode_graphs.num_verify_steps == sum(q > 1 for _, q, _, _ in served) >= 3


def test_adaptive_engine_picks_draft_length_buckets(llama_dir: Path) -> None:
    config = build_engine_config(llama_dir, dtype="float32", device="cpu",
                                 speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    tuner = EngineTuner(config, SpeculativeConfig.from_dict(config.speculative_config), set())
    assert tuner.graph_draft_lengths() is None  # nothing seen: the default buckets
    tuner.controller.verified_lengths.update({3: 500, 5: 40, 6: 2, 8: 3})
    lengths = tuner.graph_draft_lengths()
    assert lengths[-1] == 8 and {3, 5} <= set(lengths) and len(lengths) <= MAX_DRAFT_LENGTH_BUCKETS
