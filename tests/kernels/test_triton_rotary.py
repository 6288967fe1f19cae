import pytest
import torch
from kernel_asserts import assert_close

from reasoning_engine.kernels import rotary, triton_rotary


def _tables(max_pos: int, half: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos().to(device), angles.sin().to(device)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,hq,hk,head_dim,rot_dim", [(0, 4, 2, 16, 16), (1, 1, 1, 8, 8), (5, 6, 2, 24, 16), (3, 3, 1, 64, 64),
                                                       (3, 4, 2, 32, 8), (2, 3, 1, 128, 64)])
def test_rotary_matches_reference(device, interleaved, dtype, tokens, hq, hk, head_dim, rot_dim):
    cos, sin = _tables(64, rot_dim // 2, device)
    positions = torch.randint(0, 64, (tokens,), device=device)
    q = torch.randn(tokens, hq, head_dim, device=device).to(dtype)
    k = torch.randn(tokens, hk, head_dim, device=device).to(dtype)
    out_q, out_k = triton_rotary.apply_rotary(positions, q, k, cos, sin, interleaved)
    ref_q, ref_k = rotary.apply_rotary(positions, q, k, cos, sin, interleaved)
    assert_close(out_q, ref_q)
    assert_close(out_k, ref_k)


def test_rotary_strided_views(device):
    """DeepSeek's q_pe is the tail slice of each head's query: a strided view."""
    cos, sin = _tables(32, 8, device)
    positions = torch.tensor([3, 0, 31], device=device)
    q_full = torch.randn(3, 4, 40, device=device)
    k = torch.randn(3, 1, 16, device=device)
    out_q, out_k = triton_rotary.apply_rotary(positions, q_full[..., 24:], k, cos, sin, True)
    ref_q, ref_k = rotary.apply_rotary(positions, q_full[..., 24:], k, cos, sin, True)
    assert_close(out_q, ref_q)
    assert_close(out_k, ref_k)


def test_reference_matches_transformers_layouts():
    """neox equals transformers' rotate_half form; interleaved equals apply_rotary_pos_emb_interleave (de-interleaved
    output), and both preserve q·k for a relative shift of positions."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb, apply_rotary_pos_emb_interleave

    cos, sin = _tables(16, 8, "cpu")
    positions = torch.tensor([0, 5, 9])
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    full_cos = torch.cat([cos, cos], -1)[positions]
    full_sin = torch.cat([sin, sin], -1)[positions]
    for interleaved, fn in ((False, apply_rotary_pos_emb), (True, apply_rotary_pos_emb_interleave)):
        exp_q, exp_k = fn(q.transpose(0, 1), k.transpose(0, 1), full_cos, full_sin, unsqueeze_dim=0)
        out_q, out_k = rotary.apply_rotary(positions, q, k, cos, sin, interleaved)
        assert_close(out_q, exp_q.transpose(0, 1).contiguous())
        assert_close(out_k, exp_k.transpose(0, 1).contiguous())
        a_q, _ = rotary.apply_rotary(torch.tensor([7]), q[:1], k[:1], cos, sin, interleaved)
        _, a_k = rotary.apply_rotary(torch.tensor([3]), q[:1], k[:1], cos, sin, interleaved)
        b_q, _ = rotary.apply_rotary(torch.tensor([12]), q[:1], k[:1], cos, sin, interleaved)
        _, b_k = rotary.apply_rotary(torch.tensor([8]), q[:1], k[:1], cos, sin, interleaved)
        torch.testing.assert_close((a_q[0, 0] * a_k[0, 0]).sum(), (b_q[0, 0] * b_k[0, 0]).sum(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,nope,latent,rope", [(1, 3, 32, 64, 16), (5, 2, 16, 48, 8), (19, 4, 48, 160, 32)])
def test_mla_rope_and_cache_matches_reference(device, interleaved, dtype, tokens, heads, nope, latent, rope):
    """MLA's query/key side in one launch: the absorbed query (q_nope @ W_UK, q_pe rotated) and the cache rows (the
    normalised latent, k_pe rotated) at each token's slot, from strided views of the projections' outputs; other
    slots untouched."""
    cos, sin = _tables(64, rope // 2, device)
    positions = torch.randint(0, 64, (tokens,), device=device)
    q = torch.randn(tokens, heads * (nope + rope) + 4, device=device).to(dtype)[:, 4:].view(tokens, heads, nope + rope)
    kv_a = torch.randn(tokens, latent + rope + 8, device=device).to(dtype)[:, : latent + rope]
    w_uk = (torch.randn(heads, nope, latent, device=device) / nope**0.5).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(latent, device=device)).to(dtype)
    slots = torch.randperm(4 * 8, device=device)[:tokens]
    caches = [torch.full((4, 8, latent + rope), 7.0, device=device, dtype=dtype) for _ in range(2)]
    out = triton_rotary.mla_rope_and_cache(positions, q, kv_a, w_uk, norm_weight, 1e-6, cos, sin, interleaved, caches[0], slots)
    ref = rotary.mla_rope_and_cache(positions, q, kv_a, w_uk, norm_weight, 1e-6, cos, sin, interleaved, caches[1], slots)
    assert_close(out, ref, scale=2.0)
    assert_close(caches[0], caches[1])
    untouched = torch.ones(4 * 8, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert (caches[0].view(32, -1)[untouched] == 7.0).all()
