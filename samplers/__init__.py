"""How samples are integrated: DDPM/DDIM over a respaced diffusion, ODE and SDE solvers for interpolants,
guidance (classifier-free, autoguidance) and per-sample noise. Every sampler takes a model function, x_T, labels
and options and returns a SampleResult(samples, nfe)."""

from .guidance import autoguidance, classifier_free_guidance
from .interface import ModelFn, SampleResult
from .noise import PerSampleNoise

__all__ = ["ModelFn", "PerSampleNoise", "SampleResult", "autoguidance", "classifier_free_guidance"]
