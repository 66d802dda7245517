"""ADM's centre crop, so that a folder of raw images of mixed sizes (ImageNet-style) can be scored."""

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
