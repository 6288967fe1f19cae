"""gpt-oss experts in the fused-MoE kernels: biases and the clamped SwiGLU, plain and MXFP4 weights; Triton (interpreted
on CPU) against the torch reference, and the reference against transformers' GptOssExperts."""

import pytest
import torch
from kernel_asserts import assert_close, rel_error
from test_triton_moe import MOE_SHAPES, _route

from reasoning_engine.kernels import fused_moe, triton_moe
from reasoning_engine.kernels.fused_moe import MoEQuant


def _biases(experts, inter, hidden, device, dtype):
    return (torch.randn(experts, 2 * inter, device=device).to(dtype), torch.randn(experts, hidden, device=device).to(dtype))


def mxfp4_weights(experts, out_ch, in_ch, gen):
    blocks = torch.randint(0, 256, (experts, out_ch, in_ch // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(121, 125, (experts, out_ch, in_ch // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", MOE_SHAPES)
def test_biases_and_clamped_swiglu(device, dtype, shape):
    """A limit of 1.5 on weights scaled to 2 clamps many gate and up values, so the clamp is exercised."""
    tokens, experts, top_k, hidden, inter = shape
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w13 = (2 * torch.randn(experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    b13, b2 = _biases(experts, inter, hidden, device, dtype)
    weights, ids = _route(tokens, experts, top_k, device)
    kwargs = dict(w13_bias=b13, w2_bias=b2, swiglu_limit=1.5)
    out = triton_moe.fused_moe(x, w13, w2, weights, ids, **kwargs)
    ref = fused_moe.fused_moe(x, w13, w2, weights, ids, **kwargs)
    assert_close(out, ref, scale=3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4, 2, 64, 32), (9, 5, 3, 128, 96), (2, 6, 2, 576, 64)])
def test_mxfp4(device, dtype, shape):
    tokens, experts, top_k, hidden, inter = shape
    gen = torch.Generator().manual_seed(0)
    p13, s13 = mxfp4_weights(experts, 2 * inter, hidden, gen)
    p2, s2 = mxfp4_weights(experts, hidden, inter, gen)
    quant = MoEQuant("mxfp4", s13.to(device), s2.to(device), group_size=32)
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    b13, b2 = _biases(experts, inter, hidden, device, dtype)
    weights, ids = _route(tokens, experts, top_k, device)
    kwargs = dict(w13_bias=b13, w2_bias=b2, swiglu_limit=7.0)
    out = triton_moe.fused_moe(x, p13.to(device), p2.to(device), weights, ids, quant, **kwargs)
    ref = fused_moe.fused_moe(x, p13.to(device), p2.to(device), weights, ids, quant, **kwargs)
    if dtype == torch.float32:
        assert_close(out, ref, scale=3.0)
    else:  # the reference rounds the gate/up product to bf16 before the activation, the kernel after it
        assert rel_error(out, ref) < 1e-2
    # the reference on MXFP4 is the reference on the dequantized weights
    dense = fused_moe.fused_moe(x, fused_moe.dequantize_mxfp4(p13, s13).to(device).to(dtype),
                                fused_moe.dequantize_mxfp4(p2, s2).to(device).to(dtype), weights, ids, None, **kwargs)
    assert torch.equal(ref, dense)


def test_reference_matches_transformers_gpt_oss_experts():
    """transformers' GptOssExperts (gate/up interleaved in [E, H, 2I]) equals the reference on the de-interleaved,
    transposed weights."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts, hidden, inter, tokens, top_k = 4, 32, 16, 6, 2
    cfg = SimpleNamespace(intermediate_size=inter, num_local_experts=experts, hidden_size=hidden, swiglu_alpha=1.702,
                          swiglu_limit=1.0, _experts_implementation="eager")
    module = GptOssExperts(cfg)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape))
    x = torch.randn(tokens, hidden)
    weights, ids = _route(tokens, experts, top_k, "cpu")
    with torch.no_grad():
        want = module(x, ids.long(), weights)
    gate_up, bias = module.gate_up_proj.detach(), module.gate_up_proj_bias.detach()
    w13 = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2)
    b13 = torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=-1)
    got = fused_moe.fused_moe(x, w13, module.down_proj.detach().transpose(1, 2), weights, ids,
                              w13_bias=b13, w2_bias=module.down_proj_bias.detach(), swiglu_limit=1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
