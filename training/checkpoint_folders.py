"""The checkpoint that `--resume latest|CHECKPOINT` means (the folders' names, which ones are complete, and their
steps, are generation.run_layout's: sample.py reads the same).

It lives apart from training.checkpoint, which writes and reads what is inside the folders with torch,
Accelerate and timm, so that train.py resolves a resume (training.run.load_launch_config) before it imports
those.
"""

from __future__ import annotations

from pathlib import Path

from commands import UserError
from generation.run_layout import TRAINER_STATE, list_checkpoints, step_name

RESUME_LATEST = "latest"


class CheckpointError(UserError):
    """A checkpoint to resume from that is missing or damaged (the message names the file)."""


def resolve_resume(spec: str | None, root: str | Path) -> Path | None:
    """The checkpoint to resume from: None (fresh run), "latest" (newest under root; None if there is none
    yet, so a preempted job can always be relaunched with --resume latest) or a checkpoint folder."""
    if spec is None:
        return None
    if spec == RESUME_LATEST:
        checkpoints = list_checkpoints(root)
        return checkpoints[-1] if checkpoints else None
    path = Path(spec)
    if not (path / TRAINER_STATE).is_file():
        reason = "does not exist" if not path.exists() else f"is not a checkpoint folder (no {TRAINER_STATE})"
        raise CheckpointError(
            f"resume checkpoint {path} {reason}; pass --resume latest or a folder such as {Path(root) / step_name(0)}"
        )
    return path
