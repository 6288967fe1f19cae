"""End to end: the engine gives the same greedy tokens with Triton kernels (compiled on a GPU, interpreted on CPU) as
with torch."""

from __future__ import annotations

import pytest

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.kernels import triton_attention


# glm4_moe: partial rotary (a half, a quarter of the channels) through the Triton rotary kernel, q/k norm, q/k/v biases,
# sigmoid group-limited routing with shared experts; minimax_m2: q/k norms over all heads through the Triton norm;
# gpt_oss: sinks and sliding windows (of 8) through the Triton attention kernels, expert biases, the clamped SwiGLU
# and MXFP4 experts through the Triton MoE. MLA (deepseek_v3): the test with drafts and chunks below, whose steps
# include every kind this one has
@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_moe", "llama", "minimax_m2", "minimax_m2_as_saved", "glm4_moe",
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


def test_triton_matches_torch_greedy_with_drafts_and_chunks_in_one_step(tiny_checkpoint, device: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """MLA with suffix speculation and a small token budget: steps mix decodes, draft trees being verified (the
    latent split kernel) and a prompt chunked past 16 tokens (the prefill kernel); Triton gives torch's tokens.
    adaptive=False: every proposed draft is verified, and no start-up calibration steps (synthetic batches of up to
    max_num_seqs sequences, compared with nothing) are interpreted. deepseek_v3: group-limited routing; Kimi K2's
    single group goes through the same kernels (the router cases of tests/kernels/test_triton_moe.py)."""
    prompts = [[3, 17, 9, 42] * 3, [7, 1, 30], [5 + (i * 7) % 40 for i in range(40)]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    steps = set()  # (verifies a draft tree, has a chunk for the prefill kernel) of each Triton MLA call

    def recording(q, kv_cache, latent_dim, batch, meta, scale):
        steps.add((meta.tree_bits is not None, meta.has_long))
        return latent_attention(q, kv_cache, latent_dim, batch, meta, scale)

    latent_attention = triton_attention.paged_latent_attention
    monkeypatch.setattr(triton_attention, "paged_latent_attention", recording)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_checkpoint("deepseek_v3").path, dtype="float32", device=device, kernel_backend=backend, block_size=4,
                  max_num_batched_tokens=24, adaptive=False, speculative_config={"method": "suffix", "num_speculative_tokens": 4})
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert outs["triton"] == outs["torch"]
    assert {(True, False), (False, True)} <= steps, steps  # drafts were verified, a long chunk went to prefill
