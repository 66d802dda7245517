"""The MHSA baseline in diffusers: DiTTransformer2DModel computes what our model computes, the conversion
round-trips bit for bit, DiTPipeline runs it and follows our sampler step by step, and the command writes a
diffusers folder. Peer: diffusers' own modules (no weights are downloaded; the autoencoder is a tiny random one)."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL, DiTPipeline, DiTTransformer2DModel
from diffusers.models.embeddings import get_timestep_embedding

import commands
from _tiny_models import DIT_CLASSES, tiny_dit, write_tiny_export
from dit_vca import create_diffusion, create_model
from dit_vca.models import timestep_embedding
from generation.diffusers_interop import (
    ConversionError,
    dit_scheduler,
    from_diffusers,
    main,
    to_diffusers,
    use_dit_timestep_frequencies,
)
from sit_vca import create_model as create_sit_model

REPO = Path(__file__).resolve().parents[1]
# Converted and original model run the same float32 operations, except q, k, v from three matmuls instead of
# one fused one (bit-identical on this CPU, measured); allowance: float32 rounding of a sum of ~64 products of
# O(1) terms through 2 blocks, 1e-5.
ATOL = 1e-5


def inputs(n: int = 3):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, 8, 8, generator=generator)
    return x, torch.tensor([0, 500, 999])[:n], torch.tensor([1, 7, DIT_CLASSES])[:n]  # DIT_CLASSES: the null class


@pytest.mark.parametrize("learn_sigma", [True, False])
def test_converted_transformer_computes_our_model(learn_sigma):
    """Same (B, out_channels, H, W) layout: with learn_sigma the 8 channels are [eps (4), v (4)] in both."""
    model = tiny_dit(learn_sigma)
    transformer = to_diffusers(model)
    assert isinstance(transformer, DiTTransformer2DModel)
    assert transformer.config.out_channels == (8 if learn_sigma else 4)
    x, t, y = inputs()
    with torch.no_grad():
        ours = model(x, t, y)
        theirs = transformer(x, timestep=t, class_labels=y).sample
    assert theirs.shape == ours.shape == (3, 8 if learn_sigma else 4, 8, 8)
    assert ours.abs().max() > 0.1  # a non-trivial function
    torch.testing.assert_close(theirs, ours, rtol=0, atol=ATOL)


def test_diffusers_own_timestep_frequencies_differ_from_dit():
    """diffusers' DiT divides the frequency exponent by 127 (downscale_freq_shift=1), the official DiT by 128:
    with shift 0 diffusers' features are ours; with its default the converted model's output changes."""
    t = torch.tensor([0.0, 1.0, 250.0, 999.0])
    torch.testing.assert_close(
        get_timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0),
        timestep_embedding(t),
        rtol=0,
        atol=1e-5,
    )
    model = tiny_dit()
    transformer = to_diffusers(model)
    for block in transformer.transformer_blocks:
        block.norm1.emb.time_proj.downscale_freq_shift = 1  # what DiTTransformer2DModel.from_pretrained builds
    x, t, y = inputs()
    with torch.no_grad():
        assert (transformer(x, timestep=t, class_labels=y).sample - model(x, t, y)).abs().max() > 1e-3
        use_dit_timestep_frequencies(transformer)
        torch.testing.assert_close(transformer(x, timestep=t, class_labels=y).sample, model(x, t, y), rtol=0, atol=ATOL)


def test_round_trip_gives_back_the_same_state_dict_and_config():
    model = tiny_dit()
    back = from_diffusers(to_diffusers(model))
    ours, theirs = model.state_dict(), back.state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)
    assert back.spec == replace(model.spec, class_dropout_prob=back.spec.class_dropout_prob)


def test_saved_folder_reloads(tmp_path):
    model = tiny_dit()
    to_diffusers(model).save_pretrained(tmp_path / "transformer")
    reloaded = use_dit_timestep_frequencies(DiTTransformer2DModel.from_pretrained(tmp_path / "transformer"))
    x, t, y = inputs()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x, timestep=t, class_labels=y).sample, model(x, t, y), rtol=0, atol=ATOL)
    back = from_diffusers(reloaded)
    assert all(torch.equal(value, back.state_dict()[key]) for key, value in model.state_dict().items())


def tiny_vae() -> AutoencoderKL:
    """A randomly initialised 2-level AutoencoderKL (8x8x4 latents <-> 16x16 RGB), built from a config."""
    torch.manual_seed(0)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
    ).eval()


@pytest.mark.parametrize("solver", ["dpm++2m", "unipc"])
def test_dit_pipeline_follows_our_sampler_step_by_step(solver):
    """DiTPipeline (no guidance: its null class is hard-coded to 1000) with our scheduler against our sampler
    from the same x_T: every model input and the decoded images agree. Our schedule is float64 (respaced betas),
    the pipeline's float32 linspace betas, otherwise the arithmetic is the same: the random model's predicted x_0
    reaches ~500 (eps / sqrt(abar_999)), so the states agree to float32 relative rounding (measured 2.7e-7):
    rtol 1e-5 with atol 1e-4 for the values near 0."""
    model, vae = tiny_dit(), tiny_vae()
    pipeline = DiTPipeline(transformer=to_diffusers(model), vae=vae, scheduler=dit_scheduler(solver))
    pipeline.set_progress_bar_config(disable=True)
    labels, steps = [1, 7], 10
    seen_by_pipeline = []
    pipeline.transformer.register_forward_hook(
        lambda module, args, kwargs, output: seen_by_pipeline.append((args[0].clone(), kwargs["timestep"].clone())),
        with_kwargs=True,
    )
    images = pipeline(
        labels,
        guidance_scale=1.0,
        generator=torch.Generator().manual_seed(0),
        num_inference_steps=steps,
        output_type="pt",
    ).images  # (B, 3, 16, 16) in [0, 1]

    seen_by_us = []

    def recording(x, t, y):
        seen_by_us.append((x.clone(), t.clone()))
        return model(x, t, y)

    x_T = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))  # diffusers' randn_tensor on the CPU
    latents = create_diffusion().sample(recording, x_T, torch.tensor(labels), sampler=solver, steps=steps).samples
    assert len(seen_by_us) == len(seen_by_pipeline) == steps
    for (x_ours, t_ours), (x_theirs, t_theirs) in zip(seen_by_us, seen_by_pipeline):
        assert torch.equal(t_ours, t_theirs)
        torch.testing.assert_close(x_ours, x_theirs, rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        decoded = vae.decode(latents / vae.config.scaling_factor).sample
    torch.testing.assert_close(images, (decoded / 2 + 0.5).clamp(0, 1), rtol=1e-5, atol=1e-4)


TINY_SIZES = dict(num_classes=DIT_CLASSES, depth=1, hidden_size=32, num_heads=2)


def test_vca_sit_and_lightning_models_are_refused():
    with pytest.raises(ConversionError, match="only the MHSA baseline.*attention='vca'"):
        to_diffusers(tiny_dit(attention="vca"))
    sit = create_sit_model("SiT-S/2", attention="mhsa", input_size=8, **TINY_SIZES)
    with pytest.raises(ConversionError, match="SiT"):
        to_diffusers(sit)
    # LightningDiT's block options have no place in diffusers' DiT block
    with pytest.raises(ConversionError, match="block options {'norm': 'rmsnorm'} cannot be converted"):
        to_diffusers(create_model("DiT-S/2", attention="mhsa", input_size=8, **TINY_SIZES, norm="rmsnorm"))


def test_untied_embedders_cannot_go_back():
    transformer = to_diffusers(tiny_dit())
    with torch.no_grad():
        transformer.transformer_blocks[1].norm1.emb.timestep_embedder.linear_1.bias.add_(1.0)
    with pytest.raises(ConversionError, match="copies of norm1.emb.timestep_embedder.linear_1.bias differ"):
        from_diffusers(transformer)


# ----------------------------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------------------------


def run_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "generation.diffusers_interop", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )


def test_command_writes_a_diffusers_folder_from_an_export(tmp_path):
    model = write_tiny_export(tmp_path / "export")
    out = tmp_path / "diffusers"
    done = run_command(str(tmp_path / "export"), str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    transformer = use_dit_timestep_frequencies(DiTTransformer2DModel.from_pretrained(out / "transformer"))
    x, t, y = inputs()
    with torch.no_grad():
        torch.testing.assert_close(transformer(x, timestep=t, class_labels=y).sample, model(x, t, y), rtol=0, atol=ATOL)
    assert (out / "scheduler" / "scheduler_config.json").is_file()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["diffusers", "export"]  # no staging left

    again = run_command(str(tmp_path / "export"), str(out))
    assert again.returncode == 2 and "exists; choose a new output folder" in again.stderr.strip().splitlines()[-1]


def in_process(capsys, *args: str) -> str:
    """Run the command's main() here (faster than a subprocess); returns its error line, exit status 2 expected."""
    with pytest.raises(SystemExit) as exit_info:
        commands.run_command(main, list(args))
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_command_with_a_local_vae_writes_a_pipeline(tmp_path, capsys):
    write_tiny_export(tmp_path / "export")
    tiny_vae().save_pretrained(tmp_path / "vae")
    main([str(tmp_path / "export"), str(tmp_path / "pipe"), "--vae", str(tmp_path / "vae"), "--scheduler", "unipc"])
    pipeline = DiTPipeline.from_pretrained(tmp_path / "pipe")
    assert type(pipeline.scheduler).__name__ == "UniPCMultistepScheduler"
    pipeline.set_progress_bar_config(disable=True)
    images = pipeline([3], guidance_scale=1.0, num_inference_steps=2, output_type="pt").images
    assert images.shape == (1, 3, 16, 16) and torch.isfinite(images).all()
    # A 10-class model: the conversion said what guided sampling in DiTPipeline then does (its null class is 1000)
    (warning,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert f"{tmp_path / 'export'} has {DIT_CLASSES} classes; DiTPipeline takes class 1000 as the null" in warning
    with pytest.raises(IndexError):
        pipeline([3], guidance_scale=4.0, num_inference_steps=1, output_type="pt")


def test_command_reads_an_official_state_dict_with_weights_only(tmp_path, capsys):
    model = tiny_dit()
    torch.save(model.state_dict(), tmp_path / "official.pt")
    args = [str(tmp_path / "official.pt"), str(tmp_path / "out"), "--model", "DiT-S/2", "--image-size", "64"]
    # The official DiT-S/2 is 12 blocks of width 384: the 2-block toy does not fit it, and the command says so.
    assert "does not fit --model DiT-S/2" in in_process(capsys, *args)
    torch.save({"model": model.state_dict(), "code": print}, tmp_path / "official.pt")  # pickles a function
    assert "not a plain state dict (read with weights_only=True" in in_process(capsys, *args)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "case, message",
    [
        ("vca", "only the MHSA baseline"),
        ("missing", "no such file or folder"),
        ("pt-without-model", "name its architecture with --model"),
        ("bad-vae", "--vae"),
    ],
)
def test_command_user_errors(tmp_path, capsys, case, message):
    extra, source = [], tmp_path / "src"
    if case in ("vca", "bad-vae"):
        write_tiny_export(source, attention="vca" if case == "vca" else "mhsa")
    elif case == "pt-without-model":
        source = tmp_path / "src.pt"  # a name that does not say the architecture
        torch.save(tiny_dit().state_dict(), source)
    if case == "bad-vae":
        extra = ["--vae", str(tmp_path / "no-vae-here")]
    assert message in in_process(capsys, str(source), str(tmp_path / "out"), *extra)
    assert not (tmp_path / "out").exists()
