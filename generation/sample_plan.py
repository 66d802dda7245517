"""Which class and which noise each sample index gets: the same on every process, for any batch split."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

LABEL_MODES = ("balanced", "uniform")


class SampleLabels:
    """Class label of every sample index, computed for the indices asked for: `labels[a:b]` is (b - a,) int64.

    "balanced" gives sample i the label i % num_classes, so every prefix of a multiple of num_classes samples is
    exactly class-balanced, and costs nothing until used (sample.py --num-samples 10**9 plans no 8 GB array);
    "uniform" draws the labels i.i.d. from `seed` (what ADM/DiT evaluations did), all N at the first use, since
    a part of the draw is not reproducible without the rest.
    """

    def __init__(self, num_samples: int, num_classes: int, mode: str, seed: int) -> None:
        if mode not in LABEL_MODES:
            raise ValueError(f"label mode {mode!r}: expected one of {LABEL_MODES}")
        self.num_samples, self.num_classes, self.mode, self.seed = num_samples, num_classes, mode, seed
        self._drawn: np.ndarray | None = None

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, part: slice) -> np.ndarray:
        if self.mode == "balanced":
            return np.arange(*part.indices(self.num_samples), dtype=np.int64) % self.num_classes
        if self._drawn is None:
            self._drawn = np.random.default_rng(self.seed).integers(
                0, self.num_classes, self.num_samples, dtype=np.int64
            )
        return self._drawn[part]


def assign_labels(num_samples: int, num_classes: int, mode: str, seed: int) -> np.ndarray:
    """Class label of every sample index, (N,) int64, as one array (see SampleLabels)."""
    return SampleLabels(num_samples, num_classes, mode, seed)[:]


def sample_seeds(seed: int, indices: Sequence[int]) -> list[int]:
    """One 63-bit noise seed per sample index, a hash of (seed, index) (no collisions in practice)."""
    return [int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0] >> 1) for index in indices]
