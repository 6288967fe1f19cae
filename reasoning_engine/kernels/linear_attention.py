"""Linear-attention layers of hybrid models in plain torch: the short depthwise causal convolution before them and the
gated delta rule, for Gated DeltaNet (Qwen3-Next, Qwen3.5: one log decay per head) and Kimi Delta Attention (Kimi
Linear: one per key channel). The CPU path and the reference for the GPU libraries dispatched to at the end.

The engine hands a step's tokens as one ragged batch (`query_start_loc`, cumulative query lengths) and each sequence's
carried state as a plain [B, ...] tensor; draft trees (speculative verification) give each token a parent row instead.
Decode steps (one token per sequence) have their own entry points (`*_decode`), and so do draft trees laid out as a
CUDA-graph verification bucket lays them out (`*_tree_padded`: B sequences of Q rows): no host syncs and shapes set
by the batch alone, so CUDA graphs capture them and torch.compile traces them as one graph.

The gated delta rule (Yang, Kautz & Hatamizadeh 2024, arXiv:2412.06464; KDA's per-channel decay: Kimi Team 2025,
arXiv:2510.26692), per token with state S [Dk, Dv]:
    S <- diag(exp(g)) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T (scale q)
Long sequences run in chunks of 64 (the WY / UT-transform form, derived in `_chunk_intra`), all in float32.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64
# Elements of the [chunks, H, C, C, Dk] pairwise-decay temporary that KDA's intra-chunk products may build at once.
_PAIRWISE_BUDGET = 1 << 24


def l2norm(x: Tensor, dim: int = -1, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) along dim (the normalisation of use_qk_l2norm_in_kernel)."""
    return x / torch.sqrt((x * x).sum(dim=dim, keepdim=True) + eps)


# ----------------------------------------------------------------------------------------------------------- checks


def _query_lengths(query_start_loc: Tensor, num_tokens: int, num_seqs: int) -> Tensor:
    if query_start_loc.dim() != 1 or query_start_loc.numel() != num_seqs + 1:
        raise ValueError(f"query_start_loc must be [B+1] = [{num_seqs + 1}], got {tuple(query_start_loc.shape)}")
    lens = query_start_loc[1:] - query_start_loc[:-1]
    if int(query_start_loc[0]) != 0 or int(query_start_loc[-1]) != num_tokens or bool((lens < 0).any()):
        raise ValueError(f"query_start_loc must rise from 0 to the {num_tokens} tokens, got {query_start_loc.tolist()}")
    return lens


def _tree_levels(seq_index: Tensor, parent: Tensor, num_tokens: int, num_seqs: int) -> list[Tensor]:
    """Row indices of a draft forest by depth (roots first). Rejects parents that do not come before their child, so
    the depth walk ends."""
    if seq_index.shape != (num_tokens,) or parent.shape != (num_tokens,):
        raise ValueError(f"seq_index and parent must be [T] = [{num_tokens}]")
    rows = torch.arange(num_tokens, device=parent.device)
    if num_tokens and (bool((parent < -1).any()) or bool((parent >= rows).any())):
        raise ValueError("parent[t] must be -1 or a row before t")
    if num_tokens and (bool((seq_index < 0).any()) or bool((seq_index >= num_seqs).any())):
        raise ValueError(f"seq_index must name one of the {num_seqs} sequences")
    has_parent = parent >= 0
    depth = torch.zeros_like(parent)
    for _ in range(num_tokens):
        deeper = torch.where(has_parent, depth[parent.clamp(min=0)] + 1, 0)
        if torch.equal(deeper, depth):
            break
        depth = deeper
    max_depth = int(depth.max()) if num_tokens else -1
    return [torch.nonzero(depth == d).flatten() for d in range(max_depth + 1)]


def _tree_sources(seq_index: Tensor, parent: Tensor, num_seqs: int) -> Tensor:
    """Row of each token's preceding state in a [B + T] table: its sequence's state, or its parent's (B + parent)."""
    return torch.where(parent >= 0, num_seqs + parent, seq_index)


def _activate(x: Tensor, activation: str | None) -> Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"activation must be 'silu' or None, got {activation!r}")


# ------------------------------------------------------------------------------------------------ causal conv1d


def _check_conv(x: Tensor, weight: Tensor, state: Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"x must be [T, C] and weight [C, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if state.dim() != 3 or state.shape[1] != x.shape[1] or state.shape[2] != weight.shape[1] - 1:
        raise ValueError(f"state must be [B, C, K-1] = [B, {x.shape[1]}, {weight.shape[1] - 1}], "
                         f"got {tuple(state.shape)}")


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, query_start_loc: Tensor, state: Tensor,
                  activation: str | None = "silu") -> tuple[Tensor, Tensor]:
    """Depthwise causal conv over each sequence's tokens. x [T, C]; weight [C, K]; state [B, C, K-1]: the K-1 inputs
    before each sequence's first token of this step (zeros for a fresh sequence). Returns (out [T, C] in x.dtype,
    final_state [B, C, K-1]: the last K-1 inputs of each sequence, state ++ its tokens). activation "silu" or None."""
    _check_conv(x, weight, state)
    lens = _query_lengths(query_start_loc, x.shape[0], state.shape[0])
    _activate(x[:0], activation)
    if _gpu_conv_update_applies(x, lens):
        return _gpu_causal_conv1d_update(x, weight, bias, state, activation)
    return _torch_causal_conv1d(x, weight, bias, query_start_loc, lens, state, activation)


def _torch_causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, query_start_loc: Tensor, lens: Tensor,
                         state: Tensor, activation: str | None) -> tuple[Tensor, Tensor]:
    """Lays each sequence out as its K-1 state columns then its tokens in one [T + B(K-1), C] buffer, so every token's
    window is the K rows ending at its own, whichever sequence it is in."""
    num_tokens, channels = x.shape
    num_seqs, _, hist = state.shape
    device = x.device
    seq_ids = torch.arange(num_seqs, device=device)
    token_seq = torch.repeat_interleave(seq_ids, lens, output_size=num_tokens)
    seq_base = query_start_loc[:-1] + hist * seq_ids  # buffer row of each sequence's first state column
    buf = torch.empty(num_tokens + num_seqs * hist, channels, dtype=torch.float32, device=device)
    hist_cols = torch.arange(hist, device=device)
    buf[(seq_base[:, None] + hist_cols).flatten()] = state.transpose(1, 2).reshape(-1, channels).float()
    token_rows = torch.arange(num_tokens, device=device) + hist * (token_seq + 1)
    buf[token_rows] = x.float()
    w = weight.float()
    out = torch.zeros(num_tokens, channels, dtype=torch.float32, device=device)
    for j in range(hist + 1):  # tap j reads the input hist - j rows back
        out += buf[token_rows - (hist - j)] * w[:, j]
    if bias is not None:
        out += bias.float()
    final_rows = seq_base[:, None] + lens[:, None] + hist_cols  # the last K-1 rows of each sequence's segment
    final_state = buf[final_rows.flatten()].reshape(num_seqs, hist, channels).transpose(1, 2).to(state.dtype)
    return _activate(out, activation).to(x.dtype), final_state.contiguous()


def causal_conv1d_tree(x: Tensor, weight: Tensor, bias: Tensor | None, state: Tensor, seq_index: Tensor, parent: Tensor,
                       activation: str | None = "silu") -> tuple[Tensor, Tensor]:
    """Draft trees (speculative verification): token t belongs to sequence seq_index[t] ([T] int64) and follows the
    token in row parent[t] of x ([T] int64), or, when parent[t] == -1, the sequence's state. Rows are in an order where
    a parent comes before its children. Returns (out [T, C], token_states [T, C, K-1]: the conv state after token t,
    i.e. its last K-1 inputs along its ancestor path)."""
    _check_conv(x, weight, state)
    num_tokens, channels = x.shape
    num_seqs, _, hist = state.shape
    levels = _tree_levels(seq_index, parent, num_tokens, num_seqs)
    _activate(x[:0], activation)
    table = torch.empty(num_seqs + num_tokens, channels, hist, dtype=torch.float32, device=x.device)
    table[:num_seqs] = state.float()
    source = _tree_sources(seq_index, parent, num_seqs)
    out = torch.empty(num_tokens, channels, dtype=torch.float32, device=x.device)
    w = weight.float()
    for rows in levels:  # every token of one depth at once: its parents' states are all written
        out[rows], table[num_seqs + rows] = _conv_step(x[rows], w, bias, table[source[rows]])
    return _activate(out, activation).to(x.dtype), table[num_seqs:].to(state.dtype)


def causal_conv1d_tree_padded(x: Tensor, weight: Tensor, bias: Tensor | None, state: Tensor, parent: Tensor,
                              activation: str | None = "silu") -> tuple[Tensor, Tensor]:
    """Draft trees laid out as B sequences of Q rows each (a CUDA-graph verification bucket): x [B * Q, C], sequence b's
    rows from b * Q; parent [B, Q] int64: the row of its own sequence each row continues (one before it), or -1 for the
    sequence's state [B, C, K-1]. Returns (out [B * Q, C], row_states [B * Q, C, K-1]). Every sequence's row t at
    once, for t = 0 .. Q-1: free of host syncs."""
    _check_conv(x, weight, state)
    num_seqs, query_len = _check_padded_tree(parent, x.shape[0], state.shape[0])
    hist = state.shape[2]
    rows = x.view(num_seqs, query_len, -1)
    nodes = torch.zeros(num_seqs, query_len, x.shape[1], hist, dtype=torch.float32, device=x.device)
    out = torch.empty(num_seqs, query_len, x.shape[1], dtype=torch.float32, device=x.device)
    w, seqs = weight.float(), torch.arange(num_seqs, device=x.device)
    for t in range(query_len):
        before = _tree_predecessor(nodes, seqs, parent[:, t], state)
        out[:, t], nodes[:, t] = _conv_step(rows[:, t], w, bias, before)
    return (_activate(out.view(-1, x.shape[1]), activation).to(x.dtype),
            nodes.view(-1, x.shape[1], hist).to(state.dtype))


def _check_padded_tree(parent: Tensor, num_tokens: int, num_states: int) -> tuple[int, int]:
    if parent.dim() != 2 or parent.shape[0] != num_states or parent.shape[0] * parent.shape[1] != num_tokens:
        raise ValueError(f"parent must be [B, Q] with B = {num_states} states and B * Q = {num_tokens} tokens, "
                         f"got {tuple(parent.shape)}")
    return parent.shape[0], parent.shape[1]


def _tree_predecessor(nodes: Tensor, seqs: Tensor, parent: Tensor, state: Tensor) -> Tensor:
    """The state each sequence's row continues: its parent row's (nodes [B, Q, ...]), or the sequence's own."""
    mask = (parent >= 0).view(-1, *([1] * (state.dim() - 1)))
    return torch.where(mask, nodes[seqs, parent.clamp(min=0)], state.float())


def _conv_step(x: Tensor, w: Tensor, bias: Tensor | None, state: Tensor) -> tuple[Tensor, Tensor]:
    """One token for each of N states: x [N, C], w [C, K] float32, state [N, C, K-1]. Returns (float32 output before
    the activation [N, C], float32 state after the token [N, C, K-1])."""
    window = torch.cat([state.float(), x.float()[:, :, None]], dim=2)  # [N, C, K]
    out = (window * w).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out, window[:, :, 1:]


def causal_conv1d_decode(x: Tensor, weight: Tensor, bias: Tensor | None, state: Tensor,
                         activation: str | None = "silu") -> tuple[Tensor, Tensor]:
    """One token per sequence: x [B, C], state [B, C, K-1]. Returns (out [B, C] in x.dtype, the state after the token
    [B, C, K-1] in state.dtype). Free of host syncs (a decode step's form for CUDA graphs and compiled decode)."""
    _check_conv(x, weight, state)
    if x.shape[0] != state.shape[0]:
        raise ValueError(f"a decode step has one token per state: {x.shape[0]} tokens, {state.shape[0]} states")
    if x.is_cuda and _importable("causal_conv1d"):
        return _gpu_causal_conv1d_update(x, weight, bias, state, activation)
    out, final = _conv_step(x, weight.float(), bias, state)
    return _activate(out, activation).to(x.dtype), final.to(state.dtype)


# ------------------------------------------------------------------------------------------------ gated delta rule


def _check_delta(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q, k must be [T, Hk, Dk] and v [T, Hv, Dv], "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    num_tokens, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hv % hk:
        raise ValueError(f"v's heads ({hv}) must be a multiple of q/k's ({hk})")
    if g.shape not in ((num_tokens, hv), (num_tokens, hv, dk)):
        raise ValueError(f"g must be [T, Hv] or [T, Hv, Dk] = [{num_tokens}, {hv}(, {dk})], got {tuple(g.shape)}")
    if beta.shape != (num_tokens, hv):
        raise ValueError(f"beta must be [T, Hv] = [{num_tokens}, {hv}], got {tuple(beta.shape)}")
    if state.dim() != 4 or state.shape[1:] != (hv, dk, dv):
        raise ValueError(f"state must be [B, Hv, Dk, Dv] = [B, {hv}, {dk}, {dv}], got {tuple(state.shape)}")


def _prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
             qk_l2norm: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """float32 q (normalised, scaled), k (normalised), each repeated to the value heads; v; g as [T, Hv, Dk or 1];
    beta."""
    q, k = q.float(), k.float()
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    group = v.shape[1] // q.shape[1]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    g = g.float()
    if g.dim() == 2:
        g = g[:, :, None]
    return q, k, v.float(), g, beta.float()


def _recurrent_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """One token for each of N independent states: q, k [N, H, Dk]; v [N, H, Dv]; g [N, H, Dk|1]; beta [N, H];
    S [N, H, Dk, Dv]. Returns (o [N, H, Dv], S after the token)."""
    S = S * g.exp()[..., None]
    predicted = (k[:, :, None, :] @ S).squeeze(2)
    update = beta[..., None] * (v - predicted)
    S = S + k[..., None] * update[:, :, None, :]
    return (q[:, :, None, :] @ S).squeeze(2), S


def _chunk_intra(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """The parts of chunks that do not depend on the state entering them. Inputs [n, H, C, ...] (g [n, H, C, Dg]).

    With G_t the cumulative log decay from the chunk's start through token t and S_0 the entering state, the state
    after token t is Gamma_t S_0 + sum_{j<=t} diag(exp(G_t - G_j)) k_j u_j^T, where u_j = beta_j (v_j - (decayed
    S_{j-1})^T k_j). Substituting gives a unit lower-triangular system (I + L) U = beta V - beta (K exp(G)) S_0 with
    L[t, j] = beta_t sum_d k_t[d] k_j[d] exp(G_t[d] - G_j[d]) (j < t): so U = U0 - W S_0 with U0 = (I+L)^-1 beta V and
    W = (I+L)^-1 beta K exp(G) (the UT transform). Then O = (Q exp(G)) S_0 + A U, A[t, j] the same decayed q.k
    product for j <= t, and the state leaving is exp(G_C) S_0 + (K exp(G_C - G))^T U. Every exponent is <= 0.
    Returns (U0, W, A, q exp(G), k exp(G_C - G), exp(G_C))."""
    size = q.shape[2]
    G = g.cumsum(dim=2)
    upper = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
    if G.shape[-1] == 1:
        decay = (G[..., :, None, 0] - G[..., None, :, 0]).masked_fill(upper, float("-inf")).exp()  # [n, H, C, C]
        kk = (k @ k.transpose(-1, -2)) * decay
        qk = (q @ k.transpose(-1, -2)) * decay
    else:
        decay = (G[:, :, :, None, :] - G[:, :, None, :, :]).masked_fill(upper[:, :, None], float("-inf")).exp()
        kk = torch.einsum("nhid,nhijd,nhjd->nhij", k, decay, k)
        qk = torch.einsum("nhid,nhijd,nhjd->nhij", q, decay, k)
    system = torch.eye(size, dtype=q.dtype, device=q.device) + (beta[..., None] * kk).tril(-1)
    rhs = torch.cat([beta[..., None] * v, beta[..., None] * k * G.exp()], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u0, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    G_end = G[:, :, -1:, :]
    return u0, w, qk, q * G.exp(), k * (G_end - G).exp(), G_end.squeeze(2).exp()


def _chunk_plan(lens: list[int], starts: list[int],
                save_after: list[list[int]]) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Chunks (seq, first row, length) of the sequences longer than one token, in order within each sequence, cut at
    its save points as well as every CHUNK tokens; and the saves (chunk id, seq, slot) taken at a chunk's end."""
    chunks: list[tuple[int, int, int]] = []
    saves: list[tuple[int, int, int]] = []
    for b, (length, start) in enumerate(zip(lens, starts)):
        if length <= 1:
            continue
        slot_of = {n: i for i, n in enumerate(save_after[b])}
        cuts = sorted(set(save_after[b]) | {length})
        pos = 0
        for cut in cuts:
            while pos < cut:
                size = min(CHUNK, cut - pos)
                pos += size
                if pos in slot_of and pos == cut:
                    saves.append((len(chunks), b, slot_of[pos]))
                chunks.append((b, start + pos - size, size))
    return chunks, saves


def _check_save_after(save_after: list[list[int]] | None, lens: list[int]) -> list[list[int]]:
    if save_after is None:
        return [[] for _ in lens]
    if len(save_after) != len(lens):
        raise ValueError(f"save_after must hold one list per sequence ({len(lens)}), got {len(save_after)}")
    for b, (points, length) in enumerate(zip(save_after, lens)):
        if any(not 1 <= n <= length for n in points) or any(a >= c for a, c in zip(points, points[1:])):
            raise ValueError(f"save_after[{b}] must be ascending within 1..{length} (the query length), got {points}")
    return [list(points) for points in save_after]


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, query_start_loc: Tensor,
                     state: Tensor, scale: float | None = None, qk_l2norm: bool = True,
                     save_after: list[list[int]] | None = None) -> tuple[Tensor, Tensor, list[list[Tensor]]]:
    """q, k [T, Hk, Dk]; v [T, Hv, Dv] with Hv a multiple of Hk (each q/k head serves Hv/Hk consecutive value heads);
    g: log decay, [T, Hv] (Gated DeltaNet: one per head) or [T, Hv, Dk] (KDA: one per key channel); beta [T, Hv];
    state [B, Hv, Dk, Dv] float32 (zeros for a fresh sequence). scale None = Dk ** -0.5. qk_l2norm: q and k
    L2-normalised per head in float32 first. Returns (out [T, Hv, Dv] in v.dtype, final_state [B, Hv, Dk, Dv] float32,
    saved): saved[b] holds, for each n in save_after[b] (ascending, 1 <= n <= that sequence's query length), the state
    after its first n tokens (float32 [Hv, Dk, Dv]). Sequences of one token go in one batched recurrent step, longer
    ones through the chunked form."""
    _check_delta(q, k, v, g, beta, state)
    lens_t = _query_lengths(query_start_loc, q.shape[0], state.shape[0])
    lens = lens_t.tolist()
    save_after = _check_save_after(save_after, lens)
    if _fla_applies(q):
        return _fla_gated_delta_rule(q, k, v, g, beta, query_start_loc, lens, state, scale, qk_l2norm, save_after)
    return _torch_gated_delta_rule(q, k, v, g, beta, query_start_loc, lens_t, lens, state, scale, qk_l2norm, save_after)


def _torch_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, query_start_loc: Tensor,
                            lens_t: Tensor, lens: list[int], state: Tensor, scale: float | None, qk_l2norm: bool,
                            save_after: list[list[int]]) -> tuple[Tensor, Tensor, list[list[Tensor]]]:
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, qk_l2norm)
    num_tokens, heads, dv = v.shape
    final = state.float().clone()
    out = torch.zeros(num_tokens, heads, dv, dtype=torch.float32, device=v.device)
    saved: list[list[Tensor]] = [[torch.empty(0)] * len(points) for points in save_after]

    single = torch.nonzero(lens_t == 1).flatten()
    if single.numel():  # decodes: one batched recurrent step
        rows = query_start_loc[:-1][single]
        out[rows], final[single] = _recurrent_step(q[rows], k[rows], v[rows], g[rows], beta[rows], final[single])
        for b in single.tolist():
            if save_after[b]:
                saved[b][0] = final[b].clone()

    chunks, saves = _chunk_plan(lens, query_start_loc[:-1].tolist(), save_after)
    if chunks:
        _chunked(q, k, v, g, beta, chunks, saves, final, out, saved)
    return out.to(out_dtype), final, saved


def _chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunks: list[tuple[int, int, int]],
             saves: list[tuple[int, int, int]], final: Tensor, out: Tensor, saved: list[list[Tensor]]) -> None:
    """Runs the planned chunks: the state-free parts of all chunks at once (in groups bounded by _PAIRWISE_BUDGET),
    then a scan whose step i takes the i-th chunk of every sequence together. Updates final, out, saved in place."""
    device = q.device
    seq = torch.tensor([c[0] for c in chunks], device=device)
    first = torch.tensor([c[1] for c in chunks], device=device)
    size = torch.tensor([c[2] for c in chunks], device=device)
    offsets = torch.arange(CHUNK, device=device)
    valid = offsets < size[:, None]  # [N, C]
    rows = torch.where(valid, first[:, None] + offsets, 0)

    heads, dg = q.shape[1], g.shape[2]
    group = max(1, _PAIRWISE_BUDGET // (heads * CHUNK * CHUNK * dg))
    parts = []
    for lo in range(0, len(chunks), group):
        sel = slice(lo, lo + group)
        sub_rows, sub_valid = rows[sel], valid[sel]
        picked = []
        for x in (q, k, v, g, beta):
            p = x[sub_rows] * sub_valid.view(*sub_valid.shape, *([1] * (x.dim() - 1)))
            picked.append(p.transpose(1, 2).contiguous())
        parts.append(_chunk_intra(*picked))
    u0, w, qk, q_dec, k_dec, end_decay = (torch.cat(xs) for xs in zip(*parts))

    ordinal: list[int] = []
    count: dict[int, int] = {}
    for b, _, _ in chunks:
        ordinal.append(count.get(b, 0))
        count[b] = ordinal[-1] + 1
    ordinal_t = torch.tensor(ordinal, device=device)
    save_at: dict[int, list[tuple[int, int]]] = {}
    for chunk_id, b, slot in saves:
        save_at.setdefault(chunk_id, []).append((b, slot))
    outputs = torch.empty(len(chunks), heads, CHUNK, out.shape[-1], dtype=torch.float32, device=device)
    for step in range(max(count.values())):
        ids = torch.nonzero(ordinal_t == step).flatten()
        seqs = seq[ids]
        S = final[seqs]
        u = u0[ids] - w[ids] @ S
        outputs[ids] = q_dec[ids] @ S + qk[ids] @ u
        S = end_decay[ids][..., None] * S + k_dec[ids].transpose(-1, -2) @ u
        final[seqs] = S
        for j, chunk_id in enumerate(ids.tolist()):
            for b, slot in save_at.get(chunk_id, ()):
                saved[b][slot] = S[j].clone()
    out[rows[valid]] = outputs.transpose(1, 2)[valid]


def gated_delta_rule_tree(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, seq_index: Tensor,
                          parent: Tensor, scale: float | None = None, qk_l2norm: bool = True) -> tuple[Tensor, Tensor]:
    """Draft trees: as causal_conv1d_tree, each token continues its parent's state (or its sequence's state when
    parent == -1). state [B, Hv, Dk, Dv]. Returns (out [T, Hv, Dv] in v.dtype, token_states [T, Hv, Dk, Dv] float32:
    the state after each token). The tokens of one depth go in one batched recurrent step."""
    _check_delta(q, k, v, g, beta, state)
    num_tokens, num_seqs = q.shape[0], state.shape[0]
    levels = _tree_levels(seq_index, parent, num_tokens, num_seqs)
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, qk_l2norm)
    table = torch.empty(num_seqs + num_tokens, *state.shape[1:], dtype=torch.float32, device=v.device)
    table[:num_seqs] = state.float()
    source = _tree_sources(seq_index, parent, num_seqs)
    out = torch.empty_like(v)
    for rows in levels:
        out[rows], table[num_seqs + rows] = _recurrent_step(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                                            table[source[rows]])
    return out.to(out_dtype), table[num_seqs:]


def gated_delta_rule_tree_padded(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                                 parent: Tensor, scale: float | None = None,
                                 qk_l2norm: bool = True) -> tuple[Tensor, Tensor]:
    """Draft trees laid out as B sequences of Q rows each, as causal_conv1d_tree_padded: q, k, v, g, beta with
    T = B * Q rows, state [B, Hv, Dk, Dv], parent [B, Q]. Returns (out [T, Hv, Dv] in v.dtype, row_states
    [T, Hv, Dk, Dv] float32). Every sequence's row t in one batched recurrent step: free of host syncs."""
    _check_delta(q, k, v, g, beta, state)
    num_seqs, query_len = _check_padded_tree(parent, q.shape[0], state.shape[0])
    out_dtype = v.dtype
    q, k, v, g, beta = (t.view(num_seqs, query_len, *t.shape[1:])
                        for t in _prepare(q, k, v, g, beta, scale, qk_l2norm))
    nodes = torch.zeros(num_seqs, query_len, *state.shape[1:], dtype=torch.float32, device=v.device)
    out = torch.empty_like(v)
    seqs = torch.arange(num_seqs, device=v.device)
    for t in range(query_len):
        before = _tree_predecessor(nodes, seqs, parent[:, t], state)
        out[:, t], nodes[:, t] = _recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], before)
    return out.view(-1, *out.shape[2:]).to(out_dtype), nodes.view(-1, *state.shape[1:])


def gated_delta_rule_decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                            scale: float | None = None, qk_l2norm: bool = True) -> tuple[Tensor, Tensor]:
    """One token per sequence (shapes as gated_delta_rule's with T = B): returns (out [B, Hv, Dv] in v.dtype, the state
    after the token [B, Hv, Dk, Dv] float32). Free of host syncs (a decode step's form for CUDA graphs and compiled
    decode)."""
    _check_delta(q, k, v, g, beta, state)
    if q.shape[0] != state.shape[0]:
        raise ValueError(f"a decode step has one token per state: {q.shape[0]} tokens, {state.shape[0]} states")
    if _fla_applies(q):
        return _fla_gated_delta_rule_decode(q, k, v, g, beta, state, scale, qk_l2norm)
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, qk_l2norm)
    out, final = _recurrent_step(q, k, v, g, beta, state.float())
    return out.to(out_dtype), final


# ------------------------------------------------------------------------------------------------ GPU libraries
# Optional (`pip install reasoning-engine[gpu-linear]`): flash-linear-attention for the delta rule, causal-conv1d for
# the decode conv. Used only for CUDA tensors when importable; everything else takes the torch path above.


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _fla_applies(q: Tensor) -> bool:
    return q.is_cuda and _importable("fla")


def _gpu_conv_update_applies(x: Tensor, lens: Tensor) -> bool:
    """causal-conv1d's update kernel takes one token per sequence; prefill keeps the torch path (its varlen kernel
    cannot start sequences from given states)."""
    return x.is_cuda and x.shape[0] == lens.numel() and bool((lens == 1).all()) and _importable("causal_conv1d")


def _gpu_causal_conv1d_update(x: Tensor, weight: Tensor, bias: Tensor | None, state: Tensor,
                              activation: str | None) -> tuple[Tensor, Tensor]:
    from causal_conv1d import causal_conv1d_update

    conv_state = state.clone()  # updated in place by the kernel; the caller's tensor stays as it was
    out = causal_conv1d_update(x, conv_state, weight, bias, activation)
    return out, conv_state


def _fla_functions(g: Tensor):
    """flash-linear-attention's (chunked, fused recurrent) kernels: KDA's for a per-channel decay, else Gated
    DeltaNet's."""
    if g.dim() == 3:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
        return chunk_kda, fused_recurrent_kda
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def _fla_gated_delta_rule_decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                                 scale: float | None, qk_l2norm: bool) -> tuple[Tensor, Tensor]:
    """The fused recurrent kernel over B sequences of one token each (its batch dimension; no cu_seqlens, which the
    library would read on the host)."""
    _, recurrent_fn = _fla_functions(g)
    group = v.shape[1] // q.shape[1]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    o, final = recurrent_fn(q=q[:, None], k=k[:, None], v=v[:, None], g=g[:, None].float(), beta=beta[:, None],
                            scale=scale, initial_state=state.float(), output_final_state=True,
                            use_qk_l2norm_in_kernel=qk_l2norm)
    return o[:, 0].to(v.dtype), final.float()


def _fla_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, query_start_loc: Tensor,
                          lens: list[int], state: Tensor, scale: float | None, qk_l2norm: bool,
                          save_after: list[list[int]]) -> tuple[Tensor, Tensor, list[list[Tensor]]]:
    """flash-linear-attention's varlen kernels (batch dim 1, cu_seqlens). The library returns final states only, so
    each sequence is cut at its save points and round r runs every sequence's r-th piece, from the previous round's
    states."""
    chunk_fn, recurrent_fn = _fla_functions(g)
    group = v.shape[1] // q.shape[1]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    starts = query_start_loc[:-1].tolist()
    pieces = [list(zip([0] + points, points + [length])) for points, length in zip(save_after, lens)]
    final = state.float().clone()
    out = torch.empty_like(v)
    saved: list[list[Tensor]] = [[] for _ in lens]
    for r in range(max((len(p) for p in pieces), default=0)):
        seqs = [b for b, p in enumerate(pieces) if r < len(p) and p[r][1] > p[r][0]]
        if not seqs:
            continue
        rows = torch.cat([torch.arange(starts[b] + pieces[b][r][0], starts[b] + pieces[b][r][1]) for b in seqs])
        rows = rows.to(q.device)
        seq_lens = torch.tensor([pieces[b][r][1] - pieces[b][r][0] for b in seqs])
        cu = F.pad(seq_lens.cumsum(0), (1, 0)).to(device=q.device, dtype=torch.long)
        fn = recurrent_fn if int(seq_lens.max()) == 1 else chunk_fn
        seq_t = torch.tensor(seqs, device=q.device)
        o, s = fn(q=q[rows][None], k=k[rows][None], v=v[rows][None], g=g[rows][None].float(), beta=beta[rows][None],
                  scale=scale, initial_state=final[seq_t], output_final_state=True,
                  use_qk_l2norm_in_kernel=qk_l2norm, cu_seqlens=cu)
        out[rows] = o[0].to(out.dtype)
        final[seq_t] = s.float()
        for j, b in enumerate(seqs):
            if r < len(save_after[b]):
                saved[b].append(final[b].clone())
    return out, final, saved
