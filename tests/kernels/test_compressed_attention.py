"""DeepSeek-V4's attention over window rows and compressed rows with a sink: the torch reference
(`kernels/compressed_attention.compressed_attention`) against a per-query float64 softmax, the Triton kernel
(`kernels/triton_compressed_attention.py`) against the reference, and the engine's Triton backend against torch."""

import pytest
import torch
from kernel_asserts import assert_close
from test_engine_backends import greedy_by_backend

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.kernels import compressed_attention, triton_compressed_attention

BLOCKS, BLOCK_ROWS = 9, 8


def _addressing(tokens: int, count: int, valid_share: float, device: str):
    """[T, count] random (block, offset) pairs and validity (rows past a query's reach are invalid, as are the -1
    picks of a short CSA selection); the first query sees no row at all."""
    block = torch.randint(0, BLOCKS, (tokens, count), device=device)
    offset = torch.randint(0, BLOCK_ROWS, (tokens, count), device=device)
    valid = torch.rand(tokens, count, device=device) < valid_share
    valid[0] = False
    return block, offset, valid


def _inputs(tokens: int, heads: int, dim: int, window: int, rows: int | None, dtype, device: str):
    q = torch.randn(tokens, heads, dim, device=device).to(dtype)
    window_cache = torch.randn(BLOCKS, BLOCK_ROWS, dim, device=device).to(dtype)
    sinks = torch.randn(heads, device=device).to(dtype)
    args = [q, window_cache, *_addressing(tokens, window, 0.8, device), sinks, dim**-0.5]
    kwargs = {}
    if rows is not None:
        # a strided view, as a layer's row cache may be: rows of 2 * dim channels, the first dim of them
        row_cache = torch.randn(BLOCKS, BLOCK_ROWS, 2 * dim, device=device).to(dtype)[..., :dim]
        kwargs = dict(zip(("row_block", "row_offset", "row_valid"), _addressing(tokens, rows, 0.6, device)))
        kwargs["row_cache"] = row_cache
    return args, kwargs


def _float64_attention(args, kwargs) -> torch.Tensor:
    """Per query: the scores of its valid rows and the sink in one float64 softmax; output = sum p * row."""
    q, window_cache, w_block, w_offset, w_valid, sinks, scale = args
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        keys = [window_cache[b, o] for b, o, v in zip(w_block[t], w_offset[t], w_valid[t]) if v]
        if kwargs:
            keys += [kwargs["row_cache"][b, o] for b, o, v in
                     zip(kwargs["row_block"][t], kwargs["row_offset"][t], kwargs["row_valid"][t]) if v]
        if not keys:
            continue
        k = torch.stack(keys).double()
        scores = q[t].double() @ k.T * scale
        logits = torch.cat([scores, sinks.double().view(-1, 1)], dim=1)
        out[t] = logits.softmax(dim=1)[:, :-1] @ k
    return out


@pytest.mark.parametrize("rows", [None, 5, 40])  # window only (sliding layers), CSA-sized picks, HCA-sized rows
def test_reference_is_one_softmax_with_the_sink(rows, device) -> None:
    args, kwargs = _inputs(5, 3, 16, 6, rows, torch.float32, device)
    out = compressed_attention.compressed_attention(*args, **kwargs)
    torch.testing.assert_close(out.double().cpu(), _float64_attention([a.cpu() if torch.is_tensor(a) else a for a in args],
                                                                      {k: v.cpu() for k, v in kwargs.items()}),
                               atol=1e-5, rtol=1e-5)
    assert out[0].abs().max() == 0  # no key at all: the sink takes the whole softmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, heads, dim, window, rows", [
    (6, 4, 32, 8, None),  # a sliding layer: window rows only
    (5, 4, 32, 8, 3),  # CSA: a few picked rows
    (4, 20, 48, 40, 37),  # two head blocks (one partial), a head_dim padded to 64, windows and rows over many tiles
])
def test_triton_matches_reference(tokens, heads, dim, window, rows, dtype, device) -> None:
    args, kwargs = _inputs(tokens, heads, dim, window, rows, dtype, device)
    expected = compressed_attention.compressed_attention(*args, **kwargs)
    actual = triton_compressed_attention.compressed_attention(*args, **kwargs)
    assert_close(actual, expected)


def test_triton_rejects_a_cache_of_another_width(device) -> None:
    args, kwargs = _inputs(2, 4, 32, 4, 3, torch.float32, device)
    kwargs["row_cache"] = torch.zeros(BLOCKS, BLOCK_ROWS, 16, device=device)
    with pytest.raises(ValueError, match="row_cache"):
        triton_compressed_attention.compressed_attention(*args, **kwargs)


@pytest.mark.slow
def test_engine_triton_backend_matches_torch_on_deepseek_v4(tiny_checkpoint, device: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny deepseek_v4 (a sliding, two CSA (rate 4, top-4) and an HCA (rate 16) layer, window 8): prompts past
    the window and several compression boundaries, greedy tokens of the Triton backend equal torch's, and every kind
    of layer went through the Triton kernel (window only, and with compressed rows)."""
    seen = set()  # the number of compressed rows per call (0: a sliding layer)

    def recording(*args, **kwargs):
        seen.add(kwargs["row_block"].shape[1] if "row_block" in kwargs else 0)
        return kernel(*args, **kwargs)

    kernel = triton_compressed_attention.compressed_attention
    monkeypatch.setattr(triton_compressed_attention, "compressed_attention", recording)
    prompts = [[5 + (i * 7) % 90 for i in range(37)], [3, 17, 9, 42, 5, 8, 11]]
    outs = greedy_by_backend(tiny_checkpoint("deepseek_v4").path, device, prompts, 6)
    assert outs["triton"] == outs["torch"]
    assert 0 in seen and max(seen) >= 2, seen


@pytest.mark.slow
def test_engine_triton_backend_matches_torch_with_drafts_and_chunks(tiny_checkpoint, device: str) -> None:
    """deepseek_v4 with suffix speculation and a 24-token budget: steps mix decodes, drafts verified across
    compression boundaries and a 45-token prompt in chunks; the Triton backend gives torch's tokens."""
    prompts = [[3, 17, 9, 42] * 6, [7, 1, 30], [5 + (i * 7) % 90 for i in range(45)]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_checkpoint("deepseek_v4").path, dtype="float32", device=device, kernel_backend=backend,
                  block_size=4, max_num_batched_tokens=24, adaptive=False,
                  speculative_config={"method": "suffix", "num_speculative_tokens": 4})
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        assert llm.engine.stats().spec_decode["accepted_tokens"] > 0  # drafts were verified and kept
    assert outs["triton"] == outs["torch"]
