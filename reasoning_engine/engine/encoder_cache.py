"""Which vision-encoder outputs each worker keeps, decided by the driver.

The driver plans, the workers obey: every rank of a replica gets the same plan in its `StepInput` (the items to encode,
with their pixels, and the hashes to drop), so all ranks hold the same outputs without asking each other. Outputs are
keyed by content hash, so the same image in another turn or another request is encoded once while it stays cached.
An item that was dropped and is needed again (a long prompt's later chunk, a preempted request) is simply encoded again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from reasoning_engine.multimodal.inputs import MediaItem


@dataclass(frozen=True)
class MediaSlice:
    """Rows [start, stop) of an item's encoder output become the input embeddings of the step's rows from `row`."""

    content_hash: str
    start: int
    stop: int
    row: int


class EncoderCachePlan:
    """One replica's view of its workers' encoder outputs: least recently used first out, within a token budget
    that a step's own items may exceed (they are never dropped while the step needs them)."""

    def __init__(self, budget_tokens: int) -> None:
        self.budget_tokens = budget_tokens
        self.held: OrderedDict[str, int] = OrderedDict()  # content hash -> rows
        self.hits = 0  # items a step needed that were already encoded
        self.misses = 0

    def plan(self, needed: list[MediaItem]) -> tuple[list[MediaItem], list[str]]:
        """The items to encode for a step that reads `needed`, and the hashes the workers drop first."""
        wanted: dict[str, MediaItem] = {item.content_hash: item for item in needed}
        encode = []
        for key, item in wanted.items():
            if key in self.held:
                self.held.move_to_end(key)
                self.hits += 1
            else:
                encode.append(item)
                self.misses += 1
        total = sum(self.held.values()) + sum(item.length for item in encode)
        drop = []
        for key in list(self.held):
            if total <= self.budget_tokens:
                break
            if key not in wanted:
                total -= self.held.pop(key)
                drop.append(key)
        for item in encode:
            self.held[item.content_hash] = item.length
        return encode, drop
