"""Tiny data sets the tests write: class folders of random images, latent shards with their manifest, and the
config of a latent extraction over them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file


def make_image_folder(root, classes=("cat", "dog"), per_class=6, size=(40, 48), seed=0):
    """An image folder of random RGB PNGs (`size` as height, width), 000.png, 001.png, ... in a folder per class."""
    rng = np.random.default_rng(seed)
    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i:03d}.png")
    return root


def write_latent_shards(root, means, stds, labels, shard_size):
    """A latent folder as training.latents writes it: shards of `shard_size` (mean, std, label) rows and the
    manifest (format 1) of 32 px images in 4x4x4 latents, classes a, b, c."""
    root.mkdir()
    shards = []
    for k, start in enumerate(range(0, len(labels), shard_size)):
        part = slice(start, start + shard_size)
        save_file({"mean": means[part], "std": stds[part], "labels": labels[part]}, root / f"shard-{k:05d}.safetensors")
        shards.append({"file": f"shard-{k:05d}.safetensors", "count": len(labels[part]), "skipped": 0})
    manifest = {
        "format": 1,
        "image_size": 32,
        "vae": "test",
        "latent_channels": 4,
        "latent_size": 4,
        "dtype": "float32",
        "classes": ["a", "b", "c"],
        "num_images": len(labels),
        "num_skipped": 0,
        "shards": shards,
    }
    (root / "manifest.json").write_text(json.dumps(manifest))


def latent_shards(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """16 latents (means, stds (16, 2, 4, 4, 4)) of 3 classes in two shards of 8 in `folder`."""
    generator = torch.Generator().manual_seed(0)
    means, stds = torch.randn(16, 2, 4, 4, 4, generator=generator), torch.full((16, 2, 4, 4, 4), 0.1)
    write_latent_shards(folder, means, stds, torch.arange(16) % 3, shard_size=8)
    return means, stds


def make_images(root: Path, per_class: int, size: int = 32) -> Path:
    """Classes ant and bee of `per_class` random RGB PNGs each (0.png, 1.png, ...), `size` high and 8 px wider: the
    image folder of the latent-extraction tests."""
    rng = np.random.default_rng(0)
    for name in ("ant", "bee"):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (size, size + 8, 3), dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


def extraction_config(tmp_path: Path, images: Path, latents: Path, vae_folder: Path, **extract) -> Path:
    """A config (written in `tmp_path`) that extracts the latents of `images` into `latents` with the VAE of
    `vae_folder`; `extract`: settings of its extract section (image_size: of data)."""
    settings = {"batch_size": 3, "shard_size": 4, "dtype": "float32", **extract}
    path = tmp_path / f"extract-{latents.name}.yaml"
    path.write_text(f"""
model: {{name: DiT-S/2}}
data: {{source: images, images: {images}, latents: {latents}, image_size: {settings.pop("image_size", 32)},
        num_classes: 2, num_workers: 0}}
vae: {{name: {vae_folder}, scale: 0.5}}
extract: {json.dumps(settings)}
train: {{global_batch_size: 4, max_steps: 1, lr: 1.0e-4, ema_decay: 0.99, cpu: true}}
""")
    return path
