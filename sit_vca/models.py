"""SiT models: the DiT backbone of `dit_vca.models` under SiT names, predicting velocity by default."""

from dit_vca.models import DiT, create_backbone


def create_model(name: str, *args, **kwargs) -> DiT:
    """Build a "SiT-{S,B,L,XL}/{2,4,8}" model (learn_sigma defaults to False; the released official SiT
    checkpoint needs learn_sigma=True, see docs/VCA.md); arguments as `dit_vca.models.create_backbone`."""
    return create_backbone("SiT", name, *args, **kwargs)
