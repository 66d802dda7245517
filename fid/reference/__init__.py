"""ADM's ImageNet reference batches, by short name: `python -m fid.reference imagenet256` fetches one into the
cache, and `python -m fid samples.npz imagenet256` scores against it (see batches.py)."""

from .batches import (
    BASE_URL,
    RESOLUTIONS,
    ReferenceBatch,
    cache_dir,
    check_structure,
    download_file,
    fetch,
    reference_batch,
    resolve_input,
    verify,
)

__all__ = [
    "BASE_URL",
    "RESOLUTIONS",
    "ReferenceBatch",
    "cache_dir",
    "check_structure",
    "download_file",
    "fetch",
    "reference_batch",
    "resolve_input",
    "verify",
]
