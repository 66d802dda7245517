"""The objectives as one table of plain data: the objective each model family trains with, the settings a config
chooses for it (their choices, and the official DiT's and SiT's values as defaults), and the samplers it offers
(their options, their default step counts, and the defaults of the SDE and adaptive solvers' options).

Each objective's settings are written once, as its spec (`DiffusionSpec`, `TransportSpec`): the spec is the
config's section (diffusion.*, transport.*), the export's objective record (`objective_record`) and the one
argument the objective is built from (dit_vca.diffusion.GaussianDiffusion, sit_vca.transport.Transport).

Every module that names an objective, one of its settings or a sampler reads it here: the objectives
(dit_vca.diffusion, sit_vca.transport) and the samplers (samplers.ode, samplers.multistep) dispatch on these names,
dit_vca.models takes a family's output default, training's config schema and `train.py --help` offer the choices,
and sample.py checks --sampler against a checkpoint's objective and lists every sampler in `--help`. Nothing here
imports torch (nor any project module but `settings`), so that the commands' help and argument checks answer at once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from settings import choice, value_range

# --------------------------------------------------------------------------------------------------
#                                  The objectives and their settings
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectiveKind:
    """One objective: its name in an export's description (`objective.kind`), the model family that trains with
    it (the prefix of the model names, "DiT-XL/2"), and whether that family's network also predicts a variance by
    default (its output channels)."""

    kind: str
    family: str
    learn_sigma: bool


DIFFUSION = ObjectiveKind("diffusion", "DiT", learn_sigma=True)  # DDPM with a learned-range variance (hybrid loss)
TRANSPORT = ObjectiveKind("transport", "SiT", learn_sigma=False)  # interpolants: velocity (or score, noise) alone
OBJECTIVES = {objective.kind: objective for objective in (DIFFUSION, TRANSPORT)}  # by an export's objective kind
MODEL_FAMILIES = {objective.family: objective for objective in (DIFFUSION, TRANSPORT)}  # by model family, DiT first


@dataclass(frozen=True)
class Setting:
    """A setting of an objective: the value the official code uses, and every value it may take."""

    default: Any
    choices: tuple[Any, ...]


# DDPM (the config's diffusion.*; learn_sigma's default is DIFFUSION.learn_sigma)
DECODER_CDF = Setting("tanh", ("tanh", "exact"))  # normal CDF of the t = 0 decoder NLL: ADM's tanh form, or exact
# Interpolants (the config's transport.*)
PATH = Setting("linear", ("linear", "gvp", "vp"))  # the interpolant from noise to data
PREDICTION = Setting("velocity", ("velocity", "score", "noise"))  # what the network predicts
LOSS_WEIGHT = Setting(None, (None, "velocity", "likelihood"))  # of a score or noise model's loss; None: unweighted
TIME_DISTRIBUTION = Setting("uniform", ("uniform", "logit-normal"))  # of the training times, on the training interval


def _setting(setting: Setting) -> Any:
    """A spec's field of an objective's setting: its default and choices, from the table above."""
    return choice(setting.default, *setting.choices)


# --------------------------------------------------------------------------------------------------
#                          The objectives' specs: config sections and export records
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiffusionSpec:
    """DDPM objective of DiT models (used when model.name starts with "DiT-")."""

    kind: ClassVar[str] = DIFFUSION.kind

    learn_sigma: bool = DIFFUSION.learn_sigma  # learned-range variance + hybrid loss (DiT); False: plain eps-MSE
    decoder_cdf: str = _setting(DECODER_CDF)  # normal CDF of the t = 0 decoder NLL: official tanh form


@dataclass(frozen=True)
class TransportSpec:
    """Interpolant objective of SiT models (used when model.name starts with "SiT-")."""

    kind: ClassVar[str] = TRANSPORT.kind

    path: str = _setting(PATH)  # the interpolant from noise to data
    prediction: str = _setting(PREDICTION)  # what the network predicts
    loss_weight: str | None = _setting(LOSS_WEIGHT)  # score/noise prediction only
    train_eps: float | None = value_range(None, 0.0, 1.0)  # None: the path's default (sit_vca.transport)
    sample_eps: float | None = value_range(None, 0.0, 1.0)  # None: the path's default (sit_vca.transport)
    time_distribution: str = _setting(TIME_DISTRIBUTION)  # of training times: uniform or logit-normal
    logit_normal_location: float = value_range(0.0, -math.inf)  # m of t = sigmoid(m + s·N(0, 1)); t = 1 is data
    logit_normal_scale: float = value_range(1.0, 0.0, above=True)  # s of the same
    cosine_loss_weight: float = value_range(0.0, 0.0)  # weight of the direction loss 1 - cos(v, u) (LightningDiT: 1);
    # 0: off


ObjectiveSpec = DiffusionSpec | TransportSpec
OBJECTIVE_SPECS: dict[str, type[ObjectiveSpec]] = {spec.kind: spec for spec in (DiffusionSpec, TransportSpec)}


def objective_record(spec: ObjectiveSpec) -> dict[str, Any]:
    """The spec as an export records it (JSON): {"kind": "diffusion" | "transport", **its settings}."""
    return {"kind": spec.kind, **asdict(spec)}


def objective_from_record(record: dict[str, Any]) -> ObjectiveSpec:
    """The spec an export's record holds; a setting the record lacks (written before the setting existed, or an
    official checkpoint's, which names its kind alone) has the spec's default, which is what that model used."""
    settings = dict(record)
    kind = settings.pop("kind", None)
    if kind not in OBJECTIVE_SPECS:
        raise ValueError(f"objective kind must be one of {sorted(OBJECTIVE_SPECS)}, got {kind!r}")
    return OBJECTIVE_SPECS[kind](**settings)


# --------------------------------------------------------------------------------------------------
#                                        Their samplers
# --------------------------------------------------------------------------------------------------

ADAPTIVE_METHODS = ("dopri5", "dopri8", "bosh3", "fehlberg2", "adaptive_heun")  # torchdiffeq's, with atol/rtol
DEFAULT_ATOL, DEFAULT_RTOL = 1e-6, 1e-3  # SiT's tolerances of the adaptive solvers (sampling and likelihood)
MULTISTEP_SOLVERS = ("dpm++2m", "unipc")  # diffusers' multistep schedulers on DiT's process (samplers.multistep)
# SiT's SDE samplers: their options with SiT's defaults, and the choices of the named ones
DEFAULT_SDE = {"diffusion_form": "sigma", "diffusion_norm": 1.0, "last_step": "Mean", "last_step_size": 0.04}
SDE_OPTIONS = tuple(DEFAULT_SDE)
DIFFUSION_FORMS = ("constant", "SBDM", "sigma", "linear", "decreasing", "increasing-decreasing")
LAST_STEPS = ("Mean", "Tweedie", "Euler", None)
# The fixed-step ODE samplers' time shift (LightningDiT's timestep_shift): 1 leaves the grid uniform.
DEFAULT_TIME_SHIFT = 1.0


@dataclass(frozen=True)
class SamplerTable:
    """The samplers of one objective: name -> the options it takes, name -> its default step count (None: an
    adaptive solver, which chooses its own steps), and the sampler used when none is named."""

    objective: str  # whose samplers, as the help names them
    default: str
    options: dict[str, tuple[str, ...]]
    steps: dict[str, int | None]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.options)

    def describe(self) -> str:
        """Every sampler with its default step count: "ddpm 250 steps (default), ddim 50, ..." and then the adaptive
        solvers, "adaptive (atol 1e-06, rtol 0.001, no steps): dopri5 (default), ..."."""

        def named(name: str) -> str:
            return f"{name} (default)" if name == self.default else name

        fixed = [name for name in self.names if self.steps[name] is not None]
        adaptive = [named(name) for name in self.names if self.steps[name] is None]
        counted = [f"{named(name)} {self.steps[name]}{' steps' * (index == 0)}" for index, name in enumerate(fixed)]
        tolerances = f"atol {DEFAULT_ATOL:g}, rtol {DEFAULT_RTOL:g}, no steps"
        return ", ".join(counted) + (f"; adaptive ({tolerances}): {', '.join(adaptive)}" if adaptive else "")


DIFFUSION_SAMPLERS = SamplerTable(
    objective="DiT (DDPM)",
    default="ddpm",
    options={"ddpm": ("clip_denoised",), "ddim": ("clip_denoised", "eta"), **{name: () for name in MULTISTEP_SOLVERS}},
    steps={"ddpm": 250, "ddim": 50, **{name: 20 for name in MULTISTEP_SOLVERS}},
)
TRANSPORT_SAMPLERS = SamplerTable(
    objective="SiT (interpolants)",
    default="dopri5",
    options={
        "euler": ("time_shift",),
        "heun": ("time_shift",),
        **{method: ("atol", "rtol") for method in ADAPTIVE_METHODS},
        "sde-euler": SDE_OPTIONS,
        "sde-heun": SDE_OPTIONS,
    },
    steps={"euler": 50, "heun": 50, **{method: None for method in ADAPTIVE_METHODS}, "sde-euler": 250, "sde-heun": 250},
)
SAMPLERS = {DIFFUSION.kind: DIFFUSION_SAMPLERS, TRANSPORT.kind: TRANSPORT_SAMPLERS}  # by an export's objective kind
# Every option that some sampler takes, each once (the sample.py flags that are passed on to the sampler)
SAMPLER_OPTIONS = tuple(
    dict.fromkeys(option for table in SAMPLERS.values() for options in table.options.values() for option in options)
)
