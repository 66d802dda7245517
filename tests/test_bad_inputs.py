"""What each command answers to a user error: one line `error: ...` naming the file, key or value, exit status 2,
nothing written (docs/what-happens-when.md, rows for train.py, sample.py, training.latents and
demo.py). Two rows run as real subprocesses; the rest call the commands' `main` through `commands.run_command`,
as their `__main__` does. Damaged resume checkpoints are in tests/test_train.py (they need a trained run)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState

import sample
import training.latents
from _tiny_models import tiny_export
from _user_errors import one_line_error
from commands import USER_ERROR_STATUS, run_command
from training.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "configs" / "digits.yaml"
# A row that does not fail would train for one step only.
TINY = ["model.hidden_size=32", "model.depth=1", "model.num_heads=2", "train.global_batch_size=64", "train.max_steps=1"]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


COMMANDS = {
    "train": lambda: load_script("train").main,
    "demo": lambda: load_script("demo").main,
    "sample": lambda: sample.main,
    "latents": lambda: training.latents.main,
}


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """One folder with every damaged or foreign input the table below points to."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "bad.yaml").write_text("train:\n  lr: [1\n")
    (root / "scalar.yaml").write_text("5\n")
    (root / "loop-a").symlink_to(root / "loop-b")  # --ckpt naming a loop of symbolic links
    (root / "loop-b").symlink_to(root / "loop-a")
    import numpy as np

    np.savez(root / "no-stats.npz", mu_s=np.zeros(3), sigma_s=np.eye(3))  # sFID statistics only
    for name in ("cut-weights", "cut-config"):
        tiny_export(root / name)
    truncate(root / "cut-weights" / "ema.safetensors")
    truncate(root / "cut-config" / "config.json")
    from dit_vca import create_model

    torch.save(
        {"ema": create_model("DiT-S/8", depth=1, attention="mhsa", input_size=32).state_dict()},
        root / "DiT-S-8-256x256.pt",
    )
    truncate(root / "DiT-S-8-256x256.pt")
    tiny_export(root / "export")
    for folder, name in (("foreign-json", "report.json"), ("foreign-png", "report.png")):
        (root / folder).mkdir()
        (root / folder / name).write_text("the user's own file")
    (root / "used-run").mkdir()
    (root / "used-run" / "metrics.jsonl").write_text('{"step": 100, "loss": 0.5}\n')
    from PIL import Image

    for name in ("n01440764", "n01443537", "n01484850"):  # an ImageNet-style folder of 3 classes
        (root / "images" / name).mkdir(parents=True)
        Image.new("RGB", (20, 24), (90, 40, 10)).save(root / "images" / name / "a.png")
    (root / "latents-32").mkdir()  # what python -m training.latents writes last, for 32 px images
    (root / "latents-32" / "manifest.json").write_text(
        json.dumps(
            {
                "format": 1,
                "image_size": 32,
                "classes": ["a", "b"],
                "latent_channels": 4,
                "latent_size": 4,
                "num_images": 0,
                "shards": [],
            }
        )
    )
    return root


TRAIN = ["--config", str(DIGITS), *TINY, "run.dir={tmp}/run"]
NO_VAE = ["vae.name={tmp}/no-vae", "vae.scale=0.5"]
ON_IMAGES = [*TRAIN, *NO_VAE, "data.source=images"]
ON_LATENTS = [*TRAIN, *NO_VAE, "data.source=latents"]
SAMPLE = ["--ckpt", "{tmp}/export", "--out", "{tmp}/samples.npz", "--num-samples", "4"]

CASES = [  # (id, command, arguments, text the one line must contain)
    (
        "yaml",
        "train",
        ["--config", "{tmp}/bad.yaml"],
        "bad.yaml: not valid YAML (did not find expected ',' or ']' at line 3, column 1)",
    ),
    ("no-config", "train", ["--config", "{tmp}/none.yaml"], "config file {tmp}/none.yaml does not exist"),
    # issue 32: a folder, a bare value, an FID reference without mu/sigma (found at start-up, not at the first FID)
    ("config-folder", "train", ["--config", "{tmp}/images"], "config file {tmp}/images is a folder, not a file"),
    (
        "config-scalar",
        "train",
        ["--config", "{tmp}/scalar.yaml"],
        "scalar.yaml: a bare value (Invalid loaded object type: int), not a mapping of sections at the top level",
    ),
    (
        "fid-reference-without-mu",
        "train",
        [*TRAIN, "log.fid_every=1", "log.fid_reference={tmp}/no-stats.npz"],
        "log.fid_reference: {tmp}/no-stats.npz: no pool_3 statistics ('mu', 'sigma')",
    ),
    ("unknown-key", "train", [*TRAIN, "train.lrr=1"], "unknown key 'train.lrr'; valid keys under 'train'"),
    ("wrong-type", "train", [*TRAIN, "train.max_steps=many"], "bad value for 'train.max_steps' (expected int)"),
    ("max-steps-0", "train", [*TRAIN, "train.max_steps=0"], "'train.max_steps' is 0; expected a finite value >= 1"),
    ("log-every-0", "train", [*TRAIN, "log.every=0"], "'log.every' is 0; expected a finite value >= 1"),
    ("checkpoint-every-0", "train", [*TRAIN, "log.checkpoint_every=0"], "'log.checkpoint_every' is 0; expected"),
    ("grad-accum-0", "train", [*TRAIN, "train.grad_accum_steps=0"], "'train.grad_accum_steps' is 0; expected"),
    ("batch-negative", "train", [*TRAIN, "train.global_batch_size=-8"], "'train.global_batch_size' is -8; expected"),
    ("lr-negative", "train", [*TRAIN, "train.lr=-1e-4"], "'train.lr' is -0.0001; expected a finite value >= 0"),
    ("keep-negative", "train", [*TRAIN, "log.keep_checkpoints=-1"], "'log.keep_checkpoints' is -1; expected"),
    (
        "batch-split",
        "train",
        [*TRAIN, "train.global_batch_size=63", "train.grad_accum_steps=2"],
        "train.global_batch_size=63 does not split over 1 processes x 2 accumulation steps",
    ),
    ("unknown-argument", "train", [*TRAIN, "--bogus"], "unrecognized arguments: --bogus (see train.py --help)"),
    (
        "resume-missing",
        "train",
        [*TRAIN, "--resume", "{tmp}/nowhere"],
        "resume checkpoint {tmp}/nowhere does not exist",
    ),
    (
        "resume-and-overwrite",
        "train",
        [*TRAIN, "--resume", "latest", "--overwrite"],
        "argument --overwrite: not allowed with argument --resume",
    ),
    (
        "run-in-use",
        "train",
        ["--config", str(DIGITS), "run.dir={tmp}/used-run"],
        "run.dir {tmp}/used-run already holds a run (metrics.jsonl): continue it with --resume latest, choose another "
        "run.dir=..., or pass --overwrite",
    ),
    # data mismatches (issue 20): named before any model is built (an unloadable vae.name is never reached)
    ("no-data-images", "train", [*ON_IMAGES], "data.source=images needs data.images=<folder with one sub-folder"),
    (
        "no-image-folder",
        "train",
        [*ON_IMAGES, "data.images={tmp}/nowhere"],
        "data.images={tmp}/nowhere: the image folder does not exist",
    ),
    (
        "num-classes",
        "train",
        [*ON_IMAGES, "data.images={tmp}/images"],
        "data.num_classes=10, but the image folder {tmp}/images holds 3 classes (n01440764, n01443537, n01484850): "
        "set data.num_classes=3",
    ),
    (
        "latents-image-size",
        "train",
        [*ON_LATENTS, "data.latents={tmp}/latents-32", "data.image_size=16"],
        "data.image_size=16, but the latents in {tmp}/latents-32/manifest.json were extracted at 32 px",
    ),
    (
        "latents-num-classes",
        "train",
        [*ON_LATENTS, "data.latents={tmp}/latents-32", "data.image_size=32"],
        "data.num_classes=10, but {tmp}/latents-32/manifest.json holds 2 classes (a, b): set data.num_classes=2",
    ),
    (
        "no-manifest",
        "train",
        [*ON_LATENTS, "data.latents={tmp}/images"],
        "data.latents={tmp}/images: {tmp}/images/manifest.json not found",
    ),
    (
        "latents-without-statistics",
        "train",
        [*ON_LATENTS, "data.latents={tmp}/latents-32", "vae.normalize=channels"],
        "vae.normalize=channels, but {tmp}/latents-32/manifest.json has no per-channel statistics",
    ),
    (
        "channel-statistics-of-images",
        "train",
        [*ON_IMAGES, "data.images={tmp}/images", "vae.normalize=channels"],
        "'vae.normalize' is channels, but data.source=images: the per-channel statistics come from the extracted",
    ),
    # issue 41: LightningDiT's options that do not fit together
    (
        "rope-head-dim",
        "train",
        [*TRAIN, "model.blocks=lightning", "model.hidden_size=24", "model.num_heads=4"],
        "'model.rope' needs a head dimension divisible by 4 (rows and columns of channel pairs); DiT-S/2 has 6",
    ),
    (
        "cosine-loss-noise",
        "train",
        [*TRAIN, "model.name=SiT-S/2", "transport.prediction=noise", "transport.cosine_loss_weight=1"],
        "'transport.cosine_loss_weight' is 1, but transport.prediction=noise: the velocity-direction loss needs",
    ),
    # issue 48: the grids' sampler and steps, checked before training (the first grid came after the first
    # checkpoint and stopped the run there)
    (
        "preview-sampler",
        "train",
        [*TRAIN, "model.name=SiT-S/2"],  # the digits config's log.sample_sampler is ddim
        "'log.sample_sampler' is 'ddim'; SiT-S/2's objective offers euler, heun, dopri5",
    ),
    (
        "preview-adaptive-steps",
        "train",
        [*TRAIN, "model.name=SiT-S/2", "log.sample_sampler=null"],
        "'log.sample_steps' is 50, but log.sample_sampler=dopri5 (the default) chooses its own steps: set",
    ),
    ("latents-no-folders", "latents", ["--config", str(DIGITS)], "latent extraction needs data.images="),
    ("latents-bad-value", "latents", ["--config", str(DIGITS), "extract.batch_size=0"], "'extract.batch_size' is 0"),
    ("demo-num-samples", "demo", ["--out", "{tmp}/demo", "--num-samples", "0"], "--num-samples must be positive"),
    ("demo-override", "demo", ["--out", "{tmp}/demo", "train.lrr=1"], "unknown key 'train.lrr'"),
    ("sample-num-samples", "sample", [*SAMPLE, "--num-samples", "0"], "--num-samples must be positive, got 0"),
    ("sample-argument-type", "sample", [*SAMPLE, "--seed", "x"], "argument --seed: invalid int value: 'x'"),
    ("sample-seed-negative", "sample", [*SAMPLE, "--seed", "-1"], "--seed must be >= 0, got -1"),
    (
        "ckpt-symlink-loop",
        "sample",
        ["--ckpt", "{tmp}/loop-a", "--out", "{tmp}/samples.npz", "--num-samples", "4"],
        "--ckpt: {tmp}/loop-a: a loop of symbolic links; expected an export folder",
    ),
    (
        "cut-ema",
        "sample",
        ["--ckpt", "{tmp}/cut-weights", "--out", "{tmp}/samples.npz", "--num-samples", "4"],
        "--ckpt: {tmp}/cut-weights/ema.safetensors cannot be read as safetensors",
    ),
    (
        "cut-export-config",
        "sample",
        ["--ckpt", "{tmp}/cut-config", "--out", "{tmp}/samples.npz", "--num-samples", "4"],
        "--ckpt: {tmp}/cut-config/config.json is not valid JSON",
    ),
    (
        "cut-official",
        "sample",
        ["--ckpt", "{tmp}/DiT-S-8-256x256.pt", "--out", "{tmp}/samples.npz", "--num-samples", "4"],
        "--ckpt: {tmp}/DiT-S-8-256x256.pt cannot be read",
    ),
    (
        "foreign-json",
        "sample",
        ["--ckpt", "{tmp}/export", "--out", "{tmp}/foreign-json/report.npz", "--num-samples", "4"],
        "{tmp}/foreign-json/report.json exists and was not written by sample.py; choose another --out",
    ),
    (
        "out-below-a-file",  # issue 47: was "folder {tmp}/bad.yaml does not exist"
        "sample",
        ["--ckpt", "{tmp}/export", "--out", "{tmp}/bad.yaml/x.npz", "--num-samples", "4"],
        "cannot write in {tmp}/bad.yaml: {tmp}/bad.yaml is a file, not a folder",
    ),
    (
        "foreign-png",
        "sample",
        ["--ckpt", "{tmp}/export", "--out", "{tmp}/foreign-png/report.npz", "--num-samples", "4"],
        "{tmp}/foreign-png/report.png exists and was not written by sample.py; choose another --out",
    ),
]


def tree(root: Path) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("command, arguments, message", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_user_error_is_one_line_and_exit_status_2_and_writes_nothing(
    inputs, capsys, monkeypatch, command, arguments, message
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(inputs)
    main = COMMANDS[command]()
    before = tree(inputs)
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as exit_:
            run_command(main, [argument.format(tmp=inputs) for argument in arguments])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert exit_.value.code == USER_ERROR_STATUS
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert message.format(tmp=inputs) in lines[0]
    assert tree(inputs) == before  # nothing created, nothing changed


def test_several_processes_without_train_cpu_are_refused(inputs, capsys, monkeypatch):
    # What torchrun --nproc_per_node 2 sets; on this GPU-less machine Accelerate then sees a single process.
    monkeypatch.setenv("WORLD_SIZE", "2")
    main = COMMANDS["train"]()
    try:
        with pytest.raises(SystemExit, match=str(USER_ERROR_STATUS)):
            run_command(main, ["--config", str(DIGITS), *TINY, f"run.dir={inputs}/two"])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert capsys.readouterr().err == (
        "error: launched 2 processes but Accelerate sees one: on a machine without GPUs add train.cpu=true\n"
    )
    assert not (inputs / "two").exists()


def test_debug_keeps_the_traceback(inputs):
    main = COMMANDS["train"]()
    with pytest.raises(ConfigError, match="'train.max_steps' is 0"):
        run_command(main, [*[a.format(tmp=inputs) for a in TRAIN], "train.max_steps=0", "--debug"])


def test_a_bug_keeps_its_traceback():
    def main(argv):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        run_command(main, [])


@pytest.mark.parametrize(
    "script, arguments, message",
    [
        ("train.py", ["--config", "{tmp}/bad.yaml"], "error: {tmp}/bad.yaml: not valid YAML"),
        (
            "sample.py",
            ["--ckpt", "{tmp}/cut-weights", "--out", "{tmp}/s.npz", "--num-samples", "4"],
            "error: --ckpt: {tmp}/cut-weights/ema.safetensors cannot be read as safetensors",
        ),
    ],
    ids=["train", "sample"],
)
def test_a_real_command_prints_one_line_and_exits_2(inputs, script, arguments, message):
    result = subprocess.run(
        [sys.executable, str(ROOT / script), *[a.format(tmp=inputs) for a in arguments]],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == USER_ERROR_STATUS
    assert result.stderr.startswith(message.format(tmp=inputs)) and result.stderr.count("\n") == 1, result.stderr
    assert not (inputs / "s.npz").exists()


def test_a_non_finite_loss_is_one_line(capsys):
    from training.loop import NonFiniteLossError

    def main(argv):  # what Trainer.stop_if_non_finite raises (tested in tests/test_train.py)
        raise NonFiniteLossError("the loss is not finite at step 7; ... train.mixed_precision=fp32)")

    with pytest.raises(SystemExit, match=str(USER_ERROR_STATUS)):
        run_command(main, [])
    assert capsys.readouterr().err == "error: the loss is not finite at step 7; ... train.mixed_precision=fp32)\n"


@pytest.mark.parametrize("command", ["train", "demo"])
def test_any_output_folder_where_a_file_stands_is_one_line(tmp_path, capsys, command):
    # Before (train.py run.dir=FILE): NotADirectoryError's traceback from the writability probe.

    mine = tmp_path / "mine.txt"
    mine.write_text("not yours\n")
    argv = ["--config", str(DIGITS), f"run.dir={mine}"] if command == "train" else ["--out", str(mine)]
    error = one_line_error(COMMANDS[command](), argv, capsys)
    assert error == f"error: cannot write in {mine}: {mine} is a file, not a folder; choose another place"
    assert mine.read_text() == "not yours\n"
