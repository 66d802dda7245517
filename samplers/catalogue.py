"""Which samplers each objective offers: their names, the options each takes, their default step counts and the
objective's default sampler. The objectives (dit_vca.diffusion, sit_vca.transport) dispatch on these tables and
`sample.py --help` lists them; plain data without torch, so that the help answers at once."""

from __future__ import annotations

from dataclasses import dataclass

ADAPTIVE_METHODS = ("dopri5", "dopri8", "bosh3", "fehlberg2", "adaptive_heun")  # torchdiffeq's, with atol/rtol
DEFAULT_ATOL, DEFAULT_RTOL = 1e-6, 1e-3  # SiT's tolerances of the adaptive solvers (sampling and likelihood)
MULTISTEP_SOLVERS = ("dpm++2m", "unipc")  # diffusers' multistep schedulers on DiT's process (samplers.multistep)
SDE_OPTIONS = ("diffusion_form", "diffusion_norm", "last_step", "last_step_size")


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
        "euler": (),
        "heun": (),
        **{method: ("atol", "rtol") for method in ADAPTIVE_METHODS},
        "sde-euler": SDE_OPTIONS,
        "sde-heun": SDE_OPTIONS,
    },
    steps={"euler": 50, "heun": 50, **{method: None for method in ADAPTIVE_METHODS}, "sde-euler": 250, "sde-heun": 250},
)
SAMPLERS = {"diffusion": DIFFUSION_SAMPLERS, "transport": TRANSPORT_SAMPLERS}  # by export objective kind
