"""SiT with Visual-Contrast Attention: the shared backbone and the interpolant (transport) objective."""

from .models import create_model
from .transport import Transport, create_transport
