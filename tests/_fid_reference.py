"""Independent reference implementations shared by the fid tests."""

import numpy as np


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
