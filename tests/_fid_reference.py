"""Independent reference implementations and small input makers shared by the fid tests."""

import numpy as np
import pytest

import fid.evaluation


def uint8_images(n: int, size: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def pool_stats(dim: int = 2048) -> dict[str, np.ndarray]:
    return {"mu": np.zeros(dim), "sigma": np.eye(dim)}


@pytest.fixture
def no_inception(monkeypatch):
    """Fail the test if Inception is built: input errors must come before any heavy work."""

    def forbidden(*args, **kwargs):
        raise AssertionError("Inception was loaded before the input error was reported")

    monkeypatch.setattr(fid.evaluation, "load_inception", forbidden)


def numpy_inception_score(logits: np.ndarray, split_size: int) -> float:
    """The ADM evaluator's definition in plain numpy: softmax, then exp(mean KL(p(y|x) || p(y))) per split, averaged."""
    exp = np.exp(logits - logits.max(1, keepdims=True))
    preds = exp / exp.sum(1, keepdims=True)
    scores = []
    for i in range(0, len(preds), split_size):
        part = preds[i : i + split_size]
        kl = part * (np.log(part) - np.log(np.expand_dims(np.mean(part, 0), 0)))
        scores.append(np.exp(np.mean(np.sum(kl, 1))))
    return float(np.mean(scores))


def self_distance_tolerance(cov: np.ndarray) -> float:
    """How far from 0 the Fréchet distance of a Gaussian to itself may land in float64.

    Eigenvalues that are 0 in exact arithmetic come out as +-eps * ||S||; each clipped one still
    adds up to sqrt(eps * ||S||) to the trace of the square root, twice (two square roots).
    """
    return 2 * cov.shape[0] * np.sqrt(np.finfo(np.float64).eps * np.trace(cov))
