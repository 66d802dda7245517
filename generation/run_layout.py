"""Where a training run keeps the exports that generation reads: `<run>/checkpoints/step-XXXXXXX/export/`.

Training writes this layout (training.run, training.checkpoint_folders) and generation reads it, to take a run
folder for the export of its newest checkpoint (generation.export.find_export). It lives here, on generation's
floor and apart from the export's weights and Hub code, so that both can name it and train.py can list a run's
checkpoints before it imports torch's companions.

A checkpoint folder is complete once its trainer_state.json is written: training writes that file last and flushes
every file to the disk before the folder takes its name (atomic_files.commit). Every reader that picks a run's
newest checkpoint (`--resume latest`, sample.py given a run folder) takes it from `list_checkpoints`, so a folder
without it (a hand-made copy, a save cut short on a file system that lost it) is never the newest.
"""

from __future__ import annotations

import re
from pathlib import Path

CHECKPOINTS_FOLDER = "checkpoints"  # in the run directory
CHECKPOINT_PATTERN = re.compile(r"^step-(\d{7,})$")  # the checkpoint folders in it, by optimiser step
TRAINER_STATE = "trainer_state.json"  # in a checkpoint folder, written last: the folder is complete


def checkpoint_step(checkpoint: Path) -> int:
    """The optimiser step of a checkpoint folder, from its name."""
    return int(CHECKPOINT_PATTERN.match(checkpoint.name).group(1))


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (temporary folders of interrupted saves, and folders without
    a trainer_state.json, are left out)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        path for path in root.iterdir() if CHECKPOINT_PATTERN.match(path.name) and (path / TRAINER_STATE).is_file()
    ]
    return sorted(found, key=checkpoint_step)
