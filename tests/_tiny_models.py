"""Tiny models the tests write to disk or build in memory: exports of a 1-block DiT-VCA or SiT-VCA on 8x8 pixels,
a 2-block DiT for diffusers, random AutoencoderKLs and a ViT encoder folder for REPA. Each takes well under a
second on the CPU."""

from __future__ import annotations

from pathlib import Path

import timm
import torch
from diffusers import AutoencoderKL
from timm.models import save_for_hf

from dit_vca import create_model
from objectives import DiffusionSpec, TransportSpec

EXPORT_CLASSES = 4  # tiny_export's classes


def tiny_export(folder: Path, class_dropout_prob: float = 0.1, family: str = "DiT", seed: int = 0) -> Path:
    """A 1-block DiT-VCA (or SiT-VCA) on 8x8 one-channel pixels with random (not zero-initialised) output layers;
    `seed` draws the perturbation of the weights (another seed, another model of the same shape)."""
    import dit_vca
    import sit_vca
    from generation import ExportDescription, write_export

    create_model = {"DiT": dit_vca.create_model, "SiT": sit_vca.create_model}[family]
    model = create_model(
        f"{family}-S/2",
        depth=1,
        hidden_size=32,
        num_heads=2,
        input_size=8,
        in_channels=1,
        num_classes=EXPORT_CLASSES,
        class_dropout_prob=class_dropout_prob,
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:  # adaLN-Zero starts at zero output: perturb every trained weight
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    objective = DiffusionSpec(learn_sigma=True) if family == "DiT" else TransportSpec()
    description = ExportDescription(
        model=model.spec, objective=objective, space="pixels", image_size=8, num_classes=EXPORT_CLASSES
    )
    write_export(folder, model.state_dict(), description)
    return folder


DIT_CLASSES = 10  # tiny_dit's classes


def tiny_dit(learn_sigma: bool = True, attention: str = "mhsa", seed: int = 0) -> torch.nn.Module:
    """DiT-S/2 shrunk to 2 blocks of width 64 on an 8x8x4 latent, every trained weight perturbed (adaLN-Zero
    would otherwise make it the zero function)."""
    torch.manual_seed(seed)
    model = create_model(
        "DiT-S/2",
        attention=attention,
        input_size=8,
        num_classes=DIT_CLASSES,
        depth=2,
        hidden_size=64,
        num_heads=4,
        learn_sigma=learn_sigma,
    )
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.05 * torch.randn_like(parameter))
    return model.eval()


def write_tiny_export(folder: Path, attention: str = "mhsa") -> torch.nn.Module:
    from generation import ExportDescription, write_export

    model = tiny_dit(attention=attention)
    write_export(
        folder,
        model.state_dict(),
        ExportDescription(
            model=model.spec,
            objective=DiffusionSpec(learn_sigma=True),
            space="latents",
            image_size=64,
            num_classes=DIT_CLASSES,
            latent_scale=0.18215,
            vae="stabilityai/sd-vae-ft-ema",
        ),
    )
    return model


# A small AutoencoderKL: two resolutions (2x downsampling), 4 latent channels, random weights.
TINY_VAE = dict(
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    block_out_channels=(32, 64),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=8,
)


def tiny_sd_vae() -> AutoencoderKL:
    """A randomly initialised AutoencoderKL in the SD layout (4 levels: 8x downsampling, 4 latent channels), with
    tiny widths."""
    return AutoencoderKL(
        block_out_channels=(8, 8, 8, 8),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
    )


ENCODER_WIDTH = 24


def save_vit(folder: Path, in_chans: int = 1, img_size: int = 8, patch_size: int = 2, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    vit = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=img_size,
        patch_size=patch_size,
        in_chans=in_chans,
        embed_dim=ENCODER_WIDTH,
        depth=2,
        num_heads=2,
        num_classes=0,
    )
    save_for_hf(vit, folder, safe_serialization=True)
    return folder
