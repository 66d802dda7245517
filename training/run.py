"""The run directory and the Accelerate setup of one training run.

    results/<run>/
        config.yaml          resolved config of the latest launch
        metrics.jsonl        one JSON line per logging step (main process only)
        fid.jsonl            FID of EMA samples, when log.fid_every > 0
        samples/step-XXXXXXX.png   EMA sample grids
        tensorboard/         TensorBoard events (log.trackers; wandb/ too for wandb, see training.trackers)
        checkpoints/step-XXXXXXX/  see training.checkpoint
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from training.checkpoint import keep_plain_model_keys
from training.config import Config
from training.trackers import check_trackers


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
    def samples(self) -> Path:
        return self.root / "samples"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"


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
    keep_plain_model_keys(accelerator)
    torch.set_float32_matmul_precision("high" if train.tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = train.tf32
    return accelerator


def micro_batch_size(config: Config, num_processes: int) -> int:
    """Examples per process per forward pass; the global batch must split evenly."""
    train = config.train
    parts = num_processes * train.grad_accum_steps
    if train.global_batch_size % parts:
        raise ValueError(f"train.global_batch_size={train.global_batch_size} does not split over {num_processes} "
                         f"processes x {train.grad_accum_steps} accumulation steps")
    return train.global_batch_size // parts
