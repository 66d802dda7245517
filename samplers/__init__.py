"""How samples are integrated: DDPM/DDIM over a respaced diffusion, ODE and SDE solvers for interpolants,
guidance (classifier-free, autoguidance) and per-sample noise. Every sampler takes a model function, x_T, labels
and options and returns a SampleResult(samples, nfe).

The names below are imported from their modules on first use (PEP 562, as in `generation`), so that the table
of samplers (`samplers.catalogue`, which `sample.py --help` lists) is read without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from samplers.guidance import autoguidance, classifier_free_guidance
    from samplers.interface import ModelFn, SampleResult
    from samplers.noise import PerSampleNoise

_HOMES = {
    "autoguidance": "samplers.guidance",
    "classifier_free_guidance": "samplers.guidance",
    "ModelFn": "samplers.interface",
    "SampleResult": "samplers.interface",
    "PerSampleNoise": "samplers.noise",
}

__all__ = ["ModelFn", "PerSampleNoise", "SampleResult", "autoguidance", "classifier_free_guidance"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'samplers' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
