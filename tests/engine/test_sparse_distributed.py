"""DeepSeek Sparse Attention across ranks (gloo, tests/engine/test_distributed.py's setting: a cache small enough to
preempt, chunked prefill): each rank keeps the whole indexer and its key cache beside its replica's latent cache, so
tensor-parallel heads attend to the same selection and data-parallel replicas each index their own requests."""

from __future__ import annotations

import pytest

from reasoning_engine import LLM

from .test_distributed import GREEDY, TIGHT, _assert_same, _prompts

CASES = [("deepseek_v32", 2, False, 1), ("glm_moe_dsa", 1, True, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("variant,tp,ep,dp", CASES, ids=[f"{v}-tp{t}{'-ep' if e else ''}-dp{d}" for v, t, e, d in CASES])
def test_ranks_give_one_process_tokens(tiny_checkpoint, variant: str, tp: int, ep: bool, dp: int) -> None:
    path = tiny_checkpoint(variant).path
    reference = LLM(path, **TIGHT).generate(_prompts(), GREEDY)
    with LLM(path, tensor_parallel_size=tp, enable_expert_parallel=ep, data_parallel_size=dp, **TIGHT) as llm:
        outs = llm.generate(_prompts(), GREEDY)
        assert llm.engine.num_preemptions > 0
    _assert_same(outs, reference)
