"""DiT's DDPM objective against the reference implementation's numbers, diffusers and closed-form Gaussians."""

import math

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler
from scipy import integrate, stats

from _gaussian import load_reference
from dit_vca import GaussianDiffusion, create_diffusion
from dit_vca.diffusion import discretized_gaussian_log_likelihood, space_timesteps

# The reference numbers are float64 results of the same arithmetic; 1e-12 leaves room only for a different
# order of float64 operations (values are O(1)-O(10), float64 eps 2.2e-16).
EXACT = 1e-12
RESPACINGS = ["250", "100", "50", "ddim50", "ddim25"]


@pytest.fixture(scope="module")
def reference():
    return load_reference()


@pytest.fixture(scope="module")
def diffusion():
    return create_diffusion()


def reference_schedule(reference) -> tuple[np.ndarray, np.ndarray]:
    """Training betas and alphas_cumprod straight from the reference file."""
    betas = np.array(reference["betas_linear_1000"], dtype=np.float64)
    return betas, np.cumprod(1.0 - betas)


# ----------------------------------------------------------------------------------------------------------------
# Schedules and respacing
# ----------------------------------------------------------------------------------------------------------------


def test_training_schedule_matches_reference(diffusion, reference):
    assert diffusion.num_timesteps == reference["train_T"] == 1000
    np.testing.assert_allclose(diffusion.betas.numpy(), reference["betas_linear_1000"], rtol=0, atol=EXACT)
    for t, value in reference["alphas_cumprod_1000_at"].items():
        assert abs(diffusion.alphas_cumprod[int(t)].item() - value) <= EXACT, t
    for t, value in reference["posterior_log_variance_clipped_at"].items():
        assert abs(diffusion.posterior_log_variance_clipped[int(t)].item() - value) <= EXACT, t


@pytest.mark.parametrize("spec", RESPACINGS)
def test_respacing_matches_reference(diffusion, reference, spec):
    expected = reference[f"respace_{spec}"]
    process = create_diffusion(spec)
    assert process.timestep_map.tolist() == expected["timesteps"]
    np.testing.assert_allclose(process.betas.numpy(), expected["betas"], rtol=0, atol=EXACT)
    # Respacing keeps the marginals q(x_t | x_0) of the retained steps (relative float64 rounding only).
    np.testing.assert_allclose(
        process.alphas_cumprod.numpy(), diffusion.alphas_cumprod.numpy()[expected["timesteps"]], rtol=1e-13
    )


def test_alphas_cumprod_match_diffusers(diffusion):
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02, beta_schedule="linear")
    # diffusers builds the schedule in float32: storage rounding (6e-8) plus a random walk of rounding errors over
    # up to 1000 products (~sqrt(1000) * 6e-8 = 2e-6); rtol 1e-5 keeps a 5x margin and still catches any schedule
    # difference (the next beta differs from its neighbour by ~2e-5 relative to alphas_cumprod).
    np.testing.assert_allclose(diffusion.alphas_cumprod.numpy(), scheduler.alphas_cumprod.double().numpy(), rtol=1e-5)


@pytest.mark.parametrize("spec", ["ddim999", "2000", "abc", "0", "ddim"])
def test_bad_respacing_is_rejected(spec):
    with pytest.raises(ValueError, match="respacing"):
        space_timesteps(1000, spec)


def test_model_is_called_with_original_timesteps(reference):
    seen = []

    def model(x, t, y):
        seen.append(t[0].item())
        return torch.zeros(x.shape[0], 2 * x.shape[1], *x.shape[2:])

    y = torch.zeros(2, dtype=torch.long)
    create_diffusion().sample(model, torch.randn(2, 4, 2, 2), y, sampler="ddpm", steps=50)
    assert seen == reference["respace_50"]["timesteps"][::-1]

    seen.clear()
    process = create_diffusion("ddim25")
    process.training_losses(model, torch.randn(2, 4, 2, 2), y, t=torch.tensor([3, 3]))
    assert seen == [reference["respace_ddim25"]["timesteps"][3]]


# ----------------------------------------------------------------------------------------------------------------
# Learned-range variance and the variational bound
# ----------------------------------------------------------------------------------------------------------------


def test_learned_range_extremes_are_beta_tilde_and_beta(diffusion, reference):
    betas, alphas_cumprod = reference_schedule(reference)
    t = torch.tensor([1, 10, 500, 999])
    x = torch.randn(4, 4, 2, 2, dtype=torch.float64)
    eps = torch.randn_like(x)
    beta = betas[t.numpy()]
    beta_tilde = beta * (1 - alphas_cumprod[t.numpy() - 1]) / (1 - alphas_cumprod[t.numpy()])
    for v, expected in [(-1.0, beta_tilde), (1.0, beta)]:
        output = torch.cat([eps, torch.full_like(x, v)], dim=1)
        variance = diffusion.p_mean_variance(output, x, t).log_variance.exp()  # (4, 4, 2, 2)
        np.testing.assert_allclose(variance[:, 0, 0, 0].numpy(), expected, rtol=EXACT)
    # At step 0 the posterior variance is 0; its log is clipped to step 1's (reference value).
    output = torch.cat([eps, -torch.ones_like(x)], dim=1)
    log_variance = diffusion.p_mean_variance(output, x, torch.zeros(4, dtype=torch.long)).log_variance
    assert abs(log_variance[0, 0, 0, 0].item() - reference["posterior_log_variance_clipped_at"]["0"]) <= EXACT
    # Without learn_sigma the variance is fixed to beta_t ("fixed large").
    fixed = create_diffusion(learn_sigma=False).p_mean_variance(eps, x, t).log_variance.exp()
    np.testing.assert_allclose(fixed[:, 0, 0, 0].numpy(), beta, rtol=EXACT)


def _reverse_gaussians(reference, x_start, x_t, eps, v, t):
    """Closed-form q(x_{t-1} | x_t, x_0) and the model's p(x_{t-1} | x_t) from the reference betas (numpy)."""
    betas, abar = reference_schedule(reference)
    abar_prev = 1.0 if t == 0 else abar[t - 1]
    coef_x0 = betas[t] * math.sqrt(abar_prev) / (1 - abar[t])
    coef_xt = (1 - abar_prev) * math.sqrt(1 - betas[t]) / (1 - abar[t])
    beta_tilde = betas[t] * (1 - abar_prev) / (1 - abar[t])
    pred_x0 = (x_t - math.sqrt(1 - abar[t]) * eps) / math.sqrt(abar[t])
    frac = (v + 1) / 2
    log_beta_tilde_clipped = math.log(beta_tilde if t > 0 else betas[1] * (1 - abar[0]) / (1 - abar[1]))
    model_var = np.exp(frac * math.log(betas[t]) + (1 - frac) * log_beta_tilde_clipped)
    return coef_x0 * x_start + coef_xt * x_t, beta_tilde, coef_x0 * pred_x0 + coef_xt * x_t, model_var


def gaussian_kl(mean1, var1, mean2, var2):
    """KL(N(mean1, var1) || N(mean2, var2)) in nats, element-wise (numpy)."""
    return 0.5 * np.log(var2 / var1) + (var1 + (mean1 - mean2) ** 2) / (2 * var2) - 0.5


def test_vb_term_is_the_gaussian_kl_in_bits(diffusion, reference):
    rng = np.random.default_rng(0)
    x_start = rng.uniform(-1, 1, size=(3, 2, 2, 1))
    noise = rng.normal(size=x_start.shape)
    eps = noise + 0.3 * rng.normal(size=x_start.shape)  # an imperfect prediction
    v = rng.uniform(-1, 1, size=x_start.shape)
    t = np.array([1, 300, 999])
    x_t = np.stack(
        [
            math.sqrt(a) * x0 + math.sqrt(1 - a) * n
            for a, x0, n in zip(reference_schedule(reference)[1][t], x_start, noise)
        ]
    )
    as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    step = diffusion.p_mean_variance(torch.cat([as_t(eps), as_t(v)], dim=1), as_t(x_t), as_t(t))
    vb = diffusion.vb_terms_bits(as_t(x_start), as_t(x_t), as_t(t), step).numpy()  # (3,)
    for i in range(3):
        true_mean, true_var, model_mean, model_var = _reverse_gaussians(
            reference, x_start[i], x_t[i], eps[i], v[i], t[i]
        )
        kl = gaussian_kl(true_mean, true_var, model_mean, model_var)
        # float64 arithmetic on O(1) quantities; 1e-10 relative allows reordering only.
        assert vb[i] == pytest.approx(kl.mean() / math.log(2), rel=1e-10)
    # One element by numerical integration of p log(p/q): an independent check of the closed form above.
    true_mean, true_var, model_mean, model_var = _reverse_gaussians(reference, x_start[1], x_t[1], eps[1], v[1], 300)
    p = stats.norm(true_mean[0, 0, 0], math.sqrt(true_var))
    q = stats.norm(model_mean[0, 0, 0], math.sqrt(model_var[0, 0, 0]))
    lo, hi = p.ppf(1e-12), p.isf(1e-12)
    kl_quad, _ = integrate.quad(lambda z: p.pdf(z) * (p.logpdf(z) - q.logpdf(z)), lo, hi, epsabs=1e-13, limit=200)
    kl_closed = gaussian_kl(true_mean, true_var, model_mean, model_var)
    assert kl_closed[0, 0, 0] == pytest.approx(kl_quad, rel=1e-6)  # quadrature accuracy


# ----------------------------------------------------------------------------------------------------------------
# Decoder NLL at t = 0: pixels on the 256-level grid of [-1, 1], level 0 and level 255 being the open end bins
# ----------------------------------------------------------------------------------------------------------------

LOG_FLOOR = math.log(1e-12)  # -27.631..., the official code's floor on each of its three branches
# Hand-derived values for a bin centred on the mean with std 1/255 (standardised bin edges ±1). The tanh CDF is
# odd around 1/2, so the centre bin is tanh(a) and an end bin 0.5·(1 + tanh(a)) with a = √(2/π)·(1 + 0.044715).
# log(tanh(a)) = -0.38216275726..., log(0.5·(1 + tanh(a))) = -0.17293535658... (the exact normal CDF gives
# log(2Φ(1) − 1) = -0.38171514... and log Φ(1) = -0.17275378...: the two forms differ in the fourth digit).
HAND_CENTRE_BIN = -0.38216275726460813
HAND_END_BIN = -0.17293535658708467


def official_log_likelihood(level: np.ndarray, mean: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """ADM/DiT's discretised Gaussian log-likelihood re-derived in float64 NumPy from its definition: the tanh
    approximation of the normal CDF, bins of half-width 1/255 around each pixel level, level 0 open to -inf and
    level 255 to +inf, every log-probability floored at log(1e-12). Branches are chosen by level index."""

    def cdf(z):
        return 0.5 * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))

    x = level / 127.5 - 1
    upper, lower = cdf((x + 1 / 255 - mean) / scale), cdf((x - 1 / 255 - mean) / scale)
    probability = np.select([level == 0, level == 255], [upper, 1.0 - lower], upper - lower)
    return np.log(np.maximum(probability, 1e-12))


def decoder_cases() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every pixel level × means 0, ±0.5, ±3, ±10 and ±40 stds away × four stds (1/255 to 1): broadcast arrays."""
    level = np.arange(256, dtype=np.float64).reshape(256, 1, 1)
    offset = np.array([0.0, 0.5, -0.5, 3.0, -3.0, 10.0, -10.0, 40.0, -40.0]).reshape(1, 9, 1)
    scale = np.array([1 / 255, 0.01, 0.1, 1.0]).reshape(1, 1, 4)
    x = level / 127.5 - 1
    return np.broadcast_arrays(level, x + offset * scale, scale)


def test_decoder_log_likelihood_is_the_official_form_on_the_pixel_grid():
    level, mean, scale = decoder_cases()
    as_t = torch.from_numpy
    ours = discretized_gaussian_log_likelihood(as_t(level / 127.5 - 1), as_t(mean), as_t(np.log(scale))).numpy()
    expected = official_log_likelihood(level, mean, scale)
    assert (expected >= LOG_FLOOR).all() and (expected == LOG_FLOOR).any()  # the floor is reached and bounds it
    # Both float64: differences come from last-ulp rounding of tanh in torch vs NumPy (~1e-16), amplified by the
    # cancellation in CDF(upper) − CDF(lower); every probability here is either floored or ≥ 3e-5, so log p moves
    # by ≤ 1e-16 / 3e-5 ≈ 3e-12 (1.7e-12 seen). 1e-9 is far below any difference between the two CDF forms.
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-9)
    # And exactly where the checks by hand apply: mean on the bin centre, std 1/255.
    centred = (mean == level / 127.5 - 1) & (scale == 1 / 255)
    assert ours[centred & (level == 0)] == pytest.approx(HAND_END_BIN, abs=1e-12)
    assert ours[centred & (level == 255)] == pytest.approx(HAND_END_BIN, abs=1e-12)
    assert ours[centred & (level > 0) & (level < 255)] == pytest.approx(np.full(254, HAND_CENTRE_BIN), abs=1e-12)


def test_decoder_nll_far_tails_stop_at_the_official_floor():
    # Data at -1 and +1 (the end bins) and at level 128 (a middle bin) under a mean 2 (or 1) away with std 0.01,
    # i.e. 100-200 stds: the tanh CDF saturates to 0 or 1, so every branch returns the floor log(1e-12).
    x = torch.tensor([-1.0, 1.0, 128 / 127.5 - 1], dtype=torch.float64)
    mean = torch.tensor([1.0, -1.0, -1.0], dtype=torch.float64)
    log_scale = torch.full_like(x, math.log(0.01))
    official = discretized_gaussian_log_likelihood(x, mean, log_scale)
    assert official.tolist() == pytest.approx([LOG_FLOOR] * 3, abs=1e-12)
    # The exact CDF is not floored on the end bins: log Φ(-199.6) ≈ -19928 nats.
    exact = discretized_gaussian_log_likelihood(x, mean, log_scale, cdf="exact")
    assert exact[0].item() == pytest.approx(stats.norm.logcdf((-1 + 1 / 255 - 1) / 0.01), rel=1e-9)
    assert exact[0].item() < -19_000


def step_zero_vb(diffusion, levels):
    """vb_terms_bits at t = 0 for pixels at `levels`, with a model output that moves the mean off the data."""
    x_start = torch.tensor(levels, dtype=torch.float64).view(1, -1, 1, 1) / 127.5 - 1
    x_t = x_start + 0.01
    eps = torch.full_like(x_start, 0.2)
    v = torch.full_like(x_start, 0.4)
    t = torch.zeros(1, dtype=torch.long)
    step = diffusion.p_mean_variance(torch.cat([eps, v], dim=1), x_t, t)
    mean = step.mean.flatten().numpy()
    scale = np.exp(0.5 * step.log_variance.flatten().numpy())
    return diffusion.vb_terms_bits(x_start, x_t, t, step).item(), np.array(levels, dtype=np.float64), mean, scale


def test_step_zero_vb_term_is_the_official_decoder_nll_by_default(diffusion):
    # Pixels on the 256-level grid, both end bins included; the default diffusion uses the official form.
    nll_bits, level, mean, scale = step_zero_vb(diffusion, [0, 1, 37, 128, 200, 254, 255])
    expected = -official_log_likelihood(level, mean, scale).mean() / math.log(2)
    assert nll_bits == pytest.approx(expected, rel=1e-9)  # float64 on both sides, same formula


def test_step_zero_vb_term_with_the_exact_cdf_option():
    # decoder_cdf="exact": the exact normal CDF (scipy as the reference), end bins open to ±inf.
    diffusion = create_diffusion(decoder_cdf="exact")
    assert diffusion.respaced("50").spec.decoder_cdf == "exact"  # respacing keeps the option
    nll_bits, level, mean, scale = step_zero_vb(diffusion, [0, 37, 200, 255])
    expected = []
    for lv, m, s in zip(level, mean, scale):
        x, dist = lv / 127.5 - 1, stats.norm(m, s)
        if lv == 0:
            log_p = dist.logcdf(x + 1 / 255)
        elif lv == 255:
            log_p = dist.logsf(x - 1 / 255)
        else:
            log_p = math.log(dist.cdf(x + 1 / 255) - dist.cdf(x - 1 / 255))
        expected.append(-log_p / math.log(2))
    # scipy's normal CDF vs torch's ndtr, both float64: agreement to ~1e-12 relative; 1e-9 allows for log of
    # differences of CDFs (cancellation over a bin of width 2/255 at scale ~1e-2).
    assert nll_bits == pytest.approx(np.mean(expected), rel=1e-9)
    official_bits, *_ = step_zero_vb(create_diffusion(), [0, 37, 200, 255])
    assert official_bits != pytest.approx(nll_bits, rel=1e-6)  # the option changes the loss


def test_unknown_decoder_cdf_is_rejected():
    with pytest.raises(ValueError, match="'erf'.*tanh.*exact"):
        create_diffusion(decoder_cdf="erf")


# ----------------------------------------------------------------------------------------------------------------
# Training losses
# ----------------------------------------------------------------------------------------------------------------


def test_hybrid_loss_trains_the_mean_by_mse_and_the_variance_by_vb(diffusion):
    # Seeded: at t = 0 a decoder-NLL bin probability can hit its 1e-12 floor, whose gradient is exactly 0 (7 %
    # of seeds 0-199, which made the last assertion depend on the RNG state earlier tests left).
    torch.manual_seed(0)
    x = torch.randn(3, 4, 2, 2)
    noise = torch.randn_like(x)
    t = torch.tensor([0, 17, 999])
    output = torch.randn(3, 8, 2, 2, requires_grad=True)
    terms = diffusion.training_losses(lambda x_t, t_, y: output, x, torch.zeros(3, dtype=torch.long), t=t, noise=noise)

    torch.testing.assert_close(terms["mse"], ((noise - output[:, :4]) ** 2).mean(dim=(1, 2, 3)), rtol=0, atol=0)
    torch.testing.assert_close(terms["loss"], terms["mse"] + terms["vb"], rtol=0, atol=0)
    (grad,) = torch.autograd.grad(terms["vb"].sum(), output)
    assert torch.count_nonzero(grad[:, :4]) == 0, "the VB term must not train the mean (epsilon) channels"
    assert torch.count_nonzero(grad[:, 4:]) == grad[:, 4:].numel()


def test_training_losses_without_learned_sigma():
    diffusion = create_diffusion(learn_sigma=False)
    x = torch.randn(2, 4, 2, 2)
    terms = diffusion.training_losses(
        lambda x_t, t, y: torch.zeros_like(x_t), x, torch.zeros(2, dtype=torch.long), noise=torch.ones_like(x)
    )
    assert set(terms) == {"mse", "loss"}
    torch.testing.assert_close(terms["loss"], torch.ones(2), rtol=0, atol=0)  # mean((1 - 0)^2)


def test_clip_denoised_keeps_eps_consistent_with_the_clipped_x0(diffusion):
    """Pixel-space sampling may clip predicted x_0 to [-1, 1]; DDIM then needs the epsilon that matches it:
    x_t = sqrt(abar) x_0 + sqrt(1 - abar) eps must still hold (float64 rounding only)."""
    x_t = 3 * torch.randn(4, 4, 2, 2, dtype=torch.float64)
    t = torch.tensor([5, 100, 400, 900])
    output = torch.cat([torch.randn_like(x_t), torch.zeros_like(x_t)], dim=1)
    step = diffusion.p_mean_variance(output, x_t, t, clip_denoised=True)
    assert step.pred_xstart.abs().max() <= 1 and (step.pred_xstart.abs() == 1).any()
    abar = diffusion.alphas_cumprod[t].view(-1, 1, 1, 1)
    torch.testing.assert_close(
        abar.sqrt() * step.pred_xstart + (1 - abar).sqrt() * step.eps, x_t, rtol=1e-12, atol=1e-12
    )


def test_wrong_model_output_channels_are_reported(diffusion):
    with pytest.raises(ValueError, match="expected 8"):
        diffusion.training_losses(lambda x_t, t, y: x_t, torch.randn(2, 4, 2, 2), torch.zeros(2, dtype=torch.long))


def test_sampler_request_is_checked_before_sampling(diffusion):
    model = lambda x, t, y: pytest.fail("the model must not run for a bad request")  # noqa: E731
    x, y = torch.randn(1, 4, 2, 2), torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"unknown sampler 'euler'.*'ddim', 'ddpm'"):
        diffusion.sample(model, x, y, sampler="euler")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['eta'\]"):
        diffusion.sample(model, x, y, sampler="ddpm", eta=1.0)
    assert diffusion.default_sampler == "ddpm" and set(diffusion.sampler_names) == {"ddpm", "ddim", "dpm++2m", "unipc"}
    assert isinstance(diffusion, GaussianDiffusion)
