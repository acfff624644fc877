"""Pictures of coloured shapes with questions about them, drawn at run time with Pillow (no download): the
built-in image data a debug vision-language model can learn on a CPU.

A sample is one image holding ``count`` copies (1-4) of one shape (circle, square, triangle, diamond) in one of
eight colours, on a grey background, at places that do not overlap, and one question about it:

    colour    "What colour are the shapes?"   -> "red"          chance 1/8
    shape     "What shape are they?"          -> "circle"       chance 1/4
    count     "How many shapes are there?"    -> "3"            chance 1/4
    position  "Where is the shape?"           -> "top left"     chance 1/4 (one shape, in one of four quadrants)
    caption   "Describe the picture."         -> "3 red circles"

Each kind's answers are balanced: the n-th question of a kind takes the (n mod options)-th answer; everything else
about the picture is drawn from a generator seeded by (seed, split, index), so a sample depends on nothing but
them and a held-out split never repeats a training picture. ``blank`` draws the background only, with the same
questions and answers: the control that shows a model answering from the pixels, not from the question.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from torchtitan.data.errors import DataError

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (240, 210, 40),
           "purple": (140, 60, 180), "orange": (245, 140, 30), "white": (250, 250, 250), "black": (15, 15, 15)}
SHAPES = ("circle", "square", "triangle", "diamond")
COUNTS = (1, 2, 3, 4)
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
KINDS = ("colour", "shape", "count", "position", "caption")
QUESTIONS = {"colour": "What colour are the shapes?", "shape": "What shape are they?",
             "count": "How many shapes are there?", "position": "Where is the shape?",
             "caption": "Describe the picture."}
OPTIONS = {"colour": tuple(COLOURS), "shape": SHAPES, "count": tuple(map(str, COUNTS)), "position": POSITIONS}
BACKGROUND = (128, 128, 128)
# The registered datasets of image conversations (data/sources.py registers them).
IMAGE_DATASETS = ("shapes", "shapes_blank")
# Samples per split of the registered datasets "shapes" and "shapes_blank" (drawn when read).
SPLITS = {"train": 20_000, "validation": 1_000}


@dataclass(frozen=True)
class ShapesSample:
    image: Image.Image
    kind: str
    question: str
    answer: str

    def messages(self) -> list[dict]:
        """The sample as a conversation whose user turn shows the image first (transformers' content-list form)."""
        return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": self.question}]},
                {"role": "assistant", "content": [{"type": "text", "text": self.answer}]}]


def _generator(seed: int, split: str, index: int) -> np.random.Generator:
    digest = hashlib.sha256(f"shapes/{seed}/{split}/{index}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _draw(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], colour: tuple[int, int, int]):
    x0, y0, x1, y1 = box
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=colour)
    else:
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=colour)


def shapes_sample(index: int, seed: int = 0, split: str = "train", size: int = 64,
                  blank: bool = False) -> ShapesSample:
    """The ``index``-th sample of ``split`` (see the module doc); ``size``: the picture's side in pixels."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {tuple(SPLITS)}")
    rng = _generator(seed, split, index)
    kind = KINDS[index % len(KINDS)]
    nth = index // len(KINDS)  # this question's rank among its kind's: it picks the balanced answer
    colour = tuple(COLOURS)[nth % len(COLOURS)] if kind == "colour" else tuple(COLOURS)[rng.integers(len(COLOURS))]
    shape = SHAPES[nth % len(SHAPES)] if kind == "shape" else SHAPES[rng.integers(len(SHAPES))]
    if kind == "position":
        count = 1
    else:
        count = COUNTS[nth % len(COUNTS)] if kind == "count" else COUNTS[rng.integers(len(COUNTS))]
    # Each shape sits in its own quadrant (so they never overlap), at a random size and offset within it.
    quadrants = ([nth % len(POSITIONS)] if kind == "position"
                 else sorted(rng.choice(len(POSITIONS), size=count, replace=False).tolist()))
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    half = size // 2
    for quadrant in quadrants:
        side = int(rng.integers(half * 5 // 10, half * 9 // 10))
        x = (quadrant % 2) * half + int(rng.integers(0, half - side + 1))
        y = (quadrant // 2) * half + int(rng.integers(0, half - side + 1))
        if not blank:
            _draw(draw, shape, (x, y, x + side - 1, y + side - 1), COLOURS[colour])
    answers = {"colour": colour, "shape": shape, "count": str(count), "position": POSITIONS[quadrants[0]],
               "caption": f"{count} {colour} {shape}{'s' if count > 1 else ''}"}
    return ShapesSample(image, kind, QUESTIONS[kind], answers[kind])


class ShapesChat:
    """The registered chat datasets ``shapes`` and ``shapes_blank`` (``blank``): a split's samples as image
    conversations {"messages", "images"}, drawn when read (data/image_chat.py reads the rows)."""

    def __init__(self, split: str = "train", blank: bool = False, seed: int = 0, size: int = 64):
        if split not in SPLITS:
            raise DataError(f"the shapes datasets have no {split!r} split; valid: {', '.join(SPLITS)}")
        self.split, self.blank, self.seed, self.size = split, blank, seed, size

    def __len__(self) -> int:
        return SPLITS[self.split]

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(index)
        sample = shapes_sample(index, self.seed, self.split, self.size, self.blank)
        return {"messages": sample.messages(), "images": [sample.image]}

    def __iter__(self):
        return (self[i] for i in range(len(self)))
