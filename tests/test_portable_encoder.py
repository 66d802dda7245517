"""Run configs that travel, for REPA's encoder: a folder given as train.repa.encoder is recorded by the timm name it
is a copy of (else its absolute path) with its absolute path as a hint, so `train.py --resume <run>` works from
another folder, a resume compares encoders rather than spellings of their folder, and where neither the hint nor
timm can give the encoder, the one line names train.repa.encoder and the missing copy.

The encoders are saved here with timm's save_for_hf (random weights): nothing is downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import huggingface_hub.constants
import pytest
import timm
import torch
import yaml
from timm.models import save_for_hf

from _tiny_models import save_vit
from _tiny_runs import DIGITS, TINY_REPA, metrics, run_train
from commands import run_command
from training.config import ConfigError, RepaConfig, load_config
from training.repa import PROJECTOR_WEIGHTS, EncoderUnavailableError, check_repa_resume, load_encoder

ROOT = Path(__file__).resolve().parents[1]
TIMM_NAME = "test_vit.r160_in1k"  # timm's smallest ViT with a pretrained tag: 0.37 M parameters, patch 16
NAMED = [
    *(option for option in TINY_REPA if not option.startswith("train.repa.input_size")),
    "train.repa.input_size=64",
]


def save_as_downloaded(folder: Path) -> Path:
    """What `save_for_hf(timm.create_model(TIMM_NAME, pretrained=True), folder)` writes, with random weights: the
    architecture, the tag and the arguments of the plain build (save_for_hf records no download source)."""
    torch.manual_seed(0)
    save_for_hf(timm.create_model(TIMM_NAME), folder, safe_serialization=True)
    return folder


def repa_at_launch(*overrides: str) -> RepaConfig:
    """train.repa as a launch with these overrides sees it (named by load_config)."""
    return load_config(DIGITS, [*TINY_REPA, *overrides]).train.repa


def checkpoint(folder: Path, **recorded: str) -> Path:
    """A checkpoint's config.yaml whose train.repa records `recorded` (the structure of TINY_REPA), beside a
    projector."""
    folder.mkdir(parents=True)
    repa = {"depth": 1, "projector_dim": 16, **recorded}
    (folder / "config.yaml").write_text(yaml.safe_dump({"train": {"repa": repa}}))
    (folder / PROJECTOR_WEIGHTS).touch()
    return folder / "config.yaml"


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No hub and an empty Hugging Face cache: a timm name loads only from a local copy."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_config_names_an_encoder_folder_by_the_timm_name_it_copies_else_by_its_absolute_path(tmp_path, monkeypatch):
    named, other = save_as_downloaded(tmp_path / "encoders" / "test-vit"), save_vit(tmp_path / "encoders" / "tiny")
    monkeypatch.chdir(tmp_path)
    repa = repa_at_launch("train.repa.encoder=encoders/test-vit")
    assert (repa.encoder, repa.path) == (TIMM_NAME, str(named))
    repa = repa_at_launch("train.repa.encoder=encoders/test-vit/model.safetensors")  # the weights file names its folder
    assert (repa.encoder, repa.path) == (TIMM_NAME, str(named))
    repa = repa_at_launch("train.repa.encoder=encoders/tiny")  # another size and patch: a copy of no named model
    assert (repa.encoder, repa.path) == (str(other), str(other))
    # studies/digits_encoder's config.json carries vit_tiny_patch16_224's default tag, but it is not that model
    digits = ROOT / "studies" / "digits_encoder"
    repa = repa_at_launch(f"train.repa.encoder={os.path.relpath(digits)}")
    assert (repa.encoder, repa.path) == (str(digits), str(digits))
    repa = repa_at_launch(f"train.repa.encoder={TIMM_NAME}")
    assert (repa.encoder, repa.path) == (TIMM_NAME, None)  # a timm name stays as it is, with no hint
    # a recorded hint that is another encoder here is dropped; one not here is kept for where it is
    assert repa_at_launch(f"train.repa.encoder={TIMM_NAME}", f"train.repa.path={other}").path is None
    assert (
        repa_at_launch(f"train.repa.encoder={TIMM_NAME}", "train.repa.path=/elsewhere/test-vit").path
        == "/elsewhere/test-vit"
    )


def test_a_resume_compares_encoders_not_the_spellings_of_their_folder(tmp_path, monkeypatch):
    here, elsewhere = tmp_path / "train-here", tmp_path / "elsewhere"
    tiny, named = save_vit(here / "encoders" / "tiny"), save_as_downloaded(here / "encoders" / "test-vit")
    other = save_vit(tmp_path / "other", seed=1)
    elsewhere.mkdir()
    monkeypatch.chdir(here)
    # (a) a run of the code before names travelled recorded the folder as it was given
    before = checkpoint(tmp_path / "old", encoder="encoders/tiny")
    check_repa_resume(before, repa_at_launch("train.repa.encoder=encoders/tiny"))
    check_repa_resume(before, repa_at_launch(f"train.repa.encoder={tiny}"))
    # (b) a run recorded by name and hint: the same encoder by a path from another folder, or through the hint
    unnamed, by_name = (
        repa_at_launch("train.repa.encoder=encoders/tiny"),
        repa_at_launch("train.repa.encoder=encoders/test-vit"),
    )
    runs = {
        tiny: checkpoint(tmp_path / "tiny", encoder=unnamed.encoder, path=unnamed.path),
        named: checkpoint(tmp_path / "named", encoder=by_name.encoder, path=by_name.path),
    }
    monkeypatch.chdir(elsewhere)
    for folder, saved in runs.items():
        check_repa_resume(saved, repa_at_launch(f"train.repa.encoder={os.path.relpath(folder)}"))
        check_repa_resume(saved, repa_at_launch(f"train.repa.encoder={folder}"))
        recorded = yaml.safe_load(saved.read_text())["train"]["repa"]  # what `--resume <run>` launches with
        check_repa_resume(saved, repa_at_launch(*(f"train.repa.{key}={recorded[key]}" for key in ("encoder", "path"))))
    check_repa_resume(runs[named], repa_at_launch(f"train.repa.encoder={TIMM_NAME}"))
    # (c) another encoder is refused in one line
    for saved, given in [(runs[tiny], other), (runs[named], tiny), (before, named)]:
        with pytest.raises(ConfigError) as refused:
            check_repa_resume(saved, repa_at_launch(f"train.repa.encoder={given}"))
        message = str(refused.value)
        assert "train.repa.encoder=" in message and "cannot change on resume" in message and "\n" not in message


def test_an_encoder_folder_named_by_its_path_that_moved_away_is_named_in_one_line(tmp_path, monkeypatch):
    """A folder that copies no timm model is its absolute path: gone, loading names train.repa.encoder and the
    folder; a new run may take the folder where it is now, a resume needs it back at its path (a link will do)."""
    old = tmp_path / "train-here" / "encoders" / "tiny"
    save_vit(old)
    monkeypatch.chdir(tmp_path / "train-here")
    recorded = repa_at_launch("train.repa.encoder=encoders/tiny")
    saved = checkpoint(tmp_path / "run", encoder=recorded.encoder, path=recorded.path)
    (tmp_path / "train-here" / "encoders").rename(tmp_path / "moved")
    monkeypatch.chdir(tmp_path)
    again = repa_at_launch(f"train.repa.encoder={recorded.encoder}", f"train.repa.path={recorded.path}")
    with pytest.raises(EncoderUnavailableError) as missing:
        load_encoder(again, image_channels=1, model_grid=4)
    assert str(missing.value) == (
        f"train.repa.encoder={old}: no such folder or file (set train.repa.encoder=FOLDER to where the encoder is "
        f"on this machine)"
    )
    given = repa_at_launch("train.repa.encoder=moved/tiny", f"train.repa.path={recorded.path}")
    assert load_encoder(given, image_channels=1, model_grid=4).grid == 4
    with pytest.raises(ConfigError) as refused:
        check_repa_resume(saved, given)
    assert str(refused.value).endswith(
        f"(its encoder folder {old} is not on this machine: put it back there, or a link to it, to resume)"
    )
    (tmp_path / "train-here" / "encoders").symlink_to(tmp_path / "moved")
    check_repa_resume(
        saved, repa_at_launch(f"train.repa.encoder={recorded.encoder}", f"train.repa.path={recorded.path}")
    )


def test_a_repa_run_resumes_from_another_folder_and_the_error_names_train_repa_encoder(
    tmp_path, monkeypatch, capsys, offline
):
    """A tiny REPA run trained with train.repa.encoder=<relative folder>; `train.py --resume <run>` from another
    folder finds the encoder through the recorded hint; with the folder moved away (and timm offline) the one line
    names train.repa.encoder and the missing copy, exit 2; given explicitly, the run resumes."""
    here, elsewhere, run = tmp_path / "train-here", tmp_path / "elsewhere", tmp_path / "run"
    hint = str(save_as_downloaded(here / "encoders" / "test-vit"))
    elsewhere.mkdir()

    def train(*arguments: str) -> None:
        run_command(lambda argv: run_train(*argv), list(arguments))

    monkeypatch.chdir(here)
    first = ["--config", str(DIGITS), *NAMED, "train.repa.encoder=encoders/test-vit", "train.max_steps=1"]
    train(*first, "log.every=1", "log.checkpoint_every=1", f"run.dir={run}")
    recorded = yaml.safe_load((run / "config.yaml").read_text())["train"]["repa"]
    assert (recorded["encoder"], recorded["path"]) == (TIMM_NAME, hint)

    monkeypatch.chdir(elsewhere)
    train("--resume", str(run), "train.max_steps=2")
    assert metrics(run)[-1]["step"] == 2

    (here / "encoders").rename(tmp_path / "moved")
    capsys.readouterr()
    with pytest.raises(SystemExit) as failed:
        train("--resume", str(run), "train.max_steps=3")
    lines = capsys.readouterr().err.strip().splitlines()
    assert failed.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: encoder '{TIMM_NAME}' (its local copy {hint} is not on this machine)")
    assert "set train.repa.encoder=" in lines[0] and metrics(run)[-1]["step"] == 2

    train("--resume", str(run), "train.max_steps=3", "train.repa.encoder=../moved/test-vit")
    assert metrics(run)[-1]["step"] == 3
    recorded = yaml.safe_load((run / "config.yaml").read_text())["train"]["repa"]
    assert (recorded["encoder"], recorded["path"]) == (TIMM_NAME, str(tmp_path / "moved" / "test-vit"))
