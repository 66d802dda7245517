"""What the EMA model generates during training: a sample grid and, optionally, FID against reference statistics.

Both use fixed (label, noise seed) pairs (sample i: label i % classes, seed of index i), so successive grids and
FID values differ only by the weights. Generation draws from per-sample noise streams, never from the global
RNG, so it does not perturb training. Images are made by `generation.Generator`, the same path as sample.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from generation.generator import ImageGenerator
from generation.images import save_grid
from generation.sample_plan import sample_seeds
from training.config import ConfigError, LogConfig

PREVIEW_SEED = 0


def load_fid_extractor(log: LogConfig, device):
    """The Inception feature extractor for FID monitoring (None when log.fid_every is 0); the reference
    statistics are read here, before training starts (not at the first FID step, after a checkpoint)."""
    if not log.fid_every:
        return None
    from fid import InputError, load_inception, reference_pool

    if log.fid_reference is None or not Path(log.fid_reference).is_file():
        raise ConfigError(
            f"log.fid_every={log.fid_every} needs log.fid_reference=<.npz with mu and sigma>, got {log.fid_reference}"
        )
    try:
        reference_pool(log.fid_reference)
    except InputError as error:
        raise ConfigError(f"log.fid_reference: {error}") from None
    return load_inception(log.fid_inception, device=device)


def generation_options(log: LogConfig) -> dict:
    return dict(guidance=log.sample_guidance, sampler=log.sample_sampler, steps=log.sample_steps)


def save_preview_grid(generator: ImageGenerator, log: LogConfig, path: Path) -> None:
    """A grid of `log.sample_count` samples, labels cycling through the classes."""
    indices = np.arange(log.sample_count)
    images = generator.generate(
        indices % generator.num_classes, sample_seeds(PREVIEW_SEED, indices), **generation_options(log)
    )
    save_grid(images, path)


def preview_fid(
    generator: ImageGenerator, log: LogConfig, extractor, process_index: int, num_processes: int, batch_size: int
) -> float:
    """FID of `log.fid_samples` class-balanced samples against `log.fid_reference`.

    The processes share the sample indices; their feature statistics are summed across processes before the
    Fréchet distance, so every process returns the FID of all `fid_samples` images (the same value as one
    process generating them all).
    """
    from fid import fid_from_batches

    indices = np.arange(process_index, log.fid_samples, num_processes)

    def batches() -> Iterator[np.ndarray]:
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            yield generator.generate(
                chunk % generator.num_classes, sample_seeds(PREVIEW_SEED, chunk), **generation_options(log)
            )

    return fid_from_batches(batches(), log.fid_reference, extractor, across_processes=num_processes > 1)
