"""The built-in data sets, small enough to train on a CPU: scikit-learn's 1797 handwritten digits (8x8, bundled
with scikit-learn: no download) and the coloured shapes (16x16, drawn from a fixed seed). `data.source=digits`
and `data.source=shapes` train on them (training.data.build_dataset); the demo and the studies judge samples
against them (judges/).
"""

from __future__ import annotations

import numpy as np
import torch

from training.example_seeds import EpochSeeded, Example

DIGITS_SIZE = 8  # scikit-learn's digits are 8 x 8 ...
DIGITS_CLASSES = 10
DIGITS_MAX_VALUE = 16.0  # ... with integer intensities 0..16
SHAPES_SIZE = 16  # the coloured shapes are 16 x 16 RGB: 64 tokens at patch 2
SHAPE_KINDS = ("square", "disc", "triangle", "cross")
SHAPE_COLOURS = {"red": (1.0, 0.15, 0.1), "green": (0.1, 0.9, 0.2), "blue": (0.2, 0.35, 1.0)}
SHAPES_CLASSES = len(SHAPE_KINDS) * len(SHAPE_COLOURS)  # class = kind index * 3 + colour index
SHAPES_PER_CLASS = 200
SHAPES_SEED = 0  # the dataset is one fixed draw, whatever the training seed


# --------------------------------------------------------------------------------------------------
#                                             Digits
# --------------------------------------------------------------------------------------------------


class InMemoryImages(EpochSeeded):
    """A built-in pixel-space dataset held as one tensor: images (N, C, S, S) in [-1, 1] and labels (N,)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, random_flip: bool, seed: int) -> None:
        super().__init__(seed)
        self.images = images
        self.labels = labels
        self.random_flip = random_flip

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Example:
        x = self.images[index]
        if self.random_flip and torch.randint(2, (), generator=self.generator(index)):
            x = x.flip(-1)
        return x, int(self.labels[index])


class DigitsDataset(InMemoryImages):
    """scikit-learn's 1797 handwritten digits: (1, 8, 8) in [-1, 1], labels 0..9, bundled (no download)."""

    def __init__(self, random_flip: bool = False, seed: int = 0) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.from_numpy(digits.images).float() / DIGITS_MAX_VALUE * 2 - 1  # (1797, 8, 8)
        super().__init__(images.unsqueeze(1), torch.from_numpy(digits.target).long(), random_flip, seed)


# --------------------------------------------------------------------------------------------------
#                                         Coloured shapes
# --------------------------------------------------------------------------------------------------

SUPERSAMPLING = 4  # coverage of each pixel from 4 x 4 points: anti-aliased edges, so size and position vary smoothly


def shape_coverage(kind: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Whether points (u, v), in units of the shape's half-size around its centre (v grows downwards), are
    inside a shape of `kind`; each kind fills the square [-1, 1]^2 that bounds it in its own way."""
    if kind == "square":
        return np.maximum(np.abs(u), np.abs(v)) <= 0.85
    if kind == "disc":
        return u**2 + v**2 <= 1.0
    if kind == "triangle":  # apex up, base at the bottom
        return (v <= 1.0) & (np.abs(u) <= (v + 1.0) / 2.0)
    if kind == "cross":  # a plus sign with bars 0.7 wide
        return ((np.abs(u) <= 0.35) & (np.abs(v) <= 1.0)) | ((np.abs(v) <= 0.35) & (np.abs(u) <= 1.0))
    raise ValueError(f"shape kind {kind!r}: expected one of {SHAPE_KINDS}")


def render_shapes(per_class: int = SHAPES_PER_CLASS, seed: int = SHAPES_SEED) -> tuple[np.ndarray, np.ndarray]:
    """The coloured-shapes dataset: images (N, 3, 16, 16) float32 in [0, 1] and labels (N,) int64, N = 12 x
    per_class, label i % 12 for image i.

    Each image is one shape (square, disc, triangle, cross) in one colour (red, green, blue) on a dark grey
    background; half-size (3 to 7 px), centre (anywhere the shape fits), background level and colour brightness
    are drawn from `seed` (numpy PCG64), so the same arguments give the same pixels on every machine.
    """
    rng = np.random.default_rng(seed)
    count = SHAPES_CLASSES * per_class
    labels = np.arange(count, dtype=np.int64) % SHAPES_CLASSES
    half = rng.uniform(3.0, 7.0, count)  # (N,)
    centre = rng.uniform(half[:, None], SHAPES_SIZE - half[:, None], (count, 2))  # (N, 2): x, y
    background = rng.uniform(0.0, 0.2, count)  # (N,)
    brightness = rng.uniform(0.75, 1.0, count)  # (N,)
    points = (np.arange(SHAPES_SIZE * SUPERSAMPLING) + 0.5) / SUPERSAMPLING  # (S*k,) pixel units
    u = (points[None, None, :] - centre[:, 0, None, None]) / half[:, None, None]  # (N, 1, S*k)
    v = (points[None, :, None] - centre[:, 1, None, None]) / half[:, None, None]  # (N, S*k, 1)
    inside = np.zeros((count, SHAPES_SIZE * SUPERSAMPLING, SHAPES_SIZE * SUPERSAMPLING), dtype=bool)
    colours = np.array(list(SHAPE_COLOURS.values()))  # (3 colours, RGB)
    for index, kind in enumerate(SHAPE_KINDS):
        rows = labels // len(SHAPE_COLOURS) == index
        inside[rows] = shape_coverage(kind, u[rows], v[rows])
    coverage = inside.reshape(count, SHAPES_SIZE, SUPERSAMPLING, SHAPES_SIZE, SUPERSAMPLING).mean(axis=(2, 4))
    colour = colours[labels % len(SHAPE_COLOURS)] * brightness[:, None]  # (N, 3)
    images = (
        background[:, None, None, None] * (1 - coverage[:, None]) + colour[:, :, None, None] * coverage[:, None]
    )  # (N, 3, S, S)
    return images.astype(np.float32), labels


class ShapesDataset(InMemoryImages):
    """Built-in coloured shapes (`render_shapes`): (3, 16, 16) in [-1, 1], 12 classes = 4 shapes x 3 colours."""

    def __init__(self, random_flip: bool = False, seed: int = 0) -> None:
        images, labels = render_shapes()
        super().__init__(torch.from_numpy(images) * 2 - 1, torch.from_numpy(labels), random_flip, seed)
