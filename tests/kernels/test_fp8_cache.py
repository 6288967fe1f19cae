"""The FP8 KV cache (kv_cache_dtype="fp8"): rows quantised to e4m3 with a scale each, written by both backends alike
and read by every attention path (torch gather, compiled decode, Triton decode / latent / prefill / sparse kernels)
as the torch reference reads them."""

import dataclasses

import pytest
import torch
from kernel_asserts import assert_close
from test_triton_attention import DECODE_CASES, PREFILL_CASES, make_batch

from reasoning_engine.kernels import attention, sparse_attention, triton_attention, triton_sparse_attention
from reasoning_engine.kernels.fp8_cache import dequantize_rows, quantize_rows, row_bytes


def test_rows_round_trip_within_e4m3_precision_and_keep_the_tail_in_bfloat16():
    values = torch.randn(40, 3, 24) * torch.logspace(-3, 3, 40).view(-1, 1, 1)  # rows of very different magnitudes
    values[0] = 0.0
    rows = quantize_rows(values)
    assert rows.dtype == torch.uint8 and rows.shape == (40, 3, row_bytes(24)) == (40, 3, 26)
    back = dequantize_rows(rows, 24, torch.float32)
    assert torch.equal(back[0], torch.zeros(3, 24))
    # e4m3 keeps 3 mantissa bits: half a unit in the last place is 1/16 of a value, plus the subnormal step
    amax = values.abs().amax(-1, keepdim=True)
    assert ((back - values).abs() <= values.abs() / 16 + amax * 2.0**-9 / 448 * 2).all()
    assert back.abs().amax(-1).sub(amax.squeeze(-1)).abs().le(amax.squeeze(-1) / 16).all()  # each row's range used

    latent = torch.randn(7, 40)  # 32 quantised channels, an 8-channel bfloat16 tail (MLA's rotary key)
    rows = quantize_rows(latent, tail=8)
    assert rows.shape == (7, row_bytes(32, 8)) == (7, 32 + 2 + 16)
    back = dequantize_rows(rows, 32, torch.float32)
    assert torch.equal(back[:, 32:], latent[:, 32:].to(torch.bfloat16).float())
    assert ((back[:, :32] - latent[:, :32]).abs() <= latent[:, :32].abs() / 16 + 1e-3).all()


def _fp8_cache(num_blocks, block_size, inner, quantized, tail, device):
    """A uint8 cache of random quantised rows."""
    return quantize_rows(torch.randn(num_blocks, block_size, *inner, quantized + tail, device=device), tail=tail)


@pytest.mark.parametrize("tail", [0, 8])
def test_both_backends_write_the_same_fp8_rows(device, tail):
    cache = torch.zeros(5, 4, 2, row_bytes(16, tail), dtype=torch.uint8, device=device)
    ref = cache.clone()
    values = torch.randn(6, 2, 16 + tail, device=device).to(torch.bfloat16)
    slots = torch.randperm(20, device=device)[:6]
    triton_attention.write_kv_cache(cache, values, slots)
    attention.write_kv_cache(ref, values, slots)
    assert torch.equal(cache, ref)
    read = dequantize_rows(cache.view(-1, 2, cache.shape[-1])[slots], 16, torch.float32)
    assert ((read[..., :16] - values[..., :16].float()).abs() <= values[..., :16].float().abs() / 16 + 1e-3).all()
    assert torch.equal(read[..., 16:], values[..., 16:].float())


def _gqa_case(context_lens, query_lens, block_size, heads, kv_heads, head_dim, dtype, device):
    batch, num_blocks = make_batch(context_lens, query_lens, block_size, device)
    k_cache = _fp8_cache(num_blocks, block_size, (kv_heads,), head_dim, 0, device)
    v_cache = _fp8_cache(num_blocks, block_size, (kv_heads,), head_dim, 0, device)
    for cache in (k_cache, v_cache):
        attention.write_kv_cache(cache, torch.randn(batch.num_tokens, kv_heads, head_dim, device=device), batch.slot_mapping)
    q = torch.randn(batch.num_tokens, heads, head_dim, device=device).to(dtype)
    return batch, q, k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", DECODE_CASES + PREFILL_CASES[1:])
def test_fp8_gqa_attention_matches_the_dequantised_cache_on_every_path(device, dtype, lens):
    """Triton (decode split-K or prefill) and torch over FP8 caches give what torch gives over the same rows
    dequantised into a plain cache."""
    batch, q, k_cache, v_cache = _gqa_case(*lens, 3, 4, 2, 16, dtype, device)
    plain_k, plain_v = (dequantize_rows(c, 16, dtype) for c in (k_cache, v_cache))
    meta = attention.prepare_attention(batch, 3)
    want = attention.paged_attention(q, plain_k, plain_v, batch, meta, 0.25)
    assert_close(attention.paged_attention(q, k_cache, v_cache, batch, meta, 0.25), want)
    tmeta = triton_attention.prepare_attention(batch, 3, split_tokens=16)
    assert_close(triton_attention.paged_attention(q, k_cache, v_cache, batch, tmeta, 0.25), want, scale=2.0)


def _mla_case(context_lens, query_lens, block_size, heads, latent, rope, dtype, device, tree=False):
    batch, num_blocks = make_batch(context_lens, query_lens, block_size, device, tree=tree)
    kv_cache = _fp8_cache(num_blocks, block_size, (), latent, rope, device)
    attention.write_kv_cache(kv_cache, torch.randn(batch.num_tokens, latent + rope, device=device), batch.slot_mapping)
    q = torch.randn(batch.num_tokens, heads, latent + rope, device=device).to(dtype)
    return batch, q, kv_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode_kernel_heads", [0, 16])  # latent split kernel, or the decode kernel for decodes
@pytest.mark.parametrize("lens", DECODE_CASES + PREFILL_CASES[1:] + [([5, 0], [4, 40])])
def test_fp8_latent_attention_matches_the_dequantised_cache_on_every_path(device, dtype, decode_kernel_heads, lens):
    batch, q, kv_cache = _mla_case(*lens, 3, 4, 32, 8, dtype, device)
    plain = dequantize_rows(kv_cache, 32, dtype)
    meta = attention.prepare_attention(batch, 3)
    want = attention.paged_latent_attention(q, plain, 32, batch, meta, 0.2)
    assert_close(attention.paged_latent_attention(q, kv_cache, 32, batch, meta, 0.2), want)
    tmeta = triton_attention.prepare_attention(batch, 3, split_tokens=16, decode_kernel_heads=decode_kernel_heads)
    assert_close(triton_attention.paged_latent_attention(q, kv_cache, 32, batch, tmeta, 0.2), want, scale=2.0)


def test_fp8_latent_attention_with_a_draft_tree(device):
    batch, q, kv_cache = _mla_case([5, 0], [4, 3], 2, 3, 24, 8, torch.float32, device, tree=True)
    want = attention.paged_latent_attention(q, dequantize_rows(kv_cache, 24, torch.float32), 24, batch,
                                            attention.prepare_attention(batch, 2), 0.2)
    got = triton_attention.paged_latent_attention(q, kv_cache, 24, batch, triton_attention.prepare_attention(batch, 2), 0.2)
    assert_close(got, want)


@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_fused_decode_matches_the_gather_path(device, compiled):
    """compile_decode's form (`decode_attention`, dequantising inside its loads) over FP8 caches, eager and
    compiled as engine/compiled_decode.py compiles (Inductor's pattern matcher off), gives the gather path's result."""
    run = ((torch.compile(lambda f, *args: f(*args), fullgraph=True, options={"pattern_matcher": False}))
           if compiled else (lambda f, *args: f(*args)))
    lens = ([4, 0, 37], [1, 1, 1])
    batch, q, k_cache, v_cache = _gqa_case(*lens, 3, 6, 2, 16, torch.float32, device)
    ref = attention.paged_attention(q, k_cache, v_cache, batch, attention.prepare_attention(batch, 3), 0.3)
    meta = dataclasses.replace(attention.prepare_attention(batch, 3), fused_decode=True)
    assert_close(run(attention.paged_attention, q, k_cache, v_cache, batch, meta, 0.3), ref)

    batch, q, kv_cache = _mla_case(*lens, 3, 4, 24, 8, torch.float32, device)
    ref = attention.paged_latent_attention(q, kv_cache, 24, batch, attention.prepare_attention(batch, 3), 0.2)
    meta = dataclasses.replace(attention.prepare_attention(batch, 3), fused_decode=True)
    assert_close(run(attention.paged_latent_attention, q, kv_cache, 24, batch, meta, 0.2), ref)


def test_fp8_sparse_latent_attention_matches_the_dequantised_cache(device):
    batch, q, kv_cache = _mla_case([37, 0, 70], [1, 9, 1], 16, 4, 32, 16, torch.float32, device)
    selected = torch.full((batch.num_tokens, 20), -1, dtype=torch.long)
    for t, position in enumerate(batch.positions.tolist()):  # the query's own position and up to 19 before it
        picked = torch.cat([torch.tensor([position]), torch.randperm(position)[:19]])
        selected[t, : len(picked)] = picked
    selected = selected.to(device)
    meta = attention.prepare_attention(batch, 16)
    want = sparse_attention.sparse_latent_attention(q, dequantize_rows(kv_cache, 32, torch.float32), 32, batch, meta,
                                                    0.3, selected)
    assert_close(sparse_attention.sparse_latent_attention(q, kv_cache, 32, batch, meta, 0.3, selected), want)
    got = triton_sparse_attention.sparse_latent_attention(q, kv_cache, 32, batch,
                                                          triton_attention.prepare_attention(batch, 16), 0.3, selected)
    assert_close(got, want, scale=2.0)


def test_gqa_layer_rotates_queries_and_keys_alike_and_rounds_less_for_it():
    """A GQA layer whose keys carry a few large channels (as RoPE'd keys of real models do): its FP8-cache output
    stays close to the float cache's, closer than without the rotation (same caches, keys unrotated), which needs the
    queries rotated exactly as the keys are."""
    from reasoning_engine.layers.attention import GQAttention
    from reasoning_engine.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    layer = GQAttention(64, 4, 2, 32, RotaryEmbedding(32, 10000.0, None, 256, 256))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
        layer.qkv_proj.weight[4 * 32: 4 * 32 + 2].mul_(20)  # two loud key channels in kv head 0 ...
        layer.qkv_proj.weight[:2].mul_(5)  # ... read by loud query channels
    batch, num_blocks = make_batch([0, 9], [21, 4], 4, "cpu")
    batch.attn_metadata = attention.prepare_attention(batch, 4)
    x = torch.randn(batch.num_tokens, 64)

    def run(fp8: bool, rotate: bool) -> torch.Tensor:
        layer.fp8_cache, layer.key_rotation = False, None
        if fp8:
            layer.use_fp8_cache(torch.device("cpu"))
            layer.key_rotation = layer.key_rotation if rotate else None
        shapes = layer.cache_shape(num_blocks, 4)
        layer.bind_cache([torch.zeros(s, dtype=d) for s, d in zip(shapes, layer.cache_dtypes(torch.float32))])
        with torch.no_grad():
            return layer(batch.positions, x, batch)

    want = run(False, False)
    rotated, plain = ((run(True, rotate) - want).norm() / want.norm() for rotate in (True, False))
    assert rotated < 0.06 and rotated < 0.8 * plain, (rotated, plain)
