"""DiT with Visual-Contrast Attention: backbone, attention and DDPM objective. The method: docs/VCA.md.

The names below are imported from their modules on first use (PEP 562, as in `generation`), so that importing a
light module of the package (`dit_vca.model_spec`, which training's config schema and `train.py --help` read)
does not import torch first. A submodule is reached as an attribute too (`dit_vca.models`), as when the package
imported it eagerly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dit_vca.attention import MultiHeadSelfAttention, VisualContrastAttention
    from dit_vca.diffusion import GaussianDiffusion, create_diffusion
    from dit_vca.model_spec import ModelSpec
    from dit_vca.models import DiT, create_model

_HOMES = {
    "MultiHeadSelfAttention": "dit_vca.attention",
    "VisualContrastAttention": "dit_vca.attention",
    "GaussianDiffusion": "dit_vca.diffusion",
    "create_diffusion": "dit_vca.diffusion",
    "DiT": "dit_vca.models",
    "ModelSpec": "dit_vca.model_spec",
    "create_model": "dit_vca.models",
}

__all__ = [
    "DiT",
    "GaussianDiffusion",
    "MultiHeadSelfAttention",
    "ModelSpec",
    "VisualContrastAttention",
    "create_diffusion",
    "create_model",
]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":  # the submodule exists but needs a missing package
            raise
        raise AttributeError(f"module 'dit_vca' has no attribute {name!r}") from None
