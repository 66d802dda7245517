"""The run directory of one training run (results/<run>/, whose layout is generation.run_layout's), and the
config and checkpoint a launch into it continues with.

A new launch never damages an earlier run: a run directory that already holds one is refused unless the
launch continues it (--resume) or replaces it (--overwrite). While a launch runs, its main process holds the
run directory's lock (atomic_files.folder_lock): a second train.py into the same run.dir is refused, naming the
process that holds it, before any model is built.

Nothing here imports torch's companions (Accelerate, timm, diffusers; training.accelerator sets up Accelerate):
train.py reads and checks the launch's config, and resolves its resume, before it imports them.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from atomic_files.folder_lock import lock_folder, lock_holder, locked_by_another, release_folder
from generation.run_layout import (
    CHECKPOINTS_FOLDER,
    CURVES_FILE,
    EXPORTS_FOLDER,
    FID_FILE,
    METRICS_FILE,
    SAMPLES_FOLDER,
    SNAPSHOT_FOLDER,
    STARTUP_FILE,
    STEP_FILE,
    TRACKER_FOLDERS,
    TRAIN_CONFIG,
    TRAINER_STATE,
    list_checkpoints,
)
from training.checkpoint_folders import RESUME_LATEST, resolve_resume
from training.config import Config, ConfigError, load_config

if TYPE_CHECKING:
    from accelerate import Accelerator


@dataclass(frozen=True)
class RunDirectory:
    root: Path

    @contextlib.contextmanager
    def claimed(self, accelerator: Accelerator) -> Iterator[None]:
        """Hold this run directory for the launch from here on (its main process holds the lock until `unlock`
        or its end); another launch holding it is refused on every process with one line naming the folder and
        the process. If the block fails (the model, data or VAE cannot be built), the lock is let go and a folder
        created for it removed again, so a failed launch leaves nothing behind."""
        busy: list[str | None] = [None]
        created = not self.root.exists()
        if accelerator.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            if not lock_folder(self.root):
                busy[0] = self._in_use()
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(busy)
        if busy[0] is not None:
            raise ConfigError(busy[0])
        try:
            yield
        except BaseException:
            self.unlock()
            if created and accelerator.is_main_process and not any(self.root.iterdir()):
                self.root.rmdir()
            raise

    def unlock(self) -> None:
        release_folder(self.root)

    def _in_use(self) -> str:
        return (
            f"run.dir {self.root} is in use by another train.py ({lock_holder(self.root)}) right now: wait for it "
            f"to end, or choose another run.dir=..."
        )

    @property
    def config(self) -> Path:
        return self.root / TRAIN_CONFIG

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def fid(self) -> Path:
        return self.root / FID_FILE

    @property
    def curves(self) -> Path:
        return self.root / CURVES_FILE

    @property
    def startup(self) -> Path:
        return self.root / STARTUP_FILE

    @property
    def samples(self) -> Path:
        return self.root / SAMPLES_FOLDER

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_FOLDER

    @property
    def exports(self) -> Path:
        return self.root / EXPORTS_FOLDER

    @property
    def snapshots(self) -> Path:
        return self.root / SNAPSHOT_FOLDER

    @property
    def step_folders(self) -> tuple[Path, ...]:
        """The folders of step-XXXXXXX entries that runs write."""
        return (self.checkpoints, self.exports, self.samples, self.snapshots)

    def earlier_run(self) -> list[Path]:
        """What an earlier launch left here: checkpoints, logs, exports (empty for a new directory). A config.yaml
        alone does not count: a launch that failed before its first log line (an unreadable image, say) leaves
        nothing a rerun of the same command could lose, and it would block that rerun."""
        checkpoints = list_checkpoints(self.checkpoints)
        logs = [path for path in (self.config, self.metrics, self.fid, self.exports) if path.exists()]
        return [] if not checkpoints and logs == [self.config] else checkpoints + logs

    def check_new(self) -> None:
        """Refuse to start a fresh run over an earlier one (it would truncate its logs and rotate its checkpoints)."""
        found = self.earlier_run()
        if found and locked_by_another(self.root):  # the run that left them is still going
            raise ConfigError(self._in_use())
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
        found = [path for path in (self.config, self.startup, self.metrics, self.fid, self.curves) if path.exists()]
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


def load_launch_config(
    config_file: str | None, resume: str | None, overrides: Sequence[str]
) -> tuple[Config, str | None]:
    """The config of a train.py launch and what its --resume means, as (config, resume spec for resolve_resume).

    Without --config, a resume takes the run's own config (the overrides still apply on top and are checked
    against the checkpoint as with --config): `--resume <run folder>` reads that folder's config.yaml,
    `run.dir=<run folder> --resume latest` too, and `--resume <checkpoint folder>` the checkpoint's. `--resume
    <run folder>` continues the newest checkpoint of that folder: in place (as `--resume latest`, a fresh start
    when it has none yet), or into another run.dir given as an override."""
    run_dir = next((item.partition("=")[2] for item in reversed(overrides) if item.startswith("run.dir=")), None)
    folder = Path(resume) if resume not in (None, RESUME_LATEST) else None
    if folder is not None and folder.is_dir() and not (folder / TRAINER_STATE).is_file():  # a run folder
        run = RunDirectory(folder)
        newest = list_checkpoints(run.checkpoints)
        if not run.config.is_file() and not newest:
            raise ConfigError(
                f"--resume {folder}: neither a run folder (no {run.config.name}, no checkpoints/) nor a checkpoint "
                f"folder (no {TRAINER_STATE})"
            )
        if run_dir is None or Path(run_dir).resolve() == folder.resolve():
            resume = RESUME_LATEST
        elif newest:
            resume = str(newest[-1])
        else:
            raise ConfigError(f"--resume {folder}: the run holds no checkpoint to continue in run.dir={run_dir}")
        config = load_config(
            config_file or (run.config if run.config.is_file() else newest[-1] / TRAIN_CONFIG), overrides
        )
        if run_dir is None:
            config.run.dir = str(folder)  # where the run is now, wherever its config.yaml says it was
        return config, resume
    if config_file is not None:
        return load_config(config_file, overrides), resume
    if resume is None:
        raise ConfigError("--config is required for a new run (to continue one: --resume <run folder>)")
    if resume == RESUME_LATEST:
        if run_dir is None:
            raise ConfigError("--resume latest without --config needs the run: add run.dir=<run folder>")
        run = RunDirectory(Path(run_dir))
        if not run.config.is_file():
            raise ConfigError(f"run.dir={run_dir} holds no {run.config.name} to resume with: pass --config")
        return load_config(run.config, overrides), resume
    checkpoint = resolve_resume(resume, Path(resume).parent)  # a missing checkpoint stops here
    config = load_config(checkpoint / TRAIN_CONFIG, overrides)
    if run_dir is None and checkpoint.parent.name == RunDirectory(checkpoint.parent.parent).checkpoints.name:
        config.run.dir = str(checkpoint.parent.parent)
    return config, resume
