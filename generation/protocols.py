"""Evaluation protocols: the sampling settings behind published FID numbers, as one `sample.py --protocol` name.

Each preset writes down what the official evaluation scripts used for their 50K-sample FID: DiT's and SiT's
`sample_ddp.py` (labels drawn uniformly at random, classifier-free guidance applied to the first 3 of the 4
latent channels only, a quirk of the released code that the published numbers depend on, at scale 1.5, and the
sampler) and LightningDiT's `inference.py` with its reproduction configs (hustvl/LightningDiT at 2725fed,
configs/reproductions/*.yaml): uniform labels, guidance on the first 3 of its 32 channels (the same quirk, kept
in its `forward_with_cfg`) only from t = cfg_interval_start to the data end, Euler on 250 grid points (249 steps)
shifted by its timestep_shift 0.3. Settings a user gives explicitly win over the preset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OFFICIAL_GUIDANCE = {"labels": "uniform", "cfg_scale": 1.5, "guidance_channels": 3}
# LightningDiT's sampling (its configs' sample section): ODE Euler, num_sampling_steps 250 grid points (our --steps
# counts intervals), timestep_shift 0.3; guidance on 3 channels for t >= cfg_interval_start (t = 1 is the data).
LIGHTNING_SAMPLING = {"labels": "uniform", "guidance_channels": 3, "sampler": "euler", "steps": 249, "time_shift": 0.3}


@dataclass(frozen=True)
class Protocol:
    """A named preset: the model family it applies to, its settings (sample.py argument names), and the
    numbers it reproduces on ImageNet 256 with the official checkpoint."""

    family: str  # "DiT" or "SiT" (objectives.MODEL_FAMILIES)
    settings: dict[str, Any] = field(default_factory=dict)
    published: str = ""


PROTOCOLS: dict[str, Protocol] = {
    "dit": Protocol(
        "DiT",
        {**OFFICIAL_GUIDANCE, "sampler": "ddpm", "steps": 250},
        "DiT-XL/2 256: FID 2.27 (cfg 1.5), 9.62 with --cfg-scale 1",
    ),
    "sit": Protocol(
        "SiT",
        {
            **OFFICIAL_GUIDANCE,
            "sampler": "sde-euler",
            "steps": 250,
            "diffusion_form": "sigma",
            "diffusion_norm": 1.0,
            "last_step": "Mean",
            "last_step_size": 0.04,
        },
        "SiT-XL/2 256: FID 2.06 (SDE Euler-Maruyama, cfg 1.5)",
    ),
    "sit-ode": Protocol(
        "SiT",
        {**OFFICIAL_GUIDANCE, "sampler": "dopri5", "atol": 1e-6, "rtol": 1e-3},
        "SiT-XL/2 256: FID 2.15 (ODE dopri5, cfg 1.5)",
    ),
    "lightningdit": Protocol(
        "SiT",
        {**LIGHTNING_SAMPLING, "cfg_scale": 6.7, "guidance_interval": [0.125, 1.0]},
        "LightningDiT-XL/1 800 epochs on VA-VAE f16d32: FID 1.35 (Euler 250 points shifted 0.3, cfg 6.7 from "
        "t = 0.125)",
    ),
    "lightningdit-64ep": Protocol(
        "SiT",
        {**LIGHTNING_SAMPLING, "cfg_scale": 10.0, "guidance_interval": [0.1, 1.0]},
        "LightningDiT-XL/1 64 epochs: FID 2.11 (the same with cfg 10 from t = 0.1)",
    ),
}
