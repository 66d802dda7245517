"""The judge of generated digits: scikit-learn's 1797 real digits, an independent classifier fitted on them (does a
sample show the digit it was asked for?) and the Inception batches of digit images; the real digits' features, which
FID compares samples against, are judges.digits_reference's. demo.py, bench.demo and the digits studies
(studies.repa_digits, studies.posthoc_digits, studies.solvers) score with them.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from judges.classifier import HeldOutClassifier, fit_held_out

INCEPTION_BATCH = 100  # images per Inception batch


def real_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 training digits as sample files store them: (N, 8, 8, 3) uint8 and (N,) int64 labels."""
    from generation.images import to_uint8
    from training.builtin_data import DigitsDataset

    dataset = DigitsDataset()
    return to_uint8(dataset.images), dataset.labels.numpy()


def classifier_features(images: np.ndarray) -> np.ndarray:
    """(N, 8, 8, 3) uint8 -> (N, 64) floats in [0, 1] (the three channels are equal: keep one)."""
    return images[..., 0].reshape(len(images), -1) / 255.0


def fit_classifier(images: np.ndarray, labels: np.ndarray, seed: int = 0) -> HeldOutClassifier:
    """An RBF support-vector classifier (scikit-learn's defaults) on the pixels of 75 % of the real digits."""
    from sklearn.svm import SVC

    return fit_held_out(SVC(), classifier_features, images, labels, seed)


def inception_batches(images: np.ndarray, name: str) -> Iterator[np.ndarray]:
    """uint8 images in Inception batches, with a progress bar (Inception is the slow part on a CPU)."""
    from tqdm import tqdm

    for start in tqdm(range(0, len(images), INCEPTION_BATCH), desc=f"Inception features of {name}", unit="batch"):
        yield images[start : start + INCEPTION_BATCH]
