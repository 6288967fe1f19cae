"""Linear-attention token mixers over per-sequence state slots: Gated DeltaNet (Qwen3-Next, Qwen3.5 / Qwen3.6;
Yang et al., 2024, arXiv:2412.06464) and Kimi Delta Attention (Kimi Linear, arXiv:2510.26692).

Each layer keeps two states per slot (engine/state_cache.py): the short causal convolution's last K-1 inputs, and the
recurrent matrix state [heads, key dim, value dim] in float32, as the references keep it. A step reads each sequence's
slot (or zeros for a sequence that starts fresh) and writes it back, and writes the snapshots the driver asked for
(`state_saves`: the state after n of the step's tokens, into a snapshot slot). A sequence verifying a draft tree
leaves its live slot alone: each node's state goes to a scratch slot of its own, and the driver copies the accepted
node's into the live slot at the start of the next step (`state_commits`), so a rejected branch costs nothing.

A decode step (one token per sequence, no draft, no snapshot written inside it: the snapshot of a sequence that runs
one token is its state after the step, which the worker copies out of the live slot then) gets
`DecodeStateMetadata`: its slot and zero-start flag per sequence as tensors, read with a gather and torch.where and
written back with index_copy_, so the step has no host sync and no shape that depends on a value. That is what lets
CUDA graphs replay it (padding rows point at the padding slot, which no request owns, and start from zeros) and
torch.compile trace it as one graph for every batch size. A CUDA-graph verification step (`PaddedTreeStateMetadata`)
is the same with every sequence padded to the bucket's query length: each row continues a parent row of its
sequence, found from the tree mask with tensor ops, and its state goes to a slot chosen the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.kernels import linear_attention as ops
from reasoning_engine.layers.linear import row_parallel
from reasoning_engine.parallel import Group


@dataclass
class LinearStateMetadata:
    """Which rows and slots a step's linear-attention layers read and write; built once per step for all layers."""

    plain_rows: torch.Tensor | None  # rows of the sequences without a draft; None: every row
    plain_qsl: torch.Tensor  # their query_start_loc
    plain_slots: torch.Tensor  # [Bp] int64
    plain_fresh: torch.Tensor  # [Bp] bool: start from zeros
    any_fresh: bool  # whether any plain sequence starts from zeros (decode steps: none)
    save_after: list[list[int]] | None  # per plain sequence, token counts to snapshot after
    save_index: list[tuple[int, int]]  # (plain sequence, token count) of each snapshot, in save_slots order
    save_slots: torch.Tensor | None  # [S] int64
    verify_rows: torch.Tensor | None  # rows of the sequences verifying a draft tree
    verify_seq: torch.Tensor | None  # [Tv] the verifying sequence (0..Bv-1) of each of those rows
    verify_parent: torch.Tensor | None  # [Tv] the row (within verify_rows) each node continues, -1: the live state
    verify_slots: torch.Tensor | None  # [Bv] live slots read
    verify_scratch: torch.Tensor | None  # [Tv] the scratch slot each node's state is written to


@dataclass
class DecodeStateMetadata:
    """A decode step's state addressing: per sequence the slot it reads and writes and whether it starts from zeros
    (tensors only, so one captured or compiled graph serves every step of its batch size)."""

    slots: torch.Tensor  # [B] int64
    fresh: torch.Tensor  # [B] bool

    @property
    def targets(self) -> torch.Tensor:
        """The slot each row's state is written to: its own."""
        return self.slots


@dataclass
class PaddedTreeStateMetadata:
    """A CUDA-graph verification step's state addressing (engine/cuda_graph.py): B sequences of Q rows each, sequence
    b's from row b * Q; per sequence its slot and zero-start flag, per row the row of its sequence it continues (-1: the
    slot's state) and the slot its state is written to."""

    slots: torch.Tensor  # [B] int64
    fresh: torch.Tensor  # [B] bool
    parent: torch.Tensor  # [B, Q] int64
    targets: torch.Tensor  # [B * Q] int64


def padded_tree_state(slots: torch.Tensor, fresh: torch.Tensor, scratch: torch.Tensor, tree_mask: torch.Tensor,
                      padding_slot: int) -> PaddedTreeStateMetadata:
    """The addressing of B sequences of Q rows from tensors alone (the buffers a CUDA graph replays over): `scratch`
    [B], a verifying sequence's first scratch slot or -1 for one that decodes; `tree_mask` [B * Q, Q], the rows of
    its sequence each row sees, itself included (padding rows: only themselves). A row's parent is the nearest row it
    sees before it (its ancestors come in order); a verifying sequence's row t writes its scratch slot t (padding rows
    too: within its own Q scratch slots, never read), a decoding sequence's first row its live slot, any other row the
    padding slot."""
    num_seqs, query_len = slots.shape[0], tree_mask.shape[1]
    cols = torch.arange(query_len, device=slots.device)
    earlier = tree_mask.view(num_seqs, query_len, query_len) & (cols.view(1, -1) < cols.view(-1, 1))
    parent = torch.where(earlier, cols, -1).amax(dim=-1)
    first = scratch.view(-1, 1).expand(num_seqs, query_len)
    live = torch.where(cols == 0, slots.view(-1, 1), padding_slot)
    targets = torch.where(first >= 0, first + cols, live).reshape(-1)
    return PaddedTreeStateMetadata(slots, fresh, parent, targets)


def is_decode_state_step(batch: ForwardBatch) -> bool:
    """One token per sequence (so none verifies a draft) and no snapshot to write inside the step."""
    return batch.max_query_len == 1 and not any(batch.state_saves or ())


def fits_padded_tree(batch: ForwardBatch) -> bool:
    """Whether a step with a tree mask can run as `PaddedTreeStateMetadata`: every sequence verifies a draft or
    decodes one token (no prefill chunk), and no snapshot is written inside the step."""
    scratch = batch.state_scratch or [-1] * len(batch.query_lens_cpu)
    return (not any(batch.state_saves or ())
            and all(n == 1 for n, first in zip(batch.query_lens_cpu, scratch) if first < 0))


def prepare_state(batch: ForwardBatch) -> LinearStateMetadata | DecodeStateMetadata:
    """The step's state addressing from the batch's per-sequence fields (`state_slots`, `state_fresh`,
    `state_saves`, `state_scratch`) and, for drafts, its tree mask: a decode step's in tensors alone, any other's
    as host-side plans (LinearStateMetadata)."""
    if is_decode_state_step(batch):
        return DecodeStateMetadata(batch.state_slots, batch.state_fresh)
    dev = batch.input_ids.device
    lens = batch.query_lens_cpu
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    scratch = batch.state_scratch or [-1] * len(lens)
    slots = batch.state_slots.tolist()
    fresh = batch.state_fresh.tolist()
    plain = [b for b in range(len(lens)) if scratch[b] < 0]
    verify = [b for b in range(len(lens)) if scratch[b] >= 0]
    saves = batch.state_saves or [[] for _ in lens]
    save_after = [[n for n, _ in saves[b]] for b in plain]
    save_index = [(j, n) for j, b in enumerate(plain) for n, _ in saves[b]]
    save_slots = [slot for b in plain for _, slot in saves[b]]
    plain_qsl = [0]
    for b in plain:
        plain_qsl.append(plain_qsl[-1] + lens[b])
    plain_rows = None
    if verify:
        plain_rows = torch.tensor([r for b in plain for r in range(starts[b], starts[b + 1])], dtype=torch.long, device=dev)
    meta = LinearStateMetadata(
        plain_rows=plain_rows,
        plain_qsl=torch.tensor(plain_qsl, dtype=torch.long, device=dev),
        plain_slots=torch.tensor([slots[b] for b in plain], dtype=torch.long, device=dev),
        plain_fresh=torch.tensor([fresh[b] for b in plain], dtype=torch.bool, device=dev),
        any_fresh=any(fresh[b] for b in plain),
        save_after=save_after if save_slots else None,
        save_index=save_index,
        save_slots=torch.tensor(save_slots, dtype=torch.long, device=dev) if save_slots else None,
        verify_rows=None, verify_seq=None, verify_parent=None, verify_slots=None, verify_scratch=None)
    if verify:
        rows, seq, parent, node_slots = [], [], [], []
        mask = batch.tree_mask.cpu()
        for j, b in enumerate(verify):
            base = len(rows)
            for t in range(lens[b]):
                row = starts[b] + t
                ancestors = [u for u in range(t) if mask[row, u]]
                rows.append(row)
                seq.append(j)
                parent.append(base + ancestors[-1] if ancestors else -1)
                node_slots.append(scratch[b] + t)
        meta.verify_rows = torch.tensor(rows, dtype=torch.long, device=dev)
        meta.verify_seq = torch.tensor(seq, dtype=torch.long, device=dev)
        meta.verify_parent = torch.tensor(parent, dtype=torch.long, device=dev)
        meta.verify_slots = torch.tensor([slots[b] for b in verify], dtype=torch.long, device=dev)
        meta.verify_scratch = torch.tensor(node_slots, dtype=torch.long, device=dev)
    return meta


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's output, then times act(gate): the output norm of Gated DeltaNet (SiLU) and KDA
    (sigmoid)."""

    def __init__(self, dim: int, eps: float, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ("silu", "sigmoid"):
            raise ValueError(f"gated norm activation must be 'silu' or 'sigmoid', got {activation!r}")
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.activation = F.silu if activation == "silu" else torch.sigmoid

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * self.activation(gate.float())).to(x.dtype)


class LinearAttention(nn.Module):
    """What every delta-rule mixer shares: the convolution and recurrent states in slots, the conv over q/k/v, the
    delta rule over the step's sequences (plain ones in chunks, draft trees node by node), snapshots and scratch."""

    def __init__(self, conv_dim: int, conv_kernel: int, num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int) -> None:
        super().__init__()
        self.conv_dim, self.conv_kernel = conv_dim, conv_kernel
        self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim = num_k_heads, num_v_heads, k_dim, v_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_kernel, groups=conv_dim, bias=False)
        self.conv_state: torch.Tensor | None = None  # [slots, conv_dim, K-1]
        self.recurrent_state: torch.Tensor | None = None  # [slots, Hv, Dk, Dv] float32

    def state_shapes(self, num_slots: int) -> list[tuple[tuple[int, ...], torch.dtype | None]]:
        """The per-slot tensors (None dtype: the model's)."""
        return [((num_slots, self.conv_dim, self.conv_kernel - 1), None),
                ((num_slots, self.num_v_heads, self.k_dim, self.v_dim), torch.float32)]

    def bind_state(self, tensors: list[torch.Tensor]) -> None:
        self.conv_state, self.recurrent_state = tensors

    def conv(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The short causal conv (with SiLU) of x [T, conv_dim], reading and updating the conv states."""
        meta = batch.state_metadata
        weight = self.conv1d.weight.view(self.conv_dim, self.conv_kernel)
        if isinstance(meta, (DecodeStateMetadata, PaddedTreeStateMetadata)):
            state = _slot_states(self.conv_state, meta)
            if isinstance(meta, DecodeStateMetadata):
                out, written = ops.causal_conv1d_decode(x, weight, None, state)
            else:
                out, written = ops.causal_conv1d_tree_padded(x, weight, None, state, meta.parent)
            self.conv_state.index_copy_(0, meta.targets, written)
            return out
        out = torch.empty_like(x)
        xp = x if meta.plain_rows is None else x[meta.plain_rows]
        if xp.shape[0]:
            state = self.conv_state[meta.plain_slots]
            if meta.any_fresh:
                state = state.masked_fill(meta.plain_fresh[:, None, None], 0)
            yp, final = ops.causal_conv1d(xp, weight, None, meta.plain_qsl, state)
            if meta.save_slots is not None:
                self.conv_state[meta.save_slots] = _conv_states_after(state, xp, meta)
            self.conv_state[meta.plain_slots] = final.to(self.conv_state.dtype)
            if meta.plain_rows is None:
                out = yp
            else:
                out[meta.plain_rows] = yp
        if meta.verify_rows is not None:
            xv = x[meta.verify_rows]
            state = self.conv_state[meta.verify_slots]
            yv, node_states = ops.causal_conv1d_tree(xv, weight, None, state, meta.verify_seq, meta.verify_parent)
            self.conv_state[meta.verify_scratch] = node_states.to(self.conv_state.dtype)
            out[meta.verify_rows] = yv
        return out

    def delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   batch: ForwardBatch) -> torch.Tensor:
        """The gated delta rule over the step's sequences; q, k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv] or [T, Hv, Dk],
        beta [T, Hv]; returns [T, Hv, Dv]."""
        meta = batch.state_metadata
        if isinstance(meta, (DecodeStateMetadata, PaddedTreeStateMetadata)):
            state = _slot_states(self.recurrent_state, meta)
            if isinstance(meta, DecodeStateMetadata):
                out, written = ops.gated_delta_rule_decode(q, k, v, g, beta, state)
            else:
                out, written = ops.gated_delta_rule_tree_padded(q, k, v, g, beta, state, meta.parent)
            self.recurrent_state.index_copy_(0, meta.targets, written)
            return out
        out = torch.empty_like(v)
        rows = meta.plain_rows
        if rows is None or rows.numel():
            pick = (lambda t: t) if rows is None else (lambda t: t[rows])
            state = self.recurrent_state[meta.plain_slots]
            if meta.any_fresh:
                state = state.masked_fill(meta.plain_fresh[:, None, None, None], 0)
            o, final, saved = ops.gated_delta_rule(pick(q), pick(k), pick(v), pick(g), pick(beta), meta.plain_qsl,
                                                   state, save_after=meta.save_after)
            self.recurrent_state[meta.plain_slots] = final
            if meta.save_slots is not None:
                self.recurrent_state[meta.save_slots] = torch.stack([s for per_seq in saved for s in per_seq])
            if rows is None:
                out = o
            else:
                out[rows] = o
        if meta.verify_rows is not None:
            r = meta.verify_rows
            state = self.recurrent_state[meta.verify_slots]
            o, node_states = ops.gated_delta_rule_tree(q[r], k[r], v[r], g[r], beta[r], state, meta.verify_seq,
                                                       meta.verify_parent)
            self.recurrent_state[meta.verify_scratch] = node_states
            out[r] = o
        return out


def _slot_states(states: torch.Tensor, meta: DecodeStateMetadata | PaddedTreeStateMetadata) -> torch.Tensor:
    """Each sequence's state from its slot, zeros where it starts fresh: a gather and a select, no host sync."""
    return torch.where(meta.fresh.view(-1, *[1] * (states.dim() - 1)), 0, states[meta.slots])


def _conv_states_after(state: torch.Tensor, x: torch.Tensor, meta: LinearStateMetadata) -> torch.Tensor:
    """The conv state after n tokens of each snapshot's sequence: the last K-1 inputs of its state then its tokens."""
    qsl = meta.plain_qsl.tolist()
    width = state.shape[-1]
    out = []
    for seq, n in meta.save_index:
        history = torch.cat([state[seq], x[qsl[seq] : qsl[seq] + n].t().to(state.dtype)], dim=-1)
        out.append(history[:, history.shape[-1] - width :])
    return torch.stack(out)


class GatedDeltaNet(LinearAttention):
    """Qwen3-Next's and Qwen3.5's linear-attention layer: q, k, v through the short conv, L2-normalised q and k,
    a decay per value head g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), the gated delta rule, a gated
    RMSNorm per head with z, the output projection. `fused_projections`: Qwen3-Next's in_proj_qkvz / in_proj_ba,
    whose rows come grouped per key head; else Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a. Under
    tensor parallelism a rank keeps 1 / tp of the key and of the value heads (value head j reads key head j // (Hv /
    Hk), so the shares line up), with their conv channels and states; out_proj sums the ranks' parts."""

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int, conv_kernel: int,
                 eps: float, fused_projections: bool, tp: Group = Group()) -> None:
        num_k_heads, num_v_heads = num_k_heads // tp.size, num_v_heads // tp.size
        key, value = num_k_heads * k_dim, num_v_heads * v_dim
        super().__init__(2 * key + value, conv_kernel, num_k_heads, num_v_heads, k_dim, v_dim)
        self.fused_projections = fused_projections
        if fused_projections:
            self.in_proj_qkvz = nn.Linear(hidden_size, 2 * key + 2 * value, bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, 2 * key + value, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, value, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads))
        self.norm = GatedRMSNorm(v_dim, eps)
        self.out_proj = row_parallel(value * tp.size, hidden_size, False, tp)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, k, v) concatenated as the conv reads them [T, conv_dim], z [T, Hv, Dv], b and a [T, Hv]."""
        t, hk, hv = x.shape[0], self.num_k_heads, self.num_v_heads
        dk, dv, r = self.k_dim, self.v_dim, self.num_v_heads // self.num_k_heads
        if self.fused_projections:  # per key head: q, k, its r value heads' v, their z
            q, k, v, z = self.in_proj_qkvz(x).view(t, hk, 2 * dk + 2 * r * dv).split([dk, dk, r * dv, r * dv], dim=-1)
            b, a = self.in_proj_ba(x).view(t, hk, 2 * r).split([r, r], dim=-1)
            mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
            return mixed, z.reshape(t, hv, dv), b.reshape(t, hv), a.reshape(t, hv)
        return (self.in_proj_qkv(x), self.in_proj_z(x).view(t, hv, dv), self.in_proj_b(x), self.in_proj_a(x))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        mixed, z, b, a = self._project(x)
        mixed = self.conv(mixed, batch)
        key, value = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        q, k, v = mixed.split([key, key, value], dim=-1)
        q = q.reshape(t, self.num_k_heads, self.k_dim)
        k = k.reshape(t, self.num_k_heads, self.k_dim)
        v = v.reshape(t, self.num_v_heads, self.v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        o = self.delta_rule(q, k, v, g, beta, batch)
        return self.out_proj(self.norm(o, z).reshape(t, -1))


class KimiDeltaAttention(LinearAttention):
    """Kimi Linear's linear-attention layer (KDA): q, k, v (as many key as value heads) through the short conv,
    L2-normalised q and k, a decay per key channel g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias) (low-rank), or
    with a `gate_lower_bound` b (GLM-5.3-Flash's "safe gate") g = b * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias)),
    beta = sigmoid(b_proj(x)), the gated delta rule, an RMSNorm per head times sigmoid(g_b(g_a(x))), the output
    projection. q/k/v are one fused projection here (the checkpoints keep them and their convs apart)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int, eps: float,
                 tp: Group = Group(), gate_lower_bound: float | None = None) -> None:
        """`num_heads` is the model's; this rank keeps 1 / tp.size of them, with their channels of every projection
        that has one per head (the low-rank f_a / g_a and the norm weight are whole on every rank)."""
        num_heads //= tp.size
        width = num_heads * head_dim
        super().__init__(3 * width, conv_kernel, num_heads, num_heads, head_dim, head_dim)
        self.gate_lower_bound = gate_lower_bound
        self.qkv_proj = nn.Linear(hidden_size, 3 * width, bias=False)
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, width, bias=False)
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(width))
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, width, bias=False)
        self.o_norm = GatedRMSNorm(head_dim, eps, activation="sigmoid")
        self.o_proj = row_parallel(width * tp.size, hidden_size, False, tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_k_heads, self.k_dim
        q, k, v = self.conv(self.qkv_proj(x), batch).view(t, 3, h, d).unbind(1)
        logits = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(t, h, d)
        if self.gate_lower_bound is None:
            g = -self.A_log.float().exp()[:, None] * F.softplus(logits)
        else:
            g = self.gate_lower_bound * torch.sigmoid(self.A_log.float().exp()[:, None] * logits)
        beta = self.b_proj(x).sigmoid()
        o = self.delta_rule(q, k, v, g, beta, batch)
        gate = self.g_b_proj(self.g_a_proj(x)).view(t, h, d)
        return self.o_proj(self.o_norm(o, gate).reshape(t, -1))
