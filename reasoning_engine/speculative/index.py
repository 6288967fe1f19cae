"""Hashed n-gram occurrence index: the shared core of the n-gram, lookup and suffix proposers.

Token sequences are stored as segments (a request's growing context, or one finished output). For each configured order
n, a table maps the hash of an n-gram to the positions that immediately follow its occurrences, oldest first. Asking
"where did the last n tokens occur before, and what came next?" is then one dict lookup, and the continuation is read
straight from the segment. This answers the same queries as a depth-limited suffix tree (a tree node is a pattern, its
count the number of occurrences, its children the tokens that follow them) in pure Python at a few microseconds per
appended token, without building one node object per substring.

Hashes are polynomial over 64-bit integers and kept as prefix hashes per open segment, so the key of any window is
O(1); they are deterministic across processes (state on disk is tokens only and is re-indexed on load).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Iterable, Sequence

import numpy as np

from reasoning_engine.speculative.draft import Draft

MASK = (1 << 64) - 1
BASE = 0x9E3779B97F4A7C15
BASE_INVERSE = pow(BASE, -1, 1 << 64)
BULK_MIN = 64  # appends at least this long (prompts, finished outputs) hash with numpy
SEGMENT_SHIFT = 32
OFFSET_MASK = (1 << SEGMENT_SHIFT) - 1
INDEX_BUDGET = 4096  # context tokens one step may index before drafting (a few milliseconds: docs/measurements.md)


def power(n: int) -> int:
    """BASE ** n modulo 2 ** 64, the factor that removes the tokens before an n-token window."""
    return pow(BASE, n, 1 << 64)


def prefix_hashes(tokens: Iterable[int]) -> list[int]:
    """[h_0, h_1, ...] with h_i the hash of the first i tokens."""
    prefix = [0]
    h = 0
    for token in tokens:
        h = (h * BASE + token + 1) & MASK
        prefix.append(h)
    return prefix


def window_key(prefix: Sequence[int], end: int, n: int, n_power: int) -> int:
    """Hash of tokens[end - n:end] from the prefix hashes of `tokens` (`n_power` = power(n))."""
    return (prefix[end] - prefix[end - n] * n_power) & MASK


class NgramIndex:
    """Segments of tokens and, per order, hash(n-gram) -> packed positions that follow it (oldest first).

    A packed position is `segment << 32 | offset`: the continuation is segments[segment][offset:]. N-grams never span
    two segments. Values are a bare int while an n-gram has one occurrence (most of them), a list after that.
    """

    def __init__(self, orders: Sequence[int]) -> None:
        if not orders or min(orders) < 1:
            raise ValueError(f"orders must be positive n-gram lengths, got {orders!r}")
        self.orders: tuple[int, ...] = tuple(sorted(set(orders)))
        self.powers: tuple[int, ...] = tuple(power(n) for n in self.orders)
        self.tables: list[dict[int, int | list[int]]] = [{} for _ in self.orders]
        self.segments: dict[int, list[int]] = {}
        self.prefixes: dict[int, list[int]] = {}
        self.num_tokens = 0
        self._next_segment = 0

    def open_segment(self, tokens: Iterable[int] = ()) -> int:
        """Start a segment that `append` can keep growing (its prefix hashes are kept until `close_segment`)."""
        segment = self._next_segment
        self._next_segment += 1
        self.segments[segment] = []
        self.prefixes[segment] = [0]
        self.append(segment, tokens)
        return segment

    def add_segment(self, tokens: Iterable[int]) -> int:
        """A finished sequence: indexed once, then read-only."""
        segment = self.open_segment(tokens)
        self.close_segment(segment)
        return segment

    def close_segment(self, segment: int) -> None:
        self.prefixes.pop(segment, None)

    def append(self, segment: int, tokens: Iterable[int]) -> None:
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        if len(tokens) >= BULK_MIN:
            self._append_bulk(segment, tokens)
            return
        seg = self.segments[segment]
        prefix = self.prefixes[segment]
        base = segment << SEGMENT_SHIFT
        columns = list(zip(self.orders, self.powers, self.tables))
        h = prefix[-1]
        for token in tokens:
            h = (h * BASE + token + 1) & MASK
            seg.append(token)
            prefix.append(h)
            end = len(seg)
            pos = base | end
            for n, n_power, table in columns:
                if n > end:
                    break
                key = (h - prefix[end - n] * n_power) & MASK
                found = table.get(key)
                if found is None:
                    table[key] = pos
                elif found.__class__ is int:
                    table[key] = [found, pos]
                else:
                    found.append(pos)
        self.num_tokens += len(tokens)

    def _append_bulk(self, segment: int, tokens: list[int]) -> None:
        """The same tables as the token-by-token loop, with the hashes computed as uint64 arrays (wrapping mod 2**64).

        h_(s+i+1) = h_s * B^(i+1) + B^i * sum_(j<=i) (t_j + 1) * B^-j, so the prefix hashes are one cumulative sum; only
        the dict inserts stay in Python, which halves the cost of indexing a long prompt.
        """
        seg = self.segments[segment]
        prefix = self.prefixes[segment]
        start, count = len(seg), len(tokens)
        powers = np.full(count + 1, BASE, dtype=np.uint64)
        powers[0] = 1
        powers = np.multiply.accumulate(powers)
        inverse = np.full(count, BASE_INVERSE, dtype=np.uint64)
        inverse[0] = 1
        inverse = np.multiply.accumulate(inverse)
        weighted = (np.asarray(tokens, dtype=np.uint64) + np.uint64(1)) * inverse
        hashes = np.uint64(prefix[-1]) * powers[1:] + powers[:count] * np.cumsum(weighted, dtype=np.uint64)
        keep = min(start, self.orders[-1])  # earlier prefix hashes the first windows reach back to
        window = np.concatenate([np.array(prefix[len(prefix) - 1 - keep:], dtype=np.uint64), hashes])
        seg.extend(tokens)
        prefix.extend(hashes.tolist())
        base = segment << SEGMENT_SHIFT
        for n, n_power, table in zip(self.orders, self.powers, self.tables):
            first = max(start + 1, n)
            if first > start + count:
                continue
            ends = np.arange(first - start + keep, count + keep + 1)
            keys = (window[ends] - window[ends - n] * np.uint64(n_power)).tolist()
            get = table.get
            for key, pos in zip(keys, range(base | first, (base | (start + count)) + 1)):
                found = get(key)
                if found is None:
                    table[key] = pos
                elif found.__class__ is int:
                    table[key] = [found, pos]
                else:
                    found.append(pos)
        self.num_tokens += count

    def truncate(self, segment: int, length: int) -> None:
        """Cut an open segment back to its first `length` tokens, forgetting every position past them: the tables end
        as if only those tokens had been appended, at the cost of indexing the tokens dropped."""
        seg = self.segments[segment]
        prefix = self.prefixes[segment]
        base = segment << SEGMENT_SHIFT
        for n, n_power, table in zip(self.orders, self.powers, self.tables):
            for end in range(len(seg), max(length, n - 1), -1):
                key = (prefix[end] - prefix[end - n] * n_power) & MASK
                found = table[key]
                if found.__class__ is int:
                    del table[key]
                    continue
                pos = base | end
                if found[-1] == pos:
                    found.pop()
                else:  # a later segment's position follows it
                    found.remove(pos)
                if len(found) == 1:
                    table[key] = found[0]
        self.num_tokens -= len(seg) - length
        del seg[length:]
        del prefix[length + 1:]

    def drop_segment(self, segment: int) -> None:
        """Forget a segment and every position in it (eviction of the oldest outputs)."""
        seg = self.segments.pop(segment)
        self.prefixes.pop(segment, None)
        prefix = prefix_hashes(seg)
        base = segment << SEGMENT_SHIFT
        for n, n_power, table in zip(self.orders, self.powers, self.tables):
            for end in range(n, len(seg) + 1):
                key = window_key(prefix, end, n, n_power)
                found = table.get(key)
                pos = base | end
                if found == pos:
                    del table[key]
                elif found.__class__ is list and pos in found:  # not found only after a 64-bit hash collision
                    found.remove(pos)
                    if not found:
                        del table[key]
        self.num_tokens -= len(seg)


def latest_before(found: int | list[int] | None, end: int) -> int | None:
    """The most recent position in a table value that lies before `end` (skips the window that ends right now)."""
    if found is None:
        return None
    if found.__class__ is int:
        return found if found < end else None
    return found[-1] if found[-1] < end else found[-2]


def common_suffix(tokens: list[int], a: int, b: int, known: int, limit: int) -> int:
    """Length of the common suffix of tokens[:a] and tokens[:b], given it is at least `known` and at most `limit`.

    A binary search over slice comparisons: each probe runs at C speed, so even long matches cost microseconds.
    """
    lo, hi = known, max(known, limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tokens[a - mid:a] == tokens[b - mid:b]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists, by a binary search over slice comparisons (C speed)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RequestContext:
    """One request's sequence (prompt then accepted output) as a single open segment of its own index."""

    __slots__ = ("index", "prompt_len")

    def __init__(self, orders: Sequence[int], prompt: Sequence[int]) -> None:
        self.index = NgramIndex(orders)
        self.index.open_segment(prompt)
        self.prompt_len = len(prompt)

    @property
    def tokens(self) -> list[int]:
        return self.index.segments[0]

    @property
    def prefix(self) -> list[int]:
        return self.index.prefixes[0]

    def extend(self, tokens: Iterable[int]) -> None:
        self.index.append(0, tokens)

    def truncate(self, length: int) -> None:
        self.index.truncate(0, length)


class ContextStore:
    """Per-request contexts, plus recently finished ones: up to `reuse_capacity` of them and `reuse_max_tokens` tokens
    in all (~0.8 KB of RAM a token for the suffix proposer's 8 orders, so ~110 MB by default). At 32 agent sessions a
    capacity of 8 kept too few: a session's previous turn was mostly gone when its next one came.

    An agent's next turn is a new request whose prompt begins with the previous request's prompt and most of its output
    (the chat template may render the reply differently from the tokens sampled: reasoning dropped from the history, a
    cut-off thinking block closed); reusing the finished context, cut back to the part the prompt shares, turns a
    rebuild of the whole conversation's index into dropping the few tokens that differ and appending the new ones.

    A context is indexed at its first `get` or `sync`, not at `start`: a request that never drafts (in a batch where
    drafting does not pay) never pays for indexing its prompt, and a request that does pays it in a step that drafts,
    where the adaptive gate counts it against drafting.
    """

    def __init__(self, orders: Sequence[int], reuse_capacity: int = 64, reuse_max_tokens: int = 131_072) -> None:
        self.orders = tuple(orders)
        self.reuse_capacity = reuse_capacity
        self.reuse_max_tokens = reuse_max_tokens
        self.active: dict[str, RequestContext] = {}
        self._unindexed: dict[str, list[int]] = {}  # request -> its prompt, until its context is first needed
        self._finished: list[RequestContext] = []
        self._finished_tokens = 0

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        self._unindexed[request_id] = list(prompt)

    def _index(self, request_id: str) -> RequestContext:
        prompt = self._unindexed.pop(request_id)
        found = self._reusable(prompt)
        if found is None:
            context = RequestContext(self.orders, prompt)
        else:
            place, shared = found
            context = self._finished.pop(place)
            self._finished_tokens -= len(context.tokens)
            context.truncate(shared)
            context.extend(prompt[shared:])
            context.prompt_len = len(prompt)
        self.active[request_id] = context
        return context

    def _reusable(self, prompt: list[int]) -> tuple[int, int] | None:
        """The finished context (its place in `_finished`, and how many of its tokens begin `prompt`) that is cheapest
        to turn into the prompt's, if that is cheaper than indexing the prompt afresh: cutting it back costs its tokens
        past the shared part, so it pays when more than half of it is shared. The newest wins a tie."""
        best, best_cost = None, len(prompt)
        for place in range(len(self._finished) - 1, -1, -1):
            tokens = self._finished[place].tokens
            need = (len(tokens) + len(prompt) - best_cost) // 2 + 1  # shared tokens that would beat the best so far
            if need > min(len(tokens), len(prompt)) or tokens[need - 1] != prompt[need - 1]:
                continue  # one token tells most conversations apart
            shared = common_prefix(tokens, prompt)
            cost = len(tokens) + len(prompt) - 2 * shared
            if cost < best_cost:
                best, best_cost = (place, shared), cost
        return best

    def unseen(self, request_id: str, length: int) -> int:
        """How many tokens the next `sync` of the request's `length`-token sequence would index (or drop)."""
        context = self.active.get(request_id)
        if context is not None:
            return length - len(context.tokens)
        found = self._reusable(self._unindexed[request_id])
        if found is None:
            return length
        place, shared = found
        return len(self._finished[place].tokens) + length - 2 * shared

    def get(self, request_id: str) -> RequestContext:
        context = self.active.get(request_id)
        return context if context is not None else self._index(request_id)

    def sync(self, request_id: str, token_ids: Sequence[int]) -> RequestContext:
        """Append whatever part of the request's full sequence the index has not seen yet."""
        context = self.get(request_id)
        known = len(context.tokens)
        if len(token_ids) < known:
            raise ValueError(f"request {request_id}: sequence of {len(token_ids)} tokens is shorter than the {known} already seen")
        if len(token_ids) > known:
            context.extend(token_ids[known:])
        return context

    def finish(self, request_id: str) -> tuple[int, list[int]]:
        """Forget the request; returns its prompt length and the tokens its context saw (just the prompt if it was
        never indexed, in which case there is nothing to keep for reuse either)."""
        prompt = self._unindexed.pop(request_id, None)
        if prompt is not None:
            return len(prompt), prompt
        context = self.active.pop(request_id)
        self._finished.append(context)
        self._finished_tokens += len(context.tokens)
        while self._finished and (len(self._finished) > self.reuse_capacity
                                  or self._finished_tokens > self.reuse_max_tokens):
            self._finished_tokens -= len(self._finished.pop(0).tokens)
        return context.prompt_len, context.tokens


def propose_within_budget(contexts: ContextStore, propose: Callable[[str, Sequence[int], int], Draft],
                          items: Sequence[tuple[str, Sequence[int], int]], budget: int) -> list[Draft]:
    """One step's drafts, indexing at most `budget` new context tokens.

    A request's first draft indexes its whole context, and with drafting gated off at large batches (or held back by
    a batch cap) many requests come to their first draft in the same step: without a budget, a stall of several
    decode steps that every running request waits through (docs/measurements.md). A request that needs more than the
    step has left drafts at a later step; the step's first request always goes, so a prompt longer than the budget
    still gets its turn.
    """
    left = budget
    drafts = []
    for request_id, token_ids, limit in items:
        need = contexts.unseen(request_id, len(token_ids))
        if need > max(left, 0) and left < budget:
            drafts.append(Draft.empty())
            continue
        left -= need
        drafts.append(propose(request_id, token_ids, limit))
    return drafts


def check_index_budget(budget: int) -> None:
    if budget < 1:
        raise ValueError(f"index_budget must be >= 1, got {budget}")


class ContextProposer(ABC):
    """The request lifecycle shared by proposers that only look inside each request's own context (ngram, lookup)."""

    def __init__(self, orders: Sequence[int], reuse_capacity: int, index_budget: int) -> None:
        check_index_budget(index_budget)
        self.contexts = ContextStore(orders, reuse_capacity)
        self.index_budget = index_budget

    @abstractmethod
    def propose(self, request_id: str, token_ids: Sequence[int], max_draft_tokens: int) -> Draft: ...

    def propose_batch(self, items: Sequence[tuple[str, Sequence[int], int]]) -> list[Draft]:
        return propose_within_budget(self.contexts, self.propose, items, self.index_budget)

    def start_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        self.contexts.start(request_id, prompt_token_ids)

    def on_tokens_accepted(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        self.contexts.get(request_id).extend(new_token_ids)

    def finish_request(self, request_id: str, learn: bool = True, token_ids: Sequence[int] | None = None) -> None:
        self.contexts.finish(request_id)
