"""ADM-style sample files: `arr_0` uint8 images (N, H, W, 3) and `arr_1` int64 labels (N,), written in shards.

The sample indices 0..N-1 are cut into consecutive shards of a fixed size (independent of the number of
processes); each finished shard is an .npz with its images, labels and indices. `merge_shards` streams them, in
index order, into the final .npz without holding all images in memory (50 000 images at 512 px are 39 GB). The plan
computes each shard when asked for (10**9 samples are 3.9 M shards of 256), and `run_bytes` says how much disk a
run needs: the shards and the merged .npz, both on it until the merge ends.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from atomic_files import atomic_output, remove_stale_temporaries, save_npz_atomic
from atomic_files.folder_lock import locked_by_another
from atomic_files.ownership import json_object_with, refuse_foreign
from atomic_files.shards import ShardNames, first_difference
from commands import UserError

SHARD_NAME = "shard-{:06d}.npz"  # shard k's file in <out>.shards/
LABEL_BYTES = np.dtype(np.int64).itemsize  # a label, or a sample index, in a sample file
NPZ_OVERHEAD_BYTES = 1024  # headers and zip records of an .npz of up to three arrays, at most (a shard: 748)
RECORD_BYTES = 16 << 10  # the most a run's summary .json or its shard folder's settings.json takes (about 1.1 KiB)
FOLDER_ENTRY_BYTES = 64  # a shard's entry in the shard folder (ext4: 24 bytes for 8 and its 16-character name)
WRITER, CHOOSE = "sample.py", "choose another --out"  # for the refusal of a file sample.py did not write


@dataclass(frozen=True)
class Shard:
    """Sample indices [start, stop), stored as one file once finished."""

    number: int
    start: int
    stop: int

    @property
    def file_name(self) -> str:
        return SHARD_NAME.format(self.number)

    @property
    def indices(self) -> range:
        return range(self.start, self.stop)


class DamagedShardError(UserError):
    """A shard file that cannot be read, or holds other samples than its name says."""


class SampleFilesError(UserError):
    """An output file that another run, or something other than sample.py, wrote (the message names it)."""


@dataclass(frozen=True)
class SampleFiles:
    """What one sample run writes for `samples` (an .npz): the summary `.json` (its settings and speed), the
    preview `.png`, and the `.shards/` folder that exists until the merge."""

    samples: Path

    @property
    def summary(self) -> Path:
        return self.samples.with_suffix(".json")

    @property
    def grid(self) -> Path:
        return self.samples.with_suffix(".png")

    @property
    def shards(self) -> Path:
        return self.samples.with_name(self.samples.name + ".shards")

    def claim(self, settings: dict[str, Any], overwrite: bool = False) -> bool:
        """True when the samples are already complete for these settings (then a shard folder that a stop between
        the merge's rename and its clean-up left is removed). Files of another run (unless `overwrite`:
        `remove_other_run` deletes them once the model has loaded) raise SampleFilesError, files the summary does
        not vouch for ForeignFileError; temporary files of a killed run are removed."""
        key = None
        refuse_foreign(self.summary, self.written_here, WRITER, choose=CHOOSE)
        for path in (self.samples, self.grid):  # vouched for by the summary, or not sample.py's
            refuse_foreign(path, lambda _: self.summary.exists(), WRITER, choose=CHOOSE)
        if self.summary.exists():
            stored = json.loads(self.summary.read_text())["settings"]
            key = first_difference(stored, settings)
            if key is not None and not overwrite:
                raise SampleFilesError(
                    f"{self.summary} belongs to a run with {key}={stored.get(key)!r}, not "
                    f"{settings.get(key)!r}: remove it or choose another --out"
                )
        for path in (self.samples, self.summary, self.grid):
            remove_stale_temporaries(path)
        complete = self.samples.exists() and key is None
        if complete and self.shards.is_dir() and not locked_by_another(self.shards):
            shutil.rmtree(self.shards, ignore_errors=True)  # left by a stop between the merge's rename and clean-up
        return complete

    @staticmethod
    def written_here(summary: Path) -> bool:
        """Whether `summary` is a summary sample.py wrote: a JSON object with its run's "settings"."""
        return json_object_with(summary, ["settings"]) and isinstance(json.loads(summary.read_text())["settings"], dict)

    def bytes_on_disk(self, unit: int = 1) -> int:
        """Bytes that the shard folder and the .npz take now (each file rounded up to the disk's allocation `unit`),
        which a run needs no free space for: a resumed run keeps its finished shards, and once `claim` found the
        samples incomplete, an .npz is another run's that --overwrite deletes (without it, `claim` refused)."""
        shards = [entry.stat().st_size for entry in os.scandir(self.shards)] if self.shards.is_dir() else []
        files = [*shards, *([self.samples.stat().st_size] if self.samples.exists() else [])]
        return sum(allocated(size, unit) for size in files)

    def remove_other_run(self, settings: dict[str, Any]) -> list[Path]:
        """`sample.py --overwrite`: delete the .npz, grid and summary of a sample.py run with other settings
        (`claim` made sure the summary is sample.py's), the samples first, so that a kill midway never leaves a
        summary vouching for another run's samples. Returns what was deleted."""
        if (
            not self.summary.exists()
            or first_difference(json.loads(self.summary.read_text())["settings"], settings) is None
        ):
            return []
        removed = [path for path in (self.samples, self.grid, self.summary) if path.exists()]
        for path in removed:
            path.unlink()
        return removed


@dataclass(frozen=True)
class ShardPlan(Sequence[Shard]):
    """The indices 0..N-1 cut into consecutive shards of `shard_size` (the last one may be smaller), shard k computed
    when asked for: a plan of any size is two numbers (a list of the 3.9 M shards of 10**9 samples held 733 MiB)."""

    num_samples: int
    shard_size: int

    def __len__(self) -> int:
        return -(-self.num_samples // self.shard_size)

    def __getitem__(self, item: int | slice) -> Shard | list[Shard]:
        if isinstance(item, slice):
            return [self[number] for number in range(len(self))[item]]
        number = range(len(self))[item]
        start = number * self.shard_size
        return Shard(number, start, min(start + self.shard_size, self.num_samples))

    @property
    def names(self) -> ShardNames:
        """The shards' file names (Shard.file_name), for the shard folder."""
        return ShardNames(len(self), SHARD_NAME)

    def samples_in(self, numbers: Sequence[int]) -> int:
        """How many samples the shards `numbers` (ascending) hold, without visiting them: all are full but the last
        shard of the plan."""
        if not numbers:
            return 0
        short = len(self) * self.shard_size - self.num_samples  # samples the last shard lacks
        return len(numbers) * self.shard_size - (short if numbers[-1] == len(self) - 1 else 0)


def plan_shards(num_samples: int, shard_size: int) -> ShardPlan:
    """Cut the indices 0..N-1 into consecutive shards of `shard_size` (the last one may be smaller)."""
    return ShardPlan(num_samples, shard_size)


def allocated(size: int, unit: int) -> int:
    """The bytes a file of `size` bytes takes on a disk that allocates in multiples of `unit`."""
    return -(-size // unit) * unit


def run_bytes(num_samples: int, image_size: int, shard_size: int, grid_bytes: int = 0, unit: int = 1) -> int:
    """Disk bytes a sample run fills at its peak, the end of the merge: every shard (images, labels and indices)
    and the merged .npz (images and labels), since the shards are removed only once the merge is complete, with the
    summary, the shard folder's settings record and the preview grid (`grid_bytes`) written before it; every file
    rounded up to the disk's allocation `unit` (atomic_files.allocation_unit), the shard folder's entries too."""
    image = image_size * image_size * 3  # (H, W, 3) uint8

    def shard(count: int) -> int:
        return allocated(count * (image + 2 * LABEL_BYTES) + NPZ_OVERHEAD_BYTES, unit)

    full, rest = divmod(num_samples, shard_size)
    shards = full * shard(shard_size) + (shard(rest) if rest else 0)
    folder = allocated(len(plan_shards(num_samples, shard_size)) * FOLDER_ENTRY_BYTES, unit)
    merged = allocated(num_samples * (image + LABEL_BYTES) + NPZ_OVERHEAD_BYTES, unit)
    return shards + folder + merged + 2 * allocated(RECORD_BYTES, unit) + allocated(grid_bytes, unit)


def save_shard(path: Path, shard: Shard, images: np.ndarray, labels: np.ndarray) -> None:
    """Write the (n, H, W, 3) uint8 images of `shard` with their labels and indices, atomically."""
    save_npz_atomic(
        path, arr_0=images, arr_1=labels[shard.start : shard.stop], index=np.arange(shard.start, shard.stop)
    )


def load_shard(path: Path, shard: Shard, labels: np.ndarray) -> np.ndarray:
    """Images of a finished shard, (n, H, W, 3) uint8, after checking its indices and labels."""
    try:
        with np.load(path) as data:
            images, shard_labels, indices = data["arr_0"], data["arr_1"], data["index"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        raise DamagedShardError(f"{path} cannot be read ({type(error).__name__}: {error})") from None
    if (
        images.dtype != np.uint8
        or images.ndim != 4
        or images.shape[-1] != 3
        or len(images) != len(shard.indices)
        or not np.array_equal(indices, np.arange(shard.start, shard.stop))
        or not np.array_equal(shard_labels, labels[shard.start : shard.stop])
    ):
        raise DamagedShardError(f"{path} does not hold samples {shard.start}..{shard.stop - 1} of this run")
    return images


def shard_reader(
    folder: Path, labels: np.ndarray, repair: Callable[[Shard, DamagedShardError], np.ndarray]
) -> Callable[[Shard], np.ndarray]:
    """A function from a shard to its images; a shard that cannot be read is handed to `repair`, which returns its
    images (sampled again: every sample is a function of its index) and writes the file anew."""

    def images_of(shard: Shard) -> np.ndarray:
        try:
            return load_shard(folder / shard.file_name, shard, labels)
        except DamagedShardError as error:
            return repair(shard, error)

    return images_of


def merge_shards(
    shards: Iterable[Shard], images_of: Callable[[Shard], np.ndarray], labels: np.ndarray, out: Path
) -> None:
    """Stream all shards, in index order, into `out` (arr_0 images, arr_1 labels), atomically."""
    shards = iter(shards)  # one pass: a plan of millions of shards is never listed
    first = images_of(next(shards))
    shape = (len(labels), *first.shape[1:])
    with atomic_output(out) as temporary, zipfile.ZipFile(temporary, "w", allowZip64=True) as archive:
        with archive.open("arr_0.npy", "w", force_zip64=True) as member:
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False, "shape": shape}
            np.lib.format.write_array_header_1_0(member, header)
            member.write(first.tobytes())
            for shard in shards:
                images = images_of(shard)
                if images.shape[1:] != shape[1:]:
                    raise DamagedShardError(
                        f"shard {shard.file_name}: images of shape {images.shape[1:]}, expected {shape[1:]}"
                    )
                member.write(images.tobytes())
        with archive.open("arr_1.npy", "w") as member:
            np.lib.format.write_array(member, labels)


def images_at(shards: ShardPlan, images_of: Callable[[Shard], np.ndarray], indices: Sequence[int]) -> np.ndarray:
    """The samples `indices` (in that order), (n, H, W, 3) uint8, for the preview grid: each shard that holds some
    of them is read once and only those are kept (a grid's 64 samples may lie in 30 shards, 1.5 GB at 256 px)."""
    indices = np.asarray(indices, dtype=np.int64)
    numbers = indices // shards.shard_size
    picked: dict[int, np.ndarray] = {}
    for number in np.unique(numbers).tolist():
        images = images_of(shards[number])
        for index in indices[numbers == number].tolist():
            picked[index] = images[index - number * shards.shard_size]
    return np.stack([picked[index] for index in indices.tolist()])
