"""ADM's centre crop, so that a folder of raw images of mixed sizes (ImageNet-style) can be scored, and the one
conversion of a decoded image to 8-bit RGB (shared by fid's image folders and training's)."""

import numpy as np
from PIL import Image


def center_crop_adm(image: Image.Image, size: int) -> np.ndarray:
    """guided-diffusion's `center_crop_arr`: halve with a box filter while the short side is at least
    twice `size`, resize bicubically so that the short side is `size`, then cut out the centre.

    Returns uint8 (size, size, C) pixels of the image's mode (convert to RGB first for 3 channels).
    """
    while min(image.size) >= 2 * size:
        image = image.resize(tuple(side // 2 for side in image.size), resample=Image.BOX)
    scale = size / min(image.size)
    image = image.resize(tuple(round(side * scale) for side in image.size), resample=Image.BICUBIC)
    pixels = np.asarray(image)  # (H', W', C), min(H', W') == size
    top, left = (pixels.shape[0] - size) // 2, (pixels.shape[1] - size) // 2
    return pixels[top : top + size, left : left + size]


# What PIL raises for files that are not images, broken headers (SyntaxError from verify), cut data, and a file
# declaring more than twice Image.MAX_IMAGE_PIXELS pixels (a decompression bomb, refused before it is decoded).
DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # how Pillow opens 16-bit greyscale PNG and TIFF
SIXTEEN_BIT_TO_EIGHT = 257  # 65535 / 255: maps 0..65535 onto 0..255 exactly at both ends


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` as 8-bit RGB. A 16-bit greyscale image is scaled (value / 257, rounded), where Pillow's
    convert("RGB") clips every value above 255 to white; every other mode goes through convert("RGB")."""
    if image.mode not in SIXTEEN_BIT_MODES:
        return image.convert("RGB")
    values = np.asarray(image).astype(np.float64)  # (H, W); mode "I" holds int32, 16-bit files 0..65535
    grey = np.clip(np.rint(values / SIXTEEN_BIT_TO_EIGHT), 0, 255).astype(np.uint8)  # (H, W)
    return Image.fromarray(grey).convert("RGB")
