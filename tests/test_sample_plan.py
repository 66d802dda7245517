"""generation/sample_plan.py: which label and which noise seed each sample gets (balanced or seeded uniform labels,
per-sample seeds of (seed, index) only), planned lazily for any --num-samples."""

import numpy as np
import pytest

from generation.sample_plan import assign_labels, sample_seeds


def test_balanced_labels_are_balanced_in_every_prefix():
    labels = assign_labels(1003, 10, "balanced", seed=0)
    assert labels.dtype == np.int64 and labels.shape == (1003,)
    counts = np.bincount(labels, minlength=10)
    assert counts.max() - counts.min() <= 1 and counts.sum() == 1003
    for prefix in (10, 500, 1000):
        assert np.all(np.bincount(labels[:prefix], minlength=10) == prefix // 10)


def test_uniform_labels_follow_the_seed():
    first = assign_labels(5000, 7, "uniform", seed=3)
    assert first.dtype == np.int64 and first.min() == 0 and first.max() == 6
    np.testing.assert_array_equal(first, assign_labels(5000, 7, "uniform", seed=3))
    assert not np.array_equal(first, assign_labels(5000, 7, "uniform", seed=4))
    with pytest.raises(ValueError, match="balanced"):
        assign_labels(10, 7, "sorted", seed=3)


def test_sample_seeds_depend_on_seed_and_index_only():
    seeds = sample_seeds(0, range(20_000))
    assert len(set(seeds)) == 20_000 and all(0 <= s < 2**63 for s in seeds)
    assert sample_seeds(0, [17, 5]) == [seeds[17], seeds[5]]  # any order or subset of indices
    assert set(sample_seeds(1, range(20_000))).isdisjoint(seeds)  # seed + index does not alias


def test_sample_labels_are_the_eager_ones_in_every_part():
    from generation.sample_plan import SampleLabels

    for mode in ("balanced", "uniform"):
        labels = SampleLabels(1003, 7, mode, seed=3)
        whole = labels[:]
        assert whole.shape == (1003,) and whole.dtype.name == "int64"
        for start, stop in ((0, 1), (5, 260), (1000, 1003), (0, 1003)):
            assert (labels[start:stop] == whole[start:stop]).all()
    assert (SampleLabels(10, 4, "balanced", 0)[:] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]).all()
