"""The shards of a samples file written by hand (as sample.py writes them: `arr_0` images, `arr_1` labels and the
samples' `index`), for the tests of the shard plan and merge (tests/test_sample_file.py) and of the shard folder
(tests/test_shards.py)."""

import numpy as np

from atomic_files import save_npz_atomic


def write_shards(folder, images, labels, shards):
    """Write each of `shards` (generation.sample_file.Shard) into `folder` with its slice of `images` (N, H, W, 3) and
    `labels` (N,)."""
    for shard in shards:
        save_npz_atomic(
            folder / shard.file_name,
            arr_0=images[shard.start : shard.stop],
            arr_1=labels[shard.start : shard.stop],
            index=np.arange(shard.start, shard.stop),
        )
