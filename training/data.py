"""Training examples: an image folder (ADM centre crop) or pre-extracted latent shards, the built-in digits and
coloured shapes (training.builtin_data) chosen by `data.source`, and the sharded, resumable batch stream.

Every random choice made for an example comes from a generator of its own (training.example_seeds), so a run sees
the same data whatever the number of loader workers, and a resumed run sees exactly what an uninterrupted one
would have.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from accelerate import skip_first_batches
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes

# The evaluator's preprocessing: training images are cut exactly as the ADM reference batches were.
from commands import UserError
from fid.preprocess import DECODE_ERRORS, center_crop_adm, to_rgb
from generation.vae import LatentNormalization
from training.builtin_data import (
    DIGITS_CLASSES,
    DIGITS_SIZE,
    SHAPES_CLASSES,
    SHAPES_SIZE,
    DigitsDataset,
    ShapesDataset,
)
from training.config import Config
from training.example_seeds import EpochSeeded, Example

LATENT_MANIFEST = "manifest.json"


class CorruptImageError(UserError):
    """An image file that PIL cannot decode, or will not (a decompression bomb)."""


class LatentShardError(UserError):
    """A latent shard that is cut, of the wrong shape or with labels outside data.num_classes (named)."""


class DataMismatchError(UserError):
    """data.* settings that do not match the files they point to: a missing folder or manifest, latents of
    another image size, another number of classes (the message names the key, the file and both values)."""


# --------------------------------------------------------------------------------------------------
#                                          Image folder
# --------------------------------------------------------------------------------------------------


class ImageFolderDataset(EpochSeeded):
    """root/<class name>/<image>; classes sorted by name get labels 0..K-1.

    Items are (image (3, S, S) in [-1, 1], label); 16-bit images are scaled to 8 bits (fid.preprocess.to_rgb).
    A file PIL cannot decode raises CorruptImageError naming it, or, with on_corrupt="skip", yields None (dropped
    and counted by `collate_examples`). A class folder without images is an error naming it (with "skip": a
    class without examples).
    """

    def __init__(
        self, root: str | Path, image_size: int, random_flip: bool, on_corrupt: str = "error", seed: int = 0
    ) -> None:
        super().__init__(seed)
        root = Path(root)
        if not root.is_dir():
            raise DataMismatchError(f"data.images={root}: the image folder does not exist")
        try:
            self.classes, class_to_index = find_classes(str(root))
        except FileNotFoundError:  # torchvision's "Couldn't find any class folder"
            raise DataMismatchError(
                f"data.images={root}: the folder holds no class folders; expected <folder>/<class name>/<image>"
            ) from None
        self.samples = list_images(root, class_to_index, allow_empty=on_corrupt == "skip")
        self.image_size = image_size
        self.random_flip = random_flip
        self.on_corrupt = on_corrupt

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Example | None:
        path, label = self.samples[index]
        try:
            with Image.open(path) as file:
                image = to_rgb(file)
        except DECODE_ERRORS as error:
            if self.on_corrupt == "skip":
                return None
            raise CorruptImageError(
                f"cannot decode image {path}: {error} (set data.on_corrupt=skip to skip and count such files)"
            ) from error
        pixels = torch.from_numpy(center_crop_adm(image, self.image_size).copy())
        x = pixels.permute(2, 0, 1).float() / 127.5 - 1.0  # (3, S, S) in [-1, 1]
        if self.random_flip and torch.randint(2, (), generator=self.generator(index)):
            x = x.flip(-1)
        return x, label


def list_images(root: Path, class_to_index: dict[str, int], allow_empty: bool) -> list[tuple[str, int]]:
    """(path, label) of every image under root/<class>/, in torchvision's ImageFolder order (classes, then
    folders, then files, each sorted).

    Symbolic links are followed, but every image is listed once and under its own class, whatever the links: what a
    path really is (its realpath) belongs to the class whose folder really holds it, or, outside every class folder,
    to the first class that links to it. So a folder is entered once (a link back into the class would list it again,
    until the OS stops at 40 levels), a folder holding class folders (`ln -s .. ant/up`: the dataset itself) or
    inside another class's folder is not entered, and an image linked from two places counts once."""
    owners: dict[str, str] = {}  # the real path of each class folder -> its class (the first, if two share one)
    for name in sorted(class_to_index):
        owners.setdefault(os.path.realpath(root / name), name)
    containers = {parent for folder in owners for parent in _parents(folder)} - owners.keys()
    listed: set[str] = set()  # real paths of the images listed so far, over all classes
    samples = []
    for name in sorted(class_to_index):
        found = _class_images(root / name, name, owners, containers, listed)
        if not found and not allow_empty:
            raise DataMismatchError(
                f"data.images={root}: the class folder {root / name} holds no images ({', '.join(IMG_EXTENSIONS)}) "
                f"of its own; remove it, or set data.on_corrupt=skip to keep it as a class without examples"
            )
        samples += [(path, class_to_index[name]) for path in sorted(found, key=lambda path: os.path.split(path))]
    return samples


def _parents(path: str) -> list[str]:
    """The folders above the absolute `path`, nearest first."""
    parents = []
    while (parent := os.path.dirname(path)) != path:
        parents.append(parent)
        path = parent
    return parents


def _owner(real: str, owners: dict[str, str]) -> str | None:
    """The class whose folder really holds the real path `real` (the innermost one), None for a path outside them."""
    for folder in (real, *_parents(real)):
        if folder in owners:
            return owners[folder]
    return None


def _class_images(folder: Path, name: str, owners: dict[str, str], containers: set[str], listed: set[str]) -> list[str]:
    """The images to list under class `name`, found below its folder (see `list_images`); adds them to `listed`."""
    found, entered, pending = [], set(), [str(folder)]
    while pending:
        path = pending.pop()
        real = os.path.realpath(path)
        if real in entered or real in containers or _owner(real, owners) not in (name, None):
            continue
        entered.add(real)
        try:
            entries = sorted(os.scandir(path), key=lambda entry: entry.name)
        except OSError:  # unreadable, or a broken link: os.walk passes over such folders too
            continue
        # top-down in sorted order, as os.walk: the first of several links to one folder is the one followed
        pending += reversed([entry.path for entry in entries if entry.is_dir()])  # is_dir follows links
        for entry in entries:
            if not entry.is_dir() and entry.name.lower().endswith(IMG_EXTENSIONS):
                image = os.path.realpath(entry.path) if entry.is_symlink() else os.path.join(real, entry.name)
                if image not in listed and (not entry.is_symlink() or _owner(image, owners) in (name, None)):
                    listed.add(image)
                    found.append(entry.path)
    return found


# --------------------------------------------------------------------------------------------------
#                                         Latent shards
# --------------------------------------------------------------------------------------------------


def read_manifest(root: str | Path) -> dict:
    """The description written by `python -m training.latents` once every shard exists."""
    path = Path(root) / LATENT_MANIFEST
    if not path.is_file():
        raise DataMismatchError(
            f"data.latents={root}: {path} not found, so the latents are missing or incomplete; "
            f"(re)run `python -m training.latents --config <config>` to finish them"
        )
    return json.loads(path.read_text())


class LatentShardDataset(EpochSeeded):
    """Pre-extracted posteriors; each item is a fresh sample z = mean + std * eps of a random flip, in model space
    (`normalization`: scale * z, or with `per_channel` scale * (z - mean_c) / std_c by the manifest's statistics).

    Shards hold "mean" and "std" of shape (n, 2, C, h, w) (index 1 along dim 1 = horizontally flipped
    image), "labels" (n,) and (format 2) "indices" (n,), each latent's position in the image folder.
    With `images` (the folder, unflipped; REPA), items are (latent, label, image) with the image flipped as
    the latent was, so an alignment encoder sees the very image the latent encodes.
    """

    def __init__(
        self,
        root: str | Path,
        scale: float,
        random_flip: bool,
        seed: int = 0,
        images: ImageFolderDataset | None = None,
        per_channel: bool = False,
    ) -> None:
        super().__init__(seed)
        self.images = images
        self.root = Path(root)
        self.manifest = read_manifest(root)
        self.files = [self.root / shard["file"] for shard in self.manifest["shards"]]
        self.offsets = np.cumsum([0] + [shard["count"] for shard in self.manifest["shards"]]).tolist()
        statistics = ()
        if per_channel:
            if "latent_mean" not in self.manifest:
                raise DataMismatchError(
                    f"vae.normalize=channels, but {self.root / LATENT_MANIFEST} has no per-channel statistics "
                    f"(extracted by an earlier version): extract the latents again into a new data.latents folder"
                )
            statistics = (tuple(self.manifest["latent_mean"]), tuple(self.manifest["latent_std"]))
        self.normalization = LatentNormalization(scale, *statistics)
        self.random_flip = random_flip
        self._open: dict[int, object] = {}  # shard index -> safe_open handle, opened lazily in each worker

    def __len__(self) -> int:
        return self.offsets[-1]

    def check_shards(self, num_classes: int) -> None:
        """Open every shard as training will (the safetensors header covers the whole file, so a cut file fails
        here) and check its shapes against the manifest and its labels against `num_classes`, before training."""
        from safetensors import SafetensorError, safe_open

        channels, side = self.manifest["latent_channels"], self.manifest["latent_size"]
        for file, count in zip(self.files, np.diff(self.offsets).tolist()):
            expected = [count, 2, channels, side, side]
            try:
                with safe_open(file, framework="pt") as tensors:
                    shapes = {key: tensors.get_slice(key).get_shape() for key in ("mean", "std", "labels")}
                    labels = tensors.get_tensor("labels")
            except (SafetensorError, OSError) as error:
                raise LatentShardError(f"latent shard {file} cannot be read ({error}); extract it again") from None
            if shapes != {"mean": expected, "std": expected, "labels": [count]}:
                raise LatentShardError(
                    f"latent shard {file} holds {shapes}; the manifest says mean and std {expected}, labels [{count}]"
                )
            if count and not 0 <= int(labels.min()) <= int(labels.max()) < num_classes:
                raise LatentShardError(
                    f"latent shard {file} holds labels {int(labels.min())}..{int(labels.max())};"
                    f" data.num_classes={num_classes} allows 0..{num_classes - 1}"
                )

    def __getitem__(self, index: int) -> Example:
        shard = bisect.bisect_right(self.offsets, index) - 1
        row = index - self.offsets[shard]
        tensors = self._shard(shard)
        generator = self.generator(index)
        flip = int(torch.randint(2, (), generator=generator)) if self.random_flip else 0
        mean = tensors.get_slice("mean")[row, flip].float()  # (C, h, w)
        std = tensors.get_slice("std")[row, flip].float()  # (C, h, w)
        latent = mean + std * torch.randn(mean.shape, generator=generator)  # (C, h, w)
        if not torch.isfinite(latent).all():  # else training stops later at a non-finite loss, blaming train.lr
            raise LatentShardError(
                f"latent shard {self.files[shard]} holds NaN or infinite values at row {row} (image {index}); "
                f"extract the latents again"
            )
        label = int(tensors.get_slice("labels")[row])
        latent = self.normalization.to_model(latent)  # (C, h, w)
        if self.images is None:
            return latent, label
        image = self.images[int(tensors.get_slice("indices")[row])][0]  # (3, S, S) in [-1, 1]
        return latent, label, image.flip(-1) if flip else image

    def __getstate__(self) -> dict:
        # open file handles do not cross into worker processes; each worker reopens what it reads
        return {**self.__dict__, "_open": {}}

    def _shard(self, shard: int):
        from safetensors import safe_open

        if shard not in self._open:
            self._open[shard] = safe_open(self.files[shard], framework="pt")
        return self._open[shard]


# --------------------------------------------------------------------------------------------------
#                                         Building and loading
# --------------------------------------------------------------------------------------------------


def build_dataset(config: Config) -> Dataset:
    """The dataset named by `data.source`, checked against the config before any model is built."""
    data = config.data
    if data.source == "digits":
        if (data.image_size, data.num_classes) != (DIGITS_SIZE, DIGITS_CLASSES):
            raise DataMismatchError(
                f"data.source=digits needs data.image_size={DIGITS_SIZE} and "
                f"data.num_classes={DIGITS_CLASSES}, got {data.image_size} and {data.num_classes}"
            )
        return DigitsDataset(random_flip=data.random_flip, seed=config.train.seed)
    if data.source == "shapes":
        if (data.image_size, data.num_classes) != (SHAPES_SIZE, SHAPES_CLASSES):
            raise DataMismatchError(
                f"data.source=shapes needs data.image_size={SHAPES_SIZE} and "
                f"data.num_classes={SHAPES_CLASSES}, got {data.image_size} and {data.num_classes}"
            )
        return ShapesDataset(random_flip=data.random_flip, seed=config.train.seed)
    if data.source == "images":
        if data.images is None:
            raise DataMismatchError(
                "data.source=images needs data.images=<folder with one sub-folder per class>, which is not set"
            )
        dataset = ImageFolderDataset(
            data.images, data.image_size, data.random_flip, data.on_corrupt, seed=config.train.seed
        )
        _check_num_classes(dataset.classes, data.num_classes, f"the image folder {data.images}")
        return dataset
    if data.latents is None:
        raise DataMismatchError(
            "data.source=latents needs data.latents=<folder written by python -m training.latents>, which is not set"
        )
    dataset = LatentShardDataset(
        data.latents,
        config.vae.scale,
        data.random_flip,
        seed=config.train.seed,
        images=paired_images(config) if config.train.repa.enabled else None,
        per_channel=config.vae.normalize == "channels",
    )
    manifest = dataset.manifest
    if manifest["image_size"] != data.image_size:
        raise DataMismatchError(
            f"data.image_size={data.image_size}, but the latents in "
            f"{Path(data.latents) / LATENT_MANIFEST} were extracted at {manifest['image_size']} "
            f"px: set data.image_size={manifest['image_size']} or extract them again"
        )
    _check_num_classes(manifest["classes"], data.num_classes, Path(data.latents) / LATENT_MANIFEST)
    dataset.check_shards(data.num_classes)
    return dataset


def paired_images(config: Config) -> ImageFolderDataset:
    """The image folder the latents were extracted from, for REPA: checked to still hold what was encoded."""
    data = config.data
    manifest = read_manifest(data.latents)
    if manifest.get("format", 1) < 2:
        raise UserError(
            f"latents at {data.latents} hold no image indices (format 1): REPA pairs each latent with "
            f"its image; extract them again with `python -m training.latents`"
        )
    if data.images is None or not Path(data.images).is_dir():
        raise UserError(
            f"train.repa with data.source=latents needs data.images=<the folder the latents at "
            f"{data.latents} were extracted from>, got {data.images}"
        )
    images = ImageFolderDataset(data.images, data.image_size, random_flip=False)
    encoded = manifest["num_images"] + manifest["num_skipped"]
    if len(images) != encoded:
        raise UserError(
            f"data.images={data.images} holds {len(images)} images, but the latents at {data.latents} "
            f"were extracted from {encoded}: not the same folder"
        )
    return images


def _check_num_classes(classes: list[str], expected: int, where: str | Path) -> None:
    """Refuse a data.num_classes other than the number of class folders (the model's label table would not fit)."""
    if len(classes) != expected:
        names = ", ".join(classes[:3]) + (", ..." if len(classes) > 3 else "")
        raise DataMismatchError(
            f"data.num_classes={expected}, but {where} holds {len(classes)} classes "
            f"({names}): set data.num_classes={len(classes)}"
        )


def collate_examples(items: list[Example | None]) -> tuple:
    """Stack examples into (x (B, ...), y (B,), number of skipped corrupt files); B may be 0. Items that carry
    their image as a third element (latents paired for REPA) add the images (B, 3, S, S) as a fourth."""
    kept = [item for item in items if item is not None]
    if not kept:
        return torch.empty(0), torch.empty(0, dtype=torch.long), len(items)
    x = torch.stack([item[0] for item in kept])
    y = torch.tensor([item[1] for item in kept], dtype=torch.long)
    paired = (torch.stack([item[2] for item in kept]),) if len(kept[0]) > 2 else ()
    return (x, y, len(items) - len(kept), *paired)


def loader_workers(requested: int) -> int:
    """`data.num_workers` capped at the CPUs this process may run on (its affinity mask: a Slurm or cgroup
    allocation, taskset): more workers than CPUs only contend for them, and torch warns of each extra one."""
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(requested, available)


class ShardedBatches:
    """This process's share of an endless shuffled stream of micro-batches, resumable at any batch.

    Epoch e visits a permutation that depends only on (seed, e), split over processes by DistributedSampler;
    the stream's position is the number of micro-batches drawn so far. `num_workers` is capped by loader_workers.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        process_index: int,
        num_processes: int,
        seed: int,
        num_workers: int,
        pin_memory: bool = False,
    ) -> None:
        self.dataset = dataset
        self.sampler = DistributedSampler(
            dataset, num_replicas=num_processes, rank=process_index, shuffle=True, seed=seed, drop_last=True
        )
        # Workers are recreated each epoch (persistent_workers=False) so they see the dataset's new epoch; the
        # loader's own generator keeps worker seeding off the global RNG, which checkpoints restore.
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            drop_last=True,
            num_workers=loader_workers(num_workers),
            collate_fn=collate_examples,
            pin_memory=pin_memory,
            generator=torch.Generator().manual_seed(seed),
        )
        if len(self.loader) == 0:
            raise ValueError(
                f"the dataset has {len(dataset)} examples, fewer than one batch of {batch_size} "
                f"on each of {num_processes} processes"
            )

    @property
    def batches_per_epoch(self) -> int:
        return len(self.loader)

    def stream(self, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        """Micro-batches from position `start` on."""
        epoch, skip = divmod(start, self.batches_per_epoch)
        while True:
            self.sampler.set_epoch(epoch)
            if hasattr(self.dataset, "set_epoch"):
                self.dataset.set_epoch(epoch)
            yield from skip_first_batches(self.loader, skip) if skip else self.loader
            epoch, skip = epoch + 1, 0
