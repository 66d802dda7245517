"""DiT with Visual-Contrast Attention: backbone, attention and DDPM objective. The method: docs/VCA.md."""

from .attention import MultiHeadSelfAttention, VisualContrastAttention
from .diffusion import GaussianDiffusion, create_diffusion
from .models import DiT, build_model_from_config, create_model

__all__ = [
    "DiT",
    "GaussianDiffusion",
    "MultiHeadSelfAttention",
    "VisualContrastAttention",
    "build_model_from_config",
    "create_diffusion",
    "create_model",
]
