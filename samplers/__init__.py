"""How samples are integrated: DDPM/DDIM over a respaced diffusion, ODE and SDE solvers for interpolants,
guidance (classifier-free, autoguidance) and per-sample noise. Every sampler takes a model function, x_T, labels
and options and returns a SampleResult(samples, nfe); given a callback, it hands it a SamplerStep after every step.
Which samplers each objective offers, with their options and step counts, is the objectives table's (`objectives`,
torch-free, which `sample.py --help` lists).
"""

from samplers.guidance import autoguidance, classifier_free_guidance
from samplers.interface import ModelFn, SampleResult, SamplerStep, StepCallback
from samplers.noise import PerSampleNoise

__all__ = [
    "ModelFn",
    "PerSampleNoise",
    "SampleResult",
    "SamplerStep",
    "StepCallback",
    "autoguidance",
    "classifier_free_guidance",
]
