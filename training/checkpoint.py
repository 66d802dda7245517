"""Run checkpoints: the full training state, written atomically, plus an export that sampling can load alone.

    <run>/checkpoints/step-0000020/
        model.safetensors            weights (Accelerate save_state; the model's own keys, no DDP prefix)
        model_1.safetensors          REPA's projector, when train.repa is on (never in the export)
        optimizer.bin, scheduler.bin optimiser and learning-rate state (Accelerate; plain tensors and numbers)
        random_states_<rank>.pkl     every process's RNG states (Accelerate)
        trainer_state.json           step and data position
        config.yaml                  the resolved training config
        export/                      EMA weights and their description (generation.export): what sampling needs

Nothing here unpickles arbitrary objects: weights are safetensors and Accelerate reads its .bin/.pkl files
with torch.load(weights_only=True) (tensors, numbers and NumPy RNG arrays only). Accelerate's
`register_for_checkpointing` would pickle with weights_only=False, so the EMA is stored as safetensors instead.
Every process writes into a hidden temporary folder that the main process renames once complete. Only the
newest `log.keep_checkpoints` are kept (never removing the one just written); milestone exports, written every
`log.export_every` steps to `<run>/exports/step-XXXXXXX/`, are never rotated away.

Before a resume, `check_checkpoint` reads every file the resume needs (Accelerate alone would skip an unreadable
RNG state without a word and the run would continue differently): a damaged file is an error naming it.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from accelerate import Accelerator
from accelerate.utils import load as accelerate_load
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from timm.utils import ModelEmaV3
from torch import nn

from commands import UserError
from generation.export import (CHECKPOINT_PATTERN, EXPORT_DIR, EXPORT_WEIGHTS, ExportDescription, read_weights,
                               write_export)
from training.ema import ema_state_dict, load_ema_state_dict

TRAINER_STATE = "trainer_state.json"
TRAIN_CONFIG = "config.yaml"
MODEL_WEIGHTS = "model.safetensors"  # Accelerate's file name for the first prepared model
OPTIMIZER_STATE, SCHEDULER_STATE = "optimizer.bin", "scheduler.bin"  # Accelerate's names (one of each)
RANDOM_STATES = "random_states_{}.pkl"  # Accelerate's name, one per process
RANDOM_STATE_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")
RESUME_LATEST = "latest"


class CheckpointError(UserError):
    """A checkpoint to resume from that is missing or damaged (the message names the file)."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (temporary folders of interrupted saves are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir()
             if CHECKPOINT_PATTERN.match(path.name) and (path / TRAINER_STATE).is_file()]
    return sorted(found, key=_step)


def resolve_resume(spec: Optional[str], root: str | Path) -> Optional[Path]:
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
        raise CheckpointError(f"resume checkpoint {path} {reason}; pass --resume latest or a folder such as "
                              f"{Path(root) / checkpoint_name(0)}")
    return path


def keep_plain_model_keys(accelerator: Accelerator) -> None:
    """Save and load model weights under the unwrapped model's keys, so a state saved by N processes (DDP,
    keys prefixed "module.") resumes on M processes and matches the export's keys."""

    def save_hook(models: list[nn.Module], weights: list[dict], output_dir: str) -> None:
        if len(weights) == len(models):  # FSDP and DeepSpeed save their own shards and pass no weights
            weights[:] = [accelerator.unwrap_model(model).state_dict() for model in models]

    def load_hook(models: list[nn.Module], input_dir: str) -> None:
        for index, model in enumerate(models):
            name = MODEL_WEIGHTS if index == 0 else MODEL_WEIGHTS.replace(".", f"_{index}.")
            accelerator.unwrap_model(model).load_state_dict(load_file(Path(input_dir) / name), strict=True)
        models.clear()  # loaded here; Accelerate goes on with the optimiser, scheduler and RNG states

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def save_checkpoint(accelerator: Accelerator, root: str | Path, step: int, ema: ModelEmaV3,
                    trainer_state: dict[str, Any], export: ExportDescription, config_yaml: str, keep: int) -> Path:
    """Write checkpoint `step` under root (called on every process), then keep only the newest `keep`."""
    root = Path(root)
    final = root / checkpoint_name(step)
    temporary = root / f".{final.name}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(temporary, ignore_errors=True)  # left by a save that was killed
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(temporary))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_export(temporary / EXPORT_DIR, ema_state_dict(ema), replace(export, train_step=step))
        (temporary / TRAIN_CONFIG).write_text(config_yaml)
        (temporary / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2))
        _replace_folder(temporary, final)
        for old in rotated_away(list_checkpoints(root), final, keep):
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def rotated_away(checkpoints: list[Path], newest: Path, keep: int) -> list[Path]:
    """The checkpoints to delete once `newest` is written: all but the `keep - 1` latest before it, and every
    later one (left by an abandoned timeline, e.g. a resume from an older checkpoint)."""
    step = _step(newest)
    earlier = [path for path in checkpoints if _step(path) < step]
    later = [path for path in checkpoints if _step(path) > step]
    return earlier[:max(len(earlier) - (keep - 1), 0)] + later


def save_milestone_export(root: str | Path, step: int, ema: ModelEmaV3, export: ExportDescription) -> Path:
    """Write the EMA export of `step` to root/step-XXXXXXX (main process only); milestones are never rotated."""
    root = Path(root)
    final = root / checkpoint_name(step)
    temporary = root / f".{final.name}.tmp"
    shutil.rmtree(temporary, ignore_errors=True)  # left by a save that was killed
    write_export(temporary, ema_state_dict(ema), replace(export, train_step=step))
    _replace_folder(temporary, final)
    return final


def check_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read every file a resume from `path` needs, without unpickling code; returns the trainer state. A missing
    or damaged file raises CheckpointError naming it and the earlier checkpoint to resume from instead."""
    path = Path(path)
    state = _read_trainer_state(path)
    try:
        extra_models = sorted(path.glob(MODEL_WEIGHTS.replace(".", "_*.")))  # REPA's projector: model_1.safetensors
        for file in (path / MODEL_WEIGHTS, *extra_models, path / EXPORT_DIR / EXPORT_WEIGHTS):
            _check_safetensors(file)
        for name in (OPTIMIZER_STATE, SCHEDULER_STATE):
            _check_zip(path / name)
        for rank in range(int(state["num_processes"])):
            _check_random_states(path / RANDOM_STATES.format(rank))
    except OSError as error:
        raise CheckpointError(_damaged(path, str(error))) from None
    return state


def load_checkpoint(accelerator: Accelerator, path: str | Path, ema: ModelEmaV3) -> dict[str, Any]:
    """Restore model, optimiser, scheduler, RNG states and EMA from `path`; returns the trainer state. Call
    `check_checkpoint(path)` first (train.py does, before anything is built): this does not read every file twice."""
    path = Path(path)
    state = _read_trainer_state(path)
    accelerator.load_state(str(path))
    load_ema_state_dict(ema, read_weights(path / EXPORT_DIR))  # copied onto the EMA's device
    return state


def _read_trainer_state(path: Path) -> dict[str, Any]:
    file = path / TRAINER_STATE
    try:
        state = json.loads(file.read_text())
        int(state["step"]), int(state["examples_seen"]), int(state["num_processes"])
        return state
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise CheckpointError(_damaged(path, f"{file} cannot be read ({type(error).__name__}: {error})")) from None


def _check_safetensors(file: Path) -> None:
    """The header of a safetensors file covers the whole file, so a cut file fails here (no weights are read)."""
    try:
        with safe_open(file, framework="pt") as weights:
            weights.keys()
    except (SafetensorError, OSError) as error:
        raise OSError(f"{file} cannot be read ({error})") from None


def _check_zip(file: Path) -> None:
    """A torch.save file is a zip archive: its directory sits at the end, so a cut file fails here."""
    try:
        with zipfile.ZipFile(file) as archive:
            archive.namelist()
    except (zipfile.BadZipFile, OSError) as error:
        raise OSError(f"{file} cannot be read ({type(error).__name__}: {error})") from None


def _check_random_states(file: Path) -> None:
    """Load one process's RNG states as Accelerate does (weights_only) and check they are all there."""
    try:
        states = accelerate_load(file)
    except Exception as error:  # torch.load reports damage with many types (UnpicklingError, RuntimeError, ...)
        first_sentence = str(error).splitlines()[0].split(". ")[0]  # torch's advice that follows is long
        raise OSError(f"{file} cannot be read ({type(error).__name__}: {first_sentence})") from None
    if not isinstance(states, dict) or any(key not in states for key in RANDOM_STATE_KEYS):
        raise OSError(f"{file} does not hold Accelerate's random states ({', '.join(RANDOM_STATE_KEYS)})")


def _damaged(path: Path, problem: str) -> str:
    earlier = [checkpoint for checkpoint in list_checkpoints(path.parent) if _step(checkpoint) < _step(path)] \
        if CHECKPOINT_PATTERN.match(path.name) else []
    instead = f"--resume {earlier[-1]}" if earlier else "a fresh run"
    return f"cannot resume from {path}: {problem}; use {instead}, or delete the damaged checkpoint"


def _step(checkpoint: Path) -> int:
    return int(CHECKPOINT_PATTERN.match(checkpoint.name).group(1))


def _replace_folder(source: Path, target: Path) -> None:
    """Rename source to target; an existing target (a checkpoint of an abandoned timeline) is removed."""
    if target.exists():
        stale = target.with_name(f".{target.name}.old")
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(target, stale)
        os.replace(source, target)
        shutil.rmtree(stale)
    else:
        os.replace(source, target)
