"""The run directory and the Accelerate setup of one training run.

    results/<run>/
        config.yaml          resolved config of the latest launch
        startup.txt          what the latest launch said it would do (training.summary)
        metrics.jsonl        one JSON line per logging step (main process only)
        fid.jsonl            FID of EMA samples, when log.fid_every > 0
        samples/step-XXXXXXX.png   EMA sample grids
        tensorboard/         TensorBoard events (log.trackers; wandb/ too for wandb, see training.trackers)
        checkpoints/step-XXXXXXX/  see training.checkpoint (the newest log.keep_checkpoints)
        exports/step-XXXXXXX/      milestone exports every log.export_every steps (never deleted)
        posthoc_ema/step-XXXXXXX/  post-hoc EMA snapshots every train.posthoc_ema.snapshot_every steps (never deleted)
        posthoc_exports/           exports reconstructed from them by `python -m training.posthoc_ema`

A new launch never damages an earlier run: a run directory that already holds one is refused unless the
launch continues it (--resume) or replaces it (--overwrite).
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from commands import check_launched_processes
from training.checkpoint import keep_plain_model_keys, list_checkpoints
from training.config import Config, ConfigError
from training.posthoc_ema import SNAPSHOT_FOLDER
from training.trackers import TRACKER_FOLDERS, check_trackers

# step-XXXXXXX (a checkpoint or export folder), step-XXXXXXX.png (a grid), and the hidden folders and files of
# saves that were killed or failed (.step-XXXXXXX.tmp, .old, .step-XXXXXXX.png.tmp-<pid>)
STEP_FILE = re.compile(r"^\.?step-\d{7,}(\.png)?(\.tmp|\.old|\.tmp-\d+)?$")


@dataclass(frozen=True)
class RunDirectory:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def fid(self) -> Path:
        return self.root / "fid.jsonl"

    @property
    def startup(self) -> Path:
        return self.root / "startup.txt"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def exports(self) -> Path:
        return self.root / "exports"

    @property
    def step_folders(self) -> tuple[Path, ...]:
        """The folders of step-XXXXXXX entries that runs write."""
        return (self.checkpoints, self.exports, self.samples, self.root / SNAPSHOT_FOLDER)

    def earlier_run(self) -> list[Path]:
        """What an earlier launch left here: checkpoints, logs, exports (empty for a new directory)."""
        logs = [path for path in (self.config, self.metrics, self.fid, self.exports) if path.exists()]
        return list_checkpoints(self.checkpoints) + logs

    def check_new(self) -> None:
        """Refuse to start a fresh run over an earlier one (it would truncate its logs and rotate its checkpoints)."""
        found = self.earlier_run()
        if found:
            names = ", ".join(str(path.relative_to(self.root)) for path in found[:3])
            raise ConfigError(
                f"run.dir {self.root} already holds a run ({names}{', ...' if len(found) > 3 else ''}): "
                f"continue it with --resume latest, choose another run.dir=..., or pass --overwrite "
                f"to start over (deletes them)"
            )

    def written_by_runs(self) -> list[Path]:
        """What runs write here: the logs, step-XXXXXXX checkpoints and exports (and hidden ones of killed saves),
        step-XXXXXXX.png grids and the trackers' folders; nothing else a user put into the directory."""
        found = [path for path in (self.config, self.startup, self.metrics, self.fid) if path.exists()]
        for folder in self.step_folders:
            if folder.is_dir():
                found += [path for path in folder.iterdir() if STEP_FILE.match(path.name)]
        return found + [self.root / name for name in TRACKER_FOLDERS if (self.root / name).exists()]

    def remove_partial_saves(self) -> None:
        """Delete the hidden folders of checkpoint and export saves that were killed: they may fill the disk
        (a `.old` folder is kept: a save killed between its two renames leaves the earlier checkpoint there)."""
        for folder in self.step_folders:
            if folder.is_dir():
                for path in folder.iterdir():
                    if path.name.startswith(".") and path.name.endswith(".tmp") and STEP_FILE.match(path.name):
                        shutil.rmtree(path, ignore_errors=True)

    def clear(self) -> list[Path]:
        """Delete an earlier run's files (train.py --overwrite) and the folders they leave empty; returns the
        files a run did not write, which stay."""
        for path in self.written_by_runs():
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        kept = []
        for folder in self.step_folders:
            if folder.is_dir():
                kept += sorted(path for path in folder.rglob("*") if not path.is_dir())
                if not any(folder.iterdir()):
                    folder.rmdir()
        return kept


def create_accelerator(config: Config, run: RunDirectory) -> Accelerator:
    """An Accelerator for `config`: mixed precision as configured (None: as `accelerate launch` says),
    accumulation over `grad_accum_steps` micro-batches; trackers are checked here and started by
    training.trackers.start_trackers once the resume step is known."""
    train = config.train
    check_trackers(config.log)
    accelerator = Accelerator(
        mixed_precision="no" if train.mixed_precision == "fp32" else train.mixed_precision,
        gradient_accumulation_steps=train.grad_accum_steps,
        cpu=train.cpu,
        project_config=ProjectConfiguration(project_dir=str(run.root), logging_dir=str(run.root)),
        step_scheduler_with_optimizer=False,  # the schedule counts optimiser steps, whatever the process count
    )
    check_launched_processes(accelerator.num_processes, "train.py", "train.cpu=true")
    keep_plain_model_keys(accelerator)
    torch.set_float32_matmul_precision("high" if train.tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = train.tf32
    return accelerator


def micro_batch_size(config: Config, num_processes: int) -> int:
    """Examples per process per forward pass; the global batch must split evenly."""
    train = config.train
    parts = num_processes * train.grad_accum_steps
    if train.global_batch_size % parts:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} does not split over {num_processes} "
            f"processes x {train.grad_accum_steps} accumulation steps"
        )
    return train.global_batch_size // parts
