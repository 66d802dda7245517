"""SiT with Visual-Contrast Attention: the shared backbone and the interpolant (transport) objective.

The names below are imported from their modules on first use (PEP 562, as in `dit_vca`), so that importing the
light module of the package (`sit_vca.transport_options`, which training's config schema and `train.py --help`
read) does not import torch first. A submodule is reached as an attribute too (`sit_vca.transport`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sit_vca.models import create_model
    from sit_vca.transport import Transport, create_transport

_HOMES = {"create_model": "sit_vca.models", "Transport": "sit_vca.transport", "create_transport": "sit_vca.transport"}

__all__ = ["Transport", "create_model", "create_transport"]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":  # the submodule exists but needs a missing package
            raise
        raise AttributeError(f"module 'sit_vca' has no attribute {name!r}") from None
