"""ADM reference batches (download into the cache, structure check, sha256, offline message, short names)
and ADM's centre crop for raw image folders. Nothing touches the network: the downloader is replaced by a
copy of a small batch made here."""

import hashlib
import shutil
import subprocess
import sys
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms

import fid.reference.batches
from _fid_reference import no_inception, uint8_images  # noqa: F401 (no_inception is a fixture)
from commands import run_command
from fid import evaluate, extract_features, load_statistics
from fid.__main__ import main as fid_main
from fid.errors import InputError
from fid.inputs import FolderImages
from fid.preprocess import center_crop_adm
from fid.reference import ReferenceBatch, fetch, reference_batch, resolve_input
from fid.reference.__main__ import main


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    return tmp_path / "hub" / "adm_reference_batches"


def fake_batch(path: Path, resolution: int = 64, **changes) -> Path:
    """A batch with few images but the statistics shapes of the published ones (zeros compress to little)."""
    arrays = {
        "arr_0": uint8_images(3, resolution),
        "arr_1": np.arange(3),
        "mu": np.zeros(2048, np.float32),
        "sigma": np.zeros((2048, 2048), np.float32),
        "mu_s": np.zeros(2023, np.float32),
        "sigma_s": np.zeros((2023, 2023), np.float32),
    }
    arrays.update(changes)
    np.savez_compressed(path, **{key: value for key, value in arrays.items() if value is not None})
    return path


class Downloads(list):
    """URLs the replaced downloader was asked for; it serves a copy of `source`."""

    source: Path | None = None


@pytest.fixture
def served(monkeypatch) -> Downloads:
    downloads_ = Downloads()

    def copy(url: str, destination: Path) -> None:
        downloads_.append(url)
        shutil.copyfile(downloads_.source, destination)

    monkeypatch.setattr(fid.reference.batches, "download_file", copy)
    return downloads_


def test_short_names():
    assert reference_batch("imagenet256") == reference_batch("adm:imagenet256") == ReferenceBatch(256)
    assert reference_batch("samples.npz") is None
    assert ReferenceBatch(512).url == (
        "https://openaipublic.blob.core.windows.net/diffusion/jul-2021/ref_batches/"
        "imagenet/512/VIRTUAL_imagenet512_labeled.npz"
    )
    with pytest.raises(InputError, match="imagenet100: ADM published ImageNet reference batches at 64, 128, 256"):
        reference_batch("imagenet100")


def test_download_is_checked_renamed_and_hashed(cache, served, tmp_path, capsys):
    served.source = fake_batch(tmp_path / "published.npz")
    (path,) = main(["imagenet64"])
    assert served == [ReferenceBatch(64).url]
    assert path == cache / "VIRTUAL_imagenet64_labeled.npz"
    assert path.read_bytes() == served.source.read_bytes()
    digest = hashlib.sha256(served.source.read_bytes()).hexdigest()
    assert (cache / "VIRTUAL_imagenet64_labeled.npz.sha256").read_text() == f"{digest}  {path.name}\n"
    assert sorted(p.name for p in cache.iterdir()) == [path.name, path.name + ".sha256"]  # no temporaries
    assert str(path) in capsys.readouterr().out
    assert main(["imagenet64"]) == [path] and len(served) == 1  # cached: checked again, not downloaded again


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"arr_0": uint8_images(3, 32)}, r"'arr_0' has shape \(3, 32, 32, 3\); expected \(N, 64, 64, 3\)"),
        ({"arr_0": uint8_images(3, 64).astype(np.float32)}, "'arr_0' has dtype float32"),
        ({"arr_0": None}, "no images 'arr_0'"),
        ({"sigma_s": None}, "has 'mu_s' but no 'sigma_s'"),
        ({"mu_s": None, "sigma_s": None}, "'mu_s'/'sigma_s' missing"),
        ({"mu": np.zeros(64), "sigma": np.zeros((64, 64))}, r"'mu'/'sigma' of shape \(64,\); expected \(2048,\)"),
        ("cut", "not a readable .npz"),
    ],
)
def test_malformed_download_is_rejected_and_leaves_nothing(cache, served, tmp_path, changes, message):
    if changes == "cut":
        whole = fake_batch(tmp_path / "whole.npz").read_bytes()
        served.source = tmp_path / "published.npz"
        served.source.write_bytes(whole[: len(whole) // 2])
    else:
        served.source = fake_batch(tmp_path / "published.npz", **changes)
    with pytest.raises(InputError, match=message) as error:
        fetch(ReferenceBatch(64))
    assert "\n" not in str(error.value)
    assert list(cache.iterdir()) == []


def test_offline_message_then_a_file_put_there_by_hand(cache, tmp_path, monkeypatch, capsys):
    def offline(url: str, destination: Path) -> None:
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(fid.reference.batches, "download_file", offline)
    batch = ReferenceBatch(128)
    with pytest.raises(SystemExit) as exit_:
        run_command(main, ["imagenet128"])
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2
    assert line.startswith(f"error: {batch.url} could not be downloaded (")
    assert f"put it at {batch.path} and run `python -m fid.reference imagenet128` again" in line
    assert list(cache.iterdir()) == []

    fake_batch(batch.path, resolution=128)  # the user follows the message
    assert main(["imagenet128"]) == [batch.path]
    assert batch.sha256_path.read_text().split()[0] == hashlib.sha256(batch.path.read_bytes()).hexdigest()
    fake_batch(batch.path, resolution=128, arr_1=np.arange(4))  # replaced later by another file
    with pytest.raises(InputError, match=r"sha256 [0-9a-f]{64} differs from [0-9a-f]{64} recorded"):
        fetch(batch)


def test_fid_takes_the_short_name_of_a_cached_batch(cache, served, tmp_path, no_inception):
    served.source = fake_batch(tmp_path / "published.npz")
    main(["imagenet64"])
    np.savez(tmp_path / "samples.npz", mu=np.ones(2048), sigma=np.zeros((2048, 2048)))
    assert resolve_input("imagenet64") == resolve_input("adm:imagenet64") == ReferenceBatch(64).path
    report = fid_main([str(tmp_path / "samples.npz"), "adm:imagenet64", "--metrics", "fid"])
    assert report["fid"] == pytest.approx(2048)  # |mu_a - mu_b|^2 with zero covariances: the cached stats were used
    assert report["ref"] == "adm:imagenet64"


# ----------------------------------------------------------------------------------------------
# ADM's centre crop
# ----------------------------------------------------------------------------------------------


def noise_image(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_center_crop_without_halving_equals_torchvision():
    # Short side 200 < 2 x 128: no box halving, so the crop is a bicubic resize of the short side to 128 and a
    # centre cut, which torchvision's PIL backend computes independently. 300x200 -> 192x128 is exact, and the
    # cut offset (64 / 2 = 32) has no rounding to disagree on.
    image = noise_image(300, 200, seed=0)
    reference = transforms.CenterCrop(128)(transforms.Resize(128, transforms.InterpolationMode.BICUBIC)(image))
    np.testing.assert_array_equal(center_crop_adm(image, 128), np.asarray(reference))


def test_center_crop_halves_with_a_box_filter_first():
    # 512x768 to 256: one box halving gives 256x384, whose short side is already 256 (the bicubic step keeps the
    # size and PIL returns a copy), then columns 64..320 are cut. A box halving is the mean of 2x2 blocks; PIL
    # rounds it to 8 bits, so the exact numpy mean may differ by at most one level.
    pixels = np.asarray(noise_image(512, 768, seed=1)).astype(np.float64)
    block_means = pixels.reshape(256, 2, 384, 2, 3).mean(axis=(1, 3))  # (256, 384, 3)
    expected = block_means[:, 64:320]
    ours = center_crop_adm(noise_image(512, 768, seed=1), 256).astype(np.float64)
    assert ours.shape == (256, 256, 3) and np.abs(ours - expected).max() <= 1


def test_mixed_size_folder_needs_center_crop_and_then_yields_cropped_images(tmp_path):
    sizes = [(300, 200), (512, 768), (40, 50)]  # (H, W); the last is smaller than the target: it is enlarged
    for i, (height, width) in enumerate(sizes):
        noise_image(height, width, seed=i).save(tmp_path / f"{i}.png")
    with pytest.raises(InputError, match="--center-crop SIZE brings images of any size"):
        FolderImages(tmp_path)
    batches = list(FolderImages(tmp_path, center_crop=64).batches(2))
    expected = np.stack([center_crop_adm(noise_image(h, w, seed=i), 64) for i, (h, w) in enumerate(sizes)])
    np.testing.assert_array_equal(np.concatenate(batches), expected)


@pytest.mark.slow
def test_save_stats_of_a_raw_mixed_size_folder(bundled_inception, tmp_path):
    sizes = [(300, 200), (90, 120), (64, 64), (200, 150)]
    for i, (height, width) in enumerate(sizes):
        noise_image(height, width, seed=i).convert("RGB").save(tmp_path / f"{i}.jpg", quality=95)
    fid_main(
        [
            str(tmp_path),
            "--save-stats",
            str(tmp_path / "stats.npz"),
            "--center-crop",
            "64",
            "--weights",
            "bundled",
            "--device",
            "cpu",
            "--batch-size",
            "3",
        ]
    )
    crops = np.stack([center_crop_adm(Image.open(tmp_path / f"{i}.jpg").convert("RGB"), 64) for i in range(4)])
    expected = extract_features([crops], bundled_inception, gaussians=("pool",)).gaussians["pool"]
    saved = load_statistics(tmp_path / "stats.npz").pool
    # The same features in batches of 3 + 1 vs one batch of 4: fp32 summation order only.
    np.testing.assert_allclose(saved.mean, expected.mean, rtol=0, atol=1e-5)
    np.testing.assert_allclose(saved.cov, expected.cov, rtol=0, atol=1e-5 * np.abs(expected.cov).max())


def test_evaluate_reports_every_input_problem_before_inception(tmp_path, no_inception):
    noise_image(10, 12, seed=0).save(tmp_path / "a.png")
    with pytest.raises(InputError, match="--center-crop must be a positive image side"):
        evaluate(tmp_path, None, [], save_stats=tmp_path / "s.npz", center_crop=0)


def test_command_line_error_is_one_line_and_exit_2(tmp_path):
    repository = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "fid.reference", "imagenet100"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(repository),
            "PATH": "/usr/bin:/bin",
            "TORCH_HOME": str(tmp_path),
        },
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: imagenet100: ADM published ImageNet reference batches at 64, 128, 256, 512 pixels only"
    ]  # and no runpy warning about a module run twice
