"""KV tiers under the prefix cache (engine/kv_tiers.py): a block evicted from a tiny device pool is kept in host memory
and copied back on a later hit, the host tier's victims go to a folder that a restarted engine serves from, damaged
files are skipped and counted, salts stay apart, and random mixes with preemption, aborts, n > 1 and speculation give
the outputs of an engine without tiers with every block back and the host tier within its bound."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.cache_groups import CacheGroup
from reasoning_engine.engine.kv_cache import prefix_hashes
from reasoning_engine.engine.kv_tiers import TierIndex, tiers_supported
from reasoning_engine.server.metrics import ServerMetrics

# 12 blocks of 4 tokens: two 30-token prompts do not fit together, so the second evicts the first one's blocks
TINY = dict(dtype="float32", device="cpu", block_size=4, kv_cache_blocks=12, max_model_len=48, adaptive=False)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _prompts(seed: int, count: int = 2, length: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 60) for _ in range(length)] for _ in range(count)]


def _run(llm: LLM, prompts: list, params: SamplingParams = GREEDY) -> list[list[int]]:
    """One prompt at a time (each turn after the previous one, as an agent's)."""
    return [llm.generate([p if isinstance(p, dict) else {"prompt_token_ids": p}], params)[0].outputs[0].token_ids
            for p in prompts]


def _store_matches_index(llm: LLM) -> None:
    """What rank 0 holds in host memory is what the driver's index says, within the bound."""
    tiers = llm.engine.block_manager.tiers
    store = llm.engine.runner.worker.tier_store
    llm.engine.step()  # runs any ops left planned
    assert set(store.entries) == set(tiers.host)
    assert len(tiers.host) <= tiers.host_blocks
    assert sum(e.numel() for e in store.entries.values()) <= llm.engine.config.kv_offload_size


def test_host_tier_serves_an_evicted_prefix(llama_dir: Path) -> None:
    a, b = _prompts(0)
    turns = [a, b, a, b]
    plain = LLM(llama_dir, **TINY)
    expected = _run(plain, turns)
    tiered = LLM(llama_dir, kv_offload_size="1MiB", **TINY)
    assert _run(tiered, turns) == expected
    stats, before = tiered.engine.stats(), plain.engine.stats()
    # the repeats of a and b hit all 7 full blocks of their prompts: what the device lost comes back from host memory
    assert stats.prefix_cache_hits == 2 * 28 > before.prefix_cache_hits
    assert stats.kv_offload_host_hits == 2 * 28 - before.prefix_cache_hits
    assert stats.kv_offload_host_stored_blocks > 0 and stats.kv_offload_host_bytes > 0
    assert stats.kv_cache_usage == 0.0 and plain.engine.stats().kv_cache_usage == 0.0
    _store_matches_index(tiered)
    text = ServerMetrics(tiered.engine.stats, "m").render().decode()
    assert f'reasoning_engine:kv_offload_host_hits_total{{model_name="m"}} {float(stats.kv_offload_host_hits)}' in text
    assert "reasoning_engine:kv_offload_host_bytes" in text and "kv_offload_damaged_entries_total" in text


def test_the_adaptive_endpoint_counts_prefix_hits_by_tier(llama_dir: Path) -> None:
    a, b = _prompts(0)
    tiered = LLM(llama_dir, kv_offload_size="1MiB", **{**TINY, "adaptive": True})
    _run(tiered, [a, b, a, b])
    stats = tiered.engine.stats()
    assert stats.kv_offload_host_hits > 0
    assert tiered.engine.adaptive_snapshot()["retention"]["prefix_hit_tokens"] == {
        "device": stats.prefix_cache_hits - stats.kv_offload_host_hits, "host": stats.kv_offload_host_hits, "disk": 0}


def _disk_tiers(llama_dir: Path, folder: Path) -> dict:
    """A host tier of two blocks over `folder`: evicted prompts pass through it to disk."""
    probe = LLM(llama_dir, kv_offload_size="1MiB", **TINY)
    return dict(kv_offload_size=2 * probe.engine.runner.worker.tier_store.entry_bytes, kv_offload_dir=folder)


def test_disk_tier_serves_a_restarted_engine_and_skips_damaged_files(llama_dir: Path, tmp_path: Path) -> None:
    """Three prompts through a 12-block device pool and a 2-block host tier push the first one's blocks to disk. A
    new engine over the same folder reads that prompt from disk; a damaged file ends the hit there (a miss, counted,
    removed), the tokens the same."""
    a, b, c = _prompts(1, count=3)
    expected = _run(LLM(llama_dir, **TINY), [a, b, c, a])
    tiers = _disk_tiers(llama_dir, tmp_path)
    writer = LLM(llama_dir, **TINY, **tiers)
    assert _run(writer, [a, b, c]) == expected[:3]
    writer.engine.step()
    assert writer.engine.stats().kv_offload_disk_stored_blocks > 0
    keys = prefix_hashes(a, 4)  # the prompt's 7 full blocks
    files = {f.name.split(".")[0]: f for f in tmp_path.rglob("*.kv")}
    assert {k.hex() for k in keys} <= set(files)  # one file per block, named by its SHA-256 key
    reader = LLM(llama_dir, **TINY, **tiers)
    assert _run(reader, [a]) == expected[3:]
    stats = reader.engine.stats()
    assert stats.kv_offload_disk_hits == 28 and stats.kv_offload_damaged_entries == 0
    assert stats.prefix_cache_hits == 28 and stats.kv_cache_usage == 0.0
    _store_matches_index(reader)

    victim = files[keys[2].hex()]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # one payload byte
    victim.write_bytes(bytes(data))
    damaged = LLM(llama_dir, **TINY, **tiers)
    assert _run(damaged, [a]) == expected[3:]
    stats = damaged.engine.stats()
    assert stats.kv_offload_damaged_entries == 1 and stats.kv_offload_disk_hits == 8  # the two blocks before it
    assert not victim.exists() and stats.kv_cache_usage == 0.0


def test_a_foreign_file_under_the_right_name_is_never_loaded(llama_dir: Path, tmp_path: Path) -> None:
    """A file whose header names another model (or whose checksum is recomputed over other bytes) is skipped."""
    a, b, c = _prompts(2, count=3)
    expected = _run(LLM(llama_dir, **TINY), [a, b, c, a])
    tiers = _disk_tiers(llama_dir, tmp_path)
    writer = LLM(llama_dir, **TINY, **tiers)
    _run(writer, [a, b, c])
    writer.engine.step()
    import hashlib

    from reasoning_engine.engine.kv_tiers import _HEADER
    for path in tmp_path.rglob("*.kv"):  # rewrite each as a sound file of another model identity
        data = path.read_bytes()
        magic, identity, key, rank, length = _HEADER.unpack(data[: _HEADER.size])
        header = _HEADER.pack(magic, hashlib.sha256(b"other model").digest(), key, rank, length)
        payload = bytes(len(data) - _HEADER.size - 32)
        path.write_bytes(header + hashlib.sha256(header + payload).digest() + payload)
    reader = LLM(llama_dir, **TINY, **tiers)
    assert _run(reader, [a]) == expected[3:]
    stats = reader.engine.stats()
    assert stats.kv_offload_disk_hits == 0 and stats.kv_offload_damaged_entries >= 1


def test_salted_prefixes_stay_apart_in_the_host_tier(llama_dir: Path) -> None:
    a, b = _prompts(3)
    llm = LLM(llama_dir, kv_offload_size="1MiB", **TINY)
    _run(llm, [{"prompt_token_ids": a, "cache_salt": "tenant-a"}, b])
    _run(llm, [{"prompt_token_ids": a, "cache_salt": "tenant-b"}, {"prompt_token_ids": a}])
    assert llm.engine.stats().kv_offload_host_hits == 0  # a under another salt, or none, is a miss in every tier
    _run(llm, [{"prompt_token_ids": a, "cache_salt": "tenant-a"}])
    assert llm.engine.stats().kv_offload_host_hits > 0


@pytest.mark.parametrize("seed,disk", [(0, False), (1, False), (2, True), (3, True)])
def test_random_stress_matches_an_engine_without_tiers(llama_dir: Path, tmp_path: Path, seed: int, disk: bool) -> None:
    """Shared prefixes, a device pool that forces preemption and eviction, aborts, n > 1 and n-gram drafts, with a
    host tier alone or a smaller one over a disk folder: greedy outputs equal an untiered engine's, every block comes
    back, the host tier stays within its bound."""
    rng = random.Random(seed)
    stems = _prompts(10 + seed, count=3, length=16)
    requests = []
    for i in range(24):
        stem = stems[rng.randrange(3)]
        tail = [rng.randrange(5, 12) for _ in range(rng.randrange(1, 10))] * 2  # repeats: n-gram drafts
        n = rng.choice([1, 1, 2])
        requests.append((stem + tail[: 40 - len(stem) - 8], n, rng.random() < 0.2))
    spec = {"method": "ngram", "num_speculative_tokens": 3}

    def replay(llm: LLM) -> dict[str, list[list[int]]]:
        engine, done, steps = llm.engine, {}, 0
        order = list(range(len(requests)))
        for start in range(0, len(order), 4):  # four at a time, so they compete for blocks
            ids = []
            for i in order[start : start + 4]:
                prompt, n, _ = requests[i]
                params = SamplingParams(temperature=0, n=n, max_tokens=8, ignore_eos=True)
                ids.append(engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params))
            while engine.has_unfinished_requests():
                steps += 1
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = [o.token_ids for o in out.outputs]
                for rid in ids:
                    if requests[int(rid[1:])][2] and steps % 3 == 0 and rid not in done:
                        engine.abort_request(rid)
                        done[rid] = None
        return done

    kwargs = dict(TINY, kv_cache_blocks=14, max_num_batched_tokens=16, max_model_len=52, speculative_config=spec)
    plain = LLM(llama_dir, **kwargs)
    tiers = dict(kv_offload_size=2048 * 2, kv_offload_dir=tmp_path) if disk else dict(kv_offload_size=2048 * 6)
    tiered = LLM(llama_dir, **tiers, **kwargs)  # 2048 bytes a block of this model (target and draft caches)
    expected, got = replay(plain), replay(tiered)
    finished = {k for k, v in expected.items() if v is not None} & {k for k, v in got.items() if v is not None}
    assert finished and all(expected[k] == got[k] for k in finished)
    stats = tiered.engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_offload_host_hits > 0
    assert not disk or stats.kv_offload_disk_hits > 0
    assert stats.spec_decode["draft_tokens"] > 0 and any(v is None for v in got.values())  # drafts, aborts
    bm = tiered.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and stats.kv_cache_usage == 0.0
    assert sum(bm.ref_counts) == 0
    _store_matches_index(tiered)


def test_a_model_with_a_sliding_window_group_runs_without_tiers(tiny_checkpoint, caplog) -> None:
    """gpt-oss's sliding-window group is not tiered: the tiers stay off (a warning says so), nothing is hit wrongly."""
    path = tiny_checkpoint("gpt_oss").path
    a, b = _prompts(5)
    kwargs = dict(TINY, kv_cache_blocks=16, max_model_len=64)
    expected = _run(LLM(path, **kwargs), [a, b, a])
    with caplog.at_level("WARNING"):
        llm = LLM(path, kv_offload_size="1MiB", **kwargs)
    assert llm.engine.block_manager.tiers is None and llm.engine.runner.worker.tier_store is None
    assert "tiers are off" in caplog.text
    assert _run(llm, [a, b, a]) == expected and llm.engine.stats().kv_offload_host_hits == 0


def test_tiers_cover_one_full_attention_group_only() -> None:
    full = CacheGroup("full", list(range(4)))
    sliding = CacheGroup("sliding", [1, 3], window=8)
    assert tiers_supported([full], has_linear_layers=False)
    assert not tiers_supported([full, sliding], has_linear_layers=False)
    assert not tiers_supported([full], has_linear_layers=True)


def test_tier_index_keeps_its_bounds_and_op_order() -> None:
    """Host keys past the bound spill to disk (or drop without one); the disk drops its oldest past its bytes; a load
    planned before a drop of the same key stays before it."""
    index = TierIndex(host_blocks=2, disk_bytes=250, file_bytes=100, fetch=lambda ops, keys, blocks: [True] * len(keys))
    keys = [bytes([i]) * 32 for i in range(5)]
    for block, key in enumerate(keys[:3]):
        index.evicted(block, key)
    assert list(index.host) == keys[1:3] and list(index.disk) == keys[:1]
    index.load([keys[1]], [7])
    index.evicted(8, keys[3])
    index.evicted(9, keys[4])
    ops = index.take_ops()
    assert ops.index(("load", keys[1], 7)) < ops.index(("spill", keys[1]))
    assert index.disk_used <= 250 and ("unlink", keys[0]) in ops
    assert len(index.host) == 2
    plain = TierIndex(host_blocks=1)
    plain.evicted(0, keys[0])
    plain.evicted(1, keys[1])
    assert ("drop", keys[0]) in plain.take_ops() and not plain.disk


def test_offload_arguments_are_checked(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_offload_size"):
        LLM(llama_dir, kv_offload_size="lots", **TINY)
    with pytest.raises(ValueError, match="kv_offload_dir needs kv_offload_size"):
        LLM(llama_dir, kv_offload_dir=tmp_path, **TINY)
    with pytest.raises(ValueError, match="kv_offload_size"):
        LLM(llama_dir, kv_offload_size=1, **TINY)  # holds no block
    not_a_folder = tmp_path / "file"
    not_a_folder.write_bytes(b"")
    with pytest.raises(ValueError, match="kv_offload_dir: .* is not a folder"):
        LLM(llama_dir, kv_offload_size="1MiB", kv_offload_dir=not_a_folder, **TINY)


def test_serve_flags_reach_the_engine_arguments(tmp_path: Path) -> None:
    from reasoning_engine.cli import build_parser
    from reasoning_engine.server.cli import _engine_kwargs

    args = build_parser().parse_args(["serve", "--kv-offload-size", "8GiB", "--kv-offload-dir", str(tmp_path),
                                      "--kv-offload-dir-size", "100GB"])
    kwargs = _engine_kwargs(args)
    assert (kwargs["kv_offload_size"], kwargs["kv_offload_dir"], kwargs["kv_offload_dir_size"]) == (
        "8GiB", str(tmp_path), "100GB")
    assert "kv_offload_size" not in _engine_kwargs(build_parser().parse_args(["serve"]))


@pytest.mark.slow
def test_tensor_parallel_ranks_each_tier_their_shard(llama_dir: Path, tmp_path: Path) -> None:
    """Under TP 2 every rank saves, loads and writes its own heads' share of each block (one file per rank), and a
    restarted TP engine reads the prompt back from both ranks' files: the tokens of one process without tiers."""
    path = llama_dir
    a, b, c = _prompts(4, count=3)
    turns = [a, b, c, a]
    expected = _run(LLM(path, **TINY), turns)
    shard_pair = LLM(path, kv_offload_size="1MiB", **TINY).engine.runner.worker.tier_store.entry_bytes
    tiers = dict(kv_offload_size=shard_pair, kv_offload_dir=tmp_path)  # two blocks of a rank's half
    with LLM(path, tensor_parallel_size=2, **TINY, **tiers) as llm:
        assert _run(llm, turns) == expected
        stats = llm.engine.stats()
        assert stats.kv_offload_host_hits + stats.kv_offload_disk_hits > 0 and stats.kv_cache_usage == 0.0
    ranks = {f.name.split(".")[1] for f in tmp_path.rglob("*.kv")}
    assert ranks == {"0", "1"}
    with LLM(path, tensor_parallel_size=2, **TINY, **tiers) as llm:
        assert _run(llm, [a]) == expected[3:]
        assert llm.engine.stats().kv_offload_disk_hits == 28


def test_a_protected_turn_waits_out_its_tool_call_in_the_host_tier(llama_dir: Path) -> None:
    """Retention's protection follows a block into the host tier: while other agents' turns push blocks through a
    host tier too small for all of them, the protected turn's blocks are evicted last, so its return hits all."""
    a, b, c = _prompts(6, count=3)
    block_bytes = LLM(llama_dir, kv_offload_size="1MiB", **TINY).engine.runner.worker.tier_store.entry_bytes

    def returning_hits(protect: bool) -> int:
        llm = LLM(llama_dir, kv_offload_size=9 * block_bytes, **TINY)
        _run(llm, [a])
        if protect:
            llm.engine.block_manager.protect(prefix_hashes(a, 4), time.monotonic() + 600, "agent-a")
        _run(llm, [b, c])
        before = llm.engine.stats().prefix_cache_hits
        _run(llm, [a])
        return llm.engine.stats().prefix_cache_hits - before

    assert returning_hits(protect=True) == 28 > returning_hits(protect=False)


def test_a_failing_disk_costs_blocks_not_the_engine(llama_dir: Path, tmp_path: Path) -> None:
    """Block files that cannot be written (the folder made read-only under the engine) are dropped with a warning;
    a later lookup of them is a miss; the engine keeps serving the same tokens."""
    a, b, c = _prompts(7, count=3)
    expected = _run(LLM(llama_dir, **TINY), [a, b, c, a])
    tiers = _disk_tiers(llama_dir, tmp_path)
    llm = LLM(llama_dir, **TINY, **tiers)
    folder = llm.engine.runner.worker.tier_store.folder
    folder.chmod(0o500)
    try:
        import os

        if os.access(folder, os.W_OK):  # root ignores the mode bits: replace the folder with a file instead
            folder.chmod(0o700)
            folder.rmdir()
            folder.write_bytes(b"")
        assert _run(llm, [a, b, c, a]) == expected
        stats = llm.engine.stats()
        assert stats.kv_offload_disk_stored_blocks > 0 and stats.kv_offload_disk_hits == 0
        assert stats.kv_cache_usage == 0.0
    finally:
        if folder.is_dir():
            folder.chmod(0o700)


def test_fp8_cache_blocks_round_trip_through_the_tiers(llama_dir: Path, tmp_path: Path) -> None:
    """An FP8 cache's rows (values and scales in one uint8 row) go to host memory and disk and come back as stored:
    the tokens of the FP8 engine without tiers, the repeats hit."""
    a, b, c = _prompts(3, count=3)
    fp8 = dict(TINY, kv_cache_dtype="fp8")
    expected = _run(LLM(llama_dir, **fp8), [a, b, c, a, b])
    probe = LLM(llama_dir, kv_offload_size="1MiB", **fp8)
    tiers = dict(kv_offload_size=2 * probe.engine.runner.worker.tier_store.entry_bytes, kv_offload_dir=tmp_path)
    tiered = LLM(llama_dir, **fp8, **tiers)
    assert _run(tiered, [a, b, c, a, b]) == expected
    stats = tiered.engine.stats()
    assert stats.kv_offload_host_hits + stats.kv_offload_disk_hits > 0 and stats.kv_offload_damaged_entries == 0
    assert stats.kv_cache_usage == 0.0
    _store_matches_index(tiered)
