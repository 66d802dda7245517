"""How samples are integrated: DDPM/DDIM over a respaced diffusion, ODE and SDE solvers for interpolants,
classifier-free guidance and per-sample noise. Every sampler takes a model function, x_T, labels and options
and returns a SampleResult(samples, nfe)."""

from .guidance import classifier_free_guidance
from .interface import ModelFn, SampleResult
from .noise import PerSampleNoise

__all__ = ["ModelFn", "PerSampleNoise", "SampleResult", "classifier_free_guidance"]
