"""generation/images.py, a generated image's pixels: uint8 = floor(clamp(127.5 x + 128, 0, 255)) (DiT's rounding),
stored pixels mapped back to themselves, one channel repeated to RGB, non-finite values refused. The grids made of
them: tests/test_grids.py."""

import numpy as np
import pytest
import torch

from generation.images import to_uint8


def test_to_uint8_maps_stored_pixels_back_to_themselves():
    # A uint8 value k read as x = k / 127.5 - 1 must come back as k: float32 puts 127.5 x + 128 within
    # ~1e-5 of k + 0.5, far from the integers where truncation would change the result.
    k = torch.arange(256, dtype=torch.float32)
    x = (k / 127.5 - 1).view(1, 1, 16, 16)  # (1, 1, 16, 16)
    pixels = to_uint8(x)
    assert pixels.dtype == np.uint8 and pixels.shape == (1, 16, 16, 3)
    np.testing.assert_array_equal(pixels[0, :, :, 0].reshape(-1), np.arange(256))


def test_to_uint8_rounds_half_up_and_clamps():
    # Hand-computed with DiT's floor(127.5 x + 128): x = 0 is 127.5 away from both ends and rounds up
    # to 128 (ADM's truncation would give 127); values outside [-1, 1] clamp to 0 and 255.
    x = torch.tensor([-3.0, -1.0, -0.999, 0.0, 0.5, 0.999, 1.0, 7.0]).view(1, 1, 1, 8)
    expected = [0, 0, 0, 128, 191, 255, 255, 255]  # 0.5 -> 191.75 -> 191; 0.999 -> 255.37 -> 255
    np.testing.assert_array_equal(to_uint8(x)[0, 0, :, 0], expected)


def test_to_uint8_repeats_one_channel_and_keeps_rgb_order():
    gray = torch.linspace(-1, 1, 12).view(1, 1, 3, 4)
    rgb = torch.stack([torch.full((3, 4), -1.0), torch.zeros(3, 4), torch.ones(3, 4)])[None]  # (1, 3, 3, 4)
    gray_pixels, rgb_pixels = to_uint8(gray), to_uint8(rgb)
    assert gray_pixels.shape == (1, 3, 4, 3)
    np.testing.assert_array_equal(gray_pixels[..., 0], gray_pixels[..., 1])
    np.testing.assert_array_equal(gray_pixels[..., 0], gray_pixels[..., 2])
    np.testing.assert_array_equal(rgb_pixels[0, 0, 0], [0, 128, 255])


def test_to_uint8_rejects_non_finite_and_odd_channels():
    with pytest.raises(FloatingPointError, match="NaN"):
        to_uint8(torch.tensor([0.0, float("nan")]).view(1, 1, 1, 2))
    with pytest.raises(ValueError, match="1 or 3 channels"):
        to_uint8(torch.zeros(1, 4, 2, 2))
