"""The mathematics of EDM2's power-function EMA (Karras et al., "Analyzing and Improving the Training Dynamics of
Diffusion Models", CVPR 2024, section 3 and appendix C): averaging profiles, their length, and the least-squares
reconstruction of one profile from others.

A power-function average at training time t (counted in training images) weighs the weights of time tau <= t by

    p(tau; t, gamma) = (gamma + 1) tau^gamma / t^(gamma + 1)

whose relative standard deviation (its width over t) is sigma_rel = sqrt((gamma + 1) / ((gamma + 2)^2 (gamma + 3))).
Tracked step by step it is an EMA with the decay beta = (1 - batch / t)^(gamma + 1) after each step of `batch`
images (t: the images after the step); beta = 0 at the first step, so the initial weights carry no weight. After
T steps the weights of step i carry ((i b)^(gamma + 1) - ((i - 1) b)^(gamma + 1)) / (T b)^(gamma + 1): exactly
the profile integrated over that step's images, so the continuous mathematics below holds for the step-by-step
average. Every function here is float64 NumPy: the Gram matrices of the reconstruction are badly conditioned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SIGMA_REL_MAX = math.sqrt(1 / 12)  # sigma_rel at gamma = 0 (a uniform average over all of training): 0.288675...


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """The exponent gamma whose profile has relative width `sigma_rel` (0 < sigma_rel < SIGMA_REL_MAX): the largest
    real root of gamma^3 + 7 gamma^2 + (16 - s^-2) gamma + (12 - s^-2) = 0, which is
    (gamma + 2)^2 (gamma + 3) = (gamma + 1) / s^2 written out."""
    if not 0 < sigma_rel < SIGMA_REL_MAX:
        raise ValueError(f"sigma_rel {sigma_rel} is outside (0, {SIGMA_REL_MAX:.6f})")
    inverse_square = sigma_rel**-2
    roots = np.roots([1.0, 7.0, 16.0 - inverse_square, 12.0 - inverse_square])
    return float(roots[np.abs(roots.imag) < 1e-9].real.max())


def gamma_to_sigma_rel(gamma: float) -> float:
    """The relative width of the profile with exponent `gamma` (> 0 for the profiles this module tracks)."""
    return math.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))


def step_decay(images: int, batch: int, gamma: float) -> float:
    """beta of the step that brought training to `images` images with a batch of `batch` (0 at the first step)."""
    return (1.0 - batch / images) ** (gamma + 1)


def profile_inner_products(t_a: np.ndarray, gamma_a: np.ndarray, t_b: np.ndarray, gamma_b: np.ndarray) -> np.ndarray:
    """<p(.; t_a, gamma_a), p(.; t_b, gamma_b)> = integral over tau of the product of two profiles, in closed form,
    for every pair: (len(a), len(b)) float64.

    With m = min(t_a, t_b) the integral is (ga + 1)(gb + 1) m^(ga + gb + 1) / ((ga + gb + 1) t_a^(ga + 1) t_b^(gb + 1)),
    evaluated as (ga + 1)(gb + 1) / (ga + gb + 1) * (m / t_a)^(ga + 1) * (m / t_b)^(gb + 1) / m so that no power of
    a time in images (1e9 ** 18 at ImageNet scale) overflows.
    """
    t_a, gamma_a = np.asarray(t_a, np.float64)[:, None], np.asarray(gamma_a, np.float64)[:, None]  # (A, 1)
    t_b, gamma_b = np.asarray(t_b, np.float64)[None, :], np.asarray(gamma_b, np.float64)[None, :]  # (1, B)
    m = np.minimum(t_a, t_b)  # (A, B)
    return (
        (gamma_a + 1)
        * (gamma_b + 1)
        / (gamma_a + gamma_b + 1)
        * (m / t_a) ** (gamma_a + 1)
        * (m / t_b) ** (gamma_b + 1)
    ) / m


@dataclass(frozen=True)
class Reconstruction:
    """The coefficients of stored profiles whose weighted sum is closest (in L2 over time) to a target profile."""

    coefficients: np.ndarray  # (S,) float64, one per stored profile
    condition: float  # condition number of the Gram matrix (2-norm): how much rounding the solve amplifies
    relative_error: float  # ||target - sum c_i p_i|| / ||target||: how well the stored profiles span the target


def reconstruct_profile(
    times: np.ndarray, gammas: np.ndarray, target_time: float, target_gamma: float
) -> Reconstruction:
    """Solve min_c ||p(.; target) - sum_i c_i p(.; times[i], gammas[i])||^2 (the normal equations G c = b, G the
    stored profiles' Gram matrix, b their inner products with the target), in float64 by least squares, which
    copes with a nearly singular G (snapshots close together)."""
    gram = profile_inner_products(times, gammas, times, gammas)  # (S, S)
    target = profile_inner_products(times, gammas, [target_time], [target_gamma])[:, 0]  # (S,)
    coefficients = np.linalg.lstsq(gram, target, rcond=None)[0]
    target_norm = profile_inner_products([target_time], [target_gamma], [target_time], [target_gamma])[0, 0]
    residual = target_norm - 2 * coefficients @ target + coefficients @ gram @ coefficients
    return Reconstruction(
        coefficients=coefficients,
        condition=float(np.linalg.cond(gram)),
        relative_error=math.sqrt(max(residual, 0.0) / target_norm),
    )
