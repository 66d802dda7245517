"""Faults of the third day (issue 38, items 7-10): files flushed to the disk before their rename is trusted, only
complete checkpoints taken as the newest, image folders whatever their links, one-line errors where tracebacks
were, and outputs that no longer mislead."""

import json
import os
import re
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import sample
from commands import USER_ERROR_STATUS, run_command
from faults import run_train
from test_sample import RUN, tiny_export

ROOT = Path(__file__).resolve().parents[1]


def one_line_error(main, argv: list[str], capsys) -> str:
    """The error line of a command that refuses `argv` as a user error (exit status 2, one line on stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        run_command(main, argv)
    error = capsys.readouterr().err
    assert exited.value.code == USER_ERROR_STATUS and len(error.strip().splitlines()) == 1, error
    return error.strip()


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory.mktemp("export") / "export")


# --------------------------------------------------------------------------------------------------
#                       Item 7: durable renames, and only complete checkpoints are the newest
# --------------------------------------------------------------------------------------------------


class DiskLog:
    """Records every fsync (by the path of its descriptor) and every os.replace, with what under the renamed file
    or folder had not been flushed when it was renamed."""

    def __init__(self, monkeypatch) -> None:
        self.events: list[tuple[str, str]] = []
        self.unflushed: dict[str, list[str]] = {}  # target of a rename -> paths renamed with it, never flushed
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(descriptor: int) -> None:
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
            real_fsync(descriptor)

        def replace(source, target, **options) -> None:
            source, target = os.path.abspath(source), os.path.abspath(target)
            inside = [source] + [str(path) for path in Path(source).rglob("*")] if os.path.isdir(source) else [source]
            flushed = {path for kind, path in self.events if kind == "fsync"}
            self.unflushed[target] = [path for path in inside if path not in flushed]
            self.events.append(("replace", target))
            real_replace(source, target, **options)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def durable(self, target: Path) -> bool:
        """Whether everything `target` was renamed from (every file and folder of a folder) was flushed before the
        rename, and the folder holding it after (the rename itself)."""
        renamed = self.events.index(("replace", str(target)))
        return self.unflushed[str(target)] == [] and ("fsync", str(target.parent)) in self.events[renamed + 1 :]


def test_a_file_is_flushed_before_its_rename_and_its_folder_after(tmp_path, monkeypatch):
    # Before: os.replace alone, so a crash of the machine could keep the name and lose the bytes.
    from atomic_files import atomic_folder, write_text_atomic

    log = DiskLog(monkeypatch)
    write_text_atomic(tmp_path / "note.txt", "whole\n")
    temporary = str(tmp_path / f".note.txt.tmp-{os.getpid()}")
    assert log.events == [("fsync", temporary), ("replace", str(tmp_path / "note.txt")), ("fsync", str(tmp_path))]
    with atomic_folder(tmp_path / "folder") as folder:
        (folder / "inner").mkdir()
        (folder / "inner" / "a.bin").write_bytes(b"a")
        write_text_atomic(folder / "b.txt", "b")  # flushed with the folder, not before
    assert log.durable(tmp_path / "folder")


@pytest.mark.slow
def test_checkpoints_exports_and_snapshots_are_flushed_before_they_take_their_names(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    log = DiskLog(monkeypatch)
    run_train(
        *("--config", str(ROOT / "configs" / "digits.yaml"), f"run.dir={run_dir}"),
        *("model.hidden_size=32", "model.depth=1", "model.num_heads=2", "train.global_batch_size=16"),
        *("train.max_steps=2", "log.checkpoint_every=2", "log.export_every=2", "log.sample_every=0"),
        *("log.trackers=[]", "train.posthoc_ema.sigma_rel=[0.1]", "train.posthoc_ema.snapshot_every=2"),
    )
    # every file and folder of each, Accelerate's optimizer.bin and RNG states too
    for folder in ("checkpoints/step-0000002", "exports/step-0000002", "posthoc_ema/step-0000002", "config.yaml"):
        assert log.durable(run_dir / folder), folder


def write_checkpoint(run_dir: Path, step: int, export: Path, complete: bool) -> Path:
    """A checkpoint folder with `export`'s export in it; complete ones have their trainer_state.json."""
    folder = run_dir / "checkpoints" / f"step-{step:07d}"
    shutil.copytree(export, folder / "export")
    if complete:
        (folder / "trainer_state.json").write_text(json.dumps({"step": step, "examples_seen": 0, "num_processes": 1}))
    return folder


def test_every_reader_of_the_newest_checkpoint_takes_only_a_complete_one(export, tmp_path):
    # Before: sample.py --ckpt RUN (generation.find_export) took step 4, which --resume latest leaves out.
    from generation import ExportError, find_export
    from training.checkpoint_folders import resolve_resume

    run_dir = tmp_path / "run"
    complete = write_checkpoint(run_dir, 2, export, complete=True)
    write_checkpoint(run_dir, 4, export, complete=False)  # its export is whole, the folder is not
    assert find_export(run_dir) == complete / "export"
    assert resolve_resume("latest", run_dir / "checkpoints") == complete
    assert sample.resolved_export(run_dir) == (complete / "export").resolve()
    shutil.rmtree(complete)
    with pytest.raises(ExportError, match=r"step-0000004/export is in a checkpoint without trainer_state.json: pass"):
        find_export(run_dir)  # the way out, for a run whose exports alone were copied


# --------------------------------------------------------------------------------------------------
#                                     Item 8: image folders and links
# --------------------------------------------------------------------------------------------------


def test_no_image_is_listed_twice_or_under_another_class_whatever_the_links(tmp_path):
    # Before: `ln -s .. ant/up` listed every class's images under ant too (39 images for 12 here).
    from test_data import make_image_folder
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


# --------------------------------------------------------------------------------------------------
#                                   Item 9: one line instead of a traceback
# --------------------------------------------------------------------------------------------------


def latent_export(folder: Path, vae: Path) -> Path:
    """A 1-block DiT on 4 channels of 4x4 latents, decoded by the tiny VAE `vae` to 8 px."""
    import dit_vca
    from generation import ExportDescription, write_export

    model = dit_vca.create_model("DiT-S/2", depth=1, hidden_size=32, num_heads=2, input_size=4, num_classes=2)
    description = ExportDescription(
        model=model.config,
        objective={"kind": "diffusion", "learn_sigma": True},
        space="latents",
        image_size=8,
        num_classes=2,
        vae=str(vae),
        latent_scale=0.5,
    )
    write_export(folder, model.state_dict(), description)
    return folder


@pytest.fixture(scope="module")
def vaes(tmp_path_factory) -> Path:
    """Tiny VAEs with 4 and 8 latent channels, both of downsampling 2."""
    from diffusers import AutoencoderKL

    from test_latents import TINY_VAE

    root = tmp_path_factory.mktemp("vaes")
    for channels in (4, 8):
        AutoencoderKL(**{**TINY_VAE, "latent_channels": channels}).save_pretrained(root / f"vae{channels}")
    return root


def test_a_vae_of_another_latent_channel_count_is_one_line(vaes, tmp_path, capsys):
    # Before: a convolution in the VAE's decoder stopped the trial sample with a RuntimeError traceback.
    export = latent_export(tmp_path / "export", vaes / "vae4")
    out = tmp_path / "out" / "s.npz"
    out.parent.mkdir()
    argv = ["--ckpt", str(export), "--vae", str(vaes / "vae8"), "--num-samples", "2", "--out", str(out)]
    error = one_line_error(sample.main, argv, capsys)
    assert f"the VAE {vaes / 'vae8'} has 8 latent channels, but the model generates 4" in error
    assert list(out.parent.iterdir()) == []


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


def fake_snapshots(run_dir: Path, steps=(2, 4, 6, 8), sigma_rels=(0.05, 0.1), batch: int = 4) -> Path:
    """Post-hoc EMA snapshots as training stores them (headers, description.json last) of a one-tensor "model"."""
    from generation.export import read_description
    from generation.run_layout import SNAPSHOT_DESCRIPTION, SNAPSHOT_FOLDER, profile_file
    from generation.run_layout import step_name as snapshot_name
    from training.power_profiles import sigma_rel_to_gamma

    description = read_description(tiny_export(run_dir.parent / "snapshot-export")).to_json()
    generator = torch.Generator().manual_seed(0)
    for step in steps:
        folder = run_dir / SNAPSHOT_FOLDER / snapshot_name(step)
        folder.mkdir(parents=True)
        for sigma_rel in sigma_rels:
            header = {"sigma_rel": repr(sigma_rel), "gamma": repr(sigma_rel_to_gamma(sigma_rel)), "step": str(step)}
            weights = {"w": torch.randn(3, 3, generator=generator)}
            save_file(weights, folder / profile_file(sigma_rel), {**header, "images": str(step * batch)})
        (folder / SNAPSHOT_DESCRIPTION).write_text(json.dumps({**description, "train_step": step}))
    return run_dir


def test_posthoc_out_naming_a_file_is_one_line_and_the_file_stays(tmp_path, capsys):
    # Before: NotADirectoryError's traceback, from the staging folder made inside the file.
    from training.posthoc_ema import main as posthoc_main

    run_dir = fake_snapshots(tmp_path / "run")
    mine = tmp_path / "mine.txt"
    mine.write_text("not yours\n")
    for out in (mine, mine / "sub"):
        error = one_line_error(posthoc_main, [str(run_dir), "--sigma-rel", "0.07", "--out", str(out)], capsys)
        assert error == f"error: cannot write in {out}: {mine} is a file, not a folder; choose another place"
    assert mine.read_text() == "not yours\n"


@pytest.mark.parametrize("command", ["train", "demo"])
def test_any_output_folder_where_a_file_stands_is_one_line(tmp_path, capsys, command):
    # Before (train.py run.dir=FILE): NotADirectoryError's traceback from the writability probe.
    from test_bad_inputs import COMMANDS, DIGITS

    mine = tmp_path / "mine.txt"
    mine.write_text("not yours\n")
    argv = ["--config", str(DIGITS), f"run.dir={mine}"] if command == "train" else ["--out", str(mine)]
    error = one_line_error(COMMANDS[command](), argv, capsys)
    assert error == f"error: cannot write in {mine}: {mine} is a file, not a folder; choose another place"
    assert mine.read_text() == "not yours\n"


def test_posthoc_list_of_a_run_with_a_cut_snapshot_is_one_line(tmp_path, capsys):
    # Cut anywhere (tried at every length of the file), a profile is named in one line.
    from training.posthoc_ema import main as posthoc_main

    run_dir = fake_snapshots(tmp_path / "run")
    cut = run_dir / "posthoc_ema" / "step-0000008" / "sigma_rel-0.1.safetensors"
    cut.write_bytes(cut.read_bytes()[:100])
    error = one_line_error(posthoc_main, [str(run_dir), "--list"], capsys)
    assert error.startswith(f"error: {cut} cannot be read as a post-hoc EMA snapshot (")


# --------------------------------------------------------------------------------------------------
#                                Item 10: outputs that no longer mislead
# --------------------------------------------------------------------------------------------------


def test_a_snapshot_copied_into_another_steps_folder_is_refused(tmp_path, capsys):
    # Before: it entered the fit as a second copy of step 4's profiles (Gram condition 1.5e17), without a word.
    from training.posthoc_ema import main as posthoc_main

    run_dir = fake_snapshots(tmp_path / "run")
    snapshots = run_dir / "posthoc_ema"
    shutil.copytree(snapshots / "step-0000004", snapshots / "step-0000010")
    error = one_line_error(posthoc_main, [str(run_dir), "--sigma-rel", "0.07", "--out", str(tmp_path / "out")], capsys)
    copy = snapshots / "step-0000010" / "sigma_rel-0.05.safetensors"
    assert error == (
        f"error: {copy} holds the profile of step 4 (its header), not of step 10 (its folder): a snapshot copied "
        f"into another step's folder? Remove it"
    )
    assert not (tmp_path / "out").exists()


def test_an_incomplete_newest_snapshot_is_left_out_and_named_by_list(tmp_path, capsys):
    # Before: the folder without its description.json was the newest step, and the reconstruction failed on it.
    from training.posthoc_ema import main as posthoc_main
    from training.posthoc_ema import reconstruct

    run_dir = fake_snapshots(tmp_path / "run")
    fake_snapshots(tmp_path / "other", steps=(10,))
    shutil.copytree(tmp_path / "other" / "posthoc_ema" / "step-0000010", run_dir / "posthoc_ema" / "step-0000010")
    (run_dir / "posthoc_ema" / "step-0000010" / "description.json").unlink()
    (written,) = reconstruct(run_dir, [0.07], out=tmp_path / "out")
    assert written.record["step"] == 8
    posthoc_main([str(run_dir), "--list"])
    assert "left out, incomplete (no description.json): step-0000010" in capsys.readouterr().out


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


def test_the_grid_estimate_is_above_the_grid_written(tmp_path):
    from generation.images import class_grid_indices, grid_bytes, save_class_grid

    rng = np.random.default_rng(0)
    names = [f"n{index:08d}_{'a long class folder name' * 2}" for index in range(1000)]  # long labels, as ImageNet's
    title = "results/a-run-folder/checkpoints/step-0400000/export: guidance 4, ddim, 250 steps " * 2  # a long title
    for count, side, classes in ((1, 8, 10), (3, 8, 10), (64, 8, 10), (9, 16, 1000), (16, 32, 1000), (4, 64, 3)):
        labels = np.arange(count * classes) % classes
        rows = class_grid_indices(labels, count)
        tiles = rng.integers(0, 256, (len(labels), side, side, 3), dtype=np.uint8)  # noise: compresses least
        save_class_grid([(label, tiles[indices]) for label, indices in rows], tmp_path / "grid.png", title, names)
        assert (tmp_path / "grid.png").stat().st_size <= grid_bytes(count, side), (count, side)


def test_a_format_written_as_a_string_is_named_as_such(export, tmp_path):
    # Before: "export format 3 is newer than this code understands (3)".
    from generation.export import ExportError, read_description

    folder = shutil.copytree(export, tmp_path / "export")
    config = json.loads((folder / "config.json").read_text())
    for written, expected in (
        ("3", '"format" is "3"; expected a whole number from 1 to 4'),
        (0, '"format" is 0; expected a whole number from 1 to 4'),
        (5, "export format 5 is newer than this code understands (4)"),
    ):
        (folder / "config.json").write_text(json.dumps({**config, "format": written}))
        with pytest.raises(ExportError, match=re.escape(expected)):
            read_description(folder)


def test_a_relative_vae_path_in_an_export_is_read_from_the_exports_folder(vaes, tmp_path, monkeypatch):
    # Before: "VAE folder ../vae does not exist", looked for from the working directory.
    from generation import ImageGenerator, read_export
    from generation.export import read_description

    shutil.copytree(vaes / "vae4", tmp_path / "models" / "vae")
    export = latent_export(tmp_path / "models" / "export", tmp_path / "models" / "vae")
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, "vae": "../vae", "vae_path": None}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert read_description(export).vae == str(tmp_path / "models" / "vae")
    generator = ImageGenerator.from_export(read_export(export))
    assert generator.generate([0], [0], steps=2).shape == (1, 8, 8, 3)
    hub_id = {**config, "vae": "stabilityai/sd-vae-ft-ema", "vae_path": None}  # not a folder beside it: a hub id
    (export / "config.json").write_text(json.dumps(hub_id))
    assert read_description(export).vae == "stabilityai/sd-vae-ft-ema"
