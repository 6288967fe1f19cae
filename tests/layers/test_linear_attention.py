"""The linear-attention layers' decode step (`DecodeStateMetadata`: slots and zero-start flags as tensors, the form
CUDA graphs replay and compiled decode traces): it equals the ragged path with its in-step snapshot, and compiled with
dynamic shapes it is one graph for every batch size, padding rows included, with the eager outputs and states. A
verification bucket's addressing (`padded_tree_state`) from its static buffers."""

from __future__ import annotations

import pytest
import torch

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.layers.linear_attention import (DecodeStateMetadata, GatedDeltaNet, KimiDeltaAttention,
                                                      LinearStateMetadata, padded_tree_state, prepare_state)

HIDDEN, SLOTS = 32, 8
PADDING = SLOTS - 1  # a slot no sequence below owns


def _layer(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gated_deltanet":  # two key heads, four value heads: the GQA repeat
        layer = GatedDeltaNet(HIDDEN, 2, 4, 8, 8, conv_kernel=4, eps=1e-6, fused_projections=True)
    else:
        layer = KimiDeltaAttention(HIDDEN, 2, 8, conv_kernel=4, eps=1e-6)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    layer.bind_state([torch.randn(shape, dtype=dtype or torch.float32) * 0.5 for shape, dtype in layer.state_shapes(SLOTS)])
    return layer.eval()


def _batch(slots: list[int], fresh: list[bool], saves: list[list[tuple[int, int]]] | None = None) -> ForwardBatch:
    n = len(slots)
    batch = ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.long), positions=torch.zeros(n, dtype=torch.long),
        slot_mapping=torch.zeros(n, dtype=torch.long), query_start_loc=torch.arange(n + 1),
        seq_lens=torch.ones(n, dtype=torch.long), block_tables=torch.zeros(n, 1, dtype=torch.int32),
        logits_indices=torch.arange(n), max_query_len=1, max_seq_len=1, query_lens_cpu=[1] * n, seq_lens_cpu=[1] * n,
        state_slots=torch.tensor(slots), state_fresh=torch.tensor(fresh), state_saves=saves)
    batch.state_metadata = prepare_state(batch)
    return batch


def _states(layer: torch.nn.Module) -> list[torch.Tensor]:
    return [layer.conv_state.clone(), layer.recurrent_state.clone()]


def _set_states(layer: torch.nn.Module, states: list[torch.Tensor]) -> None:
    layer.conv_state.copy_(states[0])
    layer.recurrent_state.copy_(states[1])


@pytest.mark.parametrize("kind", ["gated_deltanet", "kda"])
@torch.inference_mode()
def test_decode_step_equals_the_ragged_path_and_its_snapshot(kind: str) -> None:
    """A decode step through `DecodeStateMetadata` (the snapshot copied out of the live slot after it, as the worker
    does) leaves the outputs and every slot the ragged path with an in-step snapshot leaves."""
    layer = _layer(kind)
    start = _states(layer)
    x = torch.randn(3, HIDDEN)
    slots, fresh = [4, 1, 2], [False, True, False]
    ragged = _batch(slots, fresh, saves=[[], [(1, 6)], []])
    assert isinstance(ragged.state_metadata, LinearStateMetadata)
    want = layer(ragged.positions, x, ragged)
    want_states = _states(layer)

    _set_states(layer, start)
    decode = _batch(slots, fresh)
    assert isinstance(decode.state_metadata, DecodeStateMetadata)
    got = layer(decode.positions, x, decode)
    for tensor in (layer.conv_state, layer.recurrent_state):
        tensor[6] = tensor[1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for have, expected in zip(_states(layer), want_states):
        torch.testing.assert_close(have, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["gated_deltanet", "kda"])
@torch.inference_mode()
def test_compiled_decode_step_is_one_graph_for_every_batch_size(kind: str) -> None:
    """torch.compile (fullgraph, dynamic shapes, as compiled_decode.py compiles the step; the state tensors marked
    static as CompiledDecode marks them) traces the decode step once, on a batch of three (the conv state's K-1, the
    size dynamo would otherwise tie to the batch's), and serves batches of 2, 4 and 6 without recompiling. Each gives
    the eager outputs and states; padding rows (the padding slot, repeated, from zeros) change no other slot."""
    layer = _layer(kind)
    for tensor in (layer.conv_state, layer.recurrent_state):
        torch._dynamo.mark_static(tensor)
    torch._dynamo.reset()
    compiled = torch.compile(layer, dynamic=True, fullgraph=True, options={"pattern_matcher": False})
    counters = torch._dynamo.utils.counters
    before = counters["stats"]["unique_graphs"]
    steps = [([5, 0, 3], [False, True, False]), ([2, 6], [False, False]),
             ([1, 4, PADDING, PADDING], [False, True, True, True]), ([0, 1, 2, 3, 4, PADDING], [False] * 5 + [True])]
    for slots, fresh in steps:
        x = torch.randn(len(slots), HIDDEN)
        start = _states(layer)
        batch = _batch(slots, fresh)
        want = layer(batch.positions, x, batch)
        want_states = _states(layer)
        _set_states(layer, start)
        got = compiled(batch.positions, x, batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        live = [s for s in slots if s != PADDING]
        untouched = [s for s in range(SLOTS) if s not in slots]
        for have, expected, old in zip(_states(layer), want_states, start):
            torch.testing.assert_close(have[live], expected[live], rtol=1e-5, atol=1e-5)
            assert torch.equal(have[untouched], old[untouched])
    assert counters["stats"]["unique_graphs"] == before + 1


def test_padded_tree_state_finds_parents_and_target_slots() -> None:
    """Two sequences of four rows: one verifying a tree (nodes 1 and 2 under the root, 3 under 1), one decoding with
    three padding rows. Parents come from the tree mask; a verifying row writes its scratch slot, the decoding row its
    live slot, padding rows the padding slot."""
    mask = torch.zeros(8, 4, dtype=torch.bool)
    for row, seen in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0], [1], [2], [3]]):
        mask[row, seen] = True
    meta = padded_tree_state(torch.tensor([3, 5]), torch.tensor([False, True]), torch.tensor([20, -1]), mask, 9)
    assert meta.parent.tolist() == [[-1, 0, 0, 1], [-1, -1, -1, -1]]
    assert meta.targets.tolist() == [20, 21, 22, 23, 5, 9, 9, 9]
    assert meta.slots.tolist() == [3, 5] and meta.fresh.tolist() == [False, True]
