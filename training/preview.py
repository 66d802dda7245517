"""What the EMA model generates during training: a sample grid and, optionally, FID against reference statistics.

Both use fixed (label, noise seed) pairs, so successive grids and FID values differ only by the weights.
Sampling uses per-sample noise streams, never the global RNG, so it does not perturb training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from samplers import PerSampleNoise, classifier_free_guidance
from training.build import Objective
from training.config import LogConfig
from training.images import save_grid, to_uint8

Decoder = Callable[[torch.Tensor], torch.Tensor]  # model space (B, C, h, w) -> pixels in [-1, 1]


def load_fid_extractor(log: LogConfig, device: torch.device):
    """The Inception feature extractor for FID monitoring (None when log.fid_every is 0); the reference
    statistics file is checked here, before training starts."""
    if not log.fid_every:
        return None
    from fid import load_inception

    if log.fid_reference is None or not Path(log.fid_reference).is_file():
        raise FileNotFoundError(f"log.fid_every={log.fid_every} needs log.fid_reference=<.npz with mu and sigma>, "
                                f"got {log.fid_reference}")
    return load_inception(log.fid_inception, device=device)


class EMASampler:
    """Generates images of a model for given labels and seeds with the sampler chosen in the log config."""

    def __init__(self, objective: Objective, shape: tuple[int, int, int], num_classes: int, log: LogConfig,
                 decode: Decoder) -> None:
        self.objective = objective
        self.shape = shape
        self.num_classes = num_classes
        self.log = log
        self.decode = decode

    @torch.no_grad()
    def images(self, model: nn.Module, labels: torch.Tensor, seeds: Sequence[int]) -> torch.Tensor:
        """(B, 3 or 1, H, W) pixels in [-1, 1] for labels (B,) and one noise seed per sample."""
        device = next(model.parameters()).device
        noise = PerSampleNoise(seeds, device)
        x_T = noise(self.shape)                                                   # (B, C, h, w)
        model_fn = classifier_free_guidance(model, self.log.sample_guidance, null_label=self.num_classes)
        result = self.objective.sample(model_fn, x_T, labels.to(device),
                                       sampler=self.log.sample_sampler or self.objective.default_sampler,
                                       steps=self.log.sample_steps, noise=noise)
        return self.decode(result.samples)

    def save_grid(self, model: nn.Module, path: Path) -> None:
        """A grid of `sample_count` samples, labels cycling through the classes, seeds 0, 1, ..."""
        count = self.log.sample_count
        labels = torch.arange(count) % self.num_classes
        save_grid(to_uint8(self.images(model, labels, range(count))), path)

    def fid(self, model: nn.Module, extractor, reference: str, process_index: int, num_processes: int,
            batch_size: int) -> float:
        """FID of `fid_samples` class-balanced samples (label = index % classes, seed = index) against the
        reference statistics; processes share the indices and all return the same value."""
        from fid import fid_from_batches

        indices = np.arange(process_index, self.log.fid_samples, num_processes)

        def batches() -> Iterator[np.ndarray]:
            for start in range(0, len(indices), batch_size):
                chunk = indices[start:start + batch_size]
                labels = torch.from_numpy(chunk % self.num_classes)
                yield to_uint8(self.images(model, labels, chunk.tolist()))

        return fid_from_batches(batches(), reference, extractor)
