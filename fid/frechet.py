"""Fréchet distance between two Gaussians (FID, sFID), in float64."""

import numpy as np

from .statistics import Gaussian


def frechet_distance(a: Gaussian, b: Gaussian) -> float:
    """||mu_a - mu_b||^2 + tr S_a + tr S_b - 2 tr (S_a S_b)^(1/2).

    tr (S_a S_b)^(1/2) equals tr (S_a^(1/2) S_b S_a^(1/2))^(1/2), whose argument is symmetric
    positive semi-definite: two symmetric eigendecompositions replace scipy's general sqrtm,
    which is slower, returns complex round-off, and on singular covariances (fewer samples
    than dimensions) may return non-finite values that other tools patch with a diagonal offset.
    """
    if a.mean.shape != b.mean.shape:
        raise ValueError(f"cannot compare {a.mean.shape[0]}-d and {b.mean.shape[0]}-d statistics")
    sqrt_a = _psd_sqrt(a.cov)  # (D, D)
    inner = sqrt_a @ b.cov @ sqrt_a  # (D, D)
    eigenvalues = np.linalg.eigvalsh((inner + inner.T) / 2)  # (D,)
    trace_sqrt = np.sqrt(np.clip(eigenvalues, 0.0, None)).sum()
    diff = a.mean - b.mean  # (D,)
    distance = float(diff @ diff + np.trace(a.cov) + np.trace(b.cov) - 2.0 * trace_sqrt)
    # A squared distance: round-off in the traces leaves about -1e-12 for two equal Gaussians, printed -0.0000.
    return max(distance, 0.0)


def _psd_sqrt(matrix: np.ndarray) -> np.ndarray:
    """Symmetric square root of a covariance; round-off negative eigenvalues count as zero."""
    eigenvalues, eigenvectors = np.linalg.eigh(matrix.astype(np.float64))  # (D,), (D, D)
    return (eigenvectors * np.sqrt(np.clip(eigenvalues, 0.0, None))) @ eigenvectors.T
