"""Files written safely: a reader sees the old file or the whole new one, never half of it.

Every file a command of this project writes goes through `atomic_output`: the bytes go to a hidden
temporary file beside the target (`.<name>.tmp-<pid>`), which is renamed over the target only once it
is complete. A process killed mid-write leaves at most such a temporary file; the next run of the same
command removes it with `remove_stale_temporaries` before writing again. `atomic_files.shards` builds a
resumable folder of shards on top (sample.py, latent extraction).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["atomic_output", "remove_stale_temporaries", "save_npz_atomic", "write_json_atomic",
           "write_text_atomic"]

TEMPORARY_MARK = ".tmp-"


def _temporary_name(path: Path, pid: int) -> Path:
    return path.with_name(f".{path.name}{TEMPORARY_MARK}{pid}")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; it replaces `path` on success and is removed on failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = _temporary_name(path, os.getpid())
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


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
    removed = []
    for candidate in path.parent.glob(f".{path.name}{TEMPORARY_MARK}*"):
        pid = candidate.name.rpartition(TEMPORARY_MARK)[2]
        if pid.isdigit() and int(pid) != os.getpid() and _process_alive(int(pid)):
            continue
        candidate.unlink(missing_ok=True)
        removed.append(candidate)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True
