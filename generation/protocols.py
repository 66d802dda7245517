"""Evaluation protocols: the sampling settings behind published FID numbers, as one `sample.py --protocol` name.

Each preset writes down what the official evaluation scripts (DiT's and SiT's `sample_ddp.py`) used for their
50K-sample FID: labels drawn uniformly at random, classifier-free guidance applied to the first 3 of the 4
latent channels only (a quirk of the released code that the published numbers depend on), the guidance scale,
and the sampler with its settings. Settings a user gives explicitly win over the preset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OFFICIAL_GUIDANCE = {"labels": "uniform", "cfg_scale": 1.5, "guidance_channels": 3}


@dataclass(frozen=True)
class Protocol:
    """A named preset: the model family it applies to, its settings (sample.py argument names), and the
    numbers it reproduces on ImageNet 256 with the official XL/2 checkpoint."""

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
}
