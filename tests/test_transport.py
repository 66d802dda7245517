"""SiT's transport objective: paths, conversions between predictions, epsilons and losses against closed forms
(SiT's published path formulas with autograd derivatives, and the optimal predictors for Gaussian data), and
LightningDiT's training options: logit-normal times against the closed-form law (scipy), the cosine loss."""

import math

import numpy as np
import pytest
import torch
from scipy.integrate import quad
from scipy.stats import kstest, norm

from _gaussian import MU, SHAPE, interpolant_optimal_model, path_coefficients
from sit_vca import Transport, create_transport
from sit_vca.transport import GVPPath, LinearPath, VPPath, velocity_direction_loss

PATHS = ["linear", "gvp", "vp"]
# Interior times; the end points are checked separately where a formula is finite there.
TIMES = torch.linspace(0.02, 0.98, 25, dtype=torch.float64)
# Everything below is float64 arithmetic on O(1)-O(100) quantities (VP's alpha' reaches ~10, its 1/sigma ~30 at
# t = 0.98): 1e-10 relative leaves ample room for rounding and still catches any wrong coefficient.
RTOL = 1e-10


@pytest.mark.parametrize("path", PATHS)
def test_path_coefficients_match_reference_formulas(path):
    transport = create_transport(path=path)
    t = TIMES.view(-1, 1)
    alpha, d_alpha, sigma, d_sigma = path_coefficients(path, TIMES)
    a, da = transport.path.alpha(t)
    s, ds = transport.path.sigma(t)
    for got, expected in [(a, alpha), (da, d_alpha), (s, sigma), (ds, d_sigma)]:
        torch.testing.assert_close(got.flatten(), expected, rtol=RTOL, atol=0)


def test_path_end_points():
    one, zero = torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    for path in (LinearPath(), GVPPath()):
        assert path.alpha(zero)[0].item() == 0 and path.sigma(zero)[0].item() == 1
        assert path.alpha(one)[0].item() == pytest.approx(1, abs=1e-15)
        assert path.sigma(one)[0].item() == pytest.approx(0, abs=1e-15)
    vp = VPPath()
    assert vp.alpha(one)[0].item() == 1 and vp.sigma(one)[0].item() == 0
    # VP's alpha at t = 0: exp(-(sigma_max - sigma_min)/4 - sigma_min/2) with sigma_min 0.1, sigma_max 20.
    assert vp.alpha(zero)[0].item() == pytest.approx(math.exp(-19.9 / 4 - 0.05), rel=1e-14)


@pytest.mark.parametrize("path", PATHS)
def test_interpolant_and_velocity_target(path):
    transport = create_transport(path=path)
    x0, x1 = torch.randn(25, *SHAPE, dtype=torch.float64), torch.randn(25, *SHAPE, dtype=torch.float64)
    alpha, d_alpha, sigma, d_sigma = (c.view(-1, 1, 1, 1) for c in path_coefficients(path, TIMES))
    x_t, u_t = transport.path.interpolate(x0, x1, TIMES.view(-1, 1, 1, 1))
    torch.testing.assert_close(x_t, alpha * x1 + sigma * x0, rtol=RTOL, atol=1e-14)
    torch.testing.assert_close(u_t, d_alpha * x1 + d_sigma * x0, rtol=RTOL, atol=1e-14)


@pytest.mark.parametrize("path", PATHS)
def test_conversions_are_exact_for_the_optimal_predictors(path):
    """For Gaussian data the optimal velocity, score and noise predictions are known in closed form, so each
    conversion must map one exactly onto the other."""
    transport = create_transport(path=path)
    x = torch.randn(25, *SHAPE, dtype=torch.float64) * 2 + MU
    t = TIMES.view(-1, 1, 1, 1)
    y = torch.zeros(25, dtype=torch.long)
    velocity, score, noise = (interpolant_optimal_model(path, p)(x, TIMES, y) for p in ("velocity", "score", "noise"))
    p = transport.path
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)  # noqa: E731
    close(p.velocity_from_score(score, x, t), velocity)
    close(p.score_from_velocity(velocity, x, t), score)
    close(p.score_from_noise(noise, t), score)
    close(p.noise_from_score(score, t), noise)
    # The transport's own dispatch (what the samplers use) for each prediction type.
    for prediction, output in [("velocity", velocity), ("score", score), ("noise", noise)]:
        chosen = create_transport(path=path, prediction=prediction)
        close(chosen.velocity(output, x, TIMES), velocity)
        close(chosen.score(output, x, TIMES), score)


@pytest.mark.parametrize("path", ["linear", "gvp"])
def test_score_from_velocity_is_finite_at_t0(path):
    """At t = 0 (alpha = 0) the marginal is N(0, I), whose score is -x."""
    transport = create_transport(path=path)
    x = torch.randn(4, *SHAPE, dtype=torch.float64)
    t = torch.zeros(4, dtype=torch.float64)
    velocity = interpolant_optimal_model(path, "velocity")(x, t, None)
    torch.testing.assert_close(transport.score(velocity, x, t), -x, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "path, prediction, train_eps, sample_eps",
    [
        ("linear", "velocity", 0, 0),
        ("gvp", "velocity", 0, 0),
        ("vp", "velocity", 1e-5, 1e-3),
        ("linear", "noise", 1e-3, 1e-3),
        ("gvp", "score", 1e-3, 1e-3),
        ("vp", "noise", 1e-5, 1e-3),
    ],
)
def test_default_epsilons_and_intervals(path, prediction, train_eps, sample_eps):
    transport = create_transport(path=path, prediction=prediction)
    assert (transport.train_eps, transport.sample_eps) == (train_eps, sample_eps)
    t0, t1 = transport.interval(transport.sample_eps)
    assert t1 == 1 - sample_eps
    assert t0 == (sample_eps if prediction != "velocity" and path != "vp" else 0)
    # An SDE with a last step stops that step short of 1.
    assert transport.interval(transport.sample_eps, sde_form="sigma", last_step_size=0.04)[1] == pytest.approx(0.96)


def test_explicit_epsilons_override_defaults():
    transport = create_transport(path="VP", train_eps=1e-4, sample_eps=2e-3)
    assert isinstance(transport, Transport) and isinstance(transport.path, VPPath)
    assert (transport.train_eps, transport.sample_eps) == (1e-4, 2e-3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"path": "cosine"}, "unknown path"),
        ({"prediction": "x0"}, "unknown prediction"),
        ({"prediction": "score", "loss_weight": "snr"}, "unknown loss_weight"),
        ({"loss_weight": "likelihood"}, "applies to score or noise"),
    ],
)
def test_bad_configuration_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        create_transport(**kwargs)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "prediction, loss_weight",
    [("velocity", None), ("noise", None), ("noise", "velocity"), ("score", "likelihood"), ("score", None)],
)
def test_training_loss_values(path, prediction, loss_weight):
    """The loss for a fixed model output, time and noise, against the formulas of SiT's objective written out with
    the reference path coefficients: velocity |v - u|^2; noise w |eps - x0|^2; score w |s sigma + x0|^2 with
    w = 1, (b / sigma)^2 (velocity weighting) or b / sigma^2 (likelihood), b = (alpha'/alpha) sigma^2 - sigma sigma'."""
    transport = create_transport(path=path, prediction=prediction, loss_weight=loss_weight)
    x1 = torch.randn(25, *SHAPE, dtype=torch.float64)
    noise = torch.randn_like(x1)
    output = torch.randn_like(x1)
    loss = transport.training_losses(
        lambda x_t, t, y: output, x1, torch.zeros(25, dtype=torch.long), t=TIMES, noise=noise
    )["loss"]
    alpha, d_alpha, sigma, d_sigma = (c.view(-1, 1, 1, 1) for c in path_coefficients(path, TIMES))
    b = d_alpha / alpha * sigma**2 - sigma * d_sigma
    weight = {None: 1.0, "velocity": (b / sigma) ** 2, "likelihood": b / sigma**2}[loss_weight]
    error = {
        "velocity": output - (d_alpha * x1 + d_sigma * noise),
        "noise": output - noise,
        "score": output * sigma + noise,
    }[prediction]
    torch.testing.assert_close(loss, (weight * error**2).mean(dim=(1, 2, 3)), rtol=RTOL, atol=0)


@pytest.mark.parametrize("path, prediction", [("linear", "velocity"), ("linear", "noise"), ("vp", "velocity")])
def test_training_times_cover_the_training_interval(path, prediction):
    transport = create_transport(path=path, prediction=prediction)
    seen = []

    def model(x_t, t, y):
        seen.append(t)
        return torch.zeros_like(x_t)

    torch.manual_seed(0)
    transport.training_losses(model, torch.randn(4096, 1), torch.zeros(4096, dtype=torch.long))
    t = torch.cat(seen)
    t0, t1 = transport.interval(transport.train_eps)
    assert t.min() >= t0 and t.max() <= t1
    # Uniform on [t0, t1]: with 4096 draws the extreme gaps are ~1/4096, far below 0.01.
    assert t.min() < t0 + 0.01 and t.max() > t1 - 0.01


def test_learn_sigma_outputs_drop_the_extra_channels():
    """A SiT backbone built with learn_sigma=True returns 2C channels; the first C are the prediction."""
    transport = create_transport(path="linear")
    x1 = torch.randn(3, *SHAPE, dtype=torch.float64)
    prediction = torch.randn_like(x1)
    with_sigma = lambda x_t, t, y: torch.cat([prediction, torch.full_like(prediction, 1e6)], dim=1)  # noqa: E731
    loss_a = transport.training_losses(with_sigma, x1, None, t=TIMES[:3], noise=torch.zeros_like(x1))["loss"]
    loss_b = transport.training_losses(lambda *a: prediction, x1, None, t=TIMES[:3], noise=torch.zeros_like(x1))["loss"]
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0)


# -- LightningDiT's training options: logit-normal times and the velocity-direction loss ---------------------------


def unit_times(transport: Transport, count: int) -> torch.Tensor:
    """`count` training times of `transport`, mapped from its training interval onto [0, 1], in float64."""
    t = transport.training_times(count, torch.device("cpu"), torch.float64)
    t0, t1 = transport.interval(transport.train_eps)
    return (t - t0) / (t1 - t0)


def logit_normal_cdf(u, location: float, scale: float):
    """P(U <= u) for U = sigmoid(location + scale·Z), Z ~ N(0, 1): Φ((logit u − location) / scale)."""
    return norm.cdf((np.log(u) - np.log1p(-u) - location) / scale)


def logit_normal_density(u: float, location: float, scale: float) -> float:
    """d/du of `logit_normal_cdf`: φ((logit u − m) / s) / (s · u · (1 − u))."""
    return norm.pdf((math.log(u / (1 - u)) - location) / scale) / (scale * u * (1 - u))


@pytest.mark.parametrize("path, location, scale", [("linear", 0.0, 1.0), ("linear", 0.8, 0.5), ("vp", -1.0, 1.6)])
def test_logit_normal_training_times_follow_the_closed_form_law(path, location, scale):
    transport = create_transport(
        path=path, time_distribution="logit-normal", logit_normal_location=location, logit_normal_scale=scale
    )
    torch.manual_seed(0)
    u = unit_times(transport, 20_000).numpy()
    assert 0 < u.min() and u.max() < 1
    # Kolmogorov-Smirnov against the closed-form CDF: with the seed fixed the p-value is a fixed number; a wrong
    # location, scale or direction (t = 1 is data) gives p ~ 0 at 20 000 draws.
    assert kstest(u, lambda v: logit_normal_cdf(v, location, scale)).pvalue > 0.01
    # The first two moments against the density integrated by quadrature, within 4 standard errors.
    mean = quad(lambda v: v * logit_normal_density(v, location, scale), 0, 1)[0]
    second = quad(lambda v: v * v * logit_normal_density(v, location, scale), 0, 1)[0]
    standard_error = math.sqrt((second - mean**2) / len(u))
    assert abs(u.mean() - mean) < 4 * standard_error
    assert abs((u**2).mean() - second) < 4 * math.sqrt(((u**4).mean() - second**2) / len(u))


def test_uniform_times_are_the_default_and_fail_the_logit_normal_law():
    transport = create_transport(path="linear")
    torch.manual_seed(0)
    u = unit_times(transport, 20_000).numpy()
    assert kstest(u, "uniform").pvalue > 0.01
    assert kstest(u, lambda v: logit_normal_cdf(v, 0.0, 1.0)).pvalue < 1e-6  # the KS test above can fail


def test_uniform_times_draw_the_same_numbers_as_before():
    # Runs resumed across this change keep their random stream: uniform times are still one torch.rand call.
    transport = create_transport(path="linear")
    torch.manual_seed(3)
    expected = torch.rand(7, dtype=torch.float64)
    torch.manual_seed(3)
    torch.testing.assert_close(
        transport.training_times(7, torch.device("cpu"), torch.float64), expected, rtol=0, atol=0
    )


def test_velocity_direction_loss_is_one_minus_the_cosine_over_channels_per_pixel():
    predicted, target = torch.randn(3, 4, 5, 6, dtype=torch.float64), torch.randn(3, 4, 5, 6, dtype=torch.float64)
    p, u = predicted.numpy(), target.numpy()
    cosine = (p * u).sum(1) / (np.linalg.norm(p, axis=1) * np.linalg.norm(u, axis=1))  # (3, 5, 6): one per pixel
    expected = torch.from_numpy((1 - cosine).mean(axis=(1, 2)))
    torch.testing.assert_close(velocity_direction_loss(predicted, target), expected, rtol=1e-12, atol=1e-12)
    # The direction only: any positive length gives the same loss; the opposite direction gives 2, the same 0.
    torch.testing.assert_close(velocity_direction_loss(2.5 * predicted, target), expected, rtol=1e-12, atol=1e-12)
    assert velocity_direction_loss(-target, target).tolist() == pytest.approx([2.0] * 3)
    assert velocity_direction_loss(3 * target, target).tolist() == pytest.approx([0.0] * 3, abs=1e-12)


def test_training_loss_adds_the_weighted_direction_loss_to_the_velocity_mse():
    transport = create_transport(path="linear", cosine_loss_weight=0.7)
    x1 = torch.randn(25, *SHAPE, dtype=torch.float64)
    noise, output = torch.randn_like(x1), torch.randn_like(x1)
    terms = transport.training_losses(lambda x_t, t, y: output, x1, None, t=TIMES, noise=noise)
    target = x1 - noise  # Linear path: u = x1 - x0
    mse = ((output - target) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(terms["mse"], mse, rtol=RTOL, atol=0)
    torch.testing.assert_close(terms["cosine"], velocity_direction_loss(output, target), rtol=RTOL, atol=0)
    torch.testing.assert_close(terms["loss"], mse + 0.7 * terms["cosine"], rtol=RTOL, atol=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"time_distribution": "beta"}, "unknown time_distribution"),
        ({"time_distribution": "logit-normal", "logit_normal_scale": 0.0}, "logit_normal_scale must be > 0"),
        ({"prediction": "noise", "cosine_loss_weight": 1.0}, "prediction='velocity'"),
    ],
)
def test_bad_training_options_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        create_transport(**kwargs)
