"""Score a set of samples against a reference: FID, sFID, Inception Score, precision/recall.

Stored statistics win over images: an ADM reference batch (images and statistics) gives its
statistics to FID and sFID and its images to precision/recall, exactly as ADM's evaluator.
Every input problem is reported before the first image goes through Inception.
"""

import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from .class_divergence import IS_SPLIT_SIZE, inception_score
from .errors import InputError
from .frechet import frechet_distance
from .inception import InceptionFeatures, load_inception
from .inception_spec import FEATURE_DIMS, POOL_DIM
from .inputs import IMAGE_KEY, EvaluationInput, FolderImages, ImageSource, open_input
from .manifolds import NEIGHBOURS, precision_recall
from .moments import FeatureMoments
from .reference import resolve_input
from .request import BINARY_METRICS, DEFAULT_BATCH_SIZE, METRIC_NAMES, METRICS, check_request
from .statistics import STAT_KEYS, Gaussian, StatisticsFile, load_statistics, save_statistics

STATISTICS_OF = {"fid": "pool", "sfid": "spatial"}  # metric -> the Gaussian it compares
# Below this many images per set the 2048-d pool_3 covariance is rank-deficient and FID is biased upwards
# (2 vs 20 images gave FID 149): such numbers compare only with others from the same set sizes.
FULL_RANK_IMAGES = POOL_DIM


class SmallSetWarning(UserWarning):
    """A set of fewer than FULL_RANK_IMAGES images scored for FID (a sweep says it once, not once per point)."""


@dataclass
class ImageFeatures:
    """What one Inception pass over a set of images keeps (each part only when asked for)."""

    gaussians: dict[str, Gaussian] = field(default_factory=dict)  # "pool" / "spatial"
    pool: torch.Tensor | None = None  # (N, 2048) for precision/recall
    logits: torch.Tensor | None = None  # (N, 1008) for the Inception Score


def extract_features(
    batches: Iterable[np.ndarray | torch.Tensor],
    extractor: InceptionFeatures,
    gaussians: Iterable[str] = ("pool",),
    keep_pool: bool = False,
    keep_logits: bool = False,
    across_processes: bool = False,
) -> ImageFeatures:
    """Run uint8 (B, H, W, 3) batches through Inception, streaming the requested statistics.

    `across_processes`: every torch.distributed process passes its own share of the images and
    all must call this; the statistics cover all shares (kept features stay per process).
    """
    moments = {name: FeatureMoments(FEATURE_DIMS[name], extractor.device) for name in gaussians}
    pools, logits = [], []
    for batch in batches:
        out = extractor(batch)
        for name, accumulator in moments.items():
            accumulator.update(getattr(out, name))
        if keep_pool:
            pools.append(out.pool)
        if keep_logits:
            logits.append(out.logits)
    if across_processes:
        moments = {name: accumulator.all_reduce() for name, accumulator in moments.items()}
    return ImageFeatures(
        gaussians={name: accumulator.gaussian() for name, accumulator in moments.items()},
        pool=torch.cat(pools) if keep_pool else None,
        logits=torch.cat(logits) if keep_logits else None,
    )


def reference_pool(path: str | os.PathLike) -> Gaussian:
    """The pool_3 statistics ('mu', 'sigma') of a reference .npz; InputError naming the file when it has none."""
    reference = load_statistics(path).pool
    if reference is None:
        raise InputError(f"{path}: no pool_3 statistics ('mu', 'sigma')")
    return reference


def fid_from_batches(
    batches: Iterable[np.ndarray | torch.Tensor],
    reference: Gaussian | str | os.PathLike,
    extractor: InceptionFeatures,
    across_processes: bool = False,
) -> float:
    """FID of uint8 (B, H, W, 3) image batches against reference pool_3 statistics (a file or a Gaussian).

    Meant for monitoring during training: build `extractor` once with `load_inception`. With
    `across_processes`, every torch.distributed process passes its own batches (all must call)
    and all get the FID of the union.
    """
    if not isinstance(reference, Gaussian):
        reference = reference_pool(reference)
    features = extract_features(batches, extractor, gaussians=("pool",), across_processes=across_processes)
    return frechet_distance(features.gaussians["pool"], reference)


@dataclass(frozen=True)
class Evaluation:
    """The metrics, and which Inception weights produced them (None: stored statistics only)."""

    metrics: dict[str, float]
    inception_weights: str | None


@dataclass
class _Plan:
    """What must be computed from one input's images."""

    gaussians: list[str]
    keep_pool: bool
    keep_logits: bool

    @property
    def needs_images(self) -> bool:
        return bool(self.gaussians) or self.keep_pool or self.keep_logits


def plan_input(source: EvaluationInput, role: str, metrics: set[str], wants_statistics: bool) -> _Plan:
    """Decide what to compute for SAMPLES or REF, failing early on anything the input cannot provide (sweep.py asks
    it of the samples it is about to make, before the first)."""
    stat_names = [STATISTICS_OF[m] for m in ("fid", "sfid") if m in metrics]
    if wants_statistics:
        stat_names = list(STAT_KEYS)
    plan = _Plan(
        gaussians=[name for name in stat_names if source.stored(name) is None],
        keep_pool="prc" in metrics,
        keep_logits="is" in metrics,
    )
    for name in stat_names:
        stored, expected = source.stored(name), FEATURE_DIMS[name]
        if stored is not None and stored.mean.shape != (expected,):
            raise InputError(
                f"{role} {source.path}: '{STAT_KEYS[name][0]}' has shape {stored.mean.shape}; expected ({expected},)"
            )
    if source.images is None and plan.gaussians:
        mean_key, cov_key = STAT_KEYS[plan.gaussians[0]]
        raise InputError(f"{role} {source.path}: no '{mean_key}'/'{cov_key}' statistics and no images '{IMAGE_KEY}'")
    if source.images is None and (plan.keep_pool or plan.keep_logits):
        metric = "precision/recall" if plan.keep_pool else "the Inception Score"
        raise InputError(
            f"{role} {source.path}: {metric} needs images ('{IMAGE_KEY}' or a folder); it holds statistics only"
        )
    count = len(source.images) if source.images is not None else 0
    if plan.gaussians and count < 2:
        raise InputError(
            f"{role} {source.path}: {count} image(s); feature statistics (FID, sFID, --save-stats) "
            "need at least 2 for a covariance"
        )
    if plan.keep_pool and count <= NEIGHBOURS:
        raise InputError(
            f"{role} {source.path}: {count} image(s); precision/recall with k={NEIGHBOURS} "
            f"needs at least {NEIGHBOURS + 1}"
        )
    if plan.gaussians and count < FULL_RANK_IMAGES:
        warnings.warn(
            f"{role} {source.path}: {count} images; with fewer than {FULL_RANK_IMAGES} per set FID is "
            f"biased upwards and the covariance is rank-deficient (rank <= {count - 1}): compare only "
            "with scores from sets of the same sizes (published scores use 50 000 samples)",
            SmallSetWarning,
            stacklevel=3,
        )
    return plan


def unavailable_metrics(samples: EvaluationInput, ref: EvaluationInput | None) -> dict[str, str]:
    """Metric -> why these inputs cannot give it; a metric not in the dict can be computed from them.

    Images give every metric; stored statistics give only the Fréchet distance they hold (pool_3 for FID,
    spatial for sFID); precision/recall needs the images of both sets, the Inception Score those of SAMPLES.
    """
    reasons: dict[str, str] = {}
    if ref is None:
        reasons.update({metric: f"{METRIC_NAMES[metric]} needs a reference (REF)" for metric in BINARY_METRICS})
    for role, source in (("SAMPLES", samples), ("REF", ref)):
        if source is None or source.images is not None:
            continue
        for metric in ("fid", "sfid"):
            if source.stored(STATISTICS_OF[metric]) is None:
                mean_key, cov_key = STAT_KEYS[STATISTICS_OF[metric]]
                reasons.setdefault(
                    metric, f"{role} {source.path}: no '{mean_key}'/'{cov_key}' statistics and no images '{IMAGE_KEY}'"
                )
        for metric in ("prc", "is") if role == "SAMPLES" else ("prc",):
            reasons.setdefault(
                metric,
                f"{role} {source.path}: {METRIC_NAMES[metric]} needs images ('{IMAGE_KEY}' or "
                f"a folder); it holds statistics only",
            )
    return reasons


def choose_metrics(asked: Iterable[str] | None, samples: EvaluationInput, ref: EvaluationInput | None) -> set[str]:
    """The metrics to compute: those asked, each checked against what the inputs allow, or by default (None)
    every metric with a reference (FID, sFID, precision/recall) that the inputs allow, with a warning naming
    those left out and why. Asking for one the inputs cannot give is an InputError naming the metrics that
    would work."""
    reasons = unavailable_metrics(samples, ref)
    possible = [metric for metric in BINARY_METRICS if metric not in reasons]
    if asked is None:
        if ref is None:
            return set()
        if left_out := [metric for metric in BINARY_METRICS if metric in reasons]:
            if not possible:
                raise InputError(f"{reasons[left_out[0]]}; no metric can be computed from these inputs")
            why = "; ".join(reasons[metric] for metric in left_out)
            warnings.warn(
                f"{', '.join(METRIC_NAMES[metric] for metric in left_out)} left out ({why}); scoring "
                f"--metrics {','.join(possible)}",
                stacklevel=3,
            )
        return set(possible)
    asked = set(asked)
    if impossible := [metric for metric in METRICS if metric in asked and metric in reasons]:
        works = (
            f"--metrics {','.join(possible)} works with these inputs" if possible else "give REF images or statistics"
        )
        raise InputError(f"{reasons[impossible[0]]}; {works}")
    return asked


def _is_reference_batch(source: EvaluationInput) -> bool:
    """Images and stored pool_3 statistics in one file, like ADM's VIRTUAL_imagenet256_labeled.npz."""
    return source.images is not None and source.stored("pool") is not None


def evaluate(
    samples: str | os.PathLike,
    ref: str | os.PathLike | None = None,
    metrics: Iterable[str] | None = None,
    weights: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    save_stats: str | os.PathLike | None = None,
    is_split_size: int = IS_SPLIT_SIZE,
    progress: bool = False,
    center_crop: int | None = None,
    skip_corrupt: bool = False,
    extractor: InceptionFeatures | None = None,
) -> Evaluation:
    """Metrics of SAMPLES against REF; see `python -m fid --help` for the inputs accepted.

    The metrics dict holds "fid", "sfid", "is", "precision", "recall" for the metrics asked; `metrics=None`
    (the default) computes what the inputs allow (see `choose_metrics`).
    With `save_stats`, the samples' pool_3 and spatial statistics are written there (ADM format).
    `center_crop` and `skip_corrupt` apply to image folders (fid.inputs.FolderImages). Every check of the
    arguments and of the inputs' headers comes before Inception is loaded. `extractor`: an Inception already
    loaded (`load_inception`), used instead of `weights` and `device`, so that scoring many sets (sweep.py) loads
    it once.
    """
    metrics = check_request(metrics, ref, save_stats, batch_size, center_crop)
    sample_input = open_input(resolve_input(samples), center_crop, skip_corrupt)
    ref_input = open_input(resolve_input(ref), center_crop, skip_corrupt) if ref is not None else None
    metrics = choose_metrics(metrics, sample_input, ref_input)
    # Without REF or IS, the one input is only summarised for --save-stats (often a reference set): not "SAMPLES"
    sample_role = "SAMPLES" if ref_input is not None or "is" in metrics else "--save-stats input"
    sample_plan = plan_input(sample_input, sample_role, metrics, wants_statistics=save_stats is not None)
    ref_plan = plan_input(ref_input, "REF", metrics - {"is"}, wants_statistics=False) if ref_input else None
    if center_crop is not None and not any(
        isinstance(x.images, FolderImages) for x in (sample_input, ref_input) if x is not None
    ):
        raise InputError(f"--center-crop {center_crop} applies to image folders; neither input is one")
    if ref_input and _is_reference_batch(sample_input) and not _is_reference_batch(ref_input):
        warnings.warn(
            f"SAMPLES {sample_input.path} looks like an ADM reference batch (images and stored "
            f"statistics) and REF {ref_input.path} does not: python -m fid takes SAMPLES first, while "
            "ADM's evaluator.py takes the reference first; IS and precision/recall depend on the order",
            stacklevel=2,
        )
    if "is" in metrics and len(sample_input.images) < is_split_size:
        raise InputError(
            f"SAMPLES {sample_input.path}: {len(sample_input.images)} images are fewer than one "
            f"Inception Score split of {is_split_size}"
        )

    if not (sample_plan.needs_images or (ref_plan and ref_plan.needs_images)):
        extractor = None  # stored statistics only
    elif extractor is None:
        extractor = load_inception(weights, device, require_classifier="is" in metrics)
    elif "is" in metrics and not extractor.has_classifier:
        raise InputError(
            f"the Inception Score needs Inception's 1008-class layer; {extractor.weights.description} has none"
        )
    sample_features = _features_of(sample_input, sample_plan, extractor, batch_size, progress)
    ref_features = _features_of(ref_input, ref_plan, extractor, batch_size, progress) if ref_input else None

    results: dict[str, float] = {}
    for metric in ("fid", "sfid"):
        if metric in metrics:
            name = STATISTICS_OF[metric]
            results[metric] = frechet_distance(
                _gaussian(sample_input, sample_features, name), _gaussian(ref_input, ref_features, name)
            )
    if "is" in metrics:
        results["is"] = inception_score(sample_features.logits, is_split_size)
    if "prc" in metrics:
        results["precision"], results["recall"] = precision_recall(ref_features.pool, sample_features.pool)
    if save_stats is not None:
        save_statistics(
            save_stats, StatisticsFile(**{name: _gaussian(sample_input, sample_features, name) for name in STAT_KEYS})
        )
    return Evaluation(results, extractor.weights.description if extractor else None)


def _features_of(
    source: EvaluationInput, plan: _Plan, extractor: InceptionFeatures | None, batch_size: int, progress: bool
) -> ImageFeatures:
    if not plan.needs_images:
        return ImageFeatures()
    batches = _progress(source.images, batch_size, f"Inception features of {source.path.name}", progress)
    return extract_features(batches, extractor, plan.gaussians, plan.keep_pool, plan.keep_logits)


def _progress(images: ImageSource, batch_size: int, description: str, enabled: bool) -> Iterable[np.ndarray]:
    total = -(-len(images) // batch_size)
    return tqdm(images.batches(batch_size), total=total, desc=description, unit="batch", disable=not enabled)


def _gaussian(source: EvaluationInput, features: ImageFeatures, name: str) -> Gaussian:
    """Stored statistics when the file has them, else those computed from its images."""
    stored = source.stored(name)
    return stored if stored is not None else features.gaussians[name]
