"""DiT with Visual-Contrast Attention: backbone, attention and DDPM objective. The method: docs/VCA.md."""

from .attention import MultiHeadSelfAttention, VisualContrastAttention
from .models import DiT, build_model_from_config, create_model
from .diffusion import GaussianDiffusion, create_diffusion

__all__ = ["DiT", "GaussianDiffusion", "MultiHeadSelfAttention", "VisualContrastAttention", "build_model_from_config",
           "create_diffusion", "create_model"]
