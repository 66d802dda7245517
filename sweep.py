"""Sample and score a sweep in one process: exports (or post-hoc EMA lengths of a run) x guidance x scale.

    python sweep.py --ckpt results/digits --guidance none cfg --scales 1.5 2 3 --ref real-digits.npz \\
        --num-samples 1000 --out sweeps/digits-cfg -- --sampler ddim --steps 50
    python sweep.py --run results/digits --sigma-rel 0.05 0.1 0.2 --guidance cfg autoguidance --scales 1.5 2 \\
        --guide-ckpt results/digits/exports/step-0000500 --ref real-digits.npz --num-samples 1000 --out sweeps/ema

A point is one export, one guidance (`none`; classifier-free `cfg`; `autoguidance` by --guide-ckpt) and one
scale. Exports are --ckpt's (anything sample.py --ckpt takes; `NAME=PATH` names one in the table) and, with --run
and --sigma-rel, post-hoc EMA reconstructions of that run (training.posthoc_ema; made once, into the run's
posthoc_exports/, and reused). Every point is sampled by sample.py's own code (`sample.main`, with the sample.py
options after `--`: sampler, steps, seed, labels, batch and shard sizes, precision, --cpu, ...) into
<out>/samples/<point>.npz, and scored by fid's (`fid.evaluate`, as `python -m fid SAMPLES REF`): its numbers are
those of separate sample.py and `python -m fid` runs with the same options. What one process saves is the
start-up of two per point (importing torch and the model packages) and Inception's loading, once per sweep.

Resumable: each point's score is one JSON in <out>/scores/, written atomically with the settings it was made
with (scored_points: the points, samples and records that sweep.py shares with the studies); a rerun skips the
points scored with the same settings (and says how many), and a point killed while sampling
continues from its finished shards (sample.py). fid's warning of sets too small for an unbiased FID comes once per
sweep. The sweep ends with <out>/sweep.json (every point's record), <out>/sweep.md (the table) and <out>/sweep.png
(FID against the guidance scale, one line per export and guidance, the samples per point in its title). One process (one
GPU or the CPU): for 8 GPUs per point, use sample.py and `python -m fid` themselves. A bad argument, a REF that is
missing or cannot give a metric asked for, a sample.py option that sample.py refuses, an export that is missing,
damaged or cannot serve the options, or a file in --out that sweep.py (or sample.py) did not write is one line and
exit status 2 before anything is reconstructed or sampled (the exports --run reconstructs: before the first point).
A record names the sha256 of the weights its samples came from: an export replaced in place is never read back
as the old one. One sweep at a time writes into an --out (a lock; a second is refused at once).
"""

from __future__ import annotations

import argparse
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atomic_files import atomic_output, check_writable, write_json_atomic, write_text_atomic
from atomic_files.folder_lock import lock_folder, lock_holder, release_folder
from atomic_files.ownership import json_object_with, refuse_foreign
from commands import CommandParser, UserError, check_device, run_command
from fid.inputs import existing_input
from fid.reference import resolve_input
from fid.request import DEFAULT_BATCH_SIZE, METRICS, check_request
from scored_points import COLUMN_NAMES, FidScorer, Point, ScoredPoints, describe

if TYPE_CHECKING:
    from matplotlib.figure import Figure

GUIDANCE_KINDS = ("none", "cfg", "autoguidance")
# Flags each point sets itself, which the sample.py options after `--` may not give.
POINT_FLAGS = ("--ckpt", "--out", "--num-samples", "--cfg-scale", "--guide-ckpt", "--guidance-scale", "--overwrite")
STEM = "sweep"  # <out>/sweep.{json,md,png}
REPORT_KEYS = ("num_samples", "sample_options", "points")  # what makes <out>/sweep.json sweep.py's


class SweepError(UserError):
    """A sweep that cannot run as asked (the message names the argument)."""


def check_points(sweep: ScoredPoints, points: Sequence[Point], not_made: Sequence[str] = ()) -> None:
    """Refuse, before anything is sampled, what would stop any point later: sample.py options that a point sets
    itself or that sample.py refuses for a point (the output folder is made first: sample.py checks that it
    exists); an export (or guide) that is missing, damaged or holds NaN weights, or that cannot serve the
    options (another objective's sampler or sampler options, guidance without a null class, a guide of other
    inputs); a point's files in --out that sweep.py or sample.py did not write, or that another run (other
    weights, other options) wrote. Of a point whose label is in `not_made` (a reconstruction still to come),
    only the arguments."""
    import sample
    from generation import ExportError, load_export
    from generation.autoguide import guide_mismatch
    from generation.official import OfficialCheckpointError
    from generation.sample_file import SampleFiles
    from sample_arguments import check_against, check_args, parse_args

    for option in sweep.sample_options:
        flag = option.split("=")[0]
        if flag.startswith("--") and any(owned.startswith(flag) for owned in POINT_FLAGS):  # also abbreviated
            raise SweepError(f"the sample.py options after -- give {flag}, which each point sets itself")
    sweep.samples_folder.mkdir(parents=True, exist_ok=True)
    descriptions: dict[str, Any] = {}  # --ckpt or --guide-ckpt -> its export's description, each read once

    def description(args: argparse.Namespace, ckpt: str, option: str):
        if ckpt not in descriptions:
            official = (args.model, args.image_size) if option == "--ckpt" else (None, None)
            try:  # the weights are read: NaN or infinity is refused
                descriptions[ckpt] = load_export(ckpt, *official).description
            except (ExportError, OfficialCheckpointError) as error:
                raise SweepError(f"{option}: {error}") from None
        return descriptions[ckpt]

    for point in points:
        args = parse_args(sweep.sample_argv(point))
        check_args(args)
        if point.label in not_made:
            continue
        model = description(args, point.ckpt, "--ckpt")
        check_against(model, args)
        if point.guide is not None:
            mismatch = guide_mismatch(model, description(args, point.guide, "--guide-ckpt"))
            if mismatch is not None:
                name, ours, theirs = mismatch
                raise SweepError(
                    f"--guide-ckpt {point.guide}: its {name} is {theirs!r}, that of {point.label} ({point.ckpt}) "
                    f"{ours!r}; a guide needs the model's objective, inputs and classes"
                )
        sweep.refuse_foreign(point)
        SampleFiles(sweep.samples_path(point)).claim(sample.run_settings(args))


def is_report(path: Path) -> bool:
    """Whether `path` is the <out>/sweep.json that sweep.py wrote (it vouches for sweep.md and sweep.png)."""
    return json_object_with(path, REPORT_KEYS)


# ----------------------------------------------------------------------------------------------------------------
#                                         Exports and points
# ----------------------------------------------------------------------------------------------------------------


def posthoc_exports(run_dir: Path, sigma_rels: Sequence[float], step: int | None = None) -> dict[float, Path]:
    """The post-hoc EMA export of each sigma_rel at `step` (None: the run's newest snapshot), in the run's
    posthoc_exports/ (training.posthoc_ema's default), reconstructed where it is missing."""
    from generation.export import EXPORT_CONFIG
    from generation.run_layout import POSTHOC_EXPORTS_FOLDER, posthoc_export_folder
    from training.posthoc_ema import choose_snapshots, reconstruct, stored_profiles

    step = choose_snapshots(stored_profiles(run_dir), run_dir, step)[-1].step
    out = run_dir / POSTHOC_EXPORTS_FOLDER
    folders = {sigma_rel: posthoc_export_folder(out, sigma_rel, step) for sigma_rel in sigma_rels}
    missing = [sigma_rel for sigma_rel, folder in folders.items() if not (folder / EXPORT_CONFIG).is_file()]
    if missing:
        print(f"sweep: reconstructing sigma_rel {', '.join(f'{s:g}' for s in missing)} of {run_dir}", flush=True)
        reconstruct(run_dir, missing, step)
    return folders


def named_exports(ckpts: Sequence[str]) -> dict[str, str]:
    """Label -> --ckpt text of each `NAME=PATH` or `PATH` (labelled by itself)."""
    exports: dict[str, str] = {}
    for item in ckpts:
        label, _, path = item.partition("=") if "=" in item else (item, "", item)
        if not label or not path:
            raise SweepError(f"--ckpt {item!r}: expected PATH or NAME=PATH")
        if label in exports:
            raise SweepError(f"--ckpt: two exports are named {label!r}; name them apart with NAME=PATH")
        exports[label] = path
    return exports


def sweep_points(
    exports: dict[str, str], guidance: Sequence[str], scales: Sequence[float], guide: str | None
) -> list[Point]:
    """Every export x guidance x scale, in that order; `none` is cfg at scale 1 (the same samples), listed once."""
    points: list[Point] = []
    for label, ckpt in exports.items():
        for kind in guidance:
            for scale in (1.0,) if kind == "none" else scales:
                kind_of_point = "cfg" if kind == "none" else kind
                point = Point(ckpt, label, kind_of_point, scale, guide if kind == "autoguidance" else None)
                if point not in points:
                    points.append(point)
    names = [point.name for point in points]
    if len(set(names)) < len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise SweepError(f"--ckpt: two points would share the file name {twice}; name the exports with NAME=PATH")
    return points


# ----------------------------------------------------------------------------------------------------------------
#                                                 Report
# ----------------------------------------------------------------------------------------------------------------


def render_markdown(records: Sequence[dict[str, Any]], num_samples: int, sample_options: Sequence[str]) -> str:
    """The table (one row per point, in sweep order), its lowest FID, and what every point shares."""
    columns = list(records[0]["metrics"])
    lines = [
        "| export | training step | guidance | scale | " + " | ".join(COLUMN_NAMES.get(c, c) for c in columns) + " |",
        "|---|---|---|---|" + "---|" * len(columns),
    ]
    for record in records:
        point = Point(**record["point"])
        values = " | ".join(f"{record['metrics'][column]:.4f}" for column in columns)
        step = "n/a" if record["train_step"] is None else record["train_step"]  # official checkpoints have none
        guidance = "none" if point.unguided else point.guidance
        lines.append(f"| {point.label} | {step} | {guidance} | {point.scale:g} | {values} |")
    lines.append("")
    if "fid" in columns:
        best = min(records, key=lambda record: record["metrics"]["fid"])
        lines.append(f"Lowest FID: {best['metrics']['fid']:.4f} ({describe(Point(**best['point']))}).")
    first = records[0]
    guides = sorted({record["point"]["guide"] for record in records if record["point"]["guide"]})
    lines += [
        "",
        f"{num_samples} samples per point (sample.py {' '.join(sample_options) or 'defaults'}"
        + (f"; autoguidance by {', '.join(guides)}" if guides else "")
        + f"), scored against {first['scoring']['ref']} with Inception {first['inception_weights']}.",
    ]
    return "\n".join(lines) + "\n"


def plot(records: Sequence[dict[str, Any]]) -> Figure:
    """FID against the guidance scale: one colour per export, solid for cfg (its scale 1 is no guidance), dashed
    for autoguidance. Drawn without pyplot: no display backend is chosen or needed."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5))
    axis = figure.subplots()
    labels = list(dict.fromkeys(record["point"]["label"] for record in records))
    for index, label in enumerate(labels):
        for kind, style in (("cfg", "-o"), ("autoguidance", "--s")):
            line = sorted(
                (record["point"]["scale"], record["metrics"]["fid"])
                for record in records
                if record["point"]["label"] == label and record["point"]["guidance"] == kind
            )
            if line:
                scales, fids = zip(*line)
                axis.plot(scales, fids, style, color=f"C{index}", label=f"{label}, {kind}")
    axis.set_xlabel("guidance scale (cfg 1: no guidance)")
    axis.set_ylabel("FID")
    axis.set_title(f"FID of {records[0]['sampling']['num_samples']:,} samples per point against the guidance scale")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    return figure


def write_report(out: Path, records: list[dict[str, Any]], num_samples: int, sample_options: Sequence[str]) -> None:
    """<out>/sweep.json, sweep.md and (with FID) sweep.png, each replaced atomically."""
    write_json_atomic(
        out / f"{STEM}.json", {"num_samples": num_samples, "sample_options": list(sample_options), "points": records}
    )
    write_text_atomic(out / f"{STEM}.md", render_markdown(records, num_samples, sample_options))
    if "fid" in records[0]["metrics"]:  # every point has the same metrics
        with atomic_output(out / f"{STEM}.png") as path:
            plot(records).savefig(path, format="png", dpi=110)


# ----------------------------------------------------------------------------------------------------------------
#                                                  Command
# ----------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="sweep.py", description=__doc__)
    add = parser.add_argument
    add("--ckpt", nargs="+", default=[], metavar="[NAME=]PATH", help="exports to sweep (as sample.py --ckpt)")
    add("--run", type=Path, help="a run folder with post-hoc EMA snapshots, for --sigma-rel")
    add("--sigma-rel", type=float, nargs="+", default=[], help="post-hoc EMA lengths of --run to sweep")
    add("--step", type=int, help="--run's snapshot step to reconstruct at (default: the newest)")
    add("--guidance", nargs="+", choices=GUIDANCE_KINDS, default=["cfg"], help="guidance kinds (default: cfg)")
    add("--scales", type=float, nargs="+", default=[], help="scales of cfg and autoguidance (1: none)")
    add("--guide-ckpt", help="the guide of autoguidance points (as sample.py --guide-ckpt)")
    add("--num-samples", type=int, required=True, help="samples per point")
    add("--out", type=Path, required=True, help="folder of the samples, scores and report (a rerun continues it)")
    add("--ref", required=True, help="REF of python -m fid: reference images or statistics, or a name like imagenet256")
    add("--metrics", default="fid", help=f"comma-separated subset of {','.join(METRICS)} (default: fid)")
    add("--weights", help="Inception weights, as python -m fid --weights")
    add("--inception-batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="as python -m fid --batch-size")
    add("--device", help="Inception's torch device (default: cuda when available); sampling's: sample.py's --cpu")
    return parser


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The sweep's arguments and the sample.py options after `--`."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    return build_parser().parse_args(argv[:split]), argv[split + 1 :]


def check_args(args: argparse.Namespace) -> tuple[str, ...]:
    """Refuse what cannot work before anything is loaded or written; the metrics asked for."""
    if not args.ckpt and not args.sigma_rel:
        raise SweepError("nothing to sweep: give --ckpt exports, or --run RUN with --sigma-rel")
    if (args.run is None) != (not args.sigma_rel):
        raise SweepError("--run and --sigma-rel come together (post-hoc EMA reconstructions of a run)")
    if args.run is not None and not args.run.is_dir():
        raise SweepError(f"--run {args.run}: no such run folder")
    guided = [kind for kind in args.guidance if kind != "none"]
    if guided and not args.scales:
        raise SweepError(f"--guidance {' '.join(guided)} needs --scales")
    for scale in args.scales:
        if not math.isfinite(scale) or scale < 0:
            raise SweepError(f"--scales: {scale} is not a finite number >= 0")
    if ("autoguidance" in args.guidance) != (args.guide_ckpt is not None):
        raise SweepError("--guidance autoguidance and --guide-ckpt come together (the guide of its points)")
    if args.num_samples <= 0:
        raise SweepError(f"--num-samples must be positive, got {args.num_samples}")
    metrics = tuple(metric.strip() for metric in args.metrics.split(",") if metric.strip())
    check_request(metrics, args.ref, None, args.inception_batch_size, None)
    check_reference(args.ref, metrics, args.num_samples)
    if args.out.exists() and not args.out.is_dir():
        raise SweepError(f"--out {args.out} exists and is not a folder")
    if not args.out.parent.is_dir():
        check_writable(args.out.parent)  # a file where a folder should be is named as such
        raise SweepError(f"--out {args.out}: folder {args.out.parent} does not exist")
    check_writable(args.out if args.out.is_dir() else args.out.parent)
    report = args.out / f"{STEM}.json"
    refuse_foreign(report, is_report, "sweep.py", choose="choose another --out")
    for suffix in (".md", ".png"):  # vouched for by sweep.json
        refuse_foreign(report.with_suffix(suffix), lambda _: report.exists(), "sweep.py", choose="choose another --out")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SweepError("sweep.py runs as one process (one GPU or the CPU); launch it without accelerate/torchrun")
    if args.device is not None:
        check_device(args.device, "--device")
    return metrics


def claim_out(out: Path) -> None:
    """Make --out and hold its lock (atomic_files.folder_lock) until the process ends: a second sweep into the same
    folder is refused at once, instead of sampling the same points and replacing the report of the first."""
    out.mkdir(exist_ok=True)
    if not lock_folder(out):
        raise SweepError(
            f"--out {out} is being written by another sweep.py right now ({lock_holder(out)}): wait for it to "
            f"finish (its points are then kept), or choose another --out"
        )


def check_reference(ref: str, metrics: Sequence[str], num_samples: int) -> None:
    """REF exists and can give every metric asked for (precision/recall needs its images), and the samples are
    enough for them (the Inception Score's splits): fid's own checks, made before the first point is sampled."""
    from fid.class_divergence import IS_SPLIT_SIZE
    from fid.evaluation import choose_metrics, plan_input
    from fid.inputs import EvaluationInput, open_input
    from fid.statistics import StatisticsFile

    reference = open_input(existing_input(resolve_input(ref)))
    if "is" in metrics and num_samples < IS_SPLIT_SIZE:
        raise SweepError(
            f"--metrics is: the Inception Score needs --num-samples {IS_SPLIT_SIZE} or more, got {num_samples}"
        )
    samples = EvaluationInput(Path(str(num_samples)), range(num_samples), StatisticsFile())  # not yet sampled
    choose_metrics(metrics, samples, reference)
    with warnings.catch_warnings():  # fid's warning of a small set comes with each point's score
        warnings.simplefilter("ignore")
        plan_input(samples, "--num-samples", set(metrics), wants_statistics=False)  # enough images for each metric


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Parse and check, reconstruct the post-hoc EMA exports, sample and score every point, write the report."""
    args, sample_options = parse_args(argv or [])
    metrics = check_args(args)
    exports = named_exports(args.ckpt)
    scorer = FidScorer(args.ref, metrics, args.weights, args.inception_batch_size, args.device)
    sweep = ScoredPoints(args.out, args.num_samples, sample_options, scorer)
    claim_out(args.out)
    try:
        posthoc = {f"sigma_rel {sigma_rel:g}": str(args.run) for sigma_rel in args.sigma_rel}
        all_points = sweep_points(exports | posthoc, args.guidance, args.scales, args.guide_ckpt)
        check_points(sweep, all_points, not_made=posthoc)
        if args.sigma_rel:  # reconstructed once every argument is known to be good
            folders = posthoc_exports(args.run, args.sigma_rel, args.step)
            exports |= {f"sigma_rel {sigma_rel:g}": str(folder) for sigma_rel, folder in folders.items()}
        points = sweep_points(exports, args.guidance, args.scales, args.guide_ckpt)
        check_points(sweep, [point for point in points if point.label in posthoc])  # before the first is sampled
        kept = sum(sweep.stored(point) is not None for point in points)
        if kept:
            print(
                f"sweep: {kept} of {len(points)} points already scored with these settings in {args.out}: read "
                "back, not sampled again",
                flush=True,
            )
        records = [sweep.score(point) for point in points]
        write_report(args.out, records, args.num_samples, sample_options)
    finally:
        release_folder(args.out)
    print(render_markdown(records, args.num_samples, sample_options), end="")
    print(f"sweep: wrote {args.out / STEM}.json, .md and .png")
    return records


def command() -> None:
    """The installed command's entry point: a user error is one line and exit status 2."""
    run_command(main)


if __name__ == "__main__":
    command()
