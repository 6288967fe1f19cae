"""Exact parity with transformers, in float32 on CPU, for every family and config variant (quantized ones against
transformers on the dequantized weights): last-position logits within 1e-4 relative, and identical 32-token greedy
continuations for a batch of prompts of different lengths, through the offline API."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from .checkpoints import VARIANTS, TinyCheckpoint, prompts

MAX_TOKENS = 32
Loaded = tuple[TinyCheckpoint, object, torch.nn.Module]


pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # slow: every family against transformers


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint: Callable[[str], TinyCheckpoint]) -> Callable[[str], Loaded]:
    """Per variant, once: the checkpoint, our LLM on it and the transformers reference."""
    cache: dict[str, Loaded] = {}

    def get(name: str) -> Loaded:
        if name not in cache:
            from reasoning_engine import LLM

            ckpt = tiny_checkpoint(name)
            cache[name] = (ckpt, LLM(str(ckpt.path), dtype="float32", device="cpu"), ckpt.reference())
        return cache[name]

    return get


@torch.no_grad()
def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1].float()


@torch.no_grad()
def reference_greedy(model: torch.nn.Module, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy continuation recomputing the whole sequence each step, and each step's top-2 logit gap (relative to
    the largest logit) to tell a real divergence from a near-tie."""
    seq, gaps = list(ids), []
    for _ in range(steps):
        logits = reference_logits(model, seq)
        top = logits.topk(2).values
        gaps.append(float((top[0] - top[1]) / logits.abs().max()))
        seq.append(int(logits.argmax()))
    return seq[len(ids):], gaps


@pytest.mark.parametrize("name", list(VARIANTS))
def test_last_position_logits_match_transformers(loaded: Callable[[str], Loaded], name: str) -> None:
    ckpt, llm, reference = loaded(name)
    batch = prompts(ckpt.vocab_size)
    ours = llm.compute_logits(batch)
    assert len(ours) == len(batch)
    for ids, got in zip(batch, ours):
        want = reference_logits(reference, ids)
        # within 1e-4 relative, elementwise, with an absolute floor of 1e-4 of the largest logit for values near 0
        torch.testing.assert_close(got.float().cpu(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item(),
                                   msg=lambda m, n=len(ids): f"{name}, prompt of {n} tokens: {m}")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_continuations_match_transformers(loaded: Callable[[str], Loaded], name: str) -> None:
    from reasoning_engine import SamplingParams

    ckpt, llm, reference = loaded(name)
    batch = prompts(ckpt.vocab_size)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in batch],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert len(outs) == len(batch)
    for ids, out in zip(batch, outs):
        assert list(out.prompt_token_ids) == ids
        got = list(out.outputs[0].token_ids)
        want, gaps = reference_greedy(reference, ids, MAX_TOKENS)
        if got != want:
            step = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            gap = gaps[step] if step < len(gaps) else float("nan")
            pytest.fail(f"{name}, prompt of {len(ids)} tokens: continuation differs from step {step} "
                        f"(reference top-2 relative gap there {gap:.2e})\n ours: {got}\n want: {want}")
