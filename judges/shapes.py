"""The judge of generated shapes: does a sample show the shape and colour of the class it was asked for? The real
coloured shapes (training.builtin_data) and an independent classifier fitted on them; studies.quality scores with it.

Pixels alone do not suffice (an RBF SVC on raw pixels reads the real shapes at ~69 %, because a shape may sit
anywhere), so each image is first centred: the background (the median of its border pixels) is subtracted and
the image is shifted so that the centre of mass of what remains sits at the image centre. A logistic regression
on those centred pixels reads held-out real shapes at 100 % (tests/test_shapes.py asserts >= 95 %).
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage
from sklearn.linear_model import LogisticRegression

from judges.classifier import HeldOutClassifier, fit_held_out

MAX_ITERATIONS = 3000  # lbfgs converges well within this on 1800 images of 768 values


def real_shapes() -> tuple[np.ndarray, np.ndarray]:
    """The 2400 real shapes as sample files store them: (N, 16, 16, 3) uint8 and (N,) int64 labels."""
    from generation.images import to_uint8
    from training.builtin_data import ShapesDataset

    dataset = ShapesDataset()
    return to_uint8(dataset.images), dataset.labels.numpy()


def centred_pixels(images: np.ndarray) -> np.ndarray:
    """(N, S, S, 3) uint8 -> (N, 3 S S) floats: background-subtracted pixels with the foreground's centre of mass
    moved to the image centre (bilinear shift, zero outside). An image without foreground is not shifted."""
    x = images.astype(np.float64).transpose(0, 3, 1, 2) / 255.0  # (N, 3, S, S)
    side = x.shape[-1]
    border = np.concatenate([x[:, :, 0], x[:, :, -1], x[:, :, :, 0], x[:, :, :, -1]], axis=2)  # (N, 3, 4S)
    foreground = x - np.median(border, axis=2)[:, :, None, None]  # (N, 3, S, S)
    weight = np.abs(foreground).sum(axis=1)  # (N, S, S)
    total = weight.sum(axis=(1, 2))  # (N,)
    coordinate = np.arange(side, dtype=np.float64)
    centre = (side - 1) / 2
    safe_total = np.where(total > 0, total, 1.0)
    row = np.where(total > 0, (weight.sum(axis=2) * coordinate).sum(axis=1) / safe_total, centre)  # (N,)
    col = np.where(total > 0, (weight.sum(axis=1) * coordinate).sum(axis=1) / safe_total, centre)  # (N,)
    centred = np.stack(
        [
            ndimage.shift(image, (0.0, centre - r, centre - c), order=1, mode="constant")
            for image, r, c in zip(foreground, row, col)
        ]
    )  # (N, 3, S, S)
    return centred.reshape(len(images), -1)


def fit_shape_classifier(images: np.ndarray, labels: np.ndarray, seed: int = 0) -> HeldOutClassifier:
    """A logistic regression on the `centred_pixels` of 75 % of the real shapes."""
    return fit_held_out(LogisticRegression(max_iter=MAX_ITERATIONS), centred_pixels, images, labels, seed)
