"""DiT's DDPM objective: the 1000-step linear-beta schedule (float64), epsilon prediction with a learned-range
variance, the hybrid loss of improved DDPM, respacing to fewer steps, and dispatch into the samplers (ancestral
DDPM, DDIM, and the DPM-Solver++(2M) / UniPC multistep solvers)."""

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dit_vca.losses import mean_flat
from objectives import DECODER_CDF, DIFFUSION_SAMPLERS, MULTISTEP_SOLVERS, DiffusionSpec
from samplers import PerSampleNoise, SampleResult
from samplers import ddpm as ddpm_samplers
from samplers.ddpm import ReverseStep
from samplers.interface import ModelFn, SamplerOptionError, StepCallback, check_sampler_request
from samplers.multistep import multistep_solver

NUM_TIMESTEPS = 1000
BETA_START = 1e-4  # for 1000 steps; scaled by 1000 / num_timesteps otherwise, as in improved DDPM
BETA_END = 0.02
PIXEL_BIN_HALF_WIDTH = 1.0 / 255.0  # decoder NLL: data in [-1, 1] discretised to 256 levels
PROBABILITY_FLOOR = 1e-12  # decoder NLL: bin probabilities below this count as this, as in ADM/DiT


# ----------------------------------------------------------------------------------------------------------------
# Schedules and respacing
# ----------------------------------------------------------------------------------------------------------------


def linear_betas(num_timesteps: int = NUM_TIMESTEPS) -> np.ndarray:
    """Ho et al.'s linear betas, stretched so that any number of steps covers the same noise range."""
    scale = NUM_TIMESTEPS / num_timesteps
    return np.linspace(scale * BETA_START, scale * BETA_END, num_timesteps, dtype=np.float64)


def space_timesteps(num_timesteps: int, spec: str) -> list[int]:
    """The retained step indices of a num_timesteps process for a respacing spec.

    "" keeps every step. "ddimK" takes the integer stride of the DDIM paper that yields exactly K steps.
    "K" (or "K1,K2,..." for equal sections of the process) spreads K steps evenly, rounding fractional strides,
    both ends included: the convention of improved DDPM / ADM / DiT, which published numbers depend on.
    """
    if spec == "":
        return list(range(num_timesteps))
    if spec.startswith("ddim"):
        count = _parse_count(spec, spec[len("ddim") :])
        for stride in range(1, num_timesteps):
            if len(range(0, num_timesteps, stride)) == count:
                return list(range(0, num_timesteps, stride))
        raise SamplerOptionError(
            f"respacing {spec!r}: no integer stride gives exactly {count} of {num_timesteps} steps"
        )
    counts = [_parse_count(spec, part) for part in spec.split(",")]
    size_per, extra = divmod(num_timesteps, len(counts))
    start, steps = 0, []
    for i, count in enumerate(counts):
        size = size_per + (1 if i < extra else 0)
        if count > size:
            raise SamplerOptionError(f"respacing {spec!r}: cannot take {count} steps from a section of {size}")
        stride = (size - 1) / (count - 1) if count > 1 else 1.0
        steps += [start + round(j * stride) for j in range(count)]
        start += size
    return sorted(set(steps))


def _parse_count(spec: str, text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise SamplerOptionError(f"respacing {spec!r}: expected '', 'K', 'K1,K2,...' or 'ddimK' with positive integers")
    return int(text)


# ----------------------------------------------------------------------------------------------------------------
# Gaussian helpers (nats)
# ----------------------------------------------------------------------------------------------------------------


def normal_kl(mean1: Tensor, logvar1: Tensor, mean2: Tensor, logvar2: Tensor) -> Tensor:
    """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)) per element."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def approximate_normal_cdf(z: Tensor) -> Tensor:
    """The standard normal CDF by the tanh approximation 0.5·(1 + tanh(√(2/π)·(z + 0.044715·z³))) of ADM/DiT."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))


def discretized_gaussian_log_likelihood(
    x: Tensor, mean: Tensor, log_scale: Tensor, cdf: str = DECODER_CDF.default
) -> Tensor:
    """log P(x) per element for x on the 256-level grid of [-1, 1] under N(mean, e^(2 log_scale)) integrated over
    x's bin of half-width 1/255; the end bins (x = -1, x = +1) extend to -inf and +inf.

    cdf="tanh" (default) is the official ADM/DiT decoder: the tanh approximation of the normal CDF and every
    probability floored at 1e-12, so log P ≥ log(1e-12) = -27.63 on all three branches (training parity with the
    published models, bounded loss). cdf="exact" uses the exact normal CDF: the end bins by log Φ (unbounded in
    the far tails), the middle bins floored at 1e-12. See docs/VCA.md, "Conventions".
    """
    inv_scale = torch.exp(-log_scale)
    upper = (x - mean + PIXEL_BIN_HALF_WIDTH) * inv_scale  # standardised bin edges
    lower = (x - mean - PIXEL_BIN_HALF_WIDTH) * inv_scale
    if cdf == "tanh":
        cdf_upper, cdf_lower = approximate_normal_cdf(upper), approximate_normal_cdf(lower)
        log_left = torch.log(cdf_upper.clamp(min=PROBABILITY_FLOOR))  # bin (-inf, x + 1/255] at x = -1
        log_right = torch.log((1.0 - cdf_lower).clamp(min=PROBABILITY_FLOOR))  # bin [x - 1/255, inf) at x = +1
    elif cdf == "exact":
        cdf_upper, cdf_lower = torch.special.ndtr(upper), torch.special.ndtr(lower)
        log_left, log_right = torch.special.log_ndtr(upper), torch.special.log_ndtr(-lower)
    else:
        raise ValueError(f"decoder cdf {cdf!r} is not one of {DECODER_CDF.choices}")
    log_middle = torch.log((cdf_upper - cdf_lower).clamp(min=PROBABILITY_FLOOR))
    return torch.where(x < -0.999, log_left, torch.where(x > 0.999, log_right, log_middle))


# ----------------------------------------------------------------------------------------------------------------
# The diffusion process
# ----------------------------------------------------------------------------------------------------------------


class GaussianDiffusion:
    """A (possibly respaced) DDPM process with epsilon prediction and, when its spec's learn_sigma, a learned-range
    variance.

    Step k of the process corresponds to timestep_map[k] of the original training process; the model is always
    called with those original indices, so one trained model serves every respacing.

    The spec's decoder_cdf chooses the normal CDF of the decoder NLL at step 0 (see
    discretized_gaussian_log_likelihood): "tanh", the official ADM/DiT form (default), or "exact".
    """

    def __init__(
        self,
        betas: np.ndarray,
        spec: DiffusionSpec = DiffusionSpec(),
        timestep_map: list[int] | None = None,
    ):
        betas = np.asarray(betas, dtype=np.float64)
        if betas.ndim != 1 or not ((betas > 0) & (betas <= 1)).all():
            raise ValueError("betas must be a 1-D array with values in (0, 1]")
        if spec.decoder_cdf not in DECODER_CDF.choices:
            raise ValueError(f"decoder_cdf={spec.decoder_cdf!r}; expected one of {DECODER_CDF.choices}")
        self.spec = spec
        self.num_timesteps = len(betas)
        timestep_map = list(range(len(betas))) if timestep_map is None else list(timestep_map)
        if len(timestep_map) != len(betas):
            raise ValueError(f"timestep_map has {len(timestep_map)} entries for {len(betas)} betas")

        alphas_cumprod = np.cumprod(1.0 - betas)
        alphas_cumprod_prev = np.append(1.0, alphas_cumprod[:-1])
        posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)
        # The posterior variance is 0 at step 0; its log is clipped to the value at step 1.
        clipped = np.append(posterior_variance[1], posterior_variance[1:]) if len(betas) > 1 else posterior_variance
        # Without a learned variance DiT uses the "fixed large" choice beta_t (with beta~_1 at step 0).
        fixed_large = np.append(posterior_variance[1], betas[1:]) if len(betas) > 1 else betas

        as_tensor = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float64))  # noqa: E731
        self.timestep_map = torch.tensor(timestep_map, dtype=torch.long)  # (K,)
        self.betas = as_tensor(betas)  # (K,) float64, as are all schedule tensors below
        self.alphas_cumprod = as_tensor(alphas_cumprod)
        self.alphas_cumprod_prev = as_tensor(alphas_cumprod_prev)
        self.sqrt_alphas_cumprod = as_tensor(np.sqrt(alphas_cumprod))
        self.sqrt_one_minus_alphas_cumprod = as_tensor(np.sqrt(1.0 - alphas_cumprod))
        self.sqrt_recip_alphas_cumprod = as_tensor(np.sqrt(1.0 / alphas_cumprod))
        self.sqrt_recipm1_alphas_cumprod = as_tensor(np.sqrt(1.0 / alphas_cumprod - 1.0))
        self.posterior_variance = as_tensor(posterior_variance)
        self.posterior_log_variance_clipped = as_tensor(np.log(clipped))
        self.posterior_mean_coef1 = as_tensor(betas * np.sqrt(alphas_cumprod_prev) / (1.0 - alphas_cumprod))
        self.posterior_mean_coef2 = as_tensor(
            (1.0 - alphas_cumprod_prev) * np.sqrt(1.0 - betas) / (1.0 - alphas_cumprod)
        )
        self.log_betas = as_tensor(np.log(betas))
        self.fixed_log_variance = as_tensor(np.log(fixed_large))
        self._device_tables: dict[tuple[str, torch.device], Tensor] = {}  # see _table
        self._respacings: dict[str, GaussianDiffusion] = {}  # see respaced

    # -- respacing --------------------------------------------------------------------------------------------

    def respaced(self, spec: str) -> "GaussianDiffusion":
        """The process restricted to the steps kept by `spec` (see space_timesteps), with the betas that give the
        same alphas_cumprod at those steps: beta_k = 1 - abar[t_k] / abar[t_{k-1}]. Built once per spec and
        kept, with the schedule tables it has moved to a device (every sampling call respaces)."""
        if spec in self._respacings:
            return self._respacings[spec]
        kept = space_timesteps(self.num_timesteps, spec)
        alphas_cumprod = self.alphas_cumprod.numpy()[kept]
        betas = 1.0 - alphas_cumprod / np.append(1.0, alphas_cumprod[:-1])
        process = GaussianDiffusion(betas, self.spec, self.timestep_map[kept].tolist())
        self._respacings[spec] = process
        return process

    def model_timesteps(self, t: Tensor) -> Tensor:
        """Original timestep indices (what the model was trained on) for process steps t (B,)."""
        return self._table("timestep_map", t.device)[t]  # (B,)

    # -- forward process and posterior --------------------------------------------------------------------------

    def _table(self, name: str, device: torch.device) -> Tensor:
        """The schedule tensor `name` on `device`, copied there once and kept: indexing the CPU table at every
        step would copy it to the GPU each time (about 15 copies per training step, 9 per DDPM step)."""
        key = (name, device)
        if key not in self._device_tables:
            self._device_tables[key] = getattr(self, name).to(device)
        return self._device_tables[key]

    def _at(self, name: str, t: Tensor, x: Tensor) -> Tensor:
        """The schedule tensor `name` at steps t, as a (B, 1, ..., 1) tensor in x's dtype and device."""
        values = self._table(name, t.device)[t].to(x.dtype)  # (B,)
        return values.view(-1, *([1] * (x.ndim - 1)))

    def q_sample(self, x_start: Tensor, t: Tensor, noise: Tensor) -> Tensor:
        """x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps, a draw from q(x_t | x_0)."""
        return (
            self._at("sqrt_alphas_cumprod", t, x_start) * x_start
            + self._at("sqrt_one_minus_alphas_cumprod", t, x_start) * noise
        )

    def q_posterior_mean_variance(self, x_start: Tensor, x_t: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Mean, variance and clipped log-variance of q(x_{t-1} | x_t, x_0)."""
        mean = self._at("posterior_mean_coef1", t, x_t) * x_start + self._at("posterior_mean_coef2", t, x_t) * x_t
        return mean, self._at("posterior_variance", t, x_t), self._at("posterior_log_variance_clipped", t, x_t)

    def p_mean_variance(self, model_output: Tensor, x_t: Tensor, t: Tensor, clip_denoised: bool = False) -> ReverseStep:
        """The reverse step p(x_{t-1} | x_t) implied by the model output at process step t.

        With learn_sigma the output is [eps, v] with v in [-1, 1] interpolating the log-variance between the
        posterior variance beta~_t (v = -1) and beta_t (v = +1) ("learned range", improved DDPM).
        """
        channels = x_t.shape[1]
        expected = 2 * channels if self.spec.learn_sigma else channels
        if model_output.shape[1] != expected:
            raise ValueError(
                f"model output has {model_output.shape[1]} channels; expected {expected} for "
                f"{channels}-channel inputs with learn_sigma={self.spec.learn_sigma}"
            )
        model_output = model_output.to(x_t.dtype)
        if self.spec.learn_sigma:
            eps, v = model_output.split(channels, dim=1)  # (B, C, H, W) each
            frac = (v + 1) / 2
            log_variance = frac * self._at("log_betas", t, x_t) + (1 - frac) * self._at(
                "posterior_log_variance_clipped", t, x_t
            )
        else:
            eps = model_output
            log_variance = self._at("fixed_log_variance", t, x_t).expand_as(x_t)
        # x_0 = (x_t - sqrt(1 - abar) eps) / sqrt(abar), and back when x_0 is clipped
        recip = self._at("sqrt_recip_alphas_cumprod", t, x_t)
        recipm1 = self._at("sqrt_recipm1_alphas_cumprod", t, x_t)
        pred_xstart = recip * x_t - recipm1 * eps
        if clip_denoised:
            pred_xstart = pred_xstart.clamp(-1, 1)
            eps = (recip * x_t - pred_xstart) / recipm1
        mean, _, _ = self.q_posterior_mean_variance(pred_xstart, x_t, t)
        return ReverseStep(mean=mean, log_variance=log_variance, pred_xstart=pred_xstart, eps=eps)

    # -- training -------------------------------------------------------------------------------------------------

    def vb_terms_bits(self, x_start: Tensor, x_t: Tensor, t: Tensor, step: ReverseStep) -> Tensor:
        """The variational-bound term of each sample in bits per dimension: KL(q(x_{t-1}|x_t,x_0) || p(x_{t-1}|x_t))
        for t > 0, the discretised decoder NLL -log p(x_0|x_1) at t = 0."""
        true_mean, _, true_log_variance = self.q_posterior_mean_variance(x_start, x_t, t)
        kl = mean_flat(normal_kl(true_mean, true_log_variance, step.mean, step.log_variance)) / math.log(2.0)
        nll = -discretized_gaussian_log_likelihood(x_start, step.mean, 0.5 * step.log_variance, self.spec.decoder_cdf)
        return torch.where(t == 0, mean_flat(nll) / math.log(2.0), kl)  # (B,)

    def training_losses(
        self, model: ModelFn, x: Tensor, y: Tensor, t: Tensor | None = None, noise: Tensor | None = None
    ) -> dict[str, Tensor]:
        """Per-sample losses (B,) for clean inputs x: "mse" of the predicted noise, "vb" (bits/dim) training only
        the variance (the mean is detached, as in improved DDPM's hybrid loss; DiT adds it unscaled), and their
        sum "loss". t defaults to uniform process steps; the model sees the original timestep indices."""
        if t is None:
            t = torch.randint(0, self.num_timesteps, (x.shape[0],), device=x.device)
        if noise is None:
            noise = torch.randn_like(x)
        x_t = self.q_sample(x, t, noise)  # (B, C, H, W)
        output = model(x_t, self.model_timesteps(t), y).to(x.dtype)  # (B, C or 2C, H, W)
        eps = output[:, : x.shape[1]]
        terms = {"mse": mean_flat((noise - eps) ** 2)}
        if self.spec.learn_sigma:
            frozen_mean = torch.cat([eps.detach(), output[:, x.shape[1] :]], dim=1)
            terms["vb"] = self.vb_terms_bits(x, x_t, t, self.p_mean_variance(frozen_mean, x_t, t))
            terms["loss"] = terms["mse"] + terms["vb"]
        else:
            terms["loss"] = terms["mse"]
        return terms

    # -- sampling --------------------------------------------------------------------------------------------------

    default_sampler = DIFFUSION_SAMPLERS.default
    sampler_names = DIFFUSION_SAMPLERS.names

    def sample(
        self,
        model_fn: ModelFn,
        x_T: Tensor,
        labels: Tensor,
        *,
        sampler: str = DIFFUSION_SAMPLERS.default,
        steps: int | None = None,
        noise: PerSampleNoise | None = None,
        progress: bool = False,
        callback: StepCallback | None = None,
        **options,
    ) -> SampleResult:
        """Sample with "ddpm" (ancestral, respaced to `steps`, default 250), "ddim" (spacing "ddimK", default 50;
        option eta, default 0) or the deterministic multistep solvers "dpm++2m" and "unipc" (default 20 steps,
        spread over this process by diffusers' schedulers). Option clip_denoised (DDPM/DDIM) clamps predicted x_0
        to [-1, 1] (pixel data only). `callback` gets a samplers.interface.SamplerStep per step (denoised: x_0)."""
        check_sampler_request(sampler, options, DIFFUSION_SAMPLERS.options)
        steps = DIFFUSION_SAMPLERS.steps[sampler] if steps is None else steps
        stepping = {"progress": progress, "callback": callback}
        with torch.no_grad():
            if sampler in MULTISTEP_SOLVERS:
                return multistep_solver(model_fn, x_T, labels, self, solver=sampler, steps=steps, **stepping)
            process = self.respaced(f"ddim{steps}" if sampler == "ddim" else str(steps))
            run = ddpm_samplers.ddim if sampler == "ddim" else ddpm_samplers.ddpm
            return run(model_fn, x_T, labels, process, noise=noise, **stepping, **options)


def create_diffusion(
    timestep_respacing: str = "", diffusion_steps: int = NUM_TIMESTEPS, **settings: Any
) -> GaussianDiffusion:
    """DiT's diffusion: `diffusion_steps` linear-beta steps, respaced by `timestep_respacing` ("" = all steps), with
    the `DiffusionSpec` of `settings` (learn_sigma; decoder_cdf: "tanh", the official decoder NLL at step 0, or
    "exact", the exact normal CDF), e.g. `create_diffusion(learn_sigma=False)`.

    As in DiT, even the full process is built through respacing, so its betas are recomputed from alphas_cumprod.
    """
    return GaussianDiffusion(linear_betas(diffusion_steps), DiffusionSpec(**settings)).respaced(timestep_respacing)
