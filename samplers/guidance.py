"""Classifier-free guidance (Ho & Salimans 2022) as a wrapper that turns a class-conditional model into a
guided model function with the same call signature."""

import torch
from torch import Tensor, nn

from .interface import ModelFn, SamplerOptionError


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
    if scale == 1.0:
        return model
    if guided_channels is None:
        if not hasattr(model, "in_channels"):
            raise ValueError(
                "classifier_free_guidance needs model.in_channels (the prediction channels) "
                "or an explicit guided_channels"
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
        null = torch.full_like(y, null_label)  # (B,)
        out = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null]))  # (2B, C_out, H, W)
        cond, uncond = out.chunk(2)  # (B, C_out, H, W) each
        if k > cond.shape[1]:
            raise SamplerOptionError(f"guided_channels={k} exceeds the model's {cond.shape[1]} output channels")
        guided = uncond[:, :k] + scale * (cond[:, :k] - uncond[:, :k])  # (B, k, H, W)
        mask = inside.view(-1, *([1] * (cond.ndim - 1)))  # (B, 1, 1, 1)
        guided = torch.where(mask, guided, cond[:, :k])
        return torch.cat([guided, cond[:, k:]], dim=1)  # (B, C_out, H, W)

    return guided_model
