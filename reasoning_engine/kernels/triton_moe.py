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
    BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
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
    kept = tl.zeros([BLOCK_G], tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        top = tl.max(group_score, axis=0)
        pick = tl.min(tl.where(group_score == top, g, BLOCK_G), axis=0)
        kept = tl.where(g == pick, 1, kept)
        group_score = tl.where(g == pick, float("-inf"), group_score)
    eligible = tl.max(tl.where(member & (kept[None, :] != 0), 1, 0), axis=1) > 0
    choice = tl.where(eligible, biased, float("-inf"))
    ks = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int32)
    weights = tl.zeros([BLOCK_K], tl.float32)
    for j in tl.static_range(TOP_K):
        top = tl.max(choice, axis=0)
        pick = tl.min(tl.where(choice == top, e, BLOCK_E), axis=0)
        ids = tl.where(ks == j, pick, ids)
        weights = tl.where(ks == j, tl.sum(tl.where(e == pick, scores, 0.0), axis=0), weights)
        choice = tl.where(e == pick, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(weights_ptr + tok * TOP_K + ks, weights * routed_scaling_factor, mask=ks < TOP_K)
    tl.store(ids_ptr + tok * TOP_K + ks, ids, mask=ks < TOP_K)


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
    router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int32), best first."""
    tokens, num_experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if tokens:
        if router_logits.stride(-1) != 1:
            router_logits = router_logits.contiguous()
        block_e = pow2(num_experts)
        block_g = pow2(n_group)
        _router_kernel[(tokens,)](
            router_logits, e_score_correction_bias, weights, ids,
            router_logits.stride(0), num_experts, num_experts // n_group, float(routed_scaling_factor),
            TOP_K=top_k, N_GROUP=n_group, TOPK_GROUP=topk_group, NORM=norm_topk_prob,
            BLOCK_E=block_e, BLOCK_G=block_g, BLOCK_K=pow2(top_k), num_warps=num_warps_for(block_e * block_g),
        )
    return weights, ids


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, CHUNK: tl.constexpr, BINS: tl.constexpr):
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=num_experts)  # past the end: the spare bin E
    hist = tl.histogram(tl.minimum(ids, num_experts), BINS)  # another rank's expert: the spare bin too
    bins = tl.arange(0, BINS)
    tl.store(counts_ptr + chunk * num_experts + bins, hist, mask=bins < num_experts)


@triton.jit
def _align_offsets_kernel(
    counts_ptr, offsets_ptr, expert_ids_ptr, num_post_pad_ptr,
    num_chunks, num_experts, num_tiles, block_m,
    BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
):
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    total = tl.zeros([BLOCK_E], tl.int32)
    for c in range(num_chunks):
        total += tl.load(counts_ptr + c * num_experts + e, mask=e_ok, other=0)
    padded = tl.cdiv(total, block_m) * block_m
    ends = tl.cumsum(padded, axis=0)
    running = ends - padded  # each expert's first row, advanced chunk by chunk
    for c in range(num_chunks):
        tl.store(offsets_ptr + c * num_experts + e, running, mask=e_ok)
        running += tl.load(counts_ptr + c * num_experts + e, mask=e_ok, other=0)
    used = tl.sum(padded, axis=0)
    tl.store(num_post_pad_ptr, used)
    for t0 in range(0, num_tiles, BLOCK_T):
        tiles = t0 + tl.arange(0, BLOCK_T)
        first_row = tiles * block_m
        owner = tl.sum(tl.where((ends[None, :] <= first_row[:, None]) & e_ok[None, :], 1, 0), axis=1)
        tl.store(expert_ids_ptr + tiles, tl.where(first_row < used, owner, -1), mask=tiles < num_tiles)


@triton.jit
def _align_scatter_kernel(ids_ptr, offsets_ptr, sorted_ptr, num_pairs, num_experts, CHUNK: tl.constexpr):
    chunk = tl.program_id(0)
    local = tl.arange(0, CHUNK)
    offs = chunk * CHUNK + local
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    ok = (offs < num_pairs) & (ids < num_experts)  # another rank's expert: left out of the sort
    earlier_same = (ids[:, None] == ids[None, :]) & (local[None, :] < local[:, None])
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    base = tl.load(offsets_ptr + chunk * num_experts + ids, mask=ok, other=0)
    tl.store(sorted_ptr + base + rank, offs, mask=ok)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort (token, choice) pairs by expert, each expert's run padded to block_m (see `fused_moe.moe_align_block_size`
    for the outputs). Three launches, no host sync: per-chunk expert histograms; per-chunk starting rows (an exclusive
    scan over experts, then over chunks) and each tile's expert; a stable scatter where a pair's rank inside its chunk
    is the count of earlier pairs of the same expert."""
    flat = topk_ids.flatten()
    if flat.dtype != torch.int32:
        flat = flat.to(torch.int32)
    pairs = flat.numel()
    capacity = pairs + min(num_experts, pairs) * (block_m - 1)
    capacity = triton.cdiv(capacity, block_m) * block_m
    num_tiles = capacity // block_m
    device = flat.device
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_tiles, dtype=torch.int32, device=device)
    num_post_pad = torch.zeros(1, dtype=torch.int32, device=device)
    if not pairs:
        return sorted_ids, expert_ids, num_post_pad
    num_chunks = triton.cdiv(pairs, _ALIGN_CHUNK)
    counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=device)
    offsets = torch.empty_like(counts)
    _align_count_kernel[(num_chunks,)](flat, counts, pairs, num_experts, CHUNK=_ALIGN_CHUNK, BINS=pow2(num_experts + 1))
    _align_offsets_kernel[(1,)](
        counts, offsets, expert_ids, num_post_pad, num_chunks, num_experts, num_tiles, block_m,
        BLOCK_E=pow2(num_experts), BLOCK_T=max(1, 4096 // pow2(num_experts)), num_warps=4,
    )
    _align_scatter_kernel[(num_chunks,)](flat, offsets, sorted_ids, pairs, num_experts, CHUNK=_ALIGN_CHUNK, num_warps=4)
    return sorted_ids, expert_ids, num_post_pad


@triton.jit
def _load_weight_tile(
    w_ptr, s_ptr, expert, rows, scale_rows, kk, mask,
    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    QUANT: tl.constexpr, SCALE_K: tl.constexpr, DTYPE: tl.constexpr,
):
    """[BLOCK_K, BLOCK_N] tile of expert `expert`'s weight (rows = output channels, kk = input channels), dequantized
    to DTYPE: QUANT 0 plain, 1 INT4 packed (8 per int32, lowest nibble first, +8 offset), 2 FP8 with block scales.
    scale_rows: the scale row of each output channel; the scale column is kk // SCALE_K."""
    w_base = w_ptr + expert * stride_we + rows[None, :] * stride_wn
    if QUANT == 0:
        w = tl.load(w_base + kk[:, None] * stride_wk, mask=mask, other=0.0).to(DTYPE)
    else:
        scale = tl.load(
            s_ptr + expert * stride_se + scale_rows[None, :] * stride_sn + (kk // SCALE_K)[:, None] * stride_sk,
            mask=mask, other=0.0,
        ).to(tl.float32)
        if QUANT == 1:
            packed = tl.load(w_base + (kk // 8)[:, None] * stride_wk, mask=mask, other=0)
            w = (((packed >> ((kk % 8) * 4)[:, None]) & 0xF) - 8).to(tl.float32)
        else:
            w = tl.load(w_base + kk[:, None] * stride_wk, mask=mask, other=0.0).to(tl.float32)
        w = (w * scale).to(DTYPE)
    return w


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, s_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_pad_ptr, topk_w_ptr,
    num_pairs, a_row_div, n_out, k_in, up_scale_row0,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_om,
    GATED: tl.constexpr, APPLY_WEIGHT: tl.constexpr,
    QUANT: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
):
    """One row tile (one expert's pairs) x one column tile. GATED: weight rows [0, n_out) are the gate, [n_out, 2 n_out)
    the up projection, and the tile stores silu(gate) * up. Output row = pair index."""
    tile = tl.program_id(0)
    if tile * BLOCK_M >= tl.load(num_post_pad_ptr):
        return
    expert = tl.load(expert_ids_ptr + tile).to(tl.int64)
    pair = tl.load(sorted_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    a_rows = a_ptr + (pair // a_row_div).to(tl.int64)[:, None] * stride_am
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_in
        a = tl.load(a_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = _load_weight_tile(w_ptr, s_ptr, expert, cols, cols // SCALE_N, kk, w_mask, stride_we, stride_wn, stride_wk,
                              stride_se, stride_sn, stride_sk, QUANT, SCALE_K, a.dtype)
        acc += mma(a, w, MODE)
        if GATED:
            w_up = _load_weight_tile(w_ptr, s_ptr, expert, n_out + cols, up_scale_row0 + cols // SCALE_N, kk, w_mask,
                                     stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, QUANT, SCALE_K, a.dtype)
            acc_up += mma(a, w_up, MODE)
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if APPLY_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_rows = out_ptr + pair.to(tl.int64)[:, None] * stride_om
    tl.store(out_rows + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _block_m(pairs: int, num_experts: int) -> int:
    """Row tile: about the expected pairs per expert (decode steps give each expert a handful), at least 16 for tl.dot."""
    return min(64, pow2(pairs / max(num_experts, 1), 16))


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    quant: MoEQuant | None = None,
    other_experts: bool = False,
) -> torch.Tensor:
    """Routed experts: sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]). hidden [T, H] -> [T, H].
    Two grouped GEMM launches over the expert-sorted pairs, then a sum over each token's k rows. `other_experts`:
    ids may name experts of other ranks (ids >= E), whose pairs are skipped."""
    tokens, top_k = topk_ids.shape
    hidden_size = hidden.shape[1]
    num_experts = w13.shape[0]
    inter = w2.shape[2] * (8 if quant is not None and quant.method == "w4a16" else 1)
    if not tokens:
        return torch.zeros(0, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    pairs = tokens * top_k
    block_m = _block_m(pairs, num_experts)
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(topk_ids, num_experts, block_m)
    if quant is None:
        kind, scale_n, scale_k, s13, s2, up_row0 = 0, 1, 1, w13, w2, 0
    elif quant.method == "w4a16":
        kind, scale_n, scale_k, s13, s2, up_row0 = 1, 1, quant.group_size, quant.w13_scale, quant.w2_scale, inter
    else:
        scale_n, scale_k = quant.block_shape
        kind, s13, s2, up_row0 = 2, quant.w13_scale, quant.w2_scale, triton.cdiv(inter, scale_n)
    mode = dot_mode(hidden.dtype)
    common = dict(QUANT=kind, SCALE_N=scale_n, SCALE_K=scale_k, BLOCK_M=block_m, BLOCK_K=64, MODE=mode, num_warps=4)
    num_tiles = expert_ids.numel()
    intermediate = torch.empty(pairs, inter, dtype=hidden.dtype, device=hidden.device)
    _moe_gemm_kernel[(num_tiles, triton.cdiv(inter, 64))](
        hidden, w13, s13, intermediate, sorted_ids, expert_ids, num_post_pad, topk_weights,
        pairs, top_k, inter, hidden_size, up_row0,
        hidden.stride(0), *w13.stride(), *s13.stride(), intermediate.stride(0),
        GATED=True, APPLY_WEIGHT=False, BLOCK_N=64, **common,
    )
    # pairs of another rank's expert are never written: zeros, so they add nothing to their token's sum
    per_pair = (torch.zeros if other_experts else torch.empty)(pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    weights = topk_weights.reshape(-1)
    if weights.dtype != torch.float32:
        weights = weights.float()
    _moe_gemm_kernel[(num_tiles, triton.cdiv(hidden_size, 64))](
        intermediate, w2, s2, per_pair, sorted_ids, expert_ids, num_post_pad, weights,
        pairs, 1, hidden_size, inter, 0,
        intermediate.stride(0), *w2.stride(), *s2.stride(), per_pair.stride(0),
        GATED=False, APPLY_WEIGHT=True, BLOCK_N=64, **common,
    )
    return per_pair.view(tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
