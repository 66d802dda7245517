"""Post-hoc EMA (EDM2), tracked during training: power-function averages of the weights, one per sigma_rel,
updated after every optimiser step and stored as snapshots, from which `python -m training.posthoc_ema` reconstructs
any other EMA length after training.

    train.posthoc_ema.sigma_rel: [0.05, 0.10]      # the tracked profiles (training.power_profiles); [] is off
    train.posthoc_ema.snapshot_every: 5000         # steps between snapshots (and the last step)

    <run>/posthoc_ema/step-XXXXXXX/
        sigma_rel-0.05.safetensors   one profile's average at that step (train.posthoc_ema.dtype; its header's
        sigma_rel-0.1.safetensors    metadata holds sigma_rel, gamma, step and images)
        description.json             the run's export description (generation.export), to rebuild the model

Every process updates every profile after every optimiser step, in float32, from the same weights, so they
agree bit for bit; the main process writes the snapshots, which checkpoint rotation never deletes. The running
averages are part of every checkpoint (`posthoc_ema.safetensors`), so --resume continues them exactly.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

from atomic_files import atomic_folder, atomic_output, write_json_atomic
from generation.run_layout import (
    POSTHOC_STATE,
    SNAPSHOT_DESCRIPTION,
    SNAPSHOT_FOLDER,
    profile_file,
    step_name,
    step_of,
)
from training.checkpoint_folders import CheckpointError
from training.config import ConfigError, PosthocEMAConfig
from training.power_profiles import sigma_rel_to_gamma, step_decay

# torch and safetensors.torch (seconds to import) are imported where they are used, so that the reconstruction
# command (training.posthoc_ema), which reads the snapshot folders through this module, answers `--help` at once.
if TYPE_CHECKING:
    import torch
    from torch import nn

    from generation.export import ExportDescription


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
        final = Path(run_root) / SNAPSHOT_FOLDER / step_name(step)
        with atomic_folder(final, needed=self.snapshot_bytes()) as temporary:
            for sigma_rel, gamma, average in zip(self.sigma_rels, self.gammas, self.averages):
                tensors = {key: value.to(self.dtype).cpu().contiguous() for key, value in zip(self.keys, average)}
                metadata = {"sigma_rel": repr(sigma_rel), "gamma": repr(gamma), "step": str(step)}
                save_sorted(tensors, temporary / profile_file(sigma_rel), {**metadata, "images": str(self.images)})
            write_json_atomic(temporary / SNAPSHOT_DESCRIPTION, replace(description, train_step=step).to_json())
        return final

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The running averages under "<profile index>/<key>" (their size counts towards a checkpoint's)."""
        return {
            f"{i}/{key}": value for i, average in enumerate(self.averages) for key, value in zip(self.keys, average)
        }

    def write_state(self, checkpoint: Path) -> None:
        """Put the running averages into a checkpoint folder being assembled (main process)."""
        tensors = {key: value.cpu().contiguous() for key, value in self.state_tensors().items()}
        metadata = {"sigma_rel": json.dumps(self.sigma_rels), "images": str(self.images)}
        with atomic_output(Path(checkpoint) / POSTHOC_STATE) as temporary:
            save_sorted(tensors, temporary, metadata)

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
    dropped = [snapshot.folder for snapshot in snapshot_folders(Path(run_root)) if snapshot.step > step]
    for folder in dropped:
        shutil.rmtree(folder)
    return dropped


@dataclass(frozen=True)
class SnapshotFolder:
    step: int
    folder: Path

    @property
    def complete(self) -> bool:
        """Whether its description.json, which `save_snapshot` writes last, is there: only complete snapshots are
        read (a folder without it was copied by hand, or cut short on a file system that lost its files)."""
        return (self.folder / SNAPSHOT_DESCRIPTION).is_file()


def save_sorted(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, with the header's metadata in sorted key order, so that the same state gives the same
    bytes: safetensors writes the metadata map in an order that changes from call to call (a Rust HashMap;
    safetensors issue 584, open in 0.8), so two saves of one snapshot differed. The header is written again in
    place, the same length (only the order of its metadata entries changes)."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata)
    with open(path, "r+b") as file:
        size = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(size))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) <= size:  # always, by construction; a writer of another spelling keeps its own header
            file.seek(8)
            file.write(text.ljust(size))  # the header's padding is spaces


def snapshot_folders(run_root: Path) -> list[SnapshotFolder]:
    """The step-XXXXXXX folders of a run's snapshots, by step (complete or not)."""
    root = run_root / SNAPSHOT_FOLDER
    if not root.is_dir():
        return []
    found = [
        SnapshotFolder(step, path)
        for path in root.iterdir()
        if path.is_dir() and (step := step_of(path.name)) is not None
    ]
    return sorted(found, key=lambda snapshot: snapshot.step)
