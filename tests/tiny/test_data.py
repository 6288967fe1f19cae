"""The synthetic data: reference completions solve their problems, and the format is the shipped template's."""

from __future__ import annotations

import random

import pytest

from reasoning_engine.tiny.chat_format import IM_END, THINK_END, render_chat
from reasoning_engine.tiny.data import (
    GENERATORS,
    addition_steps,
    check_answer,
    eval_samples,
    letter_count_words,
    subtraction_steps,
    training_sample,
)
from reasoning_engine.tiny.eval import parse_completion


@pytest.mark.parametrize("task", sorted(GENERATORS))
def test_reference_completions_pass_the_checker(task: str) -> None:
    rng = random.Random(3)
    for _ in range(200):
        s = GENERATORS[task](rng)
        parsed = parse_completion(s.completion())
        assert parsed.has_thinking
        if s.expected is not None:
            assert check_answer(s, parsed.content, parsed.tool_calls), s.completion()


def test_column_steps() -> None:
    assert addition_steps(347, 589) == ("ones: 7+9=16, write 6 carry 1\ntens: 4+8+1=13, write 3 carry 1\n"
                                        "hundreds: 3+5+1=9, write 9")
    assert addition_steps(95, 7) == "ones: 5+7=12, write 2 carry 1\ntens: 9+0+1=10, write 0 carry 1\nhundreds: write 1"
    assert subtraction_steps(903, 458) == ("ones: 13-8=5, borrow 1\ntens: 10-1-5=4, borrow 1\n"
                                           "hundreds: 9-1-4=4")


def test_samples_render_like_full_conversations() -> None:
    """Prompt + completion equals the template rendering the conversation with the target turn appended."""
    rng = random.Random(5)
    for _ in range(300):
        s = training_sample(rng)
        gen = "<think>" if s.thinking else "<think></think>"
        assert s.prompt().endswith("<|im_assistant|>assistant<|im_middle|>" + gen)
        assert render_chat(s.messages + [s.assistant_message()], tools=s.tools) == s.prompt() + s.completion()
        assert s.completion().endswith(IM_END)
        assert (THINK_END in s.completion()) == s.thinking


def test_eval_problems_are_fresh_and_deterministic() -> None:
    a, b = eval_samples(20), eval_samples(20)
    assert [s.prompt() for s in a] == [s.prompt() for s in b]
    rng = random.Random(1234)
    train_prompts = {training_sample(rng).messages[-1]["content"] for _ in range(5000)}
    overlap = sum(s.messages[-1]["content"] in train_prompts for s in a)
    assert overlap < len(a) // 4


def test_letter_count_words_are_spelled_letter_by_letter() -> None:
    from transformers import AutoTokenizer

    from reasoning_engine.tiny import BUNDLED_MODEL_DIR

    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    for word in letter_count_words():
        pieces = tok.convert_ids_to_tokens(tok(f"in '{word}'?").input_ids)
        assert any(pieces[i : i + len(word) + 1] == ["'", *word] for i in range(len(pieces))), (word, pieces)
