"""The built-in shapes pictures (data/shapes.py): answers balanced per kind, pictures that show the answer, a blank
control that shows nothing, and samples that depend on (seed, split, index) only."""

import collections

import numpy as np
import pytest

from torchtitan.data.shapes import BACKGROUND, COLOURS, KINDS, OPTIONS, POSITIONS, shapes_sample


def _quadrants_drawn(pixels: np.ndarray) -> list[int]:
    half = pixels.shape[0] // 2
    drawn = (pixels != np.array(BACKGROUND)).any(-1)
    return [q for q in range(4) if drawn[(q // 2) * half:(q // 2 + 1) * half, (q % 2) * half:(q % 2 + 1) * half].any()]


def test_each_kinds_answers_are_balanced():
    samples = [shapes_sample(i, seed=3) for i in range(len(KINDS) * 8 * 5)]
    for kind, options in OPTIONS.items():
        counts = collections.Counter(s.answer for s in samples if s.kind == kind)
        assert set(counts) == set(options) and max(counts.values()) - min(counts.values()) <= 1, kind


def test_the_picture_shows_the_answer():
    for i in range(100):
        sample = shapes_sample(i, seed=1)
        pixels = np.asarray(sample.image)
        colours = {tuple(c) for c in pixels.reshape(-1, 3)} - {BACKGROUND}
        drawn = _quadrants_drawn(pixels)
        if sample.kind == "colour":
            assert colours == {COLOURS[sample.answer]}
        if sample.kind == "count":
            assert len(drawn) == int(sample.answer)
        if sample.kind == "position":
            assert drawn == [POSITIONS.index(sample.answer)]
        if sample.kind == "caption":
            count, colour = sample.answer.split()[:2]
            assert len(drawn) == int(count) and colours == {COLOURS[colour]}


def test_blank_pictures_hold_only_the_background_and_keep_the_questions():
    for i in range(10):
        blank, drawn = shapes_sample(i, blank=True), shapes_sample(i)
        assert (np.asarray(blank.image) == np.array(BACKGROUND)).all()
        assert (blank.question, blank.answer) == (drawn.question, drawn.answer)


def test_a_sample_depends_on_seed_split_and_index_only():
    a, b = shapes_sample(17, seed=2), shapes_sample(17, seed=2)
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image)) and a.answer == b.answer
    others = [shapes_sample(17, seed=3), shapes_sample(17, seed=2, split="validation")]
    assert all(not np.array_equal(np.asarray(a.image), np.asarray(o.image)) for o in others)
    with pytest.raises(ValueError, match="split 'test' is not one of"):
        shapes_sample(0, split="test")
