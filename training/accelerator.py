"""The Accelerate setup of one training run: its Accelerator, and how the global batch splits over its processes."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from commands import check_launched_processes
from training.checkpoint import keep_plain_model_keys
from training.config import Config, ConfigError
from training.run import RunDirectory
from training.trackers import check_trackers


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
