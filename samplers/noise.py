"""Per-sample random streams, so that a sample depends only on its seed and not on how seeds are batched."""

from collections.abc import Sequence

import torch
from torch import Tensor


class PerSampleNoise:
    """Standard normal noise with one generator per sample.

    Row i of every draw comes from its own generator seeded with seeds[i], so sample i is reproduced
    exactly whatever the batch it is generated in (one process or many, batch 8 or 64), provided the
    same sequence of draws is made for it (x_T first, then the sampler's step noise).
    """

    def __init__(self, seeds: Sequence[int], device: torch.device | str = "cpu"):
        if len(seeds) == 0:
            raise ValueError("PerSampleNoise needs at least one seed")
        self.seeds = [int(seed) for seed in seeds]
        self.device = torch.device(device)
        self.generators = [torch.Generator(self.device).manual_seed(seed) for seed in self.seeds]

    def __len__(self) -> int:
        return len(self.seeds)

    def __call__(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> Tensor:
        """Draw (len(seeds), *shape) standard normal values; row i advances only generator i."""
        rows = [torch.randn(tuple(shape), generator=g, device=self.device, dtype=dtype) for g in self.generators]
        return torch.stack(rows)  # (B, *shape)


def standard_normal_like(x: Tensor, noise: PerSampleNoise | None) -> Tensor:
    """Noise shaped like x (B, ...), from the per-sample streams when given, else from torch's global RNG."""
    if noise is None:
        return torch.randn_like(x)
    if len(noise) != x.shape[0]:
        raise ValueError(f"PerSampleNoise holds {len(noise)} seeds but the batch has {x.shape[0]} samples")
    return noise(x.shape[1:]).to(device=x.device, dtype=x.dtype)  # (B, ...)
