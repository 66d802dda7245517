"""Files written safely: a reader sees the old file or the whole new one, never half of it.

Every file a command of this project writes goes through `atomic_output`: the bytes go to a hidden
temporary file beside the target (`.<name>.tmp-<pid>`), which is renamed over the target only once it
is complete. A process killed mid-write leaves at most such a temporary file; the next run of the same
command removes it with `remove_stale_temporaries` before writing again. `atomic_folder` does the same for a
folder (a training checkpoint). `atomic_files.shards` builds a resumable folder of shards on top (sample.py,
latent extraction).

A rename is only as durable as what it renames: after a crash of the machine (a lost node, a power cut) the file
system may have kept the rename but not yet the file's bytes, leaving a complete-looking file that is cut or
zero-filled. So `commit` flushes the temporary file (every file and folder of a temporary folder) to the disk with
fsync before the rename, and the folder holding the target after it: a name that survives a crash names whole
contents.

A write that fails because the disk is full or the folder is read-only removes its temporary file and raises
`OutputError`, one line naming the path (and, for a full disk, the bytes free and needed when known); the file
it would have replaced is untouched. `check_writable` and `check_room` let a command find out before it starts.
Every rename into place goes through `commit`, the one point tests/_faults.py patches to fail writes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from commands import UserError

__all__ = [
    "OutputError",
    "allocation_unit",
    "atomic_folder",
    "atomic_output",
    "check_room",
    "check_writable",
    "commit",
    "free_bytes",
    "output_error",
    "remove_if_stale",
    "remove_stale_temporaries",
    "replace_folder",
    "staging_folder",
    "save_npz_atomic",
    "sync_to_disk",
    "temporary_target",
    "write_json_atomic",
    "write_text_atomic",
]

TEMPORARY_MARK = ".tmp-"
STAGING_SUFFIX = ".tmp"  # of the hidden folder in which a folder's new contents are assembled (`staging_folder`)
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
    the mode the umask gives a new file (`file_mode`). Its contents are flushed to the disk first and the rename
    after (`sync_to_disk`), so that a crash of the machine leaves the old target or the whole new one. Inside a
    folder being assembled (a checkpoint's export, its trainer state) that is left to the folder's own commit,
    which flushes everything in it at once (an fsync took 0.3 to 4 ms on this project's disk, by its load)."""
    mode = file_mode()
    entries = [temporary] if not temporary.is_dir() else [*temporary.rglob("*"), temporary]
    entries = [entry for entry in entries if not entry.is_symlink()]
    for entry in entries:
        if entry.is_file() and stat.S_IMODE(entry.stat().st_mode) != mode:  # a file committed before keeps its mode,
            os.chmod(entry, mode)  # and its inode clean: flushing it again costs next to nothing
    durable = not _in_staging_folder(target)
    for entry in entries if durable else []:
        sync_to_disk(entry)  # the files' bytes and the folders' names, before the name that vouches for them
    os.replace(temporary, target)
    if durable:
        sync_to_disk(target.parent)  # the rename itself


def sync_to_disk(path: Path) -> None:
    """fsync a file or a folder (a folder's fsync makes the names in it durable: created, renamed, removed). A
    file system that cannot sync a folder (EINVAL, ENOTSUP: some network and FUSE file systems) has nothing more
    to flush for it."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP) or not path.is_dir():
            raise
    finally:
        os.close(descriptor)


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


def allocation_unit(path: str | os.PathLike) -> int:
    """The file system's allocation unit at `path` (or its nearest existing parent): a file takes its size rounded
    up to a multiple of it (statvfs's fragment size; 4096 on ext4, XFS and tmpfs)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return os.statvfs(path).f_frsize or 1


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
    return path.with_name(f".{path.name}{STAGING_SUFFIX}")


def _in_staging_folder(path: Path) -> bool:
    """Whether `path` lies inside a folder being assembled (`staging_folder`), whose own commit flushes it."""
    return any(part.startswith(".") and part.endswith(STAGING_SUFFIX) for part in path.parent.parts)


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
    save; also when the nearest existing path is a file, where no folder can be made. Nothing is left behind."""
    wanted = folder = Path(folder).absolute()
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise OutputError(f"cannot write in {wanted}: {folder} is a file, not a folder; choose another place")
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
