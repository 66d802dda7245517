"""Which existing files a command may replace: only those it wrote itself.

The project's one rule for every file a user names as an output (`python -m fid --json`, `--save-stats`,
`python -m generation.likelihood --json`, sample.py's `--out` and the files beside it, sweep.py's report and
scores in its `--out`, the exports of `python -m training.posthoc_ema`, the folders of the converters): a path
that does not exist is written; an existing one is replaced only when the command recognises it, by its contents,
as one of its own outputs (`refuse_foreign`); anything else (a user's notes, an export's weights, the command's own
input, a folder) is refused in one line before any work, and nothing is written. Each command passes the test
that recognises its files: `json_object_with` (a report or record, by the keys it always holds), `npz_holding_only`
(a statistics file, by its arrays), or its own (sample.py: files its summary vouches for).
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

from commands import UserError


class ForeignFileError(UserError):
    """An output path that exists and was not written by the command (the message names the path and the command)."""


def refuse_foreign(
    path: str | os.PathLike,
    written_here: Callable[[Path], bool],
    writer: str,
    subject: str | None = None,
    choose: str = "choose another file",
) -> None:
    """Raise ForeignFileError when `path` exists (a file, a folder or a dangling link) and `written_here(path)` does
    not recognise it as an output of `writer` (the command's name, for the message). `subject` names it in the
    message (default: the path; e.g. "--json out.json"), `choose` says what to do instead."""
    path = Path(path)
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_symlink() and not path.exists():
        ours = False  # a link to nothing: writing through it would create a file elsewhere
    else:
        ours = written_here(path)
    if not ours:
        raise ForeignFileError(
            f"{subject or path} exists and was not written by {writer}; {choose} (nothing was written)"
        )


def nothing_replaced(path: Path) -> bool:
    """The test of a command that replaces no existing path (its output is always a new folder)."""
    return False


def json_object_with(path: Path, keys: Iterable[str]) -> bool:
    """True when `path` is a file holding a JSON object with every one of `keys` (how a command knows its reports)."""
    if not path.is_file():
        return False
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return False
    return isinstance(value, dict) and all(key in value for key in keys)


def npz_holding_only(path: Path, keys: Iterable[str]) -> bool:
    """True when `path` is an .npz whose arrays are some of `keys` (at least one) and nothing else."""
    if not path.is_file():
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            names = {name.removesuffix(".npy") for name in archive.namelist()}
    except (OSError, zipfile.BadZipFile):
        return False
    return bool(names) and names <= set(keys)
