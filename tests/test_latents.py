"""VAE loading and latent extraction: local folders, offline errors, shards that survive kill -9, latent spaces of
other channel counts with per-channel statistics."""

import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate.state import PartialState
from diffusers import AutoencoderKL
from safetensors import safe_open
from safetensors.torch import load_file

from _tiny_data import extraction_config, make_images
from _tiny_models import TINY_VAE, write_tiny_export
from generation.vae import LatentNormalization, VAEUnavailableError, encode_posterior, load_vae
from training.config import load_config
from training.data import CorruptImageError, LatentShardDataset
from training.latents import SHARD_METADATA, extract_latents, plan_shards, shard_name

ROOT = Path(__file__).resolve().parents[1]

# A 32-channel autoencoder with 16x downsampling (five resolutions), as VA-VAE's f16d32 latent space.
F16_VAE = dict(
    down_block_types=("DownEncoderBlock2D",) * 5,
    up_block_types=("UpDecoderBlock2D",) * 5,
    block_out_channels=(8,) * 5,
    latent_channels=32,
)


def test_vae_round_trips_through_a_local_folder(vae_folder):
    torch.manual_seed(0)
    original = AutoencoderKL(**TINY_VAE)  # same seed as the saved one
    loaded = load_vae(str(vae_folder))
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    reference = original.state_dict()
    assert all(torch.equal(value, reference[key]) for key, value in loaded.state_dict().items())
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    mean, std = encode_posterior(loaded, images)
    expected = original.encode(images).latent_dist
    assert torch.equal(mean, expected.mean) and torch.equal(std, expected.std)


def test_missing_vae_errors_say_how_to_provide_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(VAEUnavailableError) as error:
        load_vae("stabilityai/sd-vae-ft-mse")
    assert "offline (HF_HUB_OFFLINE=1)" in str(error.value)
    assert "save_pretrained('vae/sd-vae-ft-mse')" in str(error.value)
    with pytest.raises(VAEUnavailableError, match="does not exist"):
        load_vae(str(tmp_path / "no" / "such" / "vae"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(VAEUnavailableError, match="has no config.json"):
        load_vae(str(tmp_path / "empty"))


def test_a_cached_hub_vae_loads_by_name_without_deprecation_warnings(vae_folder, tmp_path, monkeypatch):
    # The Hugging Face cache's layout (models--owner--name/refs/main -> snapshots/<commit>/...) with the tiny VAE.
    from huggingface_hub import constants

    commit = "0" * 40
    repo = tmp_path / "hub" / "models--tiny--vae"
    shutil.copytree(vae_folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vae = load_vae("tiny/vae")
    assert vae.config.block_out_channels == list(TINY_VAE["block_out_channels"])
    assert not [warning for warning in caught if "local_dir_use_symlinks" in str(warning.message)], caught


def test_shards_cover_every_image_once():
    shards = plan_shards(10, 4)
    assert [len(r) for r in shards] == [4, 4, 2]
    assert [index for shard in shards for index in shard] == list(range(10))


def test_extracted_shards_hold_the_posterior_of_each_image_and_its_mirror(tmp_path, vae_folder, single_process):
    images = make_images(tmp_path / "images", per_class=5)
    config = load_config(extraction_config(tmp_path, images, tmp_path / "latents", vae_folder))
    out = extract_latents(config, single_process)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["count"] for s in manifest["shards"]] == [4, 4, 2]
    assert (manifest["num_images"], manifest["classes"], manifest["latent_channels"], manifest["latent_size"]) == (
        10,
        ["ant", "bee"],
        4,
        16,
    )

    vae = load_vae(str(vae_folder))
    from training.data import ImageFolderDataset

    dataset = ImageFolderDataset(images, 32, random_flip=False)
    pixels = torch.stack([dataset[i][0] for i in range(10)])
    mean, std = encode_posterior(vae, torch.cat([pixels, pixels.flip(-1)]))
    shards = [load_file(out / shard_name(k)) for k in range(3)]
    stored_mean = torch.cat([s["mean"] for s in shards])  # (10, 2, 4, 16, 16)
    stored_std = torch.cat([s["std"] for s in shards])
    # Same VAE and images, encoded in batches of 6 instead of 20: float32 convolutions may round differently
    # with the batch size, hence a tolerance far below any real error (values are O(1)).
    torch.testing.assert_close(stored_mean, torch.stack(mean.chunk(2), dim=1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stored_std, torch.stack(std.chunk(2), dim=1), rtol=1e-5, atol=1e-5)
    assert torch.cat([s["labels"] for s in shards]).tolist() == [0] * 5 + [1] * 5
    for k in range(3):  # one metadata key: safetensors orders a map of several differently in each process, and
        with safe_open(out / shard_name(k), framework="pt") as header:  # shards are compared byte for byte
            assert list(header.metadata()) == [SHARD_METADATA]

    latents = LatentShardDataset(out, scale=0.5, random_flip=False)
    z, label = latents[7]
    eps = (z / 0.5 - stored_mean[7, 0]) / stored_std[7, 0]
    assert label == 1 and eps.abs().max() < 6  # a posterior sample: standardised residual N(0, 1)


def test_corrupt_image_fails_naming_it_without_a_partial_shard(tmp_path, vae_folder, single_process):
    images = make_images(tmp_path / "images", per_class=5)
    corrupt = images / "bee" / "2.png"
    corrupt.write_bytes(b"not a png")
    config = load_config(extraction_config(tmp_path, images, tmp_path / "latents", vae_folder))
    with pytest.raises(CorruptImageError, match=str(corrupt)):
        extract_latents(config, single_process)
    # Image 7 lies in shard 1: shard 0 is complete, nothing of shard 1 (not even a temporary file) remains.
    assert sorted(p.name for p in (tmp_path / "latents").iterdir()) == ["settings.json", shard_name(0)]

    skipping = load_config(
        extraction_config(tmp_path, images, tmp_path / "skipped", vae_folder), ["data.on_corrupt=skip"]
    )
    manifest = json.loads((extract_latents(skipping, single_process) / "manifest.json").read_text())
    assert manifest["num_images"] == 9 and manifest["num_skipped"] == 1
    assert [s["skipped"] for s in manifest["shards"]] == [0, 1, 0]


def test_a_folder_started_with_other_settings_is_refused(tmp_path, vae_folder, single_process):
    images = make_images(tmp_path / "images", per_class=2)
    extract_latents(load_config(extraction_config(tmp_path, images, tmp_path / "latents", vae_folder)), single_process)
    other = load_config(extraction_config(tmp_path, images, tmp_path / "latents", vae_folder, image_size=16))
    with pytest.raises(ValueError, match=r"belongs to a run with image_size=32, not 16"):
        extract_latents(other, single_process)


def test_killed_extraction_keeps_finished_shards_and_completes_identically(tmp_path, vae_folder, single_process):
    # 24 shards of 2 images at 64 px: each shard takes long enough that the kill lands well before the end.
    images = make_images(tmp_path / "images", per_class=24, size=64)
    interrupted = extraction_config(
        tmp_path, images, tmp_path / "interrupted", vae_folder, shard_size=2, batch_size=2, image_size=64
    )
    command = [sys.executable, "-m", "training.latents", "--config", str(interrupted)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    for line in process.stdout:
        if f"wrote {shard_name(1)}" in line:
            os.killpg(process.pid, signal.SIGKILL)
            break
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    folder = tmp_path / "interrupted"
    finished = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.glob("shard-*.safetensors")}
    assert 2 <= len(finished) < 24 and not (folder / "manifest.json").exists()
    assert all(
        name.startswith(".") for name in os.listdir(folder) if name not in finished and name != "settings.json"
    )  # only temporaries besides whole shards

    extract_latents(load_config(interrupted), single_process)
    for name, identity in finished.items():  # not redone: same file, never rewritten
        path = folder / name
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == identity
    assert sorted(os.listdir(folder)) == sorted(["settings.json", "manifest.json"] + [shard_name(k) for k in range(24)])

    uninterrupted = extraction_config(
        tmp_path, images, tmp_path / "uninterrupted", vae_folder, shard_size=2, batch_size=2, image_size=64
    )
    reference = extract_latents(load_config(uninterrupted), single_process)
    assert (folder / "manifest.json").read_text() == (reference / "manifest.json").read_text()
    for k in range(24):
        ours, theirs = load_file(folder / shard_name(k)), load_file(reference / shard_name(k))
        assert all(torch.equal(ours[key], theirs[key]) for key in ("mean", "std", "labels"))


def test_latents_are_paired_with_their_own_image_under_the_same_flip(tmp_path, vae_folder, single_process):
    # A skipped corrupt image shifts every later latent against the folder: the stored indices keep the pairs.
    images = make_images(tmp_path / "images", per_class=5)
    (images / "ant" / "1.png").write_bytes(b"not a png")
    config = load_config(
        extraction_config(tmp_path, images, tmp_path / "latents", vae_folder), ["data.on_corrupt=skip"]
    )
    out = extract_latents(config, single_process)
    indices = torch.cat([load_file(out / shard_name(k))["indices"] for k in range(3)])
    assert indices.tolist() == [0, 2, 3, 4, 5, 6, 7, 8, 9]

    from training.data import ImageFolderDataset

    folder = ImageFolderDataset(images, 32, random_flip=False, on_corrupt="skip")
    latents = LatentShardDataset(out, scale=0.5, random_flip=True, seed=3, images=folder)
    vae = load_vae(str(vae_folder))
    flips = []
    for index in range(len(latents)):
        z, label, image = latents[index]
        original = folder[int(indices[index])][0]
        flip = not torch.equal(image, original)
        assert torch.equal(image, original.flip(-1) if flip else original) and label == (index >= 4)
        mean, std = encode_posterior(vae, image[None])  # the latent is a posterior sample of this very image
        assert ((z / 0.5 - mean[0]) / std[0]).abs().max() < 6
        flips.append(flip)
    assert 0 < sum(flips) < len(flips)  # both flips drawn (seed 3)


def test_repa_trains_on_latents_and_on_images(tmp_path, vae_folder, single_process):
    import importlib.util

    import timm
    from accelerate.state import AcceleratorState, GradientState
    from timm.models import save_for_hf

    images = make_images(tmp_path / "images", per_class=8)
    config = extraction_config(tmp_path, images, tmp_path / "latents", vae_folder)
    extract_latents(load_config(config), single_process)
    torch.manual_seed(0)
    vit = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=16,
        patch_size=2,
        embed_dim=24,
        depth=1,
        num_heads=2,
        num_classes=0,
    )
    save_for_hf(vit, tmp_path / "encoder", safe_serialization=True)
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    train_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_script)
    PartialState._reset_state()
    # 32 px images, 2x VAE: 16 x 16 latents, 8 x 8 tokens at patch 2; the encoder sees 16 px: 8 x 8 patches.
    common = [
        f"train.repa.encoder={tmp_path / 'encoder'}",
        "train.repa.input_size=16",
        "train.repa.depth=1",
        "train.repa.projector_dim=16",
        "model.depth=1",
        "model.hidden_size=32",
        "model.num_heads=2",
        "train.max_steps=2",
        "log.every=1",
        "log.trackers=[]",
    ]
    for source in ("latents", "images"):
        run_dir = tmp_path / f"run-{source}"
        try:
            train_script.main(["--config", str(config), *common, f"data.source={source}", f"run.dir={run_dir}"])
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [line["step"] for line in lines] == [1, 2] and all(-1 <= line["alignment_loss"] <= 1 for line in lines)

    format_1 = json.loads((tmp_path / "latents" / "manifest.json").read_text())
    format_1["format"] = 1
    (tmp_path / "latents" / "manifest.json").write_text(json.dumps(format_1))
    with pytest.raises(ValueError, match="hold no image indices .format 1.: REPA pairs each latent"):
        train_script.main(["--config", str(config), *common, "data.source=latents", f"run.dir={tmp_path / 'x'}"])


@pytest.fixture
def dead_hub():
    """A hub endpoint that accepts connections and closes them at once (a proxy or firewall that drops them):
    yields (url, request lines about the VAE). The downloader retries such errors with back-off; the probe does not."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    requests = []

    def serve() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:  # the server socket was closed: the test is over
                return
            with connection:
                request = connection.recv(4096).decode(errors="replace").split("\r\n")[0]
            if "sd-vae-ft-ema" in request:  # huggingface_hub may send requests of its own too
                requests.append(request)

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", requests
    server.close()


def offline_commands(tmp_path: Path, vae_folder: Path) -> dict[str, tuple[list[str], Path]]:
    """Each command that loads a hub VAE (latent extraction, training on images, sampling a latent-space export),
    with the output it must not create."""

    config = extraction_config(tmp_path, make_images(tmp_path / "images", 2), tmp_path / "latents", vae_folder)
    write_tiny_export(tmp_path / "export")  # a latent-space export naming vae=stabilityai/sd-vae-ft-ema
    hub = ["vae.name=stabilityai/sd-vae-ft-ema"]
    return {
        "latents": (["-m", "training.latents", "--config", str(config), *hub], tmp_path / "latents"),
        "train": (["train.py", "--config", str(config), *hub, f"run.dir={tmp_path}/run"], tmp_path / "run"),
        "sample": (
            [
                "sample.py",
                "--ckpt",
                str(tmp_path / "export"),
                "--num-samples",
                "2",
                "--out",
                str(tmp_path / "samples.npz"),
            ],
            tmp_path / "samples.shards",
        ),
    }


def run_against_hub(arguments: list[str], url: str, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python *arguments` in `env` with the hub at `url` and an empty Hugging Face cache in tmp_path."""
    hub = {"HF_ENDPOINT": url, "HF_HOME": str(tmp_path / "hf-home"), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *arguments], cwd=ROOT, capture_output=True, text=True, timeout=300, env={**env, **hub}
    )


@pytest.mark.parametrize("command", ["latents", "train", "sample"])
def test_an_unreachable_hub_is_one_line_naming_it_after_one_request(tmp_path, vae_folder, dead_hub, command):
    url, requests = dead_hub
    arguments, output = offline_commands(tmp_path, vae_folder)[command]
    online = {key: value for key, value in os.environ.items() if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    result = run_against_hub(arguments, url, tmp_path, online)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert f"not in the local Hugging Face cache and {url} cannot be reached" in errors[0]
    setting = "--vae vae/sd-vae-ft-ema" if command == "sample" else "vae.name=vae/sd-vae-ft-ema"
    assert setting in errors[0]  # the setting that chooses another VAE for this command
    assert requests == ["GET /api/models/stabilityai/sd-vae-ft-ema HTTP/1.1"]  # one request, no retries
    assert not output.exists() and not (tmp_path / "samples.npz").exists()


def test_hub_offline_mode_sends_no_request(tmp_path, vae_folder, dead_hub):
    url, requests = dead_hub
    arguments, output = offline_commands(tmp_path, vae_folder)["latents"]
    result = run_against_hub(arguments, url, tmp_path, {**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2 and "the hub is offline (HF_HUB_OFFLINE=1)" in result.stderr, result.stderr
    assert requests == [] and not output.exists()


def test_a_rerun_says_how_many_finished_shards_it_kept(tmp_path, vae_folder, single_process, capsys):
    images = make_images(tmp_path / "images", 3)  # 6 images in shards of 2: 3 shards
    config = load_config(extraction_config(tmp_path, images, tmp_path / "latents", vae_folder, shard_size=2))
    out = extract_latents(config, single_process)
    assert "kept" not in capsys.readouterr().out  # a first run keeps nothing
    (out / shard_name(1)).unlink()  # as a run killed before it wrote shard 1 leaves the folder
    (out / "manifest.json").unlink()
    extract_latents(config, single_process)
    assert f"{out}: kept 2 of 3 finished shards, encoding the other 1" in capsys.readouterr().out
    extract_latents(config, single_process)
    assert f"{out}: kept 3 of 3 finished shards, encoding the other 0" in capsys.readouterr().out


def test_latent_normalization_is_the_per_channel_affine_map_and_its_inverse():
    z = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    plain = LatentNormalization(0.5)
    assert torch.equal(plain.to_model(z), 0.5 * z) and torch.equal(plain.from_model(z), z / 0.5)  # SD: scale only
    normalization = LatentNormalization(2.0, (0.1, -1.0, 3.0), (0.5, 2.0, 4.0))
    mean = torch.tensor([0.1, -1.0, 3.0], dtype=torch.float64).view(3, 1, 1)
    std = torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64).view(3, 1, 1)
    torch.testing.assert_close(normalization.to_model(z), 2.0 * (z - mean) / std, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(normalization.from_model(normalization.to_model(z)), z, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(normalization.to_model(z[0]), normalization.to_model(z)[0])  # one latent (C, h, w)
    with pytest.raises(ValueError, match="one value per channel"):
        LatentNormalization(1.0, (0.0, 0.0), (1.0,))


@pytest.mark.slow
def test_a_32_channel_f16_autoencoder_trains_with_its_latent_statistics_saved_in_the_export(tmp_path, single_process):
    """Another latent space through diffusers' AutoencoderKL: 32 channels, 16x downsampling (five resolutions),
    latents normalised per channel by the statistics the extraction measured, which the export carries; SiT on the
    lightning recipe (MHSA) with logit-normal times and the cosine loss on top."""
    from accelerate.state import AcceleratorState, GradientState

    from generation import ImageGenerator, load_export
    from generation.autoguide import guide_mismatch
    from training.data import read_manifest

    torch.manual_seed(0)
    AutoencoderKL(**{**TINY_VAE, **F16_VAE}).save_pretrained(tmp_path / "f16d32")
    images = make_images(tmp_path / "images", per_class=3, size=64)
    config = extraction_config(tmp_path, images, tmp_path / "latents", tmp_path / "f16d32", image_size=64)
    out = extract_latents(load_config(config), single_process)
    manifest = read_manifest(out)
    assert (manifest["latent_channels"], manifest["latent_size"]) == (32, 4)
    # The statistics of z = mean + std·eps over every stored latent (mirrors included), from the law of total
    # variance in numpy: E[z] = E[mean], Var[z] = E[std²] + Var[mean].
    shards = [load_file(out / shard_name(k)) for k in range(2)]
    means = torch.cat([s["mean"] for s in shards]).double().numpy()  # (6, 2, 32, 4, 4)
    stds = torch.cat([s["std"] for s in shards]).double().numpy()
    expected_mean = means.mean(axis=(0, 1, 3, 4))
    expected_std = np.sqrt((stds**2).mean(axis=(0, 1, 3, 4)) + means.var(axis=(0, 1, 3, 4)))
    np.testing.assert_allclose(manifest["latent_mean"], expected_mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(manifest["latent_std"], expected_std, rtol=1e-12, atol=1e-12)

    run = tmp_path / "run"
    arguments = ["--config", str(config), "data.source=latents", "model.name=SiT-S/2", "model.attention=mhsa"]
    arguments += ["model.blocks=lightning", "model.depth=1", "model.hidden_size=32", "model.num_heads=2"]
    arguments += ["vae.scale=1.0", "vae.normalize=channels", "transport.time_distribution=logit-normal"]
    arguments += ["transport.cosine_loss_weight=1.0", "train.max_steps=2", "log.trackers=[]", f"run.dir={run}"]
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
    train_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_script)
    PartialState._reset_state()
    try:
        train_script.main(arguments)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    export = load_export(run)
    description = export.description
    assert (description.channels, description.image_size, description.model.rope) == (32, 64, True)
    assert (description.latent_mean, description.latent_std) == (manifest["latent_mean"], manifest["latent_std"])
    other = dataclasses.replace(description, latent_mean=[0.0] * 32)
    assert guide_mismatch(description, other)[0] == "latent_mean"  # a guide must share the latent space
    images = ImageGenerator.from_export(export).generate([0, 1], [0, 1], sampler="euler", steps=2)
    assert images.shape == (2, 64, 64, 3)
