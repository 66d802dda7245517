"""Discrete-time samplers over a (respaced) DDPM process: ancestral DDPM and DDIM."""

from typing import NamedTuple, Protocol

import torch
from torch import Tensor
from tqdm.auto import tqdm

from .interface import ModelFn, SampleResult, SamplerOptionError, SamplerStep, StepCallback
from .noise import PerSampleNoise, standard_normal_like


class ReverseStep(NamedTuple):
    """What a model output implies about x_{t-1} given x_t (all shaped like x_t)."""

    mean: Tensor
    log_variance: Tensor
    pred_xstart: Tensor
    eps: Tensor


class DiscreteProcess(Protocol):
    """The part of a respaced diffusion process (dit_vca.GaussianDiffusion) that the samplers use."""

    num_timesteps: int
    betas: Tensor  # (K,) float64
    alphas_cumprod: Tensor  # (K,) float64
    alphas_cumprod_prev: Tensor  # (K,) float64

    def model_timesteps(self, t: Tensor) -> Tensor: ...

    def p_mean_variance(
        self, model_output: Tensor, x_t: Tensor, t: Tensor, clip_denoised: bool = False
    ) -> ReverseStep: ...


def _reverse_step(
    model_fn: ModelFn, process: DiscreteProcess, x: Tensor, labels: Tensor, i: int, clip_denoised: bool
) -> ReverseStep:
    """Evaluate the model at process step i; the model sees the original (un-respaced) timestep index."""
    t = torch.full((x.shape[0],), i, device=x.device, dtype=torch.long)  # (B,)
    return process.p_mean_variance(model_fn(x, process.model_timesteps(t), labels), x, t, clip_denoised)


def model_time(process: DiscreteProcess, i: int) -> float:
    """The original timestep index the model sees at process step i, read on the host (for a callback)."""
    return float(process.model_timesteps(torch.tensor([i]))[0])


def ddpm(
    model_fn: ModelFn,
    x: Tensor,
    labels: Tensor,
    process: DiscreteProcess,
    *,
    noise: PerSampleNoise | None = None,
    progress: bool = False,
    clip_denoised: bool = False,
    callback: StepCallback | None = None,
) -> SampleResult:
    """Ancestral sampling (Ho et al. 2020, Alg. 2): x_{t-1} ~ N(mu(x_t, t), Sigma(x_t, t)); the last step adds
    no noise. `callback` gets every step's SamplerStep (denoised: the predicted x_0)."""
    for n, i in enumerate(tqdm(range(process.num_timesteps - 1, -1, -1), desc="DDPM", disable=not progress)):
        step = _reverse_step(model_fn, process, x, labels, i, clip_denoised)
        if callback is not None:
            callback(SamplerStep(n, model_time(process, i), x, step.pred_xstart, n + 1))
        x = step.mean
        if i > 0:
            x = x + torch.exp(0.5 * step.log_variance) * standard_normal_like(x, noise)
    return SampleResult(samples=x, nfe=process.num_timesteps)


def ddim(
    model_fn: ModelFn,
    x: Tensor,
    labels: Tensor,
    process: DiscreteProcess,
    *,
    eta: float = 0.0,
    noise: PerSampleNoise | None = None,
    progress: bool = False,
    clip_denoised: bool = False,
    callback: StepCallback | None = None,
) -> SampleResult:
    """DDIM (Song et al. 2021, Eq. 12): jump to the predicted x_0 re-noised to step t-1; eta=0 is deterministic.
    `callback` gets every step's SamplerStep (denoised: the predicted x_0)."""
    if eta < 0:
        raise SamplerOptionError(f"DDIM eta must be >= 0, got {eta}")
    alphas_cumprod = process.alphas_cumprod.tolist()  # Python floats, read once: nothing to copy in the loop
    alphas_cumprod_prev = process.alphas_cumprod_prev.tolist()
    for n, i in enumerate(tqdm(range(process.num_timesteps - 1, -1, -1), desc="DDIM", disable=not progress)):
        step = _reverse_step(model_fn, process, x, labels, i, clip_denoised)
        if callback is not None:
            callback(SamplerStep(n, model_time(process, i), x, step.pred_xstart, n + 1))
        alpha_bar, alpha_bar_prev = alphas_cumprod[i], alphas_cumprod_prev[i]
        sigma = eta * ((1 - alpha_bar_prev) / (1 - alpha_bar) * (1 - alpha_bar / alpha_bar_prev)) ** 0.5
        x = step.pred_xstart * alpha_bar_prev**0.5 + (1 - alpha_bar_prev - sigma**2) ** 0.5 * step.eps
        if i > 0 and sigma > 0:
            x = x + sigma * standard_normal_like(x, noise)
    return SampleResult(samples=x, nfe=process.num_timesteps)
