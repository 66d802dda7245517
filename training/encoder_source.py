"""Which alignment encoder `train.repa.encoder` names, named so that the name travels (training.repa loads it).

The setting takes a timm model name, or a folder written by timm's `save_for_hf` (or the model.safetensors in it)
relative to the working directory. A config records a folder by the timm name it is a copy of, where its
config.json shows one, else by its absolute path, and keeps the folder's absolute path as a hint
(`train.repa.path`) that is loaded first where it exists and holds the same encoder (generation.portable). So
`train.py --resume <run>` finds the encoder from any working directory, and a resume compares encoders, not the
spellings of a path.

save_for_hf keeps no record of where the weights came from (it drops the pretrained config's hf_hub_id), but it
records the architecture, the pretrained tag and the construction arguments. A folder whose arguments are those
`timm.create_model("<architecture>.<tag>")` records is a copy of that model: what the recipe
`save_for_hf(timm.create_model(name, pretrained=True), folder)` writes. A folder built with other arguments
(another size, patch or channel count, as studies/digits_encoder, whose config.json still carries the default tag of
vit_tiny_patch16_224) is not, and is named by its absolute path. The weights themselves are trusted, as the VAE's
recorded hub id is.
"""

from __future__ import annotations

import json
from pathlib import Path

from generation.portable import PortableSource, local_copy, portable_source

ENCODER_CONFIG, ENCODER_WEIGHTS = "config.json", "model.safetensors"  # timm's save_for_hf layout


def encoder_source(spec: str, hint: str | None = None) -> PortableSource:
    """The portable name of the encoder `spec` names (a timm name, a save_for_hf folder or its weights file),
    with the folder's absolute path as the hint; see the module docstring."""
    return portable_source(folder_spec(spec), hint, recorded_timm_name)


def encoder_copy(spec: str, hint: str | None) -> str:
    """What to load for the recorded name `spec`: the `hint` folder where it exists and holds that encoder, else
    `spec` itself (a folder, or a timm name for timm to find in the Hugging Face cache or on the hub)."""
    return local_copy(spec, hint, recorded_timm_name)


def recorded_timm_name(folder: Path) -> str | None:
    """The timm name ("<architecture>.<tag>") the save_for_hf folder is a copy of, or None: its config.json must
    record the arguments timm records for that name built as it is (the model is built on the meta device: no
    weights are made or read). A folder that cannot be read has no name (loading it says what is wrong)."""
    try:
        description = json.loads((folder / ENCODER_CONFIG).read_text())
        name = ".".join(filter(None, (description["architecture"], description["pretrained_cfg"].get("tag"))))
        arguments = description.get("model_args", {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return name if _default_arguments(name) == arguments else None


def _default_arguments(name: str) -> dict | None:
    """The construction arguments save_for_hf records for `timm.create_model(name)`, as JSON values; None for a
    name timm does not build."""
    import timm
    import torch
    from timm.models import get_model_args

    if not timm.is_model(name):
        return None
    try:
        with torch.device("meta"):
            model = timm.create_model(name)
    except (RuntimeError, ValueError, TypeError, NotImplementedError):  # an unknown tag, a model meta cannot build
        return None
    return json.loads(json.dumps(get_model_args(model)))


def folder_spec(spec: str) -> str:
    """`spec` with a weights file name taken off where it names one in a folder (the folder and its .safetensors
    name one encoder), else `spec`."""
    path = Path(spec).expanduser()
    return str(path.parent) if path.suffix == ".safetensors" and path.parent.is_dir() else spec
