"""The prefix cache's events: what a router reads to follow which blocks a replica holds."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.engine.kv_cache import prefix_hashes
from reasoning_engine.engine.kv_events import KVEventLog

TINY = dict(dtype="float32", device="cpu", block_size=4, kv_cache_blocks=12, max_model_len=48, adaptive=False)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _prompts(count: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(5, 60) for _ in range(30)] for _ in range(count)]


def _held(events: list[dict]) -> set[str]:
    """The blocks a reader of these events believes the replica holds."""
    held: set[str] = set()
    for event in events:
        (held.add if event["kind"] == "stored" else held.discard)(event["block_hash"])
    return held


def test_stored_and_removed_events_follow_the_device_cache(llama_dir: Path) -> None:
    """A prompt's full blocks are stored with their chain of parents; evicting them for other prompts removes them;
    replaying the events gives exactly the named blocks the cache holds."""
    a, b, c = _prompts(3)
    llm = LLM(llama_dir, **TINY)
    llm.generate([{"prompt_token_ids": a}], GREEDY)
    log = llm.engine.kv_events()
    keys = [k.hex() for k in prefix_hashes(a, 4)]
    stored = [e for e in log["events"] if e["kind"] == "stored"]
    assert [e["block_hash"] for e in stored[:len(keys)]] == keys  # the prompt's 7 full blocks, in order
    assert [e["parent_hash"] for e in stored[:len(keys)]] == [None, *keys[:-1]]
    assert all(e["medium"] == "device" for e in stored) and not log["dropped"]
    assert [e["seq"] for e in log["events"]] == list(range(1, len(log["events"]) + 1))
    for prompt in (b, c):
        llm.generate([{"prompt_token_ids": prompt}], GREEDY)
    more = llm.engine.kv_events(after=log["next_after"])
    assert {e["block_hash"] for e in more["events"] if e["kind"] == "removed"} & set(keys)  # a's blocks reused
    everything = llm.engine.kv_events()["events"]
    assert _held(everything) == {k.hex() for k in llm.engine.block_manager.group_cached[0]}
    assert llm.engine.kv_events(after=everything[-1]["seq"])["events"] == []


def test_the_log_is_bounded_and_says_what_a_slow_reader_lost() -> None:
    log = KVEventLog(capacity=3)
    for i in range(5):
        log.stored(bytes([i]) * 32, None)
    out = log.since(0)
    assert [e["seq"] for e in out["events"]] == [3, 4, 5] and out["dropped"] and out["next_after"] == 5
    assert log.since(2) == {**log.since(2), "dropped": False}
    assert [e["seq"] for e in log.since(3, limit=1)["events"]] == [4]
    assert log.since(5)["events"] == [] and log.since(5)["next_after"] == 5
    restarted = log.since(99)  # a number this log never gave: start over from what it keeps
    assert restarted["dropped"] and [e["seq"] for e in restarted["events"]] == [3, 4, 5]
    with pytest.raises(ValueError, match="after"):
        log.since(-1)
    with pytest.raises(ValueError, match="capacity"):
        KVEventLog(capacity=0)


def test_blocks_copied_back_from_the_host_tier_are_stored_from_host(llama_dir: Path) -> None:
    a, b = _prompts(2)
    llm = LLM(llama_dir, kv_offload_size="1MiB", **TINY)
    for prompt in (a, b, a):
        llm.generate([{"prompt_token_ids": prompt}], GREEDY)
    events = llm.engine.kv_events()["events"]
    keys = {k.hex() for k in prefix_hashes(a, 4)}
    from_host = [e["block_hash"] for e in events if e["medium"] == "host"]
    # the blocks of a the device had lost came back from host memory, one event each
    assert from_host and set(from_host) <= keys
    assert len(from_host) * 4 == llm.engine.stats().kv_offload_host_hits
    assert _held(events) == {k.hex() for k in llm.engine.block_manager.group_cached[0]}
