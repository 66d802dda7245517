"""The checkpoint that `--resume latest|CHECKPOINT` means (the folders' names, which ones are complete, and their
steps, are generation.run_layout's: sample.py reads the same).

It lives apart from training.checkpoint, which writes and reads what is inside the folders with torch,
Accelerate and timm, so that train.py resolves a resume (training.run.load_launch_config) before it imports
those.
"""

from __future__ import annotations

from pathlib import Path

from commands import UserError
from generation.run_layout import TRAINER_STATE, incomplete_checkpoints, list_checkpoints, step_name

RESUME_LATEST = "latest"


class CheckpointError(UserError):
    """A checkpoint to resume from that is missing or damaged (the message names the file)."""


def resolve_resume(spec: str | None, root: str | Path) -> Path | None:
    """The checkpoint to resume from: None (fresh run), "latest" (newest under root; None if there is none
    yet, so a preempted job can always be relaunched with --resume latest, but an error when every checkpoint
    there is incomplete) or a checkpoint folder."""
    if spec is None:
        return None
    if spec == RESUME_LATEST:
        checkpoints = list_checkpoints(root)
        if checkpoints:
            return checkpoints[-1]
        incomplete = incomplete_checkpoints(root)
        if incomplete:  # a start from step 0 would save over them: they may be all that is left of the run
            names = ", ".join(folder.name for folder in incomplete)
            raise CheckpointError(
                f"--resume latest: {root} holds {names} but no complete checkpoint (none has its {TRAINER_STATE}, "
                f"written last: a save cut short); nothing to resume, and a start from step 0 would save over them: "
                f"move them away to start anew, or finish one by hand"
            )
        return None
    path = Path(spec)
    if not (path / TRAINER_STATE).is_file():
        reason = "does not exist" if not path.exists() else f"is not a checkpoint folder (no {TRAINER_STATE})"
        raise CheckpointError(
            f"resume checkpoint {path} {reason}; pass --resume latest or a folder such as {Path(root) / step_name(0)}"
        )
    return path
