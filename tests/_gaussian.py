"""Closed-form optimal predictors for Gaussian data x_1 ~ N(MU, diag(STD^2)), written independently of the code
under test (alphas from the reference betas in tests/data/ or from SiT's published path formulas, derivatives by
autograd).

Every marginal is Gaussian: x_t ~ N(alpha_t MU, V_t) with V_t = alpha_t^2 STD^2 + sigma_t^2 per dimension, so
E[noise | x_t] = sigma_t (x - alpha_t MU) / V_t, score = -(x - alpha_t MU) / V_t and
velocity = alpha'_t MU + (alpha_t alpha'_t STD^2 + sigma_t sigma'_t) (x - alpha_t MU) / V_t.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

# The official DiT diffusion's training betas and respaced timesteps/betas (float64), see tests/data/README.md.
REFERENCE = Path(__file__).resolve().parent / "data" / "ddpm_reference.json"

# Data shaped like a 4-channel 1x1 latent; stds below 1 so that the optimal DDPM reverse variance lies inside
# the learned range [beta~_t, beta_t].
MU = torch.tensor([1.0, -0.5, 0.3, 2.0], dtype=torch.float64).view(1, 4, 1, 1)
STD = torch.tensor([0.5, 0.8, 0.3, 0.6], dtype=torch.float64).view(1, 4, 1, 1)
SHAPE = (4, 1, 1)


@pytest.fixture(autouse=True)
def single_thread():
    """Sampling the analytic model is a long chain of small element-wise ops: one intra-op thread avoids the
    threads' synchronisation overhead (8x faster on a busy 2-core box). Import this into a test module to use it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def load_reference() -> dict:
    return json.loads(REFERENCE.read_text())


# ---------------------------------------------------------------------------------------------------------------
# DDPM (DiT): x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps, t = original index 0..999
# ---------------------------------------------------------------------------------------------------------------


def reference_alphas_cumprod() -> torch.Tensor:
    betas = np.array(load_reference()["betas_linear_1000"], dtype=np.float64)
    return torch.from_numpy(np.cumprod(1.0 - betas))  # (1000,)


def ddpm_optimal_model(kept_timesteps: list[int]):
    """An epsilon + learned-range-variance "model" whose reverse step is the exact Gaussian conditional
    p(x_prev | x_t) of the process respaced to kept_timesteps (original indices, ascending)."""
    abar = reference_alphas_cumprod()
    abar_prev = torch.ones_like(abar)  # abar at the previous kept step; 1 before the first
    for prev, t in zip(kept_timesteps[:-1], kept_timesteps[1:]):
        abar_prev[t] = abar[prev]

    def model(x, t, y):
        a = abar.index_select(0, t).view(-1, 1, 1, 1)  # (B, 1, 1, 1)
        a_prev = abar_prev.index_select(0, t).view(-1, 1, 1, 1)
        var_t = a * STD**2 + 1 - a
        eps = (1 - a).sqrt() * (x - a.sqrt() * MU) / var_t  # E[eps | x_t]
        if bool((a_prev == 1).all()):  # first kept step: no noise is added, the variance is unused
            return torch.cat([eps, torch.zeros_like(eps)], dim=1).to(x.dtype)
        ratio = a / a_prev  # 1 - beta of the respaced step
        var_prev = a_prev * STD**2 + 1 - a_prev
        true_var = var_prev * (1 - ratio) / (ratio * var_prev + 1 - ratio)  # Var(x_prev | x_t)
        beta = 1 - ratio
        beta_tilde = beta * (1 - a_prev) / (1 - a)
        frac = (true_var.log() - beta_tilde.log()) / (beta.log() - beta_tilde.log())
        return torch.cat([eps, (2 * frac - 1).expand_as(eps)], dim=1).to(x.dtype)  # (B, 8, 1, 1)

    return model


# ---------------------------------------------------------------------------------------------------------------
# Interpolants (SiT): x_t = alpha_t x_1 + sigma_t x_0, t = 0 noise, t = 1 data
# ---------------------------------------------------------------------------------------------------------------


def _vp_alpha(t):
    log_mean = -0.25 * (1 - t) ** 2 * (20.0 - 0.1) - 0.5 * (1 - t) * 0.1
    return torch.exp(log_mean)


PATH_ALPHA_SIGMA = {
    "linear": (lambda t: t, lambda t: 1 - t),
    "gvp": (lambda t: torch.sin(math.pi * t / 2), lambda t: torch.cos(math.pi * t / 2)),
    "vp": (_vp_alpha, lambda t: torch.sqrt(1 - _vp_alpha(t) ** 2)),
}


def path_coefficients(path: str, t: torch.Tensor):
    """alpha, alpha', sigma, sigma' at times t (any shape), derivatives by autograd."""
    alpha_fn, sigma_fn = PATH_ALPHA_SIGMA[path]
    t = t.detach().to(torch.float64).requires_grad_(True)
    with torch.enable_grad():
        alpha, sigma = alpha_fn(t), sigma_fn(t)
        (d_alpha,) = torch.autograd.grad(alpha.sum(), t)
        (d_sigma,) = torch.autograd.grad(sigma.sum(), t)
    return alpha.detach(), d_alpha, sigma.detach(), d_sigma


def marginal(path: str, t: float):
    """Mean and std (1, 4, 1, 1) of x_t."""
    alpha, _, sigma, _ = path_coefficients(path, torch.tensor(t))
    return alpha * MU, (alpha**2 * STD**2 + sigma**2).sqrt()


def interpolant_optimal_model(path: str, prediction: str):
    """The optimal velocity, score or noise prediction as a model function (x, t, y) -> (B, 4, 1, 1)."""

    def model(x, t, y):
        times, index = torch.unique(t, return_inverse=True)  # samplers evaluate one time per batch
        coefficients = path_coefficients(path, times)
        alpha, d_alpha, sigma, d_sigma = (c.index_select(0, index).view(-1, 1, 1, 1) for c in coefficients)
        var = alpha**2 * STD**2 + sigma**2
        centred = x - alpha * MU
        out = {
            "velocity": d_alpha * MU + (alpha * d_alpha * STD**2 + sigma * d_sigma) * centred / var,
            "score": -centred / var,
            "noise": sigma * centred / var,
        }[prediction]
        return out.to(x.dtype)

    return model


def exact_flow(path: str, x: torch.Tensor, t0: float, t1: float) -> torch.Tensor:
    """Where the probability-flow ODE takes x from t0 to t1: it maps each marginal affinely onto the next."""
    mean0, std0 = marginal(path, t0)
    mean1, std1 = marginal(path, t1)
    return mean1 + std1 / std0 * (x - mean0)


def gaussian_log_density(x: torch.Tensor, mean: torch.Tensor = MU, std: torch.Tensor = STD) -> torch.Tensor:
    """log N(x; mean, diag(std^2)) summed over dimensions, (B,); the data density by default."""
    z = (x - mean) / std
    return (-0.5 * z**2 - std.log() - 0.5 * math.log(2 * math.pi)).flatten(1).sum(dim=1)


def flow_log_density(path: str, x: torch.Tensor, t0: float, t1: float) -> torch.Tensor:
    """log-density at t1 of the exact probability-flow ODE started from N(0, I) at t0: the affine image
    N(flow(0), (std_t1 / std_t0)^2). It equals the data density when the prior is exact (Linear/GVP velocity) and
    differs from it by VP's prior mismatch (alpha_0 = 0.0066, not 0) and sample_eps otherwise."""
    zero = torch.zeros(1, *SHAPE, dtype=torch.float64)
    slope = exact_flow(path, zero + 1, t0, t1) - exact_flow(path, zero, t0, t1)
    return gaussian_log_density(x, exact_flow(path, zero, t0, t1), slope)


def mean_last_step(path: str, t1: float, size: float, diffusion: float):
    """Mean and std of x + size * (v + w score) for x drawn from the exact marginal at t1: the map is affine in x,
    so the image of N(m, s^2) is N(f(m), (f(m + s) - f(m))^2). This is what an SDE sampler with SiT's "Mean" last
    step produces when its SDE part is exact."""
    mean, std = marginal(path, t1)
    t = torch.full((1,), t1, dtype=torch.float64)
    velocity, score = interpolant_optimal_model(path, "velocity"), interpolant_optimal_model(path, "score")
    step = lambda x: x + size * (velocity(x, t, None) + diffusion * score(x, t, None))  # noqa: E731
    return step(mean), (step(mean + std) - step(mean)).abs()


def rotation(dims: int = 4, seed: int = 0) -> torch.Tensor:
    """A fixed random orthogonal matrix (dims, dims)."""
    q, _ = torch.linalg.qr(torch.randn(dims, dims, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q


def rotated_velocity_model(path: str, rot: torch.Tensor):
    """The optimal velocity for data R z, z ~ N(MU, diag(STD^2)): v_R(x, t) = R v(R^T x, t), because
    x_t = R (alpha z + sigma R^T x_0) and R^T x_0 is again standard normal. Its Jacobian is not diagonal."""
    velocity = interpolant_optimal_model(path, "velocity")

    def model(x, t, y):
        z = torch.einsum("ij,bj...->bi...", rot.T, x)
        return torch.einsum("ij,bj...->bi...", rot, velocity(z, t, y))

    return model


def assert_moments(samples: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, allowance: float, z: float = 5.0):
    """Per-dimension sample mean and std within z standard errors of (mean, std) plus an absolute allowance for
    discretisation. Standard errors of N Gaussian samples: std / sqrt(N) for the mean, std / sqrt(2N) for the std;
    z = 5 makes a false alarm from sampling noise a < 1e-6 event per comparison."""
    n = samples.shape[0]
    got_mean, got_std = samples.mean(dim=0, keepdim=True), samples.std(dim=0, keepdim=True)
    mean_tol = z * std / n**0.5 + allowance
    std_tol = z * std / (2 * n) ** 0.5 + allowance
    assert ((got_mean - mean).abs() <= mean_tol).all(), f"mean {got_mean.flatten()} vs {mean.flatten()} ± {mean_tol}"
    assert ((got_std - std).abs() <= std_tol).all(), f"std {got_std.flatten()} vs {std.flatten()} ± {std_tol}"
