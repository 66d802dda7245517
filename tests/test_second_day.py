"""Faults of the second day (issue 32): folders in use, odd inputs checked at start-up, cosmetic messages."""

import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_a_claimed_shard_folder_names_the_process_that_holds_it(tmp_path):
    # sample.py, training.latents and train.py share one lock (atomic_files.folder_lock); each refusal names the
    # process, as /proc/locks lists it.
    from atomic_files.shards import ShardFolder

    folder = ShardFolder(tmp_path / "out.shards", ["shard-0.npz"], {"seed": 0})
    folder.claim()
    try:
        second = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from atomic_files.shards import ShardFolder\n"
                "try:\n    ShardFolder(sys.argv[1], ['shard-0.npz'], {'seed': 0}).claim()\n"
                "except Exception as error:\n    print(error)",
                str(tmp_path / "out.shards"),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        folder.release()
    assert f"is being written by another run right now (process {os.getpid()})" in second.stdout, second.stderr


def test_a_nan_in_a_latent_shard_stops_training_naming_the_shard_in_one_line(tmp_path):
    # Before: the run went on to "loss is not finite ... try a lower train.lr". Through a loader worker, torch wraps
    # the error in the worker's traceback: the command still prints the error's own line.
    from safetensors.torch import load_file, save_file

    from test_faults import latent_run, latent_shards

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


def test_the_read_only_error_names_the_folder_not_the_probe(tmp_path, monkeypatch):
    import errno

    from atomic_files import OutputError, check_writable
    from faults import failing_writes

    failing_writes(monkeypatch, errno.EROFS)
    try:
        check_writable(tmp_path)
    except OutputError as error:
        assert str(error) == f"cannot write {tmp_path}: read-only file system; choose a writable place"
    else:
        raise AssertionError("the read-only folder was not found")
    assert list(tmp_path.iterdir()) == []


def test_written_files_take_the_umasks_mode(tmp_path):
    # safetensors creates its files 0o600 whatever the umask (before: so were every export and checkpoint).
    import torch
    from safetensors.torch import save_file

    from atomic_files import atomic_folder, atomic_output

    previous = os.umask(0o002)  # a group-shared run directory
    try:
        with atomic_output(tmp_path / "ema.safetensors") as temporary:
            save_file({"w": torch.zeros(2)}, temporary)
        with atomic_folder(tmp_path / "checkpoint") as folder:
            save_file({"w": torch.zeros(2)}, folder / "model.safetensors")
    finally:
        os.umask(previous)
    for path in (tmp_path / "ema.safetensors", tmp_path / "checkpoint" / "model.safetensors"):
        assert oct(path.stat().st_mode & 0o777) == oct(0o664), path


def test_the_fid_of_a_set_with_itself_is_zero_not_minus_zero():
    import numpy as np

    from fid import gaussian_of
    from fid.frechet import frechet_distance

    # 50 samples of 64 features: a singular covariance, whose traces' round-off left -3.9e-7 (printed -0.0000)
    features = np.random.default_rng(0).normal(size=(50, 64))
    same = gaussian_of(features)
    assert f"{frechet_distance(same, same):.4f}" == "0.0000"


def test_a_config_yaml_alone_does_not_block_rerunning_the_command(tmp_path):
    # A launch that failed at its first step (an unreadable image) leaves config.yaml and startup.txt, nothing that
    # a rerun could lose; before, the rerun of the same command was refused as "already holds a run (config.yaml)".
    from training.run import RunDirectory

    run = RunDirectory(tmp_path)
    run.config.write_text("model: {}\n")
    run.startup.write_text("train.py start-up\n")
    run.check_new()
    run.metrics.write_text('{"step": 1}\n')
    assert run.earlier_run() == [run.config, run.metrics]


def test_an_export_whose_vae_does_not_fit_its_image_size_is_refused_before_sampling(tmp_path):
    # Before: a VAE of downsampling 2 decoded the 4x4 latents of a model declared for 32 px into 8 px images.
    from diffusers import AutoencoderKL

    import dit_vca
    from generation import ExportDescription, ExportError, ImageGenerator, read_export, write_export
    from test_latents import TINY_VAE

    AutoencoderKL(**TINY_VAE).save_pretrained(tmp_path / "vae")  # 2 blocks: 2 px per latent cell
    model = dit_vca.create_model("DiT-S/2", depth=1, hidden_size=32, num_heads=2, input_size=4, num_classes=2)
    description = ExportDescription(
        model=model.config,
        objective={"kind": "diffusion", "learn_sigma": True},
        space="latents",
        image_size=32,  # 4 latent cells x 8 px: what an SD VAE would decode
        num_classes=2,
        vae=str(tmp_path / "vae"),
        latent_scale=0.5,
    )
    write_export(tmp_path / "export", model.state_dict(), description)
    with pytest.raises(
        ExportError, match=r"decodes the model's 4x4 latents to 8 px images, but the export declares 32"
    ):
        ImageGenerator.from_export(read_export(tmp_path / "export"))


def test_a_huge_num_samples_plans_its_labels_and_shards_lazily(tmp_path, monkeypatch):
    # Before: every label was planned at once, np.arange(N) % K: 2 x 8 bytes per sample before the first sample
    # (16 GB for --num-samples 10**9; 1529 MiB before and 76 MiB after for 10**8 samples). Then the shard plan:
    # a Shard object and a file name per shard, lists of the unfinished ones, one stat and one glob per shard in
    # the claim (3.9 M shards of 256 here). Measured with this test's numbers: 1314 MiB before (with the globs
    # skipped: the old claim had not finished after 40 minutes on 2 shared cores), 3 MiB after, in 3 s.
    import tracemalloc

    import sample
    from test_sample import tiny_export

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


def test_the_lazy_shard_plan_is_the_eager_list_of_shards():
    from generation.sample_file import plan_shards

    for num_samples, shard_size in ((1, 1), (5, 7), (1001, 256), (1024, 256)):
        plan = plan_shards(num_samples, shard_size)
        eager = [
            (number, start, min(start + shard_size, num_samples))
            for number, start in enumerate(range(0, num_samples, shard_size))
        ]  # the plan as a list, before
        assert [(shard.number, shard.start, shard.stop) for shard in plan] == eager and len(plan) == len(eager)
        assert [plan.names[number] for number in range(len(plan))] == [shard.file_name for shard in plan]
        assert [plan.names.index(shard.file_name) for shard in plan] == list(range(len(plan)))
        for numbers in (range(len(plan)), range(0, len(plan), 2), range(1, len(plan), 3), range(0)):
            assert plan.samples_in(numbers) == sum(len(plan[number].indices) for number in numbers)
    names = plan_shards(10**9, 256).names  # 3,906,250 shards
    assert names[-1] == "shard-3906249.npz" and names.index("shard-3906249.npz") == 3_906_249
    for other in ("settings.json", "shard-3906250.npz", "shard-0000001.npz", "shard-\uff11.npz", "shard-.npz"):
        with pytest.raises(ValueError):
            names.index(other)


@pytest.mark.parametrize("count, finished", [(0, []), (1, [0]), (7, []), (7, [0, 3, 6]), (10, [1, 2, 3, 8]), (4, [3])])
def test_pending_shards_split_over_processes_as_the_list_of_unfinished_shards_did(count, finished):
    from atomic_files.shards import PendingShards

    eager = [number for number in range(count) if number not in finished]
    pending = PendingShards(count, finished)
    assert pending == eager and len(pending) == len(eager) and list(reversed(pending)) == eager[::-1]
    for processes in (1, 2, 3, 8):
        for rank in range(processes):
            assert pending[rank::processes] == eager[rank::processes]  # each process's shards, as before


def test_a_folder_of_millions_of_shards_is_claimed_from_one_listing(tmp_path):
    from atomic_files.shards import ShardFolder, ShardNames

    names = ShardNames(10**7, "shard-{:06d}.npz")
    folder = ShardFolder(tmp_path / "out.shards", names, {"seed": 0})
    assert len(folder.claim()) == 10**7
    folder.release()
    for number in (0, 2):
        (tmp_path / "out.shards" / names[number]).write_bytes(b"finished")
    stale, foreign = tmp_path / "out.shards" / f".{names[5]}.tmp-999999999", tmp_path / "out.shards" / "notes.txt"
    stale.write_bytes(b"half a shard")  # left by a killed writer
    foreign.write_text("kept")
    pending = folder.claim()
    assert folder.kept == 2 and len(pending) == 10**7 - 2 and pending[:4] == [1, 3, 4, 5] and pending[-1] == 10**7 - 1
    assert not stale.exists() and foreign.exists()
    folder.release()


def test_a_run_that_cannot_fit_on_its_disk_is_refused_before_the_model_is_built(tmp_path, monkeypatch, capsys):
    # Before: sampling went on until a shard, or the merge at the very end, found the disk full. 1000 8x8 samples
    # are 192,000 bytes of images, in the shards and again in the merged .npz (both on the disk until the merge
    # ends): a disk with room for the .npz alone (about 200 kB) is refused too, naming both byte counts.
    import sample
    from commands import USER_ERROR_STATUS, run_command
    from generation import ImageGenerator
    from generation.images import grid_bytes
    from test_sample import tiny_export

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
    # + the labelled grid of 64 8x8 tiles (grid_bytes: its own bound, tested in test_third_day), and at most:
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
            with pytest.raises(SystemExit, match=f"need {needed - kept:,} bytes"):
                sample.check_disk_space(args, 8, files)
        else:
            sample.check_disk_space(args, 8, files)


def test_sample_labels_are_the_eager_ones_in_every_part():
    from generation.sample_plan import SampleLabels

    for mode in ("balanced", "uniform"):
        labels = SampleLabels(1003, 7, mode, seed=3)
        whole = labels[:]
        assert whole.shape == (1003,) and whole.dtype.name == "int64"
        for start, stop in ((0, 1), (5, 260), (1000, 1003), (0, 1003)):
            assert (labels[start:stop] == whole[start:stop]).all()
    assert (SampleLabels(10, 4, "balanced", 0)[:] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]).all()
