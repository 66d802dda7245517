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
    eigenvalues = _product_eigenvalues(a, b)
    trace_sqrt = np.sqrt(np.clip(eigenvalues, 0.0, None)).sum()
    diff = a.mean - b.mean  # (D,)
    distance = float(diff @ diff + np.trace(a.cov) + np.trace(b.cov) - 2.0 * trace_sqrt)
    # A squared distance: round-off in the traces leaves about -1e-12 for two equal Gaussians, printed -0.0000.
    return max(distance, 0.0)


def _product_eigenvalues(a: Gaussian, b: Gaussian) -> np.ndarray:
    """The eigenvalues of S_a S_b that can be non-zero (those of a symmetric matrix similar to it).

    Where one side knows its rows F (n, D), S = FᵀF of a set of fewer vectors than dimensions (fid.statistics.
    Gaussian.rows): the non-zero eigenvalues of S_o^(1/2) FᵀF S_o^(1/2) are those of F S_o Fᵀ (n, n), as M Mᵀ and
    Mᵀ M share them (M = F S_o^(1/2)); no square root of a D×D matrix is needed. Written here because FID of a few
    hundred samples (the studies, monitoring during training, the tests) spent most of its time in two 2048×2048
    eigendecompositions: 35 s a call on a loaded 2-core CPU. Otherwise S_a^(1/2) S_b S_a^(1/2), D×D."""
    known = [gaussian for gaussian in (a, b) if gaussian.rows is not None]
    if known:
        low = min(known, key=lambda gaussian: gaussian.rows.shape[0])
        other = b if low is a else a
        inner = low.rows @ other.cov @ low.rows.T  # (n, n)
    else:
        sqrt_a = _psd_sqrt(a.cov)  # (D, D)
        inner = sqrt_a @ b.cov @ sqrt_a  # (D, D)
    return np.linalg.eigvalsh((inner + inner.T) / 2)


def _psd_sqrt(matrix: np.ndarray) -> np.ndarray:
    """Symmetric square root of a covariance; round-off negative eigenvalues count as zero."""
    eigenvalues, eigenvectors = np.linalg.eigh(matrix.astype(np.float64))  # (D,), (D, D)
    return (eigenvectors * np.sqrt(np.clip(eigenvalues, 0.0, None))) @ eigenvectors.T
