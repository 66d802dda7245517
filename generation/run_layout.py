"""The run folder's layout: every name in it, and the parse of its step folders. This module is their one home;
a test (tests/test_run_layout.py) holds that no other module spells them.

    results/<run>/
        config.yaml          resolved config of the latest launch (TRAIN_CONFIG)
        startup.txt          what the latest launch said it would do (training.summary)
        metrics.jsonl        one JSON line per logging step (main process only)
        fid.jsonl            FID during training (of the log.fid_weights samples), when log.fid_every > 0
        curves.png           the loss and FID curves, drawn again at checkpoints (training.curves, training.loop)
        samples/step-XXXXXXX.png   sample grids, one labelled row per class
        tensorboard/         TensorBoard events (log.trackers; wandb/ too for wandb, see training.trackers)
        checkpoints/step-XXXXXXX/  the newest log.keep_checkpoints (training.checkpoint), each with
            trainer_state.json       written last: the folder is complete
            config.yaml              the resolved training config
            export/                  EMA weights and their description (generation.export): what sampling needs
            posthoc_ema.safetensors  the running post-hoc EMA averages, when tracked
            (Accelerate's own files: model.safetensors, optimizer.bin, ...; see training.checkpoint)
        exports/step-XXXXXXX/      milestone exports every log.export_every steps (never deleted)
        posthoc_ema/step-XXXXXXX/  post-hoc EMA snapshots every train.posthoc_ema.snapshot_every steps (never deleted)
            sigma_rel-S.safetensors  one profile's average at that step
            description.json         the run's export description, to rebuild the model
        posthoc_exports/sigma_rel-S-step-XXXXXXX/   exports reconstructed by `python -m training.posthoc_ema`

Training writes this layout (training.run, training.checkpoint, training.posthoc_ema) and generation reads it, to
take a run folder for the export of its newest checkpoint (generation.export.find_export). It lives here, on
generation's floor and apart from the export's weights and Hub code, so that both can name it and train.py can
list a run's checkpoints before it imports torch's companions.

A checkpoint folder is complete once its trainer_state.json is written: training writes that file last and flushes
every file to the disk before the folder takes its name (atomic_files.commit). Every reader that picks a run's
newest checkpoint (`--resume latest`, sample.py given a run folder) takes it from `list_checkpoints`, so a folder
without it (a hand-made copy, a save cut short on a file system that lost it) is never the newest.
"""

from __future__ import annotations

import re
from pathlib import Path

# In the run folder
TRAIN_CONFIG = "config.yaml"  # also in every checkpoint folder
STARTUP_FILE = "startup.txt"
METRICS_FILE = "metrics.jsonl"
FID_FILE = "fid.jsonl"
CURVES_FILE = "curves.png"
SAMPLES_FOLDER = "samples"
TENSORBOARD_FOLDER = "tensorboard"
TRACKER_FOLDERS = (TENSORBOARD_FOLDER, "wandb")  # what trackers write here (train.py --overwrite clears them)
CHECKPOINTS_FOLDER = "checkpoints"
EXPORTS_FOLDER = "exports"
SNAPSHOT_FOLDER = "posthoc_ema"
POSTHOC_EXPORTS_FOLDER = "posthoc_exports"  # python -m training.posthoc_ema's default --out

# In a checkpoint folder
TRAINER_STATE = "trainer_state.json"  # written last: the folder is complete
EXPORT_FOLDER = "export"
POSTHOC_STATE = "posthoc_ema.safetensors"  # the running averages of post-hoc EMA

# In a snapshot folder
SNAPSHOT_DESCRIPTION = "description.json"
PROFILE_PREFIX, PROFILE_SUFFIX = "sigma_rel-", ".safetensors"
PROFILE_FILES = f"{PROFILE_PREFIX}*{PROFILE_SUFFIX}"  # every profile of a snapshot, as a glob pattern

# The step folders of checkpoints, exports and snapshots, and the grids: step-XXXXXXX, by optimiser step
STEP_PREFIX = "step-"
GRID_SUFFIX = ".png"
STEP_FOLDER = re.compile(rf"^{STEP_PREFIX}(\d{{7,}})$")
# Those, and the hidden folders and files of saves that were killed or failed (.step-XXXXXXX.tmp, .old,
# .step-XXXXXXX.png.tmp-<pid>): what runs write into the step folders' parents
STEP_FILE = re.compile(rf"^\.?{STEP_PREFIX}\d{{7,}}({re.escape(GRID_SUFFIX)})?(\.tmp|\.old|\.tmp-\d+)?$")


def step_name(step: int) -> str:
    """The name of the step folder of optimiser step `step`: step-0000020."""
    return f"{STEP_PREFIX}{step:07d}"


def short_name(ckpt: str | Path) -> str:
    """A checkpoint's name for a picture's title: "<run> step-XXXXXXX" for a run's checkpoint or milestone export
    (its export/ folder or the step folder), "<folder>/export" for another export folder, the last part of another
    local path, and what is not a local path (a hub id, a released checkpoint's name) as given."""
    path = Path(ckpt)
    if not path.exists():
        return str(ckpt)
    path = path.resolve()
    folder = path.parent if path.name == EXPORT_FOLDER else path
    if STEP_FOLDER.match(folder.name) and folder.parent.name in (CHECKPOINTS_FOLDER, EXPORTS_FOLDER):
        return f"{folder.parent.parent.name} {folder.name}"
    return f"{folder.name}/{path.name}" if folder != path else path.name


def grid_name(step: int) -> str:
    """The file name of the sample grid of `step` in samples/."""
    return step_name(step) + GRID_SUFFIX


def step_of(name: str) -> int | None:
    """The optimiser step a step folder's name stands for, or None for any other name."""
    match = STEP_FOLDER.match(name)
    return int(match.group(1)) if match else None


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (temporary folders of interrupted saves, and folders without
    a trainer_state.json, are left out)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir() if STEP_FOLDER.match(path.name) and (path / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda path: step_of(path.name))


def incomplete_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint folders under `root` without their trainer_state.json (a save cut short on a file system that
    lost it, a copy by hand), oldest first: never resumed from, never replaced without a word."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir() if STEP_FOLDER.match(path.name) and not (path / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda path: step_of(path.name))


def profile_file(sigma_rel: float) -> str:
    """The file of the profile `sigma_rel` in a snapshot folder."""
    return f"{PROFILE_PREFIX}{sigma_rel:g}{PROFILE_SUFFIX}"


def posthoc_export_folder(out: str | Path, sigma_rel: float, step: int) -> Path:
    """Where python -m training.posthoc_ema writes the export of `sigma_rel` at `step` under `out`."""
    return Path(out) / f"{PROFILE_PREFIX}{sigma_rel:g}-{step_name(step)}"
