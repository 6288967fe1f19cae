"""AsyncLLM: streaming outputs, concurrent requests on one engine loop, abort on cancellation."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import pytest

from reasoning_engine import AsyncLLM, SamplingParams


@pytest.fixture(scope="module")
def engine(llama_dir: Path):
    eng = AsyncLLM(str(llama_dir), dtype="float32", device="cpu")
    yield eng
    eng.shutdown_sync()


def test_streams_cumulative_outputs_and_matches_offline(engine: AsyncLLM) -> None:
    async def run() -> list:
        seen = []
        async for out in engine.generate("stream me", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), "a"):
            seen.append(out)
        return seen

    seen = asyncio.run(run())
    assert seen[-1].finished and len(seen[-1].outputs[0].token_ids) == 12
    lengths = [len(o.outputs[0].token_ids) for o in seen]
    assert lengths == sorted(lengths) and len(seen) >= 2
    from reasoning_engine import LLM

    offline = LLM(engine.model_config.path, dtype="float32", device="cpu").generate(
        "stream me", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert offline.outputs[0].token_ids == seen[-1].outputs[0].token_ids


def test_concurrent_requests_and_cancellation_free_blocks(engine: AsyncLLM) -> None:
    async def consume(i: int) -> int:
        n = 0
        async for out in engine.generate(f"req {i}", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), f"c{i}"):
            n = len(out.outputs[0].token_ids)
        return n

    async def cancelled() -> None:
        async for out in engine.generate("long", SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True), "long"):
            if len(out.outputs[0].token_ids) >= 3:
                break

    async def run() -> list[int]:
        results = await asyncio.gather(*(consume(i) for i in range(6)), cancelled())
        for _ in range(100):
            stats = engine.stats()
            if stats.num_requests_running == 0 and stats.free_blocks == stats.total_blocks:
                break
            await asyncio.sleep(0.05)
        return results[:6]

    assert asyncio.run(run()) == [8] * 6
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks and stats.num_requests_running == 0


def test_abort_ends_the_stream_of_every_consumer(engine: AsyncLLM) -> None:
    """abort(request_id) ends the request's generate() stream with a final output, each unfinished sample saying
    finish_reason "abort" with the tokens it had: aborts at random moments (before the first token, mid-stream,
    after the end, twice), greedy and sampled, n = 1 and 2, leave no consumer waiting and no block held."""
    rng = random.Random(0)
    count = 24
    limits = [rng.choice([3, 400]) for _ in range(count)]

    async def consume(i: int) -> list:
        params = SamplingParams(temperature=0.0 if i % 3 else 0.8, seed=i, n=1 if i % 4 else 2,
                                max_tokens=limits[i], ignore_eos=True)
        return [out async for out in engine.generate(f"abort {i}", params, f"abort-{i}")]

    async def abort_later(i: int) -> None:
        await asyncio.sleep(rng.uniform(0.0, 0.4))
        for _ in range(1 + i % 2):
            await engine.abort(f"abort-{i}")

    async def run() -> list[list]:
        consumers = [asyncio.ensure_future(consume(i)) for i in range(count)]  # each submits before any abort
        await asyncio.gather(*(abort_later(i) for i in range(count)))
        return await asyncio.wait_for(asyncio.gather(*consumers), timeout=30)

    streams = asyncio.run(run())
    reasons: list[str] = []
    for i, outs in enumerate(streams):
        final = outs[-1]
        assert final.finished and all(not o.finished for o in outs[:-1])
        for sample in final.outputs:
            reasons.append(sample.finish_reason)
            assert sample.finish_reason in ("abort", "length")
            assert (sample.finish_reason == "length") == (len(sample.token_ids) == limits[i])
            assert sample.text == engine.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    assert "abort" in reasons and "length" in reasons
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks and stats.num_requests_running == 0


def test_bad_request_raises_before_streaming(engine: AsyncLLM) -> None:
    async def run() -> None:
        async for _ in engine.generate({"prompt_token_ids": [5, 10**9]}, SamplingParams(), "bad"):
            pass

    with pytest.raises(ValueError, match="prompt_token_ids"):
        asyncio.run(run())


def test_the_engine_is_built_and_stepped_in_one_thread_not_the_callers(llama_dir: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """All of the model's torch work in one thread: a second OpenMP team (the caller's, from loading) made every op
    of the engine thread several times slower on a small CPU."""
    from reasoning_engine.engine import async_engine

    threads: dict[str, set[int]] = {"build": set(), "step": set()}
    build, step = async_engine.LLMEngine.__init__, async_engine.LLMEngine.step

    def recording_init(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        threads["build"].add(threading.get_ident())
        build(self, *args, **kwargs)

    def recording_step(self):  # type: ignore[no-untyped-def]
        threads["step"].add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(async_engine.LLMEngine, "__init__", recording_init)
    monkeypatch.setattr(async_engine.LLMEngine, "step", recording_step)
    eng = AsyncLLM(str(llama_dir), dtype="float32", device="cpu")
    try:
        async def run() -> None:
            async for _ in eng.generate("one thread", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)):
                pass

        asyncio.run(run())
    finally:
        eng.shutdown_sync()
    assert threads["build"] == threads["step"] == {eng._thread.ident}
    assert threading.get_ident() not in threads["build"]


def test_an_engine_that_fails_to_build_raises_in_the_constructor(llama_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from reasoning_engine.engine import async_engine

    def broken(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        raise OSError("the checkpoint's weights are unreadable")

    before = threading.active_count()
    monkeypatch.setattr(async_engine.LLMEngine, "__init__", broken)
    with pytest.raises(OSError, match="weights are unreadable"):
        AsyncLLM(str(llama_dir), dtype="float32", device="cpu")
    assert threading.active_count() == before  # the engine thread ended with it
