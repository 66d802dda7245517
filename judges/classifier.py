"""What every judge's classifier shares: a scikit-learn classifier on features of uint8 images, fitted on a
stratified 75 % of the real images and measured on the other 25 %. That held-out accuracy is the ceiling of what
the judge can read from samples: a model whose samples it reads as well as real images has learnt each class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

HELD_OUT_FRACTION = 0.25  # of the real images, kept from the classifier to measure its own accuracy


@dataclass
class HeldOutClassifier:
    """A fitted classifier, the features it reads and how well it reads held-out real images."""

    model: Any  # a fitted scikit-learn classifier
    features: Callable[[np.ndarray], np.ndarray]  # uint8 images (N, S, S, 3) -> (N, D)
    held_out_accuracy: float
    train_size: int
    test_size: int

    def accuracy(self, images: np.ndarray, labels: np.ndarray) -> float:
        """Fraction of uint8 images (N, S, S, 3) classified as their `labels` (N,)."""
        return float(np.mean(self.model.predict(self.features(images)) == labels))


def fit_held_out(
    model: Any, features: Callable[[np.ndarray], np.ndarray], images: np.ndarray, labels: np.ndarray, seed: int
) -> HeldOutClassifier:
    """Fit `model` on the `features` of a stratified 75 % of the real images (N, S, S, 3) uint8 and score it on the
    other 25 % (the split drawn from `seed`)."""
    from sklearn.model_selection import train_test_split

    train_x, test_x, train_y, test_y = train_test_split(
        features(images), labels, test_size=HELD_OUT_FRACTION, stratify=labels, random_state=seed
    )
    model.fit(train_x, train_y)
    return HeldOutClassifier(model, features, float(model.score(test_x, test_y)), len(train_y), len(test_y))
