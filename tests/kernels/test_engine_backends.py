"""End to end: the engine gives the same greedy tokens with Triton kernels (compiled on a GPU, interpreted on CPU) as
with torch."""

from __future__ import annotations

import pytest

from reasoning_engine import LLM, SamplingParams


# glm4_moe: partial rotary (a half, a quarter of the channels) through the Triton rotary kernel, q/k norm, q/k/v biases,
# sigmoid group-limited routing with shared experts; minimax_m2: q/k norms over all heads through the Triton norm;
# gpt_oss: sinks and sliding windows (of 8) through the Triton attention kernels, expert biases, the clamped SwiGLU
# and MXFP4 experts through the Triton MoE
@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe", "llama", "minimax_m2", "minimax_m2_as_saved", "glm4_moe",
                                  "glm4_moe_as_saved", "gpt_oss", "gpt_oss_mxfp4"])
def test_triton_backend_matches_torch_greedy(name: str, tiny_checkpoint, device: str) -> None:
    outs = greedy_by_backend(tiny_checkpoint(name).path, device, [[3, 17, 9, 42, 5, 8, 11], [7, 1, 30]], 6)
    assert outs["triton"] == outs["torch"]


def greedy_by_backend(path: str, device: str, prompts: list[list[int]], max_tokens: int) -> dict[str, list]:
    """Each prompt's greedy tokens with the torch and with the Triton kernels (block size 4, so blocks are crossed)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, dtype="float32", device=device, kernel_backend=backend, block_size=4)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    return outs
