"""Representation alignment (training.repa): the loss against a float64 re-derivation, the grid rule against a
direct computation, where gradients go, the frozen encoder, offline loading and its errors, and train.py with
REPA on for both objectives and both attentions (checkpoints, exports, --resume, two processes).

The encoder is a small random timm ViT saved with timm's save_for_hf into a temporary folder: nothing is
downloaded.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from accelerate.state import AcceleratorState, GradientState
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from _launch import GLOO_THREADS_AT_EXIT, NO_GLOO_THREAD_AT_EXIT, TORCHRUN_TWO_PROCESSES
from _tiny_models import ENCODER_WIDTH, save_vit
from _tiny_runs import TINY_REPA, metrics, summary_rows
from dit_vca import create_diffusion
from dit_vca.models import create_model
from generation import ImageGenerator, read_export
from sit_vca import create_transport
from training.checkpoint_folders import CheckpointError
from training.config import ConfigError, RepaConfig, load_config
from training.repa import (
    EncoderUnavailableError,
    RepresentationAlignment,
    alignment_loss,
    build_projector,
    check_grids,
    load_encoder,
    match_grid,
)

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "configs" / "digits.yaml"


@pytest.fixture(scope="module")
def encoder_folder(tmp_path_factory):
    return save_vit(tmp_path_factory.mktemp("encoder") / "tiny-vit")


# --------------------------------------------------------------------------------------------------
#                                        Loss, grid, projector
# --------------------------------------------------------------------------------------------------


def test_alignment_loss_is_the_negative_mean_patch_cosine_in_float64():
    generator = torch.Generator().manual_seed(0)
    projected, features = torch.randn(2, 3, 5, 7, generator=generator).unbind(0)  # (3, 5, 7) each
    p, f = projected.double().numpy(), features.double().numpy()
    expected = np.array(
        [
            np.mean([-(p[b, n] @ f[b, n]) / (np.linalg.norm(p[b, n]) * np.linalg.norm(f[b, n])) for n in range(5)])
            for b in range(3)
        ]
    )
    # float32 dot products of unit vectors of 7 elements: rounding ~1e-7 each, far below 1e-6.
    np.testing.assert_allclose(alignment_loss(projected, features).numpy(), expected, rtol=0, atol=1e-6)
    assert alignment_loss(features, features).tolist() == pytest.approx([-1.0] * 3, abs=1e-6)


def test_alignment_loss_of_float16_features_is_finite():
    # Squares of 300 overflow float16 (max 65504): normalising in float16 gives inf norms; float32 does not.
    features = torch.full((1, 4, 768), 300.0, dtype=torch.float16)
    assert torch.isinf((features * features).sum(-1)).all()
    assert alignment_loss(features, features).item() == pytest.approx(-1.0, abs=1e-6)


@pytest.mark.parametrize("encoder_grid, model_grid", [(8, 4), (12, 4), (4, 8), (4, 12), (6, 6)])
def test_grid_matching_is_the_area_mean_of_the_patches_under_each_token(encoder_grid, model_grid):
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(2, encoder_grid * encoder_grid, 3, generator=generator, dtype=torch.float64)
    grid = features.numpy().reshape(2, encoder_grid, encoder_grid, 3)
    expected = np.zeros((2, model_grid, model_grid, 3))
    for i in range(model_grid):
        for j in range(model_grid):
            if encoder_grid >= model_grid:  # each token covers k x k patches: their mean
                k = encoder_grid // model_grid
                expected[:, i, j] = grid[:, i * k : (i + 1) * k, j * k : (j + 1) * k].mean(axis=(1, 2))
            else:  # each patch covers k x k tokens: its feature
                k = model_grid // encoder_grid
                expected[:, i, j] = grid[:, i // k, j // k]
    matched = match_grid(features, model_grid).numpy()  # (2, Gm*Gm, 3)
    # float64 averages of at most 9 numbers: exact to ~1e-15.
    np.testing.assert_allclose(matched, expected.reshape(2, -1, 3), rtol=0, atol=1e-12)


@pytest.mark.parametrize("encoder_grid, model_grid", [(16, 6), (6, 16), (5, 2)])
def test_grids_that_do_not_divide_are_refused(encoder_grid, model_grid):
    with pytest.raises(ConfigError, match=f"{encoder_grid}x{encoder_grid} patch grid cannot be matched"):
        check_grids(encoder_grid, model_grid)


def test_projector_is_three_linears_with_silu():
    projector = build_projector(32, 64, 24)
    assert [type(layer).__name__ for layer in projector] == ["Linear", "SiLU", "Linear", "SiLU", "Linear"]
    assert (projector[0].in_features, projector[2].in_features, projector[4].out_features) == (32, 64, 24)


# --------------------------------------------------------------------------------------------------
#                                        Encoder and gradients
# --------------------------------------------------------------------------------------------------


def repa(encoder_folder: Path, **changes) -> RepaConfig:
    return RepaConfig(**{"encoder": str(encoder_folder), "depth": 1, "projector_dim": 16, "input_size": 8, **changes})


def test_encoder_from_a_folder_is_the_saved_vit_frozen_in_eval_mode(encoder_folder, tmp_path):
    encoder = load_encoder(repa(encoder_folder), image_channels=1, model_grid=4)
    torch.manual_seed(0)  # the saved weights
    vit = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=8,
        patch_size=2,
        in_chans=1,
        embed_dim=ENCODER_WIDTH,
        depth=2,
        num_heads=2,
        num_classes=0,
    ).eval()
    images = torch.rand(3, 1, 8, 8) * 2 - 1
    expected = vit.forward_features(((images + 1) / 2 - 0.5) / 0.5)[:, 1:]  # timm's default mean/std: 0.5
    torch.testing.assert_close(encoder(images), expected, rtol=0, atol=0)
    encoder.train()
    assert not encoder.training and not encoder.vit.training
    assert not any(p.requires_grad for p in encoder.parameters())
    assert (encoder.grid, encoder.width) == (4, ENCODER_WIDTH)
    # a 4 px input is resized (bicubic) to the encoder's 8 px; a 16 px encoder input makes an 8x8 patch grid
    assert encoder(torch.zeros(2, 1, 4, 4)).shape == (2, 16, ENCODER_WIDTH)
    assert load_encoder(repa(encoder_folder, input_size=16), 1, model_grid=4).grid == 8
    rgb = load_encoder(repa(save_vit(tmp_path / "rgb", in_chans=3)), image_channels=1, model_grid=4)
    assert rgb(torch.zeros(2, 1, 8, 8)).shape == (2, 16, ENCODER_WIDTH)  # grey images fed to an RGB encoder


def test_encoder_runs_under_the_runs_autocast_and_returns_float32(encoder_folder):
    encoder = load_encoder(repa(encoder_folder), image_channels=1, model_grid=4)
    images = torch.rand(4, 1, 8, 8) * 2 - 1
    exact = encoder(images)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what accelerator.autocast() is for a bf16 run
        low = encoder(images)
    assert low.dtype == torch.float32 and not torch.equal(low, exact)  # computed in bf16, handed back in float32
    # bf16 keeps 8 mantissa bits (relative error ~0.4 % per rounding); through two blocks the features keep
    # their direction: a mean patch cosine above 0.99 for every image.
    assert (alignment_loss(low, exact) < -0.99).all()


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(input_size=12), "the encoder's 6x6 patch grid cannot be matched with the model's 4x4"),
        (dict(input_size=9), "'train.repa.input_size' is 9; expected a multiple of the encoder's patch size 2"),
        (dict(mean=[0.1, 0.2, 0.3], std=[1.0, 1.0, 1.0]), "have 3/3 values, the encoder takes 1 channels"),
    ],
)
def test_encoder_settings_that_do_not_fit_are_one_line_errors(encoder_folder, changes, message):
    with pytest.raises(ConfigError) as raised:
        load_encoder(repa(encoder_folder, **changes), image_channels=1, model_grid=4)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_encoder_errors_name_the_folder_and_how_to_save_one(encoder_folder, tmp_path, monkeypatch):
    with pytest.raises(EncoderUnavailableError, match="no such folder or file"):
        load_encoder(repa(tmp_path / "missing"), 1, 4)
    (tmp_path / "empty").mkdir()
    with pytest.raises(EncoderUnavailableError, match="has no config.json; expected a folder written by timm"):
        load_encoder(repa(tmp_path / "empty"), 1, 4)
    with pytest.raises(EncoderUnavailableError, match="neither a folder nor a timm model name"):
        load_encoder(repa("vit_nonexistent_patch99"), 1, 4)
    damaged = shutil.copytree(encoder_folder, tmp_path / "damaged")
    (damaged / "model.safetensors").write_bytes(b"cut")
    with pytest.raises(EncoderUnavailableError, match="cannot load the encoder in"):
        load_encoder(repa(damaged), 1, 4)
    # A real timm name without a local copy while offline: timm's download raises; the answer says how to save one.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(EncoderUnavailableError) as raised:
        load_encoder(repa("vit_small_patch14_reg4_dinov2.lvd142m", input_size=14), 3, 1)
    message = str(raised.value)
    assert "save_for_hf(timm.create_model('vit_small_patch14_reg4_dinov2.lvd142m', pretrained=True)" in message
    assert "train.repa.encoder=encoders/vit_small_patch14_reg4_dinov2.lvd142m" in message and "\n" not in message


@pytest.mark.parametrize("objective", ["diffusion", "transport"])
@pytest.mark.parametrize("attention", ["vca", "mhsa"])
def test_alignment_trains_the_projector_and_the_blocks_up_to_depth_only(encoder_folder, objective, attention):
    torch.manual_seed(0)
    model = create_model(
        "DiT-S/2",
        attention=attention,
        input_size=8,
        in_channels=1,
        num_classes=10,
        learn_sigma=False,
        depth=3,
        hidden_size=32,
        num_heads=2,
    )
    encoder = load_encoder(repa(encoder_folder), image_channels=1, model_grid=4)
    projector = build_projector(32, 16, encoder.width)
    alignment = RepresentationAlignment(encoder, projector, repa(encoder_folder, depth=2), model_grid=4)
    loss_of = (create_diffusion(learn_sigma=False) if objective == "diffusion" else create_transport()).training_losses
    x, y = torch.rand(4, 1, 8, 8) * 2 - 1, torch.arange(4)

    torch.manual_seed(1)
    plain = loss_of(model, x, y)["loss"]
    torch.manual_seed(1)
    with torch.no_grad():
        targets = alignment.targets(x)
    objective_loss, aligned = alignment.losses(loss_of, model, x, y, targets)
    assert torch.equal(objective_loss, plain)  # the objective sees the same model output
    assert aligned.shape == (4,) and (aligned.abs() <= 1).all()

    aligned.mean().backward()  # the alignment loss alone
    reached = {
        name.split(".")[0] + ("." + name.split(".")[1] if name.startswith("blocks") else "")
        for name, p in model.named_parameters()
        if p.grad is not None and p.grad.abs().sum() > 0
    }
    # adaLN-Zero: block outputs do not depend on attention/MLP weights at initialisation (zero gates), so the
    # gradient reaches the embedders and the modulation of blocks 0 and 1; nothing after block 2.
    assert {"x_embedder", "blocks.0", "blocks.1"} <= reached and not reached & {"blocks.2", "final_layer"}
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in projector.parameters())
    assert all(p.grad is None for p in encoder.parameters())


# --------------------------------------------------------------------------------------------------
#                                            train.py
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["DiT-S/2", "SiT-S/2"])
@pytest.mark.parametrize("attention", ["vca", "mhsa"])
def test_repa_trains_logs_the_alignment_loss_and_keeps_the_projector_out_of_exports(
    train_script, encoder_folder, tmp_path, model, attention
):
    run_dir = tmp_path / "run"
    train_script.main(
        [
            "--config",
            str(DIGITS),
            *TINY_REPA,
            f"model.name={model}",
            f"model.attention={attention}",
            f"train.repa.encoder={encoder_folder}",
            "train.max_steps=4",
            "log.every=2",
            "log.checkpoint_every=4",
            "log.trackers=[tensorboard]",
            f"run.dir={run_dir}",
        ]
    )
    lines = metrics(run_dir)
    assert [line["step"] for line in lines] == [2, 4]
    assert all(-1 <= line["alignment_loss"] <= 1 for line in lines)
    scalars = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    logged = [(event.step, event.value) for event in scalars.Scalars("train/alignment_loss")]
    assert logged == [(line["step"], pytest.approx(line["alignment_loss"], rel=1e-6)) for line in lines]
    checkpoint = run_dir / "checkpoints" / "step-0000004"
    projector = load_file(checkpoint / "model_1.safetensors")
    assert sorted(projector) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]
    assert projector["4.weight"].shape == (ENCODER_WIDTH, 16)
    exported = read_export(checkpoint)
    weights = load_file(checkpoint / "export" / "ema.safetensors")
    assert not any(key.startswith(("0.", "2.", "4.")) for key in weights) and "repa" not in json.dumps(
        exported.description.to_json()["model"]
    )
    sampler = "ddim" if model.startswith("DiT") else "euler"
    assert ImageGenerator.from_export(exported).generate([0, 1], [0, 1], sampler=sampler, steps=2).shape[0] == 2


def test_repa_off_writes_no_projector_and_no_alignment_loss(train_script, tmp_path):
    run_dir = tmp_path / "run"
    train_script.main(["--config", str(DIGITS), *TINY_REPA, "train.max_steps=2", "log.every=2", f"run.dir={run_dir}"])
    assert "alignment_loss" not in metrics(run_dir)[0]
    assert not (run_dir / "checkpoints" / "step-0000002" / "model_1.safetensors").exists()


def test_resume_with_repa_is_bit_identical_and_refuses_other_structure(train_script, encoder_folder, tmp_path):
    arguments = [
        "--config",
        str(DIGITS),
        *TINY_REPA,
        f"train.repa.encoder={encoder_folder}",
        "train.max_steps=6",
        "log.every=2",
        "log.checkpoint_every=3",
    ]
    reference = tmp_path / "reference"
    train_script.main([*arguments, f"run.dir={reference}"])
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / "step-0000003", resumed / "checkpoints" / "step-0000003")
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    train_script.main([*arguments, f"run.dir={resumed}", "--resume", "latest"])
    ours, theirs = resumed / "checkpoints" / "step-0000006", reference / "checkpoints" / "step-0000006"
    for name in ("model.safetensors", "model_1.safetensors", "export/ema.safetensors"):
        a, b = load_file(ours / name), load_file(theirs / name)
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a), name

    def strip(lines):
        return [{k: v for k, v in line.items() if k not in ("steps_per_s", "images_per_s")} for line in lines]

    assert strip(metrics(resumed))[-1] == strip(metrics(reference))[-1]

    for changed, message in [
        ("train.repa.depth=2", "train.repa.depth=1, this launch has 2"),
        ("train.repa.encoder=null", f"train.repa.encoder='{encoder_folder}', this launch has None"),
    ]:
        with pytest.raises(ConfigError, match="cannot change on resume") as raised:
            train_script.main([*arguments, f"run.dir={resumed}", "--resume", "latest", changed])
        assert message in str(raised.value)
    broken = resumed / "checkpoints" / "step-0000003"
    (broken / "model_1.safetensors").write_bytes(b"cut")  # damaged: named by the checkpoint check
    with pytest.raises(CheckpointError, match="model_1.safetensors cannot be read"):
        train_script.main([*arguments, f"run.dir={resumed}", "--resume", str(broken)])
    (broken / "model_1.safetensors").unlink()  # missing
    with pytest.raises(ConfigError, match="REPA's projector model_1.safetensors is missing"):
        train_script.main([*arguments, f"run.dir={resumed}", "--resume", str(broken)])
    # The coefficient only weighs the loss: a resume with another one applies it.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    train_script.main(
        [*arguments, f"run.dir={resumed}", "--resume", str(ours), "train.max_steps=8", "train.repa.coefficient=1.0"]
    )
    assert metrics(resumed)[-1]["step"] == 8


@pytest.mark.parametrize(
    "changes, message",
    [
        (["train.repa.encoder=vit_nonexistent_patch99"], "neither a folder nor a timm model name"),
        (["train.repa.depth=3"], "'train.repa.depth' is 3, but DiT-S/2 with model.depth=2 has 2 blocks; expected 1..2"),
        (
            ["train.repa.input_size=12"],
            "the encoder's 6x6 patch grid cannot be matched with the model's 4x4 token grid",
        ),
    ],
)
def test_bad_repa_settings_fail_before_any_model_is_built(
    train_script, encoder_folder, tmp_path, monkeypatch, changes, message
):
    import training.build

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(training.build, "build_model", no_model)
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as raised:
        train_script.main(
            [
                "--config",
                str(DIGITS),
                *TINY_REPA,
                f"train.repa.encoder={encoder_folder}",
                f"run.dir={run_dir}",
                *changes,
            ]
        )
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert not run_dir.exists()


def test_bad_repa_values_are_config_errors():
    with pytest.raises(ConfigError, match="'train.repa.coefficient' is 0.0; expected a finite value > 0"):
        load_config(DIGITS, ["train.repa.coefficient=0"])
    with pytest.raises(ConfigError, match="unknown key 'train.repa.weight'; valid keys under 'train.repa'"):
        load_config(DIGITS, ["train.repa.weight=1"])
    assert not load_config(DIGITS).train.repa.enabled  # off by default


DDP_CHECK = """
import sys, torch
from pathlib import Path
from commands import end_processes
from training.accelerator import create_accelerator
from training.build import build_training
from training.config import load_config
from training.loop import Trainer, TrainerState
from training.run import RunDirectory


def main():  # a function, as train.py's: the DDP-wrapped models hold the process group until it returns
    config = load_config(sys.argv[1], sys.argv[2:])
    accelerator = create_accelerator(config, RunDirectory(Path(config.run.dir)))
    parts = build_training(config, accelerator)
    trainer = Trainer(accelerator, config, RunDirectory(Path(config.run.dir)), parts, TrainerState())
    stream = parts.batches.stream(0)
    for _ in range(3):
        trainer.optimizer_step(stream)
    for name, module in (("model", parts.model), ("projector", parts.alignment.projector)):
        flat = torch.cat([p.detach().flatten() for p in module.parameters()])[None]
        copies = accelerator.gather(flat)                                   # (processes, P)
        assert torch.equal(copies[0], copies[1]), name
        accelerator.print(name, "identical on", len(copies), "processes")
    accelerator.wait_for_everyone()
    end_processes(accelerator)  # as train.py's loop ends


main()
"""


def test_two_processes_keep_model_and_projector_identical(encoder_folder, tmp_path):
    script = tmp_path / "ddp_check.py"
    script.write_text(GLOO_THREADS_AT_EXIT + DDP_CHECK)  # it prints the gloo threads left at exit
    command = [
        *TORCHRUN_TWO_PROCESSES,
        str(script),
        str(DIGITS),
        *TINY_REPA,
        f"train.repa.encoder={encoder_folder}",
        "train.cpu=true",
        "train.grad_accum_steps=2",
        "train.max_steps=3",
        f"run.dir={tmp_path / 'run'}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert "model identical on 2 processes" in done.stdout and "projector identical on 2 processes" in done.stdout, (
        done.stderr[-3000:]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(NO_GLOO_THREAD_AT_EXIT) == 2, done.stdout  # the process group was freed before exit


def test_the_input_size_is_the_encoders_own_when_unset(encoder_folder, tmp_path):
    assert load_encoder(repa(encoder_folder, input_size=None), 1, model_grid=4).input_size == 8  # built for 8 px
    built_for_16 = save_vit(tmp_path / "vit-16", img_size=16)
    encoder = load_encoder(repa(built_for_16, input_size=None), 1, model_grid=4)
    assert (encoder.input_size, encoder.grid) == (16, 8)
    assert load_encoder(repa(built_for_16, input_size=8), 1, model_grid=4).input_size == 8  # a set size wins


def test_the_startup_summary_has_a_repa_line_and_counts_the_projector(train_script, tmp_path, capsys):

    built_for_16 = save_vit(tmp_path / "vit-16", img_size=16)  # patch 2: an 8x8 grid over the model's 4x4 tokens
    run_dir = tmp_path / "run"
    train_script.main(
        [
            "--config",
            str(DIGITS),
            *(option for option in TINY_REPA if not option.startswith("train.repa.input_size")),
            f"train.repa.encoder={built_for_16}",
            "train.max_steps=1",
            "log.checkpoint_every=1",
            f"run.dir={run_dir}",
        ]
    )
    rows = summary_rows(capsys.readouterr().out)
    projector = sum(p.numel() for p in build_projector(32, 16, ENCODER_WIDTH).parameters())
    assert rows["REPA"] == (
        f"encoder {built_for_16}, block 1, input 16 px, encoder grid 8x8 -> model grid 4x4, "
        f"projector {projector:,} parameters, coefficient 0.5"
    )
    checkpoint = run_dir / "checkpoints" / "step-0000001"
    model = sum(tensor.numel() for tensor in load_file(checkpoint / "export" / "ema.safetensors").values())
    assert projector == sum(tensor.numel() for tensor in load_file(checkpoint / "model_1.safetensors").values())
    assert f": {model + projector:,} parameters (" in rows["model"]
    assert f"REPA's projector {projector:,} included; attention layers" in rows["model"]


def test_the_offline_recipe_of_the_training_page_runs(train_script, tmp_path, monkeypatch, capsys):
    """docs/training.md's tiny-RGB-encoder recipe, both blocks as written (only shortened to 2 steps, no grids)."""
    import re
    import shlex
    import textwrap

    page = (ROOT / "docs" / "training.md").read_text()
    recipe = page[page.index("*Trying it offline.*") : page.index("*Grids.*")]
    snippet = textwrap.dedent(re.search(r"```python\n(.*?)```", recipe, re.S).group(1))
    command = shlex.split(re.search(r"```bash\n(.*?)```", recipe, re.S).group(1).strip())
    assert command[:2] == ["python", "train.py"]
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, "docs/training.md", "exec"), {})
    train_script.main([*command[2:], "train.max_steps=2", "log.sample_every=0", "log.trackers=[]"])
    rows = summary_rows(capsys.readouterr().out)
    folder = tmp_path.resolve() / "encoders" / "tiny-rgb"  # named by its absolute path (training.encoder_source)
    assert rows["REPA"].startswith(f"encoder {folder}, block 2, input 32 px, encoder grid 8x8 -> model grid 4x4")
    assert summary_rows((tmp_path / "results" / "digits-repa" / "startup.txt").read_text()) == rows
