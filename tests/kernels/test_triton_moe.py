"""Triton MoE (router, sort, grouped GEMMs with plain / INT4 / FP8 weights) against the torch reference."""

import pytest
import torch
from kernel_asserts import assert_close, rel_error

from reasoning_engine.kernels import fused_moe, triton_moe
from reasoning_engine.kernels.fused_moe import MoEQuant


def transformers_router(logits, bias, top_k, n_group, topk_group, norm, scale):
    """transformers' DeepseekV3TopkRouter with its gate matmul replaced by the given logits."""
    from types import SimpleNamespace

    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    num_experts = logits.shape[1]
    cfg = SimpleNamespace(
        num_experts_per_tok=top_k, num_local_experts=num_experts, hidden_size=num_experts, routed_scaling_factor=scale,
        n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
    )
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.eye(num_experts))
        router.e_score_correction_bias.copy_(bias)
        _, weights, ids = router(logits)
    return weights, ids


ROUTER_CASES = [
    # tokens, experts, top_k, n_group, topk_group, norm, scale
    (5, 16, 4, 4, 2, True, 2.5),
    (3, 24, 6, 1, 1, True, 1.0),  # Moonlight/Kimi-style: one group, top-6 (not a power of two), 24 experts
    (4, 64, 8, 8, 4, False, 2.827),
    (1, 8, 1, 2, 1, True, 1.0),
    (0, 16, 2, 4, 2, True, 1.0),
]


@pytest.mark.parametrize("case", ROUTER_CASES)
def test_router_matches_transformers(device, case):
    tokens, experts, top_k, n_group, topk_group, norm, scale = case
    logits = torch.randn(tokens, experts)
    bias = 0.1 * torch.randn(experts)
    ref_w, ref_ids = fused_moe.noaux_tc_router(logits, bias, top_k, n_group, topk_group, norm, scale)
    if tokens:
        hf_w, hf_ids = transformers_router(logits, bias, top_k, n_group, topk_group, norm, scale)
        order = hf_ids.sort(dim=1).indices
        ref_order = ref_ids.long().sort(dim=1).indices
        assert torch.equal(hf_ids.gather(1, order), ref_ids.long().gather(1, ref_order))
        torch.testing.assert_close(hf_w.gather(1, order), ref_w.gather(1, ref_order))
    w, ids = triton_moe.noaux_tc_router(logits.to(device), bias.to(device), top_k, n_group, topk_group, norm, scale)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(w.cpu(), ref_w)


def test_router_group_limit_excludes_strong_expert_in_weak_group(device):
    """An expert with the best single score loses when its group's top-2 sum is low."""
    logits = torch.full((1, 8), -4.0)
    logits[0, 0] = 4.0  # group 0: one strong, one weak
    logits[0, 2:4] = 2.0  # group 1: two good
    logits[0, 4:6] = 1.5  # group 2
    w, ids = triton_moe.noaux_tc_router(logits.to(device), torch.zeros(8, device=device), 2, 4, 2, True, 1.0)
    assert sorted(ids[0].tolist()) == [2, 3]
    ref_w, ref_ids = fused_moe.noaux_tc_router(logits, torch.zeros(8), 2, 4, 2, True, 1.0)
    assert torch.equal(ids.cpu(), ref_ids)


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [
    (0, 2, 4, 16), (1, 1, 3, 16), (7, 3, 5, 4), (300, 2, 8, 16), (2, 6, 64, 16),
    (4500, 2, 40, 16),  # 71 chunks of 128 pairs: the scan over chunks takes two steps; 40 experts: two scan programs
])
def test_align_block_size(device, tokens, top_k, experts, block_m):
    ids = torch.rand(tokens, experts).topk(top_k, dim=1).indices
    ref = fused_moe.moe_align_block_size(ids, experts, block_m)
    out = triton_moe.moe_align_block_size(ids.to(device), experts, block_m)
    used = int(ref[2])
    assert int(out[2]) == used
    assert torch.equal(out[0].cpu(), ref[0])
    assert torch.equal(out[1].cpu(), ref[1])
    # every pair exactly once, each tile one expert
    real = ref[0][ref[0] < tokens * top_k].long()
    assert torch.equal(real.sort().values, torch.arange(tokens * top_k))
    for tile in range(used // block_m):
        rows = ref[0][tile * block_m : (tile + 1) * block_m].long()
        rows = rows[rows < tokens * top_k]
        assert (ids.flatten()[rows] == ref[1][tile]).all()


def _route(tokens, experts, top_k, device):
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]) if tokens else torch.zeros(0, top_k, dtype=torch.int64)
    weights = torch.rand(tokens, top_k)
    return weights.to(device), ids.to(torch.int32).to(device)


MOE_SHAPES = [
    # tokens, experts, top_k, hidden, intermediate
    (0, 4, 2, 64, 32),
    (1, 4, 1, 64, 32),
    (5, 6, 2, 96, 64),
    (40, 3, 2, 64, 96),  # enough pairs per expert for several row tiles
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", MOE_SHAPES)
def test_fused_moe_dense(device, dtype, shape):
    tokens, experts, top_k, hidden, inter = shape
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    weights, ids = _route(tokens, experts, top_k, device)
    out = triton_moe.fused_moe(x, w13, w2, weights, ids)
    ref = fused_moe.fused_moe(x, w13, w2, weights, ids)
    assert_close(out, ref, scale=3.0)


@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_partial_sums_add_up(device, ranks):
    """Expert parallelism: each rank holds E / ranks experts and sees other ranks' choices as ids past its own (E
    local); the ranks' partial outputs sum to the whole MoE, on the sort, the torch reference and the Triton GEMMs."""
    tokens, experts, top_k, hidden, inter = 9, 8, 3, 64, 32
    x = torch.randn(tokens, hidden, device=device)
    w13 = torch.randn(experts, 2 * inter, hidden, device=device) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, device=device) / inter**0.5
    weights, ids = _route(tokens, experts, top_k, device)
    whole = fused_moe.fused_moe(x, w13, w2, weights, ids)
    local = experts // ranks
    parts_ref, parts_triton = [], []
    for rank in range(ranks):
        rank_ids = ids - rank * local
        rank_ids = rank_ids.masked_fill((rank_ids < 0) | (rank_ids >= local), local)
        mine = slice(rank * local, (rank + 1) * local)
        parts_ref.append(fused_moe.fused_moe(x, w13[mine], w2[mine], weights, rank_ids, other_experts=True))
        parts_triton.append(triton_moe.fused_moe(x, w13[mine], w2[mine], weights, rank_ids, other_experts=True))
        sorted_ids, _, used = fused_moe.moe_align_block_size(rank_ids.cpu(), local, 16)
        out = triton_moe.moe_align_block_size(rank_ids, local, 16)
        assert int(out[2]) == int(used) and torch.equal(out[0].cpu(), sorted_ids)
        real = sorted_ids[sorted_ids < tokens * top_k].long()
        assert torch.equal(real.sort().values, (rank_ids.flatten().cpu() < local).nonzero().squeeze(1))
    assert_close(sum(parts_ref), whole, scale=1.0)
    assert_close(sum(parts_triton), whole, scale=3.0)


def test_fused_moe_reference_matches_transformers_experts():
    from types import SimpleNamespace

    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    cfg = SimpleNamespace(num_local_experts=4, hidden_size=32, moe_intermediate_size=16, hidden_act="silu", _experts_implementation="eager")
    experts = DeepseekV3Experts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    x = torch.randn(6, 32)
    weights, ids = _route(6, 4, 2, "cpu")
    with torch.no_grad():
        expected = experts(x, ids.long(), weights)
    got = fused_moe.fused_moe(x, experts.gate_up_proj.data, experts.down_proj.data, weights, ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[..., in] ints in [-8, 7] -> [..., in/8] int32, lowest nibble first, stored offset by +8."""
    nibbles = (q + 8).to(torch.int64).unflatten(-1, (-1, 8))
    word = (nibbles << torch.arange(0, 32, 4)).sum(-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def int4_weights(experts, out_ch, in_ch, group):
    q = torch.randint(-8, 8, (experts, out_ch, in_ch))
    scale = (torch.rand(experts, out_ch, in_ch // group) * 0.02 + 0.01).to(torch.bfloat16)
    return pack_int4(q), scale, q


def test_int4_unpack_matches_layout():
    packed, scale, q = int4_weights(2, 3, 64, 32)
    deq = fused_moe.dequantize_int4_packed(packed, scale, 32)
    expected = q.float() * scale.float().repeat_interleave(32, -1)
    torch.testing.assert_close(deq, expected)
    assert int(packed[0, 0, 0]) & 0xF == int(q[0, 0, 0]) + 8  # lowest nibble holds the first value


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", MOE_SHAPES[:3] + [
    (9, 5, 3, 128, 96),
    (2, 6, 2, 576, 64),  # decode tiles (16 rows): 256-deep K steps, two whole and a partial one
])
def test_fused_moe_w4a16(device, dtype, shape):
    tokens, experts, top_k, hidden, inter = shape
    p13, s13, _ = int4_weights(experts, 2 * inter, hidden, 32)
    p2, s2, _ = int4_weights(experts, hidden, inter, 32)
    quant = MoEQuant("w4a16", s13.to(device), s2.to(device), group_size=32)
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    weights, ids = _route(tokens, experts, top_k, device)
    out = triton_moe.fused_moe(x, p13.to(device), p2.to(device), weights, ids, quant)
    ref = fused_moe.fused_moe(x, p13.to(device), p2.to(device), weights, ids, quant)
    assert_close(out, ref, scale=3.0)


def fp8_weights(experts, out_ch, in_ch, block):
    w = (torch.randn(experts, out_ch, in_ch) * 0.5).to(torch.float8_e4m3fn)
    scale = torch.rand(experts, -(-out_ch // block[0]), -(-in_ch // block[1])) * 0.05 + 0.01
    return w, scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,block", [((5, 4, 2, 96, 40), (16, 32)), ((1, 3, 2, 64, 48), (32, 32)), ((12, 4, 3, 80, 72), (128, 128))])
def test_fused_moe_fp8_block(device, dtype, shape, block):
    """Block shapes smaller than DeepSeek's 128x128 exercise partial edge blocks and an intermediate size that the
    block does not divide (separate gate and up scale rows)."""
    tokens, experts, top_k, hidden, inter = shape
    g, sg = fp8_weights(experts, inter, hidden, block)
    u, su = fp8_weights(experts, inter, hidden, block)
    w2, s2 = fp8_weights(experts, hidden, inter, block)
    w13 = torch.cat([g, u], dim=1)
    quant = MoEQuant("fp8_block", torch.cat([sg, su], dim=1).to(device), s2.to(device), block_shape=block)
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    weights, ids = _route(tokens, experts, top_k, device)
    out = triton_moe.fused_moe(x, w13.to(device), w2.to(device), weights, ids, quant)
    ref = fused_moe.fused_moe(x, w13.to(device), w2.to(device), weights, ids, quant)
    assert_close(out, ref, scale=3.0)
    # the reference's dequantisation, against the block formula applied element by element
    e, r, c = 1, inter - 1, hidden - 1
    assert float(fused_moe.dequantize_fp8_block(g, sg, block)[e, r, c]) == pytest.approx(float(g[e, r, c].float() * sg[e, r // block[0], c // block[1]]))


def test_fused_moe_matches_float64(device):
    x = torch.randn(7, 64, dtype=torch.float64)
    w13 = torch.randn(4, 64, 64, dtype=torch.float64) / 8
    w2 = torch.randn(4, 64, 32, dtype=torch.float64) / 6
    weights, ids = _route(7, 4, 2, "cpu")
    expected = torch.zeros(7, 64, dtype=torch.float64)
    for t in range(7):
        for j in range(2):
            gate, up = (w13[ids[t, j]] @ x[t]).chunk(2)
            expected[t] += weights[t, j].double() * (w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    out = triton_moe.fused_moe(x.float().to(device), w13.float().to(device), w2.float().to(device), weights.to(device), ids.to(device))
    assert rel_error(out.cpu(), expected) < 1e-5


@pytest.mark.parametrize("method", ["w4a16", "fp8_block", "mxfp4", None])
@pytest.mark.parametrize("tokens", [1, 3])
def test_split_k_gives_the_same_bits(device, monkeypatch, method, tokens):
    """K = 1152 over 512-channel spans: two whole spans of 16 scale groups and a partial one. Split over the spans
    (partial sums added in span order by the reduction kernel) or not, every output has the same bits, and both
    match the reference: batch 1, and 3 tokens (an odd count per expert)."""
    experts, top_k, hidden, inter = 4, 2, 1152, 64
    x = torch.randn(tokens, hidden, device=device).to(torch.bfloat16)
    if method == "w4a16":
        p13, s13, _ = int4_weights(experts, 2 * inter, hidden, 32)
        p2, s2, _ = int4_weights(experts, hidden, inter, 32)
        quant = MoEQuant("w4a16", s13.to(device), s2.to(device), group_size=32)
    elif method == "fp8_block":
        p13, s13 = fp8_weights(experts, 2 * inter, hidden, (32, 128))
        p2, s2 = fp8_weights(experts, hidden, inter, (32, 128))
        quant = MoEQuant("fp8_block", s13.to(device), s2.to(device), block_shape=(32, 128))
    elif method == "mxfp4":
        p13 = torch.randint(0, 256, (experts, 2 * inter, hidden // 2), dtype=torch.uint8)
        p2 = torch.randint(0, 256, (experts, hidden, inter // 2), dtype=torch.uint8)
        s13 = torch.randint(121, 125, (experts, 2 * inter, hidden // 32), dtype=torch.uint8)
        s2 = torch.randint(121, 125, (experts, hidden, inter // 32), dtype=torch.uint8)
        quant = MoEQuant("mxfp4", s13.to(device), s2.to(device))
    else:
        p13 = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).to(torch.bfloat16)
        p2 = (torch.randn(experts, hidden, inter) / inter**0.5).to(torch.bfloat16)
        quant = None
    weights, ids = _route(tokens, experts, top_k, device)
    launches = []
    split_kernel = triton_moe._moe_split_reduce_kernel
    monkeypatch.setattr(triton_moe, "_moe_split_reduce_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: (launches.append(grid), split_kernel[grid])[1]})())
    monkeypatch.setattr(triton_moe, "_BUSY_PROGRAMS", 10**6)  # always split
    split = triton_moe.fused_moe(x, p13.to(device), p2.to(device), weights, ids, quant)
    assert len(launches) == 1  # gate_up (K = 1152) split, down (K = 64) one span
    monkeypatch.setattr(triton_moe, "_BUSY_PROGRAMS", 0)  # never split
    whole = triton_moe.fused_moe(x, p13.to(device), p2.to(device), weights, ids, quant)
    assert len(launches) == 1
    assert torch.equal(split, whole)
    ref = fused_moe.fused_moe(x, p13.to(device), p2.to(device), weights, ids, quant)
    assert rel_error(split, ref) < 1e-2


@pytest.mark.slow
def test_int4_exponent_trick_is_exact(device):
    """The kernel's INT4 values (codes ORed into a float's mantissa, the bias subtracted, inputs reordered to match)
    are exactly q for every code and activation dtype: one-hot activations through a GEMM of unit scales recover
    each weight."""
    hidden, inter = 64, 32
    q = torch.arange(16).repeat(2 * inter * hidden // 16).view(1, 2 * inter, hidden) - 8
    q = q[:, torch.randperm(2 * inter)]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        scale = torch.ones(1, 2 * inter, hidden // 32, dtype=torch.bfloat16)
        out = torch.empty(hidden, 2 * inter)
        for k in range(hidden):  # one-hot token k: gate_up's product is column k of the weights
            x = torch.zeros(1, hidden, dtype=dtype)
            x[0, k] = 1
            align = triton_moe.moe_align_block_size(torch.zeros(1, 1, dtype=torch.int32, device=device), 1, 16)
            part = torch.empty(1, 2 * inter, dtype=torch.float32, device=device)
            triton_moe._launch_gemm(x.to(device), pack_int4(q).to(device), scale.to(device), scale.to(device), part,
                                    align, torch.ones(1, device=device), row_tiles=1, a_row_div=1, n_out=2 * inter,
                                    k_in=hidden, up_row0=0, gated=False, apply_weight=False, has_bias=False,
                                    swiglu_limit=0.0, kind=1, scale_n=1, scale_k=32, block_m=16)
            out[k] = part[0].cpu()
        assert torch.equal(out.T, q[0].float()), dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int4_weights_are_the_references_dequantised_weights(device, dtype):
    """Each INT4 weight enters the MMA as q * scale rounded once to the activations' type, as the reference
    dequantises: a GEMM over 128-channel steps of four scale groups (and a partial last step) equals the float64
    product with the reference's weights, up to float32 accumulation."""
    hidden, rows = 352, 64
    p, s, _ = int4_weights(1, rows, hidden, 32)
    x = torch.randn(1, hidden).to(dtype)
    align = triton_moe.moe_align_block_size(torch.zeros(1, 1, dtype=torch.int32, device=device), 1, 16)
    out = torch.empty(1, rows, dtype=torch.float32, device=device)
    triton_moe._launch_gemm(x.to(device), p.to(device), s.to(device), s.to(device), out, align, torch.ones(1, device=device),
                            row_tiles=1, a_row_div=1, n_out=rows, k_in=hidden, up_row0=0, gated=False, apply_weight=False,
                            has_bias=False, swiglu_limit=0.0, kind=1, scale_n=1, scale_k=32, block_m=16)
    weights = fused_moe.dequantize_int4_packed(p, s, 32)[0].to(dtype)
    expected = x.double() @ weights.double().T
    assert (out.cpu().double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [320, 352])
def test_mxfp4_weights_are_the_references_dequantised_weights(device, dtype, hidden):
    """Each MXFP4 weight enters the MMA as code * 2^(scale - 127) in the activations' type, as the reference
    dequantises: every e2m1 code (both zeros and the subnormal 0.5 included) under scales from 2^-20 to 2^8, over
    64-channel steps of two groups (320) or 128-channel steps with a partial last one (352), equals the float64
    product with the reference's weights, up to float32 accumulation."""
    rows = 64
    gen = torch.Generator().manual_seed(3)
    p = torch.randint(0, 256, (1, rows, hidden // 2), generator=gen, dtype=torch.uint8)
    codes = torch.arange(16, dtype=torch.uint8).view(8, 2)
    p[0, 0, :8] = codes[:, 0] | (codes[:, 1] << 4)  # row 0 starts with all 16 codes
    s = torch.randint(107, 136, (1, rows, hidden // 32), generator=gen, dtype=torch.uint8)
    x = torch.randn(1, hidden).to(dtype)
    align = triton_moe.moe_align_block_size(torch.zeros(1, 1, dtype=torch.int32, device=device), 1, 16)
    out = torch.empty(1, rows, dtype=torch.float32, device=device)
    words = triton_moe._as_words(p.to(device))
    triton_moe._launch_gemm(x.to(device), words, s.to(device), s.to(device), out, align, torch.ones(1, device=device),
                            row_tiles=1, a_row_div=1, n_out=rows, k_in=hidden, up_row0=0, gated=False, apply_weight=False,
                            has_bias=False, swiglu_limit=0.0, kind=3, scale_n=1, scale_k=32, block_m=16)
    weights = fused_moe.dequantize_mxfp4(p, s)[0].to(dtype)
    expected = x.double() @ weights.double().T
    assert (out.cpu().double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 6, 64), (4, 2, 8), (16, 8, 384)])
def test_align_one_launch_for_few_pairs(device, tokens, top_k, experts, monkeypatch):
    """A decode or verification step's few pairs are sorted in one launch that writes every slot itself (no filled
    allocation), the same result as the reference, other ranks' experts (ids >= E) left out."""
    ids = torch.rand(tokens, experts + 2).topk(top_k, dim=1).indices.clamp(max=experts)  # some on "another rank"
    launched = []
    original = triton_moe._align_one_program_kernel.run
    monkeypatch.setattr(triton_moe._align_one_program_kernel, "run", lambda *a, **k: launched.append(1) or original(*a, **k))
    for block_m in (4, 16):
        out = triton_moe.moe_align_block_size(ids.to(device), experts, block_m)
        ref = fused_moe.moe_align_block_size(ids, experts, block_m)
        assert [int(out[2])] == [int(ref[2])]
        assert torch.equal(out[0].cpu(), ref[0]) and torch.equal(out[1].cpu(), ref[1])
    assert len(launched) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [0, 3, 70])  # 70: past the fused shared expert, its down projection a GEMM
def test_moe_with_shared_expert_matches_reference(device, dtype, tokens):
    """The routed sum and the shared expert (from its gate_up output and down weight) in the combine kernel, as the
    torch reference adds them."""
    experts, top_k, hidden, inter, shared_inter = 6, 2, 64, 32, 48
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    gate_up = torch.randn(tokens, 2 * shared_inter + 8, device=device).to(dtype)[:, 8:]  # strided rows
    w_down = (torch.randn(hidden, shared_inter, device=device) / shared_inter**0.5).to(dtype)
    weights, ids = _route(tokens, experts, top_k, device)
    out = triton_moe.fused_moe(x, w13, w2, weights, ids, shared=(gate_up, w_down))
    ref = fused_moe.fused_moe(x, w13, w2, weights, ids, shared=(gate_up, w_down))
    assert_close(out, ref, scale=3.0)
    routed = fused_moe.fused_moe(x, w13, w2, weights, ids)
    assert_close(ref, routed + fused_moe.shared_expert(gate_up, w_down), scale=1.0)


def test_router_layer_runs_noaux_tc_kernel(device):
    """DeepSeek-V3's Router (sigmoid + correction bias) takes the kernel family's noaux_tc_router: the Triton kernel
    and the torch reference choose the same experts with the same weights."""
    from reasoning_engine.kernels import kernel_module
    from reasoning_engine.layers.moe import Router

    router = Router(32, 16, 4, "sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, n_group=4, topk_group=2,
                    topk_method="noaux_tc", correction_bias=True).to(device)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.1)
    x = torch.randn(5, 32, device=device)
    ref_w, ref_ids = router(x)
    router.ops = kernel_module("moe", "triton")
    w, ids = router(x)
    assert torch.equal(ids.long().cpu(), ref_ids.long().cpu())
    assert_close(w, ref_w)
    hf_w, hf_ids = transformers_router(torch.nn.functional.linear(x, router.weight).cpu(), router.e_score_correction_bias.detach().cpu(),
                                       4, 4, 2, True, 2.5)
    assert torch.equal(hf_ids.sort(dim=1).values, ids.long().cpu().sort(dim=1).values)


@pytest.mark.parametrize("case", ROUTER_CASES + [(40, 64, 6, 1, 1, True, 2.446)])  # 40 tokens: the router alone
def test_route_and_sort_in_one_launch(device, case):
    """noaux_tc routing of a small step's tokens at once and the sort of their pairs from registers, in one launch:
    the reference router's experts and weights, and the reference sort of its ids (for the tile size `fused_moe`
    picks); a step with more tokens gets the router alone and no sort."""
    tokens, experts, top_k, n_group, topk_group, norm, scale = case
    logits = torch.randn(tokens, experts)
    logits[:, 1] = logits[:, 0]  # a tie: the lower expert id goes first, as in the reference
    bias = torch.randn(experts) * 0.1
    w, ids, sort = triton_moe.noaux_tc_route_and_sort(logits.to(device), bias.to(device), top_k, n_group, topk_group,
                                                      norm, scale, experts)
    ref_w, ref_ids = fused_moe.noaux_tc_router(logits, bias, top_k, n_group, topk_group, norm, scale)
    assert torch.equal(ids.cpu(), ref_ids)
    assert_close(w.cpu(), ref_w)
    if tokens > 16:
        assert sort is None
        return
    if not tokens:
        return
    ref_sort = fused_moe.moe_align_block_size(ref_ids, experts, triton_moe._block_m(tokens * top_k, experts))
    assert int(sort[2]) == int(ref_sort[2])
    assert torch.equal(sort[0].cpu(), ref_sort[0]) and torch.equal(sort[1].cpu(), ref_sort[1])
