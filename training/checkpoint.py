"""Run checkpoints: the full training state, written atomically, plus an export that sampling can load alone.

    <run>/checkpoints/step-0000020/
        model.safetensors            weights (Accelerate save_state; the model's own keys, no DDP prefix)
        model_1.safetensors          REPA's projector, when train.repa is on (never in the export)
        optimizer.bin, scheduler.bin optimiser and learning-rate state (Accelerate; plain tensors and numbers)
        random_states_<rank>.pkl     every process's RNG states (Accelerate)
        trainer_state.json           step and data position
        config.yaml                  the resolved training config
        export/                      EMA weights and their description (generation.export): what sampling needs

The names in the run folder and in its checkpoint folders are generation.run_layout's (Accelerate's own files,
below, are Accelerate's); which checkpoint a resume means is training.checkpoint_folders's.
Nothing here unpickles arbitrary objects: weights are safetensors and Accelerate reads its .bin/.pkl files
with torch.load(weights_only=True) (tensors, numbers and NumPy RNG arrays only). Accelerate's
`register_for_checkpointing` would pickle with weights_only=False, so the EMA is stored as safetensors instead.
Every process writes into a hidden temporary folder that the main process renames once complete and flushed to the
disk (atomic_files.commit; each other process flushes its own RNG states first); a full disk
or a read-only folder on any process stops all of them with one line, the partial folder removed. Only the
newest `log.keep_checkpoints` are kept (never removing the one just written); milestone exports, written every
`log.export_every` steps to `<run>/exports/step-XXXXXXX/`, are never rotated away.

Before a resume, `check_checkpoint` reads every file the resume needs (Accelerate alone would skip an unreadable
RNG state without a word and the run would continue differently): a damaged file is an error naming it.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import load as accelerate_load
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from timm.utils import ModelEmaV3
from torch import nn

from atomic_files import (
    OutputError,
    atomic_folder,
    check_room,
    output_error,
    replace_folder,
    staging_folder,
    sync_to_disk,
    write_json_atomic,
    write_text_atomic,
)
from commands import UserError
from generation.export import EXPORT_WEIGHTS, ExportDescription, read_weights, write_export
from generation.run_layout import EXPORT_FOLDER, TRAIN_CONFIG, TRAINER_STATE, list_checkpoints, step_name, step_of
from training.checkpoint_folders import CheckpointError
from training.ema import ema_state_dict, load_ema_state_dict

MODEL_WEIGHTS = "model.safetensors"  # Accelerate's file name for the first prepared model
OPTIMIZER_STATE, SCHEDULER_STATE = "optimizer.bin", "scheduler.bin"  # Accelerate's names (one of each)
RANDOM_STATES = "random_states_{}.pkl"  # Accelerate's name, one per process
RANDOM_STATE_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")
# What Accelerate hands the optimiser's and the scheduler's load_state_dict: their state dicts, with these keys
STATE_KEYS = {OPTIMIZER_STATE: ("state", "param_groups"), SCHEDULER_STATE: ("last_epoch",)}


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


def save_checkpoint(
    accelerator: Accelerator,
    root: str | Path,
    step: int,
    ema: ModelEmaV3,
    trainer_state: dict[str, Any],
    export: ExportDescription,
    config_yaml: str,
    keep: int,
    needed: int | None = None,
    write_more: Callable[[Path], None] | None = None,
) -> Path:
    """Write checkpoint `step` under root (called on every process), then keep only the newest `keep`;
    `write_more(folder)` adds further state on the main process (the post-hoc EMA profiles).

    The processes agree after each phase (prepare, Accelerate's save, export and rename), so a full disk or a
    read-only folder on any of them raises OutputError on all, with the hidden partial folder removed and the
    earlier checkpoints untouched. `needed` (bytes, about) is checked against the free space first."""
    root = Path(root)
    final = root / step_name(step)
    temporary = staging_folder(final)
    main = accelerator.is_main_process

    def prepare() -> None:
        shutil.rmtree(temporary, ignore_errors=True)  # left by a save that was killed
        temporary.mkdir(parents=True)
        if needed is not None:
            check_room(final, needed)

    def finish() -> None:
        write_export(temporary / EXPORT_FOLDER, ema_state_dict(ema), replace(export, train_step=step))
        write_text_atomic(temporary / TRAIN_CONFIG, config_yaml)
        write_json_atomic(temporary / TRAINER_STATE, trainer_state)
        if write_more is not None:
            write_more(temporary)
        replace_folder(temporary, final, needed)

    def save_state() -> None:
        accelerator.save_state(str(temporary))
        if not main:  # its own RNG states: the main process's flush before the rename reaches only its own machine's
            sync_to_disk(temporary / RANDOM_STATES.format(accelerator.process_index))  # writes on a shared disk

    _agree(accelerator, _attempt(prepare, final, temporary, needed) if main else None, temporary)
    _agree(accelerator, _attempt(save_state, final, temporary, needed), temporary)
    _agree(accelerator, _attempt(finish, final, temporary, needed) if main else None, temporary)
    if main:
        for old in rotated_away(list_checkpoints(root), final, keep):
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def _attempt(action: Callable[[], None], target: Path, temporary: Path, needed: int | None) -> str | None:
    """Run `action`; the message of a full-disk or read-only failure, or None when it worked. Any other error
    (a bug) is raised, after the partial folder is removed: a failed save leaves nothing."""
    try:
        action()
    except OutputError as error:
        return str(error)
    except Exception as error:  # writers report a full disk as OSError, RuntimeError (torch), SafetensorError
        described = output_error(target, error, needed)
        if described is None:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
        return str(described)
    return None


def _agree(accelerator: Accelerator, failure: str | None, temporary: Path) -> None:
    """Every process learns whether any one failed; then the main one removes the partial folder and all raise."""
    failures = [failure]
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        failures = gather_object(failures)
    first = next((message for message in failures if message is not None), None)
    if first is not None:
        if accelerator.is_main_process:
            shutil.rmtree(temporary, ignore_errors=True)
        raise OutputError(first)


def checkpoint_bytes(*parts: Any) -> int:
    """About the bytes a checkpoint of these state dicts (nested dicts and lists of tensors) takes on disk."""

    def size(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, dict):
            return sum(size(item) for item in value.values())
        if isinstance(value, (list, tuple)):
            return sum(size(item) for item in value)
        return 0

    return sum(size(part) for part in parts)


def rotated_away(checkpoints: list[Path], newest: Path, keep: int) -> list[Path]:
    """The checkpoints to delete once `newest` is written: all but the `keep - 1` latest before it, and every
    later one (left by an abandoned timeline, e.g. a resume from an older checkpoint)."""
    step = step_of(newest.name)
    earlier = [path for path in checkpoints if step_of(path.name) < step]
    later = [path for path in checkpoints if step_of(path.name) > step]
    return earlier[: max(len(earlier) - (keep - 1), 0)] + later


def save_milestone_export(root: str | Path, step: int, ema: ModelEmaV3, export: ExportDescription) -> Path:
    """Write the EMA export of `step` to root/step-XXXXXXX (main process only); milestones are never rotated."""
    final = Path(root) / step_name(step)
    with atomic_folder(final) as temporary:
        write_export(temporary, ema_state_dict(ema), replace(export, train_step=step))
    return final


def check_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read every file a resume from `path` needs, without unpickling code; returns the trainer state. A missing
    or damaged file raises CheckpointError naming it and the earlier checkpoint to resume from instead."""
    path = Path(path)
    state = _read_trainer_state(path)
    try:
        extra_models = sorted(path.glob(MODEL_WEIGHTS.replace(".", "_*.")))  # REPA's projector: model_1.safetensors
        for file in (path / MODEL_WEIGHTS, *extra_models, path / EXPORT_FOLDER / EXPORT_WEIGHTS):
            _check_safetensors(file)
        for name, keys in STATE_KEYS.items():
            _check_state(path / name, keys)
        for rank in range(int(state["num_processes"])):
            _check_random_states(path / RANDOM_STATES.format(rank))
    except OSError as error:
        raise CheckpointError(_damaged(path, str(error))) from None
    return state


def check_resume_settings(config: Any, path: str | Path) -> None:
    """Refuse to resume `path` with a model, objective, data or seed (training.config.RESUME_FIXED) other than
    its own: one line naming the setting and the checkpoint's value, before anything is built."""
    from training.config import ConfigError, resume_conflict

    file = Path(path) / TRAIN_CONFIG
    try:
        conflict = resume_conflict(config, file.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise CheckpointError(_damaged(Path(path), f"{file} cannot be read ({type(error).__name__})")) from None
    if conflict is not None:
        key, saved, ours = conflict
        raise ConfigError(
            f"--resume {path}: {key} is {saved!r} in the checkpoint, not {ours!r}; a resumed run keeps "
            f"its model, objective, data and seed (drop the override, or start a new run.dir)"
        )


def apply_optimizer_settings(optimizer: Any, scheduler: Any, train: Any) -> None:
    """After a resume, use this launch's train.lr, weight_decay and betas from the current step on (the restored
    optimiser and scheduler states hold the old ones); the warm-up follows this launch's train.warmup_steps."""
    schedule = getattr(scheduler, "scheduler", scheduler)  # Accelerate's wrapper holds the LambdaLR
    schedule.base_lrs = [train.lr for _ in optimizer.param_groups]
    for group, factor in zip(optimizer.param_groups, schedule.lr_lambdas):
        group.update(
            initial_lr=train.lr,
            lr=train.lr * factor(schedule.last_epoch),
            weight_decay=train.weight_decay,
            betas=tuple(train.betas),
        )
    schedule._last_lr = [group["lr"] for group in optimizer.param_groups]


def load_checkpoint(accelerator: Accelerator, path: str | Path, ema: ModelEmaV3) -> dict[str, Any]:
    """Restore model, optimiser, scheduler, RNG states and EMA from `path`; returns the trainer state. Call
    `check_checkpoint(path)` first (train.py does, before anything is built): this does not read every file twice."""
    path = Path(path)
    state = _read_trainer_state(path)
    try:
        accelerator.load_state(str(path))
        load_ema_state_dict(ema, read_weights(path / EXPORT_FOLDER))  # copied onto the EMA's device
    except UserError:
        raise
    except (RuntimeError, ValueError, KeyError) as error:  # torch: missing, unexpected or mis-shaped keys
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        detail = lines[1] if len(lines) > 1 else (lines[0] if lines else type(error).__name__)
        raise CheckpointError(
            f"cannot resume from {path}: its files belong to another model than this config builds ({detail[:200]})"
        ) from None
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


def _check_state(file: Path, keys: tuple[str, ...]) -> None:
    """An optimiser's or scheduler's state as Accelerate will load it (weights_only: code is refused), memory-mapped
    so that no tensor is read: a cut file fails at its zip directory, and anything but a state dict with `keys` (a
    list, another object saved under the name) is named here, not by the optimiser's traceback at the resume."""
    _check_zip(file)
    try:
        state = accelerate_load(file, map_location="cpu", mmap=True)
    except Exception as error:  # torch.load reports refused code and damage with many types
        first_sentence = str(error).splitlines()[0].split(". ")[0]
        raise OSError(f"{file} cannot be read ({type(error).__name__}: {first_sentence})") from None
    if not isinstance(state, dict) or any(key not in state for key in keys):
        found = f"a dict of {', '.join(map(str, list(state)[:4]))}" if isinstance(state, dict) else type(state).__name__
        raise OSError(f"{file} does not hold a state dict with {', '.join(keys)} (found {found})")


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
    step = step_of(path.name)
    earlier = (
        [checkpoint for checkpoint in list_checkpoints(path.parent) if step_of(checkpoint.name) < step]
        if step is not None
        else []
    )
    instead = f"--resume {earlier[-1]}" if earlier else "a fresh run"
    return f"cannot resume from {path}: {problem}; use {instead}, or delete the damaged checkpoint"
