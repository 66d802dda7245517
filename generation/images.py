"""Turning model outputs into pictures: uint8 conversion (DiT's rounding) and labelled PNG grids.

A grid shows one row per class, labelled with the class index (and the class name where the data had names: the
sub-folders of an image folder), under a title that says what made the images (the guidance scale among them).
`grid_classes` chooses the rows: about sqrt(count) classes spread evenly over those at hand, all of them when there
are few (the digits' 10), each row up to count / rows samples of its class.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from atomic_files import atomic_output

MIN_TILE_PIXELS = 64  # tiles smaller than this (8x8 digits) are enlarged with nearest-neighbour
PADDING = 2  # white pixels between tiles
TEXT_BYTES = 32 * 1024  # a grid's labels and title, compressed: see grid_bytes


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
    the labels and the title (black text on white) add TEXT_BYTES at most, and the headers 1 KiB."""
    if not count:
        return 0
    tiles = count + math.ceil(math.sqrt(count))
    return int(tiles * side * side * 3 * (1 + _enlargement(side) / 4)) + TEXT_BYTES + 1024


def grid_classes(classes: Sequence[int], count: int) -> tuple[list[int], int]:
    """(the classes shown, one row each; samples per row) for a grid of about `count` samples drawn from
    `classes` (sorted, distinct): min(len(classes), ceil(sqrt(count))) of them, spread evenly, and ceil(count /
    rows) per row."""
    rows = min(len(classes), math.ceil(math.sqrt(count)))
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


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size)  # Pillow >= 10.1 with FreeType: a scalable font
    except TypeError:  # an older Pillow: its fixed bitmap font
        return ImageFont.load_default()


def save_class_grid(
    rows: Sequence[tuple[int, np.ndarray]], path: str | Path, title: str, class_names: Sequence[str] | None = None
) -> None:
    """Write a PNG grid, atomically: one row per (class, (n, H, W, 3) uint8 images), labelled at its left with
    the class (`class_label`), under `title`."""
    side = rows[0][1].shape[1]
    factor = _enlargement(side)
    tile = side * factor
    font = _font(max(12, min(32, tile // 4)))
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    labels = [class_label(label, class_names) for label, _ in rows]
    label_width = max(measure.textbbox((0, 0), text, font=font)[2] for text in labels) + 4 * PADDING
    title_height = measure.textbbox((0, 0), title, font=font)[3] + 4 * PADDING
    columns = max(len(images) for _, images in rows)
    width = max(label_width + columns * (tile + PADDING) + PADDING, measure.textbbox((0, 0), title, font=font)[2])
    height = title_height + len(rows) * (tile + PADDING) + PADDING
    canvas = Image.new("RGB", (width + 2 * PADDING, height), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((2 * PADDING, 2 * PADDING), title, fill="black", font=font)
    for row, ((_, images), text) in enumerate(zip(rows, labels)):
        top = title_height + row * (tile + PADDING) + PADDING
        _, text_top, _, text_bottom = draw.textbbox((0, 0), text, font=font)
        draw.text((2 * PADDING, top + (tile - text_top - text_bottom) // 2), text, fill="black", font=font)
        for column, image in enumerate(images):
            enlarged = image.repeat(factor, axis=0).repeat(factor, axis=1)  # (tile, tile, 3)
            canvas.paste(Image.fromarray(enlarged), (label_width + column * (tile + PADDING) + PADDING, top))
    with atomic_output(Path(path)) as temporary:
        canvas.save(temporary, format="PNG")
