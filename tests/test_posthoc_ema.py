"""Post-hoc EMA (EDM2): the profile mathematics against independent references, the tracker's discrete weights
against their closed form, the least-squares reconstruction, and (below) training runs that store profiles."""

import math

import numpy as np
import pytest
import torch
from scipy import integrate
from torch import nn

from training.config import PosthocEMAConfig
from training.posthoc_ema import PowerEMA
from training.power_profiles import (
    SIGMA_REL_MAX,
    gamma_to_sigma_rel,
    profile_inner_products,
    reconstruct_profile,
    sigma_rel_to_gamma,
)

# --------------------------------------------------------------------------------------------------
#                                           Mathematics
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sigma_rel, gamma", [(0.05, 16.97), (0.10, 6.94)])
def test_sigma_rel_to_gamma_matches_the_values_edm2_lists(sigma_rel, gamma):
    # EDM2 (section 3) gives gamma to two decimals: half a unit of the last place.
    assert sigma_rel_to_gamma(sigma_rel) == pytest.approx(gamma, abs=0.005)


@pytest.mark.parametrize("sigma_rel", [0.001, 0.01, 0.05, 0.1, 0.2, 0.28])
def test_gamma_to_sigma_rel_inverts_sigma_rel_to_gamma(sigma_rel):
    gamma = sigma_rel_to_gamma(sigma_rel)
    assert gamma > 0
    assert gamma_to_sigma_rel(gamma) == pytest.approx(sigma_rel, rel=1e-12)  # float64 root finding


def test_sigma_rel_is_the_relative_width_of_the_profile():
    # Independent of the closed form: the standard deviation of tau under p(tau) = (g + 1) tau^g on [0, 1].
    for sigma_rel in (0.05, 0.1, 0.2):
        gamma = sigma_rel_to_gamma(sigma_rel)
        density = lambda tau, g=gamma: (g + 1) * tau**g  # noqa: E731
        mean = integrate.quad(lambda tau, d=density: tau * d(tau), 0, 1)[0]
        variance = integrate.quad(lambda tau, d=density, m=mean: (tau - m) ** 2 * d(tau), 0, 1)[0]
        assert math.sqrt(variance) == pytest.approx(sigma_rel, rel=1e-9)


@pytest.mark.parametrize("sigma_rel", [0.0, -0.1, SIGMA_REL_MAX, 0.3])
def test_sigma_rel_outside_its_range_is_refused(sigma_rel):
    with pytest.raises(ValueError, match="outside"):
        sigma_rel_to_gamma(sigma_rel)


def test_inner_products_of_profiles_equal_numerical_integrals():
    times, gammas = np.array([3.0e3, 7.5e3, 1.0e4]), np.array([16.97, 6.94, 2.5])
    closed = profile_inner_products(times, gammas, times, gammas)  # (3, 3)

    def profile(tau, t, g):
        return (g + 1) * tau**g / t ** (g + 1) if tau <= t else 0.0

    for a in range(3):
        for b in range(3):
            upper = min(times[a], times[b])
            numeric = integrate.quad(
                lambda tau, a=a, b=b: profile(tau, times[a], gammas[a]) * profile(tau, times[b], gammas[b]),
                0,
                upper,
                epsabs=0,
                epsrel=1e-12,
            )[0]
            assert closed[a, b] == pytest.approx(numeric, rel=1e-9)  # quad's own accuracy


def test_inner_products_do_not_overflow_at_imagenet_scale():
    # 1.3e9 images to the power 18 overflows float64 when squared; the ratio form does not.
    value = profile_inner_products([1.0e9], [16.97], [1.3e9], [16.97])
    assert np.isfinite(value).all() and value[0, 0] > 0


def test_a_stored_profile_reconstructs_as_itself():
    steps = np.arange(1, 17) * 100.0
    times, gammas = np.concatenate([steps, steps]), np.array([16.97] * 16 + [6.94] * 16)
    for k in (15, 31, 20):
        solution = reconstruct_profile(times, gammas, times[k], gammas[k])
        expected = np.zeros(32)
        expected[k] = 1.0
        # The Gram matrix's condition (about 1e7 here) times float64 rounding bounds the error of the solve.
        assert np.abs(solution.coefficients - expected).max() < 1e-6
        assert solution.relative_error < 1e-5


# --------------------------------------------------------------------------------------------------
#                                    The tracker's discrete weights
# --------------------------------------------------------------------------------------------------


class OneHotWeights(nn.Module):
    """A model whose weight vector at step i is the i-th unit vector: an average of it is its weights per step."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(steps))


def tracked_weights(sigma_rels, steps: int, batch: int) -> list[np.ndarray]:
    model = OneHotWeights(steps)
    tracker = PowerEMA(model, PosthocEMAConfig(sigma_rel=list(sigma_rels), snapshot_every=steps), batch)
    for i in range(steps):
        with torch.no_grad():
            model.weight.zero_()
            model.weight[i] = 1.0
        tracker.update(model)
    return [average[0].double().numpy() for average in tracker.averages]


@pytest.mark.parametrize("batch", [1, 64])
def test_the_tracked_average_weighs_step_i_as_the_closed_form_says(batch):
    steps = 200
    for sigma_rel, weights in zip((0.05, 0.1), tracked_weights((0.05, 0.1), steps, batch)):
        power = sigma_rel_to_gamma(sigma_rel) + 1
        i = np.arange(1, steps + 1, dtype=np.float64)
        expected = (i**power - (i - 1) ** power) / steps**power  # the same for any batch: (i*b)^p / (T*b)^p
        # float32 averages over 200 updates: each step rounds at 6e-8 relative; weights are <= 0.09.
        np.testing.assert_allclose(weights, expected, rtol=0, atol=2e-6)
        assert weights.sum() == pytest.approx(1.0, abs=1e-5)


def test_the_first_update_copies_the_weights():
    model = nn.Linear(3, 2)
    tracker = PowerEMA(model, PosthocEMAConfig(sigma_rel=[0.05], snapshot_every=1), batch=8)
    with torch.no_grad():
        model.weight.add_(1.0)
    tracker.update(model)
    assert torch.equal(tracker.averages[0][0], model.weight.detach())  # beta = 0 at the first step


@pytest.mark.parametrize("every, bound", [(16, 0.02), (8, 0.005)])
def test_profiles_reconstructed_from_two_others_match_the_discrete_weights(every, bound):
    # The whole chain on the weights of each step: snapshots of the profiles 0.05 and 0.10 every `every` of 256
    # steps (16 or 32 per profile), combined by the least-squares coefficients, against the profile 0.07 tracked
    # directly. Measured: the error is 1.4 % (16 snapshots) and 0.34 % (32) of the distance to the nearest stored
    # profile, 0.37 % and 0.094 % of the target's norm; the bounds leave a factor 1.5 for platforms.
    steps, batch = 256, 64
    stored = tracked_snapshots((0.05, 0.1), steps, every, batch)
    target = tracked_weights((0.07,), steps, batch)[0]
    times = np.array([step * batch for step, _, _ in stored], np.float64)
    gammas = np.array([sigma_rel_to_gamma(sigma_rel) for _, sigma_rel, _ in stored])
    solution = reconstruct_profile(times, gammas, steps * batch, sigma_rel_to_gamma(0.07))
    rebuilt = sum(c * weights for c, (_, _, weights) in zip(solution.coefficients, stored))
    nearest = min(np.linalg.norm(weights - target) for step, _, weights in stored if step == steps)
    error = np.linalg.norm(rebuilt - target)
    assert error < bound * nearest, (error, nearest)
    # The step-by-step weights are the continuous profile integrated over each step, so the continuous fit's
    # error predicts the discrete one (to 10 %: the integration over steps smooths a little).
    assert error / np.linalg.norm(target) == pytest.approx(solution.relative_error, rel=0.1)


def tracked_snapshots(sigma_rels, steps: int, every: int, batch: int) -> list[tuple[int, float, np.ndarray]]:
    model = OneHotWeights(steps)
    tracker = PowerEMA(model, PosthocEMAConfig(sigma_rel=list(sigma_rels), snapshot_every=every), batch)
    stored = []
    for i in range(steps):
        with torch.no_grad():
            model.weight.zero_()
            model.weight[i] = 1.0
        tracker.update(model)
        if (i + 1) % every == 0:
            stored += [(i + 1, s, avg[0].double().numpy().copy()) for s, avg in zip(sigma_rels, tracker.averages)]
    return stored
