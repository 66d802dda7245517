"""SiT with Visual-Contrast Attention: the shared backbone and the interpolant (transport) objective."""

from .models import create_model
from .transport import Transport, create_transport

__all__ = ["Transport", "create_model", "create_transport"]
