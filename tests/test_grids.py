"""Grids people look at (issue 39): one labelled row per class, with the class name where the export has one, and
what made the images in the title; the rows sample.py and the demo choose."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from PIL import Image

import sample
from _tiny_models import EXPORT_CLASSES, tiny_export
from generation.export import EXPORT_CONFIG, ExportDescription
from generation.images import MIN_TILE_PIXELS, class_grid_indices, grid_classes, save_class_grid
from generation.sample_plan import assign_labels


def test_the_rows_are_classes_spread_over_those_present():
    assert grid_classes(range(10), 100) == (list(range(10)), 10)  # the digits: every class, 10 of each
    assert grid_classes(range(1000), 64) == ([0, 125, 250, 375, 500, 625, 750, 875], 8)  # ImageNet: 8 x 8
    assert grid_classes(range(10), 16) == ([0, 2, 5, 7], 4)
    assert grid_classes([3, 7], 16) == ([3, 7], 8)  # fewer classes than rows: all of them, longer rows
    labels = assign_labels(64 * 1000, 1000, "balanced", 0)
    rows = class_grid_indices(labels, 64)
    assert [label for label, _ in rows] == [0, 125, 250, 375, 500, 625, 750, 875]
    assert all(np.array_equal(indices, label + 1000 * np.arange(8)) for label, indices in rows)  # its first 8
    uniform = assign_labels(500, 10, "uniform", 3)
    for label, indices in class_grid_indices(uniform, 25):
        assert (uniform[indices] == label).all() and len(indices) == 5
        assert np.array_equal(indices, np.flatnonzero(uniform == label)[:5])


def row_colour_grid(rows: int, columns: int) -> list[tuple[int, np.ndarray]]:
    """rows x columns 8x8 tiles; tile (r, c) a flat colour that encodes (r, c)."""
    return [
        (
            label,
            np.stack([np.full((8, 8, 3), (10 + 20 * r, 10 + 20 * c, 200), np.uint8) for c in range(columns)]),
        )
        for r, label in enumerate(range(3, 3 + rows))
    ]


def test_a_grid_has_a_title_and_a_labelled_row_per_class(tmp_path):
    rows = row_colour_grid(3, 4)
    save_class_grid(rows, tmp_path / "a.png", "guidance 2")
    pixels = np.asarray(Image.open(tmp_path / "a.png").convert("RGB"))
    factor = MIN_TILE_PIXELS // 8
    for r in range(3):
        for c in range(4):
            found = np.argwhere((pixels == (10 + 20 * r, 10 + 20 * c, 200)).all(-1))
            assert len(found) == (8 * factor) ** 2, (r, c)  # the whole enlarged tile, nowhere else
            (top, left), (bottom, right) = found.min(0), found.max(0)
            assert (bottom - top + 1, right - left + 1) == (8 * factor, 8 * factor)
            if c == 0:  # the label column left of the row's first tile holds dark text: the row's class
                label = pixels[top : bottom + 1, :left]
                assert (label < 100).all(-1).any(), r
                if r == 0:
                    first_label, first_top = label, top
    title = pixels[:first_top]
    assert (title < 100).all(-1).any()
    # another title, other labels: other pixels there, the same tiles
    save_class_grid(rows, tmp_path / "b.png", "guidance 1.5", class_names=[f"class-{i}" for i in range(10)])
    other = np.asarray(Image.open(tmp_path / "b.png").convert("RGB"))
    assert not np.array_equal(other[:first_top, : title.shape[1]], title)
    assert other.shape[1] > pixels.shape[1]  # "3 class-3" is wider than "3"
    assert not np.array_equal(other[first_top : first_top + first_label.shape[0], : first_label.shape[1]], first_label)


@pytest.mark.slow
def test_sample_py_draws_a_row_per_class_with_the_exports_class_names(tmp_path):
    """The grid of a sample.py run is the class grid of its own samples (the first --grid-size x classes of them)
    with the export's class names and the guidance in the title."""
    export = tiny_export(tmp_path / "export")
    described = ExportDescription.from_json(json.loads((export / EXPORT_CONFIG).read_text()))
    names = [f"folder-{k}" for k in range(EXPORT_CLASSES)]
    (export / EXPORT_CONFIG).write_text(json.dumps(dataclasses.replace(described, class_names=names).to_json()))
    out = tmp_path / "s.npz"
    arguments = ["--ckpt", str(export), "--out", str(out), "--num-samples", "12", "--steps", "2", "--grid-size", "4"]
    sample.main([*arguments, "--cfg-scale", "2"])
    with np.load(out) as data:
        images, labels = data["arr_0"], data["arr_1"]
    rows = class_grid_indices(labels, 4)  # 2 classes (0 and 2), 2 samples each
    assert [label for label, _ in rows] == [0, 2]
    expected = tmp_path / "expected.png"
    title = f"{export}: guidance 2, ddpm, 2 steps"
    save_class_grid([(label, images[indices]) for label, indices in rows], expected, title, names)
    assert np.array_equal(np.asarray(Image.open(out.with_suffix(".png"))), np.asarray(Image.open(expected)))
    save_class_grid([(label, images[indices]) for label, indices in rows], expected, title)  # without names
    assert not np.array_equal(np.asarray(Image.open(out.with_suffix(".png"))), np.asarray(Image.open(expected)))


def test_the_grid_estimate_is_above_the_grid_written(tmp_path):
    from generation.images import class_grid_indices, grid_bytes, save_class_grid

    rng = np.random.default_rng(0)
    names = [f"n{index:08d}_{'a long class folder name' * 2}" for index in range(1000)]  # long labels, as ImageNet's
    title = "results/a-run-folder/checkpoints/step-0400000/export: guidance 4, ddim, 250 steps " * 2  # a long title
    for count, side, classes in ((1, 8, 10), (3, 8, 10), (64, 8, 10), (9, 16, 1000), (16, 32, 1000), (4, 64, 3)):
        labels = np.arange(count * classes) % classes
        rows = class_grid_indices(labels, count)
        tiles = rng.integers(0, 256, (len(labels), side, side, 3), dtype=np.uint8)  # noise: compresses least
        save_class_grid([(label, tiles[indices]) for label, indices in rows], tmp_path / "grid.png", title, names)
        assert (tmp_path / "grid.png").stat().st_size <= grid_bytes(count, side), (count, side)
