"""SiT's interpolant (transport) objective: x_t = alpha_t x_1 + sigma_t x_0 from noise x_0 (t = 0) to data x_1
(t = 1) along the Linear, GVP or VP path; velocity, score or noise prediction; loss weights; conversions between
the three predictions; and dispatch into the ODE/SDE samplers. Training options of LightningDiT's recipe:
logit-normal training times and the velocity-direction (cosine) loss."""

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dit_vca.losses import mean_flat
from objectives import (
    ADAPTIVE_METHODS,
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    DEFAULT_SDE,
    DEFAULT_TIME_SHIFT,
    DIFFUSION_FORMS,
    LAST_STEPS,
    LOSS_WEIGHT,
    PATH,
    PREDICTION,
    TIME_DISTRIBUTION,
    TRANSPORT_SAMPLERS,
    TransportSpec,
)
from samplers import PerSampleNoise, SampleResult, ode, sde
from samplers.interface import DenoiseFn, ModelFn, SamplerOptionError, StepCallback, check_sampler_request

# ----------------------------------------------------------------------------------------------------------------
# Paths
# ----------------------------------------------------------------------------------------------------------------


class Path:
    """An interpolant x_t = alpha_t x_1 + sigma_t x_0; subclasses give alpha_t, sigma_t and their time derivatives.

    Time arguments are tensors broadcastable against the data, e.g. (B, 1, 1, 1).
    """

    def alpha(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """(alpha_t, d alpha_t / dt)."""
        raise NotImplementedError

    def sigma(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """(sigma_t, d sigma_t / dt)."""
        raise NotImplementedError

    def interpolate(self, x0: Tensor, x1: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """x_t and the conditional velocity u_t = alpha'_t x_1 + sigma'_t x_0."""
        (a, da), (s, ds) = self.alpha(t), self.sigma(t)
        return a * x1 + s * x0, da * x1 + ds * x0

    def score_coefficient(self, t: Tensor) -> Tensor:
        """b_t in v = (alpha'/alpha) x + b_t * score, i.e. b_t = (alpha'/alpha) sigma^2 - sigma sigma' >= 0
        (SiT's "drift variance"); it also sets the loss weights and the SBDM diffusion."""
        (a, da), (s, ds) = self.alpha(t), self.sigma(t)
        return da / a * s**2 - s * ds

    # -- conversions between predictions (exact for the optimal predictors) ---------------------------------------

    def velocity_from_score(self, score: Tensor, x: Tensor, t: Tensor) -> Tensor:
        a, da = self.alpha(t)
        return da / a * x + self.score_coefficient(t) * score

    def score_from_velocity(self, velocity: Tensor, x: Tensor, t: Tensor) -> Tensor:
        # Written with alpha/alpha' so that it stays finite at t = 0, where alpha = 0 on the Linear and GVP paths.
        (a, da), (s, ds) = self.alpha(t), self.sigma(t)
        ratio = a / da
        return (ratio * velocity - x) / (s**2 - ratio * s * ds)

    def score_from_noise(self, noise: Tensor, t: Tensor) -> Tensor:
        return -noise / self.sigma(t)[0]

    def data_from_velocity(self, velocity: Tensor, x: Tensor, t: Tensor) -> Tensor:
        """The data estimate E[x_1 | x_t] implied by a velocity: x = alpha x_1 + sigma x_0 and v = alpha' x_1 +
        sigma' x_0 solved for x_1 (finite at t = 0, where alpha = 0 on the Linear and GVP paths)."""
        (a, da), (s, ds) = self.alpha(t), self.sigma(t)
        return (ds * x - s * velocity) / (ds * a - s * da)

    def velocity_from_drift(self, drift: Tensor, x: Tensor, t: Tensor, w: Tensor) -> Tensor:
        """The velocity v in an SDE drift f = v + w score, the score written through v (score_from_velocity):
        v = (D f + w x) / (D + w alpha / alpha'), D = sigma^2 - (alpha / alpha') sigma sigma'."""
        (a, da), (s, ds) = self.alpha(t), self.sigma(t)
        ratio = a / da
        spread = s**2 - ratio * s * ds
        return (spread * drift + w * x) / (spread + w * ratio)

    def noise_from_score(self, score: Tensor, t: Tensor) -> Tensor:
        return -self.sigma(t)[0] * score

    def sde_diffusion(self, t: Tensor, form: str, norm: float) -> Tensor:
        """w(t) of SiT's named diffusion forms for the SDE dx = (v + w score) dt + sqrt(2w) dW, element-wise on
        times t (on any device: the drift evaluates it where the samples are, without reading t back)."""
        if form == "SBDM":
            return norm * self.score_coefficient(t)
        if form == "sigma":
            return norm * self.sigma(t)[0]
        return {
            "constant": lambda: torch.full_like(t, norm),
            "linear": lambda: norm * (1 - t),
            "decreasing": lambda: 0.25 * (norm * torch.cos(math.pi * t) + 1) ** 2,
            "increasing-decreasing": lambda: norm * torch.sin(math.pi * t) ** 2,
        }[form]()


class LinearPath(Path):
    """alpha_t = t, sigma_t = 1 - t (rectified flow / SiT "Linear")."""

    def alpha(self, t):
        return t, torch.ones_like(t)

    def sigma(self, t):
        return 1 - t, -torch.ones_like(t)


class GVPPath(Path):
    """alpha_t = sin(pi t / 2), sigma_t = cos(pi t / 2): variance preserving for unit-variance data."""

    def alpha(self, t):
        return torch.sin(0.5 * math.pi * t), 0.5 * math.pi * torch.cos(0.5 * math.pi * t)

    def sigma(self, t):
        return torch.cos(0.5 * math.pi * t), -0.5 * math.pi * torch.sin(0.5 * math.pi * t)


class VPPath(Path):
    """The VP-SDE of score-based models with linear beta from sigma_min to sigma_max, time reversed (t = 1 data):
    alpha_t = exp(m_t), m_t = -(1/4)(1-t)^2 (sigma_max - sigma_min) - (1/2)(1-t) sigma_min,
    sigma_t = sqrt(1 - alpha_t^2)."""

    def __init__(self, sigma_min: float = 0.1, sigma_max: float = 20.0):
        self.sigma_min, self.sigma_max = sigma_min, sigma_max

    def _log_mean_coeff(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """(m_t, m'_t); m'_t = beta(t) / 2 with beta(t) = sigma_min + (1 - t)(sigma_max - sigma_min)."""
        u = 1 - t
        m = -0.25 * u**2 * (self.sigma_max - self.sigma_min) - 0.5 * u * self.sigma_min
        dm = 0.5 * u * (self.sigma_max - self.sigma_min) + 0.5 * self.sigma_min
        return m, dm

    def alpha(self, t):
        m, dm = self._log_mean_coeff(t)
        a = torch.exp(m)
        return a, a * dm

    def sigma(self, t):
        m, dm = self._log_mean_coeff(t)
        s = torch.sqrt(-torch.expm1(2 * m))  # sqrt(1 - alpha^2), accurate near t = 1
        return s, -torch.exp(2 * m) * dm / s  # sigma' = -alpha alpha' / sigma


PATHS = dict(zip(PATH.choices, (LinearPath, GVPPath, VPPath)))  # the table's names, in its order


# ----------------------------------------------------------------------------------------------------------------
# The transport objective
# ----------------------------------------------------------------------------------------------------------------


def velocity_direction_loss(predicted: Tensor, target: Tensor) -> Tensor:
    """LightningDiT's cosine loss (B,): 1 − cos(predicted, target) between the channel vectors of each latent pixel,
    averaged over the pixels; it penalises a wrong direction of the velocity whatever its length. Inputs (B, C, ...).
    """
    return mean_flat(1 - F.cosine_similarity(predicted, target, dim=1))  # (B,)


def _expand(t: Tensor, x: Tensor) -> Tensor:
    return t.view(-1, *([1] * (x.ndim - 1))).to(x.dtype)  # (B, 1, ..., 1)


class Transport:
    """Training loss and samplers of an interpolant model predicting velocity, score or noise along a path."""

    default_sampler = TRANSPORT_SAMPLERS.default
    sampler_names = TRANSPORT_SAMPLERS.names

    def __init__(self, spec: TransportSpec):
        """The transport of `spec` with SiT's default epsilons where the spec leaves them None: VP 1e-5 (train) /
        1e-3 (sample); Linear or GVP with noise or score prediction 1e-3 / 1e-3; Linear or GVP with velocity 0 / 0
        (stable everywhere). The training options (training_times, velocity_direction_loss) default to SiT's:
        uniform times, no cosine loss. `spec.path` is read case-insensitively."""
        key = spec.path.lower()
        if key not in PATHS:
            raise ValueError(f"unknown path {spec.path!r}; expected one of {sorted(PATHS)} (case-insensitive)")
        if spec.prediction not in PREDICTION.choices:
            raise ValueError(f"unknown prediction {spec.prediction!r}; expected one of {list(PREDICTION.choices)}")
        if spec.loss_weight not in LOSS_WEIGHT.choices:
            raise ValueError(f"unknown loss_weight {spec.loss_weight!r}; expected one of {list(LOSS_WEIGHT.choices)}")
        if spec.loss_weight is not None and spec.prediction == "velocity":
            raise ValueError(f"loss_weight {spec.loss_weight!r} applies to score or noise prediction, not velocity")
        if spec.time_distribution not in TIME_DISTRIBUTION.choices:
            raise ValueError(
                f"unknown time_distribution {spec.time_distribution!r}; expected one of "
                f"{list(TIME_DISTRIBUTION.choices)}"
            )
        if not spec.logit_normal_scale > 0:
            raise ValueError(f"logit_normal_scale must be > 0, got {spec.logit_normal_scale}")
        if spec.cosine_loss_weight < 0 or (spec.cosine_loss_weight and spec.prediction != "velocity"):
            raise ValueError(f"cosine_loss_weight {spec.cosine_loss_weight} needs to be >= 0 and prediction='velocity'")
        if key == "vp":
            default_train, default_sample = 1e-5, 1e-3
        elif spec.prediction != "velocity":
            default_train, default_sample = 1e-3, 1e-3
        else:
            default_train, default_sample = 0.0, 0.0
        self.spec = spec
        self.path = PATHS[key]()
        self.train_eps = default_train if spec.train_eps is None else float(spec.train_eps)
        self.sample_eps = default_sample if spec.sample_eps is None else float(spec.sample_eps)

    # -- time intervals ---------------------------------------------------------------------------------------

    def interval(self, eps: float, sde_form: str | None = None, last_step_size: float = 0.0) -> tuple[float, float]:
        """[t0, t1] to train or integrate on (SiT's rule). Noise and score predictions (and the SBDM diffusion)
        blow up at t = 0 on Linear/GVP, so they start at eps; every path but a velocity model on Linear/GVP
        stops at 1 - eps; an SDE with a last step stops last_step_size short of 1."""
        singular_start = self.spec.prediction != "velocity" or sde_form == "SBDM"
        t0 = eps if singular_start and not isinstance(self.path, VPPath) else 0.0
        t1 = 1.0 - (last_step_size if sde_form is not None and last_step_size > 0 else eps)
        return t0, t1

    # -- predictions -----------------------------------------------------------------------------------------------

    def _prediction(self, model_fn: ModelFn, x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        """The model output; extra channels of a learn_sigma backbone carry nothing here and are dropped (as SiT)."""
        return model_fn(x, t, y)[:, : x.shape[1]].to(x.dtype)  # (B, C, H, W)

    def velocity(self, output: Tensor, x: Tensor, t: Tensor) -> Tensor:
        """The probability-flow velocity implied by a model output at (x, t (B,))."""
        t = _expand(t, x)
        if self.spec.prediction == "velocity":
            return output
        score = output if self.spec.prediction == "score" else self.path.score_from_noise(output, t)
        return self.path.velocity_from_score(score, x, t)

    def score(self, output: Tensor, x: Tensor, t: Tensor) -> Tensor:
        """The score grad log p_t(x) implied by a model output at (x, t (B,))."""
        t = _expand(t, x)
        if self.spec.prediction == "velocity":
            return self.path.score_from_velocity(output, x, t)
        return output if self.spec.prediction == "score" else self.path.score_from_noise(output, t)

    # -- training ----------------------------------------------------------------------------------------------

    def training_times(self, batch: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """Training times (batch,) on the training interval [t0, t1]: uniform, or logit-normal, t0 + (t1 - t0) ·
        sigmoid(m + s·z) with z ~ N(0, 1) (SD3's and LightningDiT's sampling, which concentrates the times in the
        middle of the path; with t = 1 the data end here, m > 0 moves them towards the data, unlike SD3's m, whose
        t is the noise level)."""
        t0, t1 = self.interval(self.train_eps)
        if self.spec.time_distribution == "logit-normal":
            z = torch.randn(batch, device=device, dtype=dtype)
            unit = torch.sigmoid(self.spec.logit_normal_location + self.spec.logit_normal_scale * z)  # (B,)
        else:
            unit = torch.rand(batch, device=device, dtype=dtype)  # (B,)
        return unit * (t1 - t0) + t0  # (B,)

    def training_losses(
        self, model: ModelFn, x1: Tensor, y: Tensor, t: Tensor | None = None, noise: Tensor | None = None
    ) -> dict[str, Tensor]:
        """Per-sample loss (B,) for data x1: velocity models regress u_t, plus `cosine_loss_weight` times the
        velocity-direction loss (terms "mse" and "cosine" then come along); score and noise models regress
        -x_0 / sigma_t and x_0 under the chosen loss weight. t defaults to `training_times`."""
        if t is None:
            t = self.training_times(x1.shape[0], x1.device, x1.dtype)  # (B,)
        x0 = torch.randn_like(x1) if noise is None else noise
        t_ = _expand(t, x1)
        x_t, u_t = self.path.interpolate(x0, x1, t_)
        output = self._prediction(model, x_t, t, y)  # (B, C, H, W)
        if self.spec.prediction == "velocity":
            mse = mean_flat((output - u_t) ** 2)  # (B,)
            if not self.spec.cosine_loss_weight:
                return {"loss": mse}
            cosine = velocity_direction_loss(output, u_t)  # (B,)
            return {"loss": mse + self.spec.cosine_loss_weight * cosine, "mse": mse, "cosine": cosine}
        sigma_t = self.path.sigma(t_)[0]
        b_t = self.path.score_coefficient(t_)
        weight = {None: torch.ones_like(b_t), "velocity": (b_t / sigma_t) ** 2, "likelihood": b_t / sigma_t**2}[
            self.spec.loss_weight
        ]
        error = output - x0 if self.spec.prediction == "noise" else output * sigma_t + x0
        return {"loss": mean_flat(weight * error**2)}

    # -- sampling ------------------------------------------------------------------------------------------------

    def velocity_fn(self, model_fn: ModelFn) -> ode.VelocityFn:
        """The probability-flow ODE's right-hand side, one model call per evaluation."""
        return lambda x, t, y: self.velocity(self._prediction(model_fn, x, t, y), x, t)

    def data_estimate(self, x: Tensor, t: Tensor, velocity: Tensor) -> Tensor:
        """E[x_1 | x_t] from the velocity at (x, t (B,)): the data estimate a sampler's callback gets."""
        return self.path.data_from_velocity(velocity, x, _expand(t, x))

    def sample(
        self,
        model_fn: ModelFn,
        x_T: Tensor,
        labels: Tensor,
        *,
        sampler: str = TRANSPORT_SAMPLERS.default,
        steps: int | None = None,
        noise: PerSampleNoise | None = None,
        progress: bool = False,
        callback: StepCallback | None = None,
        **options,
    ) -> SampleResult:
        """Integrate from noise x_T (t = 0) to data. Samplers: "euler"/"heun" (fixed ODE steps, default 50, on a
        uniform grid or, with option time_shift s, LightningDiT's shifted one: `samplers.ode.shift_times`),
        adaptive torchdiffeq methods such as "dopri5" (options atol 1e-6, rtol 1e-3; no `steps`), and
        "sde-euler"/"sde-heun" (default 250 steps counting the last step; options diffusion_form "sigma",
        diffusion_norm 1.0, last_step "Mean" | "Tweedie" | "Euler" | None, last_step_size 0.04). How these step
        counts relate to official SiT's `num_steps`: docs/VCA.md, "Conventions". `callback` gets a
        samplers.interface.SamplerStep per step, its denoised the data estimate x_1."""
        check_sampler_request(sampler, options, TRANSPORT_SAMPLERS.options)
        if sampler in ADAPTIVE_METHODS:
            if steps is not None:
                raise SamplerOptionError(
                    f"sampler {sampler!r} chooses its own steps; pass atol/rtol instead of steps={steps}"
                )
        else:
            steps = TRANSPORT_SAMPLERS.steps[sampler] if steps is None else steps
            if steps < 1:
                raise SamplerOptionError(f"steps must be >= 1, got {steps}")
        velocity = self.velocity_fn(model_fn)
        with torch.no_grad():
            if sampler in ADAPTIVE_METHODS:
                t0, t1 = self.interval(self.sample_eps)
                return ode.adaptive(
                    velocity,
                    x_T,
                    labels,
                    t0=t0,
                    t1=t1,
                    method=sampler,
                    progress=progress,
                    callback=callback,
                    denoise=self.data_estimate,
                    atol=options.get("atol", DEFAULT_ATOL),
                    rtol=options.get("rtol", DEFAULT_RTOL),
                )
            if sampler in ("euler", "heun"):
                t0, t1 = self.interval(self.sample_eps)
                uniform = torch.linspace(t0, t1, steps + 1, dtype=torch.float64).tolist()
                t_steps = ode.shift_times(uniform, options.get("time_shift", DEFAULT_TIME_SHIFT))
                run = ode.euler if sampler == "euler" else ode.heun
                stepping = {"progress": progress, "callback": callback, "denoise": self.data_estimate}
                return run(velocity, x_T, labels, t_steps=t_steps, **stepping)
            return self._sample_sde(model_fn, x_T, labels, sampler, steps, noise, progress, callback, **options)

    def _sample_sde(
        self,
        model_fn: ModelFn,
        x_T: Tensor,
        labels: Tensor,
        sampler: str,
        steps: int,
        noise: PerSampleNoise | None,
        progress: bool,
        callback: StepCallback | None,
        **options,
    ) -> SampleResult:
        settings = {**DEFAULT_SDE, **options}
        form, norm = settings["diffusion_form"], float(settings["diffusion_norm"])
        last_step = settings["last_step"]
        last_step_size = float(settings["last_step_size"]) if last_step is not None else 0.0
        if form not in DIFFUSION_FORMS:
            raise SamplerOptionError(f"unknown diffusion_form {form!r}; expected one of {list(DIFFUSION_FORMS)}")
        if last_step not in LAST_STEPS:
            raise SamplerOptionError(f"unknown last_step {last_step!r}; expected one of {list(LAST_STEPS)}")
        if last_step is not None and not 0 < last_step_size < 1:
            raise SamplerOptionError(f"last_step_size must be in (0, 1), got {last_step_size}")
        t0, t1 = self.interval(self.sample_eps, sde_form=form, last_step_size=last_step_size)
        if form == "SBDM" and t0 == 0 and not isinstance(self.path, VPPath):
            raise SamplerOptionError(
                "diffusion_form 'SBDM' is infinite at t = 0 on the Linear/GVP paths; "
                "create the transport with sample_eps > 0 (e.g. 1e-3)"
            )

        def diffusion(t: float) -> float:  # the noise scale of a step, from the loop's own (host) time
            return float(self.path.sde_diffusion(torch.tensor(t, dtype=torch.float64), form, norm))

        def drift(x: Tensor, t: Tensor, y: Tensor) -> Tensor:
            output = self._prediction(model_fn, x, t, y)
            w = self.path.sde_diffusion(_expand(t, x).double(), form, norm).to(x.dtype)  # (B, 1, ..., 1)
            return self.velocity(output, x, t) + w * self.score(output, x, t)

        def denoise(x: Tensor, t: Tensor, f: Tensor) -> Tensor:  # the data estimate from a drift f at (x, t)
            w = self.path.sde_diffusion(_expand(t, x).double(), form, norm).to(x.dtype)  # (B, 1, ..., 1)
            return self.data_estimate(x, t, self.path.velocity_from_drift(f, x, _expand(t, x), w))

        final = self._last_step_fn(model_fn, drift, denoise, last_step, last_step_size)
        # `steps` counts every model step, the last one included (SiT's convention: 250 = 249 SDE steps + 1).
        intervals = steps - 1 if final is not None else steps
        if intervals < 1:
            raise SamplerOptionError(f"steps must be >= 2 with a last step, got {steps}")
        t_steps = torch.linspace(t0, t1, intervals + 1, dtype=torch.float64).tolist()
        run = sde.euler_maruyama if sampler == "sde-euler" else sde.heun
        return run(
            drift, diffusion, x_T, labels, t_steps=t_steps, last_step=final, noise=noise, progress=progress,
            callback=callback, denoise=denoise,
        )  # fmt: skip

    def _last_step_fn(
        self, model_fn: ModelFn, drift: sde.DriftFn, denoise: DenoiseFn, last_step: str | None, size: float
    ) -> sde.LastStepFn | None:
        """The noise-free final step from t1 to 1, with the data estimate at its start (`denoise` of a drift):
        "Mean" (an Euler step of the SDE drift), "Euler" (of the ODE velocity) or "Tweedie" (the denoised estimate
        E[x_1 | x_t] = (x + sigma^2 score) / alpha, which is also its data estimate)."""
        if last_step is None:
            return None
        if last_step == "Mean":

            def mean(x: Tensor, t: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
                f = drift(x, t, y)
                return x + size * f, denoise(x, t, f)

            return mean
        if last_step == "Euler":

            def euler(x: Tensor, t: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
                v = self.velocity_fn(model_fn)(x, t, y)
                return x + size * v, self.data_estimate(x, t, v)

            return euler

        def tweedie(x: Tensor, t: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
            t_ = _expand(t, x)
            score = self.score(self._prediction(model_fn, x, t, y), x, t)
            estimate = (x + self.path.sigma(t_)[0] ** 2 * score) / self.path.alpha(t_)[0]
            return estimate, estimate

        return tweedie

    def log_likelihood(
        self,
        model_fn: ModelFn,
        x1: Tensor,
        labels: Tensor,
        *,
        method: str = "dopri5",
        atol: float = DEFAULT_ATOL,
        rtol: float = DEFAULT_RTOL,
        divergence: str = "hutchinson",
        noise: PerSampleNoise | None = None,
        progress: bool = False,
    ) -> ode.LogLikelihood:
        """log p(x1) in nats per sample under the probability-flow ODE (prior N(0, I) at the interval start);
        divide by x1[0].numel() for nats per dimension. The interval is the sampling one, integrated backwards
        (on VP it differs from official SiT's by sample_eps: docs/VCA.md, "Conventions")."""
        t0, t1 = self.interval(self.sample_eps)
        return ode.log_likelihood(
            self.velocity_fn(model_fn),
            x1,
            labels,
            t0=t0,
            t1=t1,
            method=method,
            atol=atol,
            rtol=rtol,
            divergence=divergence,
            noise=noise,
            progress=progress,
        )


def create_transport(**settings: Any) -> Transport:
    """`Transport(TransportSpec(**settings))`, e.g. `create_transport(path="vp", prediction="noise")`: SiT's transport
    with its default epsilons (see Transport)."""
    return Transport(TransportSpec(**settings))
