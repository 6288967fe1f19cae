"""Structured output through AsyncLLM (what the server calls): the client side validates and compiles before the
request is queued (a bad spec or id is a ValueError naming the field, nothing queued), concurrent constrained and
free requests share the engine loop, and the compile cache is shared by both sides."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from reasoning_engine import AsyncLLM, SamplingParams

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "s": {"enum": ["x", "y"]}}, "required": ["n", "s"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(llama_dir: Path):
    eng = AsyncLLM(str(llama_dir), dtype="float32", device="cpu")
    yield eng
    eng.shutdown_sync()


async def _final(engine: AsyncLLM, prompt: str, params: SamplingParams, request_id: str):
    out = None
    async for out in engine.generate(prompt, params, request_id):
        pass
    return out


def test_concurrent_constrained_and_free_requests(engine: AsyncLLM) -> None:
    async def run() -> list:
        constrained = SamplingParams(temperature=0.7, seed=4, max_tokens=40, structured_outputs={"json": SCHEMA})
        free = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        return await asyncio.gather(*[_final(engine, f"q{i}", constrained if i % 2 == 0 else free, f"s{i}")
                                      for i in range(6)])

    outs = asyncio.run(run())
    for i, out in enumerate(outs):
        sample = out.outputs[0]
        if i % 2 == 0:
            assert sample.finish_reason == "stop"
            value = json.loads(sample.text)
            assert 0 <= value["n"] <= 9 and value["s"] in ("x", "y") and set(value) == {"n", "s"}
        else:
            assert len(sample.token_ids) == 10
    assert engine.engine.grammars.misses == 1  # one schema, compiled once for every request


@pytest.mark.parametrize("params,field", [
    (dict(structured_outputs={"json": {"type": "objectx"}}), r"structured_outputs\.json"),
    (dict(logit_bias={"5000": 1}), "logit_bias"),
    (dict(allowed_token_ids=[99, 100]), "allowed_token_ids"),
])
def test_invalid_constraints_fail_before_queueing(engine: AsyncLLM, params: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        asyncio.run(_final(engine, "x", SamplingParams(**params), "bad"))
    assert not engine.engine.has_unfinished_requests()
