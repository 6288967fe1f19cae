"""Lossless verification of a draft tree against the target model's distributions.

Row 0 of a request's verification rows holds the target's distribution after the root (the last accepted token),
row i + 1 the distribution after draft node i. Our proposers' drafts are deterministic given the context, i.e. the
draft distribution q is a point mass on each proposed token. Multi-candidate speculative sampling (SpecInfer,
Miao et al., 2023, arXiv:2305.09781; the single-candidate rule is Leviathan et al., 2023, arXiv:2211.17192) then reads:
at a node, try its children in turn; accept child x with probability p(x) / sum(p) (= min(1, p/q) for a point mass
q); on rejection set p(x) = 0 (the residual max(p - q, 0)) and try the next sibling; when no child is accepted, draw the
next token from what is left of p. Every emitted token is therefore distributed exactly as the target's.
Greedy decoding is the limit: follow the child equal to the target's argmax.
"""

from __future__ import annotations

import torch

from reasoning_engine.speculative.draft import Draft


def verify_greedy(draft: Draft, choices: list[int]) -> tuple[list[int], int]:
    """choices[r]: the target's greedy token at row r. Returns (accepted node indices, bonus token)."""
    return draft.greedy_accept(choices[0], choices[1:])


def verify_sampled(draft: Draft, probs: torch.Tensor, generator: torch.Generator | None) -> tuple[list[int], int]:
    """probs [1 + len(draft), V]: the target's processed distributions. Returns (accepted nodes, next token)."""
    kids = draft.children()
    accepted: list[int] = []
    node = -1
    while True:
        p = probs[node + 1].double().cpu().clone()
        chosen = None
        for child in kids[node + 1]:
            token = draft.token_ids[child]
            if float(torch.rand((), generator=generator, dtype=torch.float64)) * float(p.sum()) < float(p[token]):
                chosen = child
                break
            p[token] = 0.0  # residual after rejecting a point-mass proposal
        if chosen is None:
            return accepted, int(torch.multinomial(p / p.sum(), 1, generator=generator))
        accepted.append(chosen)
        node = chosen
