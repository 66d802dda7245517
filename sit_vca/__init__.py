"""SiT with Visual-Contrast Attention: the shared backbone under SiT names and the interpolant (transport) objective.
What a config chooses about the objective (paths, predictions, loss weights, time distributions) is the objectives
table's (`objectives`, torch-free, which training's config schema and `train.py --help` read)."""

from sit_vca.models import create_model
from sit_vca.transport import Transport, create_transport

__all__ = ["Transport", "create_model", "create_transport"]
