"""Improved precision and recall (Kynkäänniemi et al. 2019) as the ADM evaluator defines them.

Each set's manifold is the union of balls around its points whose radius is the distance to
the point's k-th nearest neighbour in the same set (k = 3). Precision: the fraction of samples
inside the reference manifold; recall: the fraction of references inside the sample manifold.
A point on a ball's boundary counts as inside, as in ADM.

Named for the manifolds, not `precision_recall`: the `fid` package hands its function `precision_recall` on
lazily, and a submodule of that name would take its place there once imported.
"""

import torch

from .fp32 import full_fp32_precision

NEIGHBOURS = 3
ROW_BATCH = 1024  # rows of the distance matrix computed at once: 1024 x N float32 values


def precision_recall(
    ref_features: torch.Tensor, sample_features: torch.Tensor, k: int = NEIGHBOURS, row_batch: int = ROW_BATCH
) -> tuple[float, float]:
    """(precision, recall) of samples (M, D) against references (N, D)."""
    for name, features in (("reference", ref_features), ("sample", sample_features)):
        if len(features) <= k:
            raise ValueError(f"precision/recall with k={k} needs more than {k} {name} images, got {len(features)}")
    with full_fp32_precision():
        ref_radii = manifold_radii(ref_features, k, row_batch)  # (N,)
        sample_radii = manifold_radii(sample_features, k, row_batch)  # (M,)
        precision = _fraction_inside(sample_features, ref_features, ref_radii, row_batch)
        recall = _fraction_inside(ref_features, sample_features, sample_radii, row_batch)
    return precision, recall


def manifold_radii(features: torch.Tensor, k: int = NEIGHBOURS, row_batch: int = ROW_BATCH) -> torch.Tensor:
    """Squared distance of every point (N, D) to its k-th nearest neighbour among the others."""
    radii = []
    for rows in features.split(row_batch):
        distances = squared_distances(rows, features)  # (R, N), the point itself at distance 0
        radii.append(distances.kthvalue(k + 1, dim=1).values)  # (R,)
    return torch.cat(radii)  # (N,)


def _fraction_inside(points: torch.Tensor, centres: torch.Tensor, radii: torch.Tensor, row_batch: int) -> float:
    """Fraction of points (M, D) within distance radius_i of some centre_i (N, D)."""
    inside = [(squared_distances(rows, centres) <= radii).any(dim=1) for rows in points.split(row_batch)]  # (R,) each
    return torch.cat(inside).double().mean().item()


def squared_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise squared Euclidean distances (R, N) of rows a (R, D) and b (N, D), in float32."""
    a, b = a.float(), b.float()
    distances = (a * a).sum(1, keepdim=True) - 2 * a @ b.T + (b * b).sum(1)  # (R, N)
    return distances.clamp_min_(0)
