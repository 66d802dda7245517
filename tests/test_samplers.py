"""Samplers against exact mathematics: the optimal predictors of Gaussian data as the "model" (closed forms in
_gaussian.py), diffusers' schedulers as a step-by-step peer, and the reproducibility and NFE contract."""

import math

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler

from _gaussian import (
    MU,
    SHAPE,
    STD,
    assert_moments,
    ddpm_optimal_model,
    exact_flow,
    flow_log_density,
    gaussian_log_density,
    interpolant_optimal_model,
    load_reference,
    mean_last_step,
    rotated_velocity_model,
    rotation,
    single_thread,  # noqa: F401 (an autouse fixture: one intra-op thread for every test here)
)
from dit_vca import create_diffusion
from samplers import PerSampleNoise, SampleResult
from sit_vca import create_transport

PATHS = ["linear", "gvp", "vp"]


def labels(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.long)


def prior(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, *SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


class SharedStream:
    """A noise source that draws each step's (B, ...) noise from one generator, as diffusers' schedulers do."""

    def __init__(self, batch: int, seed: int):
        self.batch, self.generator = batch, torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.batch

    def __call__(self, shape, dtype=torch.float32):
        return torch.randn(self.batch, *shape, generator=self.generator, dtype=dtype)


# ----------------------------------------------------------------------------------------------------------------
# DDPM and DDIM
# ----------------------------------------------------------------------------------------------------------------


def test_ddpm_250_samples_the_gaussian():
    """With the exact conditional mean and variance of every reverse step, ancestral sampling is exact up to the
    prior mismatch at t = 999 (abar = 4e-5) and the final denoising step (variance 1e-4 of STD^2): no
    discretisation allowance beyond 0.002, only sampling noise."""
    n = 16384
    model = ddpm_optimal_model(load_reference()["respace_250"]["timesteps"])
    result = create_diffusion().sample(model, prior(n), labels(n), sampler="ddpm", steps=250)
    assert result.nfe == 250
    assert_moments(result.samples, MU, STD, allowance=0.002)


def test_ddpm_matches_diffusers_step_by_step():
    """The whole 250-step chain equals diffusers' DDPMScheduler (learned_range variance, custom timesteps) fed
    the same noise; diffusers keeps alphas_cumprod in float32, so agreement is to float32 rounding
    (~1e-7 relative per step, amplified by 1/sqrt(abar) <= 160 in the predicted x_0 early on): atol 1e-4."""
    n, kept = 16, load_reference()["respace_250"]["timesteps"]
    model = ddpm_optimal_model(kept)
    x_T = prior(n).float()
    ours = create_diffusion().sample(model, x_T, labels(n), sampler="ddpm", steps=250, noise=SharedStream(n, 7))

    scheduler = DDPMScheduler(
        num_train_timesteps=1000,
        beta_start=1e-4,
        beta_end=0.02,
        beta_schedule="linear",
        variance_type="learned_range",
        clip_sample=False,
    )
    scheduler.set_timesteps(timesteps=kept[::-1])
    generator, x = torch.Generator().manual_seed(7), x_T
    for t in scheduler.timesteps:
        output = model(x.double(), torch.full((n,), int(t)), None).float()
        x = scheduler.step(output, t, x, generator=generator).prev_sample
    torch.testing.assert_close(ours.samples, x, rtol=0, atol=1e-4)


def test_ddim_matches_diffusers_step_by_step():
    """DDIM-50 (eta 0) over "ddim50" equals diffusers' DDIMScheduler (leading spacing, final alpha 1): same
    float32-rounding argument as above."""
    n, kept = 16, load_reference()["respace_ddim50"]["timesteps"]
    model = ddpm_optimal_model(kept)
    x_T = prior(n).float()
    ours = create_diffusion().sample(model, x_T, labels(n), sampler="ddim", steps=50, eta=0.0)

    scheduler = DDIMScheduler(
        num_train_timesteps=1000,
        beta_start=1e-4,
        beta_end=0.02,
        beta_schedule="linear",
        clip_sample=False,
        set_alpha_to_one=True,
        steps_offset=0,
        timestep_spacing="leading",
    )
    scheduler.set_timesteps(50)
    assert scheduler.timesteps.tolist() == kept[::-1]
    x = x_T
    for t in scheduler.timesteps:
        output = model(x.double(), torch.full((n,), int(t)), None).float()
        x = scheduler.step(output[:, :4], t, x, eta=0.0).prev_sample
    torch.testing.assert_close(ours.samples, x, rtol=0, atol=1e-4)


def test_ddim_50_samples_the_gaussian():
    """DDIM is a first-order solver of the probability-flow ODE in (x / sqrt(abar), sqrt(1/abar - 1)); on this
    problem 50 steps leave the std 4-8 % low (0.025 absolute at most; 1-2 % at 500 steps): allowance 0.04."""
    n = 16384
    model = ddpm_optimal_model(load_reference()["respace_ddim50"]["timesteps"])
    result = create_diffusion().sample(model, prior(n), labels(n), sampler="ddim", steps=50)
    assert result.nfe == 50
    assert_moments(result.samples, MU, STD, allowance=0.04)


# ----------------------------------------------------------------------------------------------------------------
# ODE samplers: pathwise against the exact flow, which maps each Gaussian marginal affinely onto the next
# ----------------------------------------------------------------------------------------------------------------

# Largest error |x - flow(x_T)| over 4096 prior samples (|x_T| up to ~4), with its justification:
ODE_ERROR_BOUNDS = {
    # first order, global error ~ C h; measured 0.080 (Linear), 0.033 (GVP, VP) at h = 1/50: 1.5x margin.
    ("euler", 50): 0.12,
    # second order, ~ C h^2; measured 6e-4 (Linear), 1.1e-3 (GVP), 4.5e-3 (VP): 1.5x margin.
    ("heun", 50): 7e-3,
    # SiT's default atol 1e-6 / rtol 1e-3 per step over ~5 steps, |x| up to ~4: measured <= 1.1e-2.
    ("dopri5", None): 2e-2,
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sampler, steps", list(ODE_ERROR_BOUNDS))
def test_ode_sampler_follows_the_exact_flow(path, sampler, steps):
    n = 4096
    transport = create_transport(path=path)
    x_T = prior(n)
    result = transport.sample(interpolant_optimal_model(path, "velocity"), x_T, labels(n), sampler=sampler, steps=steps)
    t0, t1 = transport.interval(transport.sample_eps)
    bound = ODE_ERROR_BOUNDS[(sampler, steps)]
    assert (result.samples - exact_flow(path, x_T, t0, t1)).abs().max() <= bound
    # Moments: the exact flow's image of N(0, I) is N(flow(0), slope^2) (the data, up to VP's epsilons);
    # a pathwise error <= bound moves the sample mean and std by <= bound.
    zero = torch.zeros(1, *SHAPE, dtype=torch.float64)
    flow_mean = exact_flow(path, zero, t0, t1)
    assert_moments(result.samples, flow_mean, exact_flow(path, zero + 1, t0, t1) - flow_mean, allowance=bound)


@pytest.mark.parametrize("path", PATHS)
def test_fixed_step_solvers_converge_at_their_order(path):
    """Halving the step divides Euler's error by ~2 and Heun's by ~4 (measured 1.87-1.93 and 3.3-4.4)."""
    n = 256
    transport = create_transport(path=path)
    model = interpolant_optimal_model(path, "velocity")
    x_T = prior(n)
    reference = exact_flow(path, x_T, *transport.interval(transport.sample_eps))
    error = {
        (sampler, steps): (transport.sample(model, x_T, labels(n), sampler=sampler, steps=steps).samples - reference)
        .abs()
        .max()
        .item()
        for sampler in ("euler", "heun")
        for steps in (50, 100)
    }
    assert 1.6 < error[("euler", 50)] / error[("euler", 100)] < 2.4
    assert error[("heun", 50)] / error[("heun", 100)] > 3.0


@pytest.mark.parametrize("path", PATHS)
def test_dopri5_with_tight_tolerances_is_exact(path):
    """atol = rtol = 1e-8 leaves a global error of ~1e-8 (measured <= 5e-8); 1e-6 bound."""
    n = 256
    transport = create_transport(path=path)
    x_T = prior(n)
    result = transport.sample(
        interpolant_optimal_model(path, "velocity"), x_T, labels(n), sampler="dopri5", atol=1e-8, rtol=1e-8
    )
    assert (result.samples - exact_flow(path, x_T, *transport.interval(transport.sample_eps))).abs().max() <= 1e-6


def sd3_shift(t: float, shift: float) -> float:
    """SD3's and FLUX's shift of the noise level sigma (sigma -> a·sigma / (1 + (a − 1)·sigma)), on SiT's axis,
    where the noise level is 1 − t."""
    sigma = 1 - t
    return 1 - shift * sigma / (1 + (shift - 1) * sigma)


@pytest.mark.parametrize("sampler", ["euler", "heun"])
@pytest.mark.parametrize("shift", [0.3, 1.0, 2.5])
def test_the_time_shift_puts_the_fixed_step_solvers_on_lightningdits_grid(sampler, shift):
    """LightningDiT's timestep_shift s is SD3's shift 1/s of the noise level 1 − t (algebra: 1 − s·t / (1 − (1 − s)
    t) = (1 − t) / (s + (1 − s)(1 − t))), so the grid is written here in SD3's form, not LightningDiT's. On the toy
    ODE dx/dt = x (a velocity model returning x) Euler's solution on any grid is x_0 Π (1 + h_k) and Heun's
    x_0 Π (1 + h_k + h_k² / 2): the samplers' results equal these products on the shifted grid (float64 rounding
    over 12 factors: 1e-12), and the model sees exactly the grid's times (the last one for Euler excepted)."""
    steps = 12
    grid = [sd3_shift(k / steps, 1 / shift) for k in range(steps + 1)]
    seen = []

    def model(x, t, y):
        seen.append(float(t[0]))
        return x

    x_T = torch.ones(2, 1, 1, 1, dtype=torch.float64)
    options = {} if shift == 1.0 else {"time_shift": shift}  # 1: the option left out is the same grid
    result = create_transport(path="linear").sample(model, x_T, labels(2), sampler=sampler, steps=steps, **options)
    widths = [b - a for a, b in zip(grid, grid[1:])]
    factor = math.prod(1 + h + (h * h / 2 if sampler == "heun" else 0) for h in widths)
    torch.testing.assert_close(result.samples, x_T * factor, rtol=1e-12, atol=0)
    expected_times = grid[:-1] if sampler == "euler" else [t for pair in zip(grid, grid[1:]) for t in pair]
    np.testing.assert_allclose(seen, expected_times, rtol=0, atol=1e-15)
    if shift == 0.3:  # LightningDiT's: small steps at the noise end (slope 0.3), large at the data end (1/0.3)
        assert widths[0] < 0.4 / steps and widths[-1] > 2 / steps


def test_lightningdits_shifted_euler_still_follows_the_exact_flow():
    """Euler on 250 points shifted by 0.3 (LightningDiT's sampling) lands within Euler-50's bound of the exact flow
    of the Gaussian's optimal velocity (measured 1.3e-3 on the Linear path)."""
    n, transport = 1024, create_transport(path="linear")
    x_T = prior(n)
    model = interpolant_optimal_model("linear", "velocity")
    result = transport.sample(model, x_T, labels(n), sampler="euler", steps=249, time_shift=0.3)
    assert (result.samples - exact_flow("linear", x_T, 0.0, 1.0)).abs().max() <= ODE_ERROR_BOUNDS[("euler", 50)]


@pytest.mark.parametrize(
    "path, prediction", [("linear", "noise"), ("gvp", "score"), ("vp", "noise"), ("linear", "score")]
)
@pytest.mark.parametrize("sampler, steps", [("heun", 50), ("dopri5", None)])
def test_ode_with_noise_and_score_models(path, prediction, sampler, steps):
    """Noise and score models integrate on [eps, 1 - eps] through the converted velocity; same bounds as above
    (measured <= 3.6e-3 for Heun-50, <= 8e-3 for dopri5)."""
    n = 1024
    transport = create_transport(path=path, prediction=prediction)
    x_T = prior(n)
    result = transport.sample(interpolant_optimal_model(path, prediction), x_T, labels(n), sampler=sampler, steps=steps)
    error = (result.samples - exact_flow(path, x_T, *transport.interval(transport.sample_eps))).abs().max()
    assert error <= ODE_ERROR_BOUNDS[(sampler, steps)]


# ----------------------------------------------------------------------------------------------------------------
# SDE samplers: moments against the exact marginal at t1 pushed through the (affine) last step
# ----------------------------------------------------------------------------------------------------------------

# Euler-Maruyama's weak error is O(h) with h = 0.96 / 249 ~ 0.004; on this problem the measured deviation of
# mean and std from the exact reference is <= 2 % of STD, i.e. <= 0.01 absolute (runs of 1000 steps agree): 0.01.
SDE_ALLOWANCE = 0.01


@pytest.mark.parametrize(
    "path, prediction, sampler, options",
    [
        ("linear", "velocity", "sde-euler", {}),
        ("gvp", "velocity", "sde-euler", {}),
        ("vp", "velocity", "sde-euler", {}),
        ("vp", "velocity", "sde-heun", {}),
        ("linear", "velocity", "sde-euler", {"last_step": None}),
        ("gvp", "noise", "sde-euler", {"diffusion_form": "SBDM"}),
        ("vp", "score", "sde-heun", {"diffusion_form": "linear", "diffusion_norm": 0.5}),
    ],
)
def test_sde_sampler_moments(path, prediction, sampler, options):
    n = 16384
    transport = create_transport(path=path, prediction=prediction)
    result = transport.sample(
        interpolant_optimal_model(path, prediction), prior(n), labels(n), sampler=sampler, **options
    )
    heun = sampler == "sde-heun"
    if options.get("last_step", "Mean") is None:
        # Straight to t = 1 where the diffusion sigma_t vanishes: the data distribution itself.
        assert result.nfe == (2 if heun else 1) * 250
        mean, std = MU, STD
    else:
        # 249 SDE steps to 0.96, then x + 0.04 (v + w score) without noise (SiT's default "Mean" last step).
        assert result.nfe == (2 * 249 + 1 if heun else 250)
        w = float(
            transport.path.sde_diffusion(
                torch.tensor(0.96, dtype=torch.float64),
                options.get("diffusion_form", "sigma"),
                options.get("diffusion_norm", 1.0),
            )
        )
        mean, std = mean_last_step(path, 0.96, 0.04, w)
    assert_moments(result.samples, mean, std, allowance=SDE_ALLOWANCE)


def test_sde_last_step_changes_the_result_as_specified():
    """The SiT-default "Mean" step on VP leaves the smallest std ~12 % low (noise sigma = 0.14 left at t = 0.96):
    the reference of test_sde_sampler_moments captures that, and it is far from the data's own std."""
    mean, std = mean_last_step(
        "vp",
        0.96,
        0.04,
        float(create_transport(path="vp").path.sde_diffusion(torch.tensor(0.96, dtype=torch.float64), "sigma", 1.0)),
    )
    assert (std / STD).min() < 0.9


# ----------------------------------------------------------------------------------------------------------------
# Likelihood by the probability-flow ODE
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_ode_likelihood_equals_the_gaussian_log_density(path):
    """For a diagonal Jacobian a Rademacher probe gives the exact trace, so Hutchinson is exact here; the dopri5
    defaults then leave ~2e-4 nats/dim (measured). Bound 1e-2 nats/dim as required."""
    n = 64
    transport = create_transport(path=path)
    x = MU + STD * prior(n, seed=1)
    result = transport.log_likelihood(interpolant_optimal_model(path, "velocity"), x, labels(n))
    expected = flow_log_density(path, x, *transport.interval(transport.sample_eps))
    dims = x[0].numel()
    assert ((result.log_prob - expected).abs() / dims).max() <= 1e-2
    if path != "vp":  # Linear/GVP velocity: exact prior at t = 0 and t1 = 1, so the model density is the data's
        assert ((result.log_prob - gaussian_log_density(x)).abs() / dims).max() <= 1e-2


def test_ode_likelihood_with_exact_divergence_on_a_rotated_gaussian():
    """Data R z with a non-diagonal Jacobian; the exact trace (one backward pass per dimension) must give
    log p_z(R^T x) to <= 1e-2 nats/dim (measured 2e-4)."""
    n, rot = 64, rotation()
    z = MU + STD * prior(n, seed=2)
    x = torch.einsum("ij,bj...->bi...", rot, z)
    result = create_transport(path="linear").log_likelihood(
        rotated_velocity_model("linear", rot), x, labels(n), divergence="exact"
    )
    assert ((result.log_prob - gaussian_log_density(z)).abs() / 4).max() <= 1e-2


def test_hutchinson_likelihood_is_unbiased():
    """One point, 2048 independent Rademacher probes on the rotated Gaussian: the per-probe estimates scatter by
    ~1 nat, their mean must match the exact log-density within 5 standard errors."""
    n, rot = 2048, rotation()
    z = MU + STD * prior(1, seed=3)
    x = torch.einsum("ij,bj...->bi...", rot, z).expand(n, *SHAPE)
    result = create_transport(path="linear").log_likelihood(
        rotated_velocity_model("linear", rot), x, labels(n), noise=PerSampleNoise(range(n))
    )
    estimates = result.log_prob
    assert estimates.std() > 0.1  # the probes really differ
    assert abs(estimates.mean() - gaussian_log_density(z)[0]) <= 5 * estimates.std() / n**0.5


# ----------------------------------------------------------------------------------------------------------------
# Reproducibility, NFE, progress and bad requests
# ----------------------------------------------------------------------------------------------------------------


def test_per_sample_noise_rows_follow_their_seeds():
    noise = PerSampleNoise([5, 9, 5])
    first, second = noise((2, 3)), noise((2, 3))
    for row, seed in zip(first, [5, 9, 5]):
        assert torch.equal(row, torch.randn(2, 3, generator=torch.Generator().manual_seed(seed)))
    assert torch.equal(first[0], first[2]) and not torch.equal(first[0], second[0])


def _sample(kind: str, sampler: str, seeds: list[int], **options) -> SampleResult:
    noise = PerSampleNoise(seeds)
    x_T = noise(SHAPE, dtype=torch.float64)
    if kind == "ddpm":
        model = ddpm_optimal_model(
            create_diffusion().respaced("20" if sampler == "ddpm" else "ddim10").timestep_map.tolist()
        )
        return create_diffusion().sample(
            model,
            x_T,
            labels(len(seeds)),
            sampler=sampler,
            steps=20 if sampler == "ddpm" else 10,
            noise=noise,
            **options,
        )
    return create_transport(path="linear").sample(
        interpolant_optimal_model("linear", "velocity"),
        x_T,
        labels(len(seeds)),
        sampler=sampler,
        steps=20,
        noise=noise,
        **options,
    )


@pytest.mark.parametrize(
    "kind, sampler, options",
    [
        ("ddpm", "ddpm", {}),
        ("ddpm", "ddim", {"eta": 1.0}),
        ("sit", "sde-euler", {}),
        ("sit", "sde-heun", {}),
        ("sit", "heun", {}),
    ],
)
def test_same_seeds_give_the_same_samples_in_any_batch_split(kind, sampler, options):
    seeds = [11, 3, 7, 42, 0, 5]
    whole = _sample(kind, sampler, seeds, **options).samples
    assert torch.equal(whole, _sample(kind, sampler, seeds, **options).samples)
    split = torch.cat(
        [_sample(kind, sampler, seeds[:2], **options).samples, _sample(kind, sampler, seeds[2:], **options).samples]
    )
    assert torch.equal(whole, split)
    assert not torch.equal(whole[0], whole[1])


@pytest.mark.parametrize(
    "kind, sampler, steps, expected",
    [
        ("ddpm", "ddpm", 7, 7),
        ("ddpm", "ddim", 5, 5),
        ("sit", "euler", 6, 6),
        ("sit", "heun", 6, 12),
        ("sit", "sde-euler", 6, 6),
        ("sit", "sde-heun", 6, 2 * 5 + 1),
        ("sit", "dopri5", None, None),
    ],
)
def test_nfe_counts_model_calls(kind, sampler, steps, expected):
    calls = []
    if kind == "ddpm":
        inner, objective = ddpm_optimal_model(list(range(1000))), create_diffusion()
    else:
        inner, objective = interpolant_optimal_model("linear", "velocity"), create_transport(path="linear")

    def model(x, t, y):
        calls.append(1)
        return inner(x, t, y)

    result = objective.sample(model, prior(4), labels(4), sampler=sampler, steps=steps)
    assert result.nfe == len(calls)
    if expected is not None:
        assert result.nfe == expected


def test_progress_bar_only_when_asked(capsys):
    transport = create_transport(path="linear")
    model = interpolant_optimal_model("linear", "velocity")
    transport.sample(model, prior(2), labels(2), sampler="euler", steps=3, progress=False)
    assert "ODE Euler" not in capsys.readouterr().err
    transport.sample(model, prior(2), labels(2), sampler="euler", steps=3, progress=True)
    assert "ODE Euler" in capsys.readouterr().err
    create_diffusion().sample(ddpm_optimal_model(list(range(1000))), prior(2), labels(2), steps=3, progress=True)
    assert "DDPM" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sampler": "ddpm"}, r"unknown sampler 'ddpm'; expected one of .*'dopri5'.*'sde-euler'"),
        ({"sampler": "dopri5", "steps": 50}, "chooses its own steps"),
        ({"sampler": "euler", "atol": 1e-3}, r"unknown option\(s\) \['atol'\]"),
        ({"sampler": "sde-euler", "diffusion_form": "cubic"}, "unknown diffusion_form"),
        ({"sampler": "sde-euler", "last_step": "Median"}, "unknown last_step"),
        ({"sampler": "sde-euler", "diffusion_form": "SBDM"}, "sample_eps > 0"),
        ({"sampler": "euler", "time_shift": 0.0}, "time_shift must be a finite number > 0"),
        ({"sampler": "dopri5", "time_shift": 0.3}, r"unknown option\(s\) \['time_shift'\]"),
    ],
)
def test_bad_transport_requests_fail_before_sampling(kwargs, message):
    model = lambda x, t, y: pytest.fail("the model must not run for a bad request")  # noqa: E731
    with pytest.raises(ValueError, match=message):
        create_transport(path="linear").sample(model, prior(2), labels(2), **kwargs)


def test_default_samplers():
    assert create_transport().default_sampler == "dopri5"
    assert {"euler", "heun", "dopri5", "sde-euler", "sde-heun"} <= set(create_transport().sampler_names)
