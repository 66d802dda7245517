"""What grids and FID during training draw from (log.fid_weights: the EMA, the raw weights or a post-hoc EMA
profile), and the loss and FID curves drawn to <run>/curves.png at each checkpoint (issue 39)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import dit_vca
from _tiny_runs import run_train, summary_rows
from generation import ImageGenerator, read_export
from generation.generator import pixel_decoder
from generation.objective_builder import create_objective
from training.config import ConfigError, PosthocEMAConfig, load_config
from training.curves import draw_curves
from training.ema import create_ema
from training.power_ema import PowerEMA
from training.preview import PreviewWeights, save_preview_grid

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.hidden_size=32",
    "model.depth=1",
    "model.num_heads=2",
    "train.global_batch_size=16",
    "log.trackers=[]",
]


def test_fid_weights_names_the_ema_the_raw_weights_or_a_tracked_profile():
    profiles = "train.posthoc_ema.sigma_rel=[0.05,0.1]"
    for setting, message in (
        ("bogus", "'log.fid_weights' is 'bogus'; expected ema, raw or sigma_rel=S with S one of"),
        ("sigma_rel=0.07", "'log.fid_weights' is 'sigma_rel=0.07', a profile this run does not track; expected"),
        ("sigma_rel=x", "'log.fid_weights' is 'sigma_rel=x'; expected ema, raw or sigma_rel=S"),
    ):
        with pytest.raises(ConfigError) as raised:
            load_config("digits", [profiles, f"log.fid_weights={setting}"])
        assert message in str(raised.value) and "train.posthoc_ema.sigma_rel=[0.05, 0.1]" in str(raised.value)
    for good in ("ema", "raw", "sigma_rel=0.05", "sigma_rel=0.10"):
        assert load_config("digits", [profiles, f"log.fid_weights={good}"]).log.fid_weights == good


def test_preview_weights_hold_what_fid_weights_names():
    model = dit_vca.create_model("DiT-S/2", depth=1, hidden_size=32, num_heads=2, input_size=8, in_channels=1)
    train = load_config("digits").train
    ema = create_ema(model, train)
    profiles = PowerEMA(model, PosthocEMAConfig(sigma_rel=[0.05, 0.1]), batch=4)
    generator = torch.Generator().manual_seed(0)
    for step in range(1, 4):  # three "optimiser steps"
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator))
        ema.update(model, step=step)
        profiles.update(model)
    ema_state = {key: value.clone() for key, value in ema.module.state_dict().items()}

    assert PreviewWeights("ema", ema, None).module is ema.module
    raw = PreviewWeights("raw", ema, None)
    raw.refresh(model)
    for key, value in model.state_dict().items():
        assert torch.equal(raw.module.state_dict()[key], value), key
    profile = PreviewWeights("sigma_rel=0.1", ema, profiles)
    profile.refresh(model)
    for key, value in zip(profiles.keys, profiles.averages[1]):
        assert torch.equal(profile.module.state_dict()[key], value), key
    assert not torch.equal(
        profile.module.state_dict()["x_embedder.proj.weight"], model.state_dict()["x_embedder.proj.weight"]
    )
    for key, value in ema.module.state_dict().items():  # the EMA itself is never touched
        assert torch.equal(value, ema_state[key]), key
    assert (raw.label, profile.label) == ("raw weights", "post-hoc EMA sigma_rel 0.1")


@pytest.mark.slow
def test_a_short_run_draws_its_grid_from_the_raw_weights_and_its_curves_at_each_checkpoint(
    tmp_path, capsys, monkeypatch
):
    """log.fid_weights=raw: the grid of step 2 is the grid of the checkpoint's trained (not averaged) weights, drawn
    anew here; the EMA's grid of the same step differs. curves.png is drawn at each checkpoint (CURVES_INTERVAL_S
    apart at least: 0 here), and not again at the end when nothing came since."""
    import training.loop

    drawn = []
    monkeypatch.setattr(training.loop, "CURVES_INTERVAL_S", 0.0)
    monkeypatch.setattr(training.loop, "draw_curves", lambda *args: drawn.append(args[0]) or draw_curves(*args))
    run_dir = tmp_path / "run"
    run_train(
        "--config",
        "digits",
        *TINY,
        "train.max_steps=2",
        "log.every=1",
        "log.checkpoint_every=1",
        "log.sample_every=2",
        "log.sample_count=4",
        "log.sample_steps=2",
        "log.fid_weights=raw",
        f"run.dir={run_dir}",
    )
    rows = summary_rows(capsys.readouterr().out)
    assert rows["grids and FID"] == "from the raw weights (log.fid_weights=raw)"
    checkpoint = run_dir / "checkpoints" / "step-0000002"
    export = read_export(checkpoint / "export")
    config = load_config(run_dir / "config.yaml")
    log = config.log
    trained = dit_vca.DiT(export.description.model)
    trained.load_state_dict(load_file(checkpoint / "model.safetensors"))
    objective = create_objective(export.description.objective)
    title = "step 2, raw weights, guidance 1"
    ours = ImageGenerator(trained.eval(), objective, pixel_decoder(export.description, None), 10)
    save_preview_grid(ours, log, tmp_path / "raw.png", title)
    written = np.asarray(Image.open(run_dir / "samples" / "step-0000002.png"))
    assert np.array_equal(written, np.asarray(Image.open(tmp_path / "raw.png")))
    with Image.open(run_dir / "samples" / "step-0000002.png") as grid:  # issue 48: every class whatever the count
        assert grid.text["Rows"].splitlines() == [str(k) for k in range(10)]  # (the sqrt rule drew classes 0 and 5)
        assert grid.text["Title"] == title
        settings = json.loads(grid.text["Settings"])
    assert settings == {
        "run": str(run_dir),
        "step": 2,
        "weights": "raw weights",
        "guidance": 1.0,
        "sampler": "ddim",  # the digits config's
        "steps": 2,
        "sample_count": 4,
        "seed": 0,
    }
    save_preview_grid(ImageGenerator.from_export(export), log, tmp_path / "ema.png", title)
    assert not np.array_equal(written, np.asarray(Image.open(tmp_path / "ema.png")))  # the test can tell them apart

    with Image.open(run_dir / "curves.png") as curves:
        assert curves.size == (550, 400)  # the loss alone: no FID measured
    assert drawn == [run_dir / "metrics.jsonl"] * 2  # after the checkpoints of steps 1 and 2


def curves_description(path: Path) -> str:
    with Image.open(path) as picture:
        return picture.text["Description"]


@pytest.mark.slow
def test_the_curves_end_at_the_last_checkpoint_and_fid_of_a_short_run_and_of_its_resume(tmp_path):
    """With the real interval (a drawing at most once a minute between checkpoints), a run of seconds draws its
    curves at its end, up to its last step and FID, and its resume draws them again with the FID it added. Before,
    the throttle counted from the launch and took the last drawing too: such a run had no curves.png at all, and a
    1500-step run's stopped at step 1000 with one of three FID points."""
    run_dir = tmp_path / "run"
    reference = tmp_path / "reference.npz"
    np.savez(reference, mu=np.zeros(2048), sigma=np.eye(2048))
    fid = ["log.fid_every=2", "log.fid_samples=4", f"log.fid_reference={reference}", "log.fid_inception=bundled"]
    common = ["--config", "digits", *TINY, "log.every=1", "log.checkpoint_every=2", "log.sample_every=0", *fid]
    run_train(*common, "train.max_steps=3", f"run.dir={run_dir}")
    assert curves_description(run_dir / "curves.png") == "loss at steps 1-3 (3 points); FID at steps 2, 3 (4 samples)"
    run_train(*common, "train.max_steps=5", f"run.dir={run_dir}", "--resume", "latest")
    assert curves_description(run_dir / "curves.png") == (
        "loss at steps 1-5 (5 points); FID at steps 2, 3, 4, 5 (4 samples)"
    )


def test_the_curves_show_the_fid_beside_the_loss_and_skip_a_torn_line(tmp_path):
    metrics, fid = tmp_path / "metrics.jsonl", tmp_path / "fid.jsonl"
    assert draw_curves(metrics, fid, tmp_path / "none.png", "run") is None  # nothing logged yet
    lines = [{"step": step, "loss": 1 / step} for step in (50, 100, 150)]
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 20')  # a kill tore the last
    fid.write_text(json.dumps({"step": 100, "fid": 50.0, "samples": 8, "weights": "raw"}) + "\n")
    draw_curves(metrics, fid, tmp_path / "curves.png", "run")
    with Image.open(tmp_path / "curves.png") as curves:
        assert curves.size == (1000, 400)  # two panels: loss and FID
        assert curves.text == {
            "Title": "run",
            "Description": "loss at steps 50-150 (3 points); FID at steps 100 (8 samples)",
            "Software": curves.text["Software"],  # matplotlib's own
        }
