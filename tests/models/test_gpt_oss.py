"""gpt-oss beyond the shared parity tests: sliding-window layers over the paged cache when a prompt's start comes from
the prefix cache and its prefill is chunked across the window, and decoding far past the window, against
transformers (float32, CPU)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from .checkpoints import TinyCheckpoint
from .test_parity import reference_greedy, reference_logits

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["gpt_oss", "gpt_oss_as_saved"])
def test_prefix_hit_and_chunked_prefill_across_the_window(tiny_checkpoint: Callable[[str], TinyCheckpoint],
                                                          name: str) -> None:
    """Blocks of 4, chunks of 6 tokens (never aligned with the window of 8 or 5), a second prompt whose first 20
    tokens are cached: its logits and greedy tokens are transformers', and the cache was used."""
    from reasoning_engine import LLM, SamplingParams

    ckpt = tiny_checkpoint(name)
    reference = ckpt.reference()
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(2, ckpt.vocab_size, (21,), generator=gen).tolist()
    first = shared + torch.randint(2, ckpt.vocab_size, (5,), generator=gen).tolist()
    second = shared + torch.randint(2, ckpt.vocab_size, (11,), generator=gen).tolist()
    llm = LLM(str(ckpt.path), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=6,
              enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for ids in (first, second):
        out = llm.generate([{"prompt_token_ids": ids}], params)[0]
        want, _ = reference_greedy(reference, ids, 24)
        assert list(out.outputs[0].token_ids) == want
    assert out.num_cached_tokens >= 20
    got = llm.compute_logits([second])[0]
    want_logits = reference_logits(reference, second)
    torch.testing.assert_close(got.float(), want_logits, rtol=1e-4, atol=1e-4 * want_logits.abs().max().item())


def test_decode_far_past_the_window(tiny_checkpoint: Callable[[str], TinyCheckpoint]) -> None:
    """A 3-token prompt decoded for 60 tokens (7 windows) with prompts of other lengths in the batch."""
    from reasoning_engine import LLM, SamplingParams

    ckpt = tiny_checkpoint("gpt_oss")
    reference = ckpt.reference()
    prompts = [[5, 9, 30], [7, 3, 11, 12, 40, 41, 42, 43, 44, 45, 46]]
    llm = LLM(str(ckpt.path), dtype="float32", device="cpu", block_size=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        want, _ = reference_greedy(reference, ids, 60)
        assert list(out.outputs[0].token_ids) == want


def test_mxfp4_dequantization_matches_transformers() -> None:
    """`dequantize_mxfp4` against transformers' own MXFP4 conversion (which also transposes to [E, in, out])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from reasoning_engine.kernels.fused_moe import dequantize_mxfp4

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 40, 4), generator=gen, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    got = dequantize_mxfp4(blocks.flatten(-2), scales)
    assert torch.equal(got.transpose(1, 2), want)


def test_mxfp4_experts_stay_packed(tiny_checkpoint: Callable[[str], TinyCheckpoint]) -> None:
    """Every layer's experts hold the stored bytes (rows de-interleaved into gate, then up) and uint8 scales, and
    run within float32 rounding of the same checkpoint dequantized at load."""
    from reasoning_engine import LLM

    from .checkpoints import prompts
    from .st_files import read_tensors

    ckpt = tiny_checkpoint("gpt_oss_mxfp4")
    packed = LLM(str(ckpt.path), dtype="float32", device="cpu")
    stored = read_tensors(ckpt.path)
    for index, layer in enumerate(packed.engine.model.layers):
        experts = layer.mlp.experts
        shapes = {n: (p.dtype, tuple(p.shape)) for n, p in experts.named_parameters()}
        assert shapes == {"w13": (torch.uint8, (8, 64, 32)), "w2": (torch.uint8, (8, 64, 16)),
                          "w13_scale": (torch.uint8, (8, 64, 2)), "w2_scale": (torch.uint8, (8, 64, 1)),
                          "w13_bias": (torch.float32, (8, 64)), "w2_bias": (torch.float32, (8, 64))}, shapes
        blocks = stored[f"model.layers.{index}.mlp.experts.gate_up_proj_blocks"].flatten(-2)
        assert torch.equal(experts.w13, torch.cat([blocks[:, 0::2], blocks[:, 1::2]], dim=1))
        assert torch.equal(experts.w2, stored[f"model.layers.{index}.mlp.experts.down_proj_blocks"].flatten(-2))
    dense = LLM(str(ckpt.reference_path), dtype="float32", device="cpu")
    for got, want in zip(packed.compute_logits(prompts()), dense.compute_logits(prompts())):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_mxfp4_experts_split_over_tensor_ranks_in_whole_groups(tiny_checkpoint: Callable[[str], TinyCheckpoint]) -> None:
    """An intermediate size of 32 cannot give two ranks whole groups of 32: refused at start, naming the way out."""
    from reasoning_engine import LLM

    with pytest.raises(ValueError, match="whole quantization blocks of 32 channels.*enable_expert_parallel"):
        LLM(str(tiny_checkpoint("gpt_oss_mxfp4").path), dtype="float32", device="cpu", tensor_parallel_size=2)


@pytest.mark.slow
def test_compiled_decode_matches_eager(tiny_checkpoint: Callable[[str], TinyCheckpoint]) -> None:
    """compile_decode: sinks and windows through `decode_attention`, the biased MXFP4 experts through the opaque MoE
    op (one graph, no break), decoding past the window; the tokens and logprobs of eager decoding."""
    from reasoning_engine import LLM, SamplingParams

    path = tiny_checkpoint("gpt_oss_mxfp4").path
    common = dict(dtype="float32", device="cpu", block_size=4, max_model_len=128, max_num_seqs=8,
                  enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 30], [7, 3, 11, 12, 40, 41, 42, 43, 44, 45, 46])]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=0)
    outs = {}
    for compiled in (False, True):
        llm = LLM(str(path), compile_decode=compiled, **common)
        outs[compiled] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert [o.cumulative_logprob for o in outs[True]] == pytest.approx([o.cumulative_logprob for o in outs[False]], abs=1e-4)


@pytest.mark.parametrize("packed", [False, True])
def test_opaque_moe_op_takes_biases_and_the_clamped_swiglu(packed: bool) -> None:
    from reasoning_engine.kernels.fused_moe import MoEQuant, fused_moe, fused_moe_op

    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens, top_k = 4, 64, 32, 5, 2
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    b13, b2 = torch.randn(experts, 2 * inter, generator=gen), torch.randn(experts, hidden, generator=gen)
    if packed:
        w13 = torch.randint(0, 256, (experts, 2 * inter, hidden // 2), generator=gen, dtype=torch.uint8)
        w2 = torch.randint(0, 256, (experts, hidden, inter // 2), generator=gen, dtype=torch.uint8)
        scales = (torch.full((experts, 2 * inter, hidden // 32), 122, dtype=torch.uint8),
                  torch.full((experts, hidden, inter // 32), 123, dtype=torch.uint8))
        quant = MoEQuant("mxfp4", *scales)
    else:
        w13, w2 = torch.randn(experts, 2 * inter, hidden, generator=gen), torch.randn(experts, hidden, inter, generator=gen)
        scales, quant = (None, None), None
    args = (x, w13, w2, weights, ids, quant.method if quant else None, *scales, 32 if quant else 0, [0, 0], b13, b2, 3.0)
    torch.library.opcheck(fused_moe_op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    assert torch.equal(fused_moe_op(*args), fused_moe(x, w13, w2, weights, ids, quant, w13_bias=b13, w2_bias=b2,
                                                      swiglu_limit=3.0))


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_decoding_across_the_window(tiny_checkpoint: Callable[[str], TinyCheckpoint], method: str) -> None:
    """Drafts verified under the tree mask count their window from their own position: greedy speculative decoding
    past the window gives transformers' tokens, with drafts accepted."""
    from reasoning_engine import LLM, SamplingParams

    ckpt = tiny_checkpoint("gpt_oss")
    reference = ckpt.reference()
    prompt = [5, 9, 30, 41, 5, 9, 30, 41, 5, 9, 30, 41, 5, 9]
    want, _ = reference_greedy(reference, prompt, 40)
    llm = LLM(str(ckpt.path), dtype="float32", device="cpu", block_size=4, adaptive=False,  # every draft verified
              speculative_config={"method": method, "num_speculative_tokens": 4})
    out = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt + want[:20]}],
                       SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert list(out[0].outputs[0].token_ids) == want
    assert list(out[1].outputs[0].token_ids) == reference_greedy(reference, prompt + want[:20], 40)[0]
    assert sum(o.spec_accepted_tokens for o in out) > 0
