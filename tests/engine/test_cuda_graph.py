"""CUDA graphs for decode batches (issue #7): bucket sizes, when graphs are used, and that the padded static-buffer
decode path gives the same greedy tokens as eager decoding.

The padded path also runs without capture (`CudaGraphRunner(..., capture=False)`): the same static buffers, padding
rows and static-shape attention metadata, with the forward called directly instead of replayed; that is how it is
checked without a GPU.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.batch import ForwardBatch
from reasoning_engine.engine.cuda_graph import CudaGraphRunner, decode_batch_sizes
from reasoning_engine.server.cli import _engine_kwargs, register_cli
from char_models import mixed_prompts

# Triton kernels run compiled on a GPU, else interpreted on CPU tensors (as in tests/kernels)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
# Five requests finishing at different steps: decode batches of 5 (padded to 8), 4, 3 (padded to 4) and 2. Rows
# shift when an earlier request finishes, so a padding row that kept its previous step's slot would overwrite a live
# request's cache entry.
MAX_TOKENS = [3, 6, 2, 6, 4]
PROMPTS = [{"prompt_token_ids": p} for p in mixed_prompts(len(MAX_TOKENS), seed=11, low=3, high=30)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_TOKENS]


def _generate(llm: LLM) -> tuple[list[list[int]], list[float]]:
    """Greedy tokens and their summed logprobs (these catch a corrupted cache that leaves the argmax unchanged)."""
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)]
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


@pytest.mark.parametrize("backend", ["triton", "torch"])
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
