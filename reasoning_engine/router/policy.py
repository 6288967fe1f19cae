"""Which replica takes a request: round-robin, least-loaded, or cache-aware. Plain functions over ReplicaState.

Cache-aware scores each replica as Dynamo's KV router does (docs.nvidia.com/dynamo, "Router Design": cost =
kv-overlap-score-weight x the prompt blocks the replica would have to prefill + the blocks active on it, lowest
wins): `overlap_weight x (prompt blocks - blocks it holds) + prompt blocks in flight on it`. A conversation's next
turn stays on the replica holding its history while that costs less than the load it adds there, and a new prompt
that only shares a system prompt goes where the load is lower. Over that, SGLang's cache-aware router's balance
guard (its documented defaults: balance-abs-threshold 64, balance-rel-threshold 1.5): once the busiest replica has
more than `balance_abs_threshold` requests over the idlest and more than `balance_rel_threshold` x its requests,
the least-loaded replica takes the request whatever it holds, so no replica is swamped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reasoning_engine.router.prefix import DEFAULT_MAX_BLOCKS, PrefixIndex

POLICIES = ("cache-aware", "least-loaded", "round-robin")


@dataclass
class ReplicaState:
    """One replica as the router sees it."""

    url: str
    max_blocks: int = DEFAULT_MAX_BLOCKS
    healthy: bool = True
    in_flight: int = 0
    active_blocks: int = 0  # prompt blocks of the requests in flight on it
    requests: int = 0  # sent to it, retries included
    failures: int = 0  # connection errors, timeouts, 5xx before any byte reached the client
    prefix: PrefixIndex = field(init=False)

    def __post_init__(self) -> None:
        self.prefix = PrefixIndex(self.max_blocks)


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "cache-aware"
    overlap_weight: float = 1.0
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.overlap_weight >= 0.0:
            raise ValueError(f"overlap_weight must be >= 0, got {self.overlap_weight}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")


@dataclass
class RoundRobin:
    """The next index of a round-robin walk over the replicas."""

    position: int = 0

    def next(self, count: int) -> int:
        index = self.position % count
        self.position += 1
        return index


def least_loaded(replicas: list[ReplicaState]) -> ReplicaState:
    """Fewest in flight; ties: fewest cached blocks, then the first listed."""
    return min(replicas, key=lambda r: (r.in_flight, len(r.prefix)))


def is_imbalanced(replicas: list[ReplicaState], config: RoutingConfig) -> bool:
    loads = [r.in_flight for r in replicas]
    busiest, idlest = max(loads), min(loads)
    return busiest - idlest > config.balance_abs_threshold and busiest > config.balance_rel_threshold * idlest


def prefill_cost(replica: ReplicaState, hashes: list[bytes], config: RoutingConfig) -> float:
    """What sending a prompt of blocks `hashes` to `replica` costs: its blocks to prefill there, weighted, plus the
    blocks already active there."""
    return config.overlap_weight * (len(hashes) - replica.prefix.matched(hashes)) + replica.active_blocks


def cache_aware(replicas: list[ReplicaState], hashes: list[bytes], config: RoutingConfig) -> ReplicaState:
    if not hashes or is_imbalanced(replicas, config):
        return least_loaded(replicas)
    return min(replicas, key=lambda r: (prefill_cost(r, hashes, config), r.in_flight, len(r.prefix)))


def choose(replicas: list[ReplicaState], hashes: list[bytes], config: RoutingConfig, turn: RoundRobin,
           exclude: frozenset[str] = frozenset()) -> ReplicaState | None:
    """The replica for a request with prompt blocks `hashes` among the healthy ones not in `exclude` (replicas
    that already failed this request). When none is healthy, among those marked down (Envoy's "panic" routing:
    a replica may be back before its next health check, and one that is not fails fast); None when every replica
    was tried."""
    untried = [r for r in replicas if r.url not in exclude]
    candidates = [r for r in untried if r.healthy] or untried
    if not candidates:
        return None
    if config.policy == "round-robin":
        return candidates[turn.next(len(candidates))]
    if config.policy == "least-loaded":
        return least_loaded(candidates)
    return cache_aware(candidates, hashes, config)
