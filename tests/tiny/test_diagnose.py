"""The failure classifier behind `python -m reasoning_engine.tiny.diagnose`."""

from __future__ import annotations

from reasoning_engine.tiny import BUNDLED_MODEL_DIR
from reasoning_engine.tiny.data import sorting_steps
from reasoning_engine.tiny.diagnose import SORTING_OUTCOMES, diagnose, letters_all_unmarked, sorting_error


def test_a_correct_sort_has_no_error() -> None:
    assert sorting_error(sorting_steps([42, 7, 19, 88, 40]), [42, 7, 19, 88, 40]) is None


def test_sorting_error_names_the_first_bad_tens_line() -> None:
    numbers = [52, 42, 95, 40, 7]
    right = sorting_steps(numbers)
    assert sorting_error(right.replace("4: 40, 42", "4: 40"), numbers) == "missed"
    assert sorting_error(right.replace("4: 40, 42", "4: 40, 42, 45"), numbers) == "extra"
    assert sorting_error(right.replace("0: 7", "0: 7, 5"), numbers) == "extra"
    assert sorting_error(right.replace("4: 40, 42", "4: 42, 40"), numbers) == "order"
    assert sorting_error(right.replace("0: 7", "0: -").replace("4: 40, 42", "4: 42, 40"), numbers) == "missed"
    assert sorting_error(right.replace("\n9: 95", ""), numbers) == "missed"


def test_letters_unmarked_means_no_count_mark_at_all() -> None:
    assert letters_all_unmarked("Spell it and count 'g': g r e e n\nSo 'g' appears 0 times.")
    assert not letters_all_unmarked("Spell it and count 'e': g r e1 e n\nSo 'e' appears 1 time.")
    assert letters_all_unmarked("")


def test_diagnose_counts_every_problem_once() -> None:
    counts = diagnose(BUNDLED_MODEL_DIR, n=6, seed=1)
    assert sum(counts["sorting"].values()) == 6 and sum(counts["letters"].values()) == 6
    assert set(counts["sorting"]) <= {"right", *SORTING_OUTCOMES.values()}
    assert set(counts["letters"]) <= {"right", "wrong: no match marked", "wrong: other"}
