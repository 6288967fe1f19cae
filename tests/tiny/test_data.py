"""The synthetic data: reference completions solve their problems, and the format is the shipped template's."""

from __future__ import annotations

import random
import re

import pytest

from reasoning_engine.tiny.chat_format import IM_END, THINK_END, render_chat
from reasoning_engine.tiny.data import (
    GENERATORS,
    LETTER_DOUBLED_WORDS,
    TRAIN_SEED,
    WORKED_TASKS,
    addition_steps,
    check_answer,
    comparison_lines,
    eval_samples,
    gen_comparison,
    gen_subtraction,
    letter_count_words,
    multiplication_steps,
    sorting_steps,
    subtraction_steps,
    training_sample,
    without_thinking,
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
    assert addition_steps(347, 589) == ("347 + 589: 7+9=16, carry 1, digits 6\n34 + 58: 4+8+1=13, carry 1, digits 36\n"
                                        "3 + 5: 3+5+1=9, digits 936")
    assert addition_steps(95, 7) == ("95 + 7: 5+7=12, carry 1, digits 2\n9 + 0: 9+0+1=10, carry 1, digits 02\n"
                                     "carry 1: digits 102")
    assert subtraction_steps(903, 458) == ("903 - 458: 13-8=5, borrow 1, digits 5\n90 - 45: 10-1-5=4, borrow 1, "
                                           "digits 45\n9 - 4: 9-1-4=4, digits 445")


def test_subtraction_judges_which_is_larger_digit_by_digit_first() -> None:
    assert comparison_lines(615, 186) == "615 vs 186: 6>1"
    assert comparison_lines(457, 462) == "457 vs 462: 4=4\n57 vs 62: 5<6"
    assert comparison_lines(85, 457) == "85 vs 457: 2 digits vs 3 digits"
    rng = random.Random(7)
    seen = set()
    for _ in range(300):
        s = gen_subtraction(rng)
        a, b = (int(n) for n in re.findall(r"\d+", s.messages[-1]["content"]))
        if s.messages[-1]["content"].startswith("Subtract"):
            a, b = b, a
        sign = "<" if a < b else (">" if a > b else "=")
        head = f"{comparison_lines(a, b)}\nSo {a} {sign} {b}"
        assert s.reasoning.startswith(head), s.reasoning
        seen.add(sign)
    assert seen >= {"<", ">"}


def test_multiplication_adds_the_carry_in_its_own_step() -> None:
    assert multiplication_steps(47, 6) == "47 * 6: 7*6=42, carry 4, digits 2\n4 * 6: 4*6=24, 24+4=28, digits 282"
    assert multiplication_steps(31, 3) == "31 * 3: 1*3=3, digits 3\n3 * 3: 3*3=9, digits 93"


def test_sorting_lists_every_tens_digit_smallest_first() -> None:
    assert sorting_steps([42, 7, 19, 88, 40]).splitlines() == [
        "By tens digit:", "0: 7", "1: 19", "2: -", "3: -", "4: 40, 42", "5: -", "6: -", "7: -", "8: 88", "9: -"]


def test_comparison_restates_the_asked_number_before_answering() -> None:
    rng = random.Random(11)
    for _ in range(200):
        s = gen_comparison(rng)
        if s.expected == "equal":
            continue
        word = "smaller" if s.meta["smaller"] else "larger"
        assert s.reasoning.endswith(f"the {word} one is {s.expected}.")
        assert s.content == f"{s.expected} is {word}."


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


@pytest.mark.parametrize("task", sorted(GENERATORS))
def test_thinking_off_replies_show_the_working_then_the_same_answer(task: str) -> None:
    for seed in range(50):
        on = GENERATORS[task](random.Random(seed))
        off = without_thinking(GENERATORS[task](random.Random(seed)))
        assert not off.thinking and THINK_END not in off.completion()
        if task in WORKED_TASKS:
            assert off.content == f"{on.reasoning}\n\n{on.content}"
            assert check_answer(off, off.content, None), "the checker reads the answer on the last line"
        else:
            assert off.content == on.content


def test_eval_problems_without_thinking() -> None:
    samples = eval_samples(10, thinking=False)
    assert {s.task for s in samples if s.thinking} == {"calculator_result"}
    for s in samples:
        parsed = parse_completion(s.completion())
        assert not parsed.has_thinking or s.task == "calculator_result"
        if s.expected is not None:
            assert check_answer(s, parsed.content, parsed.tool_calls), s.completion()


def test_eval_problems_are_fresh_and_deterministic() -> None:
    a, b = eval_samples(20), eval_samples(20)
    assert [s.prompt() for s in a] == [s.prompt() for s in b]
    rng = random.Random(TRAIN_SEED)
    train_prompts = {training_sample(rng).messages[-1]["content"] for _ in range(5000)}
    overlap = sum(s.messages[-1]["content"] in train_prompts for s in a)
    assert overlap < len(a) // 4


def test_letter_count_words_are_spelled_letter_by_letter() -> None:
    from transformers import AutoTokenizer

    from reasoning_engine.tiny import BUNDLED_MODEL_DIR

    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    for word in letter_count_words() + LETTER_DOUBLED_WORDS:
        pieces = tok.convert_ids_to_tokens(tok(f"in '{word}'?").input_ids)
        assert any(pieces[i : i + len(word) + 1] == ["'", *word] for i in range(len(pieces))), (word, pieces)
