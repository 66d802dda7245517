"""Generation: from a trained model to images.

Owns the export format (`ExportDescription`, `Export`: a folder of EMA weights and a JSON description, also on the
Hugging Face Hub), the conversion of official DiT/SiT checkpoints into exports, the VAE between pixels and
latents, and `ImageGenerator.generate`, the one path from labels and seeds to uint8 images. `sample.py`, training's
previews and the demo all go through it. It depends on the model packages and the samplers, never on training.

The names below are imported from their modules on first use (PEP 562), so that importing a light module of the
package (`generation.protocols`, `generation.sample_file`, which sample.py reads to parse its arguments) does not
import the models, the samplers and huggingface_hub first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from generation.export import Export, ExportDescription, ExportError, find_export, read_export, write_export
    from generation.export_sources import load_export, weights_file
    from generation.generator import ImageGenerator

_HOMES = {
    "Export": "generation.export",
    "ExportDescription": "generation.export",
    "ExportError": "generation.export",
    "find_export": "generation.export",
    "read_export": "generation.export",
    "write_export": "generation.export",
    "ImageGenerator": "generation.generator",
    "load_export": "generation.export_sources",
    "weights_file": "generation.export_sources",
}

__all__ = [
    "Export",
    "ExportDescription",
    "ExportError",
    "ImageGenerator",
    "find_export",
    "load_export",
    "read_export",
    "weights_file",
    "write_export",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'generation' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
