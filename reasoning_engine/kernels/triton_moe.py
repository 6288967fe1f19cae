"""Triton mixture-of-experts: the noaux_tc router, the token-to-expert sort with block alignment, and two grouped GEMMs
(gate_up with SiLU(gate) * up fused into its epilogue; down with the routing weight applied), for plain, W4A16 INT4
and block-FP8 expert weights. Same signatures and weight layouts as `fused_moe.py`.

The grouped GEMM follows the MegaBlocks idea (Gale et al., 2023, "MegaBlocks: Efficient Sparse Training with
Mixture-of-Experts"): (token, choice) pairs are sorted by expert and each expert's run is padded to the row tile, so
every row tile of the GEMM belongs to exactly one expert and reads only that expert's weights. Quantized weights are
dequantized in registers right after they are loaded (W4A16 as in Frantar et al., 2024, "MARLIN"), so only the packed
bytes cross the memory bus. Every pair writes its own output row and the k rows of a token are summed afterwards, so
results do not depend on scheduling (no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reasoning_engine.kernels._triton_utils import dot_mode, mma, num_warps_for, pow2
from reasoning_engine.kernels.fused_moe import MoEQuant

_ALIGN_CHUNK = 128  # pairs per program of the sort; the rank inside a chunk costs CHUNK^2 comparisons


@triton.jit
def _router_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    stride_logits, num_experts, group_size, routed_scaling_factor,
    TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    logits = tl.load(logits_ptr + tok * stride_logits + e, mask=e_ok, other=0.0).to(tl.float32)
    scores = tl.sigmoid(logits)
    biased = tl.where(e_ok, scores + tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32), float("-inf"))
    # group score = sum of the two best biased scores of the group (ties: the first best is removed, the second kept)
    g = tl.arange(0, BLOCK_G)
    member = (e // group_size)[:, None] == g[None, :]  # [BLOCK_E, BLOCK_G]
    in_group = tl.where(member, biased[:, None], float("-inf"))
    best = tl.max(in_group, axis=0)
    best_idx = tl.min(tl.where(member & (in_group == best[None, :]), e[:, None], BLOCK_E), axis=0)
    second = tl.max(tl.where(e[:, None] == best_idx[None, :], float("-inf"), in_group), axis=0)
    group_score = tl.where(g < N_GROUP, best + second, float("-inf"))
    kept = tl.zeros([BLOCK_G], tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        top = tl.max(group_score, axis=0)
        pick = tl.min(tl.where(group_score == top, g, BLOCK_G), axis=0)
        kept = kept | (g == pick)
        group_score = tl.where(g == pick, float("-inf"), group_score)
    eligible = tl.max(tl.where(member & kept[None, :], 1, 0), axis=1) > 0
    choice = tl.where(eligible, biased, float("-inf"))
    ks = tl.arange(0, TOP_K)
    ids = tl.zeros([TOP_K], tl.int32)
    weights = tl.zeros([TOP_K], tl.float32)
    for j in tl.static_range(TOP_K):
        top = tl.max(choice, axis=0)
        pick = tl.min(tl.where(choice == top, e, BLOCK_E), axis=0)
        ids = tl.where(ks == j, pick, ids)
        weights = tl.where(ks == j, tl.sum(tl.where(e == pick, scores, 0.0), axis=0), weights)
        choice = tl.where(e == pick, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(weights_ptr + tok * TOP_K + ks, weights * routed_scaling_factor)
    tl.store(ids_ptr + tok * TOP_K + ks, ids)


def noaux_tc_router(
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 noaux_tc routing, one program per token (see `fused_moe.noaux_tc_router` for the semantics).
    router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int32), best first. top_k is padded to a
    power of two internally."""
    tokens, num_experts = router_logits.shape
    k_pad = pow2(top_k)
    weights = torch.empty(tokens, k_pad, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, k_pad, dtype=torch.int32, device=router_logits.device)
    if tokens:
        if router_logits.stride(-1) != 1:
            router_logits = router_logits.contiguous()
        block_e = pow2(num_experts)
        block_g = pow2(n_group)
        # padded top-k slots pick further experts; they are sliced off below
        _router_kernel[(tokens,)](
            router_logits, e_score_correction_bias, weights, ids,
            router_logits.stride(0), num_experts, num_experts // n_group, float(routed_scaling_factor),
            TOP_K=k_pad, N_GROUP=n_group, TOPK_GROUP=topk_group, NORM=False, BLOCK_E=block_e, BLOCK_G=block_g,
            num_warps=num_warps_for(block_e * block_g),
        )
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20 * routed_scaling_factor)
        weights = weights * routed_scaling_factor
    return weights.contiguous(), ids.contiguous()
