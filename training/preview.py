"""What the model generates during training: a sample grid and, optionally, FID against reference statistics.

Both use fixed (label, noise seed) pairs, so successive grids and FID values differ only by the weights. The grid
has one labelled row per class (generation.images.grid_classes): row r, column c is sample index r * columns + c
with the row's class; FID's sample i has label i % classes. Generation draws from per-sample noise streams, never
from the global RNG, so it does not perturb training. Images are made by `generation.Generator`, the same path as
sample.py.

`log.fid_weights` chooses the weights both draw from (`PreviewWeights`): the EMA (the default, what exports hold),
the raw trained weights, or the running average of a tracked post-hoc EMA profile (train.posthoc_ema.sigma_rel).
A short run's EMA can still be mostly its first step's weights (training.ema.ema_length): the other two show
what the run has learnt so far.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from torch import nn

from generation.generator import ImageGenerator
from generation.images import grid_classes, save_class_grid
from generation.sample_plan import sample_seeds
from training.config import ConfigError, LogConfig, fid_weights_profile

if TYPE_CHECKING:
    from timm.utils import ModelEmaV3

    from training.power_ema import PowerEMA

PREVIEW_SEED = 0


class PreviewWeights:
    """The network the grids and FID during training draw from (`log.fid_weights`): the EMA model itself, or a
    float32 copy of it into which `refresh` copies the trained weights ("raw") or a post-hoc EMA profile's running
    average ("sigma_rel=S") before each use."""

    def __init__(self, setting: str, ema: ModelEmaV3, posthoc_ema: PowerEMA | None) -> None:
        self.setting = setting
        self.sigma_rel = fid_weights_profile(setting)
        self.posthoc_ema = posthoc_ema
        self.module: nn.Module = ema.module if setting == "ema" else copy.deepcopy(ema.module)

    @property
    def label(self) -> str:
        if self.sigma_rel is not None:
            return f"post-hoc EMA sigma_rel {self.sigma_rel:g}"
        return {"ema": "EMA", "raw": "raw weights"}[self.setting]

    def refresh(self, model: nn.Module) -> None:
        """Bring the copy up to date with the trained `model` (unwrapped) or the profile; nothing for the EMA."""
        if self.setting == "raw":
            self.module.load_state_dict(model.state_dict())
        elif self.sigma_rel is not None:
            self.posthoc_ema.copy_profile(self.sigma_rel, self.module)


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


def save_preview_grid(
    generator: ImageGenerator, log: LogConfig, path: Path, title: str, about: dict | None = None
) -> None:
    """A grid of about `log.sample_count` samples, one labelled row per class (every class of data with up to
    generation.images.EVERY_CLASS_UP_TO), under `title`; the generation settings and `about` (the run, the step,
    the weights) in the PNG's text."""
    classes, columns = grid_classes(range(generator.num_classes), log.sample_count)
    indices = np.arange(len(classes) * columns)
    labels = np.repeat(classes, columns)
    options = generation_options(log)
    images = generator.generate(labels, sample_seeds(PREVIEW_SEED, indices), **options)
    rows = [(label, images[row * columns : (row + 1) * columns]) for row, label in enumerate(classes)]
    settings = {**(about or {}), **options, "sample_count": log.sample_count, "seed": PREVIEW_SEED}
    save_class_grid(rows, path, title, generator.class_names, settings)


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
