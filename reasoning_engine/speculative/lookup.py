"""Plain longest-match lookup: the baseline the suffix proposer is measured against.

Find the longest suffix of the context that occurred earlier in the context and propose what followed its most recent
occurrence (up to the draft budget). Match lengths are exact up to `max_match` tokens: the n-gram index finds the
largest indexed order that matches, then a binary search over slice comparisons measures each candidate's true length.
"""

from __future__ import annotations

from typing import Sequence

from reasoning_engine.speculative.draft import Draft
from reasoning_engine.speculative.index import INDEX_BUDGET, ContextProposer, common_suffix, window_key


class LookupProposer(ContextProposer):
    method = "lookup"

    def __init__(self, max_match: int = 256, scan_limit: int = 32, reuse_capacity: int = 64,
                 index_budget: int = INDEX_BUDGET) -> None:
        orders = [1]
        while orders[-1] * 2 <= max_match:
            orders.append(orders[-1] * 2)
        self.max_match = max_match
        self.scan_limit = scan_limit
        super().__init__(orders, reuse_capacity, index_budget)

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
            found = index.tables[i].get(window_key(prefix, end, n, index.powers[i]))
            if found is None:
                continue
            candidates = [found] if found.__class__ is int else found[-self.scan_limit - 1:][::-1]
            # No earlier occurrence matches the next order, so every candidate's match is shorter than it.
            limit = min(index.orders[i + 1] - 1 if i + 1 < len(index.orders) else self.max_match, end - 1)
            best_start, best_len = -1, 0
            for start in candidates:
                if start >= end:
                    continue
                length = common_suffix(tokens, start, end, n, min(limit, start))
                if length > best_len:
                    best_start, best_len = start, length
            if best_start >= 0:
                return Draft.path(tokens[best_start:best_start + max_draft_tokens])
        return Draft.empty()

