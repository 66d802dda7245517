"""Stochastic samplers for interpolant models, integrating dx = f(x, t) dt + sqrt(2 w(t)) dW forward in t
(noise at t = 0 to data at t = 1), where f = v + w * score keeps the marginals of the probability-flow ODE."""

from collections.abc import Callable, Sequence

from torch import Tensor
from tqdm.auto import tqdm

from .interface import SampleResult, batch_time
from .noise import PerSampleNoise, standard_normal_like

DriftFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # (x (B, ...), t (B,), y (B,)) -> f(x, t) (B, ...)
DiffusionFn = Callable[[float], float]  # t -> w(t) >= 0
LastStepFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # (x, t (B,), y) -> final sample, one model evaluation


def _finish(x: Tensor, labels: Tensor, t_end: float, last_step: LastStepFn | None, nfe: int) -> SampleResult:
    if last_step is None:
        return SampleResult(samples=x, nfe=nfe)
    return SampleResult(samples=last_step(x, batch_time(t_end, x), labels), nfe=nfe + 1)


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
) -> SampleResult:
    """Euler–Maruyama: x += f(x, t) h + sqrt(2 w(t) h) z on each interval, then the optional noise-free last step."""
    pairs = list(zip(t_steps[:-1], t_steps[1:]))
    for t_cur, t_next in tqdm(pairs, desc="SDE Euler", disable=not progress):
        h = t_next - t_cur
        x_mean = x + h * drift(x, batch_time(t_cur, x), labels)
        x = x_mean + (2 * diffusion(t_cur) * h) ** 0.5 * standard_normal_like(x, noise)
    return _finish(x, labels, t_steps[-1], last_step, len(pairs))


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
) -> SampleResult:
    """Stochastic Heun (as in SiT): add the step's noise first, then one deterministic Heun step of the drift."""
    pairs = list(zip(t_steps[:-1], t_steps[1:]))
    for t_cur, t_next in tqdm(pairs, desc="SDE Heun", disable=not progress):
        h = t_next - t_cur
        x_hat = x + (2 * diffusion(t_cur) * h) ** 0.5 * standard_normal_like(x, noise)
        d_cur = drift(x_hat, batch_time(t_cur, x), labels)
        d_next = drift(x_hat + h * d_cur, batch_time(t_next, x), labels)
        x = x_hat + 0.5 * h * (d_cur + d_next)
    return _finish(x, labels, t_steps[-1], last_step, 2 * len(pairs))
