"""The studies' shared machinery: train every run of a study with train.py (or resume it, or skip it when
finished), sample and score each of its checkpoints or exports as a scored point (scored_points: sampled by
sample.py's code, recorded and read back as sweep.py's points are) with a scorer of studies.scorers, and the command
line every study shares. A rerun skips finished runs and scores and continues the rest.

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

from commands import UserError
from scored_points import Point, ScoredPoints
from studies.scorers import Scorer

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "studies" / "results"  # the committed reports of the full studies
CHECKPOINT_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
SAMPLE_SEED = 0  # the noise of sample i is sample_seeds(SAMPLE_SEED, [i]) for every model: paired samples
SAMPLE_BATCH = 250
POINTS_FOLDER = "sweeps"  # <out>/sweeps/<run>/: each run's scored points (scored_points.ScoredPoints)
# The curve's checkpoints, with room for those of an earlier, shorter budget that a run was extended from: the
# learning rate is constant after warm-up, so resuming a finished run with a larger train.max_steps is the same
# as training it for the larger budget from the start, and its checkpoints must not rotate away the curve's.
KEPT_CHECKPOINTS = 2 * len(CHECKPOINT_FRACTIONS)


class StudyError(UserError):
    """A study that cannot go on: a run that would not train, a report with nothing to report (the message says
    what is kept and what to do)."""


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
        raise StudyError(
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


def sample_options(budget: Budget, kind: str, num_classes: int) -> list[str]:
    """sample.py's options for every point of a study: the studies' deterministic sampler of the objective `kind`
    with the budget's steps, class-balanced labels of seed SAMPLE_SEED (paired samples across models) in batches of
    SAMPLE_BATCH on the CPU in float32, a grid of 12 rows of classes."""
    return [
        *("--sampler", SAMPLERS[kind], "--steps", str(budget.sampler_steps[kind])),
        *("--seed", str(SAMPLE_SEED), "--labels", "balanced", "--per-proc-batch-size", str(SAMPLE_BATCH)),
        *("--shard-size", str(4 * SAMPLE_BATCH), "--grid-size", str(12 * num_classes), "--cpu", "--precision", "fp32"),
    ]


def run_points(
    out: Path, arm: Arm, seed: int, count: int, budget: Budget, scorer: Scorer, export: Path
) -> ScoredPoints:
    """The scored points of one run (its checkpoints, its post-hoc EMA exports): `count` samples each with the
    study's sample.py options for the objective and classes of `export` (one of the run's), in
    <out>/sweeps/<run>/, scored by `scorer`."""
    from generation.export import read_description

    description = read_description(export)
    options = sample_options(budget, description.objective.kind, description.num_classes)
    folder = out / POINTS_FOLDER / run_name(arm, seed)
    return ScoredPoints(folder, count, options, scorer, command="a study", progress="quality")


def score_checkpoint(
    run_dir: Path, step: int, final: bool, budget: Budget, scorer: Scorer, out: Path, arm: Arm, seed: int
) -> dict[str, Any]:
    """Sample one checkpoint (final_samples of the final one, curve_samples of the others) and score it, or read
    the record a previous invocation wrote with the same settings (scored_points)."""
    export = checkpoint_export(run_dir, step)
    count = budget.final_samples if final else budget.curve_samples
    points = run_points(out, arm, seed, count, budget, scorer, export)
    return points.score(Point(str(export), f"{run_name(arm, seed)} step {step}", "cfg", 1.0))


def say_earlier_records(out: Path) -> None:
    """Say that score records of the format before scored_points (<out>/scores/<run>/step-XXXXXXX.json, which name
    no weights' sha256) are not read back: their checkpoints are sampled and scored again (the files stay)."""
    from generation.run_layout import STEP_PREFIX

    earlier = sorted((out / "scores").glob(f"*/{STEP_PREFIX}*.json"))
    if earlier:
        print(
            f"quality: {len(earlier)} score records of an earlier format in {out / 'scores'} are not read back (they "
            f"do not name the weights' sha256): their checkpoints are sampled and scored again into "
            f"{out / POINTS_FOLDER}",
            flush=True,
        )


def train_and_score(
    runs: list[tuple[Arm, int]], budget: Budget, out: Path, scorer: Scorer, config: Path
) -> tuple[dict[tuple[str, int], list[dict]], dict[str, float]]:
    """Train every run of `config` and score each of its checkpoints, run by run (skipping finished work, so that
    a study stopped early has its first runs scored); returns the scores per (arm, seed) and the wall time spent
    on training, sampling and scoring."""
    steps = checkpoint_steps(budget)
    say_earlier_records(out)
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
