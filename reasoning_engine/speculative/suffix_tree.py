"""Suffix proposer: speculation that learns from the request itself and from the workload's recent outputs.

After SuffixDecoding (Oliaro et al., 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications",
arXiv:2411.04975): a per-request suffix structure over the prompt and output plus a global one over recent outputs; the
longest matching suffix of the context selects a node, and a draft tree grows below it, ranked by how often each
continuation followed the pattern. This implementation is our own; its suffix trees are implicit (index.py): a node is
the set of recent occurrences of a pattern, its children the groups of those occurrences by the next token, a child's
probability the share of occurrences it keeps (the count ratio).

Drafting, per step:
- match: the longest indexed order n whose last-n-token pattern occurred before, in the request and in the global store;
- grow: best-first by path probability (product of count ratios), children below `min_token_prob` pruned, depth capped
  at `depth_per_match * n` (a short match is weak evidence, so its draft stays short), at most the draft budget nodes;
  a path draft follows only the most probable child;
- pick: the source whose draft has the larger expected accepted length (sum of path probabilities).

The global store keeps the last `global_max_tokens` tokens of finished outputs (each with the last `prompt_tail` tokens
of its context, so the start of an answer can be predicted from how prompts end), evicting the oldest outputs first.
`save`/`load` persist it as tokens; loading re-indexes them.
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from reasoning_engine.speculative.draft import Draft
from reasoning_engine.speculative.index import OFFSET_MASK, SEGMENT_SHIFT, ContextStore, NgramIndex, window_key

STATE_FORMAT = 1


@dataclass(frozen=True)
class SuffixConfig:
    orders: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
    max_occurrences: int = 64
    min_token_prob: float = 0.1
    depth_per_match: float = 1.0
    tree: bool = True
    global_max_tokens: int = 1_000_000
    prompt_tail: int = 8
    reuse_capacity: int = 8
    mixed: bool = False
    levels: int = 3
    weight_exp: float = 2.0
    global_weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.orders or min(self.orders) < 1:
            raise ValueError(f"orders must be positive, got {self.orders!r}")
        if self.max_occurrences < 1:
            raise ValueError(f"max_occurrences must be >= 1, got {self.max_occurrences}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if self.depth_per_match <= 0:
            raise ValueError(f"depth_per_match must be > 0, got {self.depth_per_match}")
        if self.global_max_tokens < 0 or self.prompt_tail < 0 or self.reuse_capacity < 0:
            raise ValueError("global_max_tokens, prompt_tail and reuse_capacity must be >= 0")


class SuffixProposer:
    method = "suffix"

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self.contexts = ContextStore(self.config.orders, self.config.reuse_capacity)
        self.global_index = NgramIndex(self.config.orders)
        self._global_order: deque[int] = deque()

    # -- request lifecycle -------------------------------------------------------------------------------------------

    def start_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        self.contexts.start(request_id, prompt_token_ids)

    def on_tokens_accepted(self, request_id: str, new_token_ids: Sequence[int]) -> None:
        self.contexts.get(request_id).extend(new_token_ids)

    def finish_request(self, request_id: str, learn: bool = True) -> None:
        """Learn the finished output into the global store (skip with learn=False, e.g. for an aborted request)."""
        context = self.contexts.finish(request_id)
        if learn and len(context.tokens) > context.prompt_len:
            self.learn(context.tokens[max(0, context.prompt_len - self.config.prompt_tail):])

    def learn(self, tokens: Sequence[int]) -> None:
        """Add one sequence to the global store, evicting the oldest ones beyond `global_max_tokens`."""
        if not tokens or self.config.global_max_tokens == 0:
            return
        self._global_order.append(self.global_index.add_segment(tokens))
        while self.global_index.num_tokens > self.config.global_max_tokens and len(self._global_order) > 1:
            self.global_index.drop_segment(self._global_order.popleft())

    # -- drafting ----------------------------------------------------------------------------------------------------

    def propose(self, request_id: str, token_ids: Sequence[int], max_draft_tokens: int) -> Draft:
        context = self.contexts.sync(request_id, token_ids)
        if max_draft_tokens <= 0:
            return Draft.empty()
        end = len(context.tokens)
        if self.config.mixed:
            return self._propose_mixed(context, end, max_draft_tokens)
        best = Draft.empty()
        for index, local in ((context.index, True), (self.global_index, False)):
            order, occurrences = self._match(index, context.prefix, end, local)
            if not occurrences:
                continue
            depth = min(max_draft_tokens, max(1, int(self.config.depth_per_match * order)))
            draft = self._grow(index.segments, occurrences, max_draft_tokens, depth)
            if draft.score > best.score:
                best = draft
        return best

    def _match(self, index: NgramIndex, prefix: list[int], end: int, local: bool) -> tuple[int, list[int]]:
        """The longest order whose last-n-token pattern occurred before, and its most recent occurrences."""
        limit = self.config.max_occurrences
        for i in range(len(index.orders) - 1, -1, -1):
            n = index.orders[i]
            if n > end:
                continue
            found = index.tables[i].get(window_key(prefix, end, n, index.powers[i]))
            if found is None:
                continue
            occurrences = [found] if found.__class__ is int else found[-limit - 1:]
            if local and occurrences[-1] >= end:
                occurrences.pop()
            if occurrences:
                return n, occurrences[-limit:]
        return 0, []

    def _grow(self, segments: dict[int, list[int]], occurrences: list[int], budget: int, max_depth: int) -> Draft:
        """Best-first expansion of the implicit suffix-tree node below the matched pattern."""
        min_prob = self.config.min_token_prob
        tree = self.config.tree
        tokens: list[int] = []
        parents: list[int] = []
        score = 0.0
        heap: list[tuple[float, int, int, int, list[int], int]] = []
        order = itertools.count()  # ties go to the earlier-found branch

        def expand(node: int, positions: list[int], depth: int, prob: float) -> None:
            groups = _group_next(segments, positions)
            total = sum(len(g) for g in groups.values())
            children = sorted(groups.items(), key=lambda item: -len(item[1]))
            for token, group in children if tree else children[:1]:
                ratio = len(group) / total
                if ratio < min_prob:
                    break
                heapq.heappush(heap, (-prob * ratio, next(order), node, token, group, depth + 1))

        expand(-1, occurrences, 0, 1.0)
        while heap and len(tokens) < budget:
            neg_prob, _, parent, token, group, depth = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent)
            score -= neg_prob
            if not tree:
                heap.clear()
            if depth < max_depth:
                expand(len(tokens) - 1, group, depth, -neg_prob)
        return Draft(tokens, parents, score)

    def _propose_mixed(self, context, end, budget):
        cfg = self.config
        P, W, L = [], [], []
        for index, local, sw in ((context.index, True, 1.0), (self.global_index, False, cfg.global_weight)):
            seen = set()
            levels = 0
            for i in range(len(index.orders) - 1, -1, -1):
                n = index.orders[i]
                if n > end:
                    continue
                found = index.tables[i].get(window_key(context.prefix, end, n, index.powers[i]))
                if found is None:
                    continue
                occ = [found] if found.__class__ is int else found[-cfg.max_occurrences - 1:]
                if local and occ[-1] >= end:
                    occ.pop()
                occ = occ[-cfg.max_occurrences:]
                if not occ:
                    continue
                w = sw * n ** cfg.weight_exp
                lim = max(1, int(cfg.depth_per_match * n))
                for q in occ:
                    if q not in seen:
                        seen.add(q)
                        P.append(q if not local else q | (1 << 62))
                        W.append(w)
                        L.append(lim)
                levels += 1
                if levels >= cfg.levels:
                    break
        if not P:
            return Draft.empty()
        local_seg = context.tokens
        gsegs = self.global_index.segments
        min_prob = cfg.min_token_prob
        tree = cfg.tree
        tokens, parents = [], []
        score = 0.0
        heap = []
        order = itertools.count()
        FLAG = 1 << 62

        def expand(node, P, W, L, depth, prob):
            groups = {}
            total = 0.0
            for q, w, lim in zip(P, W, L):
                total += w
                if lim <= depth:
                    continue
                if q & FLAG:
                    off = q & OFFSET_MASK
                    if off >= len(local_seg):
                        continue
                    t = local_seg[off]
                else:
                    seg = gsegs[q >> SEGMENT_SHIFT]
                    off = q & OFFSET_MASK
                    if off >= len(seg):
                        continue
                    t = seg[off]
                g = groups.get(t)
                if g is None:
                    groups[t] = g = [0.0, [], [], []]
                g[0] += w
                g[1].append(q + 1)
                g[2].append(w)
                g[3].append(lim)
            children = sorted(groups.items(), key=lambda item: -item[1][0])
            for t, g in children if tree else children[:1]:
                ratio = g[0] / total
                if ratio < min_prob:
                    break
                heapq.heappush(heap, (-prob * ratio, next(order), node, t, g, depth + 1))

        expand(-1, P, W, L, 0, 1.0)
        while heap and len(tokens) < budget:
            neg, _, parent, t, g, depth = heapq.heappop(heap)
            tokens.append(t)
            parents.append(parent)
            score -= neg
            if not tree:
                heap.clear()
            if depth < budget:
                expand(len(tokens) - 1, g[1], g[2], g[3], depth, -neg)
        return Draft(tokens, parents, score)

    # -- persistence -------------------------------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write the global store (tokens of each kept output, oldest first); atomic per file."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        segments = [self.global_index.segments[s] for s in self._global_order]
        lengths = np.array([len(s) for s in segments], dtype=np.int64)
        flat = np.fromiter((t for s in segments for t in s), dtype=np.int64, count=int(lengths.sum()))
        tmp = path / "suffix_state.tmp.npz"
        np.savez(tmp, tokens=flat, lengths=lengths)
        os.replace(tmp, path / "suffix_state.npz")
        meta = {"format": STATE_FORMAT, "method": self.method, "segments": len(segments), "tokens": int(lengths.sum()),
                "config": asdict(self.config)}
        tmp_meta = path / "suffix_state.tmp.json"
        tmp_meta.write_text(json.dumps(meta, indent=1))
        os.replace(tmp_meta, path / "suffix_state.json")

    def load(self, directory: str | os.PathLike[str]) -> int:
        """Replace the global store with the one saved in `directory`; returns the number of outputs loaded."""
        path = Path(directory)
        meta = json.loads((path / "suffix_state.json").read_text())
        if meta.get("format") != STATE_FORMAT:
            raise ValueError(f"{path}: unsupported suffix state format {meta.get('format')!r}")
        with np.load(path / "suffix_state.npz") as data:
            flat, lengths = data["tokens"].tolist(), data["lengths"].tolist()
        self.global_index = NgramIndex(self.config.orders)
        self._global_order.clear()
        start = 0
        for length in lengths:
            self.learn(flat[start:start + length])
            start += length
        return len(self._global_order)

    @property
    def global_tokens(self) -> int:
        return self.global_index.num_tokens


def _group_next(segments: dict[int, list[int]], positions: list[int]) -> dict[int, list[int]]:
    """Occurrences grouped by the token that follows them, each advanced past that token."""
    groups: dict[int, list[int]] = {}
    for pos in positions:
        seg = segments[pos >> SEGMENT_SHIFT]
        offset = pos & OFFSET_MASK
        if offset < len(seg):
            token = seg[offset]
            group = groups.get(token)
            if group is None:
                groups[token] = [pos + 1]
            else:
                group.append(pos + 1)
    return groups
