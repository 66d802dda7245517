"""The studies' shared machinery: train every run of a study with train.py (or resume it, or skip it when
finished), sample and score each of its checkpoints or exports with a scorer (studies.scorers), one record per
scoring, and the command line every study shares. A rerun skips finished runs and scores and continues the rest.

The studies name their arms, budgets and readings (studies.quality, studies.repa_digits, studies.posthoc_digits);
the pieces of their reports are studies.report's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from studies.scorers import Scorer, batches

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "studies" / "results"  # the committed reports of the full studies
CHECKPOINT_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
SAMPLE_SEED = 0  # the noise of sample i is sample_seeds(SAMPLE_SEED, [i]) for every model: paired samples
SAMPLE_BATCH = 250
# The curve's checkpoints, with room for those of an earlier, shorter budget that a run was extended from: the
# learning rate is constant after warm-up, so resuming a finished run with a larger train.max_steps is the same
# as training it for the larger budget from the start, and its checkpoints must not rotate away the curve's.
KEPT_CHECKPOINTS = 2 * len(CHECKPOINT_FRACTIONS)


@dataclass(frozen=True)
class Budget:
    """How much one study costs: the full study and --quick differ only here."""

    max_steps: int | None  # None: the study's config's train.max_steps
    final_samples: int  # per final model: the headline FID and accuracy
    curve_samples: int  # per checkpoint (at 100 %: the first of the final set): the FID curve
    real_images: int | None  # real images FID compares against (None: all of them)
    sampler_steps: dict[str, int]  # objective kind -> steps of its sampler
    seeds: tuple[int, ...]
    model_overrides: tuple[str, ...]  # size overrides on top of the study's config
    checkpoint_fractions: tuple[float, ...] = CHECKPOINT_FRACTIONS  # of max_steps: the checkpoints sampled


# A study's budget: the config's training steps, 1000 samples of each final model and 250 of each earlier checkpoint,
# 3 seeds.
FULL = Budget(
    max_steps=None,
    final_samples=1000,
    curve_samples=250,
    real_images=None,
    sampler_steps={"diffusion": 50, "transport": 25},
    seeds=(0, 1, 2),
    model_overrides=(),
)
# Its smoke run (--quick): a 1-block, 32-wide model for 4 steps, 12 final and 6 curve samples against 24 real images,
# about a minute per run.
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
    """One model variant of the study: train.py overrides on top of the shared recipe, or of its own config."""

    name: str
    label: str
    overrides: tuple[str, ...]
    config: Path | None = None  # None: the study's config


def run_name(arm: Arm, seed: int) -> str:
    return f"{arm.name}-seed{seed}"


# ----------------------------------------------------------------------------------------------
#                                            Training
# ----------------------------------------------------------------------------------------------


def checkpoint_steps(budget: Budget) -> list[int]:
    return [round(fraction * budget.max_steps) for fraction in budget.checkpoint_fractions]


def trained(arm: Arm, seed: int, budget: Budget, out: Path) -> bool:
    """Whether the run has its final checkpoint (a finished run: train_run skips it)."""
    from generation.run_layout import CHECKPOINTS_FOLDER, step_name

    return (out / "runs" / run_name(arm, seed) / CHECKPOINTS_FOLDER / step_name(budget.max_steps)).is_dir()


def train_run(arm: Arm, seed: int, budget: Budget, out: Path, config: Path) -> Path:
    """Train (or resume, or skip when finished) one run of the arm's config (else `config`) with train.py; returns
    its run directory."""
    run_dir = out / "runs" / run_name(arm, seed)
    if trained(arm, seed, budget, out):
        return run_dir
    every = checkpoint_steps(budget)[0]
    command = [
        sys.executable,
        str(REPO / "train.py"),
        "--config",
        str(arm.config or config),
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
#                                      Sampling and scoring
# ----------------------------------------------------------------------------------------------


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
    kind = export.description.objective.kind
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


def train_and_score(
    runs: list[tuple[Arm, int]], budget: Budget, out: Path, scorer: Scorer, config: Path
) -> tuple[dict[tuple[str, int], list[dict]], dict[str, float]]:
    """Train every run of `config` and score each of its checkpoints, run by run (skipping finished work, so that
    a study stopped early has its first runs scored); returns the scores per (arm, seed) and the wall time spent
    on training, sampling and scoring."""
    steps = checkpoint_steps(budget)
    scores = {}
    for arm, seed in runs:
        run_dir = train_run(arm, seed, budget, out, config)
        scores[(arm.name, seed)] = [
            score_checkpoint(run_dir, step, step == steps[-1], budget, scorer, out, arm, seed) for step in steps
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


# ----------------------------------------------------------------------------------------------
#                                          Command line
# ----------------------------------------------------------------------------------------------


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
        help=f"where {reports} go (default studies/results; --quick: --out)",
    )
    return parser


def parse_study_arguments(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`parser`'s arguments, with --out checked (a folder, or nothing yet) and --report-dir resolved."""
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a folder")
    args.report_dir = args.report_dir or (args.out if args.quick else RESULTS)
    return args
