"""What a training launch is about to do, said once before the first step (printed and kept as
`<run>/startup.txt`): model and attention with their parameter counts, the data, the batch geometry, precision,
devices, the run directory and where the run resumes from."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from training.build import TrainingParts
from training.config import Config
from training.loop import TrainerState


def count_parameters(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def attention_parameters(model: nn.Module) -> int:
    """Parameters of the blocks' attention layers (`block.attn`, MHSA or VCA)."""
    return sum(
        count_parameters(module.attn)
        for module in model.modules()
        if isinstance(getattr(module, "attn", None), nn.Module)
    )


def describe_data(config: Config, dataset: Any) -> str:
    data = config.data
    where = {"images": f" from {data.images}", "latents": f" from {data.latents}"}.get(data.source, " (built in)")
    encoded = f", encoded online by {config.vae.name}" if data.source == "images" else ""
    return f"{data.source}{where}: {len(dataset):,} images in {data.num_classes} classes, {data.image_size} px{encoded}"


def describe_devices(accelerator: Accelerator) -> str:
    device = accelerator.device
    where = f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)
    if accelerator.num_processes == 1:
        return f"1 process on {where}"
    return f"{accelerator.num_processes} processes ({accelerator.distributed_type.value}), rank 0 on {where}"


def geometry(values: dict[str, Any]) -> str:
    return (
        f"{values['num_processes']} process(es) x {values['micro_batch_size']} micro-batch x "
        f"{values['grad_accum_steps']} accumulation"
    )


def describe_resume(resume_from: Path | None, saved: dict[str, Any], state: TrainerState) -> str:
    if resume_from is None:
        return "nothing (a fresh start at step 0)"
    text = f"{resume_from} at step {state.step}"
    if not state.same_geometry(saved):
        text += (
            f"; the checkpoint was written with {geometry(saved)}, this launch has {geometry(asdict(state))}, "
            f"so the data position is approximate"
        )
    return text


def startup_summary(
    config: Config,
    accelerator: Accelerator,
    parts: TrainingParts,
    state: TrainerState,
    run_root: Path,
    resume_from: Path | None,
    saved: dict[str, Any],
) -> str:
    """The lines train.py prints and writes to `<run>/startup.txt` before training starts."""
    model = accelerator.unwrap_model(parts.model)
    train = config.train
    trainable = sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
    precision = accelerator.mixed_precision if accelerator.mixed_precision != "no" else "fp32"
    rows = {
        "model": f"{config.model.name}, attention {config.model.attention}: {count_parameters(model):,} parameters "
        f"({trainable:,} trained; attention layers {attention_parameters(model):,})",
        "data": describe_data(config, parts.batches.dataset),
        "batch": f"{geometry(asdict(state))} = {train.global_batch_size} global batch",
        "precision": f"{precision}, TF32 {'on' if train.tf32 else 'off'}, compile {'on' if train.compile else 'off'}",
        "devices": describe_devices(accelerator),
        "run.dir": str(run_root),
        "resumed from": describe_resume(resume_from, saved, state),
    }
    if parts.posthoc_ema is not None:
        rows["post-hoc EMA"] = parts.posthoc_ema.describe(train.max_steps)
    width = max(map(len, rows))
    return "train.py start-up\n" + "".join(f"  {key:<{width}}  {value}\n" for key, value in rows.items())
