"""Datasets and the sharded, resumable batch stream."""

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.datasets import load_digits
from torchvision import transforms

from _launch import ROOT
from _tiny_data import latent_shards, make_image_folder, write_latent_shards
from _tiny_runs import latent_run
from training.builtin_data import DigitsDataset
from training.data import (
    CorruptImageError,
    ImageFolderDataset,
    LatentShardDataset,
    ShardedBatches,
    center_crop_adm,
    collate_examples,
    read_manifest,
)


def test_adm_crop_equals_torchvision_resize_and_crop_for_small_images():
    # With the short side below 2x the target no box halving happens, so ADM's crop is a bicubic resize of the
    # short side plus a centre crop, which torchvision implements independently. 300x400 -> 256x341 is
    # chosen so both libraries round the long side (341.33) and the crop offset (42.5 -> 42) the same way.
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (300, 400, 3), dtype=np.uint8))
    reference = transforms.CenterCrop(256)(transforms.Resize(256, transforms.InterpolationMode.BICUBIC)(image))
    np.testing.assert_array_equal(center_crop_adm(image, 256), np.asarray(reference))


def test_adm_crop_box_halves_large_images_first():
    # 640x512 with target 128: two box halvings give 160x128 exactly, so only the centre crop follows.
    # PIL's reduce(4) is an independent 4x4 box average; it rounds once where two halvings round twice, so
    # values may differ by up to 2 levels. Resizing without the halving (plain antialiased bicubic) is a
    # different filter and differs by ~7 levels on average on this noise image, which the test would catch.
    image = Image.fromarray(np.random.default_rng(2).integers(0, 256, (512, 640, 3), dtype=np.uint8))
    ours = center_crop_adm(image, 128).astype(int)
    reference = np.asarray(transforms.CenterCrop(128)(image.reduce(4))).astype(int)
    assert np.abs(ours - reference).max() <= 2 and np.abs(ours - reference).mean() < 1.5
    direct = transforms.CenterCrop(128)(transforms.Resize(128, transforms.InterpolationMode.BICUBIC)(image))
    assert np.abs(ours - np.asarray(direct).astype(int)).mean() > 5


def test_image_folder_labels_range_and_flip(tmp_path):
    folder = make_image_folder(tmp_path / "images")
    plain = ImageFolderDataset(folder, 32, random_flip=False)
    flipping = ImageFolderDataset(folder, 32, random_flip=True, seed=3)
    assert len(plain) == 12 and plain.classes == ["cat", "dog"]
    assert [label for _, label in plain.samples] == [0] * 6 + [1] * 6
    x, label = plain[7]
    assert x.shape == (3, 32, 32) and label == 1 and -1 <= x.min() and x.max() <= 1
    flips = set()
    for epoch in range(20):  # all 20 draws equal has probability 2^-19
        flipping.set_epoch(epoch)
        y, _ = flipping[7]
        flips.add(torch.equal(y, x.flip(-1)))
        assert torch.equal(y, x) or torch.equal(y, x.flip(-1))
        assert torch.equal(flipping[7][0], y)  # the same (seed, epoch, index) draws the same flip
    assert flips == {True, False}


def test_corrupt_image_is_named_or_skipped_and_counted(tmp_path):
    folder = make_image_folder(tmp_path / "images")
    corrupt = folder / "dog" / "002.png"
    corrupt.write_bytes(corrupt.read_bytes()[:60])  # truncated PNG
    strict = ImageFolderDataset(folder, 16, random_flip=False)
    with pytest.raises(CorruptImageError, match=str(corrupt)):
        strict[8]
    lenient = ImageFolderDataset(folder, 16, random_flip=False, on_corrupt="skip")
    x, y, skipped = collate_examples([lenient[i] for i in range(6, 12)])
    assert skipped == 1 and x.shape == (5, 3, 16, 16) and y.tolist() == [1] * 5


def test_digits_are_sklearns_digits_in_minus_one_one():
    dataset = DigitsDataset()
    digits = load_digits()
    assert len(dataset) == 1797
    x, label = dataset[123]
    assert x.shape == (1, 8, 8) and label == digits.target[123]
    np.testing.assert_allclose(x[0].numpy(), digits.images[123] / 16 * 2 - 1)
    assert dataset.images.min() == -1 and dataset.images.max() == 1


def test_latent_shards_draw_a_fresh_posterior_sample_and_flip(tmp_path):
    generator = torch.Generator().manual_seed(0)
    means = torch.randn(10, 2, 4, 4, 4, generator=generator)
    stds = torch.rand(10, 2, 4, 4, 4, generator=generator) + 0.5
    labels = torch.arange(10) % 3
    write_latent_shards(tmp_path / "latents", means, stds, labels, shard_size=4)
    scale = 0.5
    dataset = LatentShardDataset(tmp_path / "latents", scale=scale, random_flip=True, seed=1)
    assert len(dataset) == 10 and read_manifest(tmp_path / "latents")["num_images"] == 10
    draws, flips = [], []
    for epoch in range(400):
        dataset.set_epoch(epoch)
        z, label = dataset[6]  # second shard, row 2
        assert label == 0
        # Which flip was drawn: the standardised residual under the right one is N(0, 1), under the other huge.
        residuals = [((z / scale - means[6, f]) / stds[6, f]).abs().max() for f in (0, 1)]
        flip = int(residuals[1] < residuals[0])
        flips.append(flip)
        draws.append((z / scale - means[6, flip]) / stds[6, flip])
    eps = torch.stack(draws)  # (400, 4, 4, 4) standardised samples
    # Mean 0 and variance 1 of 25 600 draws: tolerances are ~6 standard errors (0.006 and 0.009).
    assert eps.mean().abs() < 0.04 and (eps.var() - 1).abs() < 0.06
    assert 150 < sum(flips) < 250  # Binomial(400, 1/2): +-5 standard deviations
    dataset.set_epoch(7)
    assert torch.equal(dataset[6][0], dataset[6][0])  # reproducible for a given (seed, epoch, index)


def test_sharded_batches_split_the_epoch_and_resume_at_any_position():
    dataset = DigitsDataset()
    streams = [ShardedBatches(dataset, 32, rank, 2, seed=5, num_workers=0) for rank in (0, 1)]
    assert streams[0].batches_per_epoch == 898 // 32
    # Disjoint halves of one permutation: no example index repeats within an epoch across processes.
    indices = [list(itertools.islice(iter(s.sampler), 28 * 32)) for s in streams]
    assert not set(indices[0]) & set(indices[1])
    # Resuming at micro-batch 20 (inside the first epoch) replays exactly what follows, across the boundary.
    full = list(itertools.islice(streams[1].stream(0), 40))
    resumed = list(itertools.islice(streams[1].stream(20), 20))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(full[20:], resumed))
    # A new epoch is a new permutation.
    assert not torch.equal(full[0][1], full[28][1])


def test_batches_do_not_depend_on_the_number_of_loader_workers(tmp_path):
    folder = make_image_folder(tmp_path / "images", per_class=8)
    dataset = ImageFolderDataset(folder, 16, random_flip=True, seed=2)
    draws = []
    for workers in (0, 2):
        stream = ShardedBatches(dataset, 4, 0, 1, seed=2, num_workers=workers).stream(0)
        draws.append([x for x, _, _ in itertools.islice(stream, 8)])  # two epochs of 4 batches
    assert all(torch.equal(a, b) for a, b in zip(*draws))


# --------------------------------------------------------------------------------------------------
#                                      Odd image folders
# --------------------------------------------------------------------------------------------------


def test_a_symlink_loop_in_a_class_folder_is_followed_once(tmp_path):
    # Before: the loop was walked until the OS stopped it at 40 levels (each cat image counted 41 times).
    folder = make_image_folder(tmp_path / "images")
    (folder / "cat" / "again").symlink_to(folder / "cat", target_is_directory=True)
    (folder / "dog" / "elsewhere").symlink_to(make_image_folder(tmp_path / "more", classes=("x",), per_class=2) / "x")
    dataset = ImageFolderDataset(folder, 16, random_flip=False)
    assert [label for _, label in dataset.samples] == [0] * 6 + [1] * 8  # a link to a new folder is followed
    assert len({path for path, _ in dataset.samples}) == len(dataset.samples)


def test_the_image_order_is_torchvisions(tmp_path):
    # Latent shards record each latent's index in the folder: the listing must stay what it was (torchvision's).
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

    folder = make_image_folder(tmp_path / "images", classes=("b", "a"))
    (folder / "a" / "sub").mkdir()
    Image.new("RGB", (20, 20)).save(folder / "a" / "sub" / "000.png")
    Image.new("RGB", (20, 20)).save(folder / "a" / "zz.JPEG")
    (folder / "a" / "notes.txt").write_text("not an image")
    dataset = ImageFolderDataset(folder, 16, random_flip=False)
    assert dataset.samples == make_dataset(str(folder), {"a": 0, "b": 1}, extensions=IMG_EXTENSIONS)


def test_a_16_bit_png_is_scaled_not_clipped(tmp_path):
    # Before: convert("RGB") clipped every value above 255, so 99.6 % of this ramp became white.
    folder = make_image_folder(tmp_path / "images", per_class=1, size=(16, 16))
    ramp = (np.arange(256, dtype=np.uint32).reshape(16, 16) * 257).astype(np.uint16)  # 0..65535 in steps of 257
    Image.fromarray(ramp).save(folder / "cat" / "000.png")
    with Image.open(folder / "cat" / "000.png") as image:
        assert image.mode.startswith("I")  # Pillow reads it as 16-bit greyscale
    x, _ = ImageFolderDataset(folder, 16, random_flip=False)[0]
    pixels = (x + 1) * 127.5  # (3, 16, 16) back to 0..255
    expected = torch.arange(256, dtype=torch.float32).reshape(16, 16)  # value / 257 exactly
    for channel in pixels:
        torch.testing.assert_close(channel, expected, atol=1e-4, rtol=0)  # float32 round trip of x / 127.5 - 1


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height pixels (8-bit RGB) and whose data are a token: a decompression
    bomb as Pillow sees it when it opens the file."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def test_a_decompression_bomb_is_named_or_skipped(tmp_path):
    # Before: PIL's DecompressionBombError came through as a traceback.
    folder = make_image_folder(tmp_path / "images", per_class=2, size=(16, 16))
    bomb = folder / "dog" / "001.png"
    bomb.write_bytes(png_declaring(30000, 30000))
    with pytest.raises(CorruptImageError, match=rf"cannot decode image {bomb}: .*decompression bomb"):
        ImageFolderDataset(folder, 16, random_flip=False)[3]
    assert ImageFolderDataset(folder, 16, random_flip=False, on_corrupt="skip")[3] is None


def test_an_empty_class_folder_is_named_or_kept_as_a_class_without_examples(tmp_path):
    # Before: torchvision's FileNotFoundError ("Found no valid file for the classes ...") as a traceback.
    from training.data import DataMismatchError

    folder = make_image_folder(tmp_path / "images", classes=("cat", "dog", "emu"), per_class=2)
    for image in (folder / "dog").iterdir():
        image.unlink()
    (folder / "dog" / "readme.txt").write_text("no images here")
    with pytest.raises(DataMismatchError, match=rf"the class folder {folder / 'dog'} holds no images"):
        ImageFolderDataset(folder, 16, random_flip=False)
    lenient = ImageFolderDataset(folder, 16, random_flip=False, on_corrupt="skip")
    assert lenient.classes == ["cat", "dog", "emu"] and [label for _, label in lenient.samples] == [0, 0, 2, 2]


def test_a_non_finite_latent_is_named_by_its_shard(tmp_path):
    # Before: training went on until "loss is not finite ... try a lower train.lr", naming neither file nor row.
    from training.data import LatentShardError

    means, stds = torch.zeros(6, 2, 4, 4, 4), torch.ones(6, 2, 4, 4, 4)
    means[4, :, 1, 2, 3] = float("nan")
    write_latent_shards(tmp_path / "latents", means, stds, torch.arange(6) % 3, shard_size=3)
    dataset = LatentShardDataset(tmp_path / "latents", scale=0.5, random_flip=True)
    assert torch.isfinite(dataset[3][0]).all()
    shard = tmp_path / "latents" / "shard-00001.safetensors"
    with pytest.raises(
        LatentShardError, match=rf"latent shard {shard} holds NaN or infinite values at row 1 \(image 4\)"
    ):
        dataset[4]


def test_no_image_is_listed_twice_or_under_another_class_whatever_the_links(tmp_path):
    # Before: `ln -s .. ant/up` listed every class's images under ant too (39 images for 12 here).
    from training.data import ImageFolderDataset

    folder = make_image_folder(tmp_path / "images", classes=("ant", "bee", "cat"), per_class=3, size=(8, 8))
    (folder / "ant" / "up").symlink_to("..")  # the dataset itself, from inside a class
    (folder / "ant" / "borrowed.png").symlink_to("../bee/000.png")  # another class's image
    (folder / "bee" / "ants").symlink_to("../ant")  # another class's folder
    (folder / "cat" / "again").symlink_to(".")  # a cycle
    (folder / "cat" / "grandparent").symlink_to("../..")  # above the dataset
    outside = make_image_folder(tmp_path / "outside", classes=("x",), per_class=2, size=(8, 8)) / "x"
    (folder / "ant" / "extra").symlink_to(outside)  # outside every class: the first class to link it has it
    (folder / "cat" / "extra").symlink_to(outside)
    samples = ImageFolderDataset(folder, 8, random_flip=False).samples
    listed = {(os.path.relpath(path, folder), label) for path, label in samples}
    assert len(listed) == len(samples) == 11
    assert listed == {
        (f"{name}/{i:03d}.png", label) for label, name in enumerate(("ant", "bee", "cat")) for i in range(3)
    } | {
        ("ant/extra/000.png", 0),
        ("ant/extra/001.png", 0),
    }


def test_a_nan_in_a_latent_shard_stops_training_naming_the_shard_in_one_line(tmp_path):
    # Before: the run went on to "loss is not finite ... try a lower train.lr". Through a loader worker, torch wraps
    # the error in the worker's traceback: the command still prints the error's own line.
    from safetensors.torch import load_file, save_file

    latent_shards(tmp_path / "latents")
    shard = tmp_path / "latents" / "shard-00001.safetensors"
    tensors = load_file(shard)
    tensors["mean"][:, :, 0, 0, 0] = float("nan")
    save_file(tensors, shard)
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            *latent_run(tmp_path / "latents"),
            "train.max_steps=8",
            "log.sample_every=0",
            "log.trackers=[]",
            "data.num_workers=1",
            f"run.dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    # the progress bar's line may precede it (tqdm ends its line with a carriage return, not a newline)
    errors = [line[line.index("error:") :] for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f"error: latent shard {shard} holds NaN or infinite values at row "), errors[0]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
