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
_SCAN_EXPERTS = 32  # experts per program of the scan over chunks (Kimi's 384: 12 programs)
_SCAN_CHUNKS = 64  # chunks per step of that scan: a 16k-token prefill (1,024 chunks) takes 16 steps
_TILE_ELEMS = 64 * 64  # weight-tile elements per GEMM step
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


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort (token, choice) pairs by expert, each expert's run padded to block_m (see `fused_moe.moe_align_block_size`
    for the outputs). Four launches, no host sync, none serial over the pairs: per-chunk expert histograms; per
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
def _load_weight_tile(
    w_ptr, s_ptr, expert, rows, scale_rows, k0, k_in, col_ok,
    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    QUANT: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
):
    """[BLOCK_K, BLOCK_N] tile of expert `expert`'s weight (rows = output channels; input channels k0 .. k0 + BLOCK_K),
    dequantized to DTYPE: QUANT 0 plain, 1 INT4 packed (8 per int32, lowest nibble first, +8 offset), 2 FP8 with block
    scales, 3 MXFP4 (two e2m1 codes per byte, low nibble first; uint8 e8m0 scales 2^(s - 127) per 32 inputs). Every byte is loaded once: INT4 as [BLOCK_K / 8, BLOCK_N] words unpacked in registers, scales as one row
    per group of SCALE_K inputs (BLOCK_K and SCALE_K divide one another) broadcast over the group.
    scale_rows: the scale row of each output channel."""
    w_base = w_ptr + expert * stride_we + rows[None, :] * stride_wn
    if QUANT == 0:
        kk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_base + kk[:, None] * stride_wk, mask=(kk < k_in)[:, None] & col_ok[None, :], other=0.0).to(DTYPE)
    else:
        SCALE_ROWS: tl.constexpr = BLOCK_K // SCALE_K if BLOCK_K > SCALE_K else 1
        groups = k0 // SCALE_K + tl.arange(0, SCALE_ROWS)
        scale = tl.load(
            s_ptr + expert * stride_se + scale_rows[None, :] * stride_sn + groups[:, None] * stride_sk,
            mask=(groups < tl.cdiv(k_in, SCALE_K))[:, None] & col_ok[None, :], other=0.0,
        ).to(tl.float32)
        if QUANT == 3:
            scale = tl.exp2(scale - 127.0)
        scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (SCALE_ROWS, BLOCK_K // SCALE_ROWS, scale.shape[1])),
                           (BLOCK_K, scale.shape[1]))
        if QUANT == 3:  # e2m1: sign, 2 exponent bits, 1 mantissa bit; exponent 0 is subnormal (0 or 0.5)
            pairs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_base + pairs[:, None] * stride_wk, mask=(pairs < k_in // 2)[:, None] & col_ok[None, :], other=0)
            codes = (packed[:, None, :].to(tl.int32) >> (tl.arange(0, 2) * 4)[None, :, None]) & 0xF
            codes = tl.reshape(codes, (BLOCK_K, packed.shape[1]))
            exponent = (codes >> 1) & 3
            mantissa = (codes & 1).to(tl.float32)
            magnitude = tl.where(exponent == 0, 0.5 * mantissa,
                                 (1.0 + 0.5 * mantissa) * tl.exp2((exponent - 1).to(tl.float32)))
            w = tl.where(codes >= 8, -magnitude, magnitude)
        elif QUANT == 1:
            words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            packed = tl.load(w_base + words[:, None] * stride_wk, mask=(words < k_in // 8)[:, None] & col_ok[None, :], other=0)
            nibbles = (packed[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
            w = (tl.reshape(nibbles, (BLOCK_K, packed.shape[1])) - 8).to(tl.float32)
        else:
            kk = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_base + kk[:, None] * stride_wk, mask=(kk < k_in)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        w = (w * scale).to(DTYPE)
    return w


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, s_ptr, b_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_pad_ptr, topk_w_ptr,
    num_pairs, a_row_div, n_out, k_in, up_scale_row0,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_be, stride_om,
    GATED: tl.constexpr, APPLY_WEIGHT: tl.constexpr,
    QUANT: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr = False, SWIGLU_LIMIT: tl.constexpr = 0.0,
):
    """One row tile (one expert's pairs) x one column tile. GATED: weight rows [0, n_out) are the gate, [n_out, 2 n_out)
    the up projection, and the tile stores silu(gate) * up, or with SWIGLU_LIMIT > 0 gpt-oss's clamped SwiGLU. HAS_BIAS:
    the expert's bias row (gate's then up's for GATED) is added before the activation and the routing weight. Output
    row = pair index."""
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
        a = tl.load(a_rows + kk[None, :], mask=row_ok[:, None] & (kk < k_in)[None, :], other=0.0)
        w = _load_weight_tile(w_ptr, s_ptr, expert, cols, cols // SCALE_N, k0, k_in, col_ok, stride_we, stride_wn,
                              stride_wk, stride_se, stride_sn, stride_sk, QUANT, SCALE_K, BLOCK_K, a.dtype)
        acc += mma(a, w, MODE)
        if GATED:
            w_up = _load_weight_tile(w_ptr, s_ptr, expert, n_out + cols, up_scale_row0 + cols // SCALE_N, k0, k_in,
                                     col_ok, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, QUANT,
                                     SCALE_K, BLOCK_K, a.dtype)
            acc_up += mma(a, w_up, MODE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_ptr + expert * stride_be + n_out + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if SWIGLU_LIMIT > 0:
            gate = tl.minimum(acc, SWIGLU_LIMIT)
            up = tl.minimum(tl.maximum(acc_up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
            acc = gate * tl.sigmoid(1.702 * gate) * (up + 1.0)
        else:
            acc = acc * tl.sigmoid(acc) * acc_up
    if APPLY_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_rows = out_ptr + pair.to(tl.int64)[:, None] * stride_om
    tl.store(out_rows + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _block_k(scale_k: int, widest: int) -> int:
    """Input channels per GEMM step: the widest power of two up to `widest` such that BLOCK_K and the scale group
    divide one another (a tile then needs one scale row per group it holds, or one for all of it)."""
    block_k = widest
    while block_k >= 16:
        if block_k % scale_k == 0 or scale_k % block_k == 0:
            return block_k
        block_k //= 2
    raise ValueError(f"scale groups of {scale_k} input channels are not supported: the group must divide {widest} or be a multiple of 16")


def _gemm_tiles(row_tiles: int, block_m: int, n_out: int, scale_k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of a grouped GEMM. Decode-sized row tiles over few experts leave few programs (a batch-1
    Kimi TP8 gate_up, 8 experts x 256 channels, is 32 programs of 64 channels for 132 SMs), so for 16-row tiles the
    column tile narrows, down to 16, until the launch has about `_BUSY_PROGRAMS` programs, and K steps deepen to keep
    the weight tile (the bytes in flight per step) at `_TILE_ELEMS`."""
    block_n = 64
    if block_m == 16:
        while block_n > 16 and row_tiles * triton.cdiv(n_out, block_n) < _BUSY_PROGRAMS:
            block_n //= 2
    return block_n, _block_k(scale_k, _TILE_ELEMS // block_n)


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
) -> torch.Tensor:
    """Routed experts: sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]). hidden [T, H] -> [T, H].
    Two grouped GEMM launches over the expert-sorted pairs, then a sum over each token's k rows. `other_experts`:
    ids may name experts of other ranks (ids >= E), whose pairs are skipped. Biases and `swiglu_limit` (gpt-oss) as
    in the torch reference, applied in the GEMMs' epilogues."""
    tokens, top_k = topk_ids.shape
    hidden_size = hidden.shape[1]
    num_experts = w13.shape[0]
    pack = {"w4a16": 8, "mxfp4": 2}.get(quant.method, 1) if quant is not None else 1
    inter = w2.shape[2] * pack
    if not tokens:
        return torch.zeros(0, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    pairs = tokens * top_k
    block_m = _block_m(pairs, num_experts)
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(topk_ids, num_experts, block_m)
    if quant is None:
        kind, scale_n, scale_k, s13, s2, up_row0 = 0, 1, 1, w13, w2, 0
    elif quant.method in ("w4a16", "mxfp4"):
        kind = 1 if quant.method == "w4a16" else 3
        scale_n, scale_k, s13, s2, up_row0 = 1, quant.group_size, quant.w13_scale, quant.w2_scale, inter
    else:
        scale_n, scale_k = quant.block_shape
        kind, s13, s2, up_row0 = 2, quant.w13_scale, quant.w2_scale, triton.cdiv(inter, scale_n)
    common = dict(QUANT=kind, SCALE_N=scale_n, SCALE_K=scale_k, BLOCK_M=block_m, MODE=dot_mode(hidden.dtype), num_warps=4)
    b13, b2 = (w13 if w13_bias is None else w13_bias), (w2 if w2_bias is None else w2_bias)  # any pointer when None
    num_tiles = expert_ids.numel()
    row_tiles = min(pairs, num_experts) if block_m == 16 else num_tiles
    intermediate = torch.empty(pairs, inter, dtype=hidden.dtype, device=hidden.device)
    block_n, block_k = _gemm_tiles(row_tiles, block_m, inter, scale_k)
    _moe_gemm_kernel[(num_tiles, triton.cdiv(inter, block_n))](
        hidden, w13, s13, b13, intermediate, sorted_ids, expert_ids, num_post_pad, topk_weights,
        pairs, top_k, inter, hidden_size, up_row0,
        hidden.stride(0), *w13.stride(), *s13.stride(), b13.stride(0), intermediate.stride(0),
        GATED=True, APPLY_WEIGHT=False, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=w13_bias is not None,
        SWIGLU_LIMIT=float(swiglu_limit or 0.0), **common,
    )
    # pairs of another rank's expert are never written: zeros, so they add nothing to their token's sum
    per_pair = (torch.zeros if other_experts else torch.empty)(pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    weights = topk_weights.reshape(-1)
    if weights.dtype != torch.float32:
        weights = weights.float()
    block_n, block_k = _gemm_tiles(row_tiles, block_m, hidden_size, scale_k)
    _moe_gemm_kernel[(num_tiles, triton.cdiv(hidden_size, block_n))](
        intermediate, w2, s2, b2, per_pair, sorted_ids, expert_ids, num_post_pad, weights,
        pairs, 1, hidden_size, inter, 0,
        intermediate.stride(0), *w2.stride(), *s2.stride(), b2.stride(0), per_pair.stride(0),
        GATED=False, APPLY_WEIGHT=True, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=w2_bias is not None, **common,
    )
    return per_pair.view(tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
