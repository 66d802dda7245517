"""Gaussian feature statistics and the ADM-format .npz files that hold them.

numpy only, so that `python -m fid` and fid.reference read these files without importing torch; fid.moments
computes the statistics from features, with torch.
"""

import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from atomic_files import atomic_output

from .errors import InputError

# ADM reference-batch keys: pool_3 statistics and sFID (spatial) statistics.
STAT_KEYS = {"pool": ("mu", "sigma"), "spatial": ("mu_s", "sigma_s")}


@dataclass(frozen=True)
class Gaussian:
    """Mean and covariance of a set of feature vectors, float64.

    `rows`, when known, are n vectors F (n, D) with cov = FᵀF: the centred features / sqrt(N - 1) of a set of no
    more vectors than dimensions (fid.moments keeps them). The Fréchet distance then solves an n×n eigenproblem
    instead of two D×D ones (fid.frechet); files hold mean and covariance only."""

    mean: np.ndarray  # (D,)
    cov: np.ndarray  # (D, D)
    rows: np.ndarray | None = field(default=None, compare=False, repr=False)  # (n, D)

    def __post_init__(self):
        dim = self.mean.shape[0] if self.mean.ndim == 1 else -1
        if self.cov.shape != (dim, dim):
            raise ValueError(f"mean {self.mean.shape} and covariance {self.cov.shape} do not describe a (D,) Gaussian")
        if self.rows is not None and (self.rows.ndim != 2 or self.rows.shape[1] != dim):
            raise ValueError(f"rows {self.rows.shape} of a {dim}-d Gaussian: expected (n, {dim})")


@dataclass(frozen=True)
class StatisticsFile:
    """The statistics an ADM-format .npz holds: pool_3 (mu, sigma) and/or spatial (mu_s, sigma_s)."""

    pool: Gaussian | None = None
    spatial: Gaussian | None = None


def load_statistics(path: str | os.PathLike) -> StatisticsFile:
    """Read the ADM statistics keys of an .npz (absent keys give None; half a pair is an error)."""
    path = Path(path)
    stats = {}
    with np.load(path) as npz:
        for name, (mean_key, cov_key) in STAT_KEYS.items():
            present = [key for key in (mean_key, cov_key) if key in npz.files]
            if len(present) == 1:
                missing = cov_key if present == [mean_key] else mean_key
                raise InputError(f"{path}: has '{present[0]}' but no '{missing}'")
            if present:
                try:
                    mean, cov = npz[mean_key].astype(np.float64), npz[cov_key].astype(np.float64)
                except (ValueError, TypeError, OSError, EOFError, zipfile.BadZipFile) as error:  # object arrays, cuts
                    raise InputError(
                        f"{path}: '{mean_key}'/'{cov_key}' cannot be read as numbers ({type(error).__name__}: {error})"
                    ) from None
                if mean.ndim != 1 or cov.shape != (mean.shape[0], mean.shape[0]):
                    raise InputError(
                        f"{path}: '{mean_key}' {mean.shape} and '{cov_key}' {cov.shape}; expected (D,) and (D, D)"
                    )
                if not (np.isfinite(mean).all() and np.isfinite(cov).all()):
                    raise InputError(f"{path}: '{mean_key}' or '{cov_key}' holds NaN or infinite values")
                stats[name] = Gaussian(mean, cov)
    return StatisticsFile(**stats)


def save_statistics(path: str | os.PathLike, stats: StatisticsFile) -> None:
    """Write an ADM-compatible statistics .npz atomically (a crash leaves any older file intact)."""
    arrays = {}
    for name, (mean_key, cov_key) in STAT_KEYS.items():
        gaussian = getattr(stats, name)
        if gaussian is not None:
            arrays[mean_key], arrays[cov_key] = gaussian.mean, gaussian.cov
    if not arrays:
        raise ValueError(f"no statistics to write to {path}")
    with atomic_output(path) as temporary, open(temporary, "wb") as file:
        np.savez(file, **arrays)
