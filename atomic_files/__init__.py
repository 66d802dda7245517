"""Files written safely: a reader sees the old file or the whole new one, never half of it.

Every file a command of this project writes goes through `atomic_output`: the bytes go to a hidden
temporary file beside the target (`.<name>.tmp-<pid>`), which is renamed over the target only once it
is complete. A process killed mid-write leaves at most such a temporary file; the next run of the same
command removes it with `remove_stale_temporaries` before writing again. `atomic_folder` does the same for a
folder (a training checkpoint). `atomic_files.shards` builds a resumable folder of shards on top (sample.py,
latent extraction).

A write that fails because the disk is full or the folder is read-only removes its temporary file and raises
`OutputError`, one line naming the path (and, for a full disk, the bytes free and needed when known); the file
it would have replaced is untouched. `check_writable` and `check_room` let a command find out before it starts.
Every rename into place goes through `commit`, the one point tests/faults.py patches to fail writes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from commands import UserError

__all__ = [
    "OutputError",
    "atomic_folder",
    "atomic_output",
    "check_room",
    "check_writable",
    "free_bytes",
    "output_error",
    "remove_if_stale",
    "remove_stale_temporaries",
    "replace_folder",
    "staging_folder",
    "save_npz_atomic",
    "temporary_target",
    "write_json_atomic",
    "write_text_atomic",
]

TEMPORARY_MARK = ".tmp-"
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
LOW_SPACE_BYTES = 1 << 20  # a writer that fails with this little left (torch's reports no errno) ran out of room
# how writers without an errno (safetensors' Rust writer, torch's zip writer) spell the two in their messages
MESSAGES = {
    errno.ENOSPC: ("No space left on device", "os error 28"),
    errno.EROFS: ("Read-only file system", "os error 30"),
}


class OutputError(UserError):
    """An output that cannot be written: a full disk or a read-only folder (the message names the path)."""


def _temporary_name(path: Path, pid: int) -> Path:
    return path.with_name(f".{path.name}{TEMPORARY_MARK}{pid}")


def commit(temporary: Path, target: Path) -> None:
    """Rename a complete temporary file or folder into place (one step on a POSIX file system), its files given
    the mode the umask gives a new file (`file_mode`)."""
    mode = file_mode()
    for file in [temporary] if not temporary.is_dir() else [path for path in temporary.rglob("*") if path.is_file()]:
        os.chmod(file, mode)
    os.replace(temporary, target)


def file_mode() -> int:
    """The mode of a file created now by open(): 0o666 less the process's umask. Some writers (safetensors)
    create their files 0o600 whatever the umask, so that others of a group could not read a shared run."""
    try:
        status = Path("/proc/self/status").read_text()
        umask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8)
    except (OSError, StopIteration):  # not Linux: read it the only other way, setting it and back
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes free for this user on the file system of `path` (or of its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def _sizes(needed: int | None, path: Path) -> str:
    free = free_bytes(path)
    return f"{needed:,} bytes needed, {free:,} free" if needed is not None else f"{free:,} bytes free"


def output_error(path: Path, error: BaseException, needed: int | None = None) -> OutputError | None:
    """The one-line error for a write of `path` that failed with `error`, when a full disk or a read-only
    folder caused it; None for anything else (a bug keeps its traceback)."""
    code = getattr(error, "errno", None)
    if code is None:
        code = next(
            (number for number, spellings in MESSAGES.items() if any(spelling in str(error) for spelling in spellings)),
            None,
        )
    if code in NO_ROOM or (code is None and free_bytes(path) < LOW_SPACE_BYTES):
        return OutputError(
            f"cannot write {path}: no space left on its disk ({_sizes(needed, path)}); nothing "
            f"was replaced, free some space and run the command again"
        )
    if code in NOT_WRITABLE:
        return OutputError(f"cannot write {path}: {os.strerror(code).lower()}; choose a writable place")
    return None


@contextlib.contextmanager
def _failing_as_output_error(path: Path, needed: int | None) -> Iterator[None]:
    try:
        yield
    except Exception as error:  # writers report a full disk as OSError, RuntimeError (torch), SafetensorError
        if isinstance(error, UserError):
            raise
        described = output_error(path, error, needed)
        if described is None:
            raise
        raise described from None


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, needed: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `path`; it replaces `path` on success and is removed on failure (a full
    disk or a read-only folder then raises OutputError; `needed`, the expected size, goes into its message)."""
    path = Path(path)
    temporary = _temporary_name(path, os.getpid())
    with _failing_as_output_error(path, needed):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            yield temporary
            commit(temporary, path)
        finally:
            with contextlib.suppress(OSError):  # a read-only folder: its error, not this one, is the story
                temporary.unlink(missing_ok=True)


def staging_folder(path: str | os.PathLike) -> Path:
    """The hidden folder beside `path` in which its new contents are assembled (see `replace_folder`)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp")


def replace_folder(temporary: Path, path: Path, needed: int | None = None) -> None:
    """Rename the complete folder `temporary` to `path`; an existing `path` is removed once the new one is in
    place, and put back if the rename fails (then the temporary folder is removed and OutputError raised)."""
    stale = path.with_name(f".{path.name}.old")
    with _failing_as_output_error(path, needed):
        try:
            if path.exists():
                shutil.rmtree(stale, ignore_errors=True)
                os.replace(path, stale)
            commit(temporary, path)
        except BaseException:
            if stale.exists() and not path.exists():
                os.replace(stale, path)
            shutil.rmtree(temporary, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike, needed: int | None = None) -> Iterator[Path]:
    """`atomic_output` for a folder (one process): fill the yielded hidden folder; it replaces `path` once the
    block ends and is removed on failure."""
    path = Path(path)
    temporary = staging_folder(path)
    with _failing_as_output_error(path, needed):
        try:
            shutil.rmtree(temporary, ignore_errors=True)  # left by a writer that was killed
            temporary.mkdir(parents=True)
            yield temporary
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
    replace_folder(temporary, path, needed)


def check_writable(folder: str | os.PathLike) -> None:
    """Raise OutputError now if files cannot be written in `folder` (or, when it does not exist yet, in its
    nearest existing parent, where it would be created), before a command spends time on work it could not
    save. Nothing is left behind."""
    folder = Path(folder).absolute()
    while not folder.exists():
        folder = folder.parent
    probe = folder / f".write-probe{TEMPORARY_MARK}{os.getpid()}"
    temporary = _temporary_name(probe, os.getpid())
    with _failing_as_output_error(folder, None):  # the error names the folder, never the probe's own files
        try:
            temporary.write_bytes(b"")
            commit(temporary, probe)
        finally:
            for path in (temporary, probe):
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)


def check_room(path: str | os.PathLike, needed: int) -> None:
    """Raise OutputError now if the file system of `path` has fewer than `needed` bytes free."""
    if free_bytes(path) < needed:
        raise OutputError(
            f"cannot write {path}: not enough space on its disk ({_sizes(needed, Path(path))}); "
            f"free some space and run the command again"
        )


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace `path` by `text` in one step."""
    with atomic_output(path) as temporary:
        temporary.write_text(text)


def write_json_atomic(path: str | os.PathLike, value: Any) -> None:
    """Replace `path` by `value` as indented JSON (with a final newline) in one step."""
    write_text_atomic(path, json.dumps(value, indent=2) + "\n")


def save_npz_atomic(path: str | os.PathLike, **arrays: np.ndarray) -> None:
    """Write an uncompressed .npz of `arrays` in one step."""
    with atomic_output(path) as temporary, open(temporary, "wb") as file:
        np.savez(file, **arrays)


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Delete the temporary files that killed writers of `path` left behind; returns what was removed.

    A temporary file whose writer (the pid in its name) still runs on this machine is kept.
    """
    path = Path(path)
    return [candidate for candidate in path.parent.glob(f".{path.name}{TEMPORARY_MARK}*") if remove_if_stale(candidate)]


def remove_if_stale(temporary: Path) -> bool:
    """Delete the temporary file `temporary` unless its writer (the pid in its name) still runs on this machine;
    True when it was deleted."""
    pid = temporary.name.rpartition(TEMPORARY_MARK)[2]
    if pid.isdigit() and int(pid) != os.getpid() and _process_alive(int(pid)):
        return False
    temporary.unlink(missing_ok=True)
    return True


def temporary_target(name: str) -> str | None:
    """The name of the file that a temporary file named `name` (`.<target>.tmp-<pid>`) was written for; None for
    a name that is not a temporary file's. Lets a folder's temporaries be found in one listing of it."""
    if not name.startswith(".") or TEMPORARY_MARK not in name:
        return None
    return name[1:].rpartition(TEMPORARY_MARK)[0]


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True
