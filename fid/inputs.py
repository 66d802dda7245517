"""What `python -m fid` can read: image .npz batches, image folders and statistics .npz files.

Everything is validated from file headers before any feature is computed (image data is decoded up
front only for a JPEG whose end marker is missing), and images are streamed batch by batch: 50 000
samples at 512x512 are 39 GB, more than a machine's memory.
"""

import os
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from .errors import InputError
from .preprocess import DECODE_ERRORS, center_crop_adm, to_rgb
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
            raise InputError(f"{self.path}: '{IMAGE_KEY}' has dtype {dtype}; expected uint8 images (N, H, W, 3)")
        if len(shape) != 4 or shape[-1] != 3:
            raise InputError(f"{self.path}: '{IMAGE_KEY}' has shape {shape}; expected RGB images (N, H, W, 3)")
        if fortran_order:
            raise InputError(f"{self.path}: '{IMAGE_KEY}' is stored in Fortran order; save it C-ordered")
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
                    raise InputError(f"{self.path}: '{IMAGE_KEY}' is truncated at image {start}")
                yield np.frombuffer(raw, dtype=np.uint8).reshape(count, *self.shape[1:])


def _read_npy_header(member, path: Path) -> tuple[tuple[int, ...], bool, np.dtype]:
    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(member)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(member)
    raise InputError(f"{path}: unsupported .npy format version {version} for '{IMAGE_KEY}'")


class FolderImages:
    """Image files under a folder (recursively), in sorted path order, as RGB.

    All files must have one size, unless `center_crop` names the side that ADM's centre crop brings
    every image to. Every file's header is read (and checked by PIL's verify) here, before any feature
    is computed; a file that cannot be read is an error naming it, or with `skip_corrupt` is left out
    with a warning (also when its data turns out to be cut only at decode time).
    """

    def __init__(self, path: str | os.PathLike, center_crop: int | None = None, skip_corrupt: bool = False):
        self.path = Path(path)
        self.center_crop = center_crop
        self.skip_corrupt = skip_corrupt
        candidates = sorted(p for p in self.path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        if not candidates:
            raise InputError(f"{self.path}: no image files ({', '.join(IMAGE_SUFFIXES)}) in this folder")
        sizes: dict[Path, tuple[int, int]] = {}
        for file in candidates:
            try:
                sizes[file] = _checked_size(file)
            except _UnreadableImage as error:
                self._unreadable(file, error)
        self.files = list(sizes)
        if not self.files:
            raise InputError(f"{self.path}: none of its {len(candidates)} image files can be read")
        if center_crop is None:
            first = self.files[0]
            for file in self.files[1:]:
                if sizes[file] != sizes[first]:
                    raise InputError(
                        f"{file}: size {sizes[file]} differs from {first}'s {sizes[first]}; "
                        "--center-crop SIZE brings images of any size to SIZE x SIZE as ADM does"
                    )

    def __len__(self) -> int:
        return len(self.files)

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        """Yield (B, H, W, 3) uint8 arrays in sorted path order."""
        for start in range(0, len(self), batch_size):
            images = [
                image for path in self.files[start : start + batch_size] if (image := self._read(path)) is not None
            ]
            if images:
                yield np.stack(images)

    def _read(self, path: Path) -> np.ndarray | None:
        """(H, W, 3) pixels; None for a file left out with skip_corrupt."""
        try:
            with Image.open(path) as image:
                image = to_rgb(image)
        except DECODE_ERRORS as error:
            self._unreadable(path, _UnreadableImage(error))
            return None
        if self.center_crop is not None:
            return center_crop_adm(image, self.center_crop)
        return np.asarray(image)

    def _unreadable(self, path: Path, error: Exception) -> None:
        if not self.skip_corrupt:
            raise InputError(f"{path}: not a readable image ({error}); --skip-corrupt leaves such files out")
        warnings.warn(f"{path}: not a readable image ({error}); left out", stacklevel=2)


_JPEG_END = b"\xff\xd9"
_JPEG_TAIL_BYTES = 64  # where the end-of-image marker must appear; encoders may pad a few bytes after it


class _UnreadableImage(Exception):
    def __init__(self, cause: Exception):
        super().__init__(str(cause).strip() or type(cause).__name__)


def _checked_size(path: Path) -> tuple[int, int]:
    """(W, H) from the header, after PIL's verify (which for PNG checks every chunk). A JPEG whose end
    marker is missing is decoded in full here, so data cut after a valid header shows before Inception."""
    try:
        with Image.open(path) as image:
            size, image_format = image.size, image.format
            image.verify()
        if image_format == "JPEG" and not _has_jpeg_end(path):
            with Image.open(path) as image:
                image.load()
    except DECODE_ERRORS as error:
        raise _UnreadableImage(error) from None
    return size


def _has_jpeg_end(path: Path) -> bool:
    with open(path, "rb") as file:
        file.seek(max(0, path.stat().st_size - _JPEG_TAIL_BYTES))
        return _JPEG_END in file.read()


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


def existing_input(path: str | os.PathLike) -> Path:
    """`path` when it is a file or a folder, else an InputError naming it: the check of an input that needs no
    reading (`python -m fid` makes it before it imports torch)."""
    path = Path(path)
    if not (path.is_dir() or path.is_file()):
        raise InputError(f"{path}: no such file or folder")
    return path


def open_input(path: str | os.PathLike, center_crop: int | None = None, skip_corrupt: bool = False) -> EvaluationInput:
    """Open an image folder or an .npz holding images (`arr_0`), statistics (`mu`, `sigma`, ...) or both.

    `center_crop` and `skip_corrupt` apply to image folders (see FolderImages).
    """
    path = existing_input(path)
    if path.is_dir():
        return EvaluationInput(path, FolderImages(path, center_crop, skip_corrupt), StatisticsFile())
    if not zipfile.is_zipfile(path):
        raise InputError(f"{path}: not an .npz archive nor a folder of images")
    with zipfile.ZipFile(path) as archive:
        keys = sorted(name.removesuffix(".npy") for name in archive.namelist())
    images = NpzImages(path) if IMAGE_KEY in keys else None
    stats = load_statistics(path)
    if images is None and stats.pool is None and stats.spatial is None:
        raise InputError(f"{path}: holds {keys}; expected images '{IMAGE_KEY}' and/or statistics 'mu', 'sigma'")
    return EvaluationInput(path, images, stats)
