"""End to end: the engine gives the same greedy tokens with Triton kernels (compiled on a GPU, interpreted on CPU) as
with torch."""

from __future__ import annotations

import pytest

from reasoning_engine import LLM, SamplingParams


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe", "llama"])
def test_triton_backend_matches_torch_greedy(name: str, tiny_checkpoint, device: str) -> None:
    path = tiny_checkpoint(name).path
    prompts = [{"prompt_token_ids": [3, 17, 9, 42, 5, 8, 11]}, {"prompt_token_ids": [7, 1, 30]}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, dtype="float32", device=device, kernel_backend=backend, block_size=4)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]
