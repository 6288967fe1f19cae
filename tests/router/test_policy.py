"""Routing policies over ReplicaState: round-robin, least-loaded, cache-aware with its load balance."""

from __future__ import annotations

import pytest

from reasoning_engine.router.policy import ReplicaState, RoundRobin, RoutingConfig, choose
from reasoning_engine.router.prefix import block_hashes

CACHE_AWARE = RoutingConfig("cache-aware", overlap_weight=1.0, balance_abs_threshold=4, balance_rel_threshold=1.5)


def replicas(count: int = 3) -> list[ReplicaState]:
    return [ReplicaState(f"http://r{i}") for i in range(count)]


def test_round_robin_walks_the_healthy_replicas() -> None:
    pool, turn = replicas(), RoundRobin()
    config = RoutingConfig("round-robin")
    assert [choose(pool, [], config, turn).url for _ in range(4)] == ["http://r0", "http://r1", "http://r2",
                                                                      "http://r0"]
    pool[1].healthy = False
    picked = {choose(pool, [], config, turn).url for _ in range(4)}
    assert picked == {"http://r0", "http://r2"}
    tried = frozenset({"http://r0", "http://r2"})
    assert choose(pool, [], config, turn, exclude=tried).url == "http://r1"  # none healthy left: try a down one
    assert choose(pool, [], config, turn, exclude=tried | {"http://r1"}) is None


def test_least_loaded_takes_the_fewest_in_flight() -> None:
    pool = replicas()
    pool[0].in_flight, pool[1].in_flight, pool[2].in_flight = 3, 1, 2
    assert choose(pool, [], RoutingConfig("least-loaded"), RoundRobin()).url == "http://r1"


def test_cache_aware_follows_the_prefix_while_it_costs_less_than_the_load() -> None:
    pool, turn = replicas(2), RoundRobin()
    session = block_hashes("s" * 640, 64)  # 10 blocks
    pool[1].prefix.add(session)
    longer = block_hashes("s" * 640 + "n" * 128, 64)  # 12 blocks: 2 to prefill on r1, 12 on r0
    pool[1].in_flight, pool[1].active_blocks = 1, 9
    assert choose(pool, longer, CACHE_AWARE, turn).url == "http://r1"  # 2 + 9 < 12 + 0
    pool[1].active_blocks = 11
    assert choose(pool, longer, CACHE_AWARE, turn).url == "http://r0"  # 2 + 11 > 12 + 0: the load wins
    weighted = RoutingConfig("cache-aware", overlap_weight=2.0)
    assert choose(pool, longer, weighted, turn).url == "http://r1"  # 2 x 2 + 11 < 2 x 12
    fresh = block_hashes("f" * 640, 64)  # nobody holds it: the lower load
    assert choose(pool, fresh, CACHE_AWARE, turn).url == "http://r0"
    pool[1].in_flight = pool[1].active_blocks = 0
    assert choose(pool, fresh, CACHE_AWARE, turn).url == "http://r0"  # a tie: the one holding fewer blocks


def test_cache_aware_yields_to_imbalance() -> None:
    pool, turn = replicas(2), RoundRobin()
    prompt = block_hashes("s" * 640, 64)
    pool[1].prefix.add(prompt)
    pool[1].in_flight = 5  # 5 - 0 > 4 and 5 > 1.5 x 0: imbalanced, the holder is passed over
    assert choose(pool, prompt, CACHE_AWARE, turn).url == "http://r0"
    pool[0].in_flight = 4  # 5 - 4 is within the absolute threshold: back to the holder
    assert choose(pool, prompt, CACHE_AWARE, turn).url == "http://r1"
    assert choose(pool, [], CACHE_AWARE, turn).url == "http://r0"  # no prompt (a GET): the least loaded


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="policy"):
        RoutingConfig("random")
    with pytest.raises(ValueError, match="overlap_weight"):
        RoutingConfig(overlap_weight=-1.0)
