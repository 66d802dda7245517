"""What a training launch is about to do, said once before the first step (printed and kept as
`<run>/startup.txt`): model and attention with their parameter counts (REPA's projector included, with a line of
its own when REPA is on), the objective (path, prediction, training times, loss terms), what the model's inputs
are (pixels, or latents scaled or normalised per channel), the data, the batch geometry, precision, devices, the
run directory, where the run resumes from, what the EMA holds at the last step (with a warning when the run is too
short for it: training.ema.describe_ema) and which weights the grids and FID draw from."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from dit_vca.diffusion import NUM_TIMESTEPS
from dit_vca.model_options import BLOCK_PRESETS
from dit_vca.model_spec import ModelSpec, name_size
from dit_vca.models import swiglu_hidden_size
from generation.vae import LatentNormalization
from training.build import TrainingParts, objective_spec
from training.config import Config
from training.ema import describe_ema
from training.loop import TrainerState
from training.repa import RepresentationAlignment


def count_parameters(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def attention_parameters(model: nn.Module) -> int:
    """Parameters of the blocks' attention layers (`block.attn`, MHSA or VCA)."""
    return sum(
        count_parameters(module.attn)
        for module in model.modules()
        if isinstance(getattr(module, "attn", None), nn.Module)
    )


def describe_model(built: ModelSpec) -> str:
    """The model's name, with the sizes that were built where they are not the name's own (tiny test and demo
    models override depth, width, heads or the MLP ratio) and the block options that are not DiT's (RMSNorm,
    SwiGLU with its hidden width, QK-norm, RoPE): `built` is the model's (resolved) `spec`. A SwiGLU block's MLP is
    said by its hidden width (two thirds of the ratio's: dit_vca.models.swiglu_hidden_size), not by the ratio."""
    (depth, width, heads), _ = name_size(built.name)
    sizes = (built.depth, built.hidden_size, built.num_heads, built.mlp_ratio)
    dit = BLOCK_PRESETS["dit"]  # the block options and DiT's values
    swiglu = built.mlp == "swiglu"
    hidden = swiglu_hidden_size(built.hidden_size, built.mlp_ratio)
    resized = sizes != (depth, width, heads, 4.0)
    swiglu_text = "swiglu" if resized else f"swiglu (hidden width {hidden})"  # resized: said with the sizes
    changed = [
        (swiglu_text if value == "swiglu" else value) if isinstance(value, str) else key
        for key, value in built.block_options.items()
        if dit[key] != value
    ]
    options = f" with {', '.join(changed)}" if changed else ""
    if not resized:
        return built.name + options
    mlp, name_mlp = (
        (f"SwiGLU hidden width {hidden}", swiglu_hidden_size(width, 4.0)) if swiglu else (f"MLP ratio {sizes[3]:g}", 4)
    )
    return (
        f"{built.name}{options} resized to depth {sizes[0]}, width {sizes[1]}, {sizes[2]} heads, {mlp} "
        f"(the name's: {depth}, {width}, {heads}, {name_mlp})"
    )


def describe_objective(config: Config, objective: Any) -> str:
    """What the model is trained to do: DDPM's process and loss, or the interpolant's path, prediction, training
    times (their law and interval) and loss terms with their weights."""
    if objective_spec(config).kind == "diffusion":
        loss = (
            "epsilon and a learned-range variance, loss MSE + variational bound (DiT's hybrid)"
            if config.diffusion.learn_sigma
            else "epsilon, loss MSE"
        )
        return f"DDPM, {NUM_TIMESTEPS} linear-beta steps, t uniform over them; predicts {loss}"
    transport = config.transport
    t0, t1 = objective.interval(objective.train_eps)
    times = (
        f"logit-normal (location {transport.logit_normal_location:g}, scale {transport.logit_normal_scale:g})"
        if transport.time_distribution == "logit-normal"
        else "uniform"
    )
    if transport.prediction == "velocity":
        loss = "velocity MSE" + (
            f" + {transport.cosine_loss_weight:g} x direction loss 1 - cos" if transport.cosine_loss_weight else ""
        )
    else:
        loss = f"{transport.prediction} MSE, weight {transport.loss_weight or 'none'}"
    return (
        f"interpolant, {transport.path} path (t = 0 noise, 1 data), {transport.prediction} prediction, t {times} "
        f"on [{t0:g}, {t1:g}], loss {loss}"
    )


def describe_latents(config: Config, dataset: Any) -> str:
    """What the model's inputs are: pixels, or the VAE's latents z scaled, or normalised per channel (with the
    statistics' source and spread)."""
    if config.data.in_pixel_space:
        return "none: the model works on pixels in [-1, 1]"
    normalization = getattr(dataset, "normalization", None) or LatentNormalization(config.vae.scale)
    scale = f"{normalization.scale:g}"
    if normalization.mean is None:
        return f"VAE {config.vae.name}: x = {scale} z (vae.normalize=scale)"
    return (
        f"VAE {config.vae.name}: x = {scale} (z - mean_c) / std_c per channel (vae.normalize=channels), the "
        f"statistics of {config.data.latents} ({normalization.channels} channels, std "
        f"{min(normalization.std):.3g} to {max(normalization.std):.3g})"
    )


def describe_data(config: Config, dataset: Any) -> str:
    data = config.data
    where = {"images": f" from {data.images}", "latents": f" from {data.latents}"}.get(data.source, " (built in)")
    encoded = f", encoded online by {config.vae.name}" if data.source == "images" else ""
    return f"{data.source}{where}: {len(dataset):,} images in {data.num_classes} classes, {data.image_size} px{encoded}"


def describe_alignment(config: Config, alignment: RepresentationAlignment, projector_parameters: int) -> str:
    """REPA's line: which encoder, which block, what the encoder sees and how its grid meets the model's."""
    repa, encoder = config.train.repa, alignment.encoder
    return (
        f"encoder {repa.encoder}, block {repa.depth}, input {encoder.input_size} px, encoder grid "
        f"{encoder.grid}x{encoder.grid} -> model grid {alignment.model_grid}x{alignment.model_grid}, projector "
        f"{projector_parameters:,} parameters, coefficient {repa.coefficient:g}"
    )


def describe_tf32(tf32: bool, device: torch.device) -> str:
    """TF32 matters only on CUDA: elsewhere the setting is named as unused, so a CPU run does not claim it."""
    if device.type != "cuda":
        return f"TF32 unused on {device.type}"
    return f"TF32 {'on' if tf32 else 'off'}"


def describe_loader(requested: int, workers: int) -> str:
    """How examples are loaded: in the training process or by `workers` processes (data.num_workers, capped at
    the CPUs this process may use: training.data.loader_workers)."""
    if workers == 0:
        return "in the training process (data.num_workers=0)"
    capped = f" (data.num_workers={requested}, capped at the {workers} CPUs available)" if workers < requested else ""
    return f"{workers} worker processes{capped}"


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


def describe_clipping(max_grad_norm: float | None) -> str:
    if max_grad_norm is None:
        return "not clipped (train.max_grad_norm null): their norm is not computed, metrics.jsonl says grad_norm null"
    return f"clipped to a global norm of {max_grad_norm:g}; the norm before clipping is logged as grad_norm"


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
    trained = [accelerator.unwrap_model(module) for module in parts.trained_modules]  # REPA's projector too
    total = sum(count_parameters(module) for module in trained)
    trainable = sum(
        parameter.numel() for module in trained for parameter in module.parameters() if parameter.requires_grad
    )
    projector = total - count_parameters(model)
    with_projector = f", REPA's projector {projector:,} included" if parts.alignment is not None else ""
    precision = accelerator.mixed_precision if accelerator.mixed_precision != "no" else "fp32"
    rows = {
        "model": f"{describe_model(model.spec)}, attention {config.model.attention}: {total:,} parameters "
        f"({trainable:,} trained{with_projector}; attention layers {attention_parameters(model):,})",
        **({"REPA": describe_alignment(config, parts.alignment, projector)} if parts.alignment is not None else {}),
        "objective": describe_objective(config, parts.objective),
        "latents": describe_latents(config, parts.batches.dataset),
        "data": describe_data(config, parts.batches.dataset),
        "loader": describe_loader(config.data.num_workers, parts.batches.loader.num_workers),
        "batch": f"{geometry(asdict(state))} = {train.global_batch_size} global batch",
        "precision": f"{precision}, {describe_tf32(train.tf32, accelerator.device)}, "
        f"compile {'on (fullgraph)' if train.compile else 'off'}, VCA kernel {train.vca_kernel}",
        "gradients": describe_clipping(train.max_grad_norm),
        "devices": describe_devices(accelerator),
        "run.dir": str(run_root),
        "resumed from": describe_resume(resume_from, saved, state),
    }
    rows["EMA"], warning = describe_ema(train, train.max_steps)
    if parts.posthoc_ema is not None:
        rows["post-hoc EMA"] = parts.posthoc_ema.describe(train.max_steps)
    if parts.preview is not None:
        rows["grids and FID"] = f"from the {parts.preview_weights.label} (log.fid_weights={config.log.fid_weights})"
    width = max(map(len, rows))
    warnings = f"warning: {warning}\n" if warning is not None else ""
    return "train.py start-up\n" + "".join(f"  {key:<{width}}  {value}\n" for key, value in rows.items()) + warnings
