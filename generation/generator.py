"""Turning a trained model into images: `ImageGenerator.generate(labels, seeds, ...) -> uint8 images`.

One home for the path from noise to pixels, used by `sample.py`, the previews and FID during training,
and the demo: per-sample noise -> x_T -> guidance (classifier-free, or autoguidance by a weaker model) -> the
objective's sampler -> decoder
(the VAE for latent models) -> uint8 (DiT's rounding, `generation.images.to_uint8`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from torch import nn

from dit_vca.attention import set_vca_kernel
from dit_vca.models import DiT
from generation.cuda_graphs import CapturedCalls
from generation.export import Export, ExportDescription, ExportError
from generation.images import to_uint8
from generation.objective_builder import Objective, create_objective
from samplers import PerSampleNoise, StepCallback, autoguidance, classifier_free_guidance

Decoder = Callable[[torch.Tensor], torch.Tensor]  # model space (B, C, h, w) -> pixels in [-1, 1] (B, 1 or 3, H, W)
PRECISIONS = ("fp32", "tf32", "bf16")
COMPUTE_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}  # what the model computes in


def default_precision(device: torch.device, mixed_precision: str | None = None) -> str:
    """bf16 when Accelerate was launched with --mixed_precision bf16; else TF32 on CUDA, fp32 elsewhere."""
    if mixed_precision == "bf16":
        return "bf16"
    return "tf32" if device.type == "cuda" else "fp32"


def check_precision(precision: str) -> None:
    """A ValueError unless `precision` is one of PRECISIONS (the commands check theirs as user errors first)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {PRECISIONS}")


def set_matmul_precision(precision: str) -> None:
    """TF32 matmuls and convolutions on for "tf32", off otherwise (a process-wide switch of PyTorch)."""
    check_precision(precision)
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"


def load_model(
    export: Export,
    device: torch.device | str = "cpu",
    compile: bool = False,
    vca_kernel: str = "auto",
    precision: str = "fp32",
) -> nn.Module:
    """The EMA network of an export on `device`, in eval mode without gradients, its VCA core on `vca_kernel`
    (dit_vca.attention.set_vca_kernel, which checks the Triton core for `precision`'s dtype now, before any
    compiling); `compile` wraps it in torch.compile (compiled on the first batch)."""
    check_precision(precision)
    model = DiT(export.description.model)
    set_vca_kernel(model, vca_kernel, device, "--vca-kernel", COMPUTE_DTYPES[precision])
    model.load_state_dict(export.weights, strict=True)
    model = model.to(device).eval().requires_grad_(False)
    return torch.compile(model) if compile else model


def pixel_decoder(description: ExportDescription, vae: nn.Module | None) -> Decoder:
    """Model space to pixels: the identity (clamped) in pixel space, the VAE decoder in latent space."""
    if description.in_pixel_space:
        return lambda x: x.clamp(-1, 1)
    if vae is None:
        raise ValueError("a model in latent space needs its VAE to be decoded")
    from generation.vae import decode_latents

    normalization = description.latent_normalization
    return lambda z: decode_latents(vae, z, normalization)


def check_vae_fits(autoencoder, description: ExportDescription, name: str, option: str) -> None:
    """Refuse a VAE whose latents are not the model's: another channel count (a convolution deep in the decoder or
    encoder would fail naming neither) or another downsampling (images of another size than the export declares,
    without a word). `name` and `option` (sample.py's "--vae", ...) say which VAE and how to give another."""
    from generation.vae import latent_downsampling

    channels = autoencoder.config.latent_channels
    if channels != description.channels:
        raise ExportError(
            f"the VAE {name} has {channels} latent channels, but the model generates "
            f"{description.channels}: use a VAE with {description.channels} latent channels ({option})"
        )
    latent_side = description.model.input_size
    decoded = latent_side * latent_downsampling(autoencoder.config)
    if decoded != description.image_size:
        raise ExportError(
            f"the VAE {name} decodes the model's {latent_side}x{latent_side} latents to "
            f"{decoded} px images, but the export declares {description.image_size} px: use the VAE it "
            f"was trained with ({option})"
        )


class ImageGenerator:
    """A class-conditional model, its objective and its decoder.

    `precision` "bf16" runs the model and decoder under bf16 autocast ("tf32" is a process-wide switch, see
    `set_matmul_precision`). `cuda_graphs`: on CUDA every call of the network (a guide's too) replays a CUDA graph
    captured for its input shapes (generation.cuda_graphs; the classifier-free pair is one call of the doubled
    batch), kept across `generate` calls; elsewhere the same calls run eagerly. `model_evaluations` counts the
    sampler's calls of the (guided) model, summed over `generate` calls. `class_names`: the classes' names where
    the training data had them (for grids), else None.
    """

    def __init__(
        self,
        model: DiT,
        objective: Objective,
        decode: Decoder,
        num_classes: int,
        precision: str = "fp32",
        class_names: list[str] | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        check_precision(precision)
        self.model = model
        self.objective = objective
        self.decode = decode
        self.num_classes = num_classes
        self.precision = precision
        self.class_names = class_names
        self.model_evaluations = 0
        self.network = CapturedCalls(model, pure=True) if cuda_graphs else model  # what the sampler's calls run

    @classmethod
    def from_export(
        cls,
        export: Export,
        device: torch.device | str = "cpu",
        vae: str | None = None,
        precision: str = "fp32",
        compile: bool = False,
        vca_kernel: str = "auto",
        vae_option: str = "ImageGenerator.from_export(vae)",
        cuda_graphs: bool = False,
    ) -> ImageGenerator:
        """Build the EMA model of an export on `device`, with its VAE (`vae` overrides the export's);
        `compile` wraps the model in torch.compile (compiled on the first batch); `vca_kernel` ("auto", "aten",
        "triton") runs VCA's core in ATen or Triton (dit_vca.attention.set_vca_kernel); `cuda_graphs` as in the
        class. A VAE that cannot be
        loaded names `vae_option` as the way to give another: this method's `vae` argument, or the option of the
        command that calls it (sample.py: "--vae")."""
        check_precision(precision)  # before the VAE and the model are loaded
        description = export.description
        autoencoder = None
        if not description.in_pixel_space:
            from generation.vae import load_vae  # diffusers is slow to import: latents only

            autoencoder = (  # before the model: fails fast offline
                load_vae(vae, device, option=vae_option)
                if vae is not None
                else load_vae(description.vae, device, hint=description.vae_path, option=vae_option)
            )
            check_vae_fits(autoencoder, description, vae or description.vae, vae_option)
        return cls(
            load_model(export, device, compile, vca_kernel, precision),
            create_objective(description.objective),
            pixel_decoder(description, autoencoder),
            description.num_classes,
            precision,
            description.class_names,
            cuda_graphs,
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        """(C, h, w) of what the model generates."""
        spec = self.model.spec
        return (spec.in_channels, spec.input_size, spec.input_size)

    def check_guide(self, guide: nn.Module) -> None:
        """A guide must take and predict what the model does (generation.autoguide checks exports in full)."""
        for name in ("in_channels", "input_size", "num_classes"):
            if getattr(guide.spec, name) != getattr(self.model.spec, name):
                raise ValueError(
                    f"the guide's {name} is {getattr(guide.spec, name)}, the model's {getattr(self.model.spec, name)}"
                )

    @torch.no_grad()
    def generate(
        self,
        labels: Sequence[int] | np.ndarray | torch.Tensor,
        seeds: Sequence[int],
        *,
        guidance: float = 1.0,
        sampler: str | None = None,
        steps: int | None = None,
        guidance_channels: int | None = None,
        guidance_interval: tuple[float, float] | None = None,
        guide: nn.Module | None = None,
        progress: bool = False,
        callback: StepCallback | None = None,
        **options: Any,
    ) -> np.ndarray:
        """(B, H, W, 3) uint8 images for class `labels` (B,), sample i drawing all its noise from `seeds[i]`.

        guidance: the guidance scale (1: none), of classifier-free guidance, or of autoguidance when `guide` (a
        network of the same objective, inputs and classes, on this device: `load_model`) is given;
        guidance_channels / guidance_interval as in `samplers.classifier_free_guidance`. sampler / steps: the
        objective's sampler (None: its default); options: that sampler's options (eta, atol, diffusion_form, ...).
        callback: called with a samplers.SamplerStep after every step of the sampler (the state, its time, the
        model's estimate of the clean sample, in the model's space: latents for a latent model, and the model
        evaluations so far), to watch a trajectory without wrapping the model.
        """
        device = self.device
        noise = PerSampleNoise(list(seeds), device)
        x_T = noise(self.sample_shape)  # (B, C, h, w): the first draw of every sample's stream
        channels = self.model.in_channels if guidance_channels is None else guidance_channels  # guidance's default
        if guide is None:
            guided = classifier_free_guidance(
                self.network,
                guidance,
                null_label=self.num_classes,
                guided_channels=channels,
                interval=guidance_interval,
            )
        else:
            self.check_guide(guide)
            guide_calls = CapturedCalls(guide, pure=True) if isinstance(self.network, CapturedCalls) else guide
            guided = autoguidance(self.network, guide_calls, guidance, channels, guidance_interval)

        def model_fn(x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            self.model_evaluations += 1
            return guided(x, t, y)

        labels = torch.as_tensor(np.asarray(labels), dtype=torch.long, device=device)  # (B,)
        # An autocast(enabled=False) would switch off an enclosing one (training's mixed precision): enter none.
        bf16 = torch.autocast(device.type, dtype=torch.bfloat16) if self.precision == "bf16" else nullcontext()
        with bf16:
            result = self.objective.sample(
                model_fn,
                x_T,
                labels,
                sampler=sampler or self.objective.default_sampler,
                steps=steps,
                noise=noise,
                progress=progress,
                callback=callback,
                **options,
            )
            return to_uint8(self.decode(result.samples))  # (B, H, W, 3)
