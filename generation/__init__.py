"""Generation: from a trained model to images.

Owns the export format (`ExportDescription`, `Export`: a folder of EMA weights and a JSON description, also on the
Hugging Face Hub), the conversion of official DiT/SiT checkpoints into exports, the VAE between pixels and
latents, and `ImageGenerator.generate`, the one path from labels and seeds to uint8 images. `sample.py`, training's
previews and the demo all go through it. It depends on the model packages and the samplers, never on training.

The names below are imported from their modules on first use (PEP 562), so that importing a light module of the
package (`generation.protocols`, `generation.sample_file`, which sample.py reads to parse its arguments) does not
import the models, the samplers and huggingface_hub first.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from generation.export import Export, ExportDescription, ExportError, find_export, read_export, write_export
    from generation.generator import ImageGenerator

_HOMES = {
    "Export": "generation.export",
    "ExportDescription": "generation.export",
    "ExportError": "generation.export",
    "find_export": "generation.export",
    "read_export": "generation.export",
    "write_export": "generation.export",
    "ImageGenerator": "generation.generator",
}

__all__ = [
    "Export",
    "ExportDescription",
    "ExportError",
    "ImageGenerator",
    "find_export",
    "load_export",
    "read_export",
    "weights_file",
    "write_export",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'generation' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "owner/name"


def load_export(source: str | Path, model: str | None = None, image_size: int | None = None) -> Export:
    """The export `source` names: an export / checkpoint / run folder, an official `.pt` file or released
    checkpoint name (converted on the fly; `model` and `image_size` as in `generation.official`), or a
    Hugging Face Hub id ("owner/name") of an export pushed with `Export.push_to_hub`."""
    # Imported here, not at the top: `python -m generation.official` imports this package first, and runpy warns
    # when the module it is about to run is already imported.
    from generation.export import Export, read_export
    from generation.official import official_export

    text = str(source)
    kind = _source_kind(text, model, image_size)
    if kind == "official":
        return official_export(text, model, image_size)
    if kind == "folder":
        return read_export(text)
    with _hub_errors(text):
        return Export.from_pretrained(text)


def weights_file(source: str | Path, model: str | None = None, image_size: int | None = None) -> Path:
    """The local file that `load_export(source, ...)` reads the weights from: an export's `ema.safetensors` (of a
    run's newest complete checkpoint, for a run folder), an official `.pt` (a released one downloaded first, as
    `load_export` would), a hub export's `ema.safetensors` in the Hugging Face cache (fetched first). Its sha256
    (atomic_files.digest) is what identifies the weights in the records of sample.py and sweep.py."""
    from generation.export import EXPORT_WEIGHTS, find_export
    from generation.official import official_path

    text = str(source)
    kind = _source_kind(text, model, image_size)
    if kind == "official":
        return official_path(text)
    if kind == "folder":
        return find_export(text) / EXPORT_WEIGHTS
    from huggingface_hub import hf_hub_download

    with _hub_errors(text):
        return Path(hf_hub_download(repo_id=text, filename=EXPORT_WEIGHTS))


def _source_kind(text: str, model: str | None, image_size: int | None) -> str:
    """ "official" (a .pt file that is not a folder, or a released name), "folder" (anything else that exists) or
    "hub" (an "owner/name" id); an ExportError for a source that is none of them."""
    from generation.export import ExportError
    from generation.official import is_official_reference

    if is_official_reference(text):
        return "official"
    if model is not None or image_size is not None:
        raise ExportError(
            f"{text}: --model and --image-size are only for official .pt checkpoints; an export names its own model"
        )
    if Path(text).exists():
        return "folder"
    if Path(text).is_symlink():  # a link that exists() cannot follow: a loop, or a link to nothing
        try:
            Path(text).stat()
        except OSError as error:
            problem = (
                "a loop of symbolic links"
                if error.errno == errno.ELOOP
                else f"a symbolic link to nothing ({os.readlink(text)})"
            )
            raise ExportError(
                f"{text}: {problem}; expected an export folder, a run directory or an official .pt"
            ) from None
    if HUB_ID.match(text) and not text.startswith("."):
        return "hub"
    raise ExportError(
        f"{text}: no such file or folder (expected an export folder, a run directory, an official "
        f".pt checkpoint or a Hugging Face Hub id owner/name)"
    )


@contextlib.contextmanager
def _hub_errors(text: str) -> Iterator[None]:
    """A hub export that cannot be fetched (offline, unknown repository, not an export) as one ExportError."""
    from generation.export import ExportError

    try:
        yield
    except (OSError, ValueError) as error:
        raise ExportError(
            f"{text}: cannot fetch this Hugging Face Hub export ({type(error).__name__}: {error}); "
            f"offline, copy a folder written by Export.save_pretrained here and pass its "
            f"path"
        ) from None
