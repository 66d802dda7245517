"""Study: the EMA length chosen after training (post-hoc EMA), and autoguidance, on the digits (issue 29).

    python -m studies.posthoc_digits                    # MHSA and VCA, 3 seeds each
    python -m studies.posthoc_digits --quick --out DIR  # smoke run (tiny model, 8 steps, 1 seed): the machinery only

On a CPU, prefix MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 (the Makefile's CPU_ALLOCATOR).

Every run trains configs/digits.yaml (the demo's 1.28M-parameter DiT-S/2, 2000 steps on the 1797 real 8x8 digits)
with train.py under the identical recipe, storing the power-function EMA profiles 0.05 and 0.10 (EDM2) every
max_steps / 40 steps beside the recipe's classic EMA (0.999 with warm-up); an arm changes only the attention, a
run only the seed. After training, `training.posthoc_ema` reconstructs the final weights for each sigma_rel of
the grid, and each is sampled class-balanced (DDIM 50 steps) without guidance and with classifier-free guidance
(scale 2), as is the classic EMA. Then each arm's best sigma_rel without guidance (mean FID over seeds) is
autoguided by the same run's classic-EMA export at 25 % of training (step 500: a short-trained, short-EMA version
of itself) and guided by CFG at one more scale, so that autoguidance can be compared with CFG at the same
classifier accuracy (per seed, CFG's FID interpolated along its accuracy curve). Scores are the demo's
(judges.digits, through studies.scorers.DigitsScorer): FID against the 1797 real digits and its SVC's accuracy.
Every setting is a point of sweep.py (sampled by sample.py's code, scored by fid's against the real digits'
statistics, written once to <out>/real-digits-<N>-statistics.npz), with the SVC's accuracy as its extra score.

Cost: Inception sets it (about 17 images/s on the 2-core CPU this was run on, so about a minute per scoring of
1000 samples): per run 2 classic + 2 x 5 sigma_rels + 3 autoguidance + 1 more CFG scale = 16 scorings, 96 for
the 6 runs (about 1.7 h), besides 6-10 min of training per run; the reconstruction itself takes seconds.
Resumable like every study: runs in <out>/runs/<arm>-seed<k>, reconstructions in each run's posthoc_exports/,
each run's points in <out>/sweeps/<arm>-seed<k>/ (samples and one score JSON per point); a rerun skips what it
scored before (same export, guidance and settings). Report: studies/results/posthoc-digits.{json,md,png} (--quick:
--out).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from studies.report import format_spread, spread, wall_time
from studies.runner import FULL as STUDY_FULL
from studies.runner import QUICK as STUDY_QUICK
from studies.runner import (
    REPO,
    SAMPLE_BATCH,
    SAMPLE_SEED,
    SAMPLERS,
    Arm,
    Budget,
    checkpoint_export,
    parse_study_arguments,
    run_name,
    study_parser,
    train_record,
    train_run,
)
from studies.scorers import INCEPTION_BATCH, DigitsScorer
from sweep import Point, Scoring, Sweep, posthoc_exports

CONFIG = REPO / "configs" / "digits.yaml"
STEM = "posthoc-digits"
STORED = (0.05, 0.10)  # the profiles tracked during training
SNAPSHOTS = 40  # per profile over the run (docs/training.md: at least 32)
GUIDE_FRACTION = 0.25  # the guide: the classic-EMA export at this fraction of training


@dataclass(frozen=True)
class Grid:
    """What is scored after training."""

    sigma_rels: tuple[float, ...]  # reconstructed, each without guidance and with CFG at cfg_scale
    cfg_scale: float
    autoguidance_scales: tuple[float, ...]  # on each arm's best sigma_rel, guided by the run's early export
    more_cfg_scales: tuple[float, ...]  # CFG on the best sigma_rel besides 1 and cfg_scale: the curve to match


FULL = replace(STUDY_FULL, curve_samples=1000)  # every setting is scored on the final model: 1000 samples
FULL_GRID = Grid((0.01, 0.03, 0.06, 0.12, 0.25), 2.0, (1.5, 2.0, 3.0), (1.5,))
# The studies' smoke budget for 8 steps (a snapshot at every step: 8 per profile).
QUICK = replace(STUDY_QUICK, max_steps=8, curve_samples=STUDY_QUICK.final_samples)
QUICK_GRID = Grid((0.03, 0.10), 2.0, (2.0,), (1.5,))


def arms(budget: Budget) -> tuple[Arm, ...]:
    every = max(1, budget.max_steps // SNAPSHOTS)
    profiles = (
        f"train.posthoc_ema.sigma_rel=[{','.join(map(str, STORED))}]",
        f"train.posthoc_ema.snapshot_every={every}",
    )
    return (
        Arm("mhsa", "MHSA", ("model.attention=mhsa", *profiles)),
        Arm("vca", "VCA", ("model.attention=vca", *profiles)),
    )


def sample_options(budget: Budget, kind: str, num_classes: int) -> list[str]:
    """sample.py's options for every point: the studies' deterministic sampler of the objective `kind` with the
    budget's steps, class-balanced labels of seed SAMPLE_SEED in batches of SAMPLE_BATCH on the CPU (the batches
    of studies.runner.score_export, which scored this study before sweep.py did), a grid of 12 rows of classes."""
    return [
        *("--sampler", SAMPLERS[kind], "--steps", str(budget.sampler_steps[kind])),
        *("--seed", str(SAMPLE_SEED), "--labels", "balanced", "--per-proc-batch-size", str(SAMPLE_BATCH)),
        *("--shard-size", str(4 * SAMPLE_BATCH), "--grid-size", str(12 * num_classes), "--cpu", "--precision", "fp32"),
    ]


def real_statistics(scorer: DigitsScorer, out: Path) -> Path:
    """The pool_3 statistics of the real digits the study compares with, as a REF file for sweep.py (once)."""
    from fid import StatisticsFile, save_statistics

    path = out / f"real-digits-{scorer.real_images}-statistics.npz"
    if not path.is_file():
        save_statistics(path, StatisticsFile(pool=scorer.real))
    return path


def run_sweep(
    sweeper: Sweep, arm: Arm, seed: int, export: Path, scale: float, guide: Path | None = None, **what: Any
) -> dict[str, Any]:
    """One setting of one run as a point of its sweep, and the study's row of it (the arm, seed and setting, FID,
    accuracy and what they were measured with)."""
    label = "classic EMA" if what["ema"] == "classic" else f"sigma_rel {what['sigma_rel']:g}"
    method = "autoguidance" if guide is not None else "cfg"
    record = sweeper.score(Point(str(export), label, method, scale, None if guide is None else str(guide)))
    scores = record["metrics"]
    return {
        "arm": arm.name,
        "seed": seed,
        "guidance": scale,
        **what,
        "method": method,
        "fid": scores["fid"],
        "accuracy": scores["accuracy"],
        "inception_weights": record["inception_weights"],
        "classifier_held_out_accuracy": scores["classifier_held_out_accuracy"],
        "settings": record["scoring"],
        "seconds": record["seconds"],
    }


def run_study(budget: Budget, grid: Grid, out: Path, report_dir: Path) -> dict[str, Any]:
    from bench._harness import save_results
    from generation import read_export

    scorer = DigitsScorer(budget.real_images)
    runs = [(arm, seed) for arm in arms(budget) for seed in budget.seeds]
    run_dirs = {(arm.name, seed): train_run(arm, seed, budget, out, CONFIG) for arm, seed in runs}
    final, guide_step = budget.max_steps, round(GUIDE_FRACTION * budget.max_steps)
    description = read_export(checkpoint_export(next(iter(run_dirs.values())), final)).description
    scoring = Scoring(str(real_statistics(scorer, out)), ("fid",), "bundled", INCEPTION_BATCH)
    options = sample_options(budget, description.objective.kind, description.num_classes)

    def extra_scores(images: np.ndarray, labels: np.ndarray) -> dict[str, float]:
        classifier = scorer.classifier
        return {
            "accuracy": classifier.accuracy(images, labels),
            "classifier_held_out_accuracy": classifier.held_out_accuracy,
        }

    sweeps = {
        (arm.name, seed): Sweep(
            out / "sweeps" / run_name(arm, seed), budget.final_samples, options, scoring, extra_scores, scorer.settings
        )
        for arm, seed in runs
    }
    rows: list[dict[str, Any]] = []
    for arm, seed in runs:
        run_dir, sweeper = run_dirs[(arm.name, seed)], sweeps[(arm.name, seed)]
        classic = checkpoint_export(run_dir, final)
        for scale in (1.0, grid.cfg_scale):
            rows.append(run_sweep(sweeper, arm, seed, classic, scale, ema="classic"))
        for sigma_rel, folder in posthoc_exports(run_dir, grid.sigma_rels, final).items():
            for scale in (1.0, grid.cfg_scale):
                rows.append(run_sweep(sweeper, arm, seed, folder, scale, ema="posthoc", sigma_rel=sigma_rel))
    best = best_sigma_rels(rows)
    for arm, seed in runs:
        run_dir, sweeper = run_dirs[(arm.name, seed)], sweeps[(arm.name, seed)]
        main = posthoc_exports(run_dir, [best[arm.name]], final)[best[arm.name]]
        guide = checkpoint_export(run_dir, guide_step)
        what = dict(ema="posthoc", sigma_rel=best[arm.name])
        for scale in grid.autoguidance_scales:
            rows.append(run_sweep(sweeper, arm, seed, main, scale, guide, **what))
        for scale in grid.more_cfg_scales:
            rows.append(run_sweep(sweeper, arm, seed, main, scale, **what))
    fits = {key: fit_records(run_dir, grid.sigma_rels, final) for key, run_dir in run_dirs.items()}
    results = summarise(rows, runs, budget, grid, best, guide_step, fits, out)
    markdown = render_markdown(results)
    save_results(report_dir, STEM, results, markdown, plot)
    print(markdown, flush=True)
    return results


def best_sigma_rels(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per arm, the reconstructed sigma_rel with the lowest mean FID over seeds without guidance."""
    means: dict[str, dict[float, list[float]]] = {}
    for row in rows:
        if row["ema"] == "posthoc" and row["guidance"] == 1.0:
            means.setdefault(row["arm"], {}).setdefault(row["sigma_rel"], []).append(row["fid"])
    return {arm: min(fids, key=lambda sigma_rel: np.mean(fids[sigma_rel])) for arm, fids in means.items()}


def fit_records(run_dir: Path, sigma_rels: Sequence[float], step: int) -> dict[float, dict[str, float]]:
    """Per sigma_rel, how well the stored profiles reconstruct it (the export description's `posthoc_ema`)."""
    from generation import read_export

    records = {
        sigma_rel: read_export(folder).description.posthoc_ema
        for sigma_rel, folder in posthoc_exports(run_dir, sigma_rels, step).items()
    }
    return {s: {"relative_error": r["relative_error"], "condition": r["condition"]} for s, r in records.items()}


def matched_accuracy(rows: list[dict[str, Any]], grid: Grid, sigma_rel: float) -> dict[str, Any]:
    """Autoguidance against CFG at the same classifier accuracy, per seed: CFG's FID at the accuracy each
    autoguidance scale reached, interpolated linearly along the seed's CFG points (scales 1, more_cfg_scales and
    cfg_scale on the same sigma_rel, ordered by accuracy); None where that accuracy lies outside them."""
    cfg_scales = sorted({1.0, grid.cfg_scale, *grid.more_cfg_scales})
    on_best = [row for row in rows if row["ema"] == "posthoc" and row["sigma_rel"] == sigma_rel]
    matched: dict[str, Any] = {}
    for scale in grid.autoguidance_scales:
        pairs = []
        for auto in (r for r in on_best if r["method"] == "autoguidance" and r["guidance"] == scale):
            curve = sorted(
                (r["accuracy"], r["fid"])
                for r in on_best
                if r["method"] == "cfg" and r["seed"] == auto["seed"] and r["guidance"] in cfg_scales
            )
            accuracies, fids = np.array(curve).T  # (points,), (points,)
            inside = accuracies[0] <= auto["accuracy"] <= accuracies[-1]
            cfg_fid = float(np.interp(auto["accuracy"], accuracies, fids)) if inside else None
            pairs.append({"seed": auto["seed"], "accuracy": auto["accuracy"], "fid": auto["fid"], "cfg_fid": cfg_fid})
        inside = [pair for pair in pairs if pair["cfg_fid"] is not None]
        matched[f"{scale:g}"] = {
            "per_seed": pairs,
            "cfg_fid": spread([pair["cfg_fid"] for pair in inside]) if inside else None,
            "difference": spread([pair["fid"] - pair["cfg_fid"] for pair in inside]) if inside else None,
        }
    return matched


def summarise(
    rows: list[dict[str, Any]],
    runs: list[tuple[Arm, int]],
    budget: Budget,
    grid: Grid,
    best: dict[str, float],
    guide_step: int,
    fits: dict[tuple[str, int], dict[float, dict[str, float]]],
    out: Path,
) -> dict[str, Any]:
    """Per arm and setting, FID and accuracy as mean and sd over seeds; autoguidance matched with CFG; the
    reconstructions' fit errors."""
    import torch

    from bench._harness import describe_device

    def setting(row: dict[str, Any]) -> str:
        if row["ema"] == "classic":
            return f"classic cfg {row['guidance']:g}"
        return f"sigma_rel {row['sigma_rel']:g} {row['method']} {row['guidance']:g}"

    grouped: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for row in rows:
        grouped.setdefault(row["arm"], {}).setdefault(setting(row), []).append(row)
    labels = {arm.name: arm.label for arm, _ in runs}
    seeds = budget.seeds
    arms_ = {
        name: {
            "label": labels[name],
            "best_sigma_rel": best[name],
            "matched_accuracy": matched_accuracy([r for r in rows if r["arm"] == name], grid, best[name]),
            "reconstruction": {
                f"{sigma_rel:g}": {
                    "relative_error": spread([fits[(name, seed)][sigma_rel]["relative_error"] for seed in seeds]),
                    "condition": max(fits[(name, seed)][sigma_rel]["condition"] for seed in seeds),
                }
                for sigma_rel in grid.sigma_rels
            },
            "settings": {
                key: {
                    **{field: group[0][field] for field in ("ema", "method", "guidance") if field in group[0]},
                    "sigma_rel": group[0].get("sigma_rel"),
                    "seeds": [row["seed"] for row in group],
                    "fid": spread([row["fid"] for row in group]),
                    "accuracy": spread([row["accuracy"] for row in group]),
                }
                for key, group in settings.items()
            },
        }
        for name, settings in grouped.items()
    }
    trainings = [train_record(out, arm, seed) for arm, seed in runs]
    some = rows[0]
    return {
        "config": str(CONFIG.relative_to(REPO)),
        "budget": budget.__dict__,
        "grid": grid.__dict__,
        "stored_profiles": list(STORED),
        "snapshot_every": max(1, budget.max_steps // SNAPSHOTS),
        "guide_step": guide_step,
        "arms": arms_,
        "scoring": {
            "real_images": some["settings"]["real_images"],
            "inception": some["inception_weights"],
            "classifier_held_out_accuracy": some["classifier_held_out_accuracy"],
        },
        "device": describe_device(torch.device("cpu")),
        "seconds": {
            "train": round(sum(json.loads(path.read_text())["seconds"] for path in trainings if path.is_file()), 1),
            "sample": round(sum(row["seconds"]["sample"] for row in rows), 1),
            "score": round(sum(row["seconds"]["score"] for row in rows), 1),
        },
    }


def render_markdown(results: dict[str, Any]) -> str:
    """Per arm: the best sigma_rel without and with CFG against the classic EMA, the FID and accuracy against
    sigma_rel, and autoguidance against CFG on the best sigma_rel; then the settings."""
    budget, grid, scoring = results["budget"], results["grid"], results["scoring"]
    cfg = grid["cfg_scale"]
    lines = []
    for entry in results["arms"].values():
        settings = entry["settings"]
        for scale in (1.0, cfg):
            fids = {key: value for key, value in settings.items() if key.endswith(f" cfg {scale:g}")}
            posthoc = {key: value for key, value in fids.items() if key.startswith("sigma_rel")}
            best = min(posthoc, key=lambda key: posthoc[key]["fid"]["mean"])
            classic = settings[f"classic cfg {scale:g}"]
            guidance = "without guidance" if scale == 1.0 else f"with CFG {scale:g}"
            lines.append(
                f"- **{entry['label']}, {guidance}: best sigma_rel {posthoc[best]['sigma_rel']:g}, FID "
                f"{format_spread(posthoc[best]['fid'])}** against {format_spread(classic['fid'])} for the classic "
                f"EMA (classifier accuracy {format_spread(posthoc[best]['accuracy'], percent=True)} against "
                f"{format_spread(classic['accuracy'], percent=True)})."
            )
    lines += ["", "| arm | sigma_rel | FID | accuracy | FID, CFG " + f"{cfg:g} | accuracy, CFG {cfg:g} |"]
    lines.append("|---|---|---|---|---|---|")
    for entry in results["arms"].values():
        settings = entry["settings"]
        for sigma_rel in [*grid["sigma_rels"], "classic"]:
            key = "classic cfg {}" if sigma_rel == "classic" else f"sigma_rel {sigma_rel:g} cfg {{}}"
            plain, guided = settings[key.format("1")], settings[key.format(f"{cfg:g}")]
            name = "classic EMA" if sigma_rel == "classic" else f"{sigma_rel:g}"
            lines.append(
                f"| {entry['label']} | {name} | {format_spread(plain['fid'])} | "
                f"{format_spread(plain['accuracy'], percent=True)} | {format_spread(guided['fid'])} | "
                f"{format_spread(guided['accuracy'], percent=True)} |"
            )
    lines += ["", *guidance_lines(results)]
    fits = ", ".join(
        f"{sigma_rel} {100 * fit['relative_error']['mean']:.2f} %"
        for sigma_rel, fit in next(iter(results["arms"].values()))["reconstruction"].items()
    )
    worst = max(fit["condition"] for entry in results["arms"].values() for fit in entry["reconstruction"].values())
    lines += [
        "",
        f"Reconstruction from the stored profiles (first arm, mean over seeds): profile fit error by sigma_rel "
        f"{fits}; largest Gram condition number {worst:.1e}.",
    ]
    lines += [
        "",
        f"Config {results['config']} with {', '.join(budget['model_overrides']) or 'no size overrides'}; stored "
        f"profiles sigma_rel {', '.join(map(str, results['stored_profiles']))} every {results['snapshot_every']} "
        f"steps. Sampling: DDIM {budget['sampler_steps']['diffusion']} steps, class-balanced, "
        f"{budget['final_samples']} samples per setting and seed. FID: Inception-v3 pool_3 ({scoring['inception']}) "
        f"against {scoring['real_images']} real digits. Classifier: the demo's SVC, "
        f"{100 * scoring['classifier_held_out_accuracy']:.1f} % on held-out real digits. What this scale can show: "
        f"how the best EMA length of an 8x8, 2000-step model moves with guidance and attention, and whether the "
        f"reconstruction and the guide work end to end; not ImageNet's best lengths or gains.",
        f"Device: {results['device']}. {wall_time(results['seconds'])}",
    ]
    return "\n".join(lines) + "\n"


def guidance_lines(results: dict[str, Any]) -> list[str]:
    """Autoguidance against CFG on each arm's best sigma_rel: the table, then each autoguidance scale against CFG
    at the same classifier accuracy."""
    grid = results["grid"]
    lines = [
        f"Autoguidance by the step-{results['guide_step']} classic-EMA export against CFG, on each arm's best "
        "sigma_rel without guidance:",
        "",
        "| arm | sigma_rel | method | scale | FID | accuracy |",
        "|---|---|---|---|---|---|",
    ]
    cfg_scales = sorted({1.0, grid["cfg_scale"], *grid["more_cfg_scales"]})
    for entry in results["arms"].values():
        sigma_rel = entry["best_sigma_rel"]
        methods = [("cfg", cfg_scales), ("autoguidance", grid["autoguidance_scales"])]
        for method, scales in methods:
            for scale in scales:
                row = entry["settings"][f"sigma_rel {sigma_rel:g} {method} {scale:g}"]
                lines.append(
                    f"| {entry['label']} | {sigma_rel:g} | {method} | {scale:g} | {format_spread(row['fid'])} | "
                    f"{format_spread(row['accuracy'], percent=True)} |"
                )
    lines.append("")
    for entry in results["arms"].values():
        for scale, match in entry["matched_accuracy"].items():
            seeds = len(match["per_seed"])
            if match["difference"] is None:
                lines.append(
                    f"- {entry['label']}, autoguidance {scale}: its accuracy lies outside CFG's scales "
                    f"{', '.join(f'{s:g}' for s in cfg_scales)} for every seed (no match)."
                )
                continue
            inside = len(match["difference"]["values"])
            auto = entry["settings"][f"sigma_rel {entry['best_sigma_rel']:g} autoguidance {scale}"]
            lines.append(
                f"- {entry['label']}, autoguidance {scale} (accuracy {format_spread(auto['accuracy'], percent=True)}):"
                f" FID minus CFG's at the same accuracy {format_spread(match['difference'])} "
                f"(CFG {format_spread(match['cfg_fid'])}; {inside} of {seeds} seeds within CFG's accuracy range)."
            )
    return lines


def plot(results: dict[str, Any]):
    """Left: FID against sigma_rel (log scale), per arm without guidance (solid) and with CFG (dashed), the classic
    EMA as a faint horizontal line of the arm's colour. Right: FID against classifier accuracy on each arm's best
    sigma_rel, CFG's scales joined by a line, autoguidance's as squares (means over seeds)."""
    from bench._harness import subplots

    grid = results["grid"]
    figure, (sweep, trade) = subplots(1, 2, figsize=(12, 4.5))
    cfg_scales = sorted({1.0, grid["cfg_scale"], *grid["more_cfg_scales"]})
    for index, entry in enumerate(results["arms"].values()):
        colour, settings = f"C{index}", entry["settings"]
        for scale, style in ((1.0, "-"), (grid["cfg_scale"], "--")):
            fids = [settings[f"sigma_rel {s:g} cfg {scale:g}"]["fid"]["mean"] for s in grid["sigma_rels"]]
            guidance = "no guidance" if scale == 1.0 else f"CFG {scale:g}"
            sweep.plot(grid["sigma_rels"], fids, style, color=colour, marker="o", label=f"{entry['label']}, {guidance}")
            classic = settings[f"classic cfg {scale:g}"]["fid"]["mean"]
            sweep.axhline(classic, color=colour, linestyle=style, alpha=0.35, linewidth=1)
        best = f"sigma_rel {entry['best_sigma_rel']:g}"
        for method, scales, style in (("cfg", cfg_scales, "-o"), ("autoguidance", grid["autoguidance_scales"], "s")):
            points = [settings[f"{best} {method} {scale:g}"] for scale in scales]
            accuracies = [100 * point["accuracy"]["mean"] for point in points]
            trade.plot(
                accuracies,
                [point["fid"]["mean"] for point in points],
                style,
                color=colour,
                label=f"{entry['label']}, {method} ({', '.join(f'{s:g}' for s in scales)})",
            )
    sweep.set_xscale("log")
    sweep.set_xlabel("sigma_rel (post-hoc EMA); faint lines: the classic EMA")
    sweep.set_ylabel(f"FID ({results['budget']['final_samples']} samples)")
    sweep.set_title("FID against the EMA length")
    trade.set_xlabel("classifier accuracy (%)")
    trade.set_ylabel("FID")
    trade.set_title("best sigma_rel: CFG against autoguidance")
    for axis in (sweep, trade):
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    return figure


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = study_parser(
        "python -m studies.posthoc_digits",
        __doc__,
        Path("results/posthoc-digits"),
        f"{STEM}.{{json,md,png}}",
        "tiny model, 8 steps, 1 seed, 2 sigma_rels",
    )
    return parse_study_arguments(parser, argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_arguments(argv)
    from training.config import load_config

    if args.quick:
        budget, grid = QUICK, QUICK_GRID
    else:
        budget, grid = replace(FULL, max_steps=load_config(CONFIG).train.max_steps), FULL_GRID
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    return run_study(budget, grid, out, args.report_dir)


if __name__ == "__main__":
    main()
