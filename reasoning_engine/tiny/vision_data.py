"""Synthetic pictures and questions for the tiny model's vision tower, drawn from a seeded RNG.

Pictures vary as users' pictures do: canvases of 48 to 160 pixels a side and aspect ratios up to 1.6, a plain light
background of any tint, sometimes noise or a slight blur, and circles, squares and triangles anywhere on it, of any
size from 7 to 16 pixels as the model sees them, filled or outlined, in shades of six named colours (each sampled from
a range of hue, saturation and value around its name). Drawn with Pillow's ImageDraw at the canvas's own size; the
model's processor then scales the picture so that its longer side is at most 64 pixels (``PIXELS``) and pads it to
whole image tokens of 16 x 16 pixels: 4 tokens along the longer side, 2 to 4 along the other.

Three questions, each answered after a thinking section that scans the picture first:

- "What colour is the circle?": the picture has exactly one shape of the asked kind;
- "How many squares are there?": 1 to 5 of them, with up to two shapes of other kinds;
- "Which shape is on the left?": two shapes of different kinds whose centres lie in different columns of cells.

The scan reads the picture as a 4 x 4 grid of cells over the model's view of it (the padded picture, cut in quarters
each way, whatever its image-token grid), one fixed item per cell, column by column and top to bottom: `|`, the cell's
name (an upper-case letter, one token) and its content (`-`, or a colour and a shape letter: `|DGS` is a green square
in cell D); a shape belongs to the cell holding its centre. Every picture has at most one shape per cell and per image
token. Every content token is predicted right after the cell's own name, so the language model's lookup into the image
tokens is the same for every cell and every question, and the answer is read from its own thinking, with the counting
and stopping rules of the text tasks: the colour scan stops at the asked shape, the left scan at the first shape, the
count scan marks each match with its running count as the letter counts do.

For training (train_vision) each sample's meta also says, per image token, what it holds (``token_labels``: the
shape whose centre lies in it) and which cell (``token_cells``), and per cell which image tokens hold its content
(``cell_tokens``). vision_heldout draws the same questions with another program, never used for training.
"""

from __future__ import annotations

import colorsys
import random
import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from reasoning_engine.multimodal.processing import PixelSettings, navit_size
from reasoning_engine.tiny.data import SYSTEM_PROMPTS, Sample

VISION_TRAIN_SEED = 2468
VISION_EVAL_SEED = 97531
# What the model sees: 8-pixel patches merged 2 x 2 into image tokens, at most 8 patches a side, so every picture is
# scaled (never enlarged) until its longer side is at most 64 pixels: a 100 x 100 picture becomes 4 x 4 tokens, as a
# 64 x 64 one does, instead of 66 x 66 pixels padded to 5 x 5 tokens.
PIXELS = PixelSettings(patch_size=8, merge_size=2, max_patches=64, max_patches_per_side=8)
TOKEN = PIXELS.patch_size * PIXELS.merge_size
GRID = 4
SHAPES = ("circle", "square", "triangle")
# Each colour name's range of hue (degrees), saturation and value; gaps between neighbouring names keep them apart.
COLOURS: dict[str, tuple[tuple[float, float], tuple[float, float], tuple[float, float]]] = {
    "red": ((-15, 8), (0.65, 1.0), (0.6, 1.0)),
    "green": ((85, 155), (0.5, 1.0), (0.4, 0.85)),
    "blue": ((200, 245), (0.55, 1.0), (0.5, 1.0)),
    "yellow": ((47, 62), (0.6, 1.0), (0.85, 1.0)),
    "purple": ((265, 305), (0.5, 1.0), (0.4, 0.85)),
    "orange": ((15, 42), (0.7, 1.0), (0.85, 1.0)),
}
CANVAS_SIDES = (48, 160)  # the longer side's range, in the canvas's own pixels
MAX_ASPECT = 1.6
SHAPE_SIZES = (7.0, 16.0)  # width in the model's pixels
OUTLINED = 0.2

COLOUR_QUESTIONS = ["What colour is the {shape}?", "What color is the {shape}?", "Which colour is the {shape}?",
                    "What is the colour of the {shape}?"]
COUNT_QUESTIONS = ["How many {shape}s are there?", "How many {shape}s are in the picture?", "Count the {shape}s."]
LEFT_QUESTIONS = ["Which shape is on the left?", "What shape is on the left?", "Which shape is further left?"]


@dataclass(frozen=True)
class Frame:
    """A canvas as the processor shows it to the model: scaled to `scaled` (width, height) pixels, padded to `padded`;
    the model's pixels are what the grid of cells and the image tokens are measured in."""

    canvas: tuple[int, int]
    scaled: tuple[int, int]
    padded: tuple[int, int]

    @classmethod
    def of(cls, width: int, height: int) -> Frame:
        (scaled_h, scaled_w), (padded_h, padded_w) = navit_size(height, width, PIXELS)
        return cls((width, height), (scaled_w, scaled_h), (padded_w, padded_h))

    @property
    def tokens(self) -> tuple[int, int]:
        """The image-token grid (rows, columns); tokens come in raster order."""
        return self.padded[1] // TOKEN, self.padded[0] // TOKEN

    def cell_of(self, x: float, y: float) -> tuple[int, int]:
        """(row, column) of the cell holding a point in model pixels."""
        return (min(GRID - 1, int(y * GRID / self.padded[1])), min(GRID - 1, int(x * GRID / self.padded[0])))

    def token_of(self, x: float, y: float) -> int:
        rows, cols = self.tokens
        return min(rows - 1, int(y // TOKEN)) * cols + min(cols - 1, int(x // TOKEN))


@dataclass(frozen=True)
class Placed:
    """One shape: kind, colour name, the shade drawn, centre and bounding size in model pixels, outline width in
    canvas pixels (0: filled)."""

    shape: str
    colour: str
    rgb: tuple[int, int, int]
    x: float
    y: float
    width: float
    height: float
    outline: int

    def box(self) -> tuple[float, float, float, float]:
        return self.x - self.width / 2, self.y - self.height / 2, self.x + self.width / 2, self.y + self.height / 2


def random_frame(rng: random.Random) -> Frame:
    longer = rng.randint(*CANVAS_SIDES)
    shorter = longer if rng.random() < 0.25 else round(longer / rng.uniform(1.0, MAX_ASPECT))
    return Frame.of(*((longer, shorter) if rng.random() < 0.5 else (shorter, longer)))


def shade(colour: str, rng: random.Random) -> tuple[int, int, int]:
    """A random shade of a named colour."""
    (h0, h1), (s0, s1), (v0, v1) = COLOURS[colour]
    r, g, b = colorsys.hsv_to_rgb((rng.uniform(h0, h1) % 360) / 360, rng.uniform(s0, s1), rng.uniform(v0, v1))
    return round(r * 255), round(g * 255), round(b * 255)


def _apart(a: Placed, b: Placed, gap: float = 1.0) -> bool:
    al, at, ar, ab = a.box()
    bl, bt, br, bb = b.box()
    return ar + gap <= bl or br + gap <= al or ab + gap <= bt or bb + gap <= at


def place(shapes: list[str], frame: Frame, rng: random.Random, columns: list[int] | None = None
          ) -> list[Placed] | None:
    """Each shape at a random spot (its centre in a cell and an image token no other shape's centre is in, all of it
    on the picture and clear of the others), with a random colour, shade, size and fill; `columns` pins each shape's
    cell column. All shapes are placed again when one finds no room; None when the frame seems too small."""
    width, height = frame.scaled
    for _ in range(20):
        placed: list[Placed] = []
        cells: set[tuple[int, int]] = set()
        tokens: set[int] = set()
        for i, shape in enumerate(shapes):
            for _ in range(60):
                size = rng.uniform(*SHAPE_SIZES)
                size = min(size, width - 2, height - 2)
                tall = size * (rng.uniform(0.8, 1.05) if shape == "triangle" else 1.0)
                col = columns[i] if columns else rng.randrange(GRID)
                row = rng.randrange(GRID)
                cell_w, cell_h = frame.padded[0] / GRID, frame.padded[1] / GRID
                x_lo, x_hi = max(col * cell_w, size / 2 + 0.5), min((col + 1) * cell_w, width - size / 2 - 0.5)
                y_lo, y_hi = max(row * cell_h, tall / 2 + 0.5), min((row + 1) * cell_h, height - tall / 2 - 0.5)
                if x_lo >= x_hi or y_lo >= y_hi or (row, col) in cells:
                    continue
                x, y = rng.uniform(x_lo, x_hi), rng.uniform(y_lo, y_hi)
                if frame.cell_of(x, y) != (row, col) or frame.token_of(x, y) in tokens:
                    continue
                colour = rng.choice(list(COLOURS))
                scale = frame.canvas[0] / width
                outline = max(1, round(rng.uniform(0.12, 0.25) * size * scale)) if rng.random() < OUTLINED else 0
                shape_at = Placed(shape, colour, shade(colour, rng), x, y, size, tall, outline)
                if all(_apart(shape_at, other) for other in placed):
                    placed.append(shape_at)
                    cells.add((row, col))
                    tokens.add(frame.token_of(x, y))
                    break
            else:
                break
        if len(placed) == len(shapes):
            return placed
    return None


def scene(shapes: list[str], rng: random.Random, columns: list[int] | None = None) -> tuple[Frame, list[Placed]]:
    """A random frame with the shapes placed on it (another frame when they do not fit)."""
    while True:
        frame = random_frame(rng)
        placed = place(shapes, frame, rng, columns) if frame.tokens[0] * frame.tokens[1] >= len(shapes) else None
        if placed:
            return frame, placed


def draw(placed: list[Placed], frame: Frame, rng: random.Random) -> Image.Image:
    """The picture at the canvas's size: a light background of any tint, the shapes, maybe noise or a slight blur."""
    r, g, b = colorsys.hsv_to_rgb(rng.random(), rng.uniform(0.0, 0.12), rng.uniform(0.85, 1.0))
    image = Image.new("RGB", frame.canvas, (round(r * 255), round(g * 255), round(b * 255)))
    pen = ImageDraw.Draw(image)
    sx, sy = frame.canvas[0] / frame.scaled[0], frame.canvas[1] / frame.scaled[1]
    for p in placed:
        left, top, right, bottom = p.box()
        x0, y0, x1, y1 = left * sx, top * sy, right * sx - 1, bottom * sy - 1
        paint = {"outline": p.rgb, "width": p.outline} if p.outline else {"fill": p.rgb}
        if p.shape == "circle":
            pen.ellipse([x0, y0, x1, y1], **paint)
        elif p.shape == "square":
            pen.rectangle([x0, y0, x1, y1], **paint)
        else:
            pen.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], **paint)
    if rng.random() < 0.25:
        image = image.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 0.8) * sx))
    if rng.random() < 0.5:
        pixels = np.asarray(image, dtype=np.float32)
        noise = np.random.default_rng(rng.getrandbits(32)).normal(0.0, rng.uniform(1.0, 6.0), pixels.shape)
        image = Image.fromarray(np.clip(pixels + noise, 0, 255).round().astype(np.uint8), "RGB")
    return image


def objects_of(placed: list[Placed], frame: Frame) -> list[tuple[str, str, int, int]]:
    """(shape, colour, row, column) per shape, the cell holding its centre: what the scan reads."""
    return [(p.shape, p.colour, *frame.cell_of(p.x, p.y)) for p in placed]


def content_label(shape: str, colour: str) -> int:
    """0 is empty; else 1 + shape * len(COLOURS) + colour."""
    return 1 + SHAPES.index(shape) * len(COLOURS) + list(COLOURS).index(colour)


def token_targets(placed: list[Placed], frame: Frame) -> tuple[list[int], list[int], list[list[int]]]:
    """Per image token (raster order): the content label of the shape whose centre lies in it, and the cell
    (row * GRID + column) it stands for: that centre's, or its own centre's when it holds none; per cell in raster
    order, the tokens that stand for it (the one holding its shape's centre, if any), which a look-up should read. A
    cell no token stands for (where 4 cells span 3 tokens, or its token holds the shape of the cell beside it) lists
    none: the look-up then reads the image's end marker, which means empty."""
    rows, cols = frame.tokens
    labels = [0] * (rows * cols)
    cells = []
    for i in range(rows * cols):
        r, c = frame.cell_of((i % cols + 0.5) * TOKEN, (i // cols + 0.5) * TOKEN)
        cells.append(r * GRID + c)
    for p in placed:
        token = frame.token_of(p.x, p.y)
        r, c = frame.cell_of(p.x, p.y)
        labels[token] = content_label(p.shape, p.colour)
        cells[token] = r * GRID + c
    cell_tokens: list[list[int]] = [[] for _ in range(GRID * GRID)]
    for token, cell in enumerate(cells):
        cell_tokens[cell].append(token)
    for cell, tokens in enumerate(cell_tokens):
        if any(labels[t] for t in tokens):
            cell_tokens[cell] = [t for t in tokens if labels[t]]
    return labels, cells, cell_tokens


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


def _image_sample(task: str, question: str, placed: list[Placed], frame: Frame, reasoning: str, content: str,
                  expected: Any, rng: random.Random) -> Sample:
    image = draw(placed, frame, rng)
    parts: list[dict[str, Any]] = [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": question}]
    labels, cells, cell_tokens = token_targets(placed, frame)
    return Sample(task, [{"role": "user", "content": parts}], reasoning, content, expected,
                  meta={"image": image, "objects": objects_of(placed, frame), "frame": frame, "placed": placed,
                        "token_labels": labels, "token_cells": cells, "cell_tokens": cell_tokens})


def gen_image_colour(rng: random.Random, shape: str | None = None) -> Sample:
    """One shape of the asked kind and 0-3 of the other kinds."""
    shape = shape or rng.choice(SHAPES)
    others = [s for s in SHAPES if s != shape]
    frame, placed = scene([shape] + [rng.choice(others) for _ in range(rng.randint(0, 3))], rng)
    colour = placed[0].colour
    question = rng.choice(COLOUR_QUESTIONS).format(shape=shape)
    reasoning = f"I scan for the {shape}:{scan(objects_of(placed, frame), stop_at=shape)}\nSo the {shape} is {colour}."
    return _image_sample("image_colour", question, placed, frame, reasoning, f"The {shape} is {colour}.", colour, rng)


def gen_image_count(rng: random.Random, shape: str | None = None) -> Sample:
    """1-5 shapes of the asked kind and 0-2 of the other kinds."""
    shape = shape or rng.choice(SHAPES)
    others = [s for s in SHAPES if s != shape]
    n = rng.randint(1, 5)
    frame, placed = scene([shape] * n + [rng.choice(others) for _ in range(rng.randint(0, 2))], rng)
    question = rng.choice(COUNT_QUESTIONS).format(shape=shape)
    answer = f"is 1 {shape}" if n == 1 else f"are {n} {shape}s"
    reasoning = f"I scan and count the {shape}s:{scan(objects_of(placed, frame), count=shape)}\nSo there {answer}."
    return _image_sample("image_count", question, placed, frame, reasoning, f"There {answer}.", n, rng)


def gen_image_left(rng: random.Random) -> Sample:
    """Two shapes of different kinds whose centres are in different columns of cells."""
    left, right = rng.sample(SHAPES, 2)
    frame, placed = scene([left, right], rng, columns=sorted(rng.sample(range(GRID), 2)))
    rng.shuffle(placed)
    question = rng.choice(LEFT_QUESTIONS)
    reasoning = (f"I scan from the left:{scan(objects_of(placed, frame), stop_at_first=True)}\n"
                 f"So the {left} is on the left.")
    return _image_sample("image_left", question, placed, frame, reasoning, f"The {left} is on the left.", left, rng)


IMAGE_GENERATORS: dict[str, Callable[[random.Random], Sample]] = {
    "image_colour": gen_image_colour,
    "image_count": gen_image_count,
    "image_left": gen_image_left,
}
IMAGE_TASKS = list(IMAGE_GENERATORS)
# Counting reads every cell and is the hardest of the three on varied pictures, so it is asked most.
IMAGE_MIX = {"image_colour": 0.25, "image_count": 0.5, "image_left": 0.25}


def training_image_sample(rng: random.Random) -> Sample:
    """A question of a random type (IMAGE_MIX); sometimes the text before the picture, a system prompt, or thinking off
    (the scan then moves into the reply, as the text tasks' working does)."""
    sample = IMAGE_GENERATORS[rng.choices(list(IMAGE_MIX), weights=list(IMAGE_MIX.values()))[0]](rng)
    if rng.random() < 0.15:
        sample.messages[0]["content"].reverse()
    if rng.random() < 0.08:
        sample.thinking = False
        sample.content = f"{sample.reasoning}\n\n{sample.content}"
    if rng.random() < 0.1:
        sample.messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] + sample.messages
    return sample


def eval_image_samples(per_task: int = 100, seed: int = VISION_EVAL_SEED) -> list[Sample]:
    """Fresh pictures (the development figures: the training program's style, another seed) with the questions the
    eval asks: the circle's colour, the number of squares, the shape on the left."""
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
