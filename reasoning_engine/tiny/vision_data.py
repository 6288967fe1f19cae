"""Synthetic pictures and questions for the tiny model's vision tower, drawn from a seeded RNG.

A picture is 64 x 64 pixels on a plain light background, cut into a 4 x 4 grid of 16-pixel cells; each shape (circle,
square or triangle, in one of six named colours, 10-13 pixels wide, jittered inside its cell) sits in its own cell.
A cell is exactly what one image token covers (8-pixel patches merged 2 x 2), so the tower has to tell what is in a
token's cell and the language model where the tokens that matter are. Three questions, each answered after a thinking
section that scans the picture first:

- "What colour is the circle?": the picture has exactly one shape of the asked kind;
- "How many squares are there?": 1 to 5 of them, with up to two shapes of other kinds;
- "Which shape is on the left?": two shapes of different kinds in different columns.

The scan names the cells column by column, top to bottom, each as one fixed item: `|`, the cell's name (an upper-case
letter, one token) and its content (`-`, or a colour and a shape letter: `|DGS` is a green square in cell D). Every
content token is then predicted right after the cell's own name, so the language model's lookup into the image tokens
is the same simple one for every cell and every question (the name says which image token to read), and the answer is
read from its own thinking, with the counting and stopping rules of the text tasks: the colour scan stops at the asked
shape, the left scan at the first shape, the count scan marks each match with its running count as the letter counts
do.
"""

from __future__ import annotations

import random
import re
from typing import Any, Callable

from PIL import Image, ImageDraw

from reasoning_engine.tiny.data import SYSTEM_PROMPTS, Sample

VISION_TRAIN_SEED = 2468
VISION_EVAL_SEED = 97531
IMAGE_SIZE = 64
GRID = 4
CELL = IMAGE_SIZE // GRID
SHAPES = ("circle", "square", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
    "yellow": (240, 205, 30), "purple": (140, 60, 180), "orange": (245, 135, 25),
}
BACKGROUNDS = [(255, 255, 255), (232, 232, 232), (250, 242, 220), (222, 236, 250), (228, 245, 228)]

COLOUR_QUESTIONS = ["What colour is the {shape}?", "What color is the {shape}?", "Which colour is the {shape}?",
                    "What is the colour of the {shape}?"]
COUNT_QUESTIONS = ["How many {shape}s are there?", "How many {shape}s are in the picture?", "Count the {shape}s."]
LEFT_QUESTIONS = ["Which shape is on the left?", "What shape is on the left?", "Which shape is further left?"]


def _jitter(rgb: tuple[int, int, int], rng: random.Random, amount: int) -> tuple[int, int, int]:
    return tuple(min(255, max(0, v + rng.randint(-amount, amount))) for v in rgb)  # type: ignore[return-value]


def draw_scene(objects: list[tuple[str, str, int, int]], rng: random.Random) -> Image.Image:
    """The picture of (shape, colour, row, column) objects, colours slightly varied per draw."""
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), _jitter(rng.choice(BACKGROUNDS), rng, 4))
    draw = ImageDraw.Draw(image)
    for shape, colour, row, col in objects:
        size = rng.randint(10, 13)
        x0 = col * CELL + rng.randint(1, CELL - size - 1)
        y0 = row * CELL + rng.randint(1, CELL - size - 1)
        x1, y1 = x0 + size - 1, y0 + size - 1
        fill = _jitter(COLOURS[colour], rng, 15)
        if shape == "circle":
            draw.ellipse([x0, y0, x1, y1], fill=fill)
        elif shape == "square":
            draw.rectangle([x0 + 1, y0 + 1, x1 - 1, y1 - 1], fill=fill)
        else:
            draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)
    return image


def _scene(shapes: list[str], rng: random.Random) -> list[tuple[str, str, int, int]]:
    """Each shape in its own random cell, with a random colour."""
    cells = rng.sample(range(GRID * GRID), len(shapes))
    return [(s, rng.choice(list(COLOURS)), c // GRID, c % GRID) for s, c in zip(shapes, cells)]


def cell_labels(objects: list[tuple[str, str, int, int]]) -> list[int]:
    """Per cell in raster order (= per image token): 0 when empty, else 1 + shape * len(COLOURS) + colour."""
    labels = [0] * (GRID * GRID)
    for shape, colour, row, col in objects:
        labels[row * GRID + col] = 1 + SHAPES.index(shape) * len(COLOURS) + list(COLOURS).index(colour)
    return labels


NUM_CELL_LABELS = 1 + len(SHAPES) * len(COLOURS)
# The scan's order (column by column, so the first shape it meets is the leftmost) and each cell's name in it.
SCAN_ORDER = [(row, col) for col in range(GRID) for row in range(GRID)]
COLOUR_CODES = {"red": "R", "green": "G", "blue": "B", "yellow": "Y", "purple": "P", "orange": "O"}
SHAPE_CODES = {"circle": "C", "square": "S", "triangle": "T"}
# Cell names are upper-case letters, none of them a colour or shape code nor the thinking's opening `I`: the first
# scans named the cells ` a` ... ` p`, the very tokens the letter counts spell with (`g1 r e e n`), and the two formats
# competed (run 3 in docs/tiny-reasoner.md). Each item opens with `|`, so a name is always its own bare token (after a
# space, ` A`, ` K` and ` M` are single merged tokens and the other letters are not).
CELL_NAMES = "ADEFHJKLMNQUVWXZ"
ITEM_MARK = "|"


def scan(objects: list[tuple[str, str, int, int]], stop_at: str | None = None, count: str | None = None,
         stop_at_first: bool = False) -> str:
    """The thinking's scan line: `|A-|DGS|ERC...` over the cells in SCAN_ORDER; it ends after the first `stop_at`
    shape (or after the first shape at all with `stop_at_first`); with `count`, each such shape gets its running count
    (`|DGS1`)."""
    by_cell = {(row, col): (shape, colour) for shape, colour, row, col in objects}
    items, seen = [], 0
    for name, cell in zip(CELL_NAMES, SCAN_ORDER):
        if cell not in by_cell:
            items.append(f"{ITEM_MARK}{name}-")
            continue
        shape, colour = by_cell[cell]
        item = f"{ITEM_MARK}{name}{COLOUR_CODES[colour]}{SHAPE_CODES[shape]}"
        if shape == count:
            seen += 1
            item += str(seen)
        items.append(item)
        if shape == stop_at or stop_at_first:
            break
    return "".join(items)


def _image_sample(task: str, question: str, objects: list[tuple[str, str, int, int]], reasoning: str, content: str,
                  expected: Any, rng: random.Random) -> Sample:
    image = draw_scene(objects, rng)
    parts: list[dict[str, Any]] = [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": question}]
    return Sample(task, [{"role": "user", "content": parts}], reasoning, content, expected,
                  meta={"image": image, "objects": objects})


def gen_image_colour(rng: random.Random, shape: str | None = None) -> Sample:
    """One shape of the asked kind and 0-3 of the other kinds."""
    shape = shape or rng.choice(SHAPES)
    others = [s for s in SHAPES if s != shape]
    objects = _scene([shape] + [rng.choice(others) for _ in range(rng.randint(0, 3))], rng)
    colour = objects[0][1]
    question = rng.choice(COLOUR_QUESTIONS).format(shape=shape)
    reasoning = f"I scan for the {shape}:{scan(objects, stop_at=shape)}\nSo the {shape} is {colour}."
    return _image_sample("image_colour", question, objects, reasoning, f"The {shape} is {colour}.", colour, rng)


def gen_image_count(rng: random.Random, shape: str | None = None) -> Sample:
    """1-5 shapes of the asked kind and 0-2 of the other kinds."""
    shape = shape or rng.choice(SHAPES)
    others = [s for s in SHAPES if s != shape]
    n = rng.randint(1, 5)
    objects = _scene([shape] * n + [rng.choice(others) for _ in range(rng.randint(0, 2))], rng)
    question = rng.choice(COUNT_QUESTIONS).format(shape=shape)
    answer = f"is 1 {shape}" if n == 1 else f"are {n} {shape}s"
    reasoning = f"I scan and count the {shape}s:{scan(objects, count=shape)}\nSo there {answer}."
    return _image_sample("image_count", question, objects, reasoning, f"There {answer}.", n, rng)


def gen_image_left(rng: random.Random) -> Sample:
    """Two shapes of different kinds in different columns."""
    left, right = rng.sample(SHAPES, 2)
    col_left, col_right = sorted(rng.sample(range(GRID), 2))
    objects = [(left, rng.choice(list(COLOURS)), rng.randrange(GRID), col_left),
               (right, rng.choice(list(COLOURS)), rng.randrange(GRID), col_right)]
    rng.shuffle(objects)
    question = rng.choice(LEFT_QUESTIONS)
    reasoning = f"I scan from the left:{scan(objects, stop_at_first=True)}\nSo the {left} is on the left."
    return _image_sample("image_left", question, objects, reasoning, f"The {left} is on the left.", left, rng)


IMAGE_GENERATORS: dict[str, Callable[[random.Random], Sample]] = {
    "image_colour": gen_image_colour,
    "image_count": gen_image_count,
    "image_left": gen_image_left,
}
IMAGE_TASKS = list(IMAGE_GENERATORS)


def training_image_sample(rng: random.Random) -> Sample:
    """A question of a random type; sometimes the text before the picture, a system prompt, or thinking off (the
    scan then moves into the reply, as the text tasks' working does)."""
    sample = IMAGE_GENERATORS[rng.choice(IMAGE_TASKS)](rng)
    if rng.random() < 0.15:
        sample.messages[0]["content"].reverse()
    if rng.random() < 0.08:
        sample.thinking = False
        sample.content = f"{sample.reasoning}\n\n{sample.content}"
    if rng.random() < 0.1:
        sample.messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] + sample.messages
    return sample


def eval_image_samples(per_task: int = 100, seed: int = VISION_EVAL_SEED) -> list[Sample]:
    """Fresh pictures with the questions as the issue asks them: the circle's colour, the number of squares, the
    shape on the left."""
    rng = random.Random(seed)
    out = []
    for _ in range(per_task):
        sample = gen_image_colour(rng, "circle")
        sample.messages[0]["content"][1]["text"] = COLOUR_QUESTIONS[0].format(shape="circle")
        out.append(sample)
    for _ in range(per_task):
        sample = gen_image_count(rng, "square")
        sample.messages[0]["content"][1]["text"] = COUNT_QUESTIONS[0].format(shape="square")
        out.append(sample)
    for _ in range(per_task):
        sample = gen_image_left(rng)
        sample.messages[0]["content"][1]["text"] = LEFT_QUESTIONS[0]
        out.append(sample)
    return out


_WORD = re.compile(r"[a-z]+")


def check_image_answer(sample: Sample, content: str) -> bool:
    """The count is the reply's last number; a colour or shape must be the only one of its kind the reply names."""
    if sample.task == "image_count":
        nums = re.findall(r"\d+", content)
        return bool(nums) and int(nums[-1]) == sample.expected
    vocabulary = set(COLOURS) if sample.task == "image_colour" else set(SHAPES)
    named = {w for w in _WORD.findall(content.lower()) if w in vocabulary}
    return named == {sample.expected}
