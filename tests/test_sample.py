"""sample.py, the command: its output files, 1 vs 2 processes, kill -9 and resume, argument checks, --protocol,
outputs of a killed run, a run folder as --ckpt, --overwrite, the disk space needed and the weights behind the
samples, on a tiny exported model. The modules it stands on have their own specifications: the labels and seeds
(tests/test_sample_plan.py), the shard plan and merge (tests/test_sample_file.py), the shard folder
(tests/test_shards.py), the pixels (tests/test_images.py), the generator and official checkpoints
(tests/test_generation.py)."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import sample
from _launch import (
    GLOO_THREADS_AT_EXIT,
    NO_GLOO_THREAD_AT_EXIT,
    TORCHRUN_TWO_PROCESSES,
    sample_env,
    with_gloo_probe,
)
from _tiny_models import EXPORT_CLASSES, tiny_export
from _user_errors import one_line_error
from atomic_files.ownership import ForeignFileError
from commands import UserError
from generation import ImageGenerator
from generation.sample_file import SampleFiles, SampleFilesError, plan_shards
from generation.sample_plan import assign_labels
from sample_arguments import SampleError

# ----------------------------------------------------------------------------------------------
# A huge --num-samples: its labels and shards planned lazily
# ----------------------------------------------------------------------------------------------


def test_a_huge_num_samples_plans_its_labels_and_shards_lazily(tmp_path, monkeypatch):
    # Before: every label was planned at once, np.arange(N) % K: 2 x 8 bytes per sample before the first sample
    # (16 GB for --num-samples 10**9; 1529 MiB before and 76 MiB after for 10**8 samples). Then the shard plan:
    # a Shard object and a file name per shard, lists of the unfinished ones, one stat and one glob per shard in
    # the claim (3.9 M shards of 256 here). Measured with this test's numbers: 1314 MiB before (with the globs
    # skipped: the old claim had not finished after 40 minutes on 2 shared cores), 3 MiB after, in 3 s.
    import tracemalloc

    import sample

    tiny_export(tmp_path / "export")

    class FirstSample(Exception):
        pass

    def first_sample(*_, **__):
        raise FirstSample

    # 10**9 8x8 samples fill 0.4 TB: a disk that large, so that the run gets as far as its first sample
    monkeypatch.setattr(shutil, "disk_usage", lambda path: types.SimpleNamespace(total=2**50, used=0, free=2**50))
    monkeypatch.setattr(sample, "try_sampler", lambda *_: None)
    monkeypatch.setattr(sample, "sample_shards", first_sample)
    out = tmp_path / "s.npz"
    tracemalloc.start()
    try:
        with pytest.raises(FirstSample):
            sample.main(["--ckpt", str(tmp_path / "export"), "--num-samples", str(10**9), "--out", str(out)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20, f"{peak / 2**20:.0f} MiB allocated before the first sample"
    assert (out.parent / "s.npz.shards" / "settings.json").is_file()  # the shard folder was claimed


# ----------------------------------------------------------------------------------------------
# End to end, on a tiny exported model (subprocesses: the command line, torchrun and kill -9 for real)
# ----------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
# 16 samples in 4 shards of 4, batches of 2 (a shard holds 2 batches); DDPM with fresh noise at every
# step and classifier-free guidance, so both the per-sample noise streams and guidance are exercised.
SAMPLING = ["--sampler", "ddpm", "--steps", "12", "--cfg-scale", "2", "--seed", "7"]
RUN = ["--num-samples", "16", "--shard-size", "4", "--per-proc-batch-size", "2", "--grid-size", "9", *SAMPLING]


def sample_command(export: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "sample.py"), "--ckpt", str(export), "--out", str(out), *RUN, *extra]


def run(command: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(command, env=sample_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def reference(export, tmp_path_factory) -> dict[str, np.ndarray]:
    """An uninterrupted one-process run."""
    out = tmp_path_factory.mktemp("reference") / "samples.npz"
    run(sample_command(export, out))
    with np.load(out) as data:
        return {"out": out, **{key: data[key] for key in data.files}}


def test_output_layout(reference, export):
    out = reference["out"]
    assert sorted(key for key in reference if key != "out") == ["arr_0", "arr_1"]
    images, labels = reference["arr_0"], reference["arr_1"]
    assert images.dtype == np.uint8 and images.shape == (16, 8, 8, 3)
    assert labels.dtype == np.int64
    np.testing.assert_array_equal(labels, np.arange(16) % EXPORT_CLASSES)  # balanced: label = index % classes
    np.testing.assert_array_equal(images[..., 0], images[..., 2])  # one channel repeated
    assert len({image.tobytes() for image in images}) == 16  # every sample has its own noise
    assert images.std() > 10  # real pictures, not a constant
    assert not SampleFiles(out).shards.exists() and not list(out.parent.glob(".*tmp*"))
    from PIL import Image

    from generation.images import class_grid_indices, save_class_grid

    rows = class_grid_indices(labels, 9)  # --grid-size 9 of 4 classes: every class, 3 samples each
    assert [(label, indices.tolist()) for label, indices in rows] == [
        (0, [0, 4, 8]),
        (1, [1, 5, 9]),
        (2, [2, 6, 10]),
        (3, [3, 7, 11]),
    ]
    expected = out.parent / "expected-grid.png"
    title = f"{export.name}: guidance 2, {SAMPLING[1]}, {SAMPLING[3]} steps"  # the folder, not its path
    save_class_grid([(label, images[indices]) for label, indices in rows], expected, title)
    assert np.array_equal(np.asarray(Image.open(out.with_suffix(".png"))), np.asarray(Image.open(expected)))
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["new_images"] == 16 and summary["images_per_process"] == [16]
    assert summary["settings"]["guidance"] == 2.0 and summary["precision"] == "fp32"  # the CPU default


# A thread that ends between the probe's listing of /proc/self/task and its read of the thread's name: the listing
# is made, then the (daemon) thread is ended and its entry waited out, then the stale listing is handed back.
THREAD_ENDS_AFTER_THE_LISTING = """
import os, threading, time
stop = threading.Event()
worker = threading.Thread(target=stop.wait, daemon=True)  # a daemon: still running when atexit's handlers run
worker.start()
listdir = os.listdir

def listdir_then_end_the_worker(path):
    listed = listdir(path)
    if path == "/proc/self/task" and str(worker.native_id) in listed:
        stop.set()
        worker.join()
        while str(worker.native_id) in listdir(path):
            time.sleep(0.01)
    return listed

os.listdir = listdir_then_end_the_worker
"""


def test_the_gloo_thread_probe_passes_over_a_thread_that_ended_after_its_listing(tmp_path):
    """Issue 47: test_two_processes_give_the_same_file failed on a loaded CI machine: the probe read the name of a
    thread that had ended since the listing (FileNotFoundError), and printed no line at all. The race, made
    certain: the probe still prints its line, and the ended thread is not in it (it no longer runs)."""
    script = tmp_path / "race.py"
    script.write_text(f"{GLOO_THREADS_AT_EXIT}{THREAD_ENDS_AFTER_THE_LISTING}")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == f"{NO_GLOO_THREAD_AT_EXIT}\n", done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_two_processes_give_the_same_file(export, reference, tmp_path):
    out = tmp_path / "samples.npz"
    (tmp_path / "probe").mkdir()
    probed = with_gloo_probe(REPO / "sample.py", tmp_path / "probe")  # sample.py, telling the threads left at exit
    done = run([*TORCHRUN_TWO_PROCESSES, str(probed), *sample_command(export, out, "--cpu")[2:]])
    assert done.stdout.count(NO_GLOO_THREAD_AT_EXIT) == 2, done.stdout  # the process group was freed before exit
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["images_per_process"] == [8, 8]  # 4 shards of 4, taken in turn: the work was split
    with np.load(out) as data:
        np.testing.assert_array_equal(data["arr_0"], reference["arr_0"])
        np.testing.assert_array_equal(data["arr_1"], reference["arr_1"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "sampler",
    [["--sampler", "sde-euler", "--steps", "6"], ["--sampler", "heun", "--steps", "3"]],
    ids=["sde-euler", "heun"],
)
def test_two_processes_give_the_same_sit_file_at_equal_thread_counts(sampler, tmp_path):
    """What docs/sampling.md promises for SiT's ODE and SDE: the same bytes from 1 and 2 processes when both run one
    thread per process (sample_env()) and the same per-process batch; the noise per sample is the same anyway."""
    export = tiny_export(tmp_path / "sit-export", family="SiT")
    command = [
        sys.executable,
        str(REPO / "sample.py"),
        "--ckpt",
        str(export),
        "--num-samples",
        "8",
        "--shard-size",
        "2",
        "--per-proc-batch-size",
        "2",
        "--grid-size",
        "0",
        "--cfg-scale",
        "2",
        *sampler,
    ]
    run([*command, "--out", str(tmp_path / "one.npz")])
    run([*TORCHRUN_TWO_PROCESSES, *command[1:], "--cpu", "--out", str(tmp_path / "two.npz")])
    with np.load(tmp_path / "one.npz") as one, np.load(tmp_path / "two.npz") as two:
        np.testing.assert_array_equal(one["arr_1"], two["arr_1"])
        np.testing.assert_array_equal(one["arr_0"], two["arr_0"])


def test_two_processes_without_cpu_flag_refuse_to_run_on_a_cpu_only_machine(export, tmp_path):
    out = tmp_path / "samples.npz"
    cpu_only = {**sample_env(), "CUDA_VISIBLE_DEVICES": ""}
    command = [*TORCHRUN_TWO_PROCESSES, *sample_command(export, out)[1:]]
    result = subprocess.run(command, env=cpu_only, capture_output=True, text=True, timeout=240)
    assert result.returncode != 0 and "Accelerate sees one: on a machine without GPUs add --cpu" in result.stderr
    assert result.stderr.count("Accelerate sees one") == 1, result.stderr  # rank 0 says it, once
    assert list(tmp_path.iterdir()) == []


def test_accelerate_launch_cpu_with_two_processes_is_refused_with_the_command_that_works(export, tmp_path):
    """Accelerate's --cpu launcher starts one process whatever --num_processes says; sampling alone would be
    right but N times slower than asked, so the command says how to get N CPU processes."""
    out = tmp_path / "samples.npz"
    accelerate = Path(sys.executable).parent / "accelerate"
    command = [str(accelerate), "launch", "--cpu", "--num_processes", "2", *sample_command(export, out, "--cpu")[1:]]
    result = subprocess.run(command, env=sample_env(), capture_output=True, text=True, timeout=240)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and errors == [
        "error: accelerate launch --num_processes 2 started one process (with --cpu, Accelerate uses its "
        "single-process launcher); for 2 CPU processes run `torchrun --nproc_per_node 2 sample.py ... --cpu`"
    ], result.stderr
    assert list(tmp_path.iterdir()) == []


def test_killed_run_resumes_without_redoing_finished_shards(export, reference, tmp_path):
    out = tmp_path / "samples.npz"
    folder = SampleFiles(out).shards
    process = subprocess.Popen(
        sample_command(export, out), env=sample_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 180
    while not list(folder.glob("shard-*.npz")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    finished = sorted(folder.glob("shard-*.npz"))
    assert 1 <= len(finished) < 4 and not out.exists(), "the kill must land after the first shard"

    # The finished shards hold what the uninterrupted run made; mark them (invert their pixels): the
    # rerun must keep them, not sample them again, and add the rest exactly as the uninterrupted run.
    expected = reference["arr_0"].copy()
    for path in finished:
        with np.load(path) as data:
            shard = dict(data)
        np.testing.assert_array_equal(shard["arr_0"], reference["arr_0"][shard["index"]])
        shard["arr_0"] = 255 - shard["arr_0"]
        np.savez(path, **shard)
        expected[shard["index"]] = 255 - expected[shard["index"]]
    result = run(sample_command(export, out))
    assert f"resuming, {len(finished)} of 4 shards" in result.stdout
    assert json.loads(out.with_suffix(".json").read_text())["new_images"] == 16 - 4 * len(finished)
    with np.load(out) as data:
        np.testing.assert_array_equal(data["arr_0"], expected)
        np.testing.assert_array_equal(data["arr_1"], reference["arr_1"])


# ----------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, before anything heavy, nothing written
# ----------------------------------------------------------------------------------------------


def written(out: Path) -> list[Path]:
    return [path for path in out.parent.iterdir() if path.name.startswith((out.stem, f".{out.stem}"))]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"--ckpt": "missing-export"}, "--ckpt: missing-export: no such file"),
        ({"--num-samples": "0"}, "--num-samples must be positive"),
        ({"--shard-size": "-3"}, "--shard-size must be positive"),
        ({"--out": "samples.npy"}, "ending in .npz"),
        (  # a missing --out folder is made, but only once the arguments and the checkpoint are good
            {"--out": "no-such-folder/samples.npz", "--sampler": "euler"},
            "--sampler 'euler': this checkpoint's objective offers",
        ),
        ({"--out": "no-such-folder/samples.npz", "--ckpt": "missing-export"}, "--ckpt: missing-export: no such file"),
        (
            {"--sampler": "euler"},
            "--sampler 'euler': this checkpoint's objective offers ddpm, ddim, dpm\\+\\+2m, unipc",
        ),
        ({"--guidance-channels": "2"}, "--guidance-channels 2: the model predicts only 1 channels"),
        ({"--guidance-interval": ["500", "100"]}, "--guidance-interval 500.0 100.0: expected LO < HI"),
        ({"--cfg-scale": "-1"}, "--cfg-scale must be a finite number >= 0"),
        ({"--vae": "stabilityai/sd-vae-ft-ema"}, "--vae .* pixel space"),
        ({"--model": "DiT-S/2"}, "--model and --image-size are only for official .pt checkpoints"),
        ({"--protocol": "sit"}, r"--protocol sit: made for SiT models, but .* is a DiT model; use dit"),
        ({"--protocol": "dit"}, "--guidance-channels 3: the model predicts only 1 channels"),  # the preset is checked
    ],
)
def test_bad_arguments_fail_clearly_and_write_nothing(export, tmp_path, monkeypatch, change, message):
    monkeypatch.chdir(tmp_path)
    arguments = {"--ckpt": str(export), "--out": "samples.npz", "--num-samples": "8", **change}
    argv = [
        item for key, value in arguments.items() for item in [key, *(value if isinstance(value, list) else [value])]
    ]
    with pytest.raises(UserError, match=message):
        sample.main(argv)
    assert not list(tmp_path.iterdir())


def test_out_into_a_missing_folder_makes_it(export, tmp_path, capsys):
    """As DiT's sampler does (os.makedirs); before, sample.py refused it. A folder that cannot be made (a file on
    the way) is one line."""
    out = tmp_path / "new" / "nested" / "samples.npz"
    sample.main(["--ckpt", str(export), "--out", str(out), "--num-samples", "2", "--steps", "2"])
    with np.load(out) as data:
        assert data["arr_0"].shape == (2, 8, 8, 3)
    (tmp_path / "file").write_text("")
    argv = ["--ckpt", str(export), "--out", str(tmp_path / "file" / "s.npz"), "--num-samples", "2"]
    assert "is a file, not a folder" in one_line_error(sample.main, argv, capsys)


def test_the_sampler_is_checked_against_the_objectives_table_without_building_an_objective(tmp_path, monkeypatch):
    """sample.py's check of --sampler reads the checkpoint's objective kind in the objectives table (the table that
    --help lists): the same one line, with no objective built only to list its sampler names."""
    import generation.objective_builder
    from dit_vca.model_spec import ModelSpec
    from objectives import SAMPLERS, TransportSpec
    from sample_arguments import check_against, parse_args

    unbuilt = lambda spec: pytest.fail("an objective was built")  # noqa: E731
    monkeypatch.setattr(generation.objective_builder, "create_objective", unbuilt)
    sit = types.SimpleNamespace(model=ModelSpec("SiT-S/2"), objective=TransportSpec(), has_null_class=True, channels=4)
    args = parse_args(["--ckpt", "x", "--out", str(tmp_path / "s.npz"), "--num-samples", "1", "--sampler", "ddpm"])
    offered = ", ".join(SAMPLERS["transport"].names)
    with pytest.raises(SampleError, match=f"^--sampler 'ddpm': this checkpoint's objective offers {offered}$"):
        check_against(sit, args)
    args.sampler = "sde-heun"
    check_against(sit, args)  # one of the table's


def test_only_a_sampler_option_error_of_the_trial_sample_is_one_line(export, tmp_path, monkeypatch):
    """The trial sample answers the samplers' own option check in one line; any other error there is a bug and
    keeps its traceback (it is not dressed up as a bad option); nothing is written either way."""
    from samplers.interface import SamplerOptionError

    argv = ["--ckpt", str(export), "--out", str(tmp_path / "s.npz"), "--num-samples", "4", "--sampler", "ddim"]
    for error, expected in (
        (SamplerOptionError("DDIM eta must be >= 0"), SampleError),
        (ValueError("a bug"), ValueError),
    ):

        def generate(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(ImageGenerator, "generate", generate)
        with pytest.raises(expected) as raised:
            sample.main(argv)
        assert str(error) in str(raised.value)
        assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("flag", ["--cfg-scale", "--guidance-scale"])
def test_a_guidance_scale_that_overflows_is_one_line(export, tmp_path, capsys, one_thread, flag):
    # Before: FloatingPointError("images contain NaN or infinite values") with its traceback.
    guide = ["--guide-ckpt", str(tiny_export(tmp_path / "guide", seed=1))] if flag == "--guidance-scale" else []
    out = tmp_path / "out" / "s.npz"
    out.parent.mkdir()
    argv = ["--ckpt", str(export), "--num-samples", "2", "--out", str(out), "--steps", "2", *guide, flag, "1e300"]
    error = one_line_error(sample.main, argv, capsys)
    assert error.startswith(f"error: {flag} 1e+300: sample 0 comes out NaN or infinite at this scale; expected")
    assert list(out.parent.iterdir()) == []


def test_guidance_needs_a_null_class(tmp_path):
    export = tmp_path / "export"
    tiny_export(export, class_dropout_prob=0.0)
    with pytest.raises(SampleError, match="--cfg-scale 2.0: the model was trained without label dropout"):
        sample.main(["--ckpt", str(export), "--out", str(tmp_path / "s.npz"), "--num-samples", "4", "--cfg-scale", "2"])
    assert written(tmp_path / "s.npz") == []


def test_official_checkpoint_needs_a_valid_model_name(tmp_path):
    checkpoint = tmp_path / "my-model.pt"  # a name that does not say the architecture
    torch.save({}, checkpoint)
    out = tmp_path / "s.npz"
    with pytest.raises(SampleError, match="my-model.pt: name its architecture with --model"):
        sample.main(["--ckpt", str(checkpoint), "--out", str(out), "--num-samples", "4"])
    with pytest.raises(SampleError, match="--model 'DiT-XXL/2': expected one of DiT-S/1, DiT-S/2, "):
        sample.main(["--ckpt", str(checkpoint), "--model", "DiT-XXL/2", "--out", str(out), "--num-samples", "4"])
    with pytest.raises(SampleError, match="my-model.pt has no final_layer.linear.weight"):
        sample.main(["--ckpt", str(checkpoint), "--model", "DiT-S/2", "--out", str(out), "--num-samples", "4"])
    assert written(out) == []


def test_finished_output_is_kept(reference, export, capsys):
    out = reference["out"]
    before = out.stat().st_mtime_ns
    sample.main(sample_command(export, out)[2:])  # the same run again: nothing to do
    assert "already complete" in capsys.readouterr().out
    with pytest.raises(SampleFilesError, match="run with seed=7, not 8"):
        sample.main([*sample_command(export, out)[2:], "--seed", "8"])
    assert out.stat().st_mtime_ns == before


def test_foreign_output_is_kept(export, tmp_path):
    out = tmp_path / "samples.npz"
    np.savez(out, arr_0=np.zeros((1, 8, 8, 3), np.uint8))
    with pytest.raises(ForeignFileError, match="exists and was not written by sample.py"):
        sample.main(sample_command(export, out)[2:])
    assert np.load(out)["arr_0"].shape == (1, 8, 8, 3)


# ----------------------------------------------------------------------------------------------
# --protocol: the settings of the official evaluations, explicit flags winning
# ----------------------------------------------------------------------------------------------

MINIMAL = ["--out", "samples.npz", "--num-samples", "50000"]  # after --ckpt EXPORT
# Written from the official evaluation scripts (DiT and SiT sample_ddp.py with the settings of their FID tables),
# not from generation/protocols.py: uniform labels, guidance on 3 channels at scale 1.5, and the sampler.
OFFICIAL = {
    "dit": {"labels": "uniform", "guidance": 1.5, "guidance_channels": 3, "sampler": "ddpm", "steps": 250},
    "sit": {
        "labels": "uniform",
        "guidance": 1.5,
        "guidance_channels": 3,
        "sampler": "sde-euler",
        "steps": 250,
        "diffusion_form": "sigma",
        "diffusion_norm": 1.0,
        "last_step": "Mean",
        "last_step_size": 0.04,
    },
    "sit-ode": {
        "labels": "uniform",
        "guidance": 1.5,
        "guidance_channels": 3,
        "sampler": "dopri5",
        "steps": None,
        "atol": 1e-6,
        "rtol": 1e-3,
    },
    # LightningDiT (hustvl/LightningDiT at 2725fed): inference.py draws labels with torch.randint, its
    # forward_with_cfg guides channels [:3] only where t >= cfg_interval_start, transport/integrators.py's ode takes
    # num_sampling_steps 250 grid points, shifted by timestep_shift 0.3, through torchdiffeq's euler; the cfg scale
    # and interval start of configs/reproductions/lightningdit_xl_vavae_f16d32_{800ep,64ep}_cfg.yaml.
    "lightningdit": {
        "labels": "uniform",
        "guidance": 6.7,
        "guidance_channels": 3,
        "guidance_interval": [0.125, 1.0],
        "sampler": "euler",
        "steps": 249,
        "time_shift": 0.3,
    },
    "lightningdit-64ep": {
        "labels": "uniform",
        "guidance": 10.0,
        "guidance_channels": 3,
        "guidance_interval": [0.1, 1.0],
        "sampler": "euler",
        "steps": 249,
        "time_shift": 0.3,
    },
}


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_protocol_sets_the_official_settings(export, name):
    settings = sample.run_settings(sample.parse_args(["--ckpt", str(export), *MINIMAL, "--protocol", name]))
    assert settings["protocol"] == name
    assert {key: settings.get(key) for key in OFFICIAL[name]} == OFFICIAL[name]
    unset = set(sample.SAMPLER_OPTIONS) - set(OFFICIAL[name])
    assert all(key not in settings for key in unset)  # nothing else is passed on to the sampler
    if "guidance_interval" not in OFFICIAL[name]:
        assert settings["guidance_interval"] is None


def test_explicit_flags_win_over_the_protocol(export):
    args = sample.parse_args(
        [
            "--ckpt",
            str(export),
            *MINIMAL,
            "--protocol",
            "sit",
            "--cfg-scale",
            "1",
            "--labels",
            "balanced",
            "--steps",
            "100",
            "--last-step",
            "Euler",
        ]
    )
    settings = sample.run_settings(args)
    assert (settings["guidance"], settings["labels"], settings["steps"], settings["last_step"]) == (
        1.0,
        "balanced",
        100,
        "Euler",
    )
    assert (settings["sampler"], settings["guidance_channels"], settings["last_step_size"]) == ("sde-euler", 3, 0.04)


def test_without_a_protocol_the_plain_defaults_apply(export):
    settings = sample.run_settings(sample.parse_args(["--ckpt", str(export), *MINIMAL]))
    assert "protocol" not in settings  # the settings of runs from before protocols existed still match
    assert (settings["labels"], settings["guidance"], settings["guidance_channels"], settings["sampler"]) == (
        "balanced",
        1.0,
        None,
        None,
    )


def test_protocol_run_records_the_protocol_and_resolved_settings(export, tmp_path, capsys):
    out = tmp_path / "samples.npz"
    sample.main(
        [
            "--ckpt",
            str(export),
            "--out",
            str(out),
            "--num-samples",
            "4",
            "--grid-size",
            "0",
            "--protocol",
            "dit",
            "--guidance-channels",
            "1",
            "--steps",
            "3",
        ]
    )
    settings = json.loads(out.with_suffix(".json").read_text())["settings"]
    assert (settings["protocol"], settings["labels"], settings["guidance"], settings["sampler"]) == (
        "dit",
        "uniform",
        1.5,
        "ddpm",
    )
    assert (settings["steps"], settings["guidance_channels"]) == (3, 1)  # given on the command line
    assert (  # and the command said what the protocol resolved to
        "sample.py: --protocol dit: --labels uniform --cfg-scale 1.5 --guidance-channels 1 (given; the protocol's 3) "
        "--sampler ddpm --steps 3 (given; the protocol's 250)\n" in capsys.readouterr().out
    )
    with np.load(out) as data:
        np.testing.assert_array_equal(data["arr_1"], assign_labels(4, EXPORT_CLASSES, "uniform", seed=0))


# ----------------------------------------------------------------------------------------------
# Outputs of a killed run: stale temporaries, a shard damaged on disk before the merge
# ----------------------------------------------------------------------------------------------


def test_stale_temporaries_of_the_outputs_are_removed(export, reference, tmp_path, one_thread):
    out = tmp_path / "samples.npz"
    stale = [tmp_path / f".samples.{suffix}.tmp-999999999" for suffix in ("npz", "json", "png")]  # a dead writer
    for path in stale:
        path.write_bytes(b"half a file")
    other = tmp_path / ".notes.txt.tmp-999999999"  # not an output of this command: kept
    other.write_bytes(b"someone else's")
    sample.main(sample_command(export, out)[2:])
    assert not any(path.exists() for path in stale) and other.exists()
    with np.load(out) as data:
        np.testing.assert_array_equal(data["arr_0"], reference["arr_0"])


def test_a_shard_damaged_before_the_merge_is_named_and_sampled_again(
    export, reference, tmp_path, monkeypatch, capsys, one_thread
):
    out = tmp_path / "samples.npz"
    argv = sample_command(export, out)[2:]
    with monkeypatch.context() as patch:
        patch.setattr(sample, "finish", lambda *args: None)  # stops after the shards, before the merge
        sample.main(argv)
    from accelerate.state import PartialState

    PartialState._reset_state()
    shard = plan_shards(16, 4)[1]
    path = SampleFiles(out).shards / shard.file_name
    path.write_bytes(path.read_bytes()[:100])  # cut on disk
    capsys.readouterr()
    sample.main(argv)
    printed = capsys.readouterr().out
    assert f"{shard.file_name}" in printed and "sampling shard 1 again" in printed
    with np.load(out) as data:
        np.testing.assert_array_equal(data["arr_0"], reference["arr_0"])  # the same samples as a clean run
    assert not SampleFiles(out).shards.exists()


def test_a_rerun_after_a_killed_merge_keeps_the_summary_of_the_launch_that_sampled(
    export, tmp_path, monkeypatch, capsys, one_thread
):
    # Before: the rerun sampled nothing and replaced the summary by "new_images": 0, "seconds": 0.0 and printed
    # "0 images in 0.0 s".
    out = tmp_path / "samples.npz"
    argv = ["--ckpt", str(export), "--out", str(out), *RUN]

    def killed(*args):
        raise KeyboardInterrupt  # where a kill -9 would stop it: the summary and grid written, no .npz

    with monkeypatch.context() as patch:
        patch.setattr(sample, "merge_shards", killed)
        with pytest.raises(KeyboardInterrupt):
            sample.main(argv)
    from accelerate.state import PartialState

    PartialState._reset_state()
    sampled = json.loads(out.with_suffix(".json").read_text())
    assert sampled["new_images"] == 16 and sampled["seconds"] > 0 and not out.exists()
    capsys.readouterr()
    sample.main(argv)
    printed = capsys.readouterr().out
    assert f"sample.py: all 16 samples were sampled by an earlier launch; merged into {out}" in printed
    assert json.loads(out.with_suffix(".json").read_text()) == sampled
    with np.load(out) as data:
        assert data["arr_0"].shape == (16, 8, 8, 3)


# ----------------------------------------------------------------------------------------------
# A run folder as --ckpt; --overwrite
# ----------------------------------------------------------------------------------------------


def test_a_run_folder_is_sampled_from_its_newest_export_which_is_printed_and_recorded(
    export, tmp_path, capsys, one_thread
):
    import shutil

    run_dir = tmp_path / "run"
    for step in (2, 5):  # two checkpoints, as training leaves them
        folder = run_dir / "checkpoints" / f"step-{step:07d}" / "export"
        shutil.copytree(export, folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "train_step": step}))
        (folder.parent / "trainer_state.json").write_text("{}")  # complete
    out = tmp_path / "samples.npz"
    sample.main(["--ckpt", str(run_dir), "--out", str(out), "--num-samples", "2", "--grid-size", "0", *SAMPLING])
    newest = (run_dir / "checkpoints" / "step-0000005" / "export").resolve()
    assert f"sample.py: --ckpt {run_dir}: using {newest} (training step 5)" in capsys.readouterr().out
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["train_step"] == 5 and summary["settings"]["export"] == str(newest)


def test_overwrite_replaces_only_what_an_earlier_sample_run_wrote(export, tmp_path, capsys, one_thread):
    out = tmp_path / "samples.npz"
    command = ["--ckpt", str(export), "--out", str(out), "--num-samples", "4", "--grid-size", "4", *SAMPLING]
    sample.main([*command, "--seed", "1"])
    first = np.load(out)["arr_0"]
    (tmp_path / "notes.txt").write_text("the user's own file")
    shards = SampleFiles(out).shards  # the shard folder of a third run, killed after one shard
    shards.mkdir()
    (shards / "settings.json").write_text(json.dumps({"seed": 5}))
    (shards / "shard-000000.npz").write_bytes(b"another run's shard")
    with pytest.raises(SampleFilesError, match="run with seed=1, not 2"):
        sample.main([*command, "--seed", "2"])
    capsys.readouterr()
    sample.main([*command, "--seed", "2", "--overwrite"])
    assert (
        "--overwrite: removed samples.npz, samples.png, samples.json of a run with other settings"
        in capsys.readouterr().out
    )
    assert json.loads(out.with_suffix(".json").read_text())["settings"]["seed"] == 2
    assert not np.array_equal(np.load(out)["arr_0"], first) and not shards.exists()
    assert (tmp_path / "notes.txt").read_text() == "the user's own file"
    foreign = tmp_path / "foreign.npz"  # a summary sample.py did not write stays, --overwrite or not
    foreign.with_suffix(".json").write_text('{"mine": true}')
    with pytest.raises(ForeignFileError, match="foreign.json exists and was not written by sample.py"):
        sample.main([*command[:2], "--out", str(foreign), *command[4:], "--overwrite"])
    assert foreign.with_suffix(".json").read_text() == '{"mine": true}'


def test_help_lists_each_objectives_samplers_with_their_default_steps(capsys):
    """`sample.py --help` names every sampler of both objectives, each fixed-step one with its default step count
    (the count the objective samples with when --steps is not given), and each objective's default sampler."""
    import re

    from dit_vca import create_diffusion
    from objectives import SAMPLERS
    from sit_vca import create_transport

    with pytest.raises(SystemExit):
        sample.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse's line breaks aside
    for objective, table in ((create_diffusion(), SAMPLERS["diffusion"]), (create_transport(), SAMPLERS["transport"])):
        listed = text.partition(f"{table.objective}: ")[2]
        for other in SAMPLERS.values():  # up to the next objective's list
            listed = listed.partition(f"; {other.objective}: ")[0]
        for name in objective.sampler_names:
            steps = table.steps[name]
            shown = re.escape(name) + (r"(?: \(default\))?" + (rf" {steps}\b" if steps is not None else ""))
            assert re.search(shown, listed), (name, steps)
        assert f"{objective.default_sampler} (default)" in listed


def test_help_lists_the_sde_and_shift_options_choices_and_defaults(capsys):
    """--diffusion-form, --last-step list their choices; each SDE option and --time-shift its default, read from
    the table the samplers use (objectives.py); a value outside the choices is refused by the parser."""
    from objectives import DEFAULT_SDE, DIFFUSION_FORMS

    with pytest.raises(SystemExit):
        sample.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split()).partition(" options: ")[2]  # the options, not the usage
    assert "--diffusion-form {" + ",".join(DIFFUSION_FORMS) + "}" in text
    assert "--last-step {Mean,Tweedie,Euler}" in text
    for flag, default in [
        ("--diffusion-form", DEFAULT_SDE["diffusion_form"]),
        ("--diffusion-norm", "1"),
        ("--last-step", DEFAULT_SDE["last_step"]),
        ("--last-step-size", "0.04"),
        ("--time-shift", "1: none"),
    ]:
        described = text.partition(f"{flag} ")[2].partition(" --")[0]
        assert f"default {default}" in described, (flag, described)
    error = one_line_error(sample.main, [*MINIMAL, "--last-step", "Median"], capsys)
    assert "--last-step: invalid choice: 'Median' (choose from 'Mean', 'Tweedie', 'Euler')" in error


@pytest.mark.parametrize("value", ["0", "-0.3", "nan"])
def test_a_time_shift_that_is_not_positive_is_one_line(value, capsys):
    error = one_line_error(sample.main, ["--ckpt", "export", *MINIMAL, "--time-shift", value], capsys)
    assert f"--time-shift must be a finite number > 0 (1: no shift), got {float(value)}" in error


# ----------------------------------------------------------------------------------------------
# Disk space: a run that cannot fit is refused before the model is built
# ----------------------------------------------------------------------------------------------


def test_a_run_that_fits_only_without_its_small_files_and_block_rounding_is_refused_up_front(
    export, tmp_path, monkeypatch, capsys
):
    # Before: 2500 8x8 samples were estimated at 1,031,264 bytes, and on a real 1 MiB tmpfs the merge found the
    # disk full after sampling (shards rounded up to 4 KiB pages, the summary and the grid: 1,081,344 bytes).
    # Now 1,142,784 with 4 KiB units: on a tmpfs of exactly that size the run completes, a page less is refused.
    from generation import ImageGenerator

    def build(*_, **__):
        raise AssertionError("the model was built")

    out = tmp_path / "out" / "s.npz"
    out.parent.mkdir()
    monkeypatch.setattr(shutil, "disk_usage", lambda path: types.SimpleNamespace(total=1 << 20, used=0, free=1 << 20))
    monkeypatch.setattr(ImageGenerator, "from_export", build)
    argv = ["--ckpt", str(export), "--num-samples", "2500", "--out", str(out)]
    error = one_line_error(sample.main, argv, capsys)
    assert re.fullmatch(
        r"error: --num-samples 2500: 8x8 images need [\d,]+ bytes .*, but 1,048,576 are free; .*", error
    )
    assert list(out.parent.iterdir()) == []


def test_a_run_that_cannot_fit_on_its_disk_is_refused_before_the_model_is_built(tmp_path, monkeypatch, capsys):
    # Before: sampling went on until a shard, or the merge at the very end, found the disk full. 1000 8x8 samples
    # are 192,000 bytes of images, in the shards and again in the merged .npz (both on the disk until the merge
    # ends): a disk with room for the .npz alone (about 200 kB) is refused too, naming both byte counts.
    import sample
    from commands import USER_ERROR_STATUS, run_command
    from generation import ImageGenerator
    from generation.images import grid_bytes

    tiny_export(tmp_path / "export")
    out = tmp_path / "out" / "s.npz"
    out.parent.mkdir()

    def build(*_, **__):
        raise AssertionError("the model was built")

    monkeypatch.setattr(shutil, "disk_usage", lambda path: types.SimpleNamespace(total=10**6, used=0, free=300_000))
    monkeypatch.setattr(ImageGenerator, "from_export", build)
    with pytest.raises(SystemExit) as exited:
        run_command(sample.main, ["--ckpt", str(tmp_path / "export"), "--num-samples", "1000", "--out", str(out)])
    assert exited.value.code == USER_ERROR_STATUS
    error = capsys.readouterr().err
    line = re.fullmatch(
        r"error: --num-samples 1000: 8x8 images need ([\d,]+) bytes .*, but 300,000 are free; .*\n", error
    )
    assert line is not None, error
    images_twice, labels_and_indices = 2 * 1000 * 8 * 8 * 3, 3 * 8 * 1000
    # + the labelled grid of 64 8x8 tiles (grid_bytes: its own bound, tested in test_grids), and at most:
    # the summary and settings records (16 KiB each), each of these 9 files and the shard folder rounded up to the
    # disk's unit (4 KiB: 40,960), the files' headers (4 KiB)
    rest = int(line.group(1).replace(",", "")) - images_twice - labels_and_indices - grid_bytes(64, 8)
    assert 0 <= rest < 2 * 16 * 1024 + 10 * 4096 + 4096
    assert list(out.parent.iterdir()) == []  # no shard folder, nothing written


def test_the_space_needed_leaves_out_what_a_resumed_run_wrote_already(tmp_path, monkeypatch):
    import sample
    from atomic_files import allocation_unit
    from generation.sample_file import SampleFiles, allocated, run_bytes

    out = tmp_path / "s.npz"
    args = types.SimpleNamespace(num_samples=1000, shard_size=256, grid_size=0, out=out)
    files = SampleFiles(out)
    files.shards.mkdir()
    (files.shards / "shard-000000.npz").write_bytes(bytes(50_000))  # a finished shard (its size is what counts)
    unit = allocation_unit(tmp_path)
    needed, kept = run_bytes(1000, 8, 256, unit=unit), allocated(50_000, unit)  # the shard's whole units
    for free, refused in ((needed - kept, False), (needed - kept - 1, True)):
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: types.SimpleNamespace(free=free))
        if refused:
            with pytest.raises(SampleError, match=f"need {needed - kept:,} bytes"):
                sample.check_disk_space(args, 8, files)
        else:
            sample.check_disk_space(args, 8, files)


# ----------------------------------------------------------------------------------------------
# Which weights a run's samples came from (issue 47)
# ----------------------------------------------------------------------------------------------

QUICK = ["--num-samples", "4", "--shard-size", "2", "--per-proc-batch-size", "2", "--grid-size", "0", "--sampler"]
QUICK += ["ddim", "--steps", "2"]


def test_an_export_replaced_in_place_is_never_taken_for_the_one_that_made_the_samples(tmp_path, monkeypatch, capsys):
    """Issue 47: an export replaced in place (same path, other weights) counted as the same run: a finished output
    was "already complete", and an interrupted one resumed with the old weights' shards, so one .npz held two
    models' samples. The weights' sha256 is a setting of the run: both are another run's, refused in one line."""
    export = tiny_export(tmp_path / "export", seed=0)
    done = tmp_path / "done.npz"
    sample.main(["--ckpt", str(export), "--out", str(done), *QUICK])
    settings = json.loads(done.with_suffix(".json").read_text())["settings"]
    assert len(settings["weights_sha256"]) == 64
    tiny_export(export, seed=1)  # other weights at the same path
    with pytest.raises(SampleFilesError, match="weights_sha256='[0-9a-f]{64}', not '[0-9a-f]{64}'"):
        sample.main(["--ckpt", str(export), "--out", str(done), *QUICK])
    assert "already complete" not in capsys.readouterr().out

    cut = tmp_path / "cut.npz"  # stopped before the merge: its shards and their settings.json stay
    with monkeypatch.context() as patch:
        patch.setattr(sample, "finish", lambda *arguments: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            sample.main(["--ckpt", str(export), "--out", str(cut), *QUICK])
    assert sorted(path.name for path in (tmp_path / "cut.npz.shards").glob("shard-*")) == [
        "shard-000000.npz",
        "shard-000001.npz",
    ]
    tiny_export(export, seed=2)
    with pytest.raises(SampleError, match="cut.npz.shards belongs to a run with weights_sha256="):
        sample.main(["--ckpt", str(export), "--out", str(cut), *QUICK])
    assert not cut.exists()


def test_a_stop_between_the_merge_and_its_clean_up_leaves_no_shard_folder(tmp_path, monkeypatch, capsys):
    """Issue 47: a preemption after the merged .npz took its name but before the shards were removed left
    <out>.shards/ for good (9.8 GB at 50K 256-px images): the next run found the samples complete and stopped. It
    removes them."""
    export = tiny_export(tmp_path / "export")
    out = tmp_path / "samples.npz"

    def stopped(folder, **options):
        raise KeyboardInterrupt  # the signal lands just after the rename

    with monkeypatch.context() as patch:
        patch.setattr(sample, "shutil", types.SimpleNamespace(rmtree=stopped))
        with pytest.raises(KeyboardInterrupt):
            sample.main(["--ckpt", str(export), "--out", str(out), *QUICK])
    assert out.is_file() and (tmp_path / "samples.npz.shards").is_dir()
    sample.main(["--ckpt", str(export), "--out", str(out), *QUICK])
    assert "already complete" in capsys.readouterr().out
    assert not (tmp_path / "samples.npz.shards").exists()
