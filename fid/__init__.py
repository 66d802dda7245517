"""FID, sFID, Inception Score and precision/recall in PyTorch, faithful to the ADM evaluator.

Knows nothing of models: it scores uint8 images (N, H, W, 3) from .npz files, folders or
iterators, against images or ADM-format statistics files.

The names below are imported from their modules on first use (PEP 562, as in `generation`), so that
`python -m fid --help`, a bad argument and `python -m fid.reference` answer without importing torch. No
submodule bears one of these names: importing it would put the module in the name's place.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fid.class_divergence import inception_score
    from fid.errors import InputError
    from fid.evaluation import Evaluation, evaluate, extract_features, fid_from_batches, reference_pool
    from fid.frechet import frechet_distance
    from fid.inception import InceptionFeatures, load_inception
    from fid.manifolds import precision_recall
    from fid.moments import FeatureMoments, gaussian_of
    from fid.statistics import Gaussian, StatisticsFile, load_statistics, save_statistics

_HOMES = {
    "InputError": "fid.errors",
    "Evaluation": "fid.evaluation",
    "evaluate": "fid.evaluation",
    "extract_features": "fid.evaluation",
    "fid_from_batches": "fid.evaluation",
    "reference_pool": "fid.evaluation",
    "frechet_distance": "fid.frechet",
    "InceptionFeatures": "fid.inception",
    "load_inception": "fid.inception",
    "inception_score": "fid.class_divergence",
    "FeatureMoments": "fid.moments",
    "gaussian_of": "fid.moments",
    "precision_recall": "fid.manifolds",
    "Gaussian": "fid.statistics",
    "StatisticsFile": "fid.statistics",
    "load_statistics": "fid.statistics",
    "save_statistics": "fid.statistics",
}

__all__ = [
    "Evaluation",
    "FeatureMoments",
    "Gaussian",
    "InceptionFeatures",
    "InputError",
    "StatisticsFile",
    "evaluate",
    "extract_features",
    "fid_from_batches",
    "frechet_distance",
    "gaussian_of",
    "inception_score",
    "load_inception",
    "load_statistics",
    "precision_recall",
    "reference_pool",
    "save_statistics",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'fid' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
