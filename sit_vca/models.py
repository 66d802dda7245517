"""SiT models: the DiT backbone of `dit_vca.models` under SiT names, predicting velocity by default."""

from typing import Any

from dit_vca.model_spec import ModelSpec
from dit_vca.models import DiT, create_backbone


def create_model(name: str, **settings: Any) -> DiT:
    """A SiT: `DiT(ModelSpec(name, **settings))` for a "SiT-{S,B,L,XL}/{1,2,4,8}" name (learn_sigma defaults to
    False; the released official SiT checkpoint needs learn_sigma=True, see docs/VCA.md)."""
    return create_backbone("SiT", ModelSpec(name, **settings))
