"""Lossless verification of a draft tree against the target model.

Row 0 of a request's verification rows holds the target's distribution after the root (the last accepted token),
row i + 1 the distribution after draft node i. Our proposers' drafts are deterministic given the context (the draft
distribution q is a point mass on each proposed token), and verification couples them with the target's own choice:
at every row the target picks its token exactly as a plain step at that output position would (the argmax for
greedy decoding, the sampler's draw with that position's noise for sampling: layers/sampler.py), and the walk follows
the child equal to that pick; the first pick that no child matches is the next token.

Every emitted token is the target's own pick given the tokens before it, so outputs are distributed exactly as
plain decoding's, and a seeded request's are the very same tokens, with or without drafts, alone or in any batch.
For point-mass drafts this accepts as often as speculative sampling (Leviathan et al., 2023, arXiv:2211.17192) and
its multi-candidate form (SpecInfer, Miao et al., 2023, arXiv:2305.09781): a child x is taken with probability p(x),
and when no child is, the token follows p without the children, renormalised (their residual).
"""

from __future__ import annotations

from reasoning_engine.speculative.draft import Draft


def verify_draft(draft: Draft, choices: list[int]) -> tuple[list[int], int]:
    """choices[r]: the target's pick at row r. Returns (accepted node indices, root to leaf; the next token)."""
    return draft.accept(choices[0], choices[1:])
