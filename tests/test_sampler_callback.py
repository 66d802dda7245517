"""The per-step callback every sampler takes (issue 49): one SamplerStep per step with the state the model was
evaluated at, its time, the model's estimate of the clean sample there and the evaluations so far; checked against a
recording of the model's calls and against the closed-form estimate E[clean | x_t] of Gaussian data (_gaussian.py),
for DDPM, DDIM, the multistep solvers, Euler, Heun, the adaptive ODE solvers and the SDE samplers, and through
ImageGenerator.generate."""

import pytest
import torch

from _gaussian import (
    MU,
    SHAPE,
    STD,
    ddpm_optimal_model,
    interpolant_optimal_model,
    path_coefficients,
    reference_alphas_cumprod,
    single_thread,  # noqa: F401 (an autouse fixture: one intra-op thread for every test here)
)
from dit_vca import create_diffusion
from dit_vca.diffusion import space_timesteps
from samplers import PerSampleNoise, SamplerStep
from sit_vca import create_transport

BATCH = 3


class Recording:
    """The model's calls (x, t) and the steps the callback got, with the number of calls made when each came."""

    def __init__(self, model):
        self.model, self.calls, self.steps, self.calls_at_step = model, [], [], []

    def __call__(self, x, t, y):
        self.calls.append((x.clone(), t.clone()))
        return self.model(x, t, y)

    def callback(self, step: SamplerStep) -> None:
        self.steps.append(step)
        self.calls_at_step.append(len(self.calls))

    def check_counts_and_indices(self, nfe: int) -> None:
        """Steps 0, 1, ... each with the evaluations made by then; the last has them all."""
        assert [step.i for step in self.steps] == list(range(len(self.steps)))
        assert [step.nfe for step in self.steps] == self.calls_at_step
        assert self.steps[-1].nfe == nfe == len(self.calls)

    def check_states(self, evaluations_per_step: int | None, last: int | None = None) -> None:
        """Each step's x and t (the first `last` steps') are the inputs of the model call whose output gave its
        estimate: a fixed-step sampler's first call of the step; an adaptive solver's, some call at that time."""
        for step in self.steps[:last]:
            if evaluations_per_step is not None:
                x, t = self.calls[step.nfe - evaluations_per_step]
                assert torch.equal(step.x, x) and torch.all(t == t[0]) and float(t[0]) == pytest.approx(step.t, abs=0)
            else:
                assert any(torch.equal(step.x, x) and float(t[0]) == step.t for x, t in self.calls)


def prior(n: int = BATCH, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, *SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def labels(n: int = BATCH) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.long)


def noise() -> PerSampleNoise:
    return PerSampleNoise(list(range(BATCH)), "cpu")


def ddpm_estimate(x: torch.Tensor, timestep: int) -> torch.Tensor:
    """E[x_0 | x_t] of the Gaussian data, t an original timestep index: MU + sqrt(abar) STD² (x - sqrt(abar) MU) / V."""
    abar = reference_alphas_cumprod()[timestep]
    return MU + abar.sqrt() * STD**2 * (x - abar.sqrt() * MU) / (abar * STD**2 + 1 - abar)


def interpolant_estimate(path: str, x: torch.Tensor, t: float) -> torch.Tensor:
    """E[x_1 | x_t] of the Gaussian data: MU + alpha STD² (x - alpha MU) / (alpha² STD² + sigma²)."""
    alpha, _, sigma, _ = path_coefficients(path, torch.tensor(t, dtype=torch.float64))
    return MU + alpha * STD**2 * (x - alpha * MU) / (alpha**2 * STD**2 + sigma**2)


# ----------------------------------------------------------------------------------------------------------------
# DDPM's process
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler, steps", [("ddpm", 12), ("ddim", 10), ("dpm++2m", 8), ("unipc", 8)])
def test_every_ddpm_step_reaches_the_callback_with_its_state_time_and_x0(sampler, steps):
    kept = space_timesteps(1000, f"ddim{steps}" if sampler == "ddim" else str(steps))
    if sampler in ("dpm++2m", "unipc"):
        kept = list(range(1000))  # the multistep solvers step on the full process; only the epsilon half counts
    recording = Recording(ddpm_optimal_model(kept))
    diffusion = create_diffusion()
    result = diffusion.sample(recording, prior(), labels(), sampler=sampler, steps=steps, callback=recording.callback)
    assert len(recording.steps) == steps
    recording.check_counts_and_indices(result.nfe)
    recording.check_states(evaluations_per_step=1)
    times = [step.t for step in recording.steps]
    assert times == sorted(times, reverse=True) and times[0] >= 900  # from the noise end down
    if sampler in ("ddpm", "ddim"):
        assert times == sorted(kept, reverse=True)
    for step in recording.steps:
        # float64 algebra on both sides (the process's tables and the reference betas): 1e-9 after 1/sqrt(abar)
        torch.testing.assert_close(step.denoised, ddpm_estimate(step.x, int(step.t)), rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------------------------------------------
# Interpolants: ODE and SDE
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, prediction", [("linear", "velocity"), ("gvp", "score"), ("vp", "noise")])
@pytest.mark.parametrize("sampler, steps, per_step", [("euler", 7, 1), ("heun", 5, 2)])
def test_every_fixed_ode_step_reaches_the_callback(path, prediction, sampler, steps, per_step):
    transport = create_transport(path=path, prediction=prediction, sample_eps=1e-3)
    recording = Recording(interpolant_optimal_model(path, prediction))
    result = transport.sample(recording, prior(), labels(), sampler=sampler, steps=steps, callback=recording.callback)
    assert len(recording.steps) == steps
    recording.check_counts_and_indices(result.nfe)
    recording.check_states(per_step)
    t0, t1 = transport.interval(transport.sample_eps)
    expected = torch.linspace(t0, t1, steps + 1, dtype=torch.float64)[:-1].tolist()
    assert [step.t for step in recording.steps] == pytest.approx(expected, abs=1e-15)
    for step in recording.steps:  # the data estimate from the velocity, against the closed form (float64: 1e-9)
        torch.testing.assert_close(step.denoised, interpolant_estimate(path, step.x, step.t), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("method", ["dopri5", "bosh3", "fehlberg2"])
def test_every_accepted_adaptive_step_reaches_the_callback(method):
    """One SamplerStep per accepted step, at increasing times from t0; its state and estimate are those of the model
    call the step started from; the last carries every evaluation, rejected attempts included."""
    transport = create_transport(path="linear")
    recording = Recording(interpolant_optimal_model("linear", "velocity"))
    result = transport.sample(recording, prior(), labels(), sampler=method, callback=recording.callback)
    assert len(recording.steps) >= 2
    recording.check_counts_and_indices(result.nfe)
    recording.check_states(evaluations_per_step=None)
    times = [step.t for step in recording.steps]
    assert times[0] == 0.0 and all(a < b for a, b in zip(times, times[1:])) and times[-1] < 1.0
    for step in recording.steps:
        torch.testing.assert_close(step.denoised, interpolant_estimate("linear", step.x, step.t), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("path, prediction", [("linear", "velocity"), ("gvp", "noise"), ("vp", "score")])
@pytest.mark.parametrize("sampler, per_step", [("sde-euler", 1), ("sde-heun", 2)])
@pytest.mark.parametrize("last_step", ["Mean", "Euler", "Tweedie", None])
def test_every_sde_step_and_the_last_step_reach_the_callback(path, prediction, sampler, per_step, last_step):
    """The data estimate of an SDE step comes from its drift v + w·score (the velocity recovered from it); the last
    step is a step too, with the estimate at its start."""
    steps = 6
    transport = create_transport(path=path, prediction=prediction, sample_eps=1e-3)
    recording = Recording(interpolant_optimal_model(path, prediction))
    result = transport.sample(
        recording, prior(), labels(), sampler=sampler, steps=steps, last_step=last_step, callback=recording.callback
    )
    assert len(recording.steps) == steps
    recording.check_counts_and_indices(result.nfe)
    recording.check_states(per_step, last=-1 if last_step is not None else None)
    if last_step is not None:  # the last step: one evaluation at the end of the SDE's interval
        last = recording.steps[-1]
        assert last.nfe == recording.steps[-2].nfe + 1 and torch.equal(last.x, recording.calls[-1][0])
        if last_step == "Tweedie":
            assert torch.equal(last.denoised, result.samples)  # Tweedie's step is the estimate
    for step in recording.steps:  # float64; the VP path's alpha'/alpha and sigma near 1 cost digits: 1e-8
        torch.testing.assert_close(step.denoised, interpolant_estimate(path, step.x, step.t), rtol=1e-8, atol=1e-8)


def test_a_callback_does_not_change_the_samples():
    transport = create_transport(path="linear")
    model = interpolant_optimal_model("linear", "velocity")
    for sampler in ("heun", "dopri5", "sde-heun"):
        plain = transport.sample(model, prior(), labels(), sampler=sampler, noise=noise()).samples
        seen = []
        watched = transport.sample(model, prior(), labels(), sampler=sampler, noise=noise(), callback=seen.append)
        assert seen and torch.equal(plain, watched.samples), sampler


# ----------------------------------------------------------------------------------------------------------------
# Through ImageGenerator.generate
# ----------------------------------------------------------------------------------------------------------------


def test_generate_hands_every_step_to_the_callback(export):
    from generation import ImageGenerator, read_export

    generator = ImageGenerator.from_export(read_export(export))
    seen: list[SamplerStep] = []
    before = generator.model_evaluations
    generator.generate([0, 1], [5, 6], guidance=2.0, sampler="ddim", steps=4, callback=seen.append)
    assert [step.i for step in seen] == [0, 1, 2, 3]
    assert seen[-1].nfe == generator.model_evaluations - before == 4
    assert all(step.x.shape == step.denoised.shape == (2, *generator.sample_shape) for step in seen)
