"""Suffix proposer: speculation that learns from the request itself and from the workload's recent outputs.

After SuffixDecoding (Oliaro et al., 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications",
arXiv:2411.04975): a per-request suffix structure over the prompt and output plus a global one over recent outputs; the
longest matching suffix of the context selects a node, and a draft tree grows below it, ranked by how often each
continuation followed the pattern. This implementation is our own. Its suffix trees are implicit (index.py): a node is
the set of recent occurrences of a pattern, its children the groups of those occurrences by the next token, a child's
count ratio the share of occurrences it keeps.

Drafting, per step:
- match: in each store (request, global), the longest indexed order n whose last-n-token pattern occurred before, with
  its `max_occurrences` most recent occurrences. Each store also seeds a backoff candidate from the next shorter order
  that occurred (alternatives when the long pattern has few occurrences), and the request store one more: the single
  occurrence with the exact longest match, which is what plain lookup would follow;
- score: a child's acceptance probability is its count ratio times a rate learned online for its source, its effective
  match length (n plus its depth: every drafted token the target accepts lengthens the match) and its support (how many
  occurrences the ratio rests on). Replays show acceptance climbing from about one half at a one-token match to above
  0.9 past 16 tokens, so this is what makes the draft length adapt to the match length: long matches grow deep chains,
  short ones stay shallow and spend the budget on siblings;
- grow: one best-first expansion over all sources by path probability (product of those probabilities), children whose
  count ratio is below `min_token_prob` pruned, at most the draft budget nodes; a child that several sources propose is
  one node. A path draft (tree=False) follows only the most probable child.

The rates learn from what the target accepted: the next `on_tokens_accepted` (or `propose`, which catches up from the
full sequence) compares the new tokens with the request's last draft. The global store keeps the last
`global_max_tokens` tokens of finished outputs (each with the last `prompt_tail` tokens of its context, so the start of an
answer can be predicted from how prompts end), evicting the oldest outputs first. `save`/`load` persist the store (as
tokens; loading re-indexes them) and the rates.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import os
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from reasoning_engine.adaptive.state import write_atomically
from reasoning_engine.speculative.draft import Draft
from reasoning_engine.speculative.index import (INDEX_BUDGET, OFFSET_MASK, SEGMENT_SHIFT, ContextStore, NgramIndex,
                                                check_index_budget, common_suffix, propose_within_budget, window_key)

STATE_FORMAT = 1
# The candidate sources a draft grows from; each has its own acceptance rates.
LOCAL, LONGEST, LOCAL_BACKOFF, GLOBAL, GLOBAL_BACKOFF = range(5)
STORES = (LOCAL, LONGEST, LOCAL_BACKOFF, GLOBAL, GLOBAL_BACKOFF)
LONGEST_CAP = 256
LONGEST_SCAN = 16


@dataclass(frozen=True)
class SuffixConfig:
    """Defaults tuned on the first 600 records of the swe_dev workload (benchmarks/spec_replay.py).

    The global store costs about 0.6 KB of RAM per kept token (hash tables of 8 orders), so the default cap of 500k
    tokens is about 300 MB.
    """

    orders: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 16, 32)
    max_occurrences: int = 32
    min_token_prob: float = 0.05
    tree: bool = True
    global_max_tokens: int = 500_000
    prompt_tail: int = 8
    reuse_capacity: int = 64
    reuse_max_tokens: int = 131_072
    prior_strength: float = 20.0
    backoff: bool = True
    index_budget: int = INDEX_BUDGET

    def __post_init__(self) -> None:
        if not self.orders or min(self.orders) < 1:
            raise ValueError(f"orders must be positive, got {self.orders!r}")
        if self.max_occurrences < 1:
            raise ValueError(f"max_occurrences must be >= 1, got {self.max_occurrences}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if min(self.global_max_tokens, self.prompt_tail, self.reuse_capacity, self.reuse_max_tokens,
               self.prior_strength) < 0:
            raise ValueError("global_max_tokens, prompt_tail, reuse_capacity, reuse_max_tokens and prior_strength must "
                             "be >= 0")
        check_index_budget(self.index_budget)


def _log2_buckets(count: int) -> list[int]:
    """bucket[v] = floor(log2(v)) for v in 1 .. 2 ** (count - 1); values past the end share the last bucket."""
    return [max(v, 1).bit_length() - 1 for v in range(1 << (count - 1))] + [count - 1]


class AcceptanceModel:
    """P(a drafted token is accepted | its parent was) = count ratio x a learned rate.

    One rate per cell: (store, log2 bucket of the effective match length, log2 bucket of the support, i.e. how many
    occurrences the count ratio was measured on). Each rate is a ratio estimator (accepted nodes over the count ratios
    they were drafted with) started from a prior worth `prior_strength` observations; the prior, by match length only,
    is the shape seen on recorded agent traces, the data refines it.
    """

    MATCH_BUCKETS = 8
    SUPPORT_BUCKETS = 4
    MAX_RATE = 0.99
    # log2 buckets, precomputed: the cell is looked up for every expanded draft node.
    MATCH_BUCKET = _log2_buckets(MATCH_BUCKETS)
    SUPPORT_BUCKET = _log2_buckets(SUPPORT_BUCKETS)

    def __init__(self, prior_strength: float) -> None:
        self.prior_strength = prior_strength
        cells = len(STORES) * self.SUPPORT_BUCKETS * self.MATCH_BUCKETS
        self.prior = [1.0 - 0.5 * 2.0 ** (-(c % self.MATCH_BUCKETS) / 2) for c in range(cells)]
        self.accepted = [0.0] * cells
        self.drafted = [0.0] * cells
        self.rates = list(self.prior)

    @classmethod
    def cell(cls, store: int, match_len: int, support: int) -> int:
        match_bucket = cls.MATCH_BUCKET[min(match_len, len(cls.MATCH_BUCKET) - 1)]
        support_bucket = cls.SUPPORT_BUCKET[min(support, len(cls.SUPPORT_BUCKET) - 1)]
        return (store * cls.SUPPORT_BUCKETS + support_bucket) * cls.MATCH_BUCKETS + match_bucket

    def observe(self, cell: int, ratio: float, accepted: bool) -> None:
        self.accepted[cell] += accepted
        self.drafted[cell] += ratio
        self._refresh(cell)

    def _refresh(self, cell: int) -> None:
        strength = self.prior_strength
        rate = (self.accepted[cell] + strength * self.prior[cell]) / (self.drafted[cell] + strength)
        self.rates[cell] = min(rate, self.MAX_RATE)

    def to_dict(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "drafted": self.drafted}

    def load_dict(self, data: dict[str, Any]) -> None:
        if len(data["accepted"]) != len(self.accepted) or len(data["drafted"]) != len(self.drafted):
            raise ValueError("saved acceptance statistics have another shape")
        accepted, drafted = [float(x) for x in data["accepted"]], [float(x) for x in data["drafted"]]
        if not all(0.0 <= x < math.inf for x in accepted + drafted):  # NaN fails the comparison too
            raise ValueError("saved acceptance statistics must be finite non-negative numbers")
        self.accepted, self.drafted = accepted, drafted
        for cell in range(len(self.rates)):
            self._refresh(cell)


class SuffixProposer:
    method = "suffix"

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self.contexts = ContextStore(self.config.orders, self.config.reuse_capacity, self.config.reuse_max_tokens)
        self.global_index = NgramIndex(self.config.orders)
        self.model = AcceptanceModel(self.config.prior_strength)
        self._global_order: deque[int] = deque()
        # Per request, the last draft and, per node, (model cell, count ratio) to learn from.
        self._pending: dict[str, tuple[Draft, list[tuple[int, float]]]] = {}

    # -- request lifecycle -------------------------------------------------------------------------------------------

    def start_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        self.contexts.start(request_id, prompt_token_ids)

    def on_tokens_accepted(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        """Call once per verify step with all the tokens the step appended (accepted draft tokens and the bonus)."""
        self._observe(request_id, new_token_ids)
        self.contexts.get(request_id).extend(new_token_ids)

    def finish_request(self, request_id: str, learn: bool = True, token_ids: Sequence[int] | None = None) -> None:
        """Learn the finished output into the global store (skip with learn=False, e.g. for an aborted request).

        `token_ids` is the request's whole sequence: the engine reports only the steps that verified a draft, so
        the context lags behind every token decoded without one (a gated or crowded batch) and would teach the store
        a truncated output, or none at all.
        """
        self._pending.pop(request_id, None)
        prompt_len, seen = self.contexts.finish(request_id)
        tokens = seen if token_ids is None else token_ids
        if learn and len(tokens) > prompt_len:
            self.learn(tokens[max(0, prompt_len - self.config.prompt_tail):])

    def learn(self, tokens: Sequence[int]) -> None:
        """Add one sequence to the global store, evicting the oldest ones beyond `global_max_tokens`."""
        if not tokens or self.config.global_max_tokens == 0:
            return
        self._global_order.append(self.global_index.add_segment(tokens))
        while self.global_index.num_tokens > self.config.global_max_tokens and len(self._global_order) > 1:
            self.global_index.drop_segment(self._global_order.popleft())

    def _observe(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        """Score the request's last draft against the tokens the target emitted after it."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        draft, meta = pending
        accepted = draft.match(new_token_ids)
        children = draft.children()
        tested = children[0] + [c for node in accepted for c in children[node + 1]]
        hits = set(accepted)
        for node in tested:
            cell, ratio = meta[node]
            self.model.observe(cell, ratio, node in hits)

    # -- drafting ----------------------------------------------------------------------------------------------------

    def propose_batch(self, items: Sequence[tuple[str, Sequence[int], int]]) -> list[Draft]:
        """One step's drafts, indexing at most `index_budget` new context tokens (index.py's
        `propose_within_budget`)."""
        return propose_within_budget(self.contexts, self.propose, items, self.config.index_budget)

    def propose(self, request_id: str, token_ids: Sequence[int], max_draft_tokens: int) -> Draft:
        context = self.contexts.get(request_id)
        if len(token_ids) > len(context.tokens):
            self._observe(request_id, token_ids[len(context.tokens):])
            context = self.contexts.sync(request_id, token_ids)
        if max_draft_tokens <= 0:
            return Draft.empty()
        end = len(context.tokens)
        roots = []
        for index, local in ((context.index, True), (self.global_index, False)):
            level, occurrences = self._match(index, context.prefix, end, local, len(index.orders) - 1)
            if not occurrences:
                continue
            roots.append((LOCAL if local else GLOBAL, index.segments, index.orders[level], occurrences))
            if local:
                roots.append(self._longest(index, context.tokens, level, occurrences))
            if self.config.backoff and level > 0:
                lower, more = self._match(index, context.prefix, end, local, level - 1)
                if more:
                    roots.append((LOCAL_BACKOFF if local else GLOBAL_BACKOFF, index.segments, index.orders[lower], more))
        draft, meta = self._grow(roots, max_draft_tokens)
        if len(draft):
            self._pending[request_id] = (draft, meta)
        return draft

    def _match(self, index: NgramIndex, prefix: list[int], end: int, local: bool, top: int) -> tuple[int, list[int]]:
        """The longest order (its index, at most `top`) whose last-n-token pattern occurred before, with its most recent
        occurrences."""
        limit = self.config.max_occurrences
        for i in range(top, -1, -1):
            n = index.orders[i]
            if n > end:
                continue
            found = index.tables[i].get(window_key(prefix, end, n, index.powers[i]))
            if found is None:
                continue
            occurrences = [found] if found.__class__ is int else found[-limit - 1:]
            if local and occurrences[-1] >= end:
                occurrences.pop()  # the pattern's occurrence that ends right now has no continuation yet
            if occurrences:
                return i, occurrences[-limit:]
        return 0, []

    def _longest(self, index: NgramIndex, tokens: list[int], level: int,
                 occurrences: list[int]) -> tuple[int, dict[int, list[int]], int, list[int]]:
        """The single occurrence with the longest exact match (the latest on ties): what plain lookup would follow.

        None of them matches the next indexed order, so that bounds the search; past the top order, `LONGEST_CAP`.
        """
        end = len(tokens)
        n = index.orders[level]
        limit = index.orders[level + 1] - 1 if level + 1 < len(index.orders) else LONGEST_CAP
        best_pos, best_len = occurrences[-1], n
        for pos in reversed(occurrences[-LONGEST_SCAN:]):
            length = common_suffix(tokens, pos, end, n, min(limit, pos))
            if length > best_len:
                best_pos, best_len = pos, length
        return LONGEST, index.segments, best_len, [best_pos]

    def _grow(self, roots: list[tuple[int, dict[int, list[int]], int, list[int]]],
              budget: int) -> tuple[Draft, list[tuple[int, float]]]:
        """Best-first expansion of the matched implicit suffix-tree nodes of every source into one draft tree."""
        min_ratio = self.config.min_token_prob
        tree = self.config.tree
        rates = self.model.rates
        match_bucket, support_bucket = AcceptanceModel.MATCH_BUCKET, AcceptanceModel.SUPPORT_BUCKET
        max_match, max_support = len(match_bucket) - 1, len(support_bucket) - 1
        match_buckets, support_buckets = AcceptanceModel.MATCH_BUCKETS, AcceptanceModel.SUPPORT_BUCKETS
        tokens: list[int] = []
        parents: list[int] = []
        meta: list[tuple[int, float]] = []
        probs: list[float] = []
        nodes: dict[tuple[int, int], int] = {}
        heap: list[tuple[float, int, int, int, dict[int, list[int]], list[int], int, int, int, int, float]] = []
        tie = itertools.count()  # equal probabilities: the earlier-found candidate first

        def expand(node: int, store: int, segments: dict[int, list[int]], positions: list[int], depth: int,
                   order: int, prob: float) -> None:
            if len(positions) == 1:  # a single occurrence: its next token, if any, with count ratio 1
                pos = positions[0]
                seg = segments[pos >> SEGMENT_SHIFT]
                offset = pos & OFFSET_MASK
                if offset >= len(seg):
                    return
                children: Any = ((seg[offset], [pos + 1]),)
                total = 1
            else:
                groups, total = _group_next(segments, positions)
                children = sorted(groups.items(), key=_group_size, reverse=True) if len(groups) > 1 else groups.items()
            match_len = order + depth
            cell = ((store * support_buckets + support_bucket[total if total < max_support else max_support])
                    * match_buckets + match_bucket[match_len if match_len < max_match else max_match])
            rate = rates[cell]
            for token, group in children:
                ratio = len(group) / total
                if ratio < min_ratio:
                    break
                heapq.heappush(heap, (-prob * ratio * rate, next(tie), node, token, segments, group, depth + 1, order,
                                      store, cell, ratio))
                if not tree:
                    break

        for store, segments, order, occurrences in roots:
            expand(-1, store, segments, occurrences, 0, order, 1.0)
        while heap and len(tokens) < budget:
            neg_prob, _, parent, token, segments, group, depth, order, store, cell, ratio = heapq.heappop(heap)
            if not tree:
                heap.clear()
            node = nodes.get((parent, token))
            if node is None:
                node = len(tokens)
                nodes[(parent, token)] = node
                tokens.append(token)
                parents.append(parent)
                meta.append((cell, ratio))
                probs.append(-neg_prob)
            prob = -neg_prob
            # A lone occurrence has one child; while that child beats every queued candidate it would be popped next,
            # so take it here and skip the heap round trip (same draft, fewer operations on long chains).
            while len(group) == 1 and len(tokens) < budget:
                pos = group[0]
                seg = segments[pos >> SEGMENT_SHIFT]
                offset = pos & OFFSET_MASK
                match_len = order + depth
                cell = ((store * support_buckets + support_bucket[1]) * match_buckets
                        + match_bucket[match_len if match_len < max_match else max_match])
                child_prob = prob * rates[cell]
                if offset >= len(seg) or (heap and child_prob <= -heap[0][0]):
                    break
                token = seg[offset]
                group = [pos + 1]
                depth += 1
                prob = child_prob
                parent, node = node, nodes.get((node, token))
                if node is None:
                    node = len(tokens)
                    nodes[(parent, token)] = node
                    tokens.append(token)
                    parents.append(parent)
                    meta.append((cell, 1.0))
                    probs.append(prob)
            if len(tokens) < budget:
                expand(node, store, segments, group, depth, order, prob)
        return Draft(tokens, parents, sum(probs), probs), meta

    # -- persistence -------------------------------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write the global store (tokens of each kept output, oldest first) and the acceptance rates; atomic per file."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        segments = [self.global_index.segments[s] for s in self._global_order]
        lengths = np.array([len(s) for s in segments], dtype=np.int64)
        flat = np.fromiter((t for s in segments for t in s), dtype=np.int64, count=int(lengths.sum()))
        write_atomically(path / "suffix_state.npz", lambda handle: np.savez(handle, tokens=flat, lengths=lengths))
        meta = {"format": STATE_FORMAT, "method": self.method, "segments": len(segments), "tokens": int(lengths.sum()),
                "acceptance": self.model.to_dict(), "config": asdict(self.config)}
        data = json.dumps(meta, indent=1).encode()
        write_atomically(path / "suffix_state.json", lambda handle: handle.write(data))

    def load(self, directory: str | os.PathLike[str], vocab_size: int | None = None) -> int:
        """Replace the global store and rates with those saved in `directory`; returns the number of outputs loaded. A
        store whose two files disagree, or (given the model's `vocab_size`) holding a token outside the vocabulary, is
        a ValueError: drafted, such a token would fail the verifying forward (a store learned for another model)."""
        path = Path(directory)
        meta = json.loads((path / "suffix_state.json").read_text())
        if meta.get("format") != STATE_FORMAT:
            raise ValueError(f"{path}: unsupported suffix state format {meta.get('format')!r}")
        with np.load(path / "suffix_state.npz") as data:
            tokens, lengths = data["tokens"], data["lengths"]
        if (tokens.ndim != 1 or lengths.ndim != 1 or len(lengths) != meta.get("segments") or (lengths < 0).any()
                or int(lengths.sum()) != tokens.size):
            raise ValueError(f"{path}: suffix_state.npz does not hold the outputs suffix_state.json lists")
        if tokens.size and tokens.min() < 0:
            raise ValueError(f"{path}: negative token ids")
        if tokens.size and vocab_size is not None and tokens.max() >= vocab_size:
            raise ValueError(f"{path}: token ids past the model's vocabulary of {vocab_size} (learned for another "
                             "model?)")
        flat = tokens.tolist()
        self.global_index = NgramIndex(self.config.orders)
        self._global_order.clear()
        start = 0
        for length in lengths.tolist():
            self.learn(flat[start:start + length])
            start += length
        self.model.load_dict(meta["acceptance"])
        return len(self._global_order)

    @property
    def global_tokens(self) -> int:
        return self.global_index.num_tokens


def _group_size(item: tuple[int, list[int]]) -> int:
    return len(item[1])


def _group_next(segments: dict[int, list[int]], positions: list[int]) -> tuple[dict[int, list[int]], int]:
    """Occurrences grouped by the token that follows them, each advanced past that token; and how many had one."""
    groups: dict[int, list[int]] = {}
    total = 0
    for pos in positions:
        seg = segments[pos >> SEGMENT_SHIFT]
        offset = pos & OFFSET_MASK
        if offset < len(seg):
            token = seg[offset]
            total += 1
            group = groups.get(token)
            if group is None:
                groups[token] = [pos + 1]
            else:
                group.append(pos + 1)
    return groups, total
