"""The objective an export names: DiT's DDPM (`dit_vca.diffusion`) or SiT's transport (`sit_vca.transport`)."""

from __future__ import annotations

from typing import Any

from dit_vca import GaussianDiffusion, create_diffusion
from objectives import DIFFUSION, MODEL_FAMILIES, TRANSPORT
from sit_vca import Transport, create_transport

Objective = GaussianDiffusion | Transport
_FACTORIES = {DIFFUSION.kind: create_diffusion, TRANSPORT.kind: create_transport}


def create_objective(spec: dict[str, Any]) -> Objective:
    """The training loss and samplers of `spec` = {"kind": "diffusion" | "transport", **factory arguments}."""
    arguments = dict(spec)
    kind = arguments.pop("kind", None)
    if kind not in _FACTORIES:
        raise ValueError(f"objective kind must be one of {sorted(_FACTORIES)}, got {kind!r}")
    return _FACTORIES[kind](**arguments)


def default_objective_spec(family: str) -> dict[str, Any]:
    """The objective of a model family with its factory's defaults (what the official checkpoints used)."""
    return {"kind": MODEL_FAMILIES[family].kind}
