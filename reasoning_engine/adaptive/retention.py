"""How long to keep an agent's KV cache after its turn, learned from how long agents take to come back.

An agent's turn ends in a tool call; its next turn arrives after the tool ran, with the whole conversation again as
its prompt. Plain LRU may evict those blocks meanwhile. A finished request that ended in tool calls, or that carries a
session key, gets its blocks protected (engine/kv_cache.py: evicted after every unprotected block) for a hold time
learned per workload class: a high quantile of the observed return gaps (the time from a session's last finish to its
next arrival), with a margin. Until enough gaps are seen the hold is `DEFAULT_HOLD_S`.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

DEFAULT_HOLD_S = 60.0
MIN_HOLD_S, MAX_HOLD_S = 2.0, 900.0
QUANTILE, MARGIN = 0.9, 1.5
MAX_GAPS = 512  # per class, the most recent


@dataclass
class ReturnGaps:
    """The recent return gaps of one workload class, kept sorted for quantiles."""

    recent: list[float] = field(default_factory=list)  # arrival order
    ordered: list[float] = field(default_factory=list)

    def add(self, gap: float) -> None:
        self.recent.append(gap)
        bisect.insort(self.ordered, gap)
        if len(self.recent) > MAX_GAPS:
            self.ordered.pop(bisect.bisect_left(self.ordered, self.recent.pop(0)))

    def hold_seconds(self) -> float:
        if len(self.ordered) < 4:
            return DEFAULT_HOLD_S
        gap = self.ordered[min(len(self.ordered) - 1, int(QUANTILE * len(self.ordered)))]
        return min(MAX_HOLD_S, max(MIN_HOLD_S, gap * MARGIN))


class SessionRetention:
    """Sessions' last finish times and each class's return gaps."""

    def __init__(self) -> None:
        self.gaps: dict[str, ReturnGaps] = {}
        # session -> (finish time, workload class), oldest finish first
        self.last_finish: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def arrived(self, session: str, now: float) -> float | None:
        """A request of `session` arrived: its return gap, recorded for the class of the turn before, if any."""
        previous = self.last_finish.pop(session, None)
        if previous is None:
            return None
        finished, workload = previous
        gap = max(0.0, now - finished)
        self.gaps.setdefault(workload, ReturnGaps()).add(gap)
        return gap

    def finished(self, session: str, workload: str, now: float) -> float:
        """A turn of `session` finished: remember when, and return how long to protect its blocks."""
        self.last_finish[session] = (now, workload)
        self.last_finish.move_to_end(session)
        if len(self.last_finish) > 100_000:  # sessions that never came back
            self.last_finish.popitem(last=False)
        return self.hold_seconds(workload)

    def hold_seconds(self, workload: str) -> float:
        gaps = self.gaps.get(workload)
        return gaps.hold_seconds() if gaps is not None else DEFAULT_HOLD_S

    def summary(self) -> dict[str, dict[str, float]]:
        return {workload: {"gaps_seen": len(g.recent), "hold_seconds": round(g.hold_seconds(), 2),
                           "median_gap_seconds": round(g.ordered[len(g.ordered) // 2], 3) if g.ordered else 0.0}
                for workload, g in sorted(self.gaps.items())}

    def to_dict(self) -> dict[str, Any]:
        return {workload: g.recent for workload, g in self.gaps.items()}

    def load(self, data: dict[str, Any]) -> None:
        self.gaps = {}
        for workload, recent in data.items():
            gaps = ReturnGaps()
            for gap in recent:
                if not isinstance(gap, (int, float)) or gap < 0:
                    raise ValueError("return gaps must be non-negative numbers")
                gaps.add(float(gap))
            self.gaps[str(workload)] = gaps
