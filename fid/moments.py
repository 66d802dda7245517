"""Gaussian statistics of feature vectors, streamed: count, sum x and sum x x^T, summed across processes.

The accumulator holds them in float64. These add exactly across batches and processes, so 50 000 samples never
need to sit in memory together, and the covariance (N - 1 normalisation, as np.cov and the ADM evaluator) does
not depend on how the samples were split.
"""

import numpy as np
import torch
import torch.distributed as dist

from .statistics import Gaussian


class FeatureMoments:
    """Streaming count, sum x and sum x x^T of feature vectors, in float64 on `device`."""

    def __init__(self, dim: int, device: str | torch.device = "cpu"):
        self.count = 0
        self.sum = torch.zeros(dim, dtype=torch.float64, device=device)  # (D,)
        self.outer = torch.zeros(dim, dim, dtype=torch.float64, device=device)  # (D, D)
        # The vectors themselves while there are no more of them than dimensions, for Gaussian.rows (a faster
        # FID of small sets, fid.frechet); None once there are more, or after summing across processes.
        self.vectors: list[torch.Tensor] | None = []

    @property
    def dim(self) -> int:
        return self.sum.shape[0]

    def update(self, features: torch.Tensor) -> None:
        """Add a batch of feature vectors (B, D)."""
        x = torch.as_tensor(features).to(self.sum)  # (B, D)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"expected features (B, {self.dim}), got {tuple(x.shape)}")
        self.count += x.shape[0]
        self.sum += x.sum(dim=0)
        self.outer.addmm_(x.T, x)  # += x^T x without a (D, D) temporary
        if self.vectors is not None:
            self.vectors = self.vectors + [x.clone()] if self.count <= self.dim else None

    def merge(self, other: "FeatureMoments") -> "FeatureMoments":
        """The moments of both sets together (e.g. two processes' shares)."""
        merged = FeatureMoments(self.dim, self.sum.device)
        merged.count = self.count + other.count
        merged.sum = self.sum + other.sum.to(self.sum.device)
        merged.outer = self.outer + other.outer.to(self.sum.device)
        if self.vectors is not None and other.vectors is not None and merged.count <= merged.dim:
            merged.vectors = self.vectors + [vectors.to(self.sum.device) for vectors in other.vectors]
        else:
            merged.vectors = None
        return merged

    def packed(self) -> torch.Tensor:
        """One flat float64 tensor [count, sum, outer] to sum with any all-reduce (accelerate, torch.distributed)."""
        count = torch.tensor([self.count], dtype=torch.float64, device=self.sum.device)
        return torch.cat([count, self.sum, self.outer.flatten()])  # (1 + D + D*D,)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, dim: int) -> "FeatureMoments":
        """Inverse of `packed`, e.g. after the packed tensors of all processes were summed."""
        if packed.shape != (1 + dim + dim * dim,):
            raise ValueError(
                f"packed moments of {dim}-d features have {1 + dim + dim * dim} values, got {tuple(packed.shape)}"
            )
        moments = cls(dim, packed.device)
        moments.count = int(packed[0].item())
        moments.sum = packed[1 : 1 + dim].clone()
        moments.outer = packed[1 + dim :].reshape(dim, dim).clone()
        moments.vectors = None  # a sum carries no vectors
        return moments

    def all_reduce(self) -> "FeatureMoments":
        """The moments summed over all torch.distributed processes (self when not distributed)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self
        packed = self.packed()
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        return FeatureMoments.from_packed(packed, self.dim)

    def gaussian(self) -> Gaussian:
        """Mean and unbiased (N - 1) covariance."""
        if self.count < 2:
            raise ValueError(f"a covariance needs at least 2 feature vectors, got {self.count}")
        mean = self.sum / self.count  # (D,)
        cov = torch.addr(self.outer, mean, mean, alpha=-self.count).div_(self.count - 1)  # (D, D)
        cov = (cov + cov.T).div_(2)  # exact symmetry; x^T x from BLAS is symmetric only to rounding
        rows = None
        if self.vectors is not None:
            rows = ((torch.cat(self.vectors) - mean) / (self.count - 1) ** 0.5).cpu().numpy()  # (N, D)
        return Gaussian(mean.cpu().numpy(), cov.cpu().numpy(), rows)


def gaussian_of(features: np.ndarray | torch.Tensor) -> Gaussian:
    """The Gaussian (mean, N - 1 covariance, float64) of feature vectors (N, D) held in memory."""
    moments = FeatureMoments(features.shape[1])
    moments.update(torch.as_tensor(features))
    return moments.gaussian()
