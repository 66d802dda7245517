"""Run checkpoints: the full training state, written atomically, plus an export that sampling can load alone.

    <run>/checkpoints/step-0000020/
        model.safetensors            weights (Accelerate save_state; the model's own keys, no DDP prefix)
        optimizer.bin, scheduler.bin optimiser and learning-rate state (Accelerate; plain tensors and numbers)
        random_states_<rank>.pkl     every process's RNG states (Accelerate)
        trainer_state.json           step and data position
        config.yaml                  the resolved training config
        export/                      EMA weights and their description (generation.export): what sampling needs

Nothing here unpickles arbitrary objects: weights are safetensors and Accelerate reads its .bin/.pkl files
with torch.load(weights_only=True) (tensors, numbers and NumPy RNG arrays only). Accelerate's
`register_for_checkpointing` would pickle with weights_only=False, so the EMA is stored as safetensors instead.
Every process writes into a hidden temporary folder that the main process renames once complete.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from accelerate import Accelerator
from safetensors.torch import load_file
from timm.utils import ModelEmaV3
from torch import nn

from generation.export import CHECKPOINT_PATTERN, EXPORT_DIR, EXPORT_WEIGHTS, ExportDescription, write_export
from training.ema import ema_state_dict, load_ema_state_dict

TRAINER_STATE = "trainer_state.json"
TRAIN_CONFIG = "config.yaml"
MODEL_WEIGHTS = "model.safetensors"  # Accelerate's file name for the first prepared model
RESUME_LATEST = "latest"


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (temporary folders of interrupted saves are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir()
             if CHECKPOINT_PATTERN.match(path.name) and (path / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda path: int(CHECKPOINT_PATTERN.match(path.name).group(1)))


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
        raise FileNotFoundError(f"resume checkpoint {path} {reason}; pass --resume latest or a folder such as "
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
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Accelerator, path: str | Path, ema: ModelEmaV3) -> dict[str, Any]:
    """Restore model, optimiser, scheduler, RNG states and EMA from `path`; returns the trainer state."""
    path = Path(path)
    accelerator.load_state(str(path))
    load_ema_state_dict(ema, load_file(path / EXPORT_DIR / EXPORT_WEIGHTS))  # copied onto the EMA's device
    return json.loads((path / TRAINER_STATE).read_text())


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
