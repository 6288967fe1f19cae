"""What the engine tests of one model family share: random prompts, a memoised one-request-at-a-time reference,
batched greedy ids, and the check that an engine holds nothing once its requests are done."""

from __future__ import annotations

from collections.abc import Callable

import torch

from reasoning_engine import LLM, SamplingParams


def random_prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (n,), generator=gen).tolist() for n in lengths]


def one_at_a_time(llm: LLM, default: SamplingParams) -> Callable[..., list[int]]:
    """Greedy continuations from `llm` (built with max_num_seqs=1 and no prefix caching: the reference), each
    prompt and length computed once."""
    cache: dict[tuple[int, ...], list[int]] = {}

    def get(ids: list[int], params: SamplingParams = default) -> list[int]:
        key = (*ids, params.max_tokens)
        if key not in cache:
            cache[key] = list(llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids)
        return cache[key]

    return get


def generate_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_no_leak(llm: LLM, states: bool = False, pending: bool = False) -> None:
    """No request left and every KV block free; with `states`, every linear-attention slot given back too (and with
    `pending`, no state copy left planned)."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if states:
        slots = engine.scheduler.states
        assert len(slots.free) + slots.num_snapshots == slots.num_slots  # every live slot given back
        if pending:
            assert not slots.pending
