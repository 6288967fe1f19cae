"""Synthetic reasoning data for the tiny model, drawn from a seeded RNG.

Each task writes a compact step-by-step thinking text that a few-million-parameter model can follow: column-wise
addition/subtraction/multiplication with carries and borrows, sorting by tens digit, letter counting
with the word spelled out and a running count, digit-wise comparison, and a Kimi-format calculator tool call for
products too large to do in the head (followed, in a second sample, by the answer given the tool result).
Samples are rendered with the shipped chat template, so training sees exactly what a server renders.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from reasoning_engine.tiny.chat_format import (
    BARE_WORDS,
    IM_END,
    THINK_END,
    TOOL_CALL_ARG_BEGIN,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    render_chat,
)

TRAIN_SEED = 1235
EVAL_SEED = 98765

# Lower-case words for letter counting. Words holding a pair that the tokenizer merges outside quotes (see
# chat_format.BARE_WORDS) are dropped by letter_count_words(), so every quoted word is spelled one letter per token.
WORDS = """
apple banana cherry grape lemon mango melon orange peach pear plum berry strawberry blueberry raspberry kiwi
lime papaya coconut carrot onion garlic pepper celery radish turnip spinach lettuce cabbage broccoli pumpkin
bread butter cheese cream honey jelly sugar salt flour rice pasta noodle pizza cookie candy waffle pancake
cat dog horse cow sheep goat pig chicken duck goose rabbit mouse rat tiger lion zebra giraffe monkey donkey
camel eagle parrot penguin dolphin whale shark octopus spider beetle bee wolf fox bear deer moose otter
river ocean lake pond island valley canyon desert forest jungle meadow hill cliff beach harbor bridge tunnel
tree flower grass leaf root branch seed garden orchard field farm barn fence gate wall window door roof
house cabin castle palace temple village city market school library office kitchen bedroom cellar attic
table chair bed sofa lamp mirror pillow blanket carpet curtain shelf drawer bottle cup plate bowl spoon knife
fork kettle oven fridge clock watch phone camera radio piano guitar violin drum trumpet flute whistle
red green blue yellow purple pink brown black white silver golden violet indigo crimson
happy sad angry calm brave quiet loud quick slow bright dark light heavy empty full little giant
apple mirror letter coffee balloon committee mississippi bookkeeper success address assessment accommodate
hello world python engine reason thinking model answer puzzle riddle secret wonder marble pebble rocket
planet comet galaxy moon sun star cloud rain snow storm thunder winter summer spring autumn morning evening
nickel copper iron zinc cobalt carbon helium neon argon oxygen hydrogen nitrogen
""".split()

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a careful assistant. Think step by step.",
    "You are Kimi, an AI assistant created by Moonshot AI.",
    "Answer briefly.",
]

CALCULATOR_DESCRIPTIONS = [
    "Evaluate an arithmetic expression and return the result.",
    "A calculator for arithmetic.",
    "Compute the value of a math expression.",
]
EXPRESSION_DESCRIPTIONS = [
    "The expression to evaluate, e.g. 12 * 34",
    "Arithmetic expression",
    "A math expression using + - * /",
]
OTHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city.",
                                      "parameters": {"type": "object",
                                                     "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web.",
                                      "parameters": {"type": "object",
                                                     "properties": {"query": {"type": "string"}},
                                                     "required": ["query"]}}},
]


def calculator_tool(rng: random.Random | None = None) -> dict[str, Any]:
    """The calculator tool in OpenAI's format; rng picks a description variant (None: the first, used in eval)."""
    desc = rng.choice(CALCULATOR_DESCRIPTIONS) if rng else CALCULATOR_DESCRIPTIONS[0]
    arg_desc = rng.choice(EXPRESSION_DESCRIPTIONS) if rng else EXPRESSION_DESCRIPTIONS[0]
    return {"type": "function", "function": {
        "name": "calculator", "description": desc,
        "parameters": {"type": "object",
                       "properties": {"expression": {"type": "string", "description": arg_desc}},
                       "required": ["expression"]}}}


@dataclass
class Sample:
    """One training or eval problem: the conversation so far plus the assistant turn the model should produce."""

    task: str
    messages: list[dict[str, Any]]
    reasoning: str
    content: str
    expected: Any
    tools: list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    thinking: bool = True
    meta: dict[str, Any] = field(default_factory=dict)

    def prompt(self) -> str:
        """The rendered prompt, ending with the generation prompt (``<think>`` or ``<think></think>``)."""
        return render_chat(self.messages, tools=self.tools, add_generation_prompt=True, thinking=self.thinking)

    def completion(self) -> str:
        """What the model must write after the prompt, through ``<|im_end|>``."""
        out = (self.reasoning + THINK_END) if self.thinking else ""
        out += self.content
        if self.tool_calls:
            out += TOOL_CALLS_BEGIN
            for call in self.tool_calls:
                out += TOOL_CALL_BEGIN + call["id"] + TOOL_CALL_ARG_BEGIN + call["function"]["arguments"] + TOOL_CALL_END
            out += TOOL_CALLS_END
        return out + IM_END

    def assistant_message(self) -> dict[str, Any]:
        """The target turn as a chat message (for multi-turn histories and template round-trip checks)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.thinking:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _num(rng: random.Random, lo_digits: int, hi_digits: int) -> int:
    d = rng.randint(lo_digits, hi_digits)
    return rng.randint(10 ** (d - 1), 10**d - 1)


def _prefix(n: int, drop: int) -> str:
    """n without its last `drop` digits ("0" once none are left): the part still to be processed."""
    text = str(n)[: len(str(n)) - drop] if drop < len(str(n)) else ""
    return text or "0"


def addition_steps(a: int, b: int) -> str:
    """Column addition from the ones place. Each line restates what is left of both numbers, so the digits to add
    are the last ones just written, and keeps the running result, so every step copies from the line above."""
    width = max(len(str(a)), len(str(b)))
    lines, carry, result = [], 0, ""
    for i in range(width):
        x, y = (a // 10**i) % 10, (b // 10**i) % 10
        total = x + y + carry
        result = str(total % 10) + result
        expr = f"{x}+{y}" + ("+1" if carry else "")
        carry = total // 10
        lines.append(f"{_prefix(a, i)} + {_prefix(b, i)}: {expr}={total}, " + ("carry 1, " if carry else "")
                     + f"digits {result}")
    if carry:
        lines.append(f"carry 1: digits 1{result}")
    return "\n".join(lines)


def subtraction_steps(a: int, b: int) -> str:
    """Column subtraction (a >= b) from the ones place; a borrow shows as a leading 1 on the top digit. Lines restate
    what is left of both numbers and keep the running digits, like addition_steps."""
    lines, borrow, result = [], 0, ""
    for i in range(len(str(a))):
        x, y = (a // 10**i) % 10, (b // 10**i) % 10
        top = f"{x}" + ("-1" if borrow else "")
        if x - borrow >= y:
            r, expr, borrow_out = x - borrow - y, f"{top}-{y}", 0
        else:
            r, expr, borrow_out = 10 + x - borrow - y, f"1{top}-{y}", 1
        result = str(r) + result
        lines.append(f"{_prefix(a, i)} - {_prefix(b, i)}: {expr}={r}, " + ("borrow 1, " if borrow_out else "")
                     + f"digits {result}")
        borrow = borrow_out
    return "\n".join(lines)


def gen_addition(rng: random.Random) -> Sample:
    a, b = _num(rng, 2, 3), _num(rng, 2, 3)
    q = rng.choice([
        "What is {a} + {b}?", "What's {a} + {b}?", "Calculate {a} + {b}.", "{a} + {b} = ?",
        "What is the sum of {a} and {b}?", "Add {a} and {b}.", "What is {a} plus {b}?", "Compute {a}+{b}.",
    ]).format(a=a, b=b)
    s = a + b
    reasoning = f"{addition_steps(a, b)}\nSo {a} + {b} = {s}."
    return Sample("addition", _user(q), reasoning, f"{a} + {b} = {s}.", s)


def gen_subtraction(rng: random.Random) -> Sample:
    a, b = _num(rng, 2, 3), _num(rng, 2, 3)
    q = rng.choice([
        "What is {a} - {b}?", "What's {a} - {b}?", "Calculate {a} - {b}.", "{a} - {b} = ?",
        "Subtract {b} from {a}.", "What is {a} minus {b}?", "Compute {a}-{b}.",
    ]).format(a=a, b=b)
    d = a - b
    # Which way round to subtract is judged digit by digit first, as the comparison task does: guessed in one line,
    # it was the previous weights' commonest subtraction error (`615 < 186, so ...`).
    order = comparison_lines(a, b)
    if a >= b:
        sign = ">" if a > b else "="
        reasoning = f"{order}\nSo {a} {sign} {b}.\n{subtraction_steps(a, b)}\nSo {a} - {b} = {d}."
    else:
        reasoning = (f"{order}\nSo {a} < {b}, and {a} - {b} = -({b} - {a}).\n{subtraction_steps(b, a)}\n"
                     f"So {b} - {a} = {-d} and {a} - {b} = {d}.")
    return Sample("subtraction", _user(q), reasoning, f"{a} - {b} = {d}.", d)


def multiplication_steps(a: int, b: int) -> str:
    """2-digit x 1-digit from the ones digit; a carry is added in its own step (``4*6=24, 24+4=28``), so every
    step is one times-table fact or one small sum."""
    ones, tens = a % 10, a // 10
    low = ones * b
    carry = low // 10
    high = tens * b + carry
    first = f"{a} * {b}: {ones}*{b}={low}, " + (f"carry {carry}, " if carry else "") + f"digits {low % 10}"
    step = f"{tens}*{b}={tens * b}" + (f", {tens * b}+{carry}={high}" if carry else "")
    return f"{first}\n{tens} * {b}: {step}, digits {high}{low % 10}"


def gen_multiplication(rng: random.Random) -> Sample:
    a, b = rng.randint(10, 99), rng.choice([2, 3, 4, 5, 6, 7, 8, 9] * 4 + [0, 1])
    swapped = rng.random() < 0.2
    x, y = (b, a) if swapped else (a, b)
    q = rng.choice([
        "What is {x} * {y}?", "What's {x} times {y}?", "Calculate {x} * {y}.", "{x} x {y} = ?",
        "Multiply {x} by {y}.", "What is the product of {x} and {y}?", "Compute {x}*{y}.",
    ]).format(x=x, y=y)
    lines = [f"{b} * {a} = {a} * {b}."] if swapped else []
    lines.append(multiplication_steps(a, b))
    p = a * b
    reasoning = "\n".join(lines) + f"\nSo {x} * {y} = {p}."
    return Sample("multiplication", _user(q), reasoning, f"{x} * {y} = {p}.", p)


def tens_groups(nums: list[int]) -> list[list[int]]:
    """The numbers of each tens digit 0-9 (a one-digit number has tens digit 0), smallest first."""
    return [sorted(n for n in nums if n // 10 == tens) for tens in range(10)]


def sorting_steps(nums: list[int]) -> str:
    """Bucket sort by the tens digit: one line per tens digit 0-9, in order, listing its numbers smallest first, or
    ``-`` when it has none. Each line looks up the numbers whose first digit is the line's (a match on one token) and
    orders at most a few ones digits; nothing is restated, and the numbers are never compared across tens."""
    lines = ["By tens digit:"]
    for tens, group in enumerate(tens_groups(nums)):
        lines.append(f"{tens}: " + (", ".join(map(str, group)) if group else "-"))
    return "\n".join(lines)


def _sorting_sample(task: str, nums: list[int], rng: random.Random) -> Sample:
    listed = ", ".join(map(str, nums))
    q = rng.choice([
        "Sort these numbers: {l}", "Sort these numbers: {l}.", "Sort these numbers from smallest to largest: {l}",
        "Put these numbers in ascending order: {l}", "Arrange in increasing order: {l}", "Sort: {l}",
    ]).format(l=listed)
    ordered = sorted(nums)
    out = ", ".join(map(str, ordered))
    reasoning = f"{sorting_steps(nums)}\nSo the order is {out}."
    return Sample(task, _user(q), reasoning, out, ordered)


def gen_sorting(rng: random.Random) -> Sample:
    """4-6 distinct numbers below 100."""
    return _sorting_sample("sorting", rng.sample(range(1, 100), rng.randint(4, 6)), rng)


def gen_sorting_one_digit(rng: random.Random) -> Sample:
    """4-6 distinct numbers of which 1-3 have one digit (tens line 0, the line users found failing)."""
    n = rng.randint(4, 6)
    small = rng.randint(1, min(3, n - 1))
    nums = rng.sample(range(1, 10), small) + rng.sample(range(10, 100), n - small)
    rng.shuffle(nums)
    return _sorting_sample("sorting_one_digit", nums, rng)


# Common English words with doubled letters (several with a letter three or four times), where users found the
# letter count failing; the same banned-pair filter as WORDS keeps each spelled one letter per token.
DOUBLED_WORDS = """
mississippi committee parallel occurrence bookkeeper bookkeeping success address necessary possession millennium
beginning referee balloon coffee letter apple happy accommodate bottle kitten mitten rabbit puppy carrot cherry
hello dinner summer yellow pepper butter cookie needle street sheep green tree moon spoon book door floor pizza
jazz buzz fizz mammal llama hammer ladder pillow willow arrow narrow sorrow barrel cannon tunnel kennel flannel
channel difficult different officer offer effort waffle giraffe raccoon broccoli zucchini tennessee misspell
keeper guarantee agree freedom teeth sleep wheel cheese goose afternoon connecticut
mirror pebble bubble puzzle shell small tall wall ball doll bell hill mill kill spell skill
village million billion follow hollow collect college cellar accept access accident according
""".split()


def _spellable(words: list[str]) -> list[str]:
    """Words the tokenizer spells one letter per token inside quotes (deduplicated, order kept)."""
    banned = {w[:2] for w in BARE_WORDS}
    return [w for w in dict.fromkeys(words) if not any(p in w for p in banned)]


def letter_count_words() -> list[str]:
    """WORDS minus those the tokenizer would not spell one letter per token."""
    return _spellable(WORDS)


LETTER_WORDS = letter_count_words()
LETTER_DOUBLED_WORDS = _spellable(DOUBLED_WORDS)


def _letters_sample(task: str, word: str, letter: str, rng: random.Random) -> Sample:
    """Spell the word, marking each match with the running count, then answer."""
    q = rng.choice([
        "How many times does the letter '{c}' appear in '{w}'?", "How many '{c}'s are in '{w}'?",
        "Count the letter '{c}' in '{w}'.", "How many {c}'s are in the word '{w}'?",
        "In the word '{w}', how many times does '{c}' occur?", "How many times does '{c}' appear in '{w}'?",
    ]).format(c=letter, w=word)
    count, marks = 0, []
    for ch in word:
        if ch == letter:
            count += 1
            marks.append(f"{ch}{count}")
        else:
            marks.append(ch)
    times = "time" if count == 1 else "times"
    reasoning = f"Spell it and count '{letter}': {' '.join(marks)}\nSo '{letter}' appears {count} {times}."
    content = f"The letter '{letter}' appears {count} {times} in '{word}'."
    return Sample(task, _user(q), reasoning, content, count, meta={"word": word, "letter": letter})


def gen_letters(rng: random.Random) -> Sample:
    word = rng.choice(LETTER_WORDS)
    letter = rng.choice(word) if rng.random() < 0.75 else rng.choice("abcdefghijklmnopqrstuvwxyz")
    return _letters_sample("letters", word, letter, rng)


def gen_letters_doubled(rng: random.Random) -> Sample:
    """A word with a doubled letter; mostly asked about a letter it repeats."""
    word = rng.choice(LETTER_DOUBLED_WORDS)
    repeated = [c for c in dict.fromkeys(word) if word.count(c) > 1]
    r = rng.random()
    letter = rng.choice(repeated) if r < 0.7 else (rng.choice(word) if r < 0.9 else
                                                      rng.choice("abcdefghijklmnopqrstuvwxyz"))
    return _letters_sample("letters_doubled", word, letter, rng)


def comparison_lines(a: int, b: int) -> str:
    """Which of two numbers is larger: by digit count, else digit by digit from the left until two differ."""
    sa, sb = str(a), str(b)
    if len(sa) != len(sb):
        return f"{a} vs {b}: {len(sa)} digits vs {len(sb)} digits"
    steps = []
    for i, (x, y) in enumerate(zip(sa, sb)):
        steps.append(f"{sa[i:]} vs {sb[i:]}: {x}{'=' if x == y else ('>' if x > y else '<')}{y}")
        if x != y:
            break
    return "\n".join(steps)


def gen_comparison(rng: random.Random) -> Sample:
    r = rng.random()
    a = _num(rng, 2, 4)
    if r < 0.4:
        digits = list(str(a))
        i = rng.randrange(1 if len(digits) > 1 else 0, len(digits))
        choices = [d for d in "0123456789" if d != digits[i]]
        digits[i] = rng.choice(choices)
        b = int("".join(digits))
    elif r < 0.8:
        b = _num(rng, len(str(a)), len(str(a)))
    elif r < 0.96:
        b = _num(rng, 2, 4)
    else:
        b = a
    if rng.random() < 0.5:
        a, b = b, a
    smaller_q = rng.random() < 0.25
    q = rng.choice(
        ["Which is smaller, {a} or {b}?", "Which number is less, {a} or {b}?", "Which is smaller: {a} or {b}?"]
        if smaller_q else
        ["Which is larger, {a} or {b}?", "Which is bigger: {a} or {b}?", "Which number is greater, {a} or {b}?",
         "Is {a} or {b} larger?", "Which is larger: {a} or {b}?"]
    ).format(a=a, b=b)
    lines = comparison_lines(a, b)
    if a == b:
        reasoning, content, expected = lines + "\nThey are equal.", f"They are equal: {a} = {b}.", "equal"
    else:
        hi, lo = max(a, b), min(a, b)
        expected = lo if smaller_q else hi
        word = "smaller" if smaller_q else "larger"
        # The answer is restated right before </think>, so the reply copies it from the line above.
        reasoning = f"{lines}\nSo {hi} > {lo}, and the {word} one is {expected}."
        content = f"{expected} is {word}."
    return Sample("comparison", _user(q), reasoning, content, expected, meta={"smaller": smaller_q})


def _big_product_question(rng: random.Random, a: int, b: int) -> str:
    return rng.choice([
        "What is {a} * {b}?", "Compute {a} times {b}.", "Multiply {a} by {b}.", "What is the product of {a} and {b}?",
        "Calculate {a} x {b}.", "What's {a} * {b}?",
    ]).format(a=a, b=b)


def _tool_list(rng: random.Random) -> list[dict[str, Any]]:
    tools = [calculator_tool(rng)]
    if rng.random() < 0.15:
        tools.insert(rng.randrange(2), rng.choice(OTHER_TOOLS))
    return tools


CALL_REASONING = [
    "{a} * {b} is a large product, so I will use the calculator.",
    "{a} * {b} needs an exact product of big numbers. I'll call the calculator.",
]


def calculator_call(a: int, b: int) -> dict[str, Any]:
    """The tool call the model should make for a * b, in OpenAI's message format with Kimi's call id."""
    args = json.dumps({"expression": f"{a} * {b}"})
    return {"id": "functions.calculator:0", "type": "function",
            "function": {"name": "calculator", "arguments": args}}


def gen_calculator_call(rng: random.Random) -> Sample:
    a, b = _num(rng, 3, 4), _num(rng, 3, 4)
    reasoning = rng.choice(CALL_REASONING).format(a=a, b=b)
    call = calculator_call(a, b)
    return Sample("calculator", _user(_big_product_question(rng, a, b)), reasoning, "", f"{a} * {b}",
                  tools=_tool_list(rng), tool_calls=[call])


def gen_calculator_result(rng: random.Random) -> Sample:
    call = gen_calculator_call(rng)
    a, b = (int(x) for x in call.expected.split(" * "))
    p = a * b
    history = call.messages + [call.assistant_message(),
                               {"role": "tool", "tool_call_id": "functions.calculator:0", "content": str(p)}]
    reasoning = f"The calculator returned {p}."
    return Sample("calculator_result", history, reasoning, f"{a} * {b} = {p}.", p, tools=call.tools)


def gen_no_calculator(rng: random.Random) -> Sample:
    a, b = _num(rng, 3, 4), _num(rng, 3, 4)
    reasoning = f"{a} * {b} is a large product and no calculator is available, so I should not guess."
    content = f"I can't compute {a} * {b} exactly without a calculator tool."
    return Sample("no_calculator", _user(_big_product_question(rng, a, b)), reasoning, content, None)


GENERATORS: dict[str, Callable[[random.Random], Sample]] = {
    "addition": gen_addition,
    "subtraction": gen_subtraction,
    "multiplication": gen_multiplication,
    "sorting": gen_sorting,
    "letters": gen_letters,
    "letters_doubled": gen_letters_doubled,
    "sorting_one_digit": gen_sorting_one_digit,
    "comparison": gen_comparison,
    "calculator": gen_calculator_call,
    "calculator_result": gen_calculator_result,
    "no_calculator": gen_no_calculator,
}

TRAIN_MIX = {
    "addition": 0.12, "subtraction": 0.17, "multiplication": 0.16, "sorting": 0.17, "letters": 0.16,
    "comparison": 0.10, "calculator": 0.06, "calculator_result": 0.04, "no_calculator": 0.02,
}


# Tasks whose answer needs the step-by-step working; with thinking off it moves into the reply.
WORKED_TASKS = ("addition", "subtraction", "multiplication", "sorting", "letters", "comparison", "letters_doubled",
                "sorting_one_digit")
# The answer from a tool result continues a turn that thought before its call, so it is never asked without thinking.
ALWAYS_THINKS = "calculator_result"


def without_thinking(sample: Sample) -> Sample:
    """Thinking off. A model this small cannot do column arithmetic or sorting without writing the steps, and
    training it to guess the digits only adds noise (such targets held ~38% of the loss at the end of a run, at ~0.5
    nats per token), so the working moves into the reply, followed by the same answer."""
    sample.thinking = False
    if sample.task in WORKED_TASKS:
        sample.content = f"{sample.reasoning}\n\n{sample.content}"
    return sample


def decorate(sample: Sample, rng: random.Random) -> Sample:
    """Training-only variety: thinking off, a system prompt, the tool offered to other tasks, an earlier exchange."""
    if sample.task not in ("calculator", "calculator_result", "no_calculator") and rng.random() < 0.08:
        sample.tools = _tool_list(rng)
    if sample.task != ALWAYS_THINKS and rng.random() < 0.12:
        without_thinking(sample)
    if rng.random() < 0.05:
        prev = GENERATORS[rng.choice(WORKED_TASKS)](rng)
        if rng.random() < 0.3:
            without_thinking(prev)
        sample.messages = prev.messages + [prev.assistant_message()] + sample.messages
    if rng.random() < 0.12:
        sample.messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] + sample.messages
    return sample


def training_sample(rng: random.Random, mix: dict[str, float] = TRAIN_MIX) -> Sample:
    task = rng.choices(list(mix), weights=list(mix.values()))[0]
    return decorate(GENERATORS[task](rng), rng)


EVAL_TASKS = ["addition", "subtraction", "comparison", "multiplication", "sorting", "letters", "calculator",
              "calculator_result", "letters_doubled", "sorting_one_digit"]


def eval_samples(per_task: int = 100, seed: int = EVAL_SEED, thinking: bool = True) -> list[Sample]:
    """Fresh problems (different seed), no decoration; the calculator is offered with its default spec. With
    thinking off, every task but the answer from a tool result (always trained with thinking) is asked without it."""
    rng = random.Random(seed)
    out = []
    for task in EVAL_TASKS:
        for _ in range(per_task):
            sample = GENERATORS[task](rng)
            if sample.tools:
                sample.tools = [calculator_tool()]
            if not thinking and task != ALWAYS_THINKS:
                without_thinking(sample)
            out.append(sample)
    return out


_INT = re.compile(r"-?\d+")


def check_answer(sample: Sample, content: str, tool_calls: list[dict[str, Any]] | None) -> bool:
    """Whether an answer (text after ``</think>``, and parsed tool calls) solves the sample. A reply without
    thinking shows its working first, so its last line is the answer."""
    if not sample.thinking and sample.task in WORKED_TASKS:
        lines = content.strip().splitlines()
        content = lines[-1] if lines else ""
    if sample.task == "calculator":
        if not tool_calls or len(tool_calls) != 1 or tool_calls[0].get("name") != "calculator":
            return False
        try:
            args = json.loads(tool_calls[0]["arguments"])
        except (ValueError, TypeError):
            return False
        return isinstance(args, dict) and args.get("expression") == sample.expected
    nums = [int(x) for x in _INT.findall(content)]
    if sample.task in ("sorting", "sorting_one_digit"):
        return nums == sample.expected
    if sample.task == "comparison":
        if sample.expected == "equal":
            return "equal" in content
        return bool(nums) and nums[0] == sample.expected
    return bool(nums) and nums[-1] == sample.expected
