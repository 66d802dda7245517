"""A resumable output folder of shard files: each shard written atomically, the owning run's settings recorded.

Used by `sample.py` (image shards merged into one .npz at the end) and by latent extraction (the shards are the
output). A killed job is simply rerun: finished shards are kept, the others are written again. The folder's
settings record (`settings.json`) makes sure that shards of different runs are never mixed: a rerun with other
settings is refused, naming the first setting that differs. A folder in which no shard is finished belongs to
no one: the next run claims it. The main process of the run that claims the folder holds its lock
(atomic_files.folder_lock), so a second run started into the same folder is refused at once, naming the process
that holds it, instead of doing the work twice.

A folder may stand for millions of shards (sample.py --num-samples 10**9 in shards of 256: 3.9 M) without an
object or a string per shard: `ShardNames` computes shard k's file name and reads k back from a name, `claim`
lists the folder once, and the unfinished shards come back as `PendingShards`, which stores only the finished ones.
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from atomic_files import atomic_output, remove_if_stale, temporary_target, write_json_atomic
from atomic_files.folder_lock import lock_folder, lock_holder, release_folder
from commands import UserError

SETTINGS_FILE = "settings.json"


class ShardFolderError(UserError):
    """The folder belongs to another run, or cannot be used (the message names it)."""


def first_difference(stored: dict[str, Any], settings: dict[str, Any]) -> str | None:
    """The first key whose value differs between two settings records, or None."""
    for key in [*settings, *(stored.keys() - settings.keys())]:
        if stored.get(key) != settings.get(key):
            return key
    return None


class ShardNames(Sequence[str]):
    """The file names of shards 0..count-1, `pattern.format(k)` (e.g. "shard-{:06d}.npz"), each computed when asked
    for; `index(name)` reads k back from a name at once, so that a listing of the folder is matched against
    millions of shards without a list of their names."""

    def __init__(self, count: int, pattern: str) -> None:
        self.count, self.pattern = count, pattern
        self._prefix, _, rest = pattern.partition("{")
        self._suffix = rest.partition("}")[2]

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, number: int) -> str:
        return self.pattern.format(range(self.count)[operator.index(number)])

    def index(self, name: str) -> int:
        """The k whose file is `name`; ValueError for any other name (as a list's `index`)."""
        digits = name[len(self._prefix) : len(name) - len(self._suffix)]
        if name.startswith(self._prefix) and name.endswith(self._suffix) and digits.isascii() and digits.isdigit():
            number = int(digits)
            if number < self.count and self[number] == name:
                return number
        raise ValueError(f"{name!r} is the file of none of the {self.count} shards {self.pattern}")


class PendingShards(Sequence[int]):
    """The shards of 0..count-1 that have no file, ascending, as a list of them would be, but stored as the finished
    ones (as many as the folder holds files): the i-th unfinished shard is i plus the number of finished ones before
    it, found by bisection. A slice is another such view: `pending[rank::processes]` is one process's share, the
    shards a list's slice would give."""

    def __init__(self, count: int, finished: Sequence[int], positions: range | None = None) -> None:
        self.count = count
        self.finished = np.asarray(finished, dtype=np.int64)  # (F,) ascending, distinct, each < count
        # (F,) how many unfinished shards come before each finished one; non-decreasing, so the i-th unfinished
        # shard is i + (how many of these are <= i)
        self._unfinished_before = self.finished - np.arange(len(self.finished))
        self.positions = range(count - len(self.finished)) if positions is None else positions  # this view's part

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, item: int | slice) -> int | PendingShards:
        if isinstance(item, slice):
            return PendingShards(self.count, self.finished, self.positions[item])
        position = self.positions[item]
        return position + int(np.searchsorted(self._unfinished_before, position, side="right"))

    def __eq__(self, other: object) -> bool:
        """Equal to any sequence of the same shards in the same order, a list included."""
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(mine == theirs for mine, theirs in zip(self, other))

    def __repr__(self) -> str:
        shown = list(self) if len(self) <= 16 else f"<{len(self)} shards>"
        return f"PendingShards({shown}, of {self.count})"


class ShardFolder:
    """`folder`/<shard_names[k]> for k = 0..K-1, plus `folder`/settings.json. `shard_names` is a list, or
    `ShardNames` for a folder of very many shards (its `index` reads a name at once, a list's searches it)."""

    def __init__(
        self, folder: str | Path, shard_names: Sequence[str], settings: dict[str, Any], replace_other_run: bool = False
    ) -> None:
        self.folder = Path(folder)
        self.shard_names = shard_names
        self.settings = settings
        self.replace_other_run = replace_other_run  # empty a folder of other settings instead of refusing it
        self.kept = 0  # finished shards found by `claim`

    def path(self, index: int) -> Path:
        return self.folder / self.shard_names[index]

    def pending_here(self) -> PendingShards:
        """Shards without a file, as this process sees the folder now (after `claim`, on any process), from one
        listing of it."""
        finished = [number for name in os.listdir(self.folder) if (number := self._number(name)) is not None]
        return PendingShards(len(self.shard_names), sorted(finished))

    def _number(self, name: str) -> int | None:
        """The shard whose file is called `name`, None for any other file."""
        try:
            return self.shard_names.index(name)
        except ValueError:
            return None

    def _remove_stale_temporaries(self) -> None:
        """Delete the temporary files of shards whose writers were killed, found in one listing of the folder."""
        for name in os.listdir(self.folder):
            target = temporary_target(name)
            if target is not None and self._number(target) is not None:
                remove_if_stale(self.folder / name)

    def claim(self, state: Any = None) -> PendingShards:
        """Check or record the settings and list the unfinished shards, identically on every process.

        `state` is an Accelerate `Accelerator` or `PartialState` (None: a single process). The main process
        creates the folder, removes temporary files of killed writers, checks (or writes) the settings record
        and lists the shards still to write before any process writes one; the list is then broadcast.
        """
        message: list[Any] = [None, None]  # (pending shards, error): the finished shards pickled, not all shards
        if state is None or state.is_main_process:
            try:
                message[0] = self._claim_on_main_process()
            except (OSError, ShardFolderError) as error:
                message[1] = str(error)
        if state is not None and state.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(message)
        pending, error = message
        if error is not None:
            raise ShardFolderError(error)
        self.kept = len(self.shard_names) - len(pending)
        return pending

    def _claim_on_main_process(self) -> PendingShards:
        self.folder.mkdir(parents=True, exist_ok=True)
        if not lock_folder(self.folder):
            raise ShardFolderError(
                f"{self.folder} is being written by another run right now ({lock_holder(self.folder)}): wait for "
                f"it to finish (its result is then kept), or choose another output"
            )
        self._remove_stale_temporaries()
        record = self.folder / SETTINGS_FILE
        pending = self.pending_here()
        if len(pending) == len(self.shard_names):  # no shard finished: nothing to protect, whoever claimed it
            write_json_atomic(record, self.settings)
            return pending
        if not record.exists():
            raise ShardFolderError(
                f"{self.folder} holds shards but no {SETTINGS_FILE} naming their run: remove it "
                f"or choose another output"
            )
        try:
            stored = json.loads(record.read_text())
        except json.JSONDecodeError as error:
            raise ShardFolderError(f"{record} is not valid JSON ({error}): remove {self.folder}") from None
        key = first_difference(stored, self.settings)
        if key is not None and self.replace_other_run:  # settings.json says the whole folder is that run's
            for path in self.folder.iterdir():
                path.unlink()
            write_json_atomic(record, self.settings)
            return self.pending_here()
        if key is not None:
            raise ShardFolderError(
                f"{self.folder} belongs to a run with {key}={stored.get(key)!r}, not "
                f"{self.settings.get(key)!r}: remove it or choose another output"
            )
        return pending

    def release(self) -> None:
        """Drop this process's lock on the folder (once its run is done; process exit drops it too)."""
        release_folder(self.folder)

    def write(self, index: int, write: Callable[[Path], None]) -> None:
        """Write shard `index` atomically: `write(temporary_path)` fills a temporary file that is then renamed."""
        with atomic_output(self.path(index)) as temporary:
            write(temporary)
