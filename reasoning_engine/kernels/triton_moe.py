"""Triton mixture-of-experts: the noaux_tc router, the token-to-expert sort with block alignment, and two grouped GEMMs
(gate_up with SiLU(gate) * up fused into its epilogue; down with the routing weight applied), for plain, W4A16 INT4
and block-FP8 expert weights. Same signatures and weight layouts as `fused_moe.py`.

The grouped GEMM follows the MegaBlocks idea (Gale et al., 2023, "MegaBlocks: Efficient Sparse Training with
Mixture-of-Experts"): (token, choice) pairs are sorted by expert and each expert's run is padded to the row tile, so
every row tile of the GEMM belongs to exactly one expert and reads only that expert's weights. Quantized weights are
dequantized in registers as in Frantar et al., 2024, "MARLIN": only the packed bytes cross the memory bus, INT4 codes
become floats through the exponent (two per 32-bit operation) and take their group's scale there, two weights per
paired 16-bit multiply (rounded once, as the reference's dequantisation is), so a K step of 128 channels holds
several groups and is one MMA whose fixed cost (barriers; on Blackwell the tensor-memory round trip) is spread over
8 KB of packed weights per 128 rows. MXFP4 e2m1 codes take the same path: their bits placed into a bfloat16's sign,
exponent and mantissa fields, then scaled by paired multiplies. FP8 steps are one scale group each, whose scale
multiplies the step's product. The weights are the MMA's M side, so decode's few pairs per expert do not repeat one
product in every warp, and a launch too small to fill the GPU is split over K in fixed spans whose partial sums a
second kernel adds in span order (the bits do not depend on the split). Every pair writes its own output row and the k
rows of a token are summed afterwards, so results do not depend on scheduling (no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reasoning_engine.kernels._triton_utils import dot_mode, mma, num_warps_for, pow2
from reasoning_engine.kernels.fused_moe import MoEQuant, shared_expert

_ALIGN_CHUNK = 128  # pairs per program of the sort; the rank inside a chunk costs CHUNK^2 comparisons
_SCAN_EXPERTS = 32  # experts per program of the scan over chunks (Kimi's 384: 12 programs)
_SCAN_CHUNKS = 64  # chunks per step of that scan: a 16k-token prefill (1,024 chunks) takes 16 steps
_SPLIT_SPAN = 512  # input channels per split-K span: a result's bits depend on this and on K alone
_FUSED_SHARED_TOKENS = 64  # up to this many tokens the combine kernel runs the shared expert's down projection itself
_BUSY_PROGRAMS = 4 * 132  # programs a decode GEMM launch aims for: 4 per H200 SM, since the row tiles counted are a
# bound (with expert parallelism most may hold another rank's experts and return at once)


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


def noaux_tc_route_and_sort(
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """`noaux_tc_router`, and for a step with few tokens also the pairs sorted for `fused_moe` over `num_experts`
    stacked experts (its `sorted_pairs`), all in one launch (`_route_and_sort_kernel`); for more tokens the router
    alone (the sort is then `fused_moe`'s)."""
    tokens, experts = router_logits.shape
    pairs = tokens * top_k
    block_g, block_j, block_k = pow2(n_group), pow2(experts // n_group), pow2(top_k)
    block_e = pow2(num_experts + 1)
    if (not tokens or experts != num_experts
            or pow2(tokens, 2) * block_g * block_j > _ONE_PROGRAM_CELLS
            or not _one_program_sort_fits(pow2(tokens, 2) * block_k, block_e)):
        return (*noaux_tc_router(router_logits, e_score_correction_bias, top_k, n_group, topk_group, norm_topk_prob,
                                 routed_scaling_factor), None)
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    device = router_logits.device
    block_m = _block_m(pairs, num_experts)
    capacity = triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    expert_ids = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    num_post_pad = torch.empty(1, dtype=torch.int32, device=device)
    block_t = pow2(tokens, 2)  # a row of one token leaves [1, groups, experts] tiles that spill on sm_90 / sm_100
    block_p = block_t * block_k
    _route_and_sort_kernel[(1,)](
        router_logits, e_score_correction_bias, weights, ids, sorted_ids, expert_ids, num_post_pad,
        tokens, router_logits.stride(0), experts, experts // n_group, float(routed_scaling_factor), capacity,
        capacity // block_m, block_m,
        TOP_K=top_k, N_GROUP=n_group, TOPK_GROUP=topk_group, NORM=norm_topk_prob, BLOCK_T=block_t,
        BLOCK_G=block_g, BLOCK_J=block_j, BLOCK_K=block_k, BLOCK_E=block_e, **_sort_blocks(block_p, block_e),
        num_warps=8 if block_t * block_g * block_j >= 2048 else 4,
    )
    return weights, ids, (sorted_ids, expert_ids, num_post_pad)


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, CHUNK: tl.constexpr, BINS: tl.constexpr):
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=num_experts)  # past the end: the spare bin E
    hist = tl.histogram(tl.minimum(ids, num_experts), BINS)  # another rank's expert: the spare bin too
    bins = tl.arange(0, BINS)
    tl.store(counts_ptr + chunk * num_experts + bins, hist, mask=bins < num_experts)


@triton.jit
def _align_scan_kernel(counts_ptr, offsets_ptr, totals_ptr, num_chunks, num_experts, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr):
    """For BLOCK_E experts: each chunk's first row within the expert's run (an exclusive scan over chunks, BLOCK_C
    chunks per step) and the expert's total."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    carry = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        at = c[:, None] * num_experts + e[None, :]
        ok = (c < num_chunks)[:, None] & e_ok[None, :]
        counts = tl.load(counts_ptr + at, mask=ok, other=0)
        tl.store(offsets_ptr + at, carry[None, :] + tl.cumsum(counts, axis=0) - counts, mask=ok)
        carry += tl.sum(counts, axis=0)
    tl.store(totals_ptr + e, carry, mask=e_ok)


@triton.jit
def _align_experts_kernel(
    totals_ptr, starts_ptr, expert_ids_ptr, num_post_pad_ptr, num_experts, num_tiles, block_m,
    BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Each expert's first row (its run padded to block_m) and the expert of each of BLOCK_T row tiles (-1 past the
    last used row); every program recomputes the scan over the experts' totals, program 0 also stores it."""
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    total = tl.load(totals_ptr + e, mask=e_ok, other=0)
    padded = tl.cdiv(total, block_m) * block_m
    ends = tl.cumsum(padded, axis=0)
    used = tl.sum(padded, axis=0)
    if tl.program_id(0) == 0:
        tl.store(starts_ptr + e, ends - padded, mask=e_ok)
        tl.store(num_post_pad_ptr, used)
    tiles = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    first_row = tiles * block_m
    owner = tl.sum(tl.where((ends[None, :] <= first_row[:, None]) & e_ok[None, :], 1, 0), axis=1)
    tl.store(expert_ids_ptr + tiles, tl.where(first_row < used, owner, -1), mask=tiles < num_tiles)


@triton.jit
def _align_scatter_kernel(ids_ptr, starts_ptr, offsets_ptr, sorted_ptr, num_pairs, num_experts, CHUNK: tl.constexpr):
    chunk = tl.program_id(0)
    local = tl.arange(0, CHUNK)
    offs = chunk * CHUNK + local
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    ok = (offs < num_pairs) & (ids < num_experts)  # another rank's expert: left out of the sort
    earlier_same = (ids[:, None] == ids[None, :]) & (local[None, :] < local[:, None])
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    base = tl.load(starts_ptr + ids, mask=ok, other=0) + tl.load(offsets_ptr + chunk * num_experts + ids, mask=ok, other=0)
    tl.store(sorted_ptr + base + rank, offs, mask=ok)


@triton.jit
def _sort_pairs(ids, pair, p_ok, sorted_ptr, expert_ids_ptr, num_post_pad_ptr, num_pairs, num_experts, capacity,
                num_tiles, block_m, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_TL: tl.constexpr):
    """The whole sort of the pairs held in registers (ids [BLOCK_P] of pairs `pair`, `p_ok` the real ones) by one
    program: every output slot is written (the pair that lands there, or the sentinel), so nothing is allocated
    filled beforehand. A pair's slot is its expert's first row plus the count of earlier pairs of the same expert;
    each slot finds its pair by comparison (a gather, no scatter, so no ordering between writes is needed)."""
    ids = tl.where(p_ok, tl.minimum(ids, num_experts), num_experts)  # another rank's expert: the spare bin E
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    member = ids[None, :] == e[:, None]  # [BLOCK_E, BLOCK_P]
    padded = tl.where(e_ok, tl.cdiv(tl.sum(member.to(tl.int32), axis=1), block_m) * block_m, 0)
    ends = tl.cumsum(padded, axis=0)
    used = tl.sum(padded, axis=0)
    start = tl.sum(tl.where(member, (ends - padded)[:, None], 0), axis=0)
    rank = tl.sum(((ids[:, None] == ids[None, :]) & (pair[None, :] < pair[:, None])).to(tl.int32), axis=1)
    slot = tl.where(p_ok & (ids < num_experts), start + rank, -1)
    for s0 in range(0, capacity, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        hit = slot[None, :] == s[:, None]  # [BLOCK_S, BLOCK_P]
        at = tl.sum(tl.where(hit, pair[None, :], 0), axis=1)
        tl.store(sorted_ptr + s, tl.where(tl.max(hit.to(tl.int32), axis=1) > 0, at, num_pairs), mask=s < capacity)
    for t0 in range(0, num_tiles, BLOCK_TL):
        tiles = t0 + tl.arange(0, BLOCK_TL)
        first_row = tiles * block_m
        owner = tl.sum(tl.where((ends[None, :] <= first_row[:, None]) & e_ok[None, :], 1, 0), axis=1)  # [BLOCK_TL, BLOCK_E]
        tl.store(expert_ids_ptr + tiles, tl.where(first_row < used, owner, -1), mask=tiles < num_tiles)
    tl.store(num_post_pad_ptr, used)


@triton.jit
def _align_one_program_kernel(
    ids_ptr, sorted_ptr, expert_ids_ptr, num_post_pad_ptr, num_pairs, num_experts, capacity, num_tiles, block_m,
    BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_TL: tl.constexpr,
):
    """The sort of a decode or verification step's few pairs in one program (`_sort_pairs`)."""
    p = tl.arange(0, BLOCK_P)
    p_ok = p < num_pairs
    ids = tl.load(ids_ptr + p, mask=p_ok, other=num_experts)
    _sort_pairs(ids, p, p_ok, sorted_ptr, expert_ids_ptr, num_post_pad_ptr, num_pairs, num_experts, capacity,
                num_tiles, block_m, BLOCK_E, BLOCK_S, BLOCK_TL)


@triton.jit
def _route_and_sort_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, sorted_ptr, expert_ids_ptr, num_post_pad_ptr,
    tokens, stride_logits, num_experts, group_size, routed_scaling_factor, capacity, num_tiles, block_m,
    TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_TL: tl.constexpr,
):
    """noaux_tc routing of all of a small step's tokens at once (`_router_kernel`'s choice, a token per row of
    [tokens, groups, experts of a group] tiles), then the sort of their pairs (`_sort_pairs`) from registers: the
    whole bookkeeping between the router's matmul and the expert GEMMs in one launch."""
    t = tl.arange(0, BLOCK_T)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_J)
    t_ok = t < tokens
    expert = g[None, :, None] * group_size + j[None, None, :]  # [1, BLOCK_G, BLOCK_J]
    e_ok = (g < N_GROUP)[None, :, None] & (j < group_size)[None, None, :]
    ok = t_ok[:, None, None] & e_ok
    logits = tl.load(logits_ptr + t.to(tl.int64)[:, None, None] * stride_logits + expert, mask=ok, other=0.0)
    scores = tl.sigmoid(logits.to(tl.float32))
    biased = tl.where(ok, scores + tl.load(bias_ptr + expert, mask=e_ok, other=0.0).to(tl.float32), float("-inf"))
    # group score = sum of the two best biased scores of the group (ties: the first best is removed, the second kept)
    best = tl.max(biased, axis=2)
    best_j = tl.min(tl.where(biased == best[:, :, None], j[None, None, :], BLOCK_J), axis=2)
    second = tl.max(tl.where(j[None, None, :] == best_j[:, :, None], float("-inf"), biased), axis=2)
    group_score = tl.where((g < N_GROUP)[None, :], best + second, float("-inf"))  # [BLOCK_T, BLOCK_G]
    kept = tl.zeros([BLOCK_T, BLOCK_G], tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        top = tl.max(group_score, axis=1)
        pick = tl.min(tl.where(group_score == top[:, None], g[None, :], BLOCK_G), axis=1)
        kept = tl.where(g[None, :] == pick[:, None], 1, kept)
        group_score = tl.where(g[None, :] == pick[:, None], float("-inf"), group_score)
    choice = tl.reshape(tl.where(kept[:, :, None] != 0, biased, float("-inf")), (BLOCK_T, BLOCK_G * BLOCK_J))
    flat_scores = tl.reshape(scores, (BLOCK_T, BLOCK_G * BLOCK_J))
    idx = tl.arange(0, BLOCK_G * BLOCK_J)  # increases with the expert id: ties go to the lower id, as in the reference
    ks = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    weights = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    for jj in tl.static_range(TOP_K):
        top = tl.max(choice, axis=1)
        pick = tl.min(tl.where(choice == top[:, None], idx[None, :], BLOCK_G * BLOCK_J), axis=1)
        ids = tl.where(ks[None, :] == jj, ((pick // BLOCK_J) * group_size + pick % BLOCK_J)[:, None], ids)
        chosen = tl.sum(tl.where(idx[None, :] == pick[:, None], flat_scores, 0.0), axis=1)
        weights = tl.where(ks[None, :] == jj, chosen[:, None], weights)
        choice = tl.where(idx[None, :] == pick[:, None], float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    pair = t[:, None] * TOP_K + ks[None, :]
    pair_ok = t_ok[:, None] & (ks < TOP_K)[None, :]
    tl.store(weights_ptr + pair, weights * routed_scaling_factor, mask=pair_ok)
    tl.store(ids_ptr + pair, ids, mask=pair_ok)
    _sort_pairs(tl.reshape(ids, (BLOCK_T * BLOCK_K,)), tl.reshape(pair, (BLOCK_T * BLOCK_K,)),
                tl.reshape(pair_ok, (BLOCK_T * BLOCK_K,)), sorted_ptr, expert_ids_ptr, num_post_pad_ptr,
                tokens * TOP_K, num_experts, capacity, num_tiles, block_m, BLOCK_E, BLOCK_S, BLOCK_TL)


_ONE_PROGRAM_CELLS = 1 << 16  # the one-program sort holds a [experts, pairs] comparison: up to this many cells
_ONE_PROGRAM_PAIRS = 256  # and a [pairs, pairs] one
_ONE_PROGRAM_HELD = 3 << 15  # and both together (gpt-oss at 64 tokens, 256 x 256 twice, spills on sm_90 / sm_100)


def _one_program_sort_fits(block_p: int, block_e: int) -> bool:
    """Whether `_sort_pairs`' register tiles for `block_p` pairs over `block_e` experts compile without spills."""
    return (block_p * block_e <= _ONE_PROGRAM_CELLS and block_p <= _ONE_PROGRAM_PAIRS
            and block_p * (block_p + block_e) <= _ONE_PROGRAM_HELD)


def _sort_blocks(block_p: int, block_e: int) -> dict[str, int]:
    """`_sort_pairs`' steps: output slots (each compared with every pair) and row tiles (with every expert) at a time,
    about 2,048 comparisons a step (register tiles, no spills)."""
    return {"BLOCK_S": max(16, 2048 // block_p), "BLOCK_TL": max(16, 2048 // block_e)}


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort (token, choice) pairs by expert, each expert's run padded to block_m (see `fused_moe.moe_align_block_size`
    for the outputs). No host sync. A step with few pairs (decode, verification) takes one launch
    (`_align_one_program_kernel`); otherwise four, none serial over the pairs: per-chunk expert histograms; per
    expert, an exclusive scan over the chunks (parallel over experts); the experts' starting rows and each tile's
    expert (parallel over tiles); a stable scatter where a pair's rank inside its chunk is the count of earlier pairs
    of the same expert."""
    flat = topk_ids.flatten()
    if flat.dtype != torch.int32:
        flat = flat.to(torch.int32)
    pairs = flat.numel()
    capacity = pairs + min(num_experts, pairs) * (block_m - 1)
    capacity = triton.cdiv(capacity, block_m) * block_m
    num_tiles = capacity // block_m
    device = flat.device
    block_p, block_e = pow2(pairs), pow2(num_experts + 1)
    if pairs and _one_program_sort_fits(block_p, block_e):
        sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
        expert_ids = torch.empty(num_tiles, dtype=torch.int32, device=device)
        num_post_pad = torch.empty(1, dtype=torch.int32, device=device)
        _align_one_program_kernel[(1,)](
            flat, sorted_ids, expert_ids, num_post_pad, pairs, num_experts, capacity, num_tiles, block_m,
            BLOCK_P=block_p, BLOCK_E=block_e, **_sort_blocks(block_p, block_e),
            num_warps=8 if block_e > block_p and block_p * block_e >= 16384 else 4,  # a wide [experts, pairs] comparison
        )
        return sorted_ids, expert_ids, num_post_pad
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_tiles, dtype=torch.int32, device=device)
    num_post_pad = torch.zeros(1, dtype=torch.int32, device=device)
    if not pairs:
        return sorted_ids, expert_ids, num_post_pad
    num_chunks = triton.cdiv(pairs, _ALIGN_CHUNK)
    counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=device)
    offsets = torch.empty_like(counts)
    totals = torch.empty(num_experts, dtype=torch.int32, device=device)
    starts = torch.empty_like(totals)
    _align_count_kernel[(num_chunks,)](flat, counts, pairs, num_experts, CHUNK=_ALIGN_CHUNK, BINS=pow2(num_experts + 1))
    _align_scan_kernel[(triton.cdiv(num_experts, _SCAN_EXPERTS),)](
        counts, offsets, totals, num_chunks, num_experts, BLOCK_C=_SCAN_CHUNKS, BLOCK_E=_SCAN_EXPERTS, num_warps=4,
    )
    block_e = pow2(num_experts)
    block_t = max(1, 4096 // block_e)
    _align_experts_kernel[(triton.cdiv(num_tiles, block_t),)](
        totals, starts, expert_ids, num_post_pad, num_experts, num_tiles, block_m,
        BLOCK_E=block_e, BLOCK_T=block_t, num_warps=4,
    )
    _align_scatter_kernel[(num_chunks,)](flat, starts, offsets, sorted_ids, pairs, num_experts, CHUNK=_ALIGN_CHUNK, num_warps=4)
    return sorted_ids, expert_ids, num_post_pad


@triton.jit
def _round_to_bfloat16(x):
    """float32 -> bfloat16 rounded to nearest even, as the GPU's bfloat16 multiply rounds (the interpreter's own
    cast does not): on the bits, for finite values."""
    bits = x.to(tl.int32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _paired_halves(low, high):
    """[R, W, 4] values of nibbles j (`low`) and j + 4 (`high`) of W words -> [R, 8 W] in the paired order
    `_int4_order` gives the activations: position 8 w + 2 j + h holds the value of nibble j + 4 h of word w."""
    rows: tl.constexpr = low.shape[0]
    words: tl.constexpr = low.shape[1]
    values = tl.reshape(tl.join(low, high), (rows, words // 4, 4, 2, 2, 2))
    return tl.reshape(tl.permute(values, (0, 1, 3, 4, 2, 5)), (rows, words * 8))


@triton.jit
def _int4_to_float(words, scales, DTYPE: tl.constexpr, MODE: tl.constexpr):
    """[R, W] int32 words of eight INT4 codes (lowest nibble first, stored as q + 8) and [R, W] scales (each word's
    group's) -> [R, 8 W] DTYPE weights q * scale, each rounded once to DTYPE as the torch reference's dequantisation
    is. No integer-to-float conversion: each code is ORed into the mantissa of a float whose exponent makes one
    mantissa step 1 (bf16 128, fp16 1024, fp32 2^23), then the exponent's value and the +8 are subtracted, exactly.
    16-bit types take two codes per 32-bit operation (nibbles j and j + 4 land in the two halves of one word, and
    both halves are scaled by one paired multiply), so their inputs come out in `_paired_halves`' order, which
    `_int4_order` gives the activations. float32 keeps the natural order. MODE "widen"
    (bfloat16 in Triton's CPU interpreter, which computes on bfloat16's raw bits) computes in float32 and rounds the
    product to bfloat16: the same bits."""
    if DTYPE == tl.float32:
        codes = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
        values = ((codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * scales.to(tl.float32)[:, :, None]
        values = tl.reshape(values, (words.shape[0], words.shape[1] * 8))
    else:
        magic: tl.constexpr = 0x43004300 if DTYPE == tl.bfloat16 else 0x64006400
        bias: tl.constexpr = 136.0 if DTYPE == tl.bfloat16 else 1032.0
        halves = ((words[:, :, None] >> (tl.arange(0, 4) * 4)[None, None, :]) & 0x000F000F) | magic
        low = (halves & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True)
        high = (halves >> 16).to(tl.int16).to(DTYPE, bitcast=True)
        if MODE == "widen":
            scale = scales.to(tl.float32)[:, :, None]
            low = _round_to_bfloat16((low.to(tl.float32) - bias) * scale)
            high = _round_to_bfloat16((high.to(tl.float32) - bias) * scale)
        else:
            scale = scales.to(DTYPE)[:, :, None]
            low, high = (low - bias) * scale, (high - bias) * scale
        values = _paired_halves(low, high)
    return values


@triton.jit
def _exp2_int(e):
    """2^e as float32 for integer tensors e, exactly (subnormals included, 0 below 2^-149, inf above 2^127): built
    from the bits, so no approximate exp2 and no flushing."""
    normal = (tl.minimum(tl.maximum(e, -126), 128) + 127) << 23
    tiny = 1 << tl.minimum(tl.maximum(e + 149, 0), 22)
    bits = tl.where(e >= -126, normal, tl.where(e >= -149, tiny, 0))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_value(codes):
    """int32 e2m1 codes (sign, 2 exponent bits, 1 mantissa bit; exponent 0 is subnormal: 0 or 0.5) -> float32."""
    exponent = (codes >> 1) & 3
    mantissa = (codes & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa, (1.0 + 0.5 * mantissa) * _exp2_int(exponent - 1))
    return tl.where((codes & 8) != 0, -magnitude, magnitude)


@triton.jit
def _e2m1_bits(words):
    """[R, W] int32 words of eight e2m1 codes (lowest nibble first) -> [R, W, 4] int32 pairs of bfloat16 bit
    patterns: half h of pair j holds code j + 4 h with its sign in the sign bit and its exponent and mantissa bits in
    the lowest two exponent bits and the top mantissa bit, which reads as the code's value times 2^-126 (exponent 0
    is subnormal in both formats)."""
    # code j in bits 0-3, code j + 4 in 16-19 (a logical shift: each shift pair below folds into one)
    halves = words.to(tl.uint32, bitcast=True)[:, :, None] >> (tl.arange(0, 4) * 4).to(tl.uint32)[None, None, :]
    bits = ((halves << 6) & 0x01C001C0) | ((halves << 12) & 0x80008000)
    return bits.to(tl.int32, bitcast=True)


@triton.jit
def _mxfp4_to_float(words, scales, DTYPE: tl.constexpr, MODE: tl.constexpr):
    """[R, W] int32 words of eight e2m1 codes (lowest nibble first) and [R, G] uint8 e8m0 scales of the W / G words'
    groups -> [R, 8 W] DTYPE weights code * 2^(scale - 127), in `_int4_to_float`'s order, each exactly the torch
    reference's dequantised weight. bfloat16: no conversion, two codes per 32-bit operation (`_e2m1_bits`), then two
    paired multiplies, by 2^126 (the codes' values) and by the group's 2^(scale - 127) (each exact: at most two
    significant bits); the interpreter ("widen") multiplies the same bits in float32. float16 and float32 compute
    the values in float32 and round once."""
    rows: tl.constexpr = words.shape[0]
    groups: tl.constexpr = scales.shape[1]
    per_group: tl.constexpr = words.shape[1] // groups
    factor = _exp2_int(scales.to(tl.int32) - 127)
    factor = tl.reshape(tl.broadcast_to(factor[:, :, None], (rows, groups, per_group)), (rows, words.shape[1]))
    factor = factor[:, :, None]
    if DTYPE == tl.bfloat16:
        bits = _e2m1_bits(words)
        if MODE == "widen":
            low = _round_to_bfloat16((bits << 16).to(tl.float32, bitcast=True) * 8.507059173023462e37 * factor)
            high = _round_to_bfloat16((bits & -65536).to(tl.float32, bitcast=True) * 8.507059173023462e37 * factor)
        else:
            # 2^126 first, a constant: the compiler then keeps each word as a pair of bfloat16 (paired multiplies)
            scale = factor.to(tl.bfloat16)
            low = (bits & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True) * 8.507059173023462e37 * scale
            high = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True) * 8.507059173023462e37 * scale
        values = _paired_halves(low, high)
    elif DTYPE == tl.float32:
        codes = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
        values = tl.reshape(_e2m1_value(codes) * factor, (rows, words.shape[1] * 8))
    else:
        halves = words[:, :, None] >> (tl.arange(0, 4) * 4)[None, None, :]
        low = (_e2m1_value(halves & 0xF) * factor).to(DTYPE)
        high = (_e2m1_value((halves >> 16) & 0xF) * factor).to(DTYPE)
        values = _paired_halves(low, high)
    return values


@triton.jit
def _int4_order(a):
    """[STEP, M] activations in input-channel order -> the rows permuted into `_int4_to_float`'s order for 16-bit
    types (unchanged for float32): within each 32 channels, position p4 p3 p2 p1 p0 (bits) holds channel
    p2 p1 p0 p4 p3, i.e. each group of 8 positions takes the same two nibbles of 4 consecutive words. Loaded in
    natural order (wide loads), permuted in registers."""
    if a.dtype != tl.float32:
        steps: tl.constexpr = a.shape[0] // 32
        bits = tl.reshape(a, (steps, 2, 2, 2, 2, 2, a.shape[1]))  # channel bits k4 k3 k2 k1 k0
        a = tl.reshape(tl.permute(bits, (0, 4, 5, 1, 2, 3, 6)), (a.shape[0], a.shape[1]))
    return a


@triton.jit
def _step_scales(s_base, k0, k_in, row_ok, stride_sk, SCALE_K: tl.constexpr, STEP: tl.constexpr,
                 EVEN_K: tl.constexpr):
    """[R, G] scales of the G groups of input channels k0 .. k0 + STEP (one when a group spans several steps) of the
    rows whose scales start at `s_base` ([R] pointers)."""
    GROUPS: tl.constexpr = STEP // SCALE_K if SCALE_K < STEP else 1
    groups = k0 // SCALE_K + tl.arange(0, GROUPS)
    s_ok = row_ok[:, None] if EVEN_K else row_ok[:, None] & (groups < tl.cdiv(k_in, SCALE_K))[None, :]
    return tl.load(s_base[:, None] + groups[None, :] * stride_sk, mask=s_ok, other=0)


@triton.jit
def _weight_step(
    w_base, scales, k0, k_in, row_ok, stride_wk,
    QUANT: tl.constexpr, STEP: tl.constexpr, EVEN_K: tl.constexpr, DTYPE: tl.constexpr, MODE: tl.constexpr,
):
    """[R, STEP] weights of the rows at `w_base` ([R, 1] pointers), input channels k0 .. k0 + STEP, in DTYPE: QUANT 0
    plain, 1 INT4 codes times their group's scale (`scales` [R, G], `_step_scales`), 2 FP8 values, 3 MXFP4 e2m1
    codes times their group's e8m0 scale (`scales` [R, G] uint8); INT4 and MXFP4 in `_int4_order` (both pack eight
    codes per int32 word, lowest nibble first). Only the packed bytes are loaded; FP8 scales multiply the product."""
    if QUANT == 1 or QUANT == 3:
        words = k0 // 8 + tl.arange(0, STEP // 8)
        ok = row_ok[:, None] if EVEN_K else row_ok[:, None] & (words < k_in // 8)[None, :]
        packed = tl.load(w_base + words[None, :] * stride_wk, mask=ok, other=0)
        if QUANT == 1:
            GROUPS: tl.constexpr = scales.shape[1]
            per_word = tl.reshape(tl.broadcast_to(scales[:, :, None], (scales.shape[0], GROUPS, STEP // 8 // GROUPS)),
                                  (scales.shape[0], STEP // 8))
            w = _int4_to_float(packed, per_word, DTYPE, MODE)
        else:
            w = _mxfp4_to_float(packed, scales, DTYPE, MODE)
    else:
        kk = k0 + tl.arange(0, STEP)
        ok = row_ok[:, None] if EVEN_K else row_ok[:, None] & (kk < k_in)[None, :]
        w = tl.load(w_base + kk[None, :] * stride_wk, mask=ok, other=0.0).to(DTYPE)
    return w


@triton.jit
def _gemm_step(span_acc, a_ptr, a_cols, pair_ok, w_base, s_base, row_ok, k0, k_in, stride_wk, stride_sk,
               QUANT: tl.constexpr, SCALE_K: tl.constexpr, STEP: tl.constexpr, EVEN_K: tl.constexpr,
               MODE: tl.constexpr):
    """`span_acc` plus one STEP of input channels from k0: weights [R, STEP] (`_weight_step`) times the pairs'
    activations [STEP, M]; EVEN_K: the step is whole (no masks on K)."""
    kk = k0 + tl.arange(0, STEP)
    a_ok = pair_ok[None, :] if EVEN_K else pair_ok[None, :] & (kk < k_in)[:, None]
    a = tl.load(a_ptr + a_cols + kk[:, None], mask=a_ok, other=0.0)
    scales = 0
    if QUANT == 1 or QUANT == 3:
        a = _int4_order(a)
        scales = _step_scales(s_base, k0, k_in, row_ok, stride_sk, SCALE_K, STEP, EVEN_K)
    w = _weight_step(w_base, scales, k0, k_in, row_ok, stride_wk, QUANT, STEP, EVEN_K, a.dtype, MODE)
    if QUANT != 2:  # plain, or INT4 and MXFP4 already scaled
        span_acc += mma(w, a, MODE)
    else:
        scale = tl.load(s_base + (k0 // SCALE_K) * stride_sk, mask=row_ok, other=0.0).to(tl.float32)
        span_acc += mma(w, a, MODE) * scale[:, None]
    return span_acc


@triton.jit
def _moe_epilogue(gate, up, bias_ptr, topk_w_ptr, pair, pair_ok, cols, col_ok, n_out,
                  GATED: tl.constexpr, APPLY_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU_LIMIT: tl.constexpr,
                  SILU_LIMIT: tl.constexpr = 0.0):
    """Bias, activation and routing weight on [BLOCK_N channels, pairs] float32 sums (gate and up for GATED): shared
    by the GEMM and the split-K reduction, so both give the same bits. bias_ptr: the expert's bias row."""
    if HAS_BIAS:
        gate += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        if GATED:
            up += tl.load(bias_ptr + n_out + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    if GATED:
        if SWIGLU_LIMIT > 0:
            gate = tl.minimum(gate, SWIGLU_LIMIT)
            up = tl.minimum(tl.maximum(up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
            gate = gate * tl.sigmoid(1.702 * gate) * (up + 1.0)
        elif SILU_LIMIT > 0:  # DeepSeek-V4: both clamped, then silu(gate) * up
            gate = tl.minimum(gate, SILU_LIMIT)
            up = tl.minimum(tl.maximum(up, -SILU_LIMIT), SILU_LIMIT)
            gate = gate * tl.sigmoid(gate) * up
        else:
            gate = gate * tl.sigmoid(gate) * up
    if APPLY_WEIGHT:
        gate = gate * tl.load(topk_w_ptr + pair, mask=pair_ok, other=0.0).to(tl.float32)[None, :]
    return gate


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, s_ptr, b_ptr, out_ptr, part_ptr, sorted_ptr, expert_ids_ptr, num_post_pad_ptr, topk_w_ptr,
    num_pairs, a_row_div, n_out, k_in, up_scale_row0,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_be, stride_om, stride_ps,
    GATED: tl.constexpr, APPLY_WEIGHT: tl.constexpr,
    QUANT: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEP: tl.constexpr, SPAN: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, MODE: tl.constexpr, HAS_BIAS: tl.constexpr = False, SWIGLU_LIMIT: tl.constexpr = 0.0,
    SILU_LIMIT: tl.constexpr = 0.0, EVEN_N: tl.constexpr = False, SCALE_ALIGN: tl.constexpr = 1,
):
    """One row tile (BLOCK_M pairs of one expert) x BLOCK_N output channels x (SPLIT) one SPAN of input channels.

    Computed transposed, weights x activations^T (the weight rows are the MMA's M side, 2 BLOCK_N rows for GATED: the
    gate's then the up's), so decode's few pairs per expert are the narrow N side and the warps split the weight rows
    instead of repeating one product. Each STEP of input channels is one MMA: INT4 weights arrive scaled
    (`_weight_step`); an FP8 or MXFP4 step is one scale group, whose unscaled product is scaled per weight row and
    added. Sums run span by span ((0 + span 0) + span 1) + ..., so with SPLIT (one program per span, float32 partial
    sums stored at part_ptr [span, pair, weight row] and added in span order by `_moe_split_reduce_kernel`) a pair's
    result has the same bits as without. Without SPLIT the epilogue runs
    here: GATED stores silu(gate) * up (gpt-oss: the clamped SwiGLU), HAS_BIAS adds the expert's bias first,
    APPLY_WEIGHT multiplies by the routing weight; output row = pair index."""
    tile = tl.program_id(0)
    if tile * BLOCK_M >= tl.load(num_post_pad_ptr):
        return
    expert = tl.load(expert_ids_ptr + tile).to(tl.int64)
    pair = tl.load(sorted_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pair < num_pairs
    a_cols = (pair // a_row_div).to(tl.int64)[None, :] * stride_am
    ROWS: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    r = tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_N + r % BLOCK_N
    row_ok = tl.full([ROWS], 1, tl.int1) if EVEN_N else cols < n_out  # constant: the weight loads go unmasked
    is_up = r >= BLOCK_N
    w_rows = tl.where(is_up, n_out + cols, cols)
    w_base = w_ptr + expert * stride_we + w_rows.to(tl.int64)[:, None] * stride_wn
    s_base = s_ptr + expert * stride_se + tl.where(is_up, up_scale_row0 + cols // SCALE_N, cols // SCALE_N) * stride_sn
    s_base = tl.multiple_of(s_base, SCALE_ALIGN)  # bytes: a row's scales of one step load as one vector
    if SPLIT:
        first_span = tl.program_id(2)
        last_span = first_span + 1
    else:
        first_span = 0
        last_span = tl.cdiv(k_in, SPAN)
    acc = tl.zeros([ROWS, BLOCK_M], tl.float32)
    for span in range(first_span, last_span):
        span_acc = tl.zeros([ROWS, BLOCK_M], tl.float32)
        span_end = tl.minimum(span * SPAN + SPAN, k_in)
        if EVEN_K or QUANT != 3:
            for k0 in range(span * SPAN, span_end, STEP):
                span_acc = _gemm_step(span_acc, a_ptr, a_cols, pair_ok, w_base, s_base, row_ok, k0, k_in, stride_wk,
                                      stride_sk, QUANT, SCALE_K, STEP, EVEN_K, MODE)
        else:  # MXFP4 (K a multiple of 32): whole steps without masks on K, then the partial last one
            whole_end = span * SPAN + (span_end - span * SPAN) // STEP * STEP
            for k0 in range(span * SPAN, whole_end, STEP):
                span_acc = _gemm_step(span_acc, a_ptr, a_cols, pair_ok, w_base, s_base, row_ok, k0, k_in, stride_wk,
                                      stride_sk, QUANT, SCALE_K, STEP, True, MODE)
            if whole_end < span_end:
                span_acc = _gemm_step(span_acc, a_ptr, a_cols, pair_ok, w_base, s_base, row_ok, whole_end, k_in,
                                      stride_wk, stride_sk, QUANT, SCALE_K, STEP, False, MODE)
        acc += span_acc
    if SPLIT:
        part = part_ptr + tl.program_id(2).to(tl.int64) * stride_ps + pair.to(tl.int64)[None, :] * (ROWS // BLOCK_N * n_out)
        tl.store(part + w_rows[:, None], acc, mask=row_ok[:, None] & pair_ok[None, :])
    else:
        if GATED:
            gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
        else:
            gate, up = acc, acc
        out_cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = out_cols < n_out
        out = _moe_epilogue(gate, up, b_ptr + expert * stride_be, topk_w_ptr, pair, pair_ok, out_cols, col_ok, n_out,
                            GATED, APPLY_WEIGHT, HAS_BIAS, SWIGLU_LIMIT, SILU_LIMIT)
        out_rows = out_ptr + pair.to(tl.int64)[None, :] * stride_om
        tl.store(out_rows + out_cols[:, None], out.to(out_ptr.dtype.element_ty), mask=col_ok[:, None] & pair_ok[None, :])


@triton.jit
def _moe_split_reduce_kernel(
    part_ptr, b_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_pad_ptr, topk_w_ptr,
    num_pairs, n_out, splits, stride_ps, stride_be, stride_om,
    GATED: tl.constexpr, APPLY_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr = False, SWIGLU_LIMIT: tl.constexpr = 0.0, SILU_LIMIT: tl.constexpr = 0.0,
):
    """A split-K GEMM's float32 partial sums added in span order, then the GEMM's own epilogue (`_moe_epilogue`):
    one row tile of pairs x BLOCK_N output channels, in the GEMM's tiling."""
    tile = tl.program_id(0)
    if tile * BLOCK_M >= tl.load(num_post_pad_ptr):
        return
    expert = tl.load(expert_ids_ptr + tile).to(tl.int64)
    pair = tl.load(sorted_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pair < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    ok = col_ok[:, None] & pair_ok[None, :]
    width = 2 * n_out if GATED else n_out
    at = part_ptr + pair.to(tl.int64)[None, :] * width + cols[:, None]
    gate = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for split in range(0, splits):
        gate += tl.load(at + split * stride_ps, mask=ok, other=0.0)
        if GATED:
            up += tl.load(at + split * stride_ps + n_out, mask=ok, other=0.0)
    out = _moe_epilogue(gate, up, b_ptr + expert * stride_be, topk_w_ptr, pair, pair_ok, cols, col_ok, n_out,
                        GATED, APPLY_WEIGHT, HAS_BIAS, SWIGLU_LIMIT, SILU_LIMIT)
    tl.store(out_ptr + pair.to(tl.int64)[None, :] * stride_om + cols[:, None], out.to(out_ptr.dtype.element_ty), mask=ok)


def _step(quant_kind: int, scale_k: int) -> int:
    """Input channels per GEMM step: 64 for plain weights; 128 for INT4 and MXFP4 (the scales are applied to the
    weights, so a step may hold several groups, and the loop's fixed cost is spread over 128 channels); for FP8 one
    scale group (at most 128, at least 16 for the MMA), whose scale multiplies the step's product. A group that is
    not a power of two is not supported, nor an INT4 or MXFP4 group under 32 (their input order permutes channels
    within 32)."""
    if quant_kind == 0:
        return 64
    smallest = 16 if quant_kind == 2 else 32
    if scale_k < smallest or scale_k & (scale_k - 1):
        raise ValueError(f"scale groups of {scale_k} input channels are not supported: the group must be a power of two "
                         f"of at least {smallest}")
    return min(scale_k, 128) if quant_kind == 2 else 128


def _scale_alignment(s: torch.Tensor, kind: int, step: int, scale_k: int) -> int:
    """Bytes every weight row's scales are aligned to, as far as one INT4 or MXFP4 step's scales (several groups)
    span: their row's start and its offset (when the rows' strides and the base allow), so the kernel loads them as
    one vector."""
    groups = max(step // scale_k, 1) if kind in (1, 3) else 1
    span = groups * s.element_size()
    rows_aligned = all(stride % groups == 0 for stride in s.stride()[:-1]) and s.data_ptr() % span == 0
    if groups > 1 and s.stride(-1) == 1 and rows_aligned:
        return span
    return 1


def _launch_gemm(hidden: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                 align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], weights: torch.Tensor, *, row_tiles: int,
                 a_row_div: int, n_out: int, k_in: int, up_row0: int, gated: bool, apply_weight: bool,
                 has_bias: bool, swiglu_limit: float, kind: int, scale_n: int, scale_k: int, block_m: int,
                 silu_limit: float = 0.0) -> None:
    """One grouped GEMM (`_moe_gemm_kernel`), split over its K spans when its tiles alone would leave the GPU
    idle (`_BUSY_PROGRAMS`); the split's partial sums then go through `_moe_split_reduce_kernel`. Splitting never
    changes a result's bits, so this choice may depend on the batch."""
    sorted_ids, expert_ids, num_post_pad = align
    num_tiles = expert_ids.numel()
    block_n = min(128 if block_m == 16 and not gated else 64, pow2(n_out, 16))  # 128 weight rows; 64 with prefill's wide row tiles (registers)
    col_tiles = triton.cdiv(n_out, block_n)
    step = _step(kind, scale_k)
    span = max(_SPLIT_SPAN, step)
    spans = triton.cdiv(k_in, span)
    split = spans > 1 and row_tiles * col_tiles < _BUSY_PROGRAMS
    width = (2 if gated else 1) * n_out
    part = torch.empty(spans if split else 0, out.shape[0], width, dtype=torch.float32, device=out.device)
    common = dict(GATED=gated, APPLY_WEIGHT=apply_weight, BLOCK_M=block_m, BLOCK_N=block_n, HAS_BIAS=has_bias,
                  SWIGLU_LIMIT=swiglu_limit, SILU_LIMIT=silu_limit, num_warps=4 if block_m == 16 else 8)
    _moe_gemm_kernel[(num_tiles, col_tiles, spans if split else 1)](
        hidden, w, s, b, out, part, sorted_ids, expert_ids, num_post_pad, weights,
        out.shape[0], a_row_div, n_out, k_in, up_row0,
        hidden.stride(0), *w.stride(), *s.stride(), b.stride(0), out.stride(0), out.shape[0] * width,
        QUANT=kind, SCALE_N=scale_n, SCALE_K=scale_k, STEP=step, SPAN=span, SPLIT=split, EVEN_K=k_in % step == 0,
        EVEN_N=n_out % block_n == 0, SCALE_ALIGN=_scale_alignment(s, kind, step, scale_k), MODE=dot_mode(hidden.dtype),
        **common,
    )
    if split:
        _moe_split_reduce_kernel[(num_tiles, col_tiles)](
            part, b, out, sorted_ids, expert_ids, num_post_pad, weights,
            out.shape[0], n_out, spans, out.shape[0] * width, b.stride(0), out.stride(0), **common,
        )


def _as_words(packed: torch.Tensor) -> torch.Tensor:
    """[..., K / 2] uint8 MXFP4 codes -> the same bytes as [..., K / 8] int32 words (copied only when the rows are not
    contiguous and 4-byte aligned)."""
    if packed.shape[-1] % 4:
        raise ValueError(f"MXFP4 weights of {2 * packed.shape[-1]} input channels: a multiple of 8 is needed")
    if packed.stride(-1) != 1 or packed.storage_offset() % 4 or any(st % 4 for st in packed.stride()[:-1]):
        packed = packed.contiguous()
    return packed.view(torch.int32)


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
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    silu_limit: float | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    sorted_pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Routed experts: sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]). hidden [T, H] -> [T, H].
    `sorted_pairs`: `moe_align_block_size`'s output for these ids, already made (`noaux_tc_route_and_sort`).
    Two grouped GEMM launches over the expert-sorted pairs, then one kernel that sums each token's k rows (and runs
    the `shared` expert's activation and down projection and adds it, as the torch reference does). `other_experts`:
    ids may name experts of other ranks (ids >= E), whose pairs are skipped. Biases, `swiglu_limit` (gpt-oss) and
    `silu_limit` (DeepSeek-V4) as in the torch reference, applied in the GEMMs' epilogues."""
    tokens, top_k = topk_ids.shape
    hidden_size = hidden.shape[1]
    num_experts = w13.shape[0]
    pack = {"w4a16": 8, "mxfp4": 2}.get(quant.method, 1) if quant is not None else 1
    inter = w2.shape[2] * pack
    if not tokens:
        return torch.empty(0, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    pairs = tokens * top_k
    block_m = _block_m(pairs, num_experts)
    if sorted_pairs is None:
        sorted_pairs = moe_align_block_size(topk_ids, num_experts, block_m)
    elif sorted_pairs[1].numel() * block_m != triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m:
        raise ValueError("sorted_pairs were not sorted for these ids' tile size")
    sorted_ids, expert_ids, num_post_pad = sorted_pairs
    if quant is None:
        kind, scale_n, scale_k, s13, s2, up_row0 = 0, 1, 1, w13, w2, 0
    elif quant.method in ("w4a16", "mxfp4"):
        kind = 1 if quant.method == "w4a16" else 3
        scale_n, scale_k, s13, s2, up_row0 = 1, quant.group_size, quant.w13_scale, quant.w2_scale, inter
        if kind == 3:  # the kernel reads eight codes per int32 word, as it reads INT4
            w13, w2 = _as_words(w13), _as_words(w2)
    else:
        scale_n, scale_k = quant.block_shape
        kind, s13, s2, up_row0 = 2, quant.w13_scale, quant.w2_scale, triton.cdiv(inter, scale_n)
    b13, b2 = (w13 if w13_bias is None else w13_bias), (w2 if w2_bias is None else w2_bias)  # any pointer when None
    align = (sorted_ids, expert_ids, num_post_pad)
    row_tiles = min(pairs, num_experts) if block_m == 16 else expert_ids.numel()
    common = dict(row_tiles=row_tiles, kind=kind, scale_n=scale_n, scale_k=scale_k, block_m=block_m,
                  swiglu_limit=float(swiglu_limit or 0.0), silu_limit=float(silu_limit or 0.0))
    intermediate = torch.empty(pairs, inter, dtype=hidden.dtype, device=hidden.device)
    _launch_gemm(hidden, w13, s13, b13, intermediate, align, topk_weights, a_row_div=top_k, n_out=inter,
                 k_in=hidden_size, up_row0=up_row0, gated=True, apply_weight=False, has_bias=w13_bias is not None, **common)
    # pairs of another rank's expert are never written: zeros, so they add nothing to their token's sum
    per_pair = (torch.zeros if other_experts else torch.empty)(pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    weights = topk_weights.reshape(-1)
    if weights.dtype != torch.float32:
        weights = weights.float()
    _launch_gemm(intermediate, w2, s2, b2, per_pair, align, weights, a_row_div=1, n_out=hidden_size, k_in=inter,
                 up_row0=0, gated=False, apply_weight=True, has_bias=w2_bias is not None, **common)
    return moe_combine(per_pair.view(tokens, top_k, hidden_size), hidden.dtype, shared)


@triton.jit
def _combine_kernel(rows_ptr, gu_ptr, wd_ptr, out_ptr, tokens, top_k, hidden, inter, stride_gu, stride_wd, stride_out,
                    SHARED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    MODE: tl.constexpr):
    """BLOCK_T tokens x BLOCK_N channels: the k routed rows summed in order and rounded; then SHARED 1: plus the
    shared expert's output read at gu_ptr; SHARED 2: plus the shared expert computed here, silu(gate) * up (rounded
    like torch's ops) times the down weight's rows, rounded, then added."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok, n_ok = t < tokens, n < hidden
    ok = t_ok[:, None] & n_ok[None, :]
    t64 = t.to(tl.int64)
    routed = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for j in range(0, top_k):
        routed += tl.load(rows_ptr + (t64 * top_k + j)[:, None] * hidden + n[None, :], mask=ok, other=0.0)
    out = routed.to(out_ptr.dtype.element_ty)
    if SHARED == 1:
        added = tl.load(gu_ptr + t64[:, None] * stride_gu + n[None, :], mask=ok, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + added).to(out_ptr.dtype.element_ty)
    if SHARED == 2:
        acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            a_ok = t_ok[:, None] & (k < inter)[None, :]
            gate = tl.load(gu_ptr + t64[:, None] * stride_gu + k[None, :], mask=a_ok, other=0.0)
            up = tl.load(gu_ptr + t64[:, None] * stride_gu + inter + k[None, :], mask=a_ok, other=0.0)
            g = gate.to(tl.float32)
            act = ((g * tl.sigmoid(g)).to(gate.dtype).to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
            w = tl.load(wd_ptr + n[None, :].to(tl.int64) * stride_wd + k[:, None], mask=(k < inter)[:, None] & n_ok[None, :], other=0.0)
            acc += mma(act, w, MODE)
        out = (out.to(tl.float32) + acc.to(out_ptr.dtype.element_ty).to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t64[:, None] * stride_out + n[None, :], out, mask=ok)


def moe_combine(per_pair: torch.Tensor, dtype: torch.dtype, shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """per_pair [T, k, H] float32 (contiguous) -> sum over k, rounded to `dtype`, plus `fused_moe.shared_expert` of
    `shared` (gate_up [T, 2I] in `dtype`, rows may be strided; down weight [H, I]): one launch."""
    tokens, top_k, hidden_size = per_pair.shape
    out = torch.empty(tokens, hidden_size, dtype=dtype, device=per_pair.device)
    gate_up, w_down = shared if shared is not None else (out, out)
    inter = w_down.shape[1] if shared is not None else 0
    if shared is not None and (tuple(gate_up.shape) != (tokens, 2 * inter) or w_down.shape[0] != hidden_size):
        raise ValueError(f"shared expert shapes {tuple(gate_up.shape)} and {tuple(w_down.shape)} do not fit {tokens} "
                         f"tokens of {hidden_size} channels")
    mode = 0 if shared is None else 2 if tokens <= _FUSED_SHARED_TOKENS else 1
    if mode == 1:  # many tokens: the down projection as one GEMM (a weight read per 16 tokens would not pay)
        gate_up = shared_expert(gate_up, w_down)
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    if w_down.stride(-1) != 1:
        w_down = w_down.contiguous()
    if tokens:
        block_n = min(32, pow2(hidden_size, 16))
        _combine_kernel[(triton.cdiv(tokens, 16), triton.cdiv(hidden_size, block_n))](
            per_pair, gate_up, w_down, out, tokens, top_k, hidden_size, inter,
            gate_up.stride(0), w_down.stride(0), out.stride(0),
            SHARED=mode, BLOCK_T=16, BLOCK_N=block_n, BLOCK_K=min(64, pow2(inter, 16)),
            MODE=dot_mode(dtype), num_warps=4,
        )
    return out
