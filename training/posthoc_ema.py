"""Post-hoc EMA (EDM2): power-function averages tracked during training, stored as snapshots, and any other EMA
length reconstructed from them after training.

    train.posthoc_ema.sigma_rel: [0.05, 0.10]      # the tracked profiles (training.power_profiles); [] is off
    train.posthoc_ema.snapshot_every: 5000         # steps between snapshots (and the last step)

    <run>/posthoc_ema/step-XXXXXXX/
        sigma_rel-0.05.safetensors   one profile's average at that step (train.posthoc_ema.dtype; its header's
        sigma_rel-0.1.safetensors    metadata holds sigma_rel, gamma, step and images)
        description.json             the run's export description (generation.export), to rebuild the model

Every process updates every profile after every optimiser step, in float32, from the same weights, so they
agree bit for bit; the main process writes the snapshots, which checkpoint rotation never deletes. The running
averages are part of every checkpoint (`posthoc_ema.safetensors`), so --resume continues them exactly.

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
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors import SafetensorError, safe_open

from atomic_files import atomic_folder, atomic_output, check_writable, write_json_atomic
from commands import CommandParser, UserError, run_command
from generation.run_layout import (
    POSTHOC_EXPORTS_FOLDER,
    POSTHOC_STATE,
    PROFILE_FILES,
    SNAPSHOT_DESCRIPTION,
    SNAPSHOT_FOLDER,
    posthoc_export_folder,
    profile_file,
    step_name,
    step_of,
)
from training.checkpoint_folders import CheckpointError
from training.config import ConfigError, PosthocEMAConfig
from training.power_profiles import SIGMA_REL_MAX, reconstruct_profile, sigma_rel_to_gamma, step_decay

# torch, safetensors.torch and generation.export (seconds to import) are imported where they are used, so that
# `python -m training.posthoc_ema --help` and a bad argument answer at once.
if TYPE_CHECKING:
    import torch
    from torch import nn

    from generation.export import ExportDescription

MIN_SNAPSHOTS = 4  # fewer stored profiles span too little to reconstruct anything but themselves


class PosthocEMAError(UserError):
    """A reconstruction that cannot be made (no snapshots, a step without one, sigma_rel out of range, ...)."""


# --------------------------------------------------------------------------------------------------
#                                       Tracking during training
# --------------------------------------------------------------------------------------------------


class PowerEMA:
    """Power-function averages of a model's floating-point state, one per sigma_rel, in float32.

    `update(model)` after each optimiser step of `batch` images (the global batch) moves each average by
    beta = (1 - batch / t)^(gamma + 1), t the images trained on so far (training.power_profiles.step_decay).
    """

    def __init__(
        self, model: nn.Module, settings: PosthocEMAConfig, batch: int, device: torch.device | str = "cpu"
    ) -> None:
        import torch

        names = [profile_file(sigma_rel) for sigma_rel in settings.sigma_rel]
        if len(set(names)) < len(names):
            raise ConfigError(f"'train.posthoc_ema.sigma_rel' is {settings.sigma_rel}: each profile only once")
        self.sigma_rels = list(settings.sigma_rel)
        self.gammas = [sigma_rel_to_gamma(sigma_rel) for sigma_rel in self.sigma_rels]
        self.snapshot_every, self.dtype, self.batch = settings.snapshot_every, getattr(torch, settings.dtype), batch
        state = model.state_dict()
        self.keys = list(state)
        self.averages = [
            [state[key].detach().to(device, torch.float32, copy=True) for key in self.keys] for _ in self.sigma_rels
        ]
        self.images = 0  # training images behind the averages

    def update(self, model: nn.Module) -> None:
        """Fold in the weights after one more optimiser step (the same call on every process)."""
        import torch

        self.images += self.batch
        state = model.state_dict()
        current = [state[key].detach().float() for key in self.keys]
        with torch.no_grad():
            for gamma, average in zip(self.gammas, self.averages):
                torch._foreach_lerp_(average, current, 1.0 - step_decay(self.images, self.batch, gamma))

    def copy_profile(self, sigma_rel: float, module: nn.Module) -> None:
        """Load the running average of the tracked profile `sigma_rel` into `module` (a model of the same keys):
        what grids and FID during training draw from with log.fid_weights=sigma_rel=S."""
        import torch

        index = min(range(len(self.sigma_rels)), key=lambda i: abs(self.sigma_rels[i] - sigma_rel))
        state = module.state_dict()
        with torch.no_grad():
            for key, value in zip(self.keys, self.averages[index]):
                state[key].copy_(value)

    def snapshot_due(self, step: int, last: bool) -> bool:
        return step % self.snapshot_every == 0 or last

    def snapshot_bytes(self) -> int:
        """Bytes of one snapshot on disk (every profile, in the snapshot dtype; headers aside)."""
        element = self.dtype.itemsize
        return len(self.sigma_rels) * sum(tensor.numel() for tensor in self.averages[0]) * element

    def describe(self, max_steps: int) -> str:
        """The start-up summary's line: the profiles, how often they are stored and what that costs."""
        profiles = ", ".join(f"{s:g} (gamma {g:.2f})" for s, g in zip(self.sigma_rels, self.gammas))
        count = -(-max_steps // self.snapshot_every)
        size = self.snapshot_bytes()
        return (
            f"sigma_rel {profiles}; a snapshot every {self.snapshot_every} steps in {SNAPSHOT_FOLDER}/, "
            f"{size / 1e6:,.1f} MB each ({str(self.dtype).removeprefix('torch.')}), "
            f"about {count} to step {max_steps}: {count * size / 1e9:,.2f} GB"
        )

    def save_snapshot(self, run_root: Path, step: int, description: ExportDescription) -> Path:
        """Write every profile's average at `step` to <run>/posthoc_ema/step-XXXXXXX/ (main process, atomic)."""
        from safetensors.torch import save_file

        final = Path(run_root) / SNAPSHOT_FOLDER / step_name(step)
        with atomic_folder(final, needed=self.snapshot_bytes()) as temporary:
            for sigma_rel, gamma, average in zip(self.sigma_rels, self.gammas, self.averages):
                tensors = {key: value.to(self.dtype).cpu().contiguous() for key, value in zip(self.keys, average)}
                metadata = {"sigma_rel": repr(sigma_rel), "gamma": repr(gamma), "step": str(step)}
                save_file(tensors, temporary / profile_file(sigma_rel), {**metadata, "images": str(self.images)})
            write_json_atomic(temporary / SNAPSHOT_DESCRIPTION, replace(description, train_step=step).to_json())
        return final

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The running averages under "<profile index>/<key>" (their size counts towards a checkpoint's)."""
        return {
            f"{i}/{key}": value for i, average in enumerate(self.averages) for key, value in zip(self.keys, average)
        }

    def write_state(self, checkpoint: Path) -> None:
        """Put the running averages into a checkpoint folder being assembled (main process)."""
        from safetensors.torch import save_file

        tensors = {key: value.cpu().contiguous() for key, value in self.state_tensors().items()}
        metadata = {"sigma_rel": json.dumps(self.sigma_rels), "images": str(self.images)}
        with atomic_output(Path(checkpoint) / POSTHOC_STATE) as temporary:
            save_file(tensors, temporary, metadata)

    def load_state(self, checkpoint: Path) -> None:
        """Continue the averages of a checkpoint (check_resume first: it refuses other profiles in one line)."""
        from safetensors.torch import load_file

        file = Path(checkpoint) / POSTHOC_STATE
        saved = load_file(file)
        with safe_open(file, framework="pt") as header:
            self.images = int(header.metadata()["images"])
        for i, average in enumerate(self.averages):
            for key, value in zip(self.keys, average):
                value.copy_(saved[f"{i}/{key}"])


def create_posthoc_ema(
    model: nn.Module, settings: PosthocEMAConfig, batch: int, device: torch.device
) -> PowerEMA | None:
    """The tracker of `settings` for `model` (before it is wrapped), on `device`; None when no profile is asked for."""
    if not settings.sigma_rel:
        return None
    return PowerEMA(model, settings, batch, device)


def check_resume(checkpoint: Path, settings: PosthocEMAConfig) -> None:
    """Refuse, in one line, a resume whose profiles differ from the checkpoint's (a profile's history lives only
    there) or whose profile state is damaged; snapshot_every and dtype may change and apply from now on."""
    file = Path(checkpoint) / POSTHOC_STATE
    saved: list[float] = []
    if file.exists():
        try:
            with safe_open(file, framework="pt") as header:
                saved = json.loads(header.metadata()["sigma_rel"])
        except (SafetensorError, OSError, KeyError, TypeError, json.JSONDecodeError) as error:
            raise CheckpointError(f"cannot resume from {checkpoint}: {file} cannot be read ({error})") from None
    if saved != list(settings.sigma_rel):
        raise ConfigError(
            f"--resume {checkpoint}: its post-hoc EMA profiles are train.posthoc_ema.sigma_rel={saved}, this launch "
            f"asks for {list(settings.sigma_rel)}; profiles cannot change on resume (keep them, or start a new run.dir)"
        )


def drop_snapshots_after(run_root: Path, step: int) -> list[Path]:
    """Delete the snapshots of steps after `step` (left by a timeline abandoned by a resume from an earlier
    checkpoint); returns them. Main process."""
    dropped = [snapshot.folder for snapshot in _snapshot_folders(Path(run_root)) if snapshot.step > step]
    for folder in dropped:
        shutil.rmtree(folder)
    return dropped


# --------------------------------------------------------------------------------------------------
#                                      Reconstruction after training
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SnapshotFolder:
    step: int
    folder: Path

    @property
    def complete(self) -> bool:
        """Whether its description.json, which `save_snapshot` writes last, is there: only complete snapshots are
        read (a folder without it was copied by hand, or cut short on a file system that lost its files)."""
        return (self.folder / SNAPSHOT_DESCRIPTION).is_file()


@dataclass(frozen=True)
class StoredProfile:
    """One profile's average in one snapshot."""

    step: int
    images: int
    sigma_rel: float
    gamma: float
    file: Path


def _snapshot_folders(run_root: Path) -> list[SnapshotFolder]:
    root = run_root / SNAPSHOT_FOLDER
    if not root.is_dir():
        return []
    found = [
        SnapshotFolder(step, path)
        for path in root.iterdir()
        if path.is_dir() and (step := step_of(path.name)) is not None
    ]
    return sorted(found, key=lambda snapshot: snapshot.step)


def stored_profiles(run_root: str | Path) -> list[StoredProfile]:
    """Every stored profile of a run's complete snapshots, by step then sigma_rel (headers only: no weights are
    read). A profile whose header names another step than its folder (a snapshot copied into another step's
    folder), or the same profile twice, is refused: it would enter the fit as a profile it is not."""
    profiles: dict[tuple[int, float], StoredProfile] = {}
    for snapshot in _snapshot_folders(Path(run_root)):
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
    return [snapshot.folder for snapshot in _snapshot_folders(Path(run_root)) if not snapshot.complete]


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
    from generation.export import EXPORT_CONFIG, read_description

    if not folder.exists():
        return
    ours = (folder / EXPORT_CONFIG).is_file() and read_description(folder).posthoc_ema is not None
    if not ours:
        raise PosthocEMAError(f"--out: {folder} exists and is not a post-hoc EMA export; choose another --out")


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
