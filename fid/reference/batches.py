"""ADM's ImageNet reference batches: download, check and cache `VIRTUAL_imagenet{N}_labeled.npz`.

Each batch holds `arr_0`, uint8 reference images (N, R, R, 3), and the statistics ADM's evaluator compares
against: `mu` (2048,), `sigma` (2048, 2048) of pool_3 and `mu_s` (2023,), `sigma_s` (2023, 2023) of the sFID
features. The cache is `<torch hub dir>/adm_reference_batches/` (torch.hub.get_dir(): $TORCH_HOME/hub, by
default ~/.cache/torch/hub), beside the Inception weights. A download goes to a temporary file that is
renamed only once its structure checks out; the file's sha256 is then recorded beside it as `<file>.sha256`,
and every later run of the command compares the file with it.
"""

import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from atomic_files import atomic_output, remove_stale_temporaries, write_text_atomic
from atomic_files.digest import file_sha256

from ..errors import InputError
from ..inception_spec import FEATURE_DIMS
from ..inputs import IMAGE_KEY, NpzImages
from ..statistics import STAT_KEYS, load_statistics

BASE_URL = "https://openaipublic.blob.core.windows.net/diffusion/jul-2021/ref_batches/imagenet"
RESOLUTIONS = (64, 128, 256, 512)
SHORT_NAME = re.compile(r"(?:adm:)?imagenet(\d+)")  # "imagenet256" or "adm:imagenet256"
CACHE_FOLDER = "adm_reference_batches"


@dataclass(frozen=True)
class ReferenceBatch:
    """One published ADM reference batch, by resolution."""

    resolution: int

    @property
    def name(self) -> str:
        return f"imagenet{self.resolution}"

    @property
    def filename(self) -> str:
        return f"VIRTUAL_imagenet{self.resolution}_labeled.npz"

    @property
    def url(self) -> str:
        return f"{BASE_URL}/{self.resolution}/{self.filename}"

    @property
    def path(self) -> Path:
        return cache_dir() / self.filename

    @property
    def sha256_path(self) -> Path:
        return self.path.with_name(self.filename + ".sha256")


def cache_dir() -> Path:
    """The cache folder of the batches, under torch.hub's folder (torch is imported here, when a short name needs
    it, so that `python -m fid` and `python -m fid.reference` answer --help and bad names without it)."""
    import torch

    return Path(torch.hub.get_dir()) / CACHE_FOLDER


def reference_batch(name: str) -> ReferenceBatch | None:
    """The batch a short name such as "imagenet256" or "adm:imagenet256" means; None for other strings."""
    match = SHORT_NAME.fullmatch(name)
    if match is None:
        return None
    resolution = int(match.group(1))
    if resolution not in RESOLUTIONS:
        raise InputError(
            f"{name}: ADM published ImageNet reference batches at {', '.join(map(str, RESOLUTIONS))} pixels only"
        )
    return ReferenceBatch(resolution)


def resolve_input(argument: str | os.PathLike) -> Path:
    """A SAMPLES / REF argument as a path: an existing file or folder as given, else a short name's cached batch."""
    path = Path(argument)
    if path.exists():
        return path
    batch = reference_batch(str(argument))
    if batch is None:
        return path
    if not batch.path.is_file():
        raise InputError(
            f"{argument}: the ADM reference batch is not in the cache ({batch.path}); "
            f"`python -m fid.reference {batch.name}` downloads it"
        )
    return batch.path


def check_structure(path: Path, batch: ReferenceBatch) -> None:
    """arr_0 uint8 (N, R, R, 3) and the four statistics with their ADM shapes, or an InputError naming the file."""
    try:
        images = NpzImages(path)
        stats = load_statistics(path)
    except InputError:
        raise
    except KeyError:
        raise InputError(f"{path}: no images '{IMAGE_KEY}'; not an ADM reference batch") from None
    except (OSError, EOFError, ValueError, zipfile.BadZipFile) as error:  # not a zip, cut archive, bad .npy
        raise InputError(f"{path}: not a readable .npz ({str(error).strip() or type(error).__name__})") from None
    expected_image = (batch.resolution, batch.resolution, 3)
    if images.shape[1:] != expected_image:
        raise InputError(
            f"{path}: '{IMAGE_KEY}' has shape {images.shape}; expected (N, {batch.resolution}, "
            f"{batch.resolution}, 3) for {batch.name}"
        )
    for name, dim in FEATURE_DIMS.items():
        gaussian, (mean_key, cov_key) = getattr(stats, name), STAT_KEYS[name]
        if gaussian is None or gaussian.mean.shape != (dim,):
            found = "missing" if gaussian is None else f"of shape {gaussian.mean.shape}"
            raise InputError(f"{path}: '{mean_key}'/'{cov_key}' {found}; expected ({dim},) and ({dim}, {dim})")


def download_file(url: str, destination: Path) -> None:
    """Fetch `url` into `destination` (torch.hub's downloader, with a progress bar)."""
    import torch

    torch.hub.download_url_to_file(url, str(destination), progress=True)


def fetch(batch: ReferenceBatch) -> Path:
    """The cached batch, downloaded first when absent; checked (structure, recorded sha256) either way."""
    if batch.path.is_file():
        return verify(batch)
    remove_stale_temporaries(batch.path)
    try:
        with atomic_output(batch.path) as temporary:
            download_file(batch.url, temporary)
            check_structure(temporary, batch)
            digest = file_sha256(temporary)
    except OSError as error:  # urllib's URLError is an OSError: offline, DNS, refused, HTTP errors
        raise InputError(
            f"{batch.url} could not be downloaded ({error}); download it by hand, put it at "
            f"{batch.path} and run `python -m fid.reference {batch.name}` again to check it"
        ) from None
    write_text_atomic(batch.sha256_path, f"{digest}  {batch.filename}\n")
    return batch.path


def verify(batch: ReferenceBatch) -> Path:
    """Check a cached (or hand-placed) batch; record its sha256 the first time, compare with it later."""
    check_structure(batch.path, batch)
    digest = file_sha256(batch.path)
    if batch.sha256_path.is_file():
        recorded = batch.sha256_path.read_text().split()[0]
        if recorded != digest:
            raise InputError(
                f"{batch.path}: sha256 {digest} differs from {recorded} recorded in "
                f"{batch.sha256_path} when it was first checked; delete both and fetch it again"
            )
    else:
        write_text_atomic(batch.sha256_path, f"{digest}  {batch.filename}\n")
    return batch.path
