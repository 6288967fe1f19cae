"""Slots of linear-attention state (Gated DeltaNet, Kimi Delta Attention): the cache group whose size per request is
fixed, whatever its length.

A linear-attention layer keeps, per sequence, a short-convolution state and a recurrent matrix state instead of a
K/V row per token. The worker holds one tensor per layer and kind, indexed by slot; this is the driver's bookkeeping
of the slots. Each running request owns one live slot (taken at admission, given back when it finishes or is
preempted). The other slots hold snapshots: the state after the first `p` tokens of some sequence, `p` a block
boundary, named by the prefix-cache key of the block that ends there. A prefix hit restores the state from the
snapshot at its last block (the KV blocks of the full-attention layers come from the BlockManager as before), so
a hit needs a snapshot at its end as well as the blocks.

Which boundaries get a snapshot (every block's would cost far more than the KV it saves): the last boundary of the
prompt (a repeated prompt, the samples of an n > 1 request), every `interval` blocks (shared long prefixes, such as
system prompts), and while decoding the latest boundary only (an agent's next turn starts with this turn's text).
Snapshots are evicted least recently used first, those in the middle of a prompt before those at the end of a turn
(a long prompt's interval snapshots would otherwise push out every other conversation's), and never hold a slot a
running request needs: the pool has a live slot for every sequence the scheduler may run, plus the snapshots.

A snapshot becomes visible only after the step that writes it (`end_step`); a hit's copy into the live slot runs at
the start of the step that admits the request, before any write of that step, so a slot evicted and reused in the
same step is still read intact.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from reasoning_engine.engine.request import Request


@dataclass
class StatePlan:
    """One step's state work for one sequence: the slot it reads and writes, whether it starts from zeros, a
    snapshot to copy in first, and the snapshots to save (tokens into this step, slot)."""

    slot: int
    fresh: bool
    restore: int | None = None
    saves: list[tuple[int, int]] = field(default_factory=list)


class StateCache:
    def __init__(self, num_slots: int, live_slots: int, block_size: int, interval_blocks: int = 32,
                 enable_prefix_caching: bool = True) -> None:
        if num_slots < live_slots:
            raise ValueError(f"{num_slots} state slots cannot hold {live_slots} running sequences")
        self.num_slots = num_slots
        self.block_size = block_size
        self.interval_blocks = interval_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() takes the lowest
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self.turn_ends: set[bytes] = set()  # snapshots at a prompt's end or a decode's latest boundary: evicted last
        self.pending: list[tuple[bytes, int]] = []  # written by this step, visible after it
        self.latest: dict[str, bytes] = {}  # seq_id -> key of its latest decode-boundary snapshot

    @property
    def num_snapshots(self) -> int:
        return len(self.snapshots)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_slots

    # ---- live slots ----
    def admit(self, request: Request) -> None:
        """A live slot for a request being admitted (it has none while waiting)."""
        if request.state_slot is None:
            request.state_slot = self._take_slot()

    def release(self, request: Request) -> None:
        """A request finished or was preempted: its live slot goes back (its snapshots stay, as cached state)."""
        if request.state_slot is not None:
            self.free.append(request.state_slot)
            request.state_slot = None
        request.state_restore = None
        self.latest.pop(request.seq_id, None)

    def _take_slot(self) -> int:
        if not self.free:
            if not self.snapshots:
                raise RuntimeError("no state slot free and no snapshot to evict")  # the pool was sized too small
            key = next((k for k in self.snapshots if k not in self.turn_ends), next(iter(self.snapshots)))
            slot = self.snapshots.pop(key)
            self.turn_ends.discard(key)
            return slot
        return self.free.pop()

    # ---- prefix hits ----
    def usable_hit(self, keys: list[bytes], hit_blocks: int) -> int:
        """Of a prefix hit of `hit_blocks` blocks (their keys), how many can be used: the longest prefix ending in a
        snapshot. 0 means none."""
        for blocks in range(hit_blocks, 0, -1):
            if keys[blocks - 1] in self.snapshots:
                return blocks
        return 0

    def restore(self, request: Request, key: bytes) -> None:
        """The request's state starts from the snapshot named `key` (copied into its live slot at its next step)."""
        slot = self.snapshots[key]
        self.snapshots.move_to_end(key)
        request.state_restore = slot

    # ---- snapshots ----
    def plan(self, request: Request, start: int, stop: int, key_of) -> StatePlan:
        """The state work of a request's step over positions [start, stop) (no draft): its live slot, the snapshot
        to restore, and the boundaries in (start, stop] to snapshot. `key_of(i)` is the prefix key of block i."""
        plan = StatePlan(request.state_slot, fresh=start == 0 and request.state_restore is None,
                         restore=request.state_restore)
        request.state_restore = None
        if self.enable_prefix_caching:
            prompt_end = self._prompt_boundary(request)
            for boundary in self._boundaries(request, start, stop):
                slot = self.save(request, key_of(boundary // self.block_size - 1), decode=boundary > prompt_end,
                                 turn_end=boundary >= prompt_end)
                if slot is not None:
                    plan.saves.append((boundary - start, slot))
        return plan

    def boundaries_after_verify(self, request: Request, start: int, stop: int) -> list[int]:
        """Boundaries in (start, stop] worth a snapshot, for the accepted part of a verified draft."""
        return list(self._boundaries(request, start, stop)) if self.enable_prefix_caching else []

    def save(self, request: Request, key: bytes, decode: bool, turn_end: bool = True) -> int | None:
        """A slot to write the snapshot `key` into during this step, or None when it is already kept."""
        if key in self.snapshots or any(k == key for k, _ in self.pending):
            return None
        if not self.free and not self.snapshots:
            return None  # every slot is live or written this step: this boundary goes without a snapshot
        if decode:  # while decoding, only the latest boundary's snapshot is kept
            previous = self.latest.get(request.seq_id)
            if previous is not None and previous in self.snapshots:
                self._drop(previous)
            self.latest[request.seq_id] = key
        slot = self._take_slot()
        self.pending.append((key, slot))
        if turn_end:
            self.turn_ends.add(key)
        return slot

    def end_step(self) -> None:
        """The step ran: the snapshots it wrote can be hit."""
        for key, slot in self.pending:
            self.snapshots[key] = slot
        self.pending.clear()

    def _drop(self, key: bytes) -> None:
        self.turn_ends.discard(key)
        self.free.append(self.snapshots.pop(key))

    def _prompt_boundary(self, request: Request) -> int:
        """The last block boundary a later request with this prompt can hit (a hit leaves >= 1 token to run)."""
        return (request.num_prompt_tokens - 1) // self.block_size * self.block_size

    def _boundaries(self, request: Request, start: int, stop: int):
        bs = self.block_size
        prompt_end = self._prompt_boundary(request)
        last = stop // bs * bs
        for boundary in range((start // bs + 1) * bs, stop + 1, bs):
            if boundary > prompt_end:  # decoding: only the last boundary of the step
                if boundary == last:
                    yield boundary
            elif boundary == prompt_end or boundary % (self.interval_blocks * bs) == 0:
                yield boundary
