"""Triton sampling: one program per row streams the vocabulary a few times and never sorts it. Same signatures, the
same random numbers and the same filter semantics as `sampling.py` (see there).

Top-k and top-p thresholds come from a radix select (as in GPU selection, Alabi et al., 2012, "Fast k-selection
algorithms for graphics processing units") over 32-bit order-preserving keys of the scaled logits, four bits per pass:
each pass builds a 16-bin histogram of the next digit among the entries that share the digits chosen so far, weighted
by 1 (top-k: the k-th largest value) or by exp(x - max) (top-p: the smallest set of top entries holding top_p of the
mass). Eight passes give the exact threshold key, instead of the ~32 passes of a bisection. A pass compares
`_RADIX_BLOCK` entries with the 16 digits at a time ([256, 16] fits in registers; [1024, 16] spilled ~28 KB a
thread). Greedy rows read the logits once (the argmax pass); the row maximum is read first only for top-p or min-p.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reasoning_engine.kernels._triton_utils import pow2
from reasoning_engine.kernels.sampling import GREEDY_TEMPERATURE

_BLOCK_V = 1024  # vocabulary entries per step of the streaming passes
_RADIX_BLOCK = 256  # entries per step of a radix-select pass (its [entries, 16] digit compare is held in registers)


@triton.jit
def _mix32(x):
    """lowbias32 (Wellons, 2018) on uint32."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _stream_key(seed, counter):
    """int64 seed and counter -> uint32 key of that random stream (as `sampling.stream_key`)."""
    h = _mix32((seed & 0xFFFFFFFF).to(tl.uint32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h = _mix32(h ^ (counter & 0xFFFFFFFF).to(tl.uint32))
    return _mix32(h ^ ((counter >> 32) & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _uniform(key, index):
    """Uniform float32 in (0, 1) for stream `key` at `index` (as `sampling.uniform`)."""
    h = _mix32(index.to(tl.uint32) * 0x9E3779B9 + key)
    h = _mix32(h ^ key)
    return ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08


@triton.jit
def _gumbel(key, index):
    return -tl.log(-tl.log(_uniform(key, index)))


@triton.jit
def _ordered_key(x):
    """float32 -> int64 in [0, 2^32) that increases with x."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits.to(tl.int64) + 0x80000000, (~bits).to(tl.int64))


@triton.jit
def _load_scaled(row_ptr, offs, vocab, inv_t):
    return tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) * inv_t


@triton.jit
def _radix_select(row_ptr, vocab, inv_t, row_max, floor, target, USE_MASS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Largest key t such that the entries with key >= max(t, floor) weigh at least `target`; weight 1 or, with
    USE_MASS, exp(x - row_max)."""
    bins = tl.arange(0, 16)
    prefix = tl.zeros([], tl.int64)
    remaining = target
    for step in tl.static_range(8):
        shift = 28 - 4 * step
        hist = tl.zeros([16], tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            x = _load_scaled(row_ptr, offs, vocab, inv_t)
            key = _ordered_key(x)
            if USE_MASS:
                w = tl.exp(x - row_max)
            else:
                w = tl.full([BLOCK_V], 1.0, tl.float32)
            same_prefix = (key >> (shift + 4)) == (prefix >> (shift + 4))
            w = tl.where((offs < vocab) & (key >= floor) & same_prefix, w, 0.0)
            digit = (key >> shift) & 15
            hist += tl.sum(tl.where(digit[:, None] == bins[None, :], w[:, None], 0.0), axis=0)
        at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        b = tl.maximum(tl.sum((at_or_above >= remaining).to(tl.int32), axis=0) - 1, 0)
        remaining -= tl.sum(tl.where(bins > b, hist, 0.0), axis=0)
        prefix = prefix | (b.to(tl.int64) << shift)
    return prefix


@triton.jit
def _pick(row_ptr, vocab, inv_t, row_max, floor, min_ratio, key, NOISE: tl.constexpr, BLOCK_V: tl.constexpr):
    """Index of the best kept entry (the first on ties): of x + Gumbel noise with NOISE, else of x."""
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.zeros([], tl.int64)
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = _load_scaled(row_ptr, offs, vocab, inv_t)
        kept = (offs < vocab) & (_ordered_key(x) >= floor) & (tl.exp(x - row_max) >= min_ratio)
        if NOISE:
            x += _gumbel(key, offs)
        score = tl.where(kept, x, float("-inf"))
        chunk_best = tl.max(score, axis=0)
        chunk_idx = tl.min(tl.where(score == chunk_best, offs, vocab), axis=0).to(tl.int64)
        take = chunk_best > best
        best_idx = tl.where(take, chunk_idx, best_idx)
        best = tl.where(take, chunk_best, best)
    return best_idx


@triton.jit
def _sample_kernel(
    logits_ptr, stride_row, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, counters_ptr, out_ptr,
    vocab, GREEDY_T: tl.constexpr, BLOCK_V: tl.constexpr, RADIX_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    t = tl.load(temp_ptr + row).to(tl.float32)
    sampled = t >= GREEDY_T
    inv_t = tl.where(sampled, 1.0 / tl.maximum(t, GREEDY_T), 1.0)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    min_p = tl.load(min_p_ptr + row).to(tl.float32)
    min_ratio = tl.where(sampled & (min_p > 0.0), min_p, 0.0)

    # without top-p or min-p the maximum is not needed: it stays 0, and exp(x - 0) >= 0 keeps every entry
    row_max = tl.zeros([], tl.float32)
    if sampled & ((top_p < 1.0) | (min_ratio > 0.0)):
        row_max = tl.full([], float("-inf"), tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            row_max = tl.maximum(row_max, tl.max(_load_scaled(row_ptr, v0 + tl.arange(0, BLOCK_V), vocab, inv_t), axis=0))
    floor = tl.zeros([], tl.int64)
    if sampled & (top_k > 0) & (top_k < vocab):
        floor = _radix_select(row_ptr, vocab, inv_t, row_max, floor, top_k.to(tl.float32), False, RADIX_BLOCK)
    if sampled & (top_p < 1.0):
        kept_mass = tl.zeros([], tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            x = _load_scaled(row_ptr, v0 + tl.arange(0, BLOCK_V), vocab, inv_t)
            kept_mass += tl.sum(tl.where(_ordered_key(x) >= floor, tl.exp(x - row_max), 0.0), axis=0)
        floor = tl.maximum(floor, _radix_select(row_ptr, vocab, inv_t, row_max, floor, top_p * kept_mass, True, RADIX_BLOCK))

    if sampled:
        key = _stream_key(tl.load(seeds_ptr + row), tl.load(counters_ptr + row))
        best_idx = _pick(row_ptr, vocab, inv_t, row_max, floor, min_ratio, key, True, BLOCK_V)
    else:
        best_idx = _pick(row_ptr, vocab, inv_t, row_max, floor, min_ratio, 0, False, BLOCK_V)
    tl.store(out_ptr + row, best_idx)


def logit_passes(top_k: bool, top_p: bool) -> int:
    """Reads of a row's logits by `_sample_kernel`: the argmax pass; the maximum for top-p; eight radix passes for
    top-k; the kept mass and eight radix passes for top-p (min-p adds the maximum too)."""
    return 1 + (8 if top_k else 0) + (1 + 1 + 8 if top_p else 0)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
) -> torch.Tensor:
    """logits [B, V]; temperature/top_p/min_p [B] float32; top_k [B] int (0 = off); seeds/counters [B] int64
    -> token ids [B] int64."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        _sample_kernel[(rows,)](
            logits, logits.stride(0), temperature, top_k, top_p, min_p, seeds.long(), counters.long(), out,
            vocab, GREEDY_T=GREEDY_TEMPERATURE, BLOCK_V=min(_BLOCK_V, pow2(vocab)), RADIX_BLOCK=min(_RADIX_BLOCK, pow2(vocab)),
            num_warps=4,
        )
    return out


@triton.jit
def _verify_kernel(
    draft_ids_ptr, num_draft_ptr, q_ptr, p_ptr, seeds_ptr, counters_ptr, accepted_ptr, recovered_ptr,
    max_draft, vocab, stride_qb, stride_qs, stride_pb, stride_ps,
    HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Position i of row b: the acceptance test of draft i (i < n) and the token drawn there on rejection (or, at
    i == n, the bonus token), from max(p - q, 0) or from p where that residual is empty."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    n = tl.load(num_draft_ptr + b)
    if i > n:
        return
    is_draft = i < n
    key = _stream_key(tl.load(seeds_ptr + b), tl.load(counters_ptr + b) + i)
    p_row = p_ptr + b * stride_pb + i * stride_ps
    q_row = q_ptr + b * stride_qb + i * stride_qs
    x = tl.load(draft_ids_ptr + b * max_draft + i, mask=is_draft, other=0).to(tl.int64)
    if is_draft:
        p_x = tl.load(p_row + x).to(tl.float32)
        if HAS_Q:
            q_x = tl.load(q_row + x).to(tl.float32)
        else:
            q_x = 1.0
        u = _uniform(key, tl.full([], 0xFFFFFFFF, tl.uint32))
        tl.store(accepted_ptr + b * max_draft + i, (u * q_x < p_x).to(tl.int8))
    q_len = tl.where(is_draft, vocab, 0)  # the bonus position has no draft distribution
    best_r = tl.full([], float("-inf"), tl.float32)
    idx_r = tl.zeros([], tl.int64)
    best_p = tl.full([], float("-inf"), tl.float32)
    idx_p = tl.zeros([], tl.int64)
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        ok = offs < vocab
        p = tl.load(p_row + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_Q:
            q = tl.load(q_row + offs, mask=offs < q_len, other=0.0).to(tl.float32)
        else:
            q = tl.where(is_draft & (offs == x), 1.0, 0.0)
        r = tl.maximum(p - q, 0.0)
        g = _gumbel(key, offs)
        s_r = tl.where(r > 0, tl.log(tl.where(r > 0, r, 1.0)) + g, float("-inf"))
        s_p = tl.where(p > 0, tl.log(tl.where(p > 0, p, 1.0)) + g, float("-inf"))
        c_r = tl.max(s_r, axis=0)
        c_p = tl.max(s_p, axis=0)
        i_r = tl.min(tl.where(s_r == c_r, offs, vocab), axis=0).to(tl.int64)
        i_p = tl.min(tl.where(s_p == c_p, offs, vocab), axis=0).to(tl.int64)
        idx_r = tl.where(c_r > best_r, i_r, idx_r)
        best_r = tl.maximum(best_r, c_r)
        idx_p = tl.where(c_p > best_p, i_p, idx_p)
        best_p = tl.maximum(best_p, c_p)
    tl.store(recovered_ptr + b * (max_draft + 1) + i, tl.where(best_r > float("-inf"), idx_r, idx_p))


@triton.jit
def _assemble_kernel(
    draft_ids_ptr, num_draft_ptr, accepted_ptr, recovered_ptr, out_ptr, num_accepted_ptr,
    max_draft, BLOCK_S: tl.constexpr,
):
    """Accepted prefix of the drafts, then the token drawn at the first rejection (or the bonus), then -1."""
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(num_draft_ptr + b)
    pos = tl.arange(0, BLOCK_S)
    accepted = tl.load(accepted_ptr + b * max_draft + pos, mask=pos < n, other=1)
    first = tl.min(tl.where((accepted == 0) & (pos < n), pos, n), axis=0)
    drafts = tl.load(draft_ids_ptr + b * max_draft + pos, mask=pos < first, other=-1).to(tl.int64)
    last = tl.load(recovered_ptr + b * (max_draft + 1) + first)
    out = tl.where(pos < first, drafts, tl.where(pos == first, last, -1))
    tl.store(out_ptr + b * (max_draft + 1) + pos, out, mask=pos <= max_draft)
    tl.store(num_accepted_ptr + b, first.to(tl.int32))


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling verification, as `sampling.rejection_sample`: one program per (row, position) tests
    acceptance and draws the replacement token in parallel, then one program per row keeps the accepted prefix.
    Returns (output ids [B, S + 1] int64 padded with -1, accepted drafts [B] int32)."""
    num_seqs, max_draft = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    out = torch.empty(num_seqs, max_draft + 1, dtype=torch.int64, device=device)
    num_accepted = torch.empty(num_seqs, dtype=torch.int32, device=device)
    if not num_seqs:
        return out, num_accepted
    drafts = draft_token_ids.contiguous()
    counts = num_draft_tokens.to(torch.int32)
    accepted = torch.empty(num_seqs, max(max_draft, 1), dtype=torch.int8, device=device)
    recovered = torch.empty(num_seqs, max_draft + 1, dtype=torch.int64, device=device)
    if target_probs.stride(-1) != 1:
        target_probs = target_probs.contiguous()
    q = target_probs if draft_probs is None else draft_probs
    if q.stride(-1) != 1:
        q = q.contiguous()
    _verify_kernel[(num_seqs, max_draft + 1)](
        drafts, counts, q, target_probs, seeds.long(), counters.long(), accepted, recovered,
        max_draft, vocab, q.stride(0), q.stride(1), target_probs.stride(0), target_probs.stride(1),
        HAS_Q=draft_probs is not None, BLOCK_V=min(_BLOCK_V, pow2(vocab)), num_warps=4,
    )
    _assemble_kernel[(num_seqs,)](drafts, counts, accepted, recovered, out, num_accepted, max_draft, BLOCK_S=pow2(max_draft + 1))
    return out, num_accepted
