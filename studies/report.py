"""The pieces of a study's report: per-seed figures as mean and spread, the honest reading of two arms' FIDs, the
Markdown tables of final scores and of FID against training step, and the plot of that curve.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from studies.runner import REPO, Arm, Budget


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
    config: Path,
) -> dict[str, Any]:
    """The stage's results: per arm the final FID and accuracy over seeds, and every run's FID and accuracy
    curves; `scores` holds each run's records (scored_points), one per checkpoint, the final one last."""
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
                **({"config": str(arm.config.relative_to(REPO))} if arm.config is not None else {}),
                "seeds": [],
                "fid": [],
                "accuracy": [],
                "curves": {},
                "accuracy_curves": {},
            },
        )
        entry["seeds"].append(seed)
        entry["fid"].append(final["metrics"]["fid"])
        entry["accuracy"].append(final["metrics"]["accuracy"])
        rows = [(row["train_step"], row["metrics"]) for row in scores[(arm.name, seed)]]
        entry["curves"][str(seed)] = [[step, metrics["fid_curve"]] for step, metrics in rows]
        entry["accuracy_curves"][str(seed)] = [[step, metrics["accuracy"]] for step, metrics in rows]
    for entry in arms.values():
        entry["fid"], entry["accuracy"] = spread(entry["fid"]), spread(entry["accuracy"])
    some = scores[(runs[0][0].name, runs[0][1])][-1]
    scoring = {
        "real_images": some["scoring"]["real_images"],
        "inception": some["inception_weights"],
        "classifier_held_out_accuracy": some["metrics"]["classifier_held_out_accuracy"],
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
    if len(sds) < 2:  # Welch's test needs a variance in each arm
        welch = "no Welch test: one arm has a single seed"
    else:
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


def plot(results: dict[str, Any], title: str):
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
    axis.set_title(title)
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    return figure
