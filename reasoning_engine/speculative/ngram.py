"""Prompt lookup (n-gram) proposer: the cheapest speculation, and strong on sequences that quote their own context.

Match the last n tokens for n from `max_n` down to `min_n` against the request's prompt and output, and propose the
tokens that followed the most recent earlier occurrence of the first n that matches.
"""

from __future__ import annotations

from typing import Sequence

from reasoning_engine.speculative.draft import Draft
from reasoning_engine.speculative.index import INDEX_BUDGET, ContextProposer, latest_before, window_key


class NgramProposer(ContextProposer):
    method = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1, reuse_capacity: int = 64,
                 index_budget: int = INDEX_BUDGET) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        super().__init__(range(min_n, max_n + 1), reuse_capacity, index_budget)

    def propose(self, request_id: str, token_ids: Sequence[int], max_draft_tokens: int) -> Draft:
        context = self.contexts.sync(request_id, token_ids)
        index, prefix, tokens = context.index, context.prefix, context.tokens
        end = len(tokens)
        if max_draft_tokens <= 0:
            return Draft.empty()
        for i in range(len(index.orders) - 1, -1, -1):
            n = index.orders[i]
            if n >= end:
                continue
            start = latest_before(index.tables[i].get(window_key(prefix, end, n, index.powers[i])), end)
            if start is not None:
                return Draft.path(tokens[start:start + max_draft_tokens])
        return Draft.empty()
