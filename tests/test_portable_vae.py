"""Exports and run configs that travel: a VAE given as a local folder is recorded by its hub id (which diffusers'
save_pretrained keeps in the folder's config.json) with the folder's absolute path as a hint, so `sample.py` and a
resume work from another folder, and where neither the hint nor the hub can give it, the one line names --vae.
A VAE that does not fit the export (its latent channels, its image size) is refused before sampling, in one line;
a relative VAE path in an export is read from the export's folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from diffusers import AutoencoderKL

import sample
from _tiny_data import latent_shards
from _tiny_models import TINY_VAE, tiny_sd_vae
from _tiny_runs import latent_run, run_train
from _user_errors import one_line_error
from dit_vca.model_spec import ModelSpec
from generation.vae import VAEUnavailableError, load_vae, vae_source
from objectives import DiffusionSpec
from training.config import load_config

ROOT = Path(__file__).resolve().parents[1]
HUB_ID = "stabilityai/sd-vae-ft-mse"


def save_vae_as_downloaded(folder: Path) -> None:
    """tiny_sd_vae() saved as one loaded from the hub would be: AutoencoderKL.from_pretrained(HUB_ID) registers
    `_name_or_path=HUB_ID` in the config, and save_pretrained writes it into config.json."""
    vae = tiny_sd_vae()
    vae.register_to_config(_name_or_path=HUB_ID)
    vae.save_pretrained(folder)


def test_a_local_folder_is_named_by_its_hub_id_with_its_absolute_path_as_a_hint(tmp_path, monkeypatch):
    save_vae_as_downloaded(tmp_path / "vae" / "sd-vae-ft-mse")
    monkeypatch.chdir(tmp_path)
    source = vae_source("vae/sd-vae-ft-mse")
    assert (source.name, source.path) == (HUB_ID, str(tmp_path / "vae" / "sd-vae-ft-mse"))
    AutoencoderKL().save_pretrained(tmp_path / "made-here")  # no hub id recorded: the absolute path names it
    assert vae_source("made-here").name == vae_source("made-here").path == str(tmp_path / "made-here")
    assert vae_source(HUB_ID) == vae_source(HUB_ID, None)  # a hub id stays as it is, with no hint
    assert vae_source(HUB_ID, str(tmp_path / "made-here")).path is None  # a hint that is another VAE is dropped
    assert vae_source(HUB_ID, "/elsewhere/vae").path == "/elsewhere/vae"  # one not here is kept for where it is


def test_a_run_config_names_the_vae_so_that_it_loads_from_another_folder(tmp_path, monkeypatch):
    """What train.py writes as config.yaml, read back from another working directory, loads the same VAE; once the
    folder is gone (another machine) and the hub offline, the line says what is missing and how to set it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    first, second = tmp_path / "first", tmp_path / "second"
    second.mkdir()
    save_vae_as_downloaded(first / "vae" / "sd-vae-ft-mse")
    monkeypatch.chdir(first)
    config = load_config(
        "digits", ["data.source=latents", "data.latents=x", "vae.name=vae/sd-vae-ft-mse", "vae.scale=0.5"]
    )
    assert (config.vae.name, config.vae.path) == (HUB_ID, str(first / "vae" / "sd-vae-ft-mse"))
    from training.config import config_to_yaml

    (first / "config.yaml").write_text(config_to_yaml(config))
    monkeypatch.chdir(second)
    again = load_config(str(first / "config.yaml"))
    assert (again.vae.name, again.vae.path) == (config.vae.name, config.vae.path)
    assert load_vae(again.vae.name, hint=again.vae.path).config.block_out_channels == [8, 8, 8, 8]

    (first / "vae").rename(first / "moved")
    with pytest.raises(VAEUnavailableError) as error:
        load_vae(again.vae.name, hint=again.vae.path)
    message = str(error.value)
    assert f"its local copy {again.vae.path} is not on this machine" in message and "vae.name=vae/" in message


def test_an_export_samples_from_another_folder_and_the_error_names_vae(tmp_path):
    """A tiny latent-space run trained with vae.name=<relative folder>; sample.py from another folder uses the
    recorded hint; with the folder moved away, the one line names --vae, and --vae gives the VAE back."""

    latent_shards(tmp_path / "latents")
    save_vae_as_downloaded(tmp_path / "train-here" / "vae" / "sd-vae-ft-mse")
    cwd = Path.cwd()
    os.chdir(tmp_path / "train-here")
    try:
        run_train(
            *latent_run(tmp_path / "latents"),
            "vae.name=vae/sd-vae-ft-mse",
            "train.max_steps=1",
            "log.checkpoint_every=1",
            "log.sample_every=0",
            "log.fid_every=0",
            "log.trackers=[]",
            f"run.dir={tmp_path / 'run'}",
        )
    finally:
        os.chdir(cwd)
    hint = str(tmp_path / "train-here" / "vae" / "sd-vae-ft-mse")
    described = json.loads(next((tmp_path / "run" / "checkpoints").glob("*/export/config.json")).read_text())
    assert (described["vae"], described["vae_path"]) == (HUB_ID, hint)
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["vae"] == {
        "name": HUB_ID,
        "path": hint,
        "scale": 0.5,
        "normalize": "scale",
    }

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def sample(out: str, *extra: str) -> subprocess.CompletedProcess:
        command = [sys.executable, str(ROOT / "sample.py"), "--ckpt", str(tmp_path / "run"), "--num-samples", "2"]
        return subprocess.run(
            [*command, "--steps", "2", "--grid-size", "0", "--out", out, *extra],
            cwd=elsewhere,
            env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
            capture_output=True,
            text=True,
            timeout=600,
        )

    done = sample("first.npz")
    assert done.returncode == 0, done.stderr
    (tmp_path / "train-here" / "vae").rename(tmp_path / "moved")
    failed = sample("second.npz")
    lines = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
    assert failed.returncode == 2 and len(lines) == 1, failed.stderr
    assert f"VAE '{HUB_ID}' (its local copy {hint} is not on this machine)" in lines[0]
    assert "set --vae vae/sd-vae-ft-mse" in lines[0]
    given = sample("third.npz", "--vae", str(tmp_path / "moved" / "sd-vae-ft-mse"))
    assert given.returncode == 0, given.stderr


def test_the_vae_error_names_the_argument_of_the_call_that_was_made(tmp_path):
    """From Python the one line names ImageGenerator.from_export's `vae` argument, not sample.py's --vae (which
    sample.py passes as vae_option, and the sample.py runs of the test above see named)."""
    from generation import Export, ExportDescription, ImageGenerator

    missing = str(tmp_path / "gone" / "vae")
    description = ExportDescription(
        model=ModelSpec("DiT-S/2"),
        objective=DiffusionSpec(),
        space="latents",
        image_size=32,
        num_classes=3,
        vae=missing,
        latent_scale=0.5,
    )  # the VAE loads before the model is built: no weights needed to reach it
    for given, named in (
        ({}, "set ImageGenerator.from_export(vae='a VAE folder or hub id')"),
        ({"vae": missing}, "set ImageGenerator.from_export(vae='a VAE folder or hub id')"),
        ({"vae_option": "--vae"}, "set --vae a VAE folder or hub id"),
    ):
        with pytest.raises(VAEUnavailableError) as raised:
            ImageGenerator.from_export(Export(description, {}), **given)
        assert f"VAE folder {missing} does not exist; {named}" == str(raised.value)


def latent_export(folder: Path, vae: Path) -> Path:
    """A 1-block DiT on 4 channels of 4x4 latents, decoded by the tiny VAE `vae` to 8 px."""
    import dit_vca
    from generation import ExportDescription, write_export

    model = dit_vca.create_model("DiT-S/2", depth=1, hidden_size=32, num_heads=2, input_size=4, num_classes=2)
    description = ExportDescription(
        model=model.spec,
        objective=DiffusionSpec(learn_sigma=True),
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


def test_an_export_whose_vae_does_not_fit_its_image_size_is_refused_before_sampling(tmp_path):
    # Before: a VAE of downsampling 2 decoded the 4x4 latents of a model declared for 32 px into 8 px images.
    from diffusers import AutoencoderKL

    import dit_vca
    from generation import ExportDescription, ExportError, ImageGenerator, read_export, write_export

    AutoencoderKL(**TINY_VAE).save_pretrained(tmp_path / "vae")  # 2 blocks: 2 px per latent cell
    model = dit_vca.create_model("DiT-S/2", depth=1, hidden_size=32, num_heads=2, input_size=4, num_classes=2)
    description = ExportDescription(
        model=model.spec,
        objective=DiffusionSpec(learn_sigma=True),
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
