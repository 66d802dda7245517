"""One writer per folder: the main process of a command that writes a folder holds an exclusive lock on it.

The lock is a flock on the folder itself (no lock file to clean up), which the kernel drops when the process ends,
kill -9 included, so a second command started into the same folder is refused at once instead of doing the work
twice, and a killed one never leaves the folder locked. Used by the shard folders of `sample.py` and latent
extraction (atomic_files.shards) and by train.py's run directory (training.run).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

_LOCKS: dict[Path, int] = {}  # folder -> descriptor holding its lock: one per folder and process (flock
# conflicts between two descriptors of one process, and the runs of one process follow each other)
PROC_LOCKS = Path("/proc/locks")


def lock_folder(folder: str | os.PathLike) -> bool:
    """Take the lock on the existing `folder` for this process (until `release_folder` or the process ends);
    False when another process holds it (`lock_holder` says which). A process that holds it already keeps it."""
    key = Path(folder).resolve()
    if key not in _LOCKS:
        descriptor = _flock(key, fcntl.LOCK_EX)
        if descriptor is None:
            return False
        _LOCKS[key] = descriptor
    return True


def release_folder(folder: str | os.PathLike) -> None:
    """Drop this process's lock on `folder`, if it holds one."""
    descriptor = _LOCKS.pop(Path(folder).resolve(), None)
    if descriptor is not None:
        os.close(descriptor)


def locked_by_another(folder: str | os.PathLike) -> bool:
    """Whether another process holds the lock on the existing `folder` now. Only looks: a shared probe, which
    never conflicts with another probe, so every process of a launch may ask at once."""
    key = Path(folder).resolve()
    if key in _LOCKS:
        return False
    descriptor = _flock(key, fcntl.LOCK_SH)
    if descriptor is not None:
        os.close(descriptor)
    return descriptor is None


def _flock(folder: Path, mode: int) -> int | None:
    """A new descriptor of `folder` holding a flock of `mode`, or None when another one holds a conflicting lock."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        return None
    return descriptor


def lock_holder(folder: str | os.PathLike) -> str:
    """Who holds the lock on `folder`, for a message: "process <pid>" as the kernel lists it in /proc/locks
    (Linux), else "another process" (another machine of a shared file system, or no /proc)."""
    status = os.stat(folder)
    inode = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    try:
        lines = PROC_LOCKS.read_text().splitlines()
    except OSError:
        return "another process"
    for fields in (line.split() for line in lines):  # "1: FLOCK ADVISORY WRITE <pid> <maj:min:inode> 0 EOF"
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode and fields[4] != str(os.getpid()):
            return f"process {fields[4]}"
    return "another process"
