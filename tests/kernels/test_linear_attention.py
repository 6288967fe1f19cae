"""kernels/linear_attention.py against transformers' own torch functions for Qwen3-Next (Gated DeltaNet, causal conv)
and Kimi Linear (KDA), run one sequence at a time; ragged batches, carried states, saved prefix states, draft trees.

Tolerances: float32 1e-5 (relative and absolute; the values are O(1)); bfloat16 inputs are compared after the output's
rounding to bfloat16, 2e-2."""

import pytest
import torch
from transformers.models.kimi_linear import modeling_kimi_linear as kimi
from transformers.models.qwen3_next import modeling_qwen3_next as qwen

from reasoning_engine.kernels import linear_attention as la

LENS = [1, 5, 64, 130]
HK, HV, DK, DV = 2, 4, 16, 8
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _ragged(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lens).cumsum(0)


def _delta_inputs(lens: list[int], per_channel: bool, dtype: torch.dtype = torch.float32) -> dict:
    total, num_seqs = sum(lens), len(lens)
    g = -torch.rand(total, HV, DK) * 0.5 if per_channel else -torch.rand(total, HV) * 0.5
    return dict(q=torch.randn(total, HK, DK, dtype=dtype), k=torch.randn(total, HK, DK, dtype=dtype),
                v=torch.randn(total, HV, DV, dtype=dtype), g=g, beta=torch.rand(total, HV, dtype=dtype),
                state=torch.randn(num_seqs, HV, DK, DV) * 0.1)


def _reference_delta(x: dict, rows: slice | torch.Tensor, state: torch.Tensor, chunked: bool = True):
    """transformers' function for one sequence (batch dim 1): Qwen3-Next's for a per-head g, Kimi Linear's for a
    per-channel one (whose q, k have the value heads already)."""
    q, k, v, g, beta = (x[n][rows][None] for n in ("q", "k", "v", "g", "beta"))
    if g.dim() == 4:
        q, k = (t.repeat_interleave(HV // HK, dim=2) for t in (q, k))
        fn = kimi.chunk_kimi_delta_attention if chunked else kimi.recurrent_kimi_delta_attention
    else:
        fn = qwen.torch_chunk_gated_delta_rule if chunked else qwen.torch_recurrent_gated_delta_rule
    out, final = fn(q, k, v, g, beta, initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_deltanet", "kda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_matches_transformers_per_sequence(per_channel, dtype):
    x = _delta_inputs(LENS, per_channel, dtype)
    qsl = _ragged(LENS)
    out, final, saved = la.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], qsl, x["state"])
    assert out.dtype == dtype and out.shape == (sum(LENS), HV, DV)
    assert final.dtype == torch.float32 and saved == [[] for _ in LENS]
    for b in range(len(LENS)):
        rows = slice(int(qsl[b]), int(qsl[b + 1]))
        ref_out, ref_state = _reference_delta(x, rows, x["state"][b])
        _close(out[rows], ref_out, TOL[dtype])
        _close(final[b], ref_state, TOL[torch.float32] if dtype == torch.float32 else 1e-4)
        if LENS[b] <= 5:  # the token-by-token references agree too
            rec_out, rec_state = _reference_delta(x, rows, x["state"][b], chunked=False)
            _close(out[rows], rec_out, TOL[dtype])
            _close(final[b], rec_state, TOL[torch.float32] if dtype == torch.float32 else 1e-4)


def test_decode_batch_and_explicit_scale_without_l2norm():
    lens = [1, 1, 1]
    x = _delta_inputs(lens, per_channel=False)
    out, final, _ = la.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], _ragged(lens), x["state"],
                                        scale=0.3, qk_l2norm=False)
    for b in range(3):
        S = x["state"][b] * x["g"][b].exp()[:, None, None]
        k = x["k"][b].repeat_interleave(2, 0)
        q = x["q"][b].repeat_interleave(2, 0) * 0.3
        S = S + k[:, :, None] * (x["beta"][b][:, None] * (x["v"][b] - torch.einsum("hkv,hk->hv", S, k)))[:, None, :]
        _close(final[b], S, 1e-5)
        _close(out[b], torch.einsum("hkv,hk->hv", S, q), 1e-5)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_deltanet", "kda"])
def test_saved_states_equal_running_the_prefix_alone(per_channel):
    x = _delta_inputs(LENS, per_channel)
    qsl = _ragged(LENS)
    save_after = [[1], [2, 5], [16, 64], [3, 64, 100, 130]]
    _, final, saved = la.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], qsl, x["state"],
                                          save_after=save_after)
    for b, points in enumerate(save_after):
        assert len(saved[b]) == len(points)
        for n, snapshot in zip(points, saved[b]):
            start = int(qsl[b])
            _, ref_state = _reference_delta(x, slice(start, start + n), x["state"][b])
            _close(snapshot, ref_state, 1e-5)
        if points[-1] == LENS[b]:
            _close(saved[b][-1], final[b], 1e-6)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_deltanet", "kda"])
def test_prefill_split_in_two_calls_equals_one_call(per_channel):
    lens = [130, 70]
    x = _delta_inputs(lens, per_channel)
    out, final, _ = la.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], _ragged(lens), x["state"])
    first, second = [50, 33], [80, 37]
    rows_a = torch.cat([torch.arange(0, 50), torch.arange(130, 163)])
    rows_b = torch.cat([torch.arange(50, 130), torch.arange(163, 200)])
    part = lambda rows: [x[n][rows] for n in ("q", "k", "v", "g", "beta")]  # noqa: E731
    out_a, mid, _ = la.gated_delta_rule(*part(rows_a), _ragged(first), x["state"])
    out_b, end, _ = la.gated_delta_rule(*part(rows_b), _ragged(second), mid)
    _close(out_a, out[rows_a], 1e-5)
    _close(out_b, out[rows_b], 1e-5)
    _close(end, final, 1e-5)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_deltanet", "kda"])
def test_random_batches_with_empty_sequences_strong_decay_and_saves(per_channel):
    """Random lengths (0 included), random save points and decays strong enough that a chunk's cumulative decay
    underflows exp: every output, final and saved state equals the token-by-token reference; nothing is NaN."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        lens = torch.randint(0, 140, (5,), generator=gen).tolist() + [0, 1]
        x = _delta_inputs(lens, per_channel)
        x["g"] = x["g"] * 20
        save_after = [sorted(set(torch.randint(1, n + 1, (3,), generator=gen).tolist())) if n else [] for n in lens]
        qsl = _ragged(lens)
        out, final, saved = la.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], qsl, x["state"],
                                                save_after=save_after)
        assert not out.isnan().any() and not final.isnan().any()
        for b, n in enumerate(lens):
            start = int(qsl[b])
            if n == 0:
                torch.testing.assert_close(final[b], x["state"][b], rtol=0, atol=0)
                continue
            ref_out, ref_state = _reference_delta(x, slice(start, start + n), x["state"][b], chunked=False)
            _close(out[start:start + n], ref_out, 1e-5)
            _close(final[b], ref_state, 1e-5)
            for point, snapshot in zip(save_after[b], saved[b]):
                _, ref_saved = _reference_delta(x, slice(start, start + point), x["state"][b], chunked=False)
                _close(snapshot, ref_saved, 1e-5)


def _forest() -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Two sequences' draft trees: seq 0 a branching tree of 6 tokens, seq 1 a chain of 3, rows interleaved (parents
    first). Returns (seq_index, parent, root-to-leaf paths as row lists)."""
    seq_index = torch.tensor([0, 1, 0, 0, 1, 0, 1, 0, 0])
    parent = torch.tensor([-1, -1, 0, 0, 1, 2, 4, 2, 3])
    paths = [[0, 2, 5], [0, 2, 7], [0, 3, 8], [1, 4, 6]]
    return seq_index, parent, paths


@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_deltanet", "kda"])
def test_tree_equals_each_root_to_leaf_path_as_a_sequence(per_channel):
    seq_index, parent, paths = _forest()
    x = _delta_inputs([9], per_channel)
    state = torch.randn(2, HV, DK, DV) * 0.1
    out, token_states = la.gated_delta_rule_tree(x["q"], x["k"], x["v"], x["g"], x["beta"], state, seq_index, parent)
    assert token_states.shape == (9, HV, DK, DV)
    for path in paths:
        rows = torch.tensor(path)
        b = int(seq_index[path[0]])
        ref_out, _ = _reference_delta(x, rows, state[b])
        _close(out[rows], ref_out, 1e-5)
        for depth, row in enumerate(path):
            _, ref_state = _reference_delta(x, rows[: depth + 1], state[b])
            _close(token_states[row], ref_state, 1e-5)


# ---------------------------------------------------------------------------------------------------- conv


def _conv_inputs(lens: list[int], channels: int = 6, width: int = 4, dtype=torch.float32) -> dict:
    return dict(x=torch.randn(sum(lens), channels, dtype=dtype), weight=torch.randn(channels, width, dtype=dtype),
                bias=torch.randn(channels, dtype=dtype), state=torch.randn(len(lens), channels, width - 1, dtype=dtype))


def _reference_conv(x: torch.Tensor, weight, bias, state: torch.Tensor, activation):
    """transformers' causal_conv1d_update on one sequence ([1, C, L]), which also advances the state in place."""
    if x.shape[0] == 0:  # a sequence with no tokens this step keeps its state
        return x, state
    conv_state = state[None].clone()
    out = qwen.causal_conv1d_update(x.t()[None], conv_state, weight, bias, activation=activation)
    return out[0].t(), conv_state[0]


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_mixed_batch_matches_transformers(activation, dtype):
    lens = [1, 5, 64, 2, 0]
    c = _conv_inputs(lens, dtype=dtype)
    qsl = _ragged(lens)
    out, final = la.causal_conv1d(c["x"], c["weight"], c["bias"], qsl, c["state"], activation=activation)
    assert out.dtype == dtype and final.shape == c["state"].shape
    for b in range(len(lens)):
        rows = slice(int(qsl[b]), int(qsl[b + 1]))
        ref_out, ref_state = _reference_conv(c["x"][rows], c["weight"], c["bias"], c["state"][b], activation)
        _close(out[rows], ref_out, TOL[dtype])
        torch.testing.assert_close(final[b], ref_state.to(final.dtype), rtol=0, atol=0)  # a copy of inputs


def test_conv_fresh_sequence_matches_causal_conv1d_fn():
    c = _conv_inputs([7])
    out, final = la.causal_conv1d(c["x"], c["weight"], c["bias"], _ragged([7]), torch.zeros_like(c["state"]))
    ref = qwen.causal_conv1d_fn(c["x"].t()[None], c["weight"], c["bias"], activation="silu")[0].t()
    _close(out, ref, 1e-5)
    torch.testing.assert_close(final[0], c["x"][-3:].t())


def test_conv_split_in_two_calls_equals_one_call():
    c = _conv_inputs([9, 2])
    out, final = la.causal_conv1d(c["x"], c["weight"], c["bias"], _ragged([9, 2]), c["state"])
    rows_a, rows_b = torch.tensor([0, 1, 9]), torch.tensor([2, 3, 4, 5, 6, 7, 8, 10])
    out_a, mid = la.causal_conv1d(c["x"][rows_a], c["weight"], c["bias"], _ragged([2, 1]), c["state"])
    out_b, end = la.causal_conv1d(c["x"][rows_b], c["weight"], c["bias"], _ragged([7, 1]), mid)
    _close(torch.cat([out_a, out_b])[torch.argsort(torch.cat([rows_a, rows_b]))], out, 1e-6)
    torch.testing.assert_close(end, final)


def test_conv_tree_equals_each_root_to_leaf_path_as_a_sequence():
    seq_index, parent, paths = _forest()
    c = _conv_inputs([9])
    state = torch.randn(2, 6, 3)
    out, token_states = la.causal_conv1d_tree(c["x"], c["weight"], c["bias"], state, seq_index, parent)
    assert token_states.shape == (9, 6, 3)
    for path in paths:
        rows = torch.tensor(path)
        b = int(seq_index[path[0]])
        ref_out, _ = _reference_conv(c["x"][rows], c["weight"], c["bias"], state[b], "silu")
        _close(out[rows], ref_out, 1e-5)
        for depth, row in enumerate(path):
            _, ref_state = _reference_conv(c["x"][rows[: depth + 1]], c["weight"], c["bias"], state[b], "silu")
            torch.testing.assert_close(token_states[row], ref_state)


# ------------------------------------------------------------------------------- decode and padded-tree forms


@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_deltanet", "kda"])
def test_decode_forms_match_transformers(per_channel):
    """One token per sequence (the forms CUDA graphs and compiled decode run): transformers' recurrent step and conv
    update per sequence."""
    x = _delta_inputs([1, 1, 1], per_channel)
    out, final = la.gated_delta_rule_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
    c = _conv_inputs([1, 1, 1])
    conv_out, conv_final = la.causal_conv1d_decode(c["x"], c["weight"], c["bias"], c["state"])
    for b in range(3):
        ref_out, ref_state = _reference_delta(x, slice(b, b + 1), x["state"][b], chunked=False)
        _close(out[b : b + 1], ref_out, 1e-5)
        _close(final[b], ref_state, 1e-5)
        ref_out, ref_state = _reference_conv(c["x"][b : b + 1], c["weight"], c["bias"], c["state"][b], "silu")
        _close(conv_out[b : b + 1], ref_out, 1e-5)
        torch.testing.assert_close(conv_final[b], ref_state)
    with pytest.raises(ValueError, match="one token per state"):
        la.gated_delta_rule_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"][:2])
    with pytest.raises(ValueError, match="one token per state"):
        la.causal_conv1d_decode(c["x"], c["weight"], c["bias"], c["state"][:2])


def _padded_forest(query_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_forest`'s two trees laid out as a verification bucket lays them out: sequence b's rows from b * query_len,
    its padding rows (parent -1) after them. Returns (padded parent [2, Q], the padded row of each forest row, and
    the forest's seq_index and parent)."""
    seq_index, parent, _ = _forest()
    rank = [int((seq_index[:r] == seq_index[r]).sum()) for r in range(len(seq_index))]  # position within its tree
    place = torch.tensor([int(seq_index[r]) * query_len + rank[r] for r in range(len(seq_index))])
    padded = torch.full((2, query_len), -1)
    for r in range(len(seq_index)):
        if parent[r] >= 0:
            padded[seq_index[r], rank[r]] = rank[int(parent[r])]
    return padded, place, seq_index, parent


@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_deltanet", "kda"])
def test_padded_tree_equals_the_ragged_tree(per_channel):
    """A verification bucket's layout (two trees of 6 and 3 tokens padded to 8 rows each) gives the ragged tree
    form's outputs and states on the real rows, conv and delta rule."""
    padded, place, seq_index, parent = _padded_forest(8)
    x = _delta_inputs([16], per_channel)
    state = torch.randn(2, HV, DK, DV) * 0.1
    out, rows = la.gated_delta_rule_tree_padded(x["q"], x["k"], x["v"], x["g"], x["beta"], state, padded)
    ref_out, ref_rows = la.gated_delta_rule_tree(*(x[n][place] for n in ("q", "k", "v", "g", "beta")), state,
                                                 seq_index, parent)
    assert out.shape == (16, HV, DV) and rows.shape == (16, HV, DK, DV)
    _close(out[place], ref_out, 1e-6)
    _close(rows[place], ref_rows, 1e-6)
    c = _conv_inputs([16])
    conv_state = torch.randn(2, 6, 3)
    conv_out, conv_rows = la.causal_conv1d_tree_padded(c["x"], c["weight"], c["bias"], conv_state, padded)
    ref_out, ref_rows = la.causal_conv1d_tree(c["x"][place], c["weight"], c["bias"], conv_state, seq_index, parent)
    _close(conv_out[place], ref_out, 1e-6)
    torch.testing.assert_close(conv_rows[place], ref_rows)
    with pytest.raises(ValueError, match="parent must be"):
        la.gated_delta_rule_tree_padded(x["q"], x["k"], x["v"], x["g"], x["beta"], state, padded[:, :5])


def test_gpu_library_decode_uses_the_batch_dimension(monkeypatch):
    """flash-linear-attention's fused recurrent kernel for a decode step, stood in for by transformers' function:
    B sequences of one token on its batch dimension (cu_seqlens, which it would read on the host, left out)."""
    import sys
    import types

    def library(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens=None):
        assert cu_seqlens is None and q.shape[1] == 1 and q.shape[2] == v.shape[2] and output_final_state
        return qwen.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                     output_final_state=True,
                                                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule"):
        module = types.ModuleType(name)
        module.chunk_gated_delta_rule = module.fused_recurrent_gated_delta_rule = library
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(la, "_fla_applies", lambda q: True)
    x = _delta_inputs([1, 1, 1], per_channel=False)
    out, final = la.gated_delta_rule_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
    monkeypatch.setattr(la, "_fla_applies", lambda q: False)
    want_out, want_final = la.gated_delta_rule_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
    _close(out, want_out, 1e-5)
    _close(final, want_final, 1e-5)


# ---------------------------------------------------------------------------------------------------- input checks


def test_bad_inputs_raise_value_errors_naming_the_field():
    x = _delta_inputs([3], per_channel=False)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match="query_start_loc"):
        la.gated_delta_rule(*args, torch.tensor([0, 2]), x["state"])
    with pytest.raises(ValueError, match="save_after"):
        la.gated_delta_rule(*args, _ragged([3]), x["state"], save_after=[[4]])
    with pytest.raises(ValueError, match="save_after"):
        la.gated_delta_rule(*args, _ragged([3]), x["state"], save_after=[[2, 2]])
    with pytest.raises(ValueError, match="g must be"):
        la.gated_delta_rule(x["q"], x["k"], x["v"], x["g"][:, :1], x["beta"], _ragged([3]), x["state"])
    with pytest.raises(ValueError, match="parent"):  # a cycle would never finish the depth walk
        la.gated_delta_rule_tree(*args, x["state"], torch.zeros(3, dtype=torch.long), torch.tensor([-1, 2, 1]))
    c = _conv_inputs([3])
    with pytest.raises(ValueError, match="activation"):
        la.causal_conv1d(c["x"], c["weight"], c["bias"], _ragged([3]), c["state"], activation="gelu")
    with pytest.raises(ValueError, match="state"):
        la.causal_conv1d(c["x"], c["weight"], c["bias"], _ragged([3]), c["state"][:, :, :2])


def test_cpu_tensors_take_the_torch_path(monkeypatch):
    """The GPU libraries are only for CUDA tensors: on CPU the torch path runs even where they are importable."""
    monkeypatch.setattr(la, "_importable", lambda name: True)
    def forbidden(*args, **kwargs):
        raise AssertionError("GPU library path taken for CPU tensors")
    monkeypatch.setattr(la, "_fla_gated_delta_rule", forbidden)
    monkeypatch.setattr(la, "_gpu_causal_conv1d_update", forbidden)
    x = _delta_inputs([1, 1], per_channel=False)
    la.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], _ragged([1, 1]), x["state"])
    c = _conv_inputs([1, 1])
    la.causal_conv1d(c["x"], c["weight"], c["bias"], _ragged([1, 1]), c["state"])
    monkeypatch.setattr(la, "_fla_gated_delta_rule_decode", forbidden)
    la.gated_delta_rule_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"])
    la.causal_conv1d_decode(c["x"], c["weight"], c["bias"], c["state"])


@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_deltanet", "kda"])
def test_gpu_library_path_cuts_sequences_at_save_points(monkeypatch, per_channel):
    """The flash-linear-attention path, with the library stood in for by transformers' functions called per
    cu_seqlens segment: rounds of pieces cut at the save points give the same outputs, final and saved states."""
    import sys
    import types

    calls = []

    def library(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
        assert q.shape[0] == 1 and q.shape[2] == v.shape[2] and scale is None and output_final_state
        calls.append(cu_seqlens.tolist())
        ref = kimi.chunk_kimi_delta_attention if g.dim() == 4 else qwen.torch_chunk_gated_delta_rule
        outs, finals = [], []
        for n, (lo, hi) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            piece = (t[:, lo:hi] for t in (q, k, v, g, beta))
            o, s = ref(*piece, initial_state=initial_state[n:n + 1], output_final_state=True,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            outs.append(o)
            finals.append(s)
        return torch.cat(outs, dim=1), torch.cat(finals)

    for name in ("fla", "fla.ops", "fla.ops.kda", "fla.ops.gated_delta_rule"):
        module = types.ModuleType(name)
        module.chunk_kda = module.fused_recurrent_kda = library
        module.chunk_gated_delta_rule = module.fused_recurrent_gated_delta_rule = library
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(la, "_fla_applies", lambda q: True)
    x = _delta_inputs(LENS, per_channel)
    qsl = _ragged(LENS)
    save_after = [[1], [], [16, 64], [3, 100]]
    out, final, saved = la.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], qsl, x["state"],
                                            save_after=save_after)
    assert calls == [[0, 1, 6, 22, 25], [0, 48, 145], [0, 30]]  # pieces: (1, 5, 16, 3), (48, 97), (30,)
    for b in range(len(LENS)):
        rows = slice(int(qsl[b]), int(qsl[b + 1]))
        ref_out, ref_state = _reference_delta(x, rows, x["state"][b])
        _close(out[rows], ref_out, 1e-5)
        _close(final[b], ref_state, 1e-5)
        for n, snapshot in zip(save_after[b], saved[b]):
            _, ref_saved = _reference_delta(x, slice(int(qsl[b]), int(qsl[b]) + n), x["state"][b])
            _close(snapshot, ref_saved, 1e-5)
        assert len(saved[b]) == len(save_after[b])
