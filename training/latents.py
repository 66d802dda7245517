"""Encode an image folder once into VAE-posterior shards, so training never runs the encoder.

    python -m training.latents --config configs/dit-s2-vca.yaml            # one process
    accelerate launch -m training.latents --config configs/dit-s2-vca.yaml  # shards spread over GPUs
    srun docs/slurm/task.sh python -m training.latents --config ...         # over Slurm's tasks

Several processes share the shards, or, where they would each run alone (a launch whose processes Accelerate does
not see: no GPUs without train.cpu=true; srun's tasks without docs/slurm/task.sh), are refused in one line before
any work (commands.check_launched_processes).

Reads data.images, writes data.latents/shard-XXXXX.safetensors with the posterior mean and std of every
image and of its mirror image and the image's index in data.images (so that REPA can pair each latent with its
own image), then manifest.json once all shards exist. Each shard is written to a
temporary file and renamed, so a killed run leaves only whole shards; rerunning skips them.

The manifest also holds each channel's mean and standard deviation of the sampled latents z = mean + std·ε over
every stored latent (mirror images included), for vae.normalize=channels: E[z] is the average of the posterior
means, Var[z] = E[std²] + Var[mean] (the law of total variance), so no sampling is needed. Each shard records
its sums, in float64 and of the values as stored, and the manifest adds them up.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from accelerate import PartialState
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import DataLoader
from tqdm import tqdm

from atomic_files import check_writable, write_text_atomic
from atomic_files.shards import ShardFolder
from commands import CommandParser, check_launched_processes, run_command
from generation.vae import encode_posterior, latent_downsampling, load_vae
from training.config import Config, ConfigError, load_config
from training.data import LATENT_MANIFEST, ImageFolderDataset, collate_examples, loader_workers

# 4: shard metadata in one key; 3: per-channel statistics; 2: shards hold "indices", each latent's position in the
# image folder
FORMAT_VERSION = 4
# A shard's metadata: one key, a JSON object ("skipped" and the `channel_sums`). One key, because safetensors writes
# its metadata map in an order that changes from process to process (a Rust HashMap), and a shard is to be the same
# bytes whichever process of whichever launch wrote it.
SHARD_METADATA = "latents"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def plan_shards(num_images: int, shard_size: int) -> list[range]:
    """Consecutive image-index ranges, one per shard."""
    return [range(start, min(start + shard_size, num_images)) for start in range(0, num_images, shard_size)]


def extract_latents(config: Config, state: PartialState | None = None) -> Path:
    """Write the missing shards (spread over the processes), then (main process) the manifest. Returns the folder."""
    state = state or PartialState(cpu=config.train.cpu)
    check_launched_processes(state.num_processes, "-m training.latents", "train.cpu=true")
    data = config.data
    if data.images is None or data.latents is None:
        raise ConfigError("latent extraction needs data.images=<image folder> and data.latents=<output folder>")
    dataset = ImageFolderDataset(data.images, data.image_size, random_flip=False, on_corrupt=data.on_corrupt)
    shards = plan_shards(len(dataset), config.extract.shard_size)
    folder = ShardFolder(data.latents, [shard_name(k) for k in range(len(shards))], _settings(config, len(dataset)))
    check_writable(data.latents)
    vae = load_vae(
        config.vae.name, device=state.device, hint=config.vae.path
    )  # an unavailable VAE fails before the folder is claimed
    pending = folder.claim(state)
    if folder.kept and state.is_main_process:
        print(
            f"{folder.folder}: kept {folder.kept} of {len(shards)} finished shards, encoding the other {len(pending)}"
        )
    todo = pending[state.process_index :: state.num_processes]
    if todo:
        _encode_shards(vae, dataset, shards, todo, folder, config, state)
    state.wait_for_everyone()
    if state.is_main_process:
        _write_manifest(folder.folder, dataset.classes, len(shards), config)
        folder.release()
    state.wait_for_everyone()
    return folder.folder


def _settings(config: Config, num_images: int) -> dict:
    return {
        "format": FORMAT_VERSION,
        "images": str(Path(config.data.images).resolve()),
        "num_images": num_images,
        "image_size": config.data.image_size,
        "vae": config.vae.name,
        "shard_size": config.extract.shard_size,
        "dtype": config.extract.dtype,
    }


def _encode_shards(
    vae,
    dataset: ImageFolderDataset,
    shards: list[range],
    todo: list[int],
    folder: ShardFolder,
    config: Config,
    state: PartialState,
) -> None:
    batch_size = config.extract.batch_size
    batches = [(shard, indices) for shard in todo for indices in _chunks(shards[shard], batch_size)]
    loader = DataLoader(
        dataset,
        batch_sampler=[indices for _, indices in batches],
        num_workers=loader_workers(config.data.num_workers),
        collate_fn=_collate_with_kept,
    )
    dtype = getattr(torch, config.extract.dtype)
    side = config.data.image_size // latent_downsampling(vae.config)
    empty = torch.empty(0, 2, vae.config.latent_channels, side, side, dtype=dtype)  # a shard's start
    pending = {
        "mean": [empty],
        "std": [empty],
        "labels": [torch.empty(0, dtype=torch.long)],
        "indices": [torch.empty(0, dtype=torch.long)],
    }
    skipped = 0
    progress = tqdm(total=len(batches), desc="encoding", disable=not state.is_local_main_process)
    for (shard, indices), ((images, labels, batch_skipped), kept) in zip(batches, loader):
        if len(labels):  # every image of a batch may have been corrupt (and skipped)
            images = images.to(state.device)
            mean, std = encode_posterior(vae, torch.cat([images, images.flip(-1)]))  # (2B, C, h, w) each
            pending["mean"].append(torch.stack(mean.chunk(2), dim=1).to("cpu", dtype))  # (B, 2, C, h, w)
            pending["std"].append(torch.stack(std.chunk(2), dim=1).to("cpu", dtype))  # (B, 2, C, h, w)
            pending["labels"].append(labels)
            pending["indices"].append(torch.tensor([i for i, k in zip(indices, kept) if k], dtype=torch.long))
        skipped += batch_skipped
        progress.update()
        if indices[-1] == shards[shard][-1]:  # last batch of this shard
            tensors = {key: torch.cat(values) for key, values in pending.items()}
            record = {"skipped": skipped, **channel_sums(tensors["mean"], tensors["std"])}
            metadata = {SHARD_METADATA: json.dumps(record)}
            folder.write(
                shard, lambda path, tensors=tensors, metadata=metadata: save_file(tensors, path, metadata=metadata)
            )
            progress.write(f"wrote {shard_name(shard)} ({len(tensors['labels'])} images, {skipped} skipped)")
            pending, skipped = {key: values[:1] for key, values in pending.items()}, 0
    progress.close()


def channel_sums(mean: torch.Tensor, std: torch.Tensor) -> dict[str, object]:
    """What a shard's metadata holds for the manifest to derive each channel's statistics from: the number of
    values per channel, and per channel the sum of the posterior means and of E[z²] = mean² + std²; mean, std
    (n, 2, C, h, w)."""
    mean, std = mean.double().transpose(0, 2).flatten(1), std.double().transpose(0, 2).flatten(1)  # (C, n·2·h·w)
    return {
        "channel_count": mean.shape[1],
        "channel_sum": mean.sum(1).tolist(),
        "channel_square_sum": (mean.square() + std.square()).sum(1).tolist(),
    }


def channel_statistics(shard_metadata: Sequence[dict[str, object]]) -> tuple[list[float], list[float]]:
    """(mean, std) per channel of the sampled latents over all shards, from their `channel_sums`."""
    count = sum(metadata["channel_count"] for metadata in shard_metadata)
    total = sum(torch.tensor(metadata["channel_sum"], dtype=torch.float64) for metadata in shard_metadata)
    squares = sum(torch.tensor(metadata["channel_square_sum"], dtype=torch.float64) for metadata in shard_metadata)
    mean = total / count
    return mean.tolist(), (squares / count - mean.square()).clamp_min(0).sqrt().tolist()


def _collate_with_kept(items: list) -> tuple:
    """`collate_examples` and which items were kept (a skipped corrupt image is None)."""
    return collate_examples(items), [item is not None for item in items]


def _chunks(indices: range, size: int) -> Iterator[list[int]]:
    for start in range(0, len(indices), size):
        yield list(indices[start : start + size])


def _write_manifest(out: Path, classes: Sequence[str], num_shards: int, config: Config) -> None:
    shards, metadata = [], []
    for k in range(num_shards):
        with safe_open(out / shard_name(k), framework="pt") as tensors:
            shape = tensors.get_slice("mean").get_shape()  # [n, 2, C, h, w]
            metadata.append(json.loads(tensors.metadata()[SHARD_METADATA]))
            shards.append({"file": shard_name(k), "count": shape[0], "skipped": metadata[-1]["skipped"]})
    latent_mean, latent_std = channel_statistics(metadata)
    manifest = {
        "format": FORMAT_VERSION,
        "image_size": config.data.image_size,
        "vae": config.vae.name,
        "latent_channels": shape[2],
        "latent_size": shape[3],
        "latent_mean": latent_mean,
        "latent_std": latent_std,
        "dtype": config.extract.dtype,
        "classes": list(classes),
        "num_images": sum(s["count"] for s in shards),
        "num_skipped": sum(s["skipped"] for s in shards),
        "shards": shards,
    }
    write_text_atomic(out / LATENT_MANIFEST, json.dumps(manifest, indent=2))


def main(argv: Sequence[str] | None = None) -> None:
    parser = CommandParser(prog="python -m training.latents", description=__doc__)
    parser.add_argument("--config", required=True, help="experiment config (data.images, data.latents, vae.*)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. extract.batch_size=32")
    args = parser.parse_intermixed_args(argv)  # overrides may also follow the options
    config = load_config(args.config, args.overrides)
    out = extract_latents(config)
    print(f"latents ready in {out}")


def command() -> None:
    """The installed command's entry point: a user error is one line and exit status 2."""
    run_command(main)


if __name__ == "__main__":
    command()
