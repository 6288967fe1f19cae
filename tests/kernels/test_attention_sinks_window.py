"""gpt-oss attention: per-head sink logits in the softmax denominator and sliding windows, in the torch reference
(`kernels/attention.py`, gathered, by parts and the fused decode form) and the Triton kernels, against an
independent float64 per-sequence computation over the paged cache."""

import pytest
import torch
from kernel_asserts import assert_close
from test_triton_attention import dense_reference, gqa_case, make_batch

from reasoning_engine.kernels import attention, triton_attention


def dense_sink_window(q, k_cache, v_cache, batch, block_size, scale, sinks, window):
    """The float64 reference over this cache: key j is visible to the query at position p when j <= p (the tree
    mask among the step's tokens) and j > p - window; the sink joins the denominator."""
    kv_heads, head_dim = k_cache.shape[2:]

    def rows(slots):
        return (k_cache.reshape(-1, kv_heads, head_dim)[slots].cpu(),
                v_cache.reshape(-1, kv_heads, v_cache.shape[-1])[slots].cpu())

    return dense_reference(q, rows, batch, block_size, scale, v_cache.shape[-1], sinks=sinks, window=window)


CASES = [
    ([0, 5, 0], [7, 3, 1]),  # fresh prefills shorter and longer than the window, a chunk crossing it
    ([33, 0], [20, 70]),  # a chunk starting past the window; a prefill longer than a kernel tile
    ([4, 0, 37], [1, 1, 1]),  # decode before and far past the window
    ([150, 2], [1, 1]),  # decode past the window with several slices of the full context
]


@pytest.mark.parametrize("window,with_sinks", [(None, True), (8, False), (8, True), (1, True)])
@pytest.mark.parametrize("lens", CASES)
def test_sinks_and_window_match_dense(device, lens, window, with_sinks):
    batch, q, k_cache, v_cache = gqa_case(*lens, 4, 4, 2, 16, torch.float32, device)
    sinks = 2.0 * torch.randn(4, device=device) if with_sinks else None
    dense = dense_sink_window(q, k_cache, v_cache, batch, 4, 0.25, sinks, window).float()
    ref = attention.paged_attention(q, k_cache, v_cache, batch, attention.prepare_attention(batch, 4), 0.25,
                                    sinks=sinks, window=window)
    assert_close(ref.cpu(), dense)
    meta = triton_attention.prepare_attention(batch, 4, split_tokens=16)
    out = triton_attention.paged_attention(q, k_cache, v_cache, batch, meta, 0.25, sinks=sinks, window=window)
    assert_close(out.cpu(), dense, scale=2.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sinks_and_window_half_precision(device, dtype):
    batch, q, k_cache, v_cache = gqa_case([0, 40, 3], [19, 1, 6], 16, 8, 2, 32, dtype, device)
    sinks = torch.randn(8, device=device).to(dtype)
    meta = triton_attention.prepare_attention(batch, 16)
    ref = attention.paged_attention(q, k_cache, v_cache, batch, attention.prepare_attention(batch, 16), 0.2,
                                    sinks=sinks, window=5)
    out = triton_attention.paged_attention(q, k_cache, v_cache, batch, meta, 0.2, sinks=sinks, window=5)
    assert_close(out, ref, scale=2.0)


def test_window_under_a_draft_tree(device):
    """Draft nodes count their window back from their position (context length + depth), not their index."""
    torch.manual_seed(3)
    batch, num_blocks = make_batch([12, 3], [6, 5], 4, device, tree=True)
    depth = []
    for b, n in enumerate(batch.query_lens_cpu):
        rows = batch.tree_mask[batch.query_start_loc[b]: batch.query_start_loc[b] + n, :n]
        depth += (rows.sum(1) - 1).tolist()
    ctx = torch.repeat_interleave(batch.seq_lens - batch.query_lens(), batch.query_lens())
    batch.positions = ctx + torch.tensor(depth, device=device)
    k_cache = torch.randn(num_blocks, 4, 2, 8, device=device)
    v_cache = torch.randn(num_blocks, 4, 2, 8, device=device)
    q = torch.randn(batch.num_tokens, 4, 8, device=device)
    sinks = torch.randn(4, device=device)
    dense = dense_sink_window(q, k_cache, v_cache, batch, 4, 0.3, sinks, 6).float()
    ref = attention.paged_attention(q, k_cache, v_cache, batch, attention.prepare_attention(batch, 4), 0.3,
                                    sinks=sinks, window=6)
    out = triton_attention.paged_attention(q, k_cache, v_cache, batch, triton_attention.prepare_attention(batch, 4),
                                           0.3, sinks=sinks, window=6)
    assert_close(ref.cpu(), dense)
    assert_close(out.cpu(), dense, scale=2.0)


def test_fused_decode_form_with_sinks_and_window(device):
    """`decode_attention` (the form compiled decode steps trace) agrees with the gathered path."""
    batch, q, k_cache, v_cache = gqa_case([4, 0, 37], [1, 1, 1], 4, 4, 2, 16, torch.float32, device)
    sinks = torch.randn(4, device=device)
    meta = attention.prepare_attention(batch, 4)
    ref = attention.paged_attention(q, k_cache, v_cache, batch, meta, 0.25, sinks=sinks, window=8)
    meta.fused_decode = True
    fused = attention.paged_attention(q, k_cache, v_cache, batch, meta, 0.25, sinks=sinks, window=8)
    assert_close(fused, ref)
