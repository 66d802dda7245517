"""The one interface every sampler shares: the model function it calls, its result type, the step it hands a
callback and the checks on a sampler request."""

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from commands import UserError


class SamplerOptionError(UserError):
    """A sampler, step count or sampler option that cannot be used; the message names it and the valid values.

    Raised before (or, for guidance channels, at the first model call of) any sampling work, so that a command
    can try a request once and answer a bad option in one line while a bug elsewhere keeps its traceback."""


# A (possibly guided) model: x (B, C, H, W), t (B,) in the model's own time units, labels y (B,) -> (B, C_out, H, W),
# C_out = C, or 2C for a DDPM model that also predicts its variance.
ModelFn = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class SamplerStep:
    """What every sampler hands its callback once per step, after the step's model evaluations (k-diffusion's
    callback dict, typed): the state the step evaluated the model at and its time, the model's estimate of the clean
    sample there, and the model evaluations made so far, this step's included."""

    i: int  # the step's index, 0 first
    t: float  # in the model's own time units: DDPM's original timestep index, an interpolant's t in [0, 1]
    x: Tensor  # (B, C, H, W): the state at t (SDE Heun: after the step's noise, where its drift is evaluated)
    denoised: Tensor | None  # (B, C, H, W): x_0 of DDPM, x_1 of an interpolant; None if the caller gave no estimate
    nfe: int  # model evaluations so far, this step's included (an adaptive solver's rejected attempts too)


StepCallback = Callable[[SamplerStep], None]
# The data estimate from the derivative a solver evaluated at (x (B, ...), t (B,)), without another model call:
# (x, t, derivative) -> (B, ...). The objective that builds the derivative from a model output provides it.
DenoiseFn = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class SampleResult:
    """Final samples of a sampler and the number of model-function evaluations (NFE) it took."""

    samples: Tensor  # (B, C, H, W), same shape as x_T
    nfe: int


def check_sampler_request(sampler: str, options: dict, allowed_options: dict[str, Iterable[str]]) -> None:
    """Raise SamplerOptionError naming the bad sampler or option (and the valid ones) before any sampling work."""
    if sampler not in allowed_options:
        raise SamplerOptionError(f"unknown sampler {sampler!r}; expected one of {sorted(allowed_options)}")
    unknown = sorted(set(options) - set(allowed_options[sampler]))
    if unknown:
        valid = sorted(allowed_options[sampler]) or "none"
        raise SamplerOptionError(f"sampler {sampler!r} got unknown option(s) {unknown}; its options are: {valid}")


def batch_time(t: float, x: Tensor) -> Tensor:
    """The scalar time t repeated for every sample of x, in x's dtype and device."""
    return torch.full((x.shape[0],), t, device=x.device, dtype=x.dtype)  # (B,)
