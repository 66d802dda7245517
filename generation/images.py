"""Turning model outputs into pictures: uint8 conversion (DiT's rounding) and labelled PNG grids.

A grid shows one row per class, labelled with the class index (and the class name where the data had names: the
sub-folders of an image folder), under a short title that says what made the images (the guidance scale among
them). `grid_classes` chooses the rows: every class when there are at most EVERY_CLASS_UP_TO of them (or fewer
than about sqrt(count)), else about sqrt(count) classes spread evenly; each row up to count / rows samples of its
class. Text is drawn with DejaVu Sans (matplotlib ships it: Latin, Greek, Cyrillic, Arabic, Hebrew, ...), each
character it lacks with the first installed font that has it (CJK where such a font is installed), and "?" where
none has; a label is cut to LABEL_EMS font sizes and the title to the grid's width (or TITLE_PIXELS), with "…".
What the picture cannot hold goes into the PNG's text (iTXt, UTF-8): the whole title, every row's label and the
settings that made the images (`Title`, `Rows`, `Settings`; `PIL.Image.open(path).text`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from PIL.PngImagePlugin import PngInfo

from atomic_files import atomic_output

MIN_TILE_PIXELS = 64  # tiles smaller than this (8x8 digits) are enlarged with nearest-neighbour
PADDING = 2  # white pixels between tiles
TEXT_BYTES = 32 * 1024  # a grid's labels and title, drawn and in the PNG's text, compressed: see grid_bytes
EVERY_CLASS_UP_TO = 32  # data with at most this many classes gets a row for every class, whatever the count
LABEL_EMS = 16  # a row's label is cut to this many font sizes (a 200-character name would squeeze the tiles)
TITLE_PIXELS = 480  # a title widens a grid narrower than this up to it, and is cut to the picture's width
ELLIPSIS = "\N{HORIZONTAL ELLIPSIS}"
MISSING_GLYPH = "?"  # drawn for a character that no installed font has


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, C, H, W) in [-1, 1] -> (B, H, W, 3) uint8 as clamp(127.5 x + 128) truncated (DiT's convention);
    one-channel images are repeated to three channels."""
    if not torch.isfinite(images).all():
        raise FloatingPointError("images contain NaN or infinite values")
    if images.shape[1] not in (1, 3):
        raise ValueError(f"expected images with 1 or 3 channels, got shape {tuple(images.shape)}")
    images = images.expand(-1, 3, -1, -1)  # (B, 3, H, W)
    pixels = torch.clamp(127.5 * images.float() + 128.0, 0, 255).to(torch.uint8)  # truncation
    return pixels.permute(0, 2, 3, 1).cpu().numpy()  # (B, H, W, 3)


def _enlargement(side: int) -> int:
    """How many times a grid enlarges a tile of `side` pixels."""
    return max(1, math.ceil(MIN_TILE_PIXELS / side))


def grid_bytes(count: int, side: int) -> int:
    """The most bytes `save_class_grid` is expected to write for a grid of about `count` images of side x side
    pixels, for a disk space estimate. Its rows hold up to count + sqrt(count) images (`grid_classes` rounds each row
    up). Measured on noise (the least compressible content): the PNG takes 2.6x the tiles' own bytes for 8 px tiles
    (enlarged 8x: the copies compress to little but not nothing), 1.6x at 16 px (4x), 1.3x at 32 px (2x) and 1.02x at
    64 and 256 px (not enlarged), so 1 + enlargement / 4 times the tiles' bytes is above each; the white margins,
    the labels and the title (black text on white, cut to LABEL_EMS and TITLE_PIXELS) and the PNG's text (compressed)
    add TEXT_BYTES at most, and the headers 1 KiB."""
    if not count:
        return 0
    tiles = count + max(math.ceil(math.sqrt(count)), EVERY_CLASS_UP_TO)  # each row rounded up (grid_classes)
    return int(tiles * side * side * 3 * (1 + _enlargement(side) / 4)) + TEXT_BYTES + 1024


def grid_classes(classes: Sequence[int], count: int) -> tuple[list[int], int]:
    """(the classes shown, one row each; samples per row) for a grid of about `count` samples drawn from
    `classes` (sorted, distinct): all of them when they are at most max(EVERY_CLASS_UP_TO, ceil(sqrt(count))), else
    ceil(sqrt(count)) of them, spread evenly; ceil(count / rows) per row."""
    square = math.ceil(math.sqrt(count))
    rows = len(classes) if len(classes) <= max(EVERY_CLASS_UP_TO, square) else square
    chosen = [classes[int(position)] for position in np.linspace(0, len(classes), rows, endpoint=False)]
    return chosen, math.ceil(count / rows)


def class_grid_indices(labels: np.ndarray, count: int) -> list[tuple[int, np.ndarray]]:
    """(class, sample indices) of each row of a grid of about `count` of the samples labelled `labels` (N,):
    `grid_classes` of the classes present, each row its class's first samples in index order."""
    present = np.unique(labels).tolist()
    chosen, columns = grid_classes(present, count)
    return [(label, np.flatnonzero(labels == label)[:columns]) for label in chosen]


def class_label(label: int, class_names: Sequence[str] | None) -> str:
    return f"{label} {class_names[label]}" if class_names is not None else str(label)


@cache
def font_files() -> tuple[str, ...]:
    """The font files text is drawn with, in the order tried for each character: DejaVu Sans, matplotlib's other
    Unicode fonts (DejaVu, STIX), then the system's (matplotlib's font_manager.findSystemFonts: TrueType, OpenType
    and collections). Not "last resort" fonts, whose glyph for every character is a box: the boxes to avoid."""
    import matplotlib
    from matplotlib import font_manager

    bundled = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    first = bundled / "DejaVuSans.ttf"
    others = sorted(str(path) for path in bundled.glob("*.ttf") if path.name.startswith(("DejaVu", "STIX")))
    system = sorted(path for path in font_manager.findSystemFonts() if "lastresort" not in path.lower())
    return (str(first), *[path for path in others if path != str(first)], *system)


@cache
def _characters(path: str) -> frozenset[int]:
    """The code points a font file has glyphs for (none when it cannot be read)."""
    from matplotlib import ft2font

    try:
        return frozenset(ft2font.FT2Font(path).get_charmap())
    except (OSError, RuntimeError, ValueError):
        return frozenset()


@cache
def font_file_for(character: str) -> str | None:
    """The first of `font_files` with a glyph for `character`, or None."""
    return next((path for path in font_files() if ord(character) in _characters(path)), None)


@cache
def _font(path: str, size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(path, size)


class Text:
    """A line of text at one font size, as runs of characters each drawn with the first font that has them;
    characters no installed font has become MISSING_GLYPH."""

    def __init__(self, text: str, size: int) -> None:
        self.text, self.size = text, size
        self.runs: list[tuple[ImageFont.FreeTypeFont, str]] = []
        for character in text:
            path = font_file_for(character)
            if path is None:
                character, path = MISSING_GLYPH, font_files()[0]
            font = _font(path, size)
            if self.runs and self.runs[-1][0] is font:
                self.runs[-1] = (font, self.runs[-1][1] + character)
            else:
                self.runs.append((font, character))

    @property
    def width(self) -> int:
        return math.ceil(sum(font.getlength(run) for font, run in self.runs))

    def cut(self, width: int) -> Text:
        """This text, or its longest beginning that fits `width` pixels with an ellipsis after it."""
        if self.width <= width:
            return self
        low, high = 0, len(self.text)  # the longest beginning that fits lies in [low, high)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (
                (middle, high) if Text(self.text[:middle] + ELLIPSIS, self.size).width <= width else (low, middle)
            )
        return Text(self.text[:low].rstrip() + ELLIPSIS, self.size)

    def draw(self, draw: ImageDraw.ImageDraw, left: int, baseline: int) -> None:
        for font, run in self.runs:
            draw.text((left, baseline), run, fill="black", font=font, anchor="ls")
            left += font.getlength(run)


def save_class_grid(
    rows: Sequence[tuple[int, np.ndarray]],
    path: str | Path,
    title: str,
    class_names: Sequence[str] | None = None,
    settings: dict[str, Any] | None = None,
) -> None:
    """Write a PNG grid, atomically: one row per (class, (n, H, W, 3) uint8 images), labelled at its left with
    the class (`class_label`, cut to LABEL_EMS font sizes), under `title` (cut to the picture's width); the whole
    title, every label and `settings` (what made the images) in the PNG's text."""
    side = rows[0][1].shape[1]
    factor = _enlargement(side)
    tile = side * factor
    size = max(12, min(32, tile // 4))
    ascent, descent = _font(font_files()[0], size).getmetrics()
    labels = [class_label(label, class_names) for label, _ in rows]
    texts = [Text(text, size).cut(LABEL_EMS * size) for text in labels]
    label_width = max(text.width for text in texts) + 4 * PADDING
    title_height = ascent + descent + 4 * PADDING
    columns = max(len(images) for _, images in rows)
    grid_width = label_width + columns * (tile + PADDING) + PADDING
    heading = Text(title, size)
    width = max(grid_width, min(heading.width, TITLE_PIXELS))
    height = title_height + len(rows) * (tile + PADDING) + PADDING
    canvas = Image.new("RGB", (width + 2 * PADDING, height), "white")
    draw = ImageDraw.Draw(canvas)
    heading.cut(width).draw(draw, 2 * PADDING, 2 * PADDING + ascent)
    for row, ((_, images), text) in enumerate(zip(rows, texts)):
        top = title_height + row * (tile + PADDING) + PADDING
        text.draw(draw, 2 * PADDING, top + (tile + ascent - descent) // 2)
        for column, image in enumerate(images):
            enlarged = image.repeat(factor, axis=0).repeat(factor, axis=1)  # (tile, tile, 3)
            canvas.paste(Image.fromarray(enlarged), (label_width + column * (tile + PADDING) + PADDING, top))
    text = PngInfo()
    text.add_itxt("Title", title, zip=True)
    text.add_itxt("Rows", "\n".join(labels), zip=True)
    if settings is not None:
        text.add_itxt("Settings", json.dumps(settings, default=str), zip=True)
    with atomic_output(Path(path)) as temporary:
        canvas.save(temporary, format="PNG", pnginfo=text)
