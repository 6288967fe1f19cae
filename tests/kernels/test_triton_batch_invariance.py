"""The Triton path's greedy tokens depend on the request alone: a request gives the same tokens alone and
in a batch with shorter and longer ones, and the padded static-shape decode path (what a CUDA graph replays; run here
without capture, the kernels getting the graph's static arguments) gives the eager path's tokens. Decode slices are
shortened to 8 tokens so that these short contexts are split into many slices the merge has to combine; the bitwise
bf16 form of the same property is `test_triton_attention.test_decode_is_bitwise_batch_and_graph_invariant`."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.engine.cuda_graph import CudaGraphRunner
from reasoning_engine.kernels import triton_attention
from char_models import mixed_prompts

pytestmark = pytest.mark.slow  # whole engines through the Triton interpreter

SPLIT_TOKENS = 8


@pytest.fixture
def short_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step's metadata (eager and static-shape) with 8-token decode slices."""
    monkeypatch.setattr(triton_attention, "prepare_attention",
                        functools.partial(triton_attention.prepare_attention, split_tokens=SPLIT_TOKENS))


def _target_output(llm: LLM, prompts: list[list[int]], index: int) -> tuple[list[int], float]:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params)[index].outputs[0]
    return out.token_ids, out.cumulative_logprob


def test_greedy_tokens_alone_mixed_and_static(deepseek_dir: Path, short_slices: None, device: str) -> None:
    """MLA and MoE (the Kimi path) through the Triton kernels; GQA's decode kernel is covered bitwise."""
    llm = LLM(deepseek_dir, dtype="float32", device=device, kernel_backend="triton", block_size=4, max_model_len=128,
              max_num_seqs=4, enable_prefix_caching=False, enforce_eager=True)
    target = mixed_prompts(1, seed=3, low=30, high=31)[0]
    # a 6- and a 60-token prompt beside the 30-token target: the launch's slice count changes with the batch
    others = [p[:n] for p, n in zip(mixed_prompts(2, seed=5, low=60, high=61), (6, 60))]
    alone = _target_output(llm, [target], 0)
    mixed = _target_output(llm, [others[0], target, others[1]], 1)

    worker = llm.engine.runner.worker
    worker.decode_graphs = CudaGraphRunner(worker.model, worker.config, worker.padding_block, capture=False)
    static_alone = _target_output(llm, [target], 0)
    static_mixed = _target_output(llm, [others[0], target, others[1]], 1)
    assert worker.decode_graphs.num_steps > 0

    for got in (mixed, static_alone, static_mixed):
        assert got[0] == alone[0]
        assert got[1] == pytest.approx(alone[1], abs=1e-4)
