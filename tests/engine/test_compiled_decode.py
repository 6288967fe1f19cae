"""compile_decode: CPU decode steps through torch.compile give the tokens of eager decoding, for a dense
model and for DeepSeek's MLA + mixture-of-experts; the three graphs (one sequence, 2-4 sequences, more) are compiled
when the engine starts and serve every later step without recompiling; a packed linear layer compiles through the
plain weight it keeps; the opaque MoE op agrees with its eager definition; bad combinations are rejected."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from torch import nn

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.kernels.fused_moe import MoEQuant, fused_moe, fused_moe_op
from reasoning_engine.layers.linear import PackedLinear
from reasoning_engine.server.cli import _engine_kwargs, register_cli
from char_models import mixed_prompts

# Six requests finishing at different steps: decode batches of 6 down to 1, the first two for the large graph
MAX_TOKENS = [3, 7, 2, 5, 4, 9]
PROMPTS = [{"prompt_token_ids": p} for p in mixed_prompts(len(MAX_TOKENS), seed=5, low=3, high=40)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_TOKENS]


def _generate(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> tuple[list[list[int]], list[float]]:
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    return [o.token_ids for o in outs], [o.cumulative_logprob for o in outs]


def _assert_same(got: tuple[list[list[int]], list[float]], want: tuple[list[list[int]], list[float]]) -> None:
    """Same greedy tokens and summed logprobs (these catch a wrong cache entry that leaves the argmax unchanged)."""
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-4)


def _compiles() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


# dense GQA; MLA without a low-rank query (the attention shape Inductor's rewrite broke); MLA with one and MoE with
# INT4 experts through the opaque MoE op (Kimi K2's shape)
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama_dir", "deepseek_v2", "kimi_k2_int4"])
def test_compiled_decode_matches_eager(family: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(family) if family.endswith("_dir") else request.getfixturevalue("tiny_checkpoint")(family).path
    common = dict(dtype="float32", device="cpu", block_size=4, max_model_len=256, max_num_seqs=8,
                  enable_prefix_caching=False)
    eager_llm = LLM(path, **common)
    assert eager_llm.engine.runner.worker.compiled_decode is None
    before = _compiles()
    llm = LLM(path, compile_decode=True, **common)
    compiled = llm.engine.runner.worker.compiled_decode
    assert _compiles() == before + 3  # the three graphs at start, none during the requests below
    assert compiled.guards_dropped > compiled.guards_kept > 0  # the model's guards dropped, the batch's kept
    assert compiled.num_steps == compiled.num_large_steps == 0
    got = _generate(llm, PROMPTS, PARAMS)
    _assert_same(got, _generate(eager_llm, PROMPTS, PARAMS))
    assert [len(t) for t in got[0]] == MAX_TOKENS
    # decode step k (the prefill gave token 1) runs the requests that want more than k tokens: 6, 5, then <= 4
    alive = [sum(n > k for n in MAX_TOKENS) for k in range(1, max(MAX_TOKENS))]
    assert compiled.num_steps == sum(n <= compiled.MAX_SEQS for n in alive) == 6
    assert compiled.num_large_steps == sum(n > compiled.MAX_SEQS for n in alive) == 2

    # other batch sizes and context lengths reuse the graphs
    more = [{"prompt_token_ids": p} for p in mixed_prompts(3, seed=9, low=50, high=90)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in (6, 3, 8)]
    _assert_same(_generate(llm, more, params), _generate(eager_llm, more, params))
    assert _compiles() == before + 3


def test_packed_linear_compiles_through_its_plain_weight() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 40)
    x = torch.randn(3, 48)
    layer = PackedLinear(linear, keep_plain=True)
    assert layer.plain_weight.data_ptr() == linear.weight.data_ptr()  # kept, not copied
    torch._dynamo.reset()
    assert torch.allclose(torch.compile(layer, fullgraph=True)(x), layer(x), atol=1e-5)
    with pytest.raises(RuntimeError, match="keep_plain"):
        torch.compile(PackedLinear(linear), fullgraph=True)(x)


@pytest.mark.parametrize("method", [None, "w4a16", "fp8_block"])
def test_fused_moe_op_matches_fused_moe(method: str | None) -> None:
    torch.manual_seed(0)
    experts, hidden, inter, tokens, top_k = 4, 32, 16, 5, 2
    x = torch.randn(tokens, hidden)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k)
    if method is None:
        w13, w2, scales, quant = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter), (None, None), None
    elif method == "w4a16":
        w13 = torch.randint(-2**31, 2**31 - 1, (experts, 2 * inter, hidden // 8), dtype=torch.int32)
        w2 = torch.randint(-2**31, 2**31 - 1, (experts, hidden, inter // 8), dtype=torch.int32)
        scales = (torch.rand(experts, 2 * inter, hidden // 8).to(torch.bfloat16), torch.rand(experts, hidden, inter // 8).to(torch.bfloat16))
        quant = MoEQuant("w4a16", *scales, group_size=8)
    else:
        w13 = torch.randn(experts, 2 * inter, hidden).to(torch.float8_e4m3fn)
        w2 = torch.randn(experts, hidden, inter).to(torch.float8_e4m3fn)
        scales = (torch.rand(experts, 2, 2), torch.rand(experts, 2, 1))
        quant = MoEQuant("fp8_block", *scales, block_shape=(16, 16))
    args = (x, w13, w2, weights, ids, method, *scales, quant.group_size if quant else 0,
            list(quant.block_shape) if quant else [0, 0])
    # opcheck's schema test cannot run float8 tensors through its checking mode; the fake-tensor ones can
    utils = ("test_faketensor", "test_aot_dispatch_dynamic") if method == "fp8_block" else ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(fused_moe_op, args, test_utils=utils)
    assert torch.equal(fused_moe_op(*args), fused_moe(x, w13, w2, weights, ids, quant))


def test_compile_decode_rejects_what_it_cannot_do(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="compile_decode"):
        LLM(llama_dir, device="cpu", compile_decode=True, enforce_eager=True)
    with pytest.raises(ValueError, match="compile_decode"):
        LLM(llama_dir, device="cpu", compile_decode=True, kernel_backend="triton")
    with pytest.raises(ValueError, match="compile_decode"):
        LLM(llama_dir, device="cuda", compile_decode=True)


def test_serve_compile_decode_flag() -> None:
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers(dest="command"))
    assert _engine_kwargs(parser.parse_args(["serve", "--compile-decode"]))["compile_decode"] is True
    assert "compile_decode" not in _engine_kwargs(parser.parse_args(["serve"]))
