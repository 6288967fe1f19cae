"""End to end: the engine gives the same greedy tokens with Triton kernels (compiled on a GPU, interpreted on CPU) as
with torch."""

from __future__ import annotations

import pytest

from reasoning_engine import LLM, SamplingParams


# glm4_moe: partial rotary (a half, a quarter of the channels) through the Triton rotary kernel, q/k norm, q/k/v biases,
# sigmoid group-limited routing with shared experts; minimax_m2: q/k norms over all heads through the Triton norm;
# gpt_oss: sinks and sliding windows (of 8) through the Triton attention kernels, expert biases, the clamped SwiGLU
# and MXFP4 experts through the Triton MoE
@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe", "llama", "minimax_m2", "minimax_m2_as_saved", "glm4_moe",
                                  "glm4_moe_as_saved", "gpt_oss", "gpt_oss_mxfp4"])
def test_triton_backend_matches_torch_greedy(name: str, tiny_checkpoint, device: str) -> None:
    path = tiny_checkpoint(name).path
    prompts = [{"prompt_token_ids": [3, 17, 9, 42, 5, 8, 11]}, {"prompt_token_ids": [7, 1, 30]}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, dtype="float32", device=device, kernel_backend=backend, block_size=4)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]
