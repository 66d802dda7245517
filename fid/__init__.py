"""FID, sFID, Inception Score and precision/recall in PyTorch, faithful to the ADM evaluator.

Knows nothing of models: it scores uint8 images (N, H, W, 3) from .npz files, folders or
iterators, against images or ADM-format statistics files.
"""

from .errors import InputError
from .evaluation import Evaluation, evaluate, extract_features, fid_from_batches, reference_pool
from .frechet import frechet_distance
from .inception import InceptionFeatures, load_inception
from .inception_score import inception_score
from .precision_recall import precision_recall
from .statistics import FeatureMoments, Gaussian, StatisticsFile, gaussian_of, load_statistics, save_statistics

__all__ = [
    "Evaluation",
    "FeatureMoments",
    "Gaussian",
    "InputError",
    "InceptionFeatures",
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
