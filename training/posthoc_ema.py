"""Post-hoc EMA (EDM2), reconstructed after training: any EMA length from the snapshots of the power-function
averages that training stored (training.power_ema).

    python -m training.posthoc_ema RUN_DIR --list
    python -m training.posthoc_ema RUN_DIR --sigma-rel 0.03 0.07 0.12 [--step N] [--out DIR]

solves EDM2's least-squares problem over every snapshot at or before step N (default: the newest) and writes one
export folder per sigma_rel (default under RUN_DIR/posthoc_exports/), which sample.py --ckpt, the diffusers
converter and generation.load_export take like any other; its description's `posthoc_ema` records sigma_rel,
the step, the snapshots used with their coefficients, the fit's relative error and the Gram matrix's condition.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors import SafetensorError, safe_open

from atomic_files import atomic_folder, check_writable
from atomic_files.ownership import refuse_foreign
from commands import CommandParser, UserError, run_command
from generation.run_layout import (
    POSTHOC_EXPORTS_FOLDER,
    PROFILE_FILES,
    SNAPSHOT_DESCRIPTION,
    SNAPSHOT_FOLDER,
    posthoc_export_folder,
)
from training.power_ema import snapshot_folders
from training.power_profiles import SIGMA_REL_MAX, reconstruct_profile, sigma_rel_to_gamma

# torch, safetensors.torch and generation.export (seconds to import) are imported where they are used, so that
# `python -m training.posthoc_ema --help` and a bad argument answer at once.
if TYPE_CHECKING:
    import torch

    from generation.export import ExportDescription

MIN_SNAPSHOTS = 4  # fewer stored profiles span too little to reconstruct anything but themselves


class PosthocEMAError(UserError):
    """A reconstruction that cannot be made (no snapshots, a step without one, sigma_rel out of range, ...)."""


@dataclass(frozen=True)
class StoredProfile:
    """One profile's average in one snapshot."""

    step: int
    images: int
    sigma_rel: float
    gamma: float
    file: Path


def stored_profiles(run_root: str | Path) -> list[StoredProfile]:
    """Every stored profile of a run's complete snapshots, by step then sigma_rel (headers only: no weights are
    read). A profile whose header names another step than its folder (a snapshot copied into another step's
    folder), or the same profile twice, is refused: it would enter the fit as a profile it is not."""
    profiles: dict[tuple[int, float], StoredProfile] = {}
    for snapshot in snapshot_folders(Path(run_root)):
        if not snapshot.complete:
            continue
        for file in sorted(snapshot.folder.glob(PROFILE_FILES)):
            profile = _read_profile_header(file)
            if profile.step != snapshot.step:
                raise PosthocEMAError(
                    f"{file} holds the profile of step {profile.step} (its header), not of step {snapshot.step} "
                    f"(its folder): a snapshot copied into another step's folder? Remove it"
                )
            twin = profiles.setdefault((profile.step, profile.sigma_rel), profile)
            if twin is not profile:
                raise PosthocEMAError(
                    f"{file} and {twin.file} hold the same profile (sigma_rel {profile.sigma_rel:g} at step "
                    f"{profile.step}); remove one"
                )
    return sorted(profiles.values(), key=lambda profile: (profile.step, profile.sigma_rel))


def _read_profile_header(file: Path) -> StoredProfile:
    try:
        with safe_open(file, framework="pt") as header:
            values = header.metadata()
        return StoredProfile(
            int(values["step"]), int(values["images"]), float(values["sigma_rel"]), float(values["gamma"]), file
        )
    except (SafetensorError, OSError, KeyError, TypeError, ValueError) as error:
        raise PosthocEMAError(f"{file} cannot be read as a post-hoc EMA snapshot ({error})") from None


def incomplete_snapshots(run_root: str | Path) -> list[Path]:
    """Snapshot folders that `stored_profiles` leaves out, for --list to name."""
    return [snapshot.folder for snapshot in snapshot_folders(Path(run_root)) if not snapshot.complete]


def choose_snapshots(profiles: list[StoredProfile], run_root: Path, step: int | None) -> list[StoredProfile]:
    """The profiles stored at or before `step` (None: the newest snapshot step), with the one-line refusals."""
    if not profiles:
        raise PosthocEMAError(
            f"{run_root} holds no post-hoc EMA snapshots ({SNAPSHOT_FOLDER}/ is missing or empty); train with "
            f"train.posthoc_ema.sigma_rel=[0.05,0.1] to store them"
        )
    steps = sorted({profile.step for profile in profiles})
    step = steps[-1] if step is None else step
    if step not in steps:
        shown = ", ".join(map(str, steps[:8])) + (f", ... {steps[-1]}" if len(steps) > 8 else "")
        raise PosthocEMAError(f"--step {step}: {run_root} has no snapshot at that step; snapshot steps: {shown}")
    used = [profile for profile in profiles if profile.step <= step]
    if len(used) < MIN_SNAPSHOTS:
        raise PosthocEMAError(
            f"--step {step}: only {len(used)} stored profile(s) at or before it in {run_root}; a reconstruction "
            f"needs at least {MIN_SNAPSHOTS} (store more often: train.posthoc_ema.snapshot_every)"
        )
    return used


def check_sigma_rel(sigma_rel: float) -> None:
    if not 0 < sigma_rel < SIGMA_REL_MAX:
        raise PosthocEMAError(f"--sigma-rel {sigma_rel}: expected a value in (0, {SIGMA_REL_MAX:.6f})")


@dataclass(frozen=True)
class PosthocExport:
    """A reconstruction of one sigma_rel: the export folder it went to and its record."""

    folder: Path
    record: dict[str, Any]


def reconstruct(
    run_root: str | Path, sigma_rels: Sequence[float], step: int | None = None, out: str | Path | None = None
) -> list[PosthocExport]:
    """Write one export per sigma_rel, the least-squares combination of every profile stored at or before `step`
    (the newest snapshot step when None), into `out` (default RUN/posthoc_exports); returns what was written."""
    from generation.export import write_export

    run_root = Path(run_root)
    for sigma_rel in sigma_rels:
        check_sigma_rel(sigma_rel)
    used = choose_snapshots(stored_profiles(run_root), run_root, step)
    step = used[-1].step
    target_images = used[-1].images
    description = _read_snapshot_description(used[-1].file.parent)
    out = Path(out) if out is not None else run_root / POSTHOC_EXPORTS_FOLDER
    check_writable(out)  # a file, or a read-only folder, is refused before any weights are read
    times = np.array([profile.images for profile in used], np.float64)
    gammas = np.array([profile.gamma for profile in used], np.float64)
    plans = []
    for sigma_rel in sigma_rels:
        gamma = sigma_rel_to_gamma(sigma_rel)
        solution = reconstruct_profile(times, gammas, target_images, gamma)
        folder = posthoc_export_folder(out, sigma_rel, step)
        _check_replaceable(folder)
        record = {
            "sigma_rel": sigma_rel,
            "gamma": gamma,
            "step": step,
            "images": target_images,
            "relative_error": solution.relative_error,
            "condition": solution.condition,
            "snapshots": [
                {"step": p.step, "sigma_rel": p.sigma_rel, "coefficient": float(c)}
                for p, c in zip(used, solution.coefficients)
            ],
        }
        plans.append((folder, record, solution.coefficients))
    weights = _combine([profile.file for profile in used], [coefficients for _, _, coefficients in plans])
    written = []
    for (folder, record, _), combined in zip(plans, weights):
        export = replace(
            description,
            train_step=step,
            source=f"post-hoc EMA sigma_rel {record['sigma_rel']:g} of {run_root.resolve()}",
            posthoc_ema=record,
        )
        with atomic_folder(folder) as temporary:
            write_export(temporary, combined, export)
        written.append(PosthocExport(folder, record))
    return written


def _combine(files: list[Path], coefficients: list[np.ndarray]) -> list[dict[str, torch.Tensor]]:
    """For each coefficient vector, sum_i c_i * (weights of files[i]) in float64, each file read once."""
    from safetensors.torch import load_file

    sums: list[dict[str, torch.Tensor]] = [{} for _ in coefficients]
    for i, file in enumerate(files):
        try:
            weights = load_file(file)
        except (SafetensorError, OSError) as error:
            raise PosthocEMAError(f"{file} cannot be read as safetensors ({error})") from None
        for total, vector in zip(sums, coefficients):
            for key, value in weights.items():
                term = float(vector[i]) * value.double()
                total[key] = total[key] + term if key in total else term
    return sums


def _read_snapshot_description(folder: Path) -> ExportDescription:
    from generation.export import ExportDescription

    file = folder / SNAPSHOT_DESCRIPTION
    try:
        return ExportDescription.from_json(json.loads(file.read_text()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise PosthocEMAError(f"{file} cannot be read as an export description ({error})") from None


def _check_replaceable(folder: Path) -> None:
    """An output folder may be new or an earlier reconstruction; anything else is not ours to replace."""
    command = "python -m training.posthoc_ema"
    refuse_foreign(folder, _is_posthoc_export, command, f"--out: {folder}", "choose another --out")


def _is_posthoc_export(folder: Path) -> bool:
    """Whether `folder` is an export this command wrote: its description records a post-hoc EMA reconstruction."""
    from generation.export import EXPORT_CONFIG, ExportError, read_description

    try:
        return (folder / EXPORT_CONFIG).is_file() and read_description(folder).posthoc_ema is not None
    except ExportError:  # a damaged or foreign config.json
        return False


def describe_stored(run_root: Path) -> str:
    """--list: the stored profiles and snapshot steps of a run."""
    profiles = stored_profiles(run_root)
    incomplete = [folder.name for folder in incomplete_snapshots(run_root)]
    left_out = [f"  left out, incomplete (no {SNAPSHOT_DESCRIPTION}): {', '.join(incomplete)}"] if incomplete else []
    if not profiles:
        return "\n".join([f"{run_root}: no post-hoc EMA snapshots", *left_out])
    steps = sorted({profile.step for profile in profiles})
    kinds = sorted({(profile.sigma_rel, profile.gamma) for profile in profiles})
    lines = [f"{run_root}: {len(profiles)} stored profiles in {len(steps)} snapshots"]
    lines += [f"  sigma_rel {sigma_rel:g} (gamma {gamma:.3f})" for sigma_rel, gamma in kinds]
    lines.append(f"  steps: {', '.join(map(str, steps))}")
    return "\n".join([*lines, *left_out])


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = CommandParser(prog="python -m training.posthoc_ema", description=__doc__)
    parser.add_argument("run_dir", type=Path, help="a run directory with post-hoc EMA snapshots")
    parser.add_argument(
        "--sigma-rel", type=float, nargs="+", help=f"EMA lengths to reconstruct, in (0, {SIGMA_REL_MAX:.4f})"
    )
    parser.add_argument("--step", type=int, help="a snapshot step (default: the newest)")
    parser.add_argument("--out", type=Path, help=f"folder for the exports (default RUN_DIR/{POSTHOC_EXPORTS_FOLDER})")
    parser.add_argument("--list", action="store_true", help="show the stored profiles and snapshot steps")
    args = parser.parse_args(argv)
    if not args.list and not args.sigma_rel:
        parser.error("give --sigma-rel (one or more values) or --list")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_arguments(argv)
    if not args.run_dir.is_dir():
        raise PosthocEMAError(f"{args.run_dir} is not a run directory")
    if args.list:
        print(describe_stored(args.run_dir))
        if not args.sigma_rel:
            return
    for written in reconstruct(args.run_dir, args.sigma_rel, args.step, args.out):
        record = written.record
        print(
            f"sigma_rel {record['sigma_rel']:g} (gamma {record['gamma']:.3f}) at step {record['step']} from "
            f"{len(record['snapshots'])} stored profiles: profile error {100 * record['relative_error']:.3f} %, "
            f"Gram condition {record['condition']:.2e}; wrote {written.folder}"
        )


if __name__ == "__main__":
    run_command(main)
