"""What an evaluation can be asked for, and the checks of a request that need no file: the metrics by name (and
which of them need a reference), the batch size and the centre crop.

`fid.evaluate` checks its arguments here first; `python -m fid` checks them here before it imports torch, so
that a bad --metrics or --batch-size answers at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from .errors import InputError

METRICS = ("fid", "sfid", "is", "prc")
BINARY_METRICS = ("fid", "sfid", "prc")  # those that need a reference
METRIC_NAMES = {"fid": "FID", "sfid": "sFID", "is": "the Inception Score", "prc": "precision/recall"}
DEFAULT_BATCH_SIZE = 64


def check_request(
    metrics: Iterable[str] | None,
    ref: str | os.PathLike | None,
    save_stats: str | os.PathLike | None,
    batch_size: int,
    center_crop: int | None,
) -> set[str] | None:
    """The metrics asked for as a set (None: choose from the inputs), or an InputError for metrics that do not
    exist or need a REF that is not given, for nothing to do, or for a batch size or crop below 1."""
    if metrics is not None:
        metrics = set(metrics)
        if unknown := metrics - set(METRICS):
            raise InputError(f"unknown metrics {sorted(unknown)}; choose from {', '.join(METRICS)}")
        if ref is None and (binary := metrics & set(BINARY_METRICS)):
            raise InputError(f"{', '.join(sorted(binary))} need a reference (REF)")
    if not metrics and ref is None and save_stats is None:
        raise InputError("nothing to do: no metrics asked and no --save-stats")
    if batch_size < 1:
        raise InputError(f"--batch-size must be at least 1, got {batch_size}")
    if center_crop is not None and center_crop < 1:
        raise InputError(f"--center-crop must be a positive image side in pixels, got {center_crop}")
    return metrics
