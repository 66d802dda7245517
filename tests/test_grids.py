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
from generation.images import (
    LABEL_EMS,
    MIN_TILE_PIXELS,
    MISSING_GLYPH,
    TITLE_PIXELS,
    class_grid_indices,
    font_file_for,
    font_files,
    grid_classes,
    save_class_grid,
)
from generation.sample_plan import assign_labels


def test_the_rows_are_every_class_of_a_few_and_spread_over_many():
    assert grid_classes(range(10), 100) == (list(range(10)), 10)  # the digits: every class, 10 of each
    assert grid_classes(range(1000), 64) == ([0, 125, 250, 375, 500, 625, 750, 875], 8)  # ImageNet: 8 x 8
    # Issue 48: log.sample_count=12 with 6 classes drew classes 0, 1, 3, 4 (the sqrt rule); every class now, as
    # many as 32 of them, whatever the count
    assert grid_classes(range(6), 12) == (list(range(6)), 2)
    assert grid_classes(range(10), 16) == (list(range(10)), 2)
    assert grid_classes(range(32), 4) == (list(range(32)), 1)
    assert grid_classes(range(33), 16) == ([0, 8, 16, 24], 4)  # more: about sqrt(count), spread
    assert grid_classes(range(100), 10_000) == (list(range(100)), 100)
    assert grid_classes([3, 7], 16) == ([3, 7], 8)  # fewer classes than rows: all of them, longer rows
    labels = assign_labels(64 * 1000, 1000, "balanced", 0)
    rows = class_grid_indices(labels, 64)
    assert [label for label, _ in rows] == [0, 125, 250, 375, 500, 625, 750, 875]
    assert all(np.array_equal(indices, label + 1000 * np.arange(8)) for label, indices in rows)  # its first 8
    uniform = assign_labels(500, 10, "uniform", 3)
    rows = class_grid_indices(uniform, 25)
    assert [label for label, _ in rows] == list(range(10))
    for label, indices in rows:
        assert (uniform[indices] == label).all() and len(indices) == 3
        assert np.array_equal(indices, np.flatnonzero(uniform == label)[:3])


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


def one_row_grid(path, name: str, title: str = "t") -> np.ndarray:
    save_class_grid([(0, np.full((1, 8, 8, 3), 200, np.uint8))], path, title, [name])
    return np.asarray(Image.open(path))


def test_names_in_other_scripts_are_drawn_with_glyphs_not_boxes(tmp_path):
    """Issue 47, item 14: Pillow's default font has no Cyrillic, Greek, Arabic or CJK glyphs and drew every such
    letter as the same box, so "кошка" and "собак" made the same picture. Now each character comes from the first
    installed font that has it; a character none has is drawn as "?" (its name is in the PNG's text in full)."""
    path = tmp_path / "g.png"
    assert not np.array_equal(one_row_grid(path, "кошка"), one_row_grid(path, "собак"))  # DejaVu Sans' Cyrillic
    assert not np.array_equal(one_row_grid(path, "γάτα"), one_row_grid(path, "σκύλ"))  # and Greek
    assert font_file_for("\U0001d400") != font_files()[0]  # DejaVu Sans lacks 𝐀: another installed font has it
    assert not np.array_equal(one_row_grid(path, "\U0001d400"), one_row_grid(path, MISSING_GLYPH))
    unassigned = "\u0378"  # no glyph in any font
    assert np.array_equal(one_row_grid(path, MISSING_GLYPH), one_row_grid(path, unassigned))
    with Image.open(path) as grid:
        assert grid.text["Rows"] == f"0 {unassigned}"
    # CJK where a font with it is installed (Noto CJK, WenQuanYi, ...), else "?" for each character
    if font_file_for("猫") is None:
        assert np.array_equal(one_row_grid(path, "猫狗"), one_row_grid(path, MISSING_GLYPH * 2))
    else:
        assert not np.array_equal(one_row_grid(path, "猫狗"), one_row_grid(path, "狗猫"))


def test_a_long_name_or_title_is_cut_and_kept_whole_in_the_pngs_text(tmp_path):
    """Issue 47, item 14: a 200-character class name made a label column 1.6 K pixels wide beside four 64-pixel
    tiles; issue 48: a long title (a full path) widened the picture as much. A label is cut to LABEL_EMS font sizes
    and the title to the grid's width (at least TITLE_PIXELS), each with an ellipsis; the PNG's text holds both in
    full."""
    name, title = "n01440764 " + "a very long class folder name " * 7, "results/" + "a-run-folder/" * 20 + "export"
    rows = [(0, np.full((4, 8, 8, 3), 200, np.uint8)), (1, np.full((4, 8, 8, 3), 100, np.uint8))]
    save_class_grid(rows, tmp_path / "g.png", title, [name, "short"])
    with Image.open(tmp_path / "g.png") as grid:
        width = grid.width
        assert grid.text["Title"] == title and grid.text["Rows"] == f"0 {name}\n1 short"
    font_size = 16  # tiles of 64 px (8 px enlarged 8 times): size max(12, min(32, 64 // 4))
    tiles = 4 * (MIN_TILE_PIXELS + 2) + 2
    assert width <= LABEL_EMS * font_size + tiles + 16  # the label cut: the tiles take a third of the width or more
    save_class_grid(rows, tmp_path / "short.png", "t", ["short", "short"])
    save_class_grid(rows, tmp_path / "untitled.png", title, ["short", "short"])
    with Image.open(tmp_path / "short.png") as short, Image.open(tmp_path / "untitled.png") as long_title:
        assert long_title.width <= max(short.width, TITLE_PIXELS + 4)  # the title widened it up to TITLE_PIXELS
        pixels = np.asarray(long_title.convert("L"))
        assert (pixels[:20, -12:] < 128).any()  # the title fills the width: its ellipsis at the right edge


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
    rows = class_grid_indices(labels, 4)  # every class (4), 1 sample each
    assert [label for label, _ in rows] == [0, 1, 2, 3]
    expected = tmp_path / "expected.png"
    title = f"{tmp_path.name}/export: guidance 2, ddpm, 2 steps"  # not the whole path
    save_class_grid([(label, images[indices]) for label, indices in rows], expected, title, names)
    assert np.array_equal(np.asarray(Image.open(out.with_suffix(".png"))), np.asarray(Image.open(expected)))
    with Image.open(out.with_suffix(".png")) as grid:  # the settings in full, in the PNG's text
        settings = json.loads(grid.text["Settings"])
        assert grid.text["Title"] == title and grid.text["Rows"] == "\n".join(f"{k} folder-{k}" for k in range(4))
    assert settings == json.loads(json.dumps(sample.run_settings(sample.parse_args([*arguments, "--cfg-scale", "2"]))))
    assert (settings["ckpt"], settings["guidance"], settings["steps"]) == (str(export), 2.0, 2)
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
        settings = {"ckpt": title, **{f"setting_{k}": k / 7 for k in range(40)}}  # sample.py's run settings, about
        save_class_grid(
            [(label, tiles[indices]) for label, indices in rows], tmp_path / "grid.png", title, names, settings
        )
        assert (tmp_path / "grid.png").stat().st_size <= grid_bytes(count, side), (count, side)


def test_a_title_names_a_checkpoint_by_its_run_and_step_not_its_path(tmp_path):
    from generation.run_layout import short_name

    checkpoint = tmp_path / "digits" / "checkpoints" / "step-0000400"
    milestone = tmp_path / "digits" / "exports" / "step-0001000"
    for folder in (checkpoint / "export", milestone, tmp_path / "lightning-xl1" / "export"):
        folder.mkdir(parents=True)
    assert short_name(checkpoint / "export") == short_name(checkpoint) == "digits step-0000400"
    assert short_name(milestone) == "digits step-0001000"
    assert short_name(tmp_path / "lightning-xl1" / "export") == "lightning-xl1/export"
    assert short_name(tmp_path / "digits") == "digits"  # a run folder
    assert short_name("owner/some-export") == "owner/some-export"  # a hub id, as given
    assert short_name("DiT-XL-2-256x256.pt") == "DiT-XL-2-256x256.pt"  # a released checkpoint's name
