"""What `python -m fid` can read: image .npz batches, image folders and statistics .npz files.

Everything is validated from file headers before any feature is computed, and images are
streamed batch by batch: 50 000 samples at 512x512 are 39 GB, more than a machine's memory.
"""

import os
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from .statistics import Gaussian, StatisticsFile, load_statistics

IMAGE_KEY = "arr_0"  # the ADM / DiT sample-file convention
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")


class NpzImages:
    """uint8 (N, H, W, 3) images stored as `arr_0` of an .npz, read a batch at a time.

    numpy's np.load materialises a whole member, so we parse the .npy header ourselves and
    read the raw bytes of each batch from the (possibly compressed) zip member.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with zipfile.ZipFile(self.path) as archive, archive.open(f"{IMAGE_KEY}.npy") as member:
            shape, fortran_order, dtype = _read_npy_header(member, self.path)
        if dtype != np.uint8:
            raise ValueError(f"{self.path}: '{IMAGE_KEY}' has dtype {dtype}; expected uint8 images (N, H, W, 3)")
        if len(shape) != 4 or shape[-1] != 3:
            raise ValueError(f"{self.path}: '{IMAGE_KEY}' has shape {shape}; expected RGB images (N, H, W, 3)")
        if fortran_order:
            raise ValueError(f"{self.path}: '{IMAGE_KEY}' is stored in Fortran order; save it C-ordered")
        self.shape: tuple[int, int, int, int] = shape

    def __len__(self) -> int:
        return self.shape[0]

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        """Yield (B, H, W, 3) uint8 arrays in file order."""
        image_bytes = int(np.prod(self.shape[1:]))
        with zipfile.ZipFile(self.path) as archive, archive.open(f"{IMAGE_KEY}.npy") as member:
            _read_npy_header(member, self.path)
            for start in range(0, len(self), batch_size):
                count = min(batch_size, len(self) - start)
                raw = bytearray(member.read(count * image_bytes))  # writable, so torch can wrap it without a copy
                if len(raw) != count * image_bytes:
                    raise ValueError(f"{self.path}: '{IMAGE_KEY}' is truncated at image {start}")
                yield np.frombuffer(raw, dtype=np.uint8).reshape(count, *self.shape[1:])


def _read_npy_header(member, path: Path) -> tuple[tuple[int, ...], bool, np.dtype]:
    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(member)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(member)
    raise ValueError(f"{path}: unsupported .npy format version {version} for '{IMAGE_KEY}'")


class FolderImages:
    """Image files of one size under a folder (recursively), in sorted path order, as RGB."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.files = sorted(p for p in self.path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        if not self.files:
            raise ValueError(f"{self.path}: no image files ({', '.join(IMAGE_SUFFIXES)}) in this folder")
        self.size = _image_size(self.files[0])  # (W, H)
        for path in self.files[1:]:  # headers only: cheap, and a mismatch fails before any feature is computed
            if _image_size(path) != self.size:
                raise ValueError(f"{path}: size {_image_size(path)} differs from {self.files[0]}'s {self.size}")

    def __len__(self) -> int:
        return len(self.files)

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        """Yield (B, H, W, 3) uint8 arrays in sorted path order."""
        for start in range(0, len(self), batch_size):
            yield np.stack([self._read(path) for path in self.files[start : start + batch_size]])

    @staticmethod
    def _read(path: Path) -> np.ndarray:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"))  # (H, W, 3)


def _image_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as image:
        return image.size


ImageSource = NpzImages | FolderImages


@dataclass
class EvaluationInput:
    """One SAMPLES or REF argument: its images, its stored statistics, or (ADM reference batches) both."""

    path: Path
    images: ImageSource | None
    stats: StatisticsFile

    def stored(self, key: str) -> Gaussian | None:
        """Stored statistics "pool" or "spatial", if the file has them."""
        return getattr(self.stats, key)


def open_input(path: str | os.PathLike) -> EvaluationInput:
    """Open an image folder or an .npz holding images (`arr_0`), statistics (`mu`, `sigma`, ...) or both."""
    path = Path(path)
    if path.is_dir():
        return EvaluationInput(path, FolderImages(path), StatisticsFile())
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not an .npz archive nor a folder of images")
    with zipfile.ZipFile(path) as archive:
        keys = sorted(name.removesuffix(".npy") for name in archive.namelist())
    images = NpzImages(path) if IMAGE_KEY in keys else None
    stats = load_statistics(path)
    if images is None and stats.pool is None and stats.spatial is None:
        raise ValueError(f"{path}: holds {keys}; expected images '{IMAGE_KEY}' and/or statistics 'mu', 'sigma'")
    return EvaluationInput(path, images, stats)
