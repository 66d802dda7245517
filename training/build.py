"""The parts a config names: model, objective, and the description exported with every checkpoint.

DiT models ("DiT-...") train with the DDPM objective of `dit_vca`, SiT models ("SiT-...") with the
transport objective of `sit_vca`; the family prefix of model.name decides, so the two cannot be mismatched.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from diffusers import AutoencoderKL
from torch.utils.data import Dataset

from dit_vca import GaussianDiffusion, create_diffusion
from dit_vca.models import DiT, build_model_from_config
from sit_vca import Transport, create_transport
from training.config import Config
from training.data import DIGITS_SIZE, LatentShardDataset
from training.vae import decode_latents, latent_downsampling

Objective = Union[GaussianDiffusion, Transport]
OBJECTIVE_OF_FAMILY = {"DiT": "diffusion", "SiT": "transport"}


def model_family(config: Config) -> str:
    """"DiT" or "SiT"."""
    return config.model.name.split("-", 1)[0]


def needs_vae(config: Config) -> bool:
    """Images are encoded online; latents are decoded for grids and FID; digits live in pixel space."""
    decodes = bool(config.log.sample_every or config.log.fid_every)
    return config.data.source == "images" or (config.data.source == "latents" and decodes)


def model_input_shape(config: Config, dataset: Dataset, vae: Optional[AutoencoderKL]) -> tuple[int, int]:
    """(channels, side) of what the model sees: pixels for digits, latents otherwise."""
    if config.data.source == "digits":
        return 1, DIGITS_SIZE
    if isinstance(dataset, LatentShardDataset):
        return dataset.manifest["latent_channels"], dataset.manifest["latent_size"]
    return vae.config.latent_channels, config.data.image_size // latent_downsampling(vae.config)


def pixel_decoder(config: Config, vae: Optional[AutoencoderKL]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Model space (B, C, h, w) -> pixels in [-1, 1]."""
    if config.data.source == "digits":
        return lambda x: x.clamp(-1, 1)
    return lambda z: decode_latents(vae, z, config.vae.scale)


def model_arguments(config: Config, in_channels: int, input_size: int) -> dict[str, Any]:
    """Keyword arguments of `create_model` (the same dict `model.config` holds once built)."""
    model = config.model
    arguments: dict[str, Any] = dict(
        name=model.name, attention=model.attention, input_size=input_size, in_channels=in_channels,
        num_classes=config.data.num_classes, class_dropout_prob=model.class_dropout_prob,
        learn_sigma=config.diffusion.learn_sigma if model_family(config) == "DiT" else False,
        gradient_checkpointing=model.gradient_checkpointing)
    if model.attention == "vca":
        arguments.update(contrast_grid=model.contrast_grid, joint_softmax=model.joint_softmax,
                         stage1_differential=model.stage1_differential,
                         stage2_differential=model.stage2_differential, pooled_content=model.pooled_content)
    for size_override in ("depth", "hidden_size", "num_heads", "mlp_ratio"):
        if getattr(model, size_override) is not None:
            arguments[size_override] = getattr(model, size_override)
    return arguments


def build_model(config: Config, in_channels: int, input_size: int) -> DiT:
    """The network of `config` for inputs (B, in_channels, input_size, input_size)."""
    return build_model_from_config(model_arguments(config, in_channels, input_size))


def objective_spec(config: Config) -> dict[str, Any]:
    """{"kind": "diffusion" | "transport", **keyword arguments of its factory} (JSON-serialisable)."""
    kind = OBJECTIVE_OF_FAMILY[model_family(config)]
    if kind == "diffusion":
        return {"kind": kind, "learn_sigma": config.diffusion.learn_sigma}
    transport = config.transport
    return {"kind": kind, "path": transport.path, "prediction": transport.prediction,
            "loss_weight": transport.loss_weight, "train_eps": transport.train_eps,
            "sample_eps": transport.sample_eps}


def create_objective(spec: dict[str, Any]) -> Objective:
    """The training loss and samplers described by `objective_spec` (or an export's "objective")."""
    arguments = dict(spec)
    kind = arguments.pop("kind", None)
    if kind == "diffusion":
        return create_diffusion(**arguments)
    if kind == "transport":
        return create_transport(**arguments)
    raise ValueError(f"objective kind must be one of {sorted(OBJECTIVE_OF_FAMILY.values())}, got {kind!r}")


def export_description(config: Config, model: DiT) -> dict[str, Any]:
    """What sampling needs to rebuild the model and turn its outputs into images (the export's config.json)."""
    pixels = config.data.source == "digits"
    return {
        "model": dict(model.config),
        "objective": objective_spec(config),
        "data": {"kind": "pixels" if pixels else "latents", "image_size": config.data.image_size,
                 "channels": model.in_channels, "num_classes": config.data.num_classes,
                 "latent_scale": None if pixels else config.vae.scale, "vae": None if pixels else config.vae.name},
    }
