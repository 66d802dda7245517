"""The objectives as one table of plain data: the objective each model family trains with, the settings a config
chooses for it (their choices, and the official DiT's and SiT's values as defaults), and the samplers it offers
(their options, their default step counts, and the defaults of the SDE and adaptive solvers' options).

Every module that names an objective, one of its settings or a sampler reads it here: the objectives
(dit_vca.diffusion, sit_vca.transport) and the samplers (samplers.ode, samplers.multistep) dispatch on these names,
dit_vca.models takes a family's output default, training's config schema and `train.py --help` offer the choices,
and sample.py checks --sampler against a checkpoint's objective and lists every sampler in `--help`. Nothing here
imports torch (nor any project module), so that the commands' help and argument checks answer at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# --------------------------------------------------------------------------------------------------
#                                  The objectives and their settings
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectiveKind:
    """One objective: its name in an export's description (`objective["kind"]`), the model family that trains with
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
