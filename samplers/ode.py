"""Probability-flow ODE samplers for interpolant models: fixed-step Euler and Heun, torchdiffeq's adaptive
solvers, and the log-likelihood of data points by integrating the divergence of the velocity field."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple, TypedDict

import torch
from torch import Tensor
from torchdiffeq import odeint
from tqdm.auto import tqdm

from objectives import ADAPTIVE_METHODS

from .interface import DenoiseFn, SampleResult, SamplerOptionError, SamplerStep, StepCallback, batch_time
from .noise import PerSampleNoise, standard_normal_like

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

VelocityFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # (x (B, ...), t (B,), y (B,)) -> dx/dt (B, ...)


def shift_times(times: Sequence[float], shift: float) -> list[float]:
    """A time grid on SiT's axis (0 noise, 1 data) shifted as LightningDiT's `timestep_shift` s shifts its ODE's:
    t -> s·t / (1 − (1 − s)·t). The map keeps 0 and 1 and is increasing; s < 1 moves the points towards the noise
    end (LightningDiT samples with s = 0.3: slope 0.3 at t = 0, 1/0.3 at t = 1), s = 1 is the identity."""
    if not (math.isfinite(shift) and shift > 0):
        raise SamplerOptionError(f"time_shift must be a finite number > 0 (1: no shift), got {shift}")
    return [shift * t / (1 - (1 - shift) * t) for t in times]


def euler(
    velocity: VelocityFn, x: Tensor, labels: Tensor, *, t_steps: Sequence[float], **stepping: Unpack[Stepping]
) -> SampleResult:
    """Explicit Euler from t_steps[0] to t_steps[-1]: x += (t_next - t) * v(x, t) (`fixed_steps`)."""
    return fixed_steps(velocity, x, labels, t_steps=t_steps, method="euler", **stepping)


def heun(
    velocity: VelocityFn, x: Tensor, labels: Tensor, *, t_steps: Sequence[float], **stepping: Unpack[Stepping]
) -> SampleResult:
    """Heun's second-order method (explicit trapezoid): an Euler predictor, then the average of both slopes."""
    return fixed_steps(velocity, x, labels, t_steps=t_steps, method="heun", **stepping)


class Stepping(TypedDict, total=False):
    """What the fixed-step solvers take beside their grid: a progress bar, a callback and the data estimate it gets."""

    progress: bool
    callback: StepCallback | None
    denoise: DenoiseFn | None


def fixed_steps(
    velocity: VelocityFn,
    x: Tensor,
    labels: Tensor,
    *,
    t_steps: Sequence[float],
    method: str,
    progress: bool = False,
    callback: StepCallback | None = None,
    denoise: DenoiseFn | None = None,
) -> SampleResult:
    """From t_steps[0] to t_steps[-1] with explicit Euler (method "euler": x += h v(x, t)) or Heun's second-order
    method ("heun", the explicit trapezoid: an Euler predictor, then the average of both slopes). `callback` gets
    every step's SamplerStep, its data estimate from `denoise` applied to the step's first slope."""
    pairs = list(zip(t_steps[:-1], t_steps[1:]))
    evaluations = {"euler": 1, "heun": 2}[method]
    for i, (t_cur, t_next) in enumerate(tqdm(pairs, desc=f"ODE {method.capitalize()}", disable=not progress)):
        h = t_next - t_cur
        t = batch_time(t_cur, x)  # (B,)
        d_cur = velocity(x, t, labels)
        step = h * d_cur
        if method == "heun":
            d_next = velocity(x + h * d_cur, batch_time(t_next, x), labels)
            step = 0.5 * h * (d_cur + d_next)
        if callback is not None:
            callback(SamplerStep(i, t_cur, x, denoise(x, t, d_cur) if denoise else None, evaluations * (i + 1)))
        x = x + step
    return SampleResult(samples=x, nfe=evaluations * len(pairs))


class _CountingField:
    """The right-hand side handed to torchdiffeq: counts evaluations and ticks the progress bar. Given a callback, it
    hands it a SamplerStep after every accepted step (torchdiffeq's callback_accept_step): the evaluation the step
    started from (torchdiffeq's f0: at the step's start for the FSAL methods dopri5, dopri8 and bosh3, at the previous
    step's last stage for fehlberg2 and adaptive_heun) with its data estimate from `denoise`."""

    def __init__(
        self,
        field: Callable[[Tensor, object], object],
        progress: bool,
        desc: str,
        callback: StepCallback | None = None,
        denoise: DenoiseFn | None = None,
    ):
        self.field = field
        self.nfe = 0
        self.bar = tqdm(desc=desc, unit="nfe", disable=not progress)
        self.callback, self.denoise = callback, denoise
        self.latest: tuple[Tensor, Tensor, Tensor] | None = None  # (t, x, value) of the last evaluation
        self.step_start: tuple[Tensor, Tensor, Tensor] | None = None  # the evaluation the current step starts from
        self.accepted = 0
        if callback is not None:  # torchdiffeq calls the hooks a field has
            self.callback_accept_step = self._accepted

    def __call__(self, t: Tensor, state: object) -> object:
        self.nfe += 1
        if not self.bar.disable:  # reads t back from the device: only when a progress bar is shown
            self.bar.update(1)
            self.bar.set_postfix(t=f"{float(t):.4f}", refresh=False)
        value = self.field(t, state)
        if self.callback is not None:
            self.latest = (t, state, value)
            self.step_start = self.step_start or self.latest  # the first evaluation: f0 of the first step
        return value

    def _accepted(self, t0: Tensor, y0: Tensor, dt: Tensor) -> None:
        t, x, value = self.step_start
        denoised = self.denoise(x, t.to(x.dtype).expand(x.shape[0]), value) if self.denoise else None
        self.callback(SamplerStep(self.accepted, float(t), x, denoised, self.nfe))
        self.accepted += 1
        self.step_start = self.latest  # the accepted step's last stage: the next step's f0


def _check_adaptive(method: str) -> None:
    if method not in ADAPTIVE_METHODS:
        raise SamplerOptionError(f"unknown adaptive ODE method {method!r}; expected one of {list(ADAPTIVE_METHODS)}")


def _end_exactly(times: Tensor) -> dict:
    """Make the solver step onto the end time instead of stepping past it and interpolating back: the field of
    a path may be undefined beyond [0, 1] (VP's sigma_t is NaN for t > 1)."""
    return {"step_t": times[-1:]}


def adaptive(
    velocity: VelocityFn,
    x: Tensor,
    labels: Tensor,
    *,
    t0: float,
    t1: float,
    method: str = "dopri5",
    atol: float = 1e-6,
    rtol: float = 1e-3,
    progress: bool = False,
    callback: StepCallback | None = None,
    denoise: DenoiseFn | None = None,
) -> SampleResult:
    """Integrate dx/dt = v(x, t) from t0 to t1 with a torchdiffeq adaptive solver (error-controlled steps).
    `callback` gets a SamplerStep per accepted step (_CountingField)."""
    _check_adaptive(method)
    field = _CountingField(
        lambda t, state: velocity(state, t.to(state.dtype).expand(state.shape[0]), labels),
        progress,
        f"ODE {method}",
        callback,
        denoise,
    )
    times = torch.tensor([t0, t1], device=x.device, dtype=x.dtype)
    with torch.no_grad():
        trajectory = odeint(field, x, times, method=method, atol=atol, rtol=rtol, options=_end_exactly(times))
    field.bar.close()
    return SampleResult(samples=trajectory[-1], nfe=field.nfe)  # trajectory: (2, B, ...)


def divergence_hutchinson(velocity: Callable[[Tensor], Tensor], x: Tensor, probe: Tensor) -> tuple[Tensor, Tensor]:
    """v(x) and the Hutchinson estimate probe^T (dv/dx) probe of its divergence: unbiased for E[probe probe^T] = I,
    one vector-Jacobian product instead of one per dimension."""
    with torch.enable_grad():
        x = x.detach().requires_grad_(True)
        v = velocity(x)  # (B, ...)
        (vjp,) = torch.autograd.grad(v, x, grad_outputs=probe)  # (B, ...)
    return v.detach(), (vjp * probe).flatten(1).sum(dim=1)  # (B, ...), (B,)


def divergence_exact(velocity: Callable[[Tensor], Tensor], x: Tensor) -> tuple[Tensor, Tensor]:
    """v(x) and the exact trace of dv/dx, one backward pass per dimension (small inputs and tests only)."""
    with torch.enable_grad():
        x = x.detach().requires_grad_(True)
        v = velocity(x)  # (B, ...)
        v_flat = v.flatten(1)  # (B, D)
        div = torch.zeros(x.shape[0], device=x.device, dtype=x.dtype)  # (B,)
        for i in range(v_flat.shape[1]):
            (grad,) = torch.autograd.grad(v_flat[:, i].sum(), x, retain_graph=True)
            div = div + grad.flatten(1)[:, i]
    return v.detach(), div


class LogLikelihood(NamedTuple):
    """log p(x) in nats per sample (B,), the prior point x(t0) each data point maps to, and the NFE."""

    log_prob: Tensor
    prior_point: Tensor
    nfe: int


def standard_normal_log_prob(z: Tensor) -> Tensor:
    """log N(z; 0, I) summed over all non-batch dimensions."""
    dims = z[0].numel()
    return -0.5 * (z.flatten(1) ** 2).sum(dim=1) - 0.5 * dims * math.log(2 * math.pi)  # (B,)


def log_likelihood(
    velocity: VelocityFn,
    x: Tensor,
    labels: Tensor,
    *,
    t0: float,
    t1: float,
    method: str = "dopri5",
    atol: float = 1e-6,
    rtol: float = 1e-3,
    divergence: str = "hutchinson",
    noise: PerSampleNoise | None = None,
    progress: bool = False,
) -> LogLikelihood:
    """Exact-in-the-limit log-density of data x at time t1 under the probability-flow ODE with a N(0, I) prior at t0.

    Along a trajectory d/dt log p_t(x_t) = -div v(x_t, t), so integrating (x, l) backwards from t1 to t0 with
    dl/dt = div v gives log p_t1(x) = log N(x(t0); 0, I) + l(t0). The Hutchinson probe (Rademacher) is drawn once
    per data point and held fixed through the solve, as in FFJORD, so the adaptive solver sees a smooth field.
    """
    _check_adaptive(method)
    if divergence not in ("hutchinson", "exact"):
        raise SamplerOptionError(f"divergence must be 'hutchinson' or 'exact', got {divergence!r}")
    probe = torch.sign(standard_normal_like(x, noise))  # (B, ...) entries +-1

    def augmented(t: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x_t = state[0]
        field = lambda z: velocity(z, t.to(z.dtype).expand(z.shape[0]), labels)  # noqa: E731
        if divergence == "exact":
            return divergence_exact(field, x_t)
        return divergence_hutchinson(field, x_t, probe)

    counted = _CountingField(augmented, progress, f"likelihood {method}")
    times = torch.tensor([t1, t0], device=x.device, dtype=x.dtype)
    start = (x, torch.zeros(x.shape[0], device=x.device, dtype=x.dtype))
    with torch.no_grad():
        xs, ls = odeint(counted, start, times, method=method, atol=atol, rtol=rtol, options=_end_exactly(times))
    counted.bar.close()
    prior_point = xs[-1]  # (B, ...)
    return LogLikelihood(
        log_prob=standard_normal_log_prob(prior_point) + ls[-1], prior_point=prior_point, nfe=counted.nfe
    )
