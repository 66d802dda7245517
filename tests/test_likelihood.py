"""`python -m generation.likelihood`: bits per dimension of images under a SiT model's probability-flow ODE, held
to the closed form of a Gaussian data set.

The model of these tests is the exact optimal velocity field of Gaussian data N(MU, diag STD^2) under the Linear
path (alpha_t = t, sigma_t = 1 - t), written here from its definition: with x_t = t x_1 + (1 - t) x_0,
E[x_1 - x_0 | x_t = x] = MU + (t STD^2 - (1 - t)) (x - t MU) / (t^2 STD^2 + (1 - t)^2). Its probability flow carries
N(0, I) at t = 0 to exactly N(MU, diag STD^2) at t = 1, so the ODE's log-density of any point is the Gaussian's."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from _tiny_models import TINY_VAE, tiny_export
from _user_errors import one_line_error
from commands import USER_ERROR_STATUS, run_command
from generation.likelihood import PIXEL_BIN, ModelSpace, bits_per_dim, main
from generation.vae import LatentNormalization
from objectives import TransportSpec
from sit_vca import create_transport

MU = torch.tensor([0.2, -0.3, 0.1], dtype=torch.float64).view(1, 3, 1, 1)  # in the model's [-1, 1]
STD = torch.tensor([0.25, 0.3, 0.2], dtype=torch.float64).view(1, 3, 1, 1)
SIDE = 2  # 2x2 RGB images: D = 12, small enough for the exact trace


def gaussian_velocity(mu: torch.Tensor, std: torch.Tensor):
    def velocity(x, t, y):
        t = t.view(-1, 1, 1, 1).to(x.dtype)  # (B, 1, 1, 1)
        return mu.to(x) + (t * std.to(x) ** 2 - (1 - t)) * (x - t * mu.to(x)) / (t**2 * std.to(x) ** 2 + (1 - t) ** 2)

    return velocity


def gaussian_images(count: int, seed: int = 0) -> np.ndarray:
    """8-bit images of Gaussian data: x ~ N(MU, STD^2) rounded as sample.py rounds, floor(clamp(127.5 x + 128))."""
    x = MU + STD * torch.randn(count, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.clamp(127.5 * x + 128, 0, 255).floor().to(torch.uint8).permute(0, 2, 3, 1).numpy()  # (N, H, W, 3)


def gaussian_nll(x: torch.Tensor, mu: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """-log N(x; mu, diag std^2) per dimension (B, C, H, W), in nats."""
    return 0.5 * math.log(2 * math.pi) + torch.log(std) + (x - mu) ** 2 / (2 * std**2)


def pixel_bits(nll: torch.Tensor) -> np.ndarray:
    """bits/dim of 8-bit images from the per-dimension -log p of their model-space points: the bin width 1/127.5
    of each dimension counts log2(127.5) bits."""
    dims = nll[0].numel()
    return ((nll.flatten(1).sum(1) + dims * math.log(127.5)) / (dims * math.log(2))).numpy()


def run(images, space, dtype=torch.float64, **options):
    labels = np.zeros(len(images), np.int64)
    return bits_per_dim(
        gaussian_velocity(MU, STD),
        create_transport(path="linear"),
        [(images, labels)],
        space,
        dtype=dtype,
        **options,
    )


def test_bits_per_dim_at_the_bin_centres_equal_the_gaussians_closed_form():
    """dopri5 with atol 1e-8, rtol 1e-6 in float64 and the exact trace: the solve's error is of order rtol times the
    log-density (~30 nats for 12 dimensions), measured 1.5e-7 bits/dim; bound 1e-5."""
    images = gaussian_images(32)
    result = run(images, ModelSpace(dequantization="none"), divergence="exact", atol=1e-8, rtol=1e-6)
    centres = torch.from_numpy(images).permute(0, 3, 1, 2).double() / 127.5 - 1  # (N, 3, H, W)
    expected = pixel_bits(gaussian_nll(centres, MU, STD))
    assert result.dims == 12
    np.testing.assert_allclose(result.bits, expected, rtol=0, atol=1e-5)
    assert "not a bound" in result.includes


def test_the_default_solver_and_hutchinson_stay_within_their_tolerance():
    """The command's defaults (float32, dopri5 atol 1e-6, rtol 1e-3, one Rademacher probe): the Jacobian of this
    field is diagonal, so the probe's estimate of the trace is exact and what remains is the solver's error,
    measured 1.1e-4 bits/dim; bound 1e-3 (rtol 1e-3 of per-dimension log-densities of order 1 nat)."""
    images = gaussian_images(32, seed=1)
    result = run(images, ModelSpace(dequantization="none"), dtype=torch.float32)
    centres = torch.from_numpy(images).permute(0, 3, 1, 2).double() / 127.5 - 1
    np.testing.assert_allclose(result.bits, pixel_bits(gaussian_nll(centres, MU, STD)), rtol=0, atol=1e-3)


def test_uniform_dequantisation_stays_in_each_bin_and_averages_to_the_closed_form_expectation():
    """Each dimension of image k is x = (k - 128 + u) / 127.5, u ~ U[0, 1): the bits of each image lie between the
    Gaussian's closed-form extremes over its bins, and their mean over images equals the closed-form expectation
    over u, E (x - MU)^2 = (c - MU)^2 + w^2 / 12 (c the bin's centre, w its width), within 5 standard errors of u's
    scatter (also closed form) plus the solver's 1e-5 (as above)."""
    images = gaussian_images(64, seed=2)
    result = run(images, ModelSpace(), divergence="exact", atol=1e-8, rtol=1e-6)
    k = torch.from_numpy(images).permute(0, 3, 1, 2).double()
    low, high = (k - 128) * PIXEL_BIN, (k - 127) * PIXEL_BIN  # each dimension's bin
    inside = (MU >= low) & (MU <= high)
    nearest = torch.where(inside, MU, torch.where(MU < low, low, high))
    farthest = torch.where((low - MU).abs() > (high - MU).abs(), low, high)
    assert (pixel_bits(gaussian_nll(nearest, MU, STD)) - 1e-5 <= result.bits).all()
    assert (result.bits <= pixel_bits(gaussian_nll(farthest, MU, STD)) + 1e-5).all()

    w, offset = PIXEL_BIN, (k - 127.5) * PIXEL_BIN - MU  # centre minus MU, (N, 3, H, W)
    expected_nll = 0.5 * math.log(2 * math.pi) + torch.log(STD) + (offset**2 + w**2 / 12) / (2 * STD**2)
    variance = (4 * offset**2 * w**2 / 12 + w**4 * (1 / 80 - 1 / 144)) / (2 * STD**2) ** 2  # of each dim's term
    dims = result.dims * math.log(2)
    standard_error = math.sqrt(float(variance.sum())) / len(images) / dims
    assert abs(result.mean - pixel_bits(expected_nll).mean()) <= 5 * standard_error + 1e-5
    assert standard_error < 1e-3  # the test has the power to see a wrong bin (an error of w/2 moves the mean more)
    assert "upper bound" in result.includes


LATENT_MU = torch.tensor([0.1, -0.2, 0.3, 0.0], dtype=torch.float64).view(1, 4, 1, 1)  # of the model's inputs w
LATENT_STD = torch.tensor([0.5, 0.4, 0.6, 0.3], dtype=torch.float64).view(1, 4, 1, 1)


@pytest.fixture(scope="module")
def tiny_vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(**TINY_VAE).eval()  # 2 px per latent cell: 4-channel 4x4 latents of 8x8 images


def posterior_means(vae, images: np.ndarray) -> torch.Tensor:
    """z: the encoder's posterior means (N, 4, 4, 4) of 8-bit images, in float64."""
    with torch.no_grad():
        x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
        return vae.encode(x).latent_dist.mean.double()


def latent_bits(vae, images, mu, std, normalization):
    """bits_per_dim of a Gaussian model N(mu, diag std^2) of the model's inputs w (the flow of its exact velocity)
    on the VAE's latents mapped by `normalization`: float64, dopri5 at atol 1e-8, rtol 1e-6; Hutchinson's probe is
    exact on this diagonal Jacobian."""
    return bits_per_dim(
        gaussian_velocity(mu, std),
        create_transport(path="linear"),
        [(images, np.zeros(len(images), np.int64))],
        ModelSpace(vae=vae, normalization=normalization),
        dtype=torch.float64,
        atol=1e-8,
        rtol=1e-6,
    )


def test_a_latent_models_figure_is_the_density_of_the_vaes_latents(tiny_vae):
    """With a global scale a: w = a z, so log p(z) = log p(w) + D ln a, and the figure is -log p(z) / (D ln 2)
    with D the latent dimensions: the Gaussian's closed form of z = w / a, N(mu / a, std / a) (float64 solve; 1e-5),
    and the model-space figure beside it is -log p(w) / (D ln 2)."""
    images = np.random.default_rng(3).integers(0, 256, (6, 8, 8, 3), dtype=np.uint8)
    scale = 0.5
    result = latent_bits(tiny_vae, images, LATENT_MU, LATENT_STD, LatentNormalization(scale))
    z = posterior_means(tiny_vae, images)  # (6, 4, 4, 4)
    nll_z = gaussian_nll(z, LATENT_MU / scale, LATENT_STD / scale).flatten(1).sum(1)
    nll_w = gaussian_nll(scale * z, LATENT_MU, LATENT_STD).flatten(1).sum(1)
    assert result.dims == 64
    np.testing.assert_allclose(result.bits, (nll_z / (64 * math.log(2))).numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(result.model_space_bits, (nll_w / (64 * math.log(2))).numpy(), rtol=0, atol=1e-5)
    assert "latent likelihood only" in result.includes and "0.5 z" in result.includes


def test_per_channel_statistics_enter_the_flow_and_their_log_determinant_the_figure(tiny_vae):
    """vae.normalize=channels: the model saw w = a (z - m_c) / s_c. Model A, statistics (m, s) and a Gaussian
    N(MU, STD) of w, is the density N(m + s MU / a, s STD / a) of z. Model B moves every channel's mean by 3 and
    triples every std (m + 3, 3 s); the same density of z then needs N(MU / 3 - a / s, STD / 3) of B's w. Both
    models' figures equal that closed form of z (so the figure does not depend on the normalisation a model was
    trained with), while their model-space figures differ by exactly log2(3) per dimension, the log-determinant
    of the tripled stds (float64 solves; 1e-5). Before, the statistics were ignored: the flow started from a z and
    the figure left out h w sum_c log(a / s_c)."""
    images = np.random.default_rng(4).integers(0, 256, (4, 8, 8, 3), dtype=np.uint8)
    scale = 0.8
    mean = torch.tensor([0.3, -1.0, 2.0, 0.5], dtype=torch.float64).view(1, 4, 1, 1)
    std = torch.tensor([1.5, 0.7, 2.0, 1.1], dtype=torch.float64).view(1, 4, 1, 1)
    a = LatentNormalization(scale, tuple(mean.flatten().tolist()), tuple(std.flatten().tolist()))
    b = LatentNormalization(scale, tuple((mean + 3).flatten().tolist()), tuple((3 * std).flatten().tolist()))
    result_a = latent_bits(tiny_vae, images, LATENT_MU, LATENT_STD, a)
    result_b = latent_bits(tiny_vae, images, LATENT_MU / 3 - scale / std, LATENT_STD / 3, b)
    z = posterior_means(tiny_vae, images)
    nll_z = gaussian_nll(z, mean + std * LATENT_MU / scale, std * LATENT_STD / scale).flatten(1).sum(1)
    expected = (nll_z / (64 * math.log(2))).numpy()
    np.testing.assert_allclose(result_a.bits, expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(result_b.bits, expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(result_a.model_space_bits - result_b.model_space_bits, math.log2(3), rtol=0, atol=1e-5)
    nll_w = gaussian_nll(scale * (z - mean) / std, LATENT_MU, LATENT_STD).flatten(1).sum(1)  # A's model space
    np.testing.assert_allclose(result_a.model_space_bits, (nll_w / (64 * math.log(2))).numpy(), rtol=0, atol=1e-5)
    assert "per-channel statistics" in result_a.includes


def test_the_log_determinant_of_the_latent_normalisation():
    """h w sum_c log(scale / std_c), or C h w log(scale) without statistics: against the log-determinant of the map's
    Jacobian built by autograd on a 2-channel 2x1 latent (float64)."""
    normalization = LatentNormalization(0.7, (0.5, -2.0), (3.0, 0.25))
    z = torch.randn(1, 2, 2, 1, dtype=torch.float64)
    jacobian = torch.autograd.functional.jacobian(normalization.to_model, z).reshape(4, 4)
    assert normalization.log_abs_det(2, 2) == pytest.approx(torch.linalg.slogdet(jacobian)[1].item(), abs=1e-12)
    assert LatentNormalization(0.18215).log_abs_det(4, 16) == pytest.approx(64 * math.log(0.18215), abs=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------------------------


def gray_images(path, count: int = 3, labels: bool = True):
    gray = np.random.default_rng(0).integers(0, 256, (count, 8, 8, 1), dtype=np.uint8).repeat(3, axis=-1)
    arrays = {"arr_0": gray, **({"arr_1": np.arange(count) % 4} if labels else {})}
    np.savez(path, **arrays)
    return path


@pytest.mark.slow
def test_the_command_reports_bits_per_dim_of_a_sit_export_and_what_they_include(tmp_path, capsys):

    export = tiny_export(tmp_path / "export", family="SiT")
    images = gray_images(tmp_path / "images.npz")
    arguments = ["--ckpt", str(export), "--images", str(images), "--batch-size", "2", "--device", "cpu"]
    report = main([*arguments, "--json", str(tmp_path / "bpd.json")])
    printed = capsys.readouterr().out
    assert report == json.loads((tmp_path / "bpd.json").read_text())
    assert report["dims"] == 64 and len(report["per_image"]) == 3 and np.isfinite(report["per_image"]).all()
    assert report["bits_per_dim"] == pytest.approx(np.mean(report["per_image"]))
    expected = (-np.array(report["log_prob_nats"]) + 64 * math.log(127.5)) / (64 * math.log(2))
    np.testing.assert_allclose(report["per_image"], expected)
    assert f"bits/dim {report['bits_per_dim']:.4f} ± " in printed and "upper bound" in printed
    # Each image draws its dequantisation and probe from its own stream: another batch size, the same noise
    # (the adaptive solver's steps follow the batch, so the figures agree to its tolerance, not bit for bit).
    again = main([*arguments[:-4], "--batch-size", "3", "--device", "cpu"])
    np.testing.assert_allclose(again["per_image"], report["per_image"], atol=1e-3)


def latent_sit_export(folder, vae_folder, mean=None, std=None, scale: float = 0.8):
    """A 1-block SiT-VCA on the tiny VAE's 4x4x4 latents of 8x8 images (random weights, seed 0), with per-channel
    statistics where given."""
    import sit_vca
    from generation import ExportDescription, write_export

    torch.manual_seed(0)
    model = sit_vca.create_model(
        "SiT-S/2", depth=1, hidden_size=32, num_heads=2, input_size=4, in_channels=4, num_classes=4
    )
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    description = ExportDescription(
        model=model.spec,
        objective=TransportSpec(),
        space="latents",
        image_size=8,
        num_classes=4,
        vae=str(vae_folder),
        latent_scale=scale,
        latent_mean=mean,
        latent_std=std,
    )
    write_export(folder, model.state_dict(), description)
    return folder


@pytest.mark.slow
def test_the_command_integrates_from_the_exports_normalised_latents_and_reports_the_vae_latents_density(
    tmp_path, vae_folder, capsys
):
    """The issue's case: one model exported with every channel mean moved by 3 and every std tripled gave the same
    figure. Now the flow starts from the latents each export's statistics make (other log-densities), and each
    figure is its log-density less the log-determinant h w sum_c log(scale / std_c) of its normalisation."""
    images = tmp_path / "images.npz"
    np.savez(images, arr_0=np.random.default_rng(5).integers(0, 256, (3, 8, 8, 3), dtype=np.uint8), arr_1=[0, 1, 2])
    mean, std = [0.1, -0.3, 0.2, 0.0], [0.9, 1.2, 0.8, 1.1]
    reports = []
    for name, (m, s) in {"a": (mean, std), "b": ([v + 3 for v in mean], [3 * v for v in std])}.items():
        export = latent_sit_export(tmp_path / name, vae_folder, m, s)
        reports.append(main(["--ckpt", str(export), "--images", str(images), "--device", "cpu"]))
        log_det = 16 * sum(math.log(0.8 / v) for v in s)  # 4x4 latent pixels
        expected = (-np.array(reports[-1]["log_prob_nats"]) - log_det) / (64 * math.log(2))
        np.testing.assert_allclose(reports[-1]["per_image"], expected, rtol=1e-12)
        assert reports[-1]["model_space_bits_per_dim"] == pytest.approx(
            -np.mean(reports[-1]["log_prob_nats"]) / (64 * math.log(2))
        )
    assert np.abs(np.subtract(reports[0]["log_prob_nats"], reports[1]["log_prob_nats"])).min() > 1.0
    printed = capsys.readouterr().out
    assert "per-channel statistics" in printed and "model space (the latents the flow integrates from)" in printed


@pytest.mark.slow
def test_an_image_folder_is_read_as_python_m_fid_reads_it_with_a_label(tmp_path, capsys):
    """A folder of PNGs gives the figures of the same images in an .npz; without --label it is one line."""
    from PIL import Image

    export = tiny_export(tmp_path / "export", family="SiT")
    npz = gray_images(tmp_path / "images.npz")
    (tmp_path / "folder" / "sub").mkdir(parents=True)
    with np.load(npz) as data:
        for index, image in enumerate(data["arr_0"]):
            Image.fromarray(image).save(tmp_path / "folder" / "sub" / f"{index:03d}.png")
    common = ["--ckpt", str(export), "--label", "1", "--device", "cpu"]
    from_folder = main([*common, "--images", str(tmp_path / "folder")])
    from_npz = main([*common, "--images", str(npz)])
    assert from_folder["per_image"] == from_npz["per_image"]
    error = one_line_error(main, ["--ckpt", str(export), "--images", str(tmp_path / "folder")], capsys)
    assert f"--images {tmp_path / 'folder'}: a folder of images has no labels; give --label K or --label null" in error


@pytest.mark.parametrize(
    "make, arguments, named",
    [
        (lambda tmp: gray_images(tmp / "i.npz"), ["--family", "DiT"], "the ODE likelihood needs an interpolant (SiT)"),
        (lambda tmp: gray_images(tmp / "i.npz", labels=False), [], "no labels arr_1; give --label K or --label null"),
        (lambda tmp: gray_images(tmp / "i.npz"), ["--label", "7"], "--label 7: expected 3 class indices in 0..3"),
        (lambda tmp: gray_images(tmp / "i.npz"), ["--num-images", "0"], "--num-images must be positive"),
        (lambda tmp: gray_images(tmp / "i.npz"), ["--no-null", "--label", "null"], "trained without label dropout"),
        (
            lambda tmp: (
                np.savez(tmp / "i.npz", arr_0=np.arange(192, dtype=np.uint8).reshape(1, 8, 8, 3)) or tmp / "i.npz"
            ),
            ["--label", "0"],
            "colour images, but the model takes one channel",
        ),
        (
            lambda tmp: np.savez(tmp / "i.npz", arr_0=np.zeros((2, 4, 4, 3), np.uint8)) or tmp / "i.npz",
            [],
            "4x4 images; the model takes 8 px",
        ),
    ],
)
def test_what_the_likelihood_cannot_be_computed_for_is_one_line(tmp_path, capsys, make, arguments, named):

    family = arguments[1] if arguments[:1] == ["--family"] else "SiT"
    dropout = 0.0 if arguments[:1] == ["--no-null"] else 0.1  # a model trained without label dropout: no null class
    arguments = arguments[2:] if arguments[:1] == ["--family"] else arguments[1:] if dropout == 0 else arguments
    export = tiny_export(tmp_path / "export", class_dropout_prob=dropout, family=family)
    with pytest.raises(SystemExit) as exit_:
        run_command(main, ["--ckpt", str(export), "--images", str(make(tmp_path)), *arguments])
    error = capsys.readouterr().err
    assert exit_.value.code == USER_ERROR_STATUS and error.count("\n") == 1 and named in error, error


def cut_file(path):
    """An .npz of gray images cut to half its bytes (a copy interrupted, a disk that filled)."""
    whole = gray_images(path).read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    return path


@pytest.mark.parametrize(
    "make, arguments, named",
    [
        (cut_file, [], "cannot be read as an .npz (BadZipFile: File is not a zip file); the file is cut or damaged"),
        (lambda path: (path.write_bytes(b"not an archive" * 8), path)[1], [], "the file is cut or damaged"),
        (gray_images, ["--device", "cuda"], "--device cuda: this machine has no cuda device"),
        (gray_images, ["--device", "cuda:x"], "--device cuda:x: not a torch device"),
    ],
)
def test_a_damaged_images_file_or_a_device_this_machine_lacks_is_one_line(tmp_path, capsys, make, arguments, named):
    """Issue 47: a cut or garbage --images (BadZipFile) and --device cuda without a GPU were tracebacks."""
    if arguments[-1:] == ["cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    export = tiny_export(tmp_path / "export", family="SiT")
    images = make(tmp_path / "i.npz")
    error = one_line_error(main, ["--ckpt", str(export), "--images", str(images), *arguments], capsys)
    assert named in error


@pytest.mark.parametrize("target", ["images", "weights", "notes"])
def test_json_never_replaces_a_file_the_likelihood_did_not_write(tmp_path, capsys, target):
    """Issue 47: --json replaced any existing file: its own --images (the images became a 782-byte report), an
    export's ema.safetensors, a user's notes. As python -m fid: a report of this command is replaced, anything
    else is refused in one line before the model is loaded, and stays as it was."""
    export = tiny_export(tmp_path / "export", family="SiT")
    images = gray_images(tmp_path / "images.npz")
    (tmp_path / "notes.json").write_text('{"mine": 1}\n')
    path = {"images": images, "weights": export / "ema.safetensors", "notes": tmp_path / "notes.json"}[target]
    before = path.read_bytes()
    arguments = ["--ckpt", str(export), "--images", str(images), "--batch-size", "3", "--json", str(path)]
    error = one_line_error(main, arguments, capsys)
    said = "is --images itself" if target == "images" else "exists and was not written by python -m generation"
    assert said in error and str(path) in error, error
    assert path.read_bytes() == before


@pytest.mark.slow
def test_json_replaces_a_report_of_its_own(tmp_path):
    export = tiny_export(tmp_path / "export", family="SiT")
    images = gray_images(tmp_path / "images.npz", count=2)
    report = tmp_path / "bpd.json"
    arguments = ["--ckpt", str(export), "--images", str(images), "--batch-size", "2", "--json", str(report)]
    main([*arguments, "--seed", "1"])
    second = main([*arguments, "--seed", "2"])
    assert json.loads(report.read_text()) == second and second["settings"]["seed"] == 2


def test_a_vae_of_another_channel_count_is_one_line_before_any_image_is_read(tmp_path, capsys):
    """Issue 47: a --vae whose latents have other channels than the model's was a convolution's traceback."""
    from diffusers import AutoencoderKL

    from generation import ExportDescription, write_export
    from sit_vca import create_model

    model = create_model("SiT-S/2", depth=1, hidden_size=32, num_heads=2, input_size=4, in_channels=4, num_classes=4)
    vae_folder = tmp_path / "vae8"
    AutoencoderKL(**{**TINY_VAE, "latent_channels": 8}).save_pretrained(vae_folder)  # 8 channels, the model 4
    description = ExportDescription(
        model=model.spec,
        objective=TransportSpec(),
        space="latents",
        image_size=8,
        num_classes=4,
        vae=str(vae_folder),
        latent_scale=0.5,
    )
    write_export(tmp_path / "export", model.state_dict(), description)
    images = gray_images(tmp_path / "images.npz")
    arguments = ["--ckpt", str(tmp_path / "export"), "--images", str(images), "--vae", str(vae_folder)]
    error = one_line_error(main, arguments, capsys)
    assert "has 8 latent channels, but the model generates 4" in error and "(--vae)" in error


def test_an_ode_that_blows_up_is_one_line_naming_the_model_and_tolerances(tmp_path, capsys):
    """Issue 47: a model whose probability-flow ODE blows up (finite weights, velocities that overflow) ended in
    torchdiffeq's AssertionError "underflow in dt nan"; it is one line naming --ckpt and the tolerances."""
    from generation.export import read_export, write_export

    export = tiny_export(tmp_path / "export", family="SiT")
    read = read_export(export)
    huge = {
        key: value * 1e30 if value.is_floating_point() and value.ndim > 1 else value
        for key, value in read.weights.items()
    }
    write_export(export, huge, read.description)  # finite weights whose products overflow float32
    images = gray_images(tmp_path / "images.npz", count=2)
    with pytest.raises(SystemExit) as exit_:
        run_command(main, ["--ckpt", str(export), "--images", str(images), "--device", "cpu"])
    error = capsys.readouterr().err  # the solver's progress bar, then the one line
    assert exit_.value.code == USER_ERROR_STATUS and "Traceback" not in error, error
    assert error.endswith("\n") and error.count("\n") == 1 and "error: " in error, error
    line = error[error.index("error: ") :]
    assert f"--ckpt {export}: dopri5 cannot solve this model's probability-flow ODE at --atol 1e-06" in line


def test_under_a_launcher_only_rank_0_computes(tmp_path, capsys, monkeypatch):
    """Issue 47: under torchrun every process computed every image (and wrote the same report). Rank 0 does the
    work; any other rank ends at once, having read nothing and written nothing."""
    export = tiny_export(tmp_path / "export", family="SiT")
    images = gray_images(tmp_path / "images.npz")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    report = tmp_path / "bpd.json"
    assert main(["--ckpt", str(export), "--images", str(images), "--json", str(report)]) is None
    assert not report.exists() and capsys.readouterr().out == ""
