"""Names of models that travel between working directories and machines: the VAE (generation.vae) and REPA's
encoder (training.encoder_source).

A model given as a local folder is named by the id its own files record (a hub id, a timm name), where they record
one, else by the folder's absolute path; the absolute path is kept beside the name as a hint, loaded first wherever
it exists and holds the model the name names. A config or export that records both works from any folder, and
two names compare equal when they name the same model, however the folder was spelled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RecordedName = Callable[[Path], str | None]  # the id a model folder's own files record, or None


@dataclass(frozen=True)
class PortableSource:
    """A model named so that the name travels: `name` is the id its folder records where it records one, else the
    folder's absolute path (or a name given as it is); `path` is the absolute local folder it was given as, tried
    first where it exists (None for a model given by name)."""

    name: str
    path: str | None = None


def portable_source(spec: str, hint: str | None, recorded_name: RecordedName) -> PortableSource:
    """The portable name of what `spec` (a name or a local folder, relative to the working directory) names.

    A folder is named by `recorded_name(folder)`, else by its absolute path, which becomes the hint. For a name, a
    recorded `hint` is kept unless it is a folder here that holds another model (a folder not here is kept for the
    machine where it is)."""
    folder = Path(spec).expanduser()
    if folder.is_dir():
        folder = folder.resolve()
        return PortableSource(recorded_name(folder) or str(folder), str(folder))
    if hint is not None and Path(hint).is_dir() and portable_source(hint, None, recorded_name).name != spec:
        hint = None
    return PortableSource(spec, hint)


def local_copy(spec: str, hint: str | None, recorded_name: RecordedName) -> str:
    """What to load for `spec`: the `hint` folder where it exists and holds the model `spec` names, else `spec`."""
    if hint is not None and Path(hint).is_dir() and portable_source(hint, None, recorded_name).name == spec:
        return hint
    return spec
