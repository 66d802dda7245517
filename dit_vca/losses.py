"""Loss helpers shared by both objectives: the DDPM (`dit_vca.diffusion`) and the transport (`sit_vca.transport`)."""

from torch import Tensor


def mean_flat(x: Tensor) -> Tensor:
    """Mean over all non-batch dimensions: (B, ...) -> (B,)."""
    return x.mean(dim=tuple(range(1, x.ndim)))  # (B,)
