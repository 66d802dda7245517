"""What `python -m fid` answers to bad input: one line `error: ...` naming the file or value, exit status 2,
before Inception is loaded; warnings for small sets and a swapped argument order; weights files that would
run code are refused; the sample set's own settings travel into the JSON report."""

import contextlib
import io
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import fid.weights
from _fid_reference import no_inception, pool_stats, uint8_images  # noqa: F401 (no_inception is a fixture)
from commands import run_command
from fid import evaluate, load_inception
from fid.__main__ import main
from fid.errors import InputError
from fid.inputs import FolderImages

REPOSITORY = Path(__file__).resolve().parents[1]


def jpeg_bytes(size: int = 16, seed: int = 0) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(uint8_images(1, size, seed)[0]).save(buffer, "JPEG")
    return buffer.getvalue()


def image_folder(folder: Path, count: int = 4, size: int = 16) -> Path:
    folder.mkdir()
    for i in range(count):
        (folder / f"{i:02d}.jpg").write_bytes(jpeg_bytes(size, seed=i))
    return folder


# ----------------------------------------------------------------------------------------------
# The table of input errors. Each case builds its inputs in tmp_path and returns the command's
# arguments and a text the one-line message must contain (the file or value at fault).
# ----------------------------------------------------------------------------------------------


def empty_set(tmp: Path):
    np.savez(tmp / "samples.npz", arr_0=np.zeros((0, 8, 8, 3), np.uint8))
    np.savez(tmp / "ref.npz", **pool_stats())
    return ["samples.npz", "ref.npz", "--metrics", "fid"], "samples.npz: 0 image(s)"


def single_image(tmp: Path):
    np.savez(tmp / "samples.npz", **pool_stats())
    np.savez(tmp / "ref.npz", arr_0=uint8_images(1))
    return ["samples.npz", "ref.npz", "--metrics", "fid"], "REF ref.npz: 1 image(s)"


def too_few_for_precision_recall(tmp: Path):
    np.savez(tmp / "samples.npz", arr_0=uint8_images(3))  # k = 3 neighbours need 4 images
    np.savez(tmp / "ref.npz", arr_0=uint8_images(10))
    return ["samples.npz", "ref.npz", "--metrics", "prc"], "samples.npz: 3 image(s); precision/recall with k=3"


def float_images(tmp: Path):
    np.savez(tmp / "samples.npz", arr_0=uint8_images(4).astype(np.float32))
    return ["samples.npz", "--save-stats", "stats.npz"], "samples.npz: 'arr_0' has dtype float32"


def channels_first(tmp: Path):
    np.savez(tmp / "samples.npz", arr_0=uint8_images(4).transpose(0, 3, 1, 2).copy())
    return ["samples.npz", "--save-stats", "stats.npz"], "samples.npz: 'arr_0' has shape (4, 3, 8, 8)"


def zero_batch_size(tmp: Path):
    np.savez(tmp / "samples.npz", arr_0=uint8_images(4))
    return ["samples.npz", "--save-stats", "stats.npz", "--batch-size", "0"], "--batch-size must be at least 1, got 0"


def jpeg_with_a_bad_header(tmp: Path):
    image_folder(tmp / "images")
    (tmp / "images" / "02.jpg").write_bytes(b"\xff\xd8 this is no JPEG header")
    return ["images", "--save-stats", "stats.npz"], "02.jpg: not a readable image"


def jpeg_cut_after_its_header(tmp: Path):
    image_folder(tmp / "images")
    data = jpeg_bytes(seed=9)
    (tmp / "images" / "03.jpg").write_bytes(data[: len(data) // 2])
    return ["images", "--save-stats", "stats.npz"], "03.jpg: not a readable image ("


def folder_of_mixed_sizes(tmp: Path):
    image_folder(tmp / "images")
    (tmp / "images" / "09.jpg").write_bytes(jpeg_bytes(size=24))
    return ["images", "--save-stats", "stats.npz"], "09.jpg: size (24, 24) differs"


def missing_file(tmp: Path):
    return ["nothing.npz", "--save-stats", "stats.npz"], "nothing.npz: no such file or folder"


def uncached_reference_batch(tmp: Path):
    np.savez(tmp / "samples.npz", **pool_stats())
    return (
        ["samples.npz", "imagenet256", "--metrics", "fid"],
        "imagenet256: the ADM reference batch is not in the cache",
    )


def unpublished_resolution(tmp: Path):
    np.savez(tmp / "samples.npz", **pool_stats())
    return (
        ["samples.npz", "imagenet300", "--metrics", "fid"],
        "imagenet300: ADM published ImageNet reference batches at 64, 128",
    )


def center_crop_of_npz_only(tmp: Path):
    np.savez(tmp / "samples.npz", arr_0=uint8_images(4))
    return ["samples.npz", "--save-stats", "s.npz", "--center-crop", "8"], "--center-crop 8 applies to image folders"


def unknown_metric(tmp: Path):
    np.savez(tmp / "samples.npz", arr_0=uint8_images(4))
    return ["samples.npz", "samples.npz", "--metrics", "fid,kid"], "unknown metrics ['kid']"


def missing_weights_file(tmp: Path):
    np.savez(tmp / "samples.npz", arr_0=uint8_images(4))
    return ["samples.npz", "--save-stats", "s.npz", "--weights", "inception.pth"], "inception.pth not found"


def device_this_machine_lacks(tmp: Path):
    """Issue 47: --device cuda on a machine without a GPU was torch's traceback, from Inception's loading."""
    np.savez(tmp / "samples.npz", arr_0=uint8_images(4))
    device = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU: on any machine, one it does not have
    return ["samples.npz", "--save-stats", "s.npz", "--device", device], f"--device {device}: this machine has"


INPUT_ERRORS = [
    empty_set,
    single_image,
    too_few_for_precision_recall,
    float_images,
    channels_first,
    zero_batch_size,
    jpeg_with_a_bad_header,
    jpeg_cut_after_its_header,
    folder_of_mixed_sizes,
    missing_file,
    uncached_reference_batch,
    unpublished_resolution,
    center_crop_of_npz_only,
    unknown_metric,
    device_this_machine_lacks,
]


@pytest.mark.parametrize("case", INPUT_ERRORS, ids=lambda case: case.__name__)
def test_input_error_is_one_line_with_exit_status_2_before_inception(case, tmp_path, monkeypatch, no_inception, capsys):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))  # an empty cache, never the user's
    arguments, expected = case(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit_:
        run_command(main, arguments)
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning: ")]
    assert len(errors) == 1 and errors[0].startswith("error: ") and expected in errors[0], errors
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, no cache folder made


def test_debug_keeps_the_traceback_of_an_input_error(tmp_path, monkeypatch, no_inception):
    arguments, expected = zero_batch_size(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=expected):
        main(arguments + ["--debug"])


def test_exit_status_of_the_command(tmp_path):
    arguments, expected = jpeg_cut_after_its_header(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "fid", *arguments],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPOSITORY), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()  # one line, no traceback
    assert line.startswith("error: images/03.jpg: not a readable image (") and line.endswith(
        "--skip-corrupt leaves such files out"
    )


# ----------------------------------------------------------------------------------------------
# Corrupt files in image folders: named at once, or left out with --skip-corrupt
# ----------------------------------------------------------------------------------------------


def truncated_bmp(path: Path) -> None:
    """A BMP cut in the middle: its header is valid and PIL's verify passes; only decoding finds the cut."""
    buffer = io.BytesIO()
    Image.fromarray(uint8_images(1, 16, seed=7)[0]).save(buffer, "BMP")
    path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])


def test_data_cut_that_only_decoding_finds_is_named_then(tmp_path):
    folder = image_folder(tmp_path / "images")
    truncated_bmp(folder / "01b.bmp")
    images = FolderImages(folder)  # the header check passes
    assert len(images) == 5
    with pytest.raises(InputError, match=r"01b\.bmp: not a readable image \(image file is truncated"):
        list(images.batches(2))


def test_skip_corrupt_leaves_out_each_unreadable_file_with_a_warning(tmp_path):
    folder = image_folder(tmp_path / "images")
    (folder / "00a.jpg").write_bytes(b"not an image")  # found by the header check
    data = jpeg_bytes(seed=5)
    (folder / "02a.jpg").write_bytes(data[: len(data) // 2])  # found by the check for the JPEG end marker
    truncated_bmp(folder / "03a.bmp")  # found at decode time
    with pytest.warns(UserWarning) as warned:
        images = FolderImages(folder, skip_corrupt=True)
        batches = list(images.batches(3))
    assert [w.message.args[0].split(": ")[0] for w in warned] == [
        str(folder / n) for n in ("00a.jpg", "02a.jpg", "03a.bmp")
    ]
    good = sorted(folder.glob("0?.jpg"))
    expected = np.stack([np.asarray(Image.open(path).convert("RGB")) for path in good])
    np.testing.assert_array_equal(np.concatenate(batches), expected)


# ----------------------------------------------------------------------------------------------
# Warnings: small sets, and SAMPLES / REF in ADM's order
# ----------------------------------------------------------------------------------------------


def test_small_sets_are_warned_about_before_inception_runs(tmp_path, no_inception, capsys):
    np.savez(tmp_path / "samples.npz", arr_0=uint8_images(2))
    np.savez(tmp_path / "ref.npz", arr_0=uint8_images(20, seed=1))
    with pytest.raises(AssertionError, match="Inception was loaded"):  # the warnings came first
        main([str(tmp_path / "samples.npz"), str(tmp_path / "ref.npz"), "--metrics", "fid"])
    warnings_ = capsys.readouterr().err.splitlines()
    assert len(warnings_) == 2 and all(line.startswith("warning: ") for line in warnings_)
    assert f"SAMPLES {tmp_path / 'samples.npz'}: 2 images; with fewer than 2048 per set FID is biased" in warnings_[0]
    assert f"REF {tmp_path / 'ref.npz'}: 20 images" in warnings_[1] and "rank <= 19" in warnings_[1]


def test_a_set_summarised_for_save_stats_alone_is_not_called_samples(tmp_path, no_inception, capsys):
    """`python -m fid REF_IMAGES --save-stats ref_stats.npz`, the way reference statistics are made."""
    np.savez(tmp_path / "reference.npz", arr_0=uint8_images(20))
    with pytest.raises(AssertionError, match="Inception was loaded"):
        main([str(tmp_path / "reference.npz"), "--save-stats", str(tmp_path / "stats.npz")])
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning.startswith(f"warning: --save-stats input {tmp_path / 'reference.npz'}: 20 images; with fewer")


def all_stats() -> dict[str, np.ndarray]:
    """pool_3 and spatial statistics: with --save-stats such a file needs no Inception and no Fréchet distance."""
    return {**pool_stats(), "mu_s": np.zeros(2023), "sigma_s": np.eye(2023)}


def test_no_small_set_warning_for_stored_statistics(tmp_path, no_inception, recwarn):
    np.savez(tmp_path / "samples.npz", **all_stats())
    evaluate(tmp_path / "samples.npz", None, [], save_stats=tmp_path / "copy.npz")
    assert not recwarn.list


def adm_reference_batch(path: Path, images: int = 8) -> None:
    np.savez(path, arr_0=uint8_images(images), **pool_stats())


@pytest.mark.parametrize("swapped", [True, False])
def test_a_reference_batch_given_first_is_warned_about(tmp_path, no_inception, swapped):
    adm_reference_batch(tmp_path / "VIRTUAL_imagenet64_labeled.npz")
    np.savez(tmp_path / "samples.npz", arr_0=uint8_images(8, seed=3))
    order = ["VIRTUAL_imagenet64_labeled.npz", "samples.npz"]
    samples, ref = (tmp_path / name for name in (order if swapped else order[::-1]))
    with pytest.warns(UserWarning) as warned, pytest.raises(AssertionError, match="Inception was loaded"):
        evaluate(samples, ref, ["fid", "prc"])
    about_order = [w for w in warned if "looks like an ADM reference batch" in str(w.message)]
    assert len(about_order) == (1 if swapped else 0)
    if swapped:
        assert "ADM's evaluator.py takes the reference first" in str(about_order[0].message)


# ----------------------------------------------------------------------------------------------
# Weights files never run code
# ----------------------------------------------------------------------------------------------


class Payload:
    """Unpickling this calls open(marker, "w"): a file appears when the pickle's code runs."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


WEIGHTS_FORMATS = ["torch.save", "pickle"]  # torch's zip format, and a bare pickle (torch's oldest format reads one)


def write_malicious_weights(path: Path, marker: Path, form: str) -> None:
    state = {"fc.weight": torch.zeros(1), "fc.bias": Payload(marker)}
    if form == "torch.save":
        torch.save(state, path)
    else:
        path.write_bytes(pickle.dumps(state, protocol=2))  # torch.save's protocol


@pytest.fixture(params=WEIGHTS_FORMATS)
def malicious_weights(request, tmp_path) -> tuple[Path, Path]:
    """A weights file whose unpickling would create `marker`."""
    marker, path = tmp_path / "code-ran", tmp_path / "evil.pth"
    write_malicious_weights(path, marker, request.param)
    return path, marker


@pytest.mark.parametrize("form", WEIGHTS_FORMATS)
def test_payload_of_the_malicious_file_is_real(tmp_path, form):
    marker = tmp_path / "code-ran"
    write_malicious_weights(tmp_path / "evil.pth", marker, form)
    with contextlib.suppress(Exception):  # torch-fidelity's torch.load(path, weights_only=False) runs it
        torch.load(tmp_path / "evil.pth", weights_only=False)
    assert marker.exists()


def test_load_inception_refuses_a_pickle_that_runs_code(malicious_weights):
    path, marker = malicious_weights
    with pytest.raises(InputError, match=r"evil\.pth: not a plain state dict of tensors") as error:
        load_inception(path, "cpu")
    assert "\n" not in str(error.value) and not marker.exists()


def test_cli_refuses_a_pickle_that_runs_code(malicious_weights, tmp_path, capsys):
    path, marker = malicious_weights
    np.savez(tmp_path / "samples.npz", arr_0=uint8_images(4))
    with pytest.raises(SystemExit) as exit_:
        run_command(
            main, [str(tmp_path / "samples.npz"), "--save-stats", str(tmp_path / "stats.npz"), "--weights", str(path)]
        )
    assert exit_.value.code == 2 and not marker.exists()
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"error: {path}: not a plain state dict")


def test_hub_cache_file_that_runs_code_is_refused(malicious_weights, tmp_path, monkeypatch):
    path, marker = malicious_weights
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.setattr(fid.weights, "_online", lambda: False)
    fid.weights.hub_cache_path().parent.mkdir(parents=True)
    fid.weights.hub_cache_path().write_bytes(path.read_bytes())
    with pytest.raises(InputError, match=f"{fid.weights.WEIGHTS_FILENAME}: not a plain state dict"):
        fid.weights.resolve_weights()
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------
# Provenance: the settings sample.py records beside its .npz go into the JSON report
# ----------------------------------------------------------------------------------------------


def test_json_report_carries_the_settings_of_the_samples(tmp_path, no_inception):
    np.savez(tmp_path / "samples.npz", **all_stats())
    settings = {"ckpt": "runs/x/exports/0001000", "cfg_scale": 1.5, "sampler": "ode", "steps": 50}
    (tmp_path / "samples.json").write_text(json.dumps({"settings": settings, "elapsed_s": 12.5}))
    main(
        [
            str(tmp_path / "samples.npz"),
            "--save-stats",
            str(tmp_path / "stats.npz"),
            "--json",
            str(tmp_path / "metrics.json"),
        ]
    )
    report = json.loads((tmp_path / "metrics.json").read_text())
    assert report["samples_settings"] == settings


def test_json_report_without_or_with_an_unreadable_settings_file(tmp_path, no_inception, capsys):
    np.savez(tmp_path / "samples.npz", **all_stats())
    arguments = [str(tmp_path / "samples.npz"), "--save-stats", str(tmp_path / "stats.npz")]
    assert "samples_settings" not in main(arguments)
    (tmp_path / "samples.json").write_text("{ cut")
    assert "samples_settings" not in main(arguments)
    assert "warning: " + str(tmp_path / "samples.json") + ": not a JSON object" in capsys.readouterr().err
