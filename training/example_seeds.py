"""Per-example randomness of the training data sets: every random choice made for an example (flip, posterior
sample) comes from a generator seeded by (seed, epoch, index), so a run sees the same data whatever the number of
loader workers, and a resumed run sees exactly what an uninterrupted one would have.

The base of every data set in training.data (image folders, latent shards) and training.builtin_data (digits,
shapes).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

Example = tuple[torch.Tensor, int]  # (image or latent, label): one item of a data set


def example_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A generator private to one draw of one example."""
    state = np.random.SeedSequence([seed, epoch, index]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


class EpochSeeded(Dataset):
    """Base of datasets whose per-example randomness depends on (seed, epoch, index)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def generator(self, index: int) -> torch.Generator:
        return example_generator(self.seed, self.epoch, index)
