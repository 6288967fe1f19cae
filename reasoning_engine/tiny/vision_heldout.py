"""A second, independent drawing program for the tiny model's picture questions: the held-out style.

It is never used for training (tests/tiny/test_vision.py checks that the training data path does not import it). It
exists to measure whether the picture answers carry over to pictures that vision_data, the training program, did not
draw; its design was fixed before the training it evaluates and is not tuned against it. Everything about the drawing
differs from vision_data's:

- canvases from a fixed list of sizes and aspect ratios (80 x 60, 100 x 100, 48 x 64, 120 x 80, 72 x 72, 60 x 90,
  128 x 96), scaled by the model's processor as any user's picture is;
- rasterised in numpy with anti-aliasing (each pixel covered by the fraction of its 4 x 4 sub-samples inside the
  shape), not with Pillow's ImageDraw; triangles are near-equilateral;
- each named colour as one of a few fixed shades from the CSS palette (crimson, firebrick, forestgreen, royalblue,
  gold, darkorchid, darkorange, ...);
- a light background from its own list, half of them with a linear gradient, all with faint pixel noise;
- shapes anywhere on the canvas (no grid; only non-overlapping, with a small gap), 13-22% of the canvas's longer side
  wide, a quarter of them drawn as outlines;
- half of the pictures saved and read back as JPEG (quality 55-90).

The questions are the eval's (the first phrasing of each of vision_data's, written out here: this module imports
nothing of the training program, which a test checks) and so is the answer check (the eval's check_image_answer), so
the two styles' figures compare the drawing alone.
"""

from __future__ import annotations

import io
import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image

from reasoning_engine.tiny.data import Sample

HELDOUT_SEED = 13579
CANVASES = [(80, 60), (100, 100), (48, 64), (120, 80), (72, 72), (60, 90), (128, 96)]  # (width, height)
SHADES: dict[str, list[tuple[int, int, int]]] = {
    "red": [(220, 20, 60), (178, 34, 34), (255, 0, 0), (205, 38, 38)],
    "green": [(34, 139, 34), (50, 205, 50), (46, 139, 87), (0, 128, 0)],
    "blue": [(65, 105, 225), (30, 144, 255), (0, 0, 205), (25, 25, 160)],
    "yellow": [(255, 215, 0), (255, 255, 0), (238, 210, 50), (250, 220, 70)],
    "purple": [(128, 0, 128), (153, 50, 204), (148, 0, 211), (120, 40, 160)],
    "orange": [(255, 140, 0), (255, 165, 0), (255, 127, 40), (240, 120, 20)],
}
BACKGROUNDS = [(255, 255, 250), (240, 244, 248), (248, 240, 232), (236, 236, 236), (242, 248, 238), (250, 238, 242)]
SUPERSAMPLE = 4
COLOUR_QUESTION = "What colour is the circle?"
COUNT_QUESTION = "How many squares are there?"
LEFT_QUESTION = "Which shape is on the left?"


@dataclass
class Shape:
    """One shape: kind, named colour, its shade, bounding box (left, top, width) in canvas pixels, outline width (0:
    filled)."""

    kind: str
    colour: str
    rgb: tuple[int, int, int]
    left: float
    top: float
    size: float
    outline: float

    @property
    def height(self) -> float:
        return self.size * (math.sqrt(3) / 2 if self.kind == "triangle" else 1.0)

    def box(self) -> tuple[float, float, float, float]:
        return self.left, self.top, self.left + self.size, self.top + self.height


def _inside(shape: Shape, x: np.ndarray, y: np.ndarray, inset: float = 0.0) -> np.ndarray:
    """Whether points (x, y) lie inside the shape shrunk by `inset` pixels on every side."""
    s, h = shape.size, shape.height
    if shape.kind == "circle":
        cx, cy, r = shape.left + s / 2, shape.top + s / 2, s / 2 - inset
        return (x - cx) ** 2 + (y - cy) ** 2 <= r * r
    if shape.kind == "square":
        return ((x >= shape.left + inset) & (x <= shape.left + s - inset)
                & (y >= shape.top + inset) & (y <= shape.top + s - inset))
    # Apex up, base at the bottom: inside all three edges' half-planes, each moved `inset` inwards.
    apex = (shape.left + s / 2, shape.top)
    corners = [apex, (shape.left + s, shape.top + h), (shape.left, shape.top + h)]
    inside = np.ones_like(x, dtype=bool)
    for (x0, y0), (x1, y1) in zip(corners, corners[1:] + corners[:1]):
        length = math.hypot(x1 - x0, y1 - y0)
        # Clockwise corners on screen (y down): the inside is where the cross product is non-negative.
        inside &= ((x1 - x0) * (y - y0) - (y1 - y0) * (x - x0)) / length >= inset
    return inside


def _coverage(shape: Shape, width: int, height: int) -> tuple[tuple[int, int, int, int], np.ndarray]:
    """The pixel window around the shape and each of its pixels' covered fraction."""
    left, top, right, bottom = shape.box()
    x0, y0 = max(0, int(left) - 1), max(0, int(top) - 1)
    x1, y1 = min(width, int(math.ceil(right)) + 1), min(height, int(math.ceil(bottom)) + 1)
    offsets = (np.arange(SUPERSAMPLE) + 0.5) / SUPERSAMPLE
    xs = (np.arange(x0, x1)[:, None] + offsets[None, :]).reshape(-1)
    ys = (np.arange(y0, y1)[:, None] + offsets[None, :]).reshape(-1)
    gx, gy = np.meshgrid(xs, ys)
    hit = _inside(shape, gx, gy)
    if shape.outline:
        hit &= ~_inside(shape, gx, gy, shape.outline)
    cover = hit.reshape(y1 - y0, SUPERSAMPLE, x1 - x0, SUPERSAMPLE).mean(axis=(1, 3))
    return (x0, y0, x1, y1), cover


def render(shapes: list[Shape], width: int, height: int, rng: random.Random) -> Image.Image:
    """The picture: background (maybe a gradient), the shapes blended by coverage, faint noise, maybe JPEG."""
    np_rng = np.random.default_rng(rng.getrandbits(32))
    canvas = np.empty((height, width, 3), dtype=np.float64)
    canvas[:] = rng.choice(BACKGROUNDS)
    if rng.random() < 0.5:
        ramp = np.linspace(0.0, 1.0, width)[None, :] if rng.random() < 0.5 else np.linspace(0.0, 1.0, height)[:, None]
        canvas += (rng.uniform(-18, 18) * ramp)[..., None]
    for shape in shapes:
        (x0, y0, x1, y1), cover = _coverage(shape, width, height)
        window = canvas[y0:y1, x0:x1]
        window += (np.array(shape.rgb, dtype=np.float64) - window) * cover[..., None]
    canvas += np_rng.normal(0.0, rng.uniform(0.5, 3.0), canvas.shape)
    image = Image.fromarray(np.clip(np.rint(canvas), 0, 255).astype(np.uint8), "RGB")
    if rng.random() < 0.5:
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=rng.randint(55, 90))
        image = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    return image


def _apart(a: Shape, b: Shape, gap: float) -> bool:
    al, at, ar, ab = a.box()
    bl, bt, br, bb = b.box()
    return ar + gap <= bl or br + gap <= al or ab + gap <= bt or bb + gap <= at


def place(kinds: list[str], width: int, height: int, rng: random.Random) -> list[Shape]:
    """The kinds at random non-overlapping places on the canvas, each with a random named colour and shade; retried
    with smaller shapes when they do not fit."""
    longer = max(width, height)
    gap = 1.5 + 0.02 * longer
    low, high = 0.13, 0.22
    while True:
        shapes: list[Shape] = []
        for kind in kinds:
            for _ in range(200):
                size = rng.uniform(low, high) * longer
                tall = size * (math.sqrt(3) / 2 if kind == "triangle" else 1.0)
                if size > width - 2 or tall > height - 2:
                    continue
                colour = rng.choice(list(SHADES))
                outline = max(2.0, 0.2 * size) if rng.random() < 0.25 else 0.0
                shape = Shape(kind, colour, rng.choice(SHADES[colour]), rng.uniform(1, width - 1 - size),
                              rng.uniform(1, height - 1 - tall), size, outline)
                if all(_apart(shape, other, gap) for other in shapes):
                    shapes.append(shape)
                    break
            else:
                break
        if len(shapes) == len(kinds):
            return shapes
        low, high = low * 0.9, high * 0.9


def _sample(task: str, question: str, shapes: list[Shape], width: int, height: int, expected: object,
            rng: random.Random) -> Sample:
    image = render(shapes, width, height, rng)
    parts = [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": question}]
    objects = [(s.kind, s.colour, round(s.left + s.size / 2), round(s.top + s.height / 2), round(s.size),
                "outline" if s.outline else "filled") for s in shapes]
    return Sample(task, [{"role": "user", "content": parts}], "", "", expected,
                  meta={"image": image, "objects": objects, "canvas": (width, height), "style": "heldout"})


def heldout_colour(rng: random.Random) -> Sample:
    """One circle and 0-3 squares or triangles: what colour is the circle?"""
    width, height = rng.choice(CANVASES)
    kinds = ["circle"] + [rng.choice(["square", "triangle"]) for _ in range(rng.randint(0, 3))]
    rng.shuffle(kinds)
    shapes = place(kinds, width, height, rng)
    circle = next(s for s in shapes if s.kind == "circle")
    return _sample("image_colour", COLOUR_QUESTION, shapes, width, height, circle.colour, rng)


def heldout_count(rng: random.Random) -> Sample:
    """1-5 squares and 0-2 circles or triangles: how many squares?"""
    width, height = rng.choice(CANVASES)
    n = rng.randint(1, 5)
    kinds = ["square"] * n + [rng.choice(["circle", "triangle"]) for _ in range(rng.randint(0, 2))]
    rng.shuffle(kinds)
    shapes = place(kinds, width, height, rng)
    return _sample("image_count", COUNT_QUESTION, shapes, width, height, n, rng)


def heldout_left(rng: random.Random) -> Sample:
    """Two shapes of different kinds, one wholly left of the other (their widths do not overlap): which is left?"""
    width, height = rng.choice(CANVASES)
    kinds = rng.sample(["circle", "square", "triangle"], 2)
    while True:
        shapes = place(kinds, width, height, rng)
        a, b = sorted(shapes, key=lambda s: s.left)
        if a.left + a.size + 1.5 + 0.02 * max(width, height) <= b.left:
            return _sample("image_left", LEFT_QUESTION, shapes, width, height, a.kind, rng)


def heldout_samples(per_task: int = 100, seed: int = HELDOUT_SEED) -> list[Sample]:
    """`per_task` pictures per question (circle colour, square count, shape on the left) in the held-out style."""
    rng = random.Random(seed)
    return ([heldout_colour(rng) for _ in range(per_task)] + [heldout_count(rng) for _ in range(per_task)]
            + [heldout_left(rng) for _ in range(per_task)])
