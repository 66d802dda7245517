"""Two-dimensional rotary position embedding (RoPE) of queries and keys on a square token grid.

The 2-D form LightningDiT uses (after EVA-02): each head's d channels are split in two halves, the first encoding
the token's row and the second its column; within a half, channel pair (2m, 2m+1) is rotated by the angle
position · ω_m with ω_m = θ^(−m / (d/4)), m = 0 … d/4 − 1, θ = 10 000. A rotation by an angle that is linear in
the position makes q_a · k_b depend on the positions a and b only through a − b (tested), so attention sees
relative offsets. Written here rather than taken from a library because timm's and diffusers' 2-D RoPE order the
channels differently from LightningDiT, whose checkpoints must load unchanged (docs/models.md).
A module of its own because both token mixers use it: MHSA rotates its queries and keys, VCA its queries and keys and
its contrast tokens, each placed at the centre of the cell of tokens it pools (docs/VCA.md).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

ROPE_THETA = 10_000.0  # base of the rotation frequencies (LightningDiT, EVA-02, the 1-D RoPE of RoFormer)


def rope_angles(rows: Tensor, cols: Tensor, head_dim: int) -> Tensor:
    """Rotation angles (P, d/2) of tokens at (rows, cols) (P,) each (any real positions): the first d/4 channel
    pairs turn with the row, the last d/4 with the column. Computed in float64."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs a head dimension divisible by 4 (two axes of channel pairs), got {head_dim}")
    quarter = head_dim // 4
    omega = ROPE_THETA ** (-torch.arange(quarter, dtype=torch.float64, device=rows.device) / quarter)  # (d/4,)
    return torch.cat([rows.double()[:, None] * omega, cols.double()[:, None] * omega], dim=1)  # (P, d/2)


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (2m, 2m+1) of x (..., P, d) by the angles whose cosines and sines are (P, d/2);
    computed in float32 (or float64) and returned in x's dtype."""
    dtype = torch.promote_types(x.dtype, cos.dtype)
    first, second = x.to(dtype).unflatten(-1, (-1, 2)).unbind(-1)  # (..., P, d/2) each
    rotated = torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1)  # (..., P, d/2, 2)
    return rotated.flatten(-2).to(x.dtype)  # (..., P, d)


def grid_positions(grid_size: int, cell: int = 1) -> tuple[Tensor, Tensor]:
    """Row and column positions (P,) each, row-major, float64: of the tokens of a grid_size × grid_size grid
    (cell=1: token i at (i // G, i % G)), or of the centres of its cell × cell cells (P = (G / cell)²): cell (a, b)
    covers rows a·cell … a·cell + cell − 1, so its centre lies at a·cell + (cell − 1)/2, a half-integer for even
    cells. Positions are in token units either way, so RoPE compares tokens and cell centres on one scale."""
    if cell < 1 or grid_size % cell:
        raise ValueError(f"cells of {cell}x{cell} tokens do not tile a {grid_size}x{grid_size} grid")
    centres = torch.arange(grid_size // cell, dtype=torch.float64) * cell + (cell - 1) / 2  # (G / cell,)
    rows, cols = torch.meshgrid(centres, centres, indexing="ij")
    return rows.flatten(), cols.flatten()


class RotaryEmbedding2d(nn.Module):
    """RoPE for the tokens of a grid_size × grid_size grid laid out row-major: `rope(x)` rotates x (B, h, N, d);
    with `cell` > 1, for the centres of its cell × cell cells instead (grid_positions), x (B, h, (G / cell)², d).

    The cosines and sines are non-persistent buffers: derived from the shape, they are in no state dict or export.
    """

    def __init__(self, head_dim: int, grid_size: int, cell: int = 1):
        super().__init__()
        angles = rope_angles(*grid_positions(grid_size, cell), head_dim)  # (P, d/2), row-major positions
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return rotate_pairs(x, self.cos, self.sin)  # (B, h, P, d)
