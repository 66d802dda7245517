"""sample.py: labels, noise seeds, pixel rounding, the shard plan (lazy, for any --num-samples), shard merging,
argument checks, the disk space needed, and end-to-end runs (1 vs 2 processes, kill -9 and resume) on a tiny
exported model."""

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
from _launch import NO_GLOO_THREAD_AT_EXIT, TORCHRUN_TWO_PROCESSES, sample_env, with_gloo_probe
from _tiny_models import EXPORT_CLASSES, tiny_export, tiny_sd_vae
from _user_errors import one_line_error
from atomic_files import save_npz_atomic
from atomic_files.shards import ShardFolder, ShardFolderError
from generation import ImageGenerator, load_export
from generation.images import to_uint8
from generation.official import official_export
from generation.sample_file import (
    DamagedShardError,
    SampleFiles,
    SampleFilesError,
    images_at,
    merge_shards,
    plan_shards,
    shard_reader,
)
from generation.sample_plan import assign_labels, sample_seeds

# ----------------------------------------------------------------------------------------------
# Pixels
# ----------------------------------------------------------------------------------------------


def test_to_uint8_maps_stored_pixels_back_to_themselves():
    # A uint8 value k read as x = k / 127.5 - 1 must come back as k: float32 puts 127.5 x + 128 within
    # ~1e-5 of k + 0.5, far from the integers where truncation would change the result.
    k = torch.arange(256, dtype=torch.float32)
    x = (k / 127.5 - 1).view(1, 1, 16, 16)  # (1, 1, 16, 16)
    pixels = to_uint8(x)
    assert pixels.dtype == np.uint8 and pixels.shape == (1, 16, 16, 3)
    np.testing.assert_array_equal(pixels[0, :, :, 0].reshape(-1), np.arange(256))


def test_to_uint8_rounds_half_up_and_clamps():
    # Hand-computed with DiT's floor(127.5 x + 128): x = 0 is 127.5 away from both ends and rounds up
    # to 128 (ADM's truncation would give 127); values outside [-1, 1] clamp to 0 and 255.
    x = torch.tensor([-3.0, -1.0, -0.999, 0.0, 0.5, 0.999, 1.0, 7.0]).view(1, 1, 1, 8)
    expected = [0, 0, 0, 128, 191, 255, 255, 255]  # 0.5 -> 191.75 -> 191; 0.999 -> 255.37 -> 255
    np.testing.assert_array_equal(to_uint8(x)[0, 0, :, 0], expected)


def test_to_uint8_repeats_one_channel_and_keeps_rgb_order():
    gray = torch.linspace(-1, 1, 12).view(1, 1, 3, 4)
    rgb = torch.stack([torch.full((3, 4), -1.0), torch.zeros(3, 4), torch.ones(3, 4)])[None]  # (1, 3, 3, 4)
    gray_pixels, rgb_pixels = to_uint8(gray), to_uint8(rgb)
    assert gray_pixels.shape == (1, 3, 4, 3)
    np.testing.assert_array_equal(gray_pixels[..., 0], gray_pixels[..., 1])
    np.testing.assert_array_equal(gray_pixels[..., 0], gray_pixels[..., 2])
    np.testing.assert_array_equal(rgb_pixels[0, 0, 0], [0, 128, 255])


def test_to_uint8_rejects_non_finite_and_odd_channels():
    with pytest.raises(FloatingPointError, match="NaN"):
        to_uint8(torch.tensor([0.0, float("nan")]).view(1, 1, 1, 2))
    with pytest.raises(ValueError, match="1 or 3 channels"):
        to_uint8(torch.zeros(1, 4, 2, 2))


# ----------------------------------------------------------------------------------------------
# Labels and seeds
# ----------------------------------------------------------------------------------------------


def test_balanced_labels_are_balanced_in_every_prefix():
    labels = assign_labels(1003, 10, "balanced", seed=0)
    assert labels.dtype == np.int64 and labels.shape == (1003,)
    counts = np.bincount(labels, minlength=10)
    assert counts.max() - counts.min() <= 1 and counts.sum() == 1003
    for prefix in (10, 500, 1000):
        assert np.all(np.bincount(labels[:prefix], minlength=10) == prefix // 10)


def test_uniform_labels_follow_the_seed():
    first = assign_labels(5000, 7, "uniform", seed=3)
    assert first.dtype == np.int64 and first.min() == 0 and first.max() == 6
    np.testing.assert_array_equal(first, assign_labels(5000, 7, "uniform", seed=3))
    assert not np.array_equal(first, assign_labels(5000, 7, "uniform", seed=4))
    with pytest.raises(ValueError, match="balanced"):
        assign_labels(10, 7, "sorted", seed=3)


def test_sample_seeds_depend_on_seed_and_index_only():
    seeds = sample_seeds(0, range(20_000))
    assert len(set(seeds)) == 20_000 and all(0 <= s < 2**63 for s in seeds)
    assert sample_seeds(0, [17, 5]) == [seeds[17], seeds[5]]  # any order or subset of indices
    assert set(sample_seeds(1, range(20_000))).isdisjoint(seeds)  # seed + index does not alias


# ----------------------------------------------------------------------------------------------
# Shards
# ----------------------------------------------------------------------------------------------


def test_plan_shards_covers_every_index_once():
    shards = plan_shards(1001, 256)
    assert [(s.start, s.stop) for s in shards] == [(0, 256), (256, 512), (512, 768), (768, 1001)]
    covered = np.concatenate([np.arange(s.start, s.stop) for s in shards])
    np.testing.assert_array_equal(covered, np.arange(1001))
    assert len({s.file_name for s in shards}) == len(shards)


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


def test_sample_labels_are_the_eager_ones_in_every_part():
    from generation.sample_plan import SampleLabels

    for mode in ("balanced", "uniform"):
        labels = SampleLabels(1003, 7, mode, seed=3)
        whole = labels[:]
        assert whole.shape == (1003,) and whole.dtype.name == "int64"
        for start, stop in ((0, 1), (5, 260), (1000, 1003), (0, 1003)):
            assert (labels[start:stop] == whole[start:stop]).all()
    assert (SampleLabels(10, 4, "balanced", 0)[:] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]).all()


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


def write_shards(folder, images, labels, shards):
    for shard in shards:
        save_npz_atomic(
            folder / shard.file_name,
            arr_0=images[shard.start : shard.stop],
            arr_1=labels[shard.start : shard.stop],
            index=np.arange(shard.start, shard.stop),
        )


def test_merge_shards_writes_a_standard_npz(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (23, 5, 6, 3), dtype=np.uint8)
    labels = assign_labels(23, 4, "balanced", seed=0)
    shards = plan_shards(23, 5)
    write_shards(tmp_path, images, labels, shards)
    images_of = shard_reader(tmp_path, labels, repair=None)
    merge_shards(shards, images_of, labels, tmp_path / "out.npz")
    with np.load(tmp_path / "out.npz") as merged:
        assert sorted(merged.files) == ["arr_0", "arr_1"]
        assert merged["arr_0"].dtype == np.uint8 and merged["arr_1"].dtype == np.int64
        np.testing.assert_array_equal(merged["arr_0"], images)
        np.testing.assert_array_equal(merged["arr_1"], labels)
    np.testing.assert_array_equal(images_at(shards, images_of, [0, 7, 22, 3]), images[[0, 7, 22, 3]])
    assert not list(tmp_path.glob(".*tmp*"))


def test_merge_shards_hands_a_shard_of_other_samples_to_repair(tmp_path):
    images = np.arange(8 * 12, dtype=np.uint8).reshape(8, 2, 2, 3)
    labels = assign_labels(8, 4, "balanced", seed=0)
    shards = plan_shards(8, 4)
    write_shards(tmp_path, images, labels, shards)
    wrong = shards[1]
    save_npz_atomic(tmp_path / wrong.file_name, arr_0=images[:4], arr_1=labels[:4], index=np.arange(4))
    (tmp_path / shards[0].file_name).write_bytes(b"PK\x03\x04 cut")  # a damaged file
    repaired = []

    def repair(shard, error):
        assert shard.file_name in str(error)
        repaired.append(shard.number)
        return images[shard.start : shard.stop]

    merge_shards(shards, shard_reader(tmp_path, labels, repair), labels, tmp_path / "out.npz")
    assert repaired == [0, 1]
    np.testing.assert_array_equal(np.load(tmp_path / "out.npz")["arr_0"], images)
    with pytest.raises(DamagedShardError, match=wrong.file_name):
        shard_reader(tmp_path, labels, repair=lambda shard, error: (_ for _ in ()).throw(error))(wrong)


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


def test_samples_do_not_depend_on_the_batch_split(export):
    generator = ImageGenerator.from_export(load_export(export))
    options = dict(sampler="ddpm", steps=12, guidance=2.0)
    labels, seeds = assign_labels(8, EXPORT_CLASSES, "balanced", 0), sample_seeds(7, range(8))
    whole = generator.generate(labels, seeds, **options)
    split = np.concatenate([generator.generate(labels[i : i + 3], seeds[i : i + 3], **options) for i in range(0, 8, 3)])
    # Per-sample noise makes the two identical in exact arithmetic; kernels may round differently for
    # other batch sizes, which can move a pixel across a uint8 boundary (bit-identical on this CPU).
    assert np.abs(whole.astype(int) - split).max() <= 1 and np.mean(whole != split) < 0.01


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
    with pytest.raises(SystemExit, match=message):
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
    import generation.objective
    from dit_vca.model_spec import ModelSpec
    from objectives import SAMPLERS, TransportSpec
    from sample_arguments import check_against, parse_args

    monkeypatch.setattr(generation.objective, "create_objective", lambda spec: pytest.fail("an objective was built"))
    sit = types.SimpleNamespace(model=ModelSpec("SiT-S/2"), objective=TransportSpec(), has_null_class=True, channels=4)
    args = parse_args(["--ckpt", "x", "--out", str(tmp_path / "s.npz"), "--num-samples", "1", "--sampler", "ddpm"])
    offered = ", ".join(SAMPLERS["transport"].names)
    with pytest.raises(SystemExit, match=f"^--sampler 'ddpm': this checkpoint's objective offers {offered}$"):
        check_against(sit, args)
    args.sampler = "sde-heun"
    check_against(sit, args)  # one of the table's


def test_only_a_sampler_option_error_of_the_trial_sample_is_one_line(export, tmp_path, monkeypatch):
    """The trial sample answers the samplers' own option check in one line; any other error there is a bug and
    keeps its traceback (it is not dressed up as a bad option); nothing is written either way."""
    from samplers.interface import SamplerOptionError

    argv = ["--ckpt", str(export), "--out", str(tmp_path / "s.npz"), "--num-samples", "4", "--sampler", "ddim"]
    for error, expected in (
        (SamplerOptionError("DDIM eta must be >= 0"), SystemExit),
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
    with pytest.raises(SystemExit, match="--cfg-scale 2.0: the model was trained without label dropout"):
        sample.main(["--ckpt", str(export), "--out", str(tmp_path / "s.npz"), "--num-samples", "4", "--cfg-scale", "2"])
    assert written(tmp_path / "s.npz") == []


def test_official_checkpoint_needs_a_valid_model_name(tmp_path):
    checkpoint = tmp_path / "my-model.pt"  # a name that does not say the architecture
    torch.save({}, checkpoint)
    out = tmp_path / "s.npz"
    with pytest.raises(SystemExit, match="my-model.pt: name its architecture with --model"):
        sample.main(["--ckpt", str(checkpoint), "--out", str(out), "--num-samples", "4"])
    with pytest.raises(SystemExit, match="--model 'DiT-XXL/2': expected one of DiT-S/1, DiT-S/2, "):
        sample.main(["--ckpt", str(checkpoint), "--model", "DiT-XXL/2", "--out", str(out), "--num-samples", "4"])
    with pytest.raises(SystemExit, match="my-model.pt has no final_layer.linear.weight"):
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
    with pytest.raises(SampleFilesError, match="exists and was not written by sample.py"):
        sample.main(sample_command(export, out)[2:])
    assert np.load(out)["arr_0"].shape == (1, 8, 8, 3)


@pytest.fixture
def main_process():
    """A stand-in for the Accelerator of a single process (broadcasting is then a no-op)."""
    from accelerate.state import PartialState

    yield types.SimpleNamespace(is_main_process=True, num_processes=1)
    PartialState._reset_state()


def test_shards_of_another_run_are_not_mixed_in(main_process, tmp_path):
    folder_path = tmp_path / "samples.npz.shards"
    shards = plan_shards(8, 4)
    names = [shard.file_name for shard in shards]
    record = {"seed": 0, "num_samples": 8}
    assert ShardFolder(folder_path, names, record).claim(main_process) == [0, 1]
    write_shards(folder_path, np.zeros((8, 2, 2, 3), np.uint8), np.zeros(8, np.int64), shards[:1])
    (folder_path / f".{names[1]}.tmp-999999999").write_bytes(b"half a shard")  # left by a killed writer
    assert ShardFolder(folder_path, names, record).claim(main_process) == [1]
    assert not list(folder_path.glob(".*tmp*"))
    with pytest.raises(ShardFolderError, match="run with seed=0, not 1"):
        ShardFolder(folder_path, names, {**record, "seed": 1}).claim(main_process)
    assert (folder_path / names[0]).exists()


# ----------------------------------------------------------------------------------------------
# Official checkpoints: a DiT state dict in the MHSA baseline, decoded by a (tiny, local) VAE
# ----------------------------------------------------------------------------------------------


def test_official_checkpoint_loads_into_the_mhsa_baseline(tmp_path):
    from dit_vca import create_model

    vae_folder = tmp_path / "vae"
    tiny_sd_vae().save_pretrained(vae_folder)
    official = create_model("DiT-S/8", attention="mhsa", input_size=32)
    torch.save({"ema": official.state_dict()}, tmp_path / "DiT-S-8-256x256.pt")  # architecture read from the name

    export = load_export(tmp_path / "DiT-S-8-256x256.pt")
    generator = ImageGenerator.from_export(export, vae=str(vae_folder))
    for key, value in official.state_dict().items():
        assert torch.equal(generator.model.state_dict()[key], value), key
    images = generator.generate(np.array([0, 999]), [1, 2], sampler="ddim", steps=2, guidance=1.5)
    assert images.shape == (2, 256, 256, 3) and images.dtype == np.uint8 and generator.model_evaluations == 2

    with pytest.raises(ValueError, match="does not fit --model DiT-S/4"):
        official_export(tmp_path / "DiT-S-8-256x256.pt", model="DiT-S/4")  # other patch size


# ----------------------------------------------------------------------------------------------
# --protocol: the settings of the official evaluations, explicit flags winning
# ----------------------------------------------------------------------------------------------

MINIMAL = ["--ckpt", "export", "--out", "samples.npz", "--num-samples", "50000"]
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
def test_protocol_sets_the_official_settings(name):
    settings = sample.run_settings(sample.parse_args([*MINIMAL, "--protocol", name]))
    assert settings["protocol"] == name
    assert {key: settings.get(key) for key in OFFICIAL[name]} == OFFICIAL[name]
    unset = set(sample.SAMPLER_OPTIONS) - set(OFFICIAL[name])
    assert all(key not in settings for key in unset)  # nothing else is passed on to the sampler
    if "guidance_interval" not in OFFICIAL[name]:
        assert settings["guidance_interval"] is None


def test_explicit_flags_win_over_the_protocol():
    args = sample.parse_args(
        [
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


def test_without_a_protocol_the_plain_defaults_apply():
    settings = sample.run_settings(sample.parse_args(MINIMAL))
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
    with pytest.raises(SampleFilesError, match="foreign.json exists and was not written by sample.py"):
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
    error = one_line_error(sample.main, [*MINIMAL, "--time-shift", value], capsys)
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
            with pytest.raises(SystemExit, match=f"need {needed - kept:,} bytes"):
                sample.check_disk_space(args, 8, files)
        else:
            sample.check_disk_space(args, 8, files)
