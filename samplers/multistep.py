"""Fast deterministic solvers for a DDPM process through diffusers' multistep schedulers: DPM-Solver++(2M)
(Lu et al. 2022) and UniPC (Zhao et al. 2023), both second order, typically good at 10-25 model evaluations
where ancestral DDPM needs ~250.

The schedulers are built from the process's own betas, so they integrate the same noise schedule the model was
trained on; they read only the epsilon half of a learned-variance output (an ODE solver has no use for the
variance). No noise is drawn after x_T. diffusers is imported on first use (it adds ~1 s to any import of the
objective otherwise).
"""

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from diffusers.schedulers.scheduling_utils import SchedulerMixin

from objectives import MULTISTEP_SOLVERS

from .ddpm import DiscreteProcess, model_time
from .interface import ModelFn, SampleResult, SamplerOptionError, SamplerStep, StepCallback

SOLVER_ORDER = 2  # DPM-Solver++(2M) and UniPC-2 (bh2): the orders recommended for guided and unguided sampling


def _dpm_solver_pp_2m(**schedule) -> "SchedulerMixin":
    from diffusers import DPMSolverMultistepScheduler

    return DPMSolverMultistepScheduler(
        **schedule,
        prediction_type="epsilon",
        algorithm_type="dpmsolver++",
        solver_order=SOLVER_ORDER,
        solver_type="midpoint",
        lower_order_final=True,
        final_sigmas_type="zero",
        timestep_spacing="linspace",
    )


def _unipc(**schedule) -> "SchedulerMixin":
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(
        **schedule,
        prediction_type="epsilon",
        predict_x0=True,
        solver_type="bh2",
        solver_order=SOLVER_ORDER,
        lower_order_final=True,
        final_sigmas_type="zero",
        timestep_spacing="linspace",
    )


# Sampler name (the objectives table, in its order) -> the diffusers scheduler it runs, given the noise schedule as
# diffusers' keyword arguments (num_train_timesteps and trained_betas, or beta_start, beta_end and beta_schedule).
SCHEDULERS: dict[str, Callable[..., "SchedulerMixin"]] = dict(zip(MULTISTEP_SOLVERS, (_dpm_solver_pp_2m, _unipc)))


def multistep_solver(
    model_fn: ModelFn,
    x: Tensor,
    labels: Tensor,
    process: DiscreteProcess,
    *,
    solver: str,
    steps: int,
    progress: bool = False,
    callback: StepCallback | None = None,
) -> SampleResult:
    """Integrate from x_T (B, C, H, W) to x_0 in `steps` model evaluations with the solver named `solver`.

    The scheduler's timesteps are steps of `process` (linspace from its last step to 0); the model sees the
    original timestep indices (process.model_timesteps) and only its first C output channels (epsilon) are used.
    `callback` gets every step's SamplerStep (denoised: x_0 = (x - sqrt(1 - abar) eps) / sqrt(abar)).
    """
    if solver not in SCHEDULERS:
        raise SamplerOptionError(f"unknown multistep solver {solver!r}; expected one of {sorted(SCHEDULERS)}")
    if not 1 <= steps < process.num_timesteps:  # diffusers' schedulers return NaN at steps == num_timesteps
        raise SamplerOptionError(f"{solver} needs 1 <= steps < {process.num_timesteps}, got {steps}")
    scheduler = SCHEDULERS[solver](num_train_timesteps=process.num_timesteps, trained_betas=process.betas.numpy())
    scheduler.set_timesteps(steps)  # on the host: the loop reads each step index without a device round trip
    channels = x.shape[1]
    for n, t in enumerate(tqdm(scheduler.timesteps, desc=solver, disable=not progress)):
        t_batch = torch.full((x.shape[0],), int(t), device=x.device, dtype=torch.long)  # (B,) process steps
        eps = model_fn(x, process.model_timesteps(t_batch), labels)[:, :channels]  # (B, C, H, W)
        if callback is not None:
            alpha_bar = float(process.alphas_cumprod[int(t)])
            denoised = (x - (1 - alpha_bar) ** 0.5 * eps.to(x.dtype)) / alpha_bar**0.5  # (B, C, H, W)
            callback(SamplerStep(n, model_time(process, int(t)), x, denoised, n + 1))
        x = scheduler.step(eps.to(x.dtype), t, x).prev_sample
    return SampleResult(samples=x, nfe=len(scheduler.timesteps))
