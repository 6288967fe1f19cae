"""Continuous batching (Orca, Yu et al., 2022) with chunked prefill and preemption by recomputation.

Each step first gives every running request its next tokens (a decode token, the rest of a prefill, or a draft to
verify), then admits waiting requests first-come-first-served while the token budget, the sequence cap and the free
blocks allow (counted over every KV cache group at once). When blocks run out, the newest running request is
preempted: its blocks are freed and it goes back to the waiting queue in its arrival order, to be recomputed later.
Nothing is dropped. Before a step, sliding-window groups give back the blocks their next queries no longer read.

The waiting queue is kept in `queue_key` order (arrival time, then the order requests were added), so the samples of
an n > 1 request, which share an arrival time, always wait in index order: sample 0 stays ahead of its siblings.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from reasoning_engine.engine.kv_cache import BlockManager
from reasoning_engine.engine.request import Request, RequestStatus
from reasoning_engine.engine.state_cache import StateCache


class SchedulerStalled(RuntimeError):
    """A step could schedule nothing although requests wait: a scheduler bug. Raised rather than spinning forever,
    so the engine's callers fail their requests instead of hanging."""


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens run this step, starting at request.num_computed_tokens (drafts included)
    num_draft_tokens: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 states: StateCache | None = None) -> None:
        """`states`: the linear-attention state slots of a hybrid model (None for attention-only models)."""
        self.blocks = block_manager
        self.states = states
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.group_leaders: dict[str, Request] = {}  # n > 1: sample 0 of each unfinished group
        self.returned_turns: list[str] = []  # finished turns whose protected blocks an admitted request found
        self._added = itertools.count()

    def add(self, request: Request) -> None:
        request.queue_key = (request.arrival_time, next(self._added))
        if request.params.n > 1 and request.index == 0:
            self.group_leaders[request.group_id] = request
        self._enqueue(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, budget: int | None = None) -> SchedulerOutput:
        """The next step; `budget` (adaptive batching) replaces max_num_batched_tokens for it."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens if budget is None else budget
        for request in self.running:  # sliding-window groups give back what their next queries no longer read
            self.blocks.slide(request)
        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            draft = len(request.draft) if request.draft is not None else 0
            num_tokens = request.num_tokens - request.num_computed_tokens + draft
            if num_tokens > budget:
                num_tokens, draft = (budget, 0) if request.is_prefilling else (1, 0)
                request.draft = None
            if not self._reserve(request, num_tokens, out):
                continue
            out.scheduled.append(ScheduledRequest(request, num_tokens, draft))
            budget -= num_tokens
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self._waits_for_leader(request):
                break  # keep FCFS: the siblings share sample 0's prompt blocks once they are computed
            if not request.block_table:
                self.blocks.match_prefix(request)
                if self.states is not None:
                    self._restore_state(request)
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.blocks.can_allocate(request, num_tokens):
                self.blocks.free(request)  # give back prefix-cache hits; matched again next time
                break
            self.blocks.allocate(request, num_tokens)
            if self.states is not None:
                self.states.admit(request)
            if request.num_preemptions == 0:
                self.returned_turns += self.blocks.record_prefix_lookup(request)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_tokens))
            budget -= num_tokens
        if not out.scheduled and self.waiting:
            raise SchedulerStalled(self._stall_report())
        return out

    def _restore_state(self, request: Request) -> None:
        """A hybrid model's prefix hit ends where a state snapshot is kept: the blocks past it are given back."""
        hit = len(request.block_table)
        request.state_restore = None
        usable = self.states.usable_hit(request.block_hashes, hit)
        if usable < hit:
            self.blocks.truncate(request, usable * self.blocks.block_size)
            request.num_computed_tokens = usable * self.blocks.block_size
        if usable:
            self.states.restore(request, request.block_hashes[usable - 1])

    def _stall_report(self) -> str:
        head = self.waiting[0]
        return (f"no request can be scheduled: {len(self.running)} running, {len(self.waiting)} waiting; the first "
                f"waiting is {head.seq_id} ({head.num_tokens} tokens, {self.blocks.num_free_blocks} free blocks)")

    def _reserve(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for a running request, preempting the newest others (or itself) until they fit."""
        while not self.blocks.can_allocate(request, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        self.blocks.allocate(request, num_tokens)
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free(request)
        if self.states is not None:
            self.states.release(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        request.draft = None
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        """Insert in `queue_key` order, ahead of everything that arrived later (the back, for a new request)."""
        index = len(self.waiting)
        while index > 0 and self.waiting[index - 1].queue_key > request.queue_key:
            index -= 1
        self.waiting.insert(index, request)

    def _waits_for_leader(self, request: Request) -> bool:
        """A sibling waits while its sample 0 is running its prompt, so that it can share those blocks. Derived from
        the leader's state, not remembered, so a preempted or finished leader can never leave it waiting forever."""
        leader = self.group_leaders.get(request.group_id)
        return (leader is not None and leader is not request and leader.status == RequestStatus.RUNNING
                and leader.num_computed_tokens < leader.num_prompt_tokens)

    def finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request)
        if self.states is not None:
            self.states.release(request)
        request.status = RequestStatus.FINISHED
        if self.group_leaders.get(request.group_id) is request:
            del self.group_leaders[request.group_id]
