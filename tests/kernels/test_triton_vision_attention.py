"""Triton ragged non-causal attention (`triton_vision_attention.py`) against the torch reference
(`vision_attention.py`), and the reference against a dense float64 softmax per item."""

import pytest
import torch
from kernel_asserts import assert_close

from reasoning_engine.kernels import triton_vision_attention, vision_attention

LENGTHS = [1, 7, 64, 100]  # a lone patch, a partial tile, exactly one tile, a tile and a partial one


def packed(lengths: list[int], heads: int, head_dim: int, dtype: torch.dtype, device: str):
    """q, k, v [T, heads, head_dim] as strided views of one fused [T, 3, heads, head_dim] projection (as the encoder
    produces them), and cu_seqlens."""
    tokens = sum(lengths)
    qkv = torch.randn(tokens, 3, heads, head_dim, device=device).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return qkv[:, 0], qkv[:, 1], qkv[:, 2], cu


def dense_reference(q, k, v, cu, scale):
    out = torch.zeros(q.shape, dtype=torch.float64)
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qi, ki, vi = (t[start:end].double().cpu().transpose(0, 1) for t in (q, k, v))
        weights = torch.softmax(qi @ ki.transpose(1, 2) * scale, dim=-1)
        out[start:end] = (weights @ vi).transpose(0, 1)
    return out


@pytest.mark.parametrize("head_dim", [72, 32])  # MoonViT's (padded to 128 in the kernel), and a power of two
def test_triton_matches_torch(head_dim: int, device: str) -> None:
    q, k, v, cu = packed(LENGTHS, 3, head_dim, torch.float32, device)
    scale = head_dim ** -0.5
    expected = vision_attention.varlen_attention(q, k, v, cu, scale)
    got = triton_vision_attention.varlen_attention(q, k, v, cu, scale, max_seqlen=max(LENGTHS))
    assert_close(got, expected)
    torch.testing.assert_close(expected.double().cpu(), dense_reference(q, k, v, cu, scale), atol=1e-5, rtol=1e-5)


def test_items_do_not_see_each_other(device: str) -> None:
    """Changing one item's keys and values leaves the others' outputs bitwise unchanged."""
    q, k, v, cu = packed(LENGTHS, 2, 32, torch.float32, device)
    before = triton_vision_attention.varlen_attention(q, k, v, cu, 0.2)
    k, v = k.clone(), v.clone()
    k[1:8] += 3.0
    v[1:8] -= 1.0
    after = triton_vision_attention.varlen_attention(q, k, v, cu, 0.2)
    assert torch.equal(after[:1], before[:1]) and torch.equal(after[8:], before[8:])
    assert not torch.equal(after[1:8], before[1:8])


def test_bfloat16(device: str) -> None:
    q, k, v, cu = packed([5, 70], 2, 72, torch.bfloat16, device)
    expected = vision_attention.varlen_attention(q, k, v, cu, 72 ** -0.5)
    assert_close(triton_vision_attention.varlen_attention(q, k, v, cu, 72 ** -0.5), expected)
