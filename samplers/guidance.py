"""Guidance as a wrapper that turns a class-conditional model into a guided model function with the same call
signature: D = D_weak + scale * (D_main - D_weak) on the guided channels, the main model's output elsewhere.

Two weak predictions share that one combination: classifier-free guidance (Ho & Salimans 2022) takes the same
model with the null label; autoguidance (Karras et al., "Guiding a Diffusion Model with a Bad Version of Itself",
NeurIPS 2024) takes another, weaker model of the same objective (a smaller one, or a shorter-trained or
shorter-EMA export of the same run) with the same label.
"""

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .interface import ModelFn, SamplerOptionError

# (x, t, y) -> (main output, weak output), each (B, C_out, H, W); the weak one needs only the guided channels
PredictionPair = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def classifier_free_guidance(
    model: nn.Module | ModelFn,
    scale: float,
    null_label: int,
    guided_channels: int | None = None,
    interval: tuple[float, float] | None = None,
) -> ModelFn:
    """Return model_fn(x, t, y) = uncond + scale * (cond - uncond) on the guided channels, cond elsewhere.

    The batch is doubled with the null label (the model's num_classes) and run in one forward pass. By default
    all prediction channels (model.in_channels) are guided; the variance channels of a learn_sigma model are
    never guided and come from the conditional half. guided_channels=k guides only the first k channels (DiT
    and SiT guide 3 of 4 latent channels; use k=3 to reproduce their numbers). interval=(t_lo, t_hi), in the
    model's own time units (DDPM: timestep index; SiT: t in [0, 1]), applies guidance only to samples with
    t_lo <= t <= t_hi and returns the conditional output elsewhere, without the doubled pass when no sample of
    the batch is inside. scale == 1 is the conditional model itself: one forward pass, nothing wrapped.
    """

    def cond_and_uncond(x: Tensor, t: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        null = torch.full_like(y, null_label)  # (B,)
        out = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null]))  # (2B, C_out, H, W)
        return out.chunk(2)  # (B, C_out, H, W) each

    return _guided(model, cond_and_uncond, scale, guided_channels, interval)


def autoguidance(
    model: nn.Module | ModelFn,
    guide: nn.Module | ModelFn,
    scale: float,
    guided_channels: int | None = None,
    interval: tuple[float, float] | None = None,
) -> ModelFn:
    """Return model_fn(x, t, y) = guide + scale * (model - guide) on the guided channels, `model` elsewhere (the
    learned-variance channels of a DDPM model come from `model`; the guide's are not used).

    `guide` must share the model's objective, time units, inputs and classes; guided_channels and interval as in
    `classifier_free_guidance`. scale == 1 is the model itself (the guide is never called); guide == model also
    gives the model's output, bit for bit.
    """

    def main_and_guide(x: Tensor, t: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        return model(x, t, y), guide(x, t, y)  # (B, C_out, H, W), (B, C_guide, H, W)

    return _guided(model, main_and_guide, scale, guided_channels, interval)


def _guided(
    model: nn.Module | ModelFn,
    predictions: PredictionPair,
    scale: float,
    guided_channels: int | None,
    interval: tuple[float, float] | None,
) -> ModelFn:
    """The one guidance combination, on the first `guided_channels` channels and inside `interval`."""
    if scale == 1.0:
        return model
    if guided_channels is None:
        if not hasattr(model, "in_channels"):
            raise ValueError(
                "guidance needs model.in_channels (the prediction channels) or an explicit guided_channels"
            )
        guided_channels = int(model.in_channels)
    if guided_channels < 1:
        raise SamplerOptionError(f"guided_channels must be >= 1, got {guided_channels}")
    if interval is not None and not interval[0] <= interval[1]:
        raise SamplerOptionError(f"guidance interval must be (t_lo, t_hi) with t_lo <= t_hi, got {interval}")
    k = guided_channels

    def guided_model(x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        if interval is None:
            inside = torch.ones_like(y, dtype=torch.bool)  # (B,)
        else:
            inside = (t >= interval[0]) & (t <= interval[1])  # (B,)
            if not bool(inside.any()):
                return model(x, t, y)
        main, weak = predictions(x, t, y)  # (B, C_out, H, W), (B, >= k, H, W)
        if k > main.shape[1]:
            raise SamplerOptionError(f"guided_channels={k} exceeds the model's {main.shape[1]} output channels")
        if k > weak.shape[1]:
            raise SamplerOptionError(f"guided_channels={k} exceeds the guide's {weak.shape[1]} output channels")
        guided = weak[:, :k] + scale * (main[:, :k] - weak[:, :k])  # (B, k, H, W)
        mask = inside.view(-1, *([1] * (main.ndim - 1)))  # (B, 1, 1, 1)
        guided = torch.where(mask, guided, main[:, :k])
        return torch.cat([guided, main[:, k:]], dim=1)  # (B, C_out, H, W)

    return guided_model
