"""The objective an export names, built from its spec: DiT's DDPM (`dit_vca.diffusion`) or SiT's transport
(`sit_vca.transport`) from `objectives.DiffusionSpec` or `objectives.TransportSpec`. The top-level `objectives`
holds the specs and the table of objectives and samplers as plain data; this module makes the torch objects."""

from __future__ import annotations

from dataclasses import asdict

from dit_vca import GaussianDiffusion, create_diffusion
from objectives import MODEL_FAMILIES, OBJECTIVE_SPECS, ObjectiveSpec, TransportSpec
from sit_vca import Transport

Objective = GaussianDiffusion | Transport


def create_objective(spec: ObjectiveSpec) -> Objective:
    """The training loss and samplers of `spec`: the transport, or DDPM's process of all 1000 steps."""
    if isinstance(spec, TransportSpec):
        return Transport(spec)
    return create_diffusion(**asdict(spec))


def default_objective(family: str) -> ObjectiveSpec:
    """The objective of a model family with the spec's defaults (what the official checkpoints used)."""
    return OBJECTIVE_SPECS[MODEL_FAMILIES[family].kind]()
