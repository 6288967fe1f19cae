"""Where the tiny model's sorting and letter counting go wrong: ``python -m reasoning_engine.tiny.diagnose``.

The eval says how often a task fails; this says at which step, which is what a change to the data format has to aim
at. Each sorting reply is classified by its first bad tens line (a number missing, one too many, or out of order), each
wrong letter count by whether any match of the word was marked.
"""

from __future__ import annotations

import argparse
import random
import re
from collections import Counter
from pathlib import Path

from reasoning_engine.tiny import BUNDLED_MODEL_DIR
from reasoning_engine.tiny.data import check_answer, gen_letters, gen_sorting, tens_groups
from reasoning_engine.tiny.eval import generate_reasoning_engine, parse_completion

DIAGNOSE_SEED = 4242
_INT = re.compile(r"\d+")
# A wrong answer whose every step was right went wrong in the final line.
SORTING_OUTCOMES = {"missed": "wrong: a number missing from its tens line",
                    "extra": "wrong: a number too many on a tens line",
                    "order": "wrong: a tens line out of order", None: "wrong: the final line"}


def sorting_error(reasoning: str, numbers: list[int]) -> str | None:
    """The first bad tens line of a bucket-sort thinking text for `numbers`: "missed" (a number with that tens digit
    is not on it, or the line is not there), "extra" (it lists a number that was not asked or has another tens digit),
    "order" (the right numbers, not smallest first) or None when every line is right."""
    lines: dict[int, list[int]] = {}
    for line in reasoning.splitlines():
        head, sep, rest = line.partition(": ")
        if sep and head.isdigit():
            lines.setdefault(int(head), [int(n) for n in _INT.findall(rest)])
    for tens, wanted in enumerate(tens_groups(numbers)):
        listed = lines.get(tens, [])
        if any(n not in listed for n in wanted):
            return "missed"
        if len(listed) != len(wanted):
            return "extra"
        if listed != wanted:
            return "order"
    return None


def letters_all_unmarked(reasoning: str) -> bool:
    """Whether the spelled word carries no count mark at all (``g r e e n``)."""
    spelled = reasoning.splitlines()[0].split(": ", 1)[-1].split() if reasoning else []
    return not any(token[1:].isdigit() for token in spelled)


def diagnose(model_dir: Path, n: int, seed: int) -> dict[str, Counter[str]]:
    """n fresh problems of each task, greedy through our engine; counts of outcomes per task."""
    rng = random.Random(seed)
    sorting = [gen_sorting(rng) for _ in range(n)]
    letters = [gen_letters(rng) for _ in range(n)]
    texts = generate_reasoning_engine(model_dir, sorting + letters)
    out: dict[str, Counter[str]] = {"sorting": Counter(), "letters": Counter()}
    for sample, text in zip(sorting + letters, texts):
        parsed = parse_completion(text)
        if check_answer(sample, parsed.content, parsed.tool_calls):
            outcome = "right"
        elif sample.task == "sorting":
            outcome = SORTING_OUTCOMES[sorting_error(parsed.reasoning, sample.expected)]
        elif sample.expected and letters_all_unmarked(parsed.reasoning):
            outcome = "wrong: no match marked"
        else:
            outcome = "wrong: other"
        out[sample.task][outcome] += 1
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL_DIR)
    parser.add_argument("--n", type=int, default=300, help="problems per task")
    parser.add_argument("--seed", type=int, default=DIAGNOSE_SEED)
    ns = parser.parse_args(argv)
    for task, counts in diagnose(ns.model, ns.n, ns.seed).items():
        print(task + ": " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()
