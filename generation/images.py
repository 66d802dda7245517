"""Turning model outputs into pictures: uint8 conversion (DiT's rounding) and PNG grids."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.utils import make_grid

from atomic_files import atomic_output

MIN_TILE_PIXELS = 64  # tiles smaller than this (8x8 digits) are enlarged with nearest-neighbour


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, C, H, W) in [-1, 1] -> (B, H, W, 3) uint8 as clamp(127.5 x + 128) truncated (DiT's convention);
    one-channel images are repeated to three channels."""
    if not torch.isfinite(images).all():
        raise FloatingPointError("images contain NaN or infinite values")
    if images.shape[1] not in (1, 3):
        raise ValueError(f"expected images with 1 or 3 channels, got shape {tuple(images.shape)}")
    images = images.expand(-1, 3, -1, -1)  # (B, 3, H, W)
    pixels = torch.clamp(127.5 * images.float() + 128.0, 0, 255).to(torch.uint8)  # truncation
    return pixels.permute(0, 2, 3, 1).cpu().numpy()  # (B, H, W, 3)


def _enlargement(side: int) -> int:
    """How many times `save_grid` enlarges a tile of `side` pixels."""
    return max(1, math.ceil(MIN_TILE_PIXELS / side))


def grid_bytes(count: int, side: int) -> int:
    """The most bytes `save_grid` is expected to write for `count` images of side x side pixels, for a disk space
    estimate. Measured on noise (the least compressible content): the PNG takes 2.6x the tiles' own bytes for 8 px
    tiles (enlarged 8x: the copies compress to little but not nothing), 1.6x at 16 px (4x), 1.3x at 32 px (2x) and
    1.02x at 64 and 256 px (not enlarged); 1 + enlargement / 4 times the tiles' bytes, and 1 KiB of headers, is
    above each."""
    return int(count * side * side * 3 * (1 + _enlargement(side) / 4)) + 1024 if count else 0


def save_grid(images: np.ndarray, path: str | Path) -> None:
    """Write (n, H, W, 3) uint8 images as a near-square PNG grid, atomically."""
    path = Path(path)
    tiles = torch.from_numpy(images).permute(0, 3, 1, 2)  # (n, 3, H, W)
    factor = _enlargement(tiles.shape[-1])
    tiles = tiles.repeat_interleave(factor, dim=2).repeat_interleave(factor, dim=3)
    grid = make_grid(tiles, nrow=math.ceil(math.sqrt(len(tiles))), padding=2, pad_value=255)
    with atomic_output(path) as temporary:
        Image.fromarray(grid.permute(1, 2, 0).numpy()).save(temporary, format="PNG")
