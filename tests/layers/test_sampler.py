"""Sampling filters and penalties against straightforward per-row references on fixed logits."""

from __future__ import annotations

import math

import pytest
import torch

from reasoning_engine.layers.sampler import SamplingMetadata, apply_penalties, filter_logits


def _reference_keep(logits: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    if top_k > 0:
        order = order[:top_k]
    z = max(logits[i] for i in order)
    weights = {i: math.exp(logits[i] - z) for i in order}
    total = sum(weights.values())
    probs = {i: w / total for i, w in weights.items()}
    kept, mass = [], 0.0
    for i in order:
        if top_p < 1 and mass >= top_p:
            break
        kept.append(i)
        mass += probs[i]
    p_max = probs[order[0]]
    return {i for i in kept if probs[i] >= min_p * p_max} | {order[0]}


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (3, 1.0, 0.0), (0, 0.5, 0.0), (0, 0.9, 0.0),
                                               (0, 1.0, 0.3), (5, 0.8, 0.05), (1, 0.2, 0.9)])
def test_filters_match_reference(top_k: int, top_p: float, min_p: float) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 17, generator=gen) * 2
    out = filter_logits(logits, torch.full((4,), top_k), torch.full((4,), top_p), torch.full((4,), min_p))
    for row in range(4):
        kept = {i for i in range(17) if out[row, i] != float("-inf")}
        assert kept == _reference_keep(logits[row].tolist(), top_k, top_p, min_p)
        for i in kept:
            assert out[row, i] == logits[row, i]


def test_penalties_match_reference() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    meta = SamplingMetadata(
        temperature=torch.ones(1), top_p=torch.ones(1), top_k=torch.zeros(1, dtype=torch.long), min_p=torch.zeros(1),
        greedy=[False], streams=[None], num_logprobs=[None], all_greedy=False, needs_filters=False,
        presence=torch.tensor([0.5]), frequency=torch.tensor([0.25]), repetition=torch.tensor([2.0]),
        prompt_ids=[[1]], output_ids=[[0, 0, 3]])
    out = apply_penalties(logits, meta)[0].tolist()
    # token 0: seen, positive -> 2/2 = 1, then -0.25*2 -0.5 = 0.0 ; token 1 (prompt): -1*2 = -2
    # token 3: 3/2 = 1.5 - 0.25 - 0.5 = 0.75 ; tokens 2, 4 untouched
    assert out == pytest.approx([0.0, -2.0, 0.5, 0.75, -2.0])
