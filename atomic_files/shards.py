"""A resumable output folder of shard files: each shard written atomically, the owning run's settings recorded.

Used by `sample.py` (image shards merged into one .npz at the end) and by latent extraction (the shards are the
output). A killed job is simply rerun: finished shards are kept, the others are written again. The folder's
settings record (`settings.json`) makes sure that shards of different runs are never mixed: a rerun with other
settings is refused, naming the first setting that differs. A folder in which no shard is finished belongs to
no one: the next run claims it. The main process of the run that claims the folder holds its lock
(atomic_files.folder_lock), so a second run started into the same folder is refused at once, naming the process
that holds it, instead of doing the work twice.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from atomic_files import atomic_output, remove_stale_temporaries, write_json_atomic
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


class ShardFolder:
    """`folder`/<shard_names[i]> for i = 0..K-1, plus `folder`/settings.json."""

    def __init__(
        self, folder: str | Path, shard_names: Sequence[str], settings: dict[str, Any], replace_other_run: bool = False
    ) -> None:
        self.folder = Path(folder)
        self.shard_names = list(shard_names)
        self.settings = settings
        self.replace_other_run = replace_other_run  # empty a folder of other settings instead of refusing it
        self.kept = 0  # finished shards found by `claim`

    def path(self, index: int) -> Path:
        return self.folder / self.shard_names[index]

    def pending_here(self) -> list[int]:
        """Shards without a file, as this process sees the folder now (after `claim`, on any process)."""
        return [index for index in range(len(self.shard_names)) if not self.path(index).exists()]

    def claim(self, state: Any = None) -> list[int]:
        """Check or record the settings and list the unfinished shards, identically on every process.

        `state` is an Accelerate `Accelerator` or `PartialState` (None: a single process). The main process
        creates the folder, removes temporary files of killed writers, checks (or writes) the settings record
        and lists the shards still to write before any process writes one; the list is then broadcast.
        """
        message: list[Any] = [None, None]  # (pending shards, error)
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

    def _claim_on_main_process(self) -> list[int]:
        self.folder.mkdir(parents=True, exist_ok=True)
        if not lock_folder(self.folder):
            raise ShardFolderError(
                f"{self.folder} is being written by another run right now ({lock_holder(self.folder)}): wait for "
                f"it to finish (its result is then kept), or choose another output"
            )
        for name in self.shard_names:
            remove_stale_temporaries(self.folder / name)
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
