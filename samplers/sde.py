"""Stochastic samplers for interpolant models, integrating dx = f(x, t) dt + sqrt(2 w(t)) dW forward in t
(noise at t = 0 to data at t = 1), where f = v + w * score keeps the marginals of the probability-flow ODE."""

from collections.abc import Callable, Sequence

from torch import Tensor
from tqdm.auto import tqdm

from .interface import DenoiseFn, SampleResult, SamplerStep, StepCallback, batch_time
from .noise import PerSampleNoise, standard_normal_like

DriftFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # (x (B, ...), t (B,), y (B,)) -> f(x, t) (B, ...)
DiffusionFn = Callable[[float], float]  # t -> w(t) >= 0
# (x, t (B,), y) -> (final sample, the data estimate at (x, t)), one model evaluation
LastStepFn = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def _finish(
    x: Tensor,
    labels: Tensor,
    t_end: float,
    last_step: LastStepFn | None,
    nfe: int,
    callback: StepCallback | None,
    steps: int,
) -> SampleResult:
    """The optional noise-free last step (itself a step for the callback, the `steps`-th)."""
    if last_step is None:
        return SampleResult(samples=x, nfe=nfe)
    samples, denoised = last_step(x, batch_time(t_end, x), labels)
    if callback is not None:
        callback(SamplerStep(steps, t_end, x, denoised, nfe + 1))
    return SampleResult(samples=samples, nfe=nfe + 1)


def euler_maruyama(
    drift: DriftFn,
    diffusion: DiffusionFn,
    x: Tensor,
    labels: Tensor,
    *,
    t_steps: Sequence[float],
    last_step: LastStepFn | None = None,
    noise: PerSampleNoise | None = None,
    progress: bool = False,
    callback: StepCallback | None = None,
    denoise: DenoiseFn | None = None,
) -> SampleResult:
    """Euler–Maruyama: x += f(x, t) h + sqrt(2 w(t) h) z on each interval, then the optional noise-free last step.
    `callback` gets every step's SamplerStep, its data estimate from `denoise` applied to the step's drift."""
    pairs = list(zip(t_steps[:-1], t_steps[1:]))
    for i, (t_cur, t_next) in enumerate(tqdm(pairs, desc="SDE Euler", disable=not progress)):
        h = t_next - t_cur
        t = batch_time(t_cur, x)  # (B,)
        d_cur = drift(x, t, labels)
        if callback is not None:
            callback(SamplerStep(i, t_cur, x, denoise(x, t, d_cur) if denoise else None, i + 1))
        x_mean = x + h * d_cur
        x = x_mean + (2 * diffusion(t_cur) * h) ** 0.5 * standard_normal_like(x, noise)
    return _finish(x, labels, t_steps[-1], last_step, len(pairs), callback, len(pairs))


def heun(
    drift: DriftFn,
    diffusion: DiffusionFn,
    x: Tensor,
    labels: Tensor,
    *,
    t_steps: Sequence[float],
    last_step: LastStepFn | None = None,
    noise: PerSampleNoise | None = None,
    progress: bool = False,
    callback: StepCallback | None = None,
    denoise: DenoiseFn | None = None,
) -> SampleResult:
    """Stochastic Heun (as in SiT): add the step's noise first, then one deterministic Heun step of the drift.
    `callback` gets every step's SamplerStep at the noised state, its data estimate from `denoise` applied to the
    first drift."""
    pairs = list(zip(t_steps[:-1], t_steps[1:]))
    for i, (t_cur, t_next) in enumerate(tqdm(pairs, desc="SDE Heun", disable=not progress)):
        h = t_next - t_cur
        x_hat = x + (2 * diffusion(t_cur) * h) ** 0.5 * standard_normal_like(x, noise)
        t = batch_time(t_cur, x)  # (B,)
        d_cur = drift(x_hat, t, labels)
        d_next = drift(x_hat + h * d_cur, batch_time(t_next, x), labels)
        if callback is not None:
            callback(SamplerStep(i, t_cur, x_hat, denoise(x_hat, t, d_cur) if denoise else None, 2 * (i + 1)))
        x = x_hat + 0.5 * h * (d_cur + d_next)
    return _finish(x, labels, t_steps[-1], last_step, 2 * len(pairs), callback, len(pairs))
