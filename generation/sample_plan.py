"""Which class and which noise each sample index gets: the same on every process, for any batch split."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

LABEL_MODES = ("balanced", "uniform")


def assign_labels(num_samples: int, num_classes: int, mode: str, seed: int) -> np.ndarray:
    """Class label of every sample index, (N,) int64.

    "balanced" gives sample i the label i % num_classes, so every prefix of a multiple of num_classes samples is
    exactly class-balanced; "uniform" draws the labels i.i.d. from `seed` (what ADM/DiT evaluations did).
    """
    if mode == "balanced":
        return np.arange(num_samples, dtype=np.int64) % num_classes
    if mode == "uniform":
        return np.random.default_rng(seed).integers(0, num_classes, num_samples, dtype=np.int64)
    raise ValueError(f"label mode {mode!r}: expected one of {LABEL_MODES}")


def sample_seeds(seed: int, indices: Sequence[int]) -> list[int]:
    """One 63-bit noise seed per sample index, a hash of (seed, index) (no collisions in practice)."""
    return [int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0] >> 1) for index in indices]
