"""The export that a --ckpt names, and the weights file behind it: an export, checkpoint or run folder (a run's
newest complete checkpoint), an official DiT/SiT `.pt` file or released checkpoint name (converted on the fly by
`generation.official`), or a Hugging Face Hub id ("owner/name") of an export pushed with `Export.push_to_hub`.
sample.py, sweep.py, the likelihood and the diffusers bridge read their checkpoints through `load_export`; the
sha256 of `weights_file` identifies the weights in sample.py's and sweep.py's records. The package hands both on
(`generation.load_export`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

from generation.export import EXPORT_WEIGHTS, Export, ExportError, find_export, read_export
from generation.official import is_official_reference, official_export, official_path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "owner/name"


def load_export(source: str | Path, model: str | None = None, image_size: int | None = None) -> Export:
    """The export `source` names: an export / checkpoint / run folder, an official `.pt` file or released
    checkpoint name (converted on the fly; `model` and `image_size` as in `generation.official`), or a
    Hugging Face Hub id ("owner/name") of an export pushed with `Export.push_to_hub`."""
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
    try:
        yield
    except (OSError, ValueError) as error:
        raise ExportError(
            f"{text}: cannot fetch this Hugging Face Hub export ({type(error).__name__}: {error}); "
            f"offline, copy a folder written by Export.save_pretrained here and pass its "
            f"path"
        ) from None
