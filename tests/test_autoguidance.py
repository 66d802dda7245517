"""Autoguidance (Karras et al., NeurIPS 2024): D = D_guide + W (D_main - D_guide) through the one guidance
combination of samplers.guidance, against separate model calls and a hand-written sampling loop; W = 1 and
guide = main are the main model alone; the export check names what differs; sample.py --guide-ckpt gives the
same file from 1 and 2 processes and records the guide."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import sample
import sit_vca
from _labelled_stub import NUM_CLASSES, LabelledStub, stub_inputs
from _launch import TORCHRUN_TWO_PROCESSES, sample_env
from _tiny_models import EXPORT_CLASSES, tiny_export
from generation import ExportDescription, ImageGenerator, load_export
from generation.autoguide import guide_mismatch
from generation.images import to_uint8
from generation.objective_builder import create_objective
from objectives import DiffusionSpec, TransportSpec
from sample_arguments import SampleError
from samplers import PerSampleNoise
from samplers.guidance import autoguidance

REPO = Path(__file__).resolve().parents[1]


class Shifted(LabelledStub):
    """Another "model" of the same shape: the stub's output plus a constant per channel."""

    def forward(self, x, t, y):
        out = super().forward(x, t, y)
        return out + 0.5 * torch.arange(out.shape[1], dtype=x.dtype).view(1, -1, 1, 1) - 1.0


# --------------------------------------------------------------------------------------------------
#                                         The combination
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [0.0, 2.0, 3.5])
def test_autoguidance_guides_the_prediction_channels_and_keeps_the_main_variance(scale):
    model, guide = LabelledStub(), Shifted()
    x, t, y = stub_inputs()
    out = autoguidance(model, guide, scale)(x, t, y)
    main, weak = model(x, t, y), guide(x, t, y)
    # The same float32 operations as the formula: agreement to float32 rounding.
    torch.testing.assert_close(out[:, :4], weak[:, :4] + scale * (main[:, :4] - weak[:, :4]))
    assert torch.equal(out[:, 4:], main[:, 4:]), "learned-variance channels come from the main model"


def test_autoguidance_on_the_first_k_channels_and_in_an_interval():
    model, guide = LabelledStub(learn_sigma=False), Shifted(learn_sigma=False)
    x, t, y = stub_inputs()  # t = 0.1, 0.3, 0.5, 0.7, 0.9
    out = autoguidance(model, guide, 3.0, guided_channels=3, interval=(0.25, 0.7))(x, t, y)
    main, weak = model(x, t, y), guide(x, t, y)
    inside = torch.tensor([False, True, True, True, False])
    torch.testing.assert_close(out[inside, :3], (weak + 3.0 * (main - weak))[inside, :3])
    assert torch.equal(out[~inside], main[~inside]) and torch.equal(out[:, 3:], main[:, 3:])


def test_scale_one_is_the_main_model_and_never_calls_the_guide():
    model, guide = LabelledStub(), Shifted()
    x, t, y = stub_inputs()
    assert torch.equal(autoguidance(model, guide, 1.0)(x, t, y), model(x, t, y))
    assert guide.calls == []


def test_the_model_guiding_itself_is_the_model_alone():
    model = LabelledStub()
    x, t, y = stub_inputs()
    assert torch.equal(autoguidance(model, model, 2.5)(x, t, y), model(x, t, y))  # weak + W * 0, bit for bit


# --------------------------------------------------------------------------------------------------
#                                 Sampling: ImageGenerator.generate
# --------------------------------------------------------------------------------------------------


def tiny_sit(prediction: str, seed: int) -> tuple[nn.Module, ExportDescription]:
    torch.manual_seed(seed)
    model = sit_vca.create_model(
        "SiT-S/2", depth=1, hidden_size=32, num_heads=2, input_size=8, in_channels=1, num_classes=NUM_CLASSES
    )
    with torch.no_grad():
        for parameter in model.parameters():  # adaLN-Zero starts as the zero function: give it some output
            parameter.add_(0.05 * torch.randn_like(parameter))
    objective = TransportSpec(prediction=prediction)
    return model.eval(), ExportDescription(
        model=model.spec, objective=objective, space="pixels", image_size=8, num_classes=NUM_CLASSES
    )


@pytest.mark.parametrize("prediction", ["velocity", "score", "noise"])
def test_autoguided_euler_sampling_equals_a_hand_written_loop(prediction):
    (model, description), (guide, _) = tiny_sit(prediction, 0), tiny_sit(prediction, 1)
    objective = create_objective(description.objective)
    generator = ImageGenerator(model, objective, lambda x: x.clamp(-1, 1), NUM_CLASSES)
    labels, seeds, scale, steps = [1, 4, 7], [11, 12, 13], 2.0, 6
    images = generator.generate(labels, seeds, guidance=scale, guide=guide, sampler="euler", steps=steps)

    # By hand: Euler steps on [t0, t1] of the velocity of D = D_guide + W (D_main - D_guide).
    y = torch.tensor(labels)
    x = PerSampleNoise(seeds, torch.device("cpu"))((1, 8, 8))  # (3, 1, 8, 8)
    t0, t1 = objective.interval(objective.sample_eps)
    times = np.linspace(t0, t1, steps + 1)
    with torch.no_grad():
        for t_cur, t_next in zip(times[:-1], times[1:]):
            t = torch.full((3,), float(t_cur))
            weak, main = guide(x, t, y)[:, :1], model(x, t, y)[:, :1]
            x = x + (t_next - t_cur) * objective.velocity(weak + scale * (main - weak), x, t)
    expected = to_uint8(x.clamp(-1, 1))
    # The same operations in the same order; a uint8 level may flip where rounding differs (none measured here).
    assert np.abs(images.astype(int) - expected).max() <= 1 and np.mean(images != expected) < 0.01
    unguided = generator.generate(labels, seeds, sampler="euler", steps=steps)
    assert np.abs(images.astype(int) - unguided).mean() > 1, "the guide changed the samples"


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny DiT (learned variance) and another of the same shape with other weights, its guide."""
    folder = tmp_path_factory.mktemp("autoguidance")
    return tiny_export(folder / "main"), tiny_export(folder / "guide", seed=1)


def test_scale_one_and_guide_equal_to_main_give_the_main_model_alone(exports):
    generator = ImageGenerator.from_export(load_export(exports[0]))
    guide = ImageGenerator.from_export(load_export(exports[1])).model
    options = dict(sampler="ddpm", steps=6)  # learn_sigma: the variance channels take part in every step
    labels, seeds = [0, 3, 1, 2], [1, 2, 3, 4]  # of EXPORT_CLASSES
    alone = generator.generate(labels, seeds, **options)
    np.testing.assert_array_equal(generator.generate(labels, seeds, guidance=1.0, guide=guide, **options), alone)
    np.testing.assert_array_equal(
        generator.generate(labels, seeds, guidance=3.0, guide=generator.model, **options), alone
    )
    guided = generator.generate(labels, seeds, guidance=3.0, guide=guide, **options)
    assert np.abs(guided.astype(int) - alone).mean() > 1, "the guide changed the samples"
    # Per-sample noise: the batch split does not change a sample (bit-identical on this CPU; a uint8 level may
    # flip where other batch sizes round differently).
    split = np.concatenate(
        [generator.generate(labels[i : i + 3], seeds[i : i + 3], guidance=3.0, guide=guide, **options) for i in (0, 3)]
    )
    assert np.abs(split.astype(int) - guided).max() <= 1 and np.mean(split != guided) < 0.01


def test_a_guide_of_other_classes_is_refused_by_generate(exports):
    generator = ImageGenerator.from_export(load_export(exports[0]))
    other = sit_vca.create_model("SiT-S/2", depth=1, hidden_size=32, num_heads=2, input_size=8, in_channels=1)
    with pytest.raises(ValueError, match=f"the guide's num_classes is 1000, the model's {EXPORT_CLASSES}"):
        generator.generate([0], [0], guidance=2.0, guide=other)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"objective": TransportSpec()}, ("objective.kind", "diffusion", "transport")),
        ({"num_classes": 1000}, ("num_classes", 10, 1000)),
        ({"image_size": 16}, ("image_size", 8, 16)),
    ],
)
def test_the_export_check_names_what_differs(change, named):
    _, description = tiny_sit("velocity", 0)
    dit = ExportDescription(**{**description.__dict__, "objective": DiffusionSpec(learn_sigma=True)})
    assert guide_mismatch(dit, dit) is None
    assert guide_mismatch(dit, ExportDescription(**{**dit.__dict__, **change})) == named


def test_the_export_check_ignores_what_only_changes_training():
    _, velocity = tiny_sit("velocity", 0)
    other = ExportDescription(**{**velocity.__dict__, "objective": replace(velocity.objective, loss_weight="velocity")})
    smaller = ExportDescription(**{**velocity.__dict__, "model": replace(velocity.model, hidden_size=16, depth=2)})
    assert guide_mismatch(velocity, other) is None and guide_mismatch(velocity, smaller) is None
    _, noise = tiny_sit("noise", 0)
    assert guide_mismatch(velocity, noise) == ("objective.prediction", "velocity", "noise")


# --------------------------------------------------------------------------------------------------
#                                        sample.py --guide-ckpt
# --------------------------------------------------------------------------------------------------

GUIDED = ["--num-samples", "8", "--shard-size", "2", "--per-proc-batch-size", "2", "--grid-size", "0"]
GUIDED += ["--sampler", "ddpm", "--steps", "6", "--seed", "3", "--guidance-scale", "2.5"]


def test_two_processes_give_the_same_autoguided_file_and_it_records_the_guide(exports, tmp_path):
    main, guide = exports
    command = [str(REPO / "sample.py"), "--ckpt", str(main), "--guide-ckpt", str(guide), *GUIDED]
    for launcher, out in (([sys.executable], "one.npz"), ([*TORCHRUN_TWO_PROCESSES], "two.npz")):
        extra = ["--cpu"] if len(launcher) > 1 else []
        done = subprocess.run(
            [*launcher, *command, *extra, "--out", str(tmp_path / out)],
            env=sample_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    with np.load(tmp_path / "one.npz") as one, np.load(tmp_path / "two.npz") as two:
        np.testing.assert_array_equal(one["arr_0"], two["arr_0"])
        np.testing.assert_array_equal(one["arr_1"], two["arr_1"])
    summary = json.loads((tmp_path / "two.json").read_text())
    assert summary["images_per_process"] == [4, 4]
    settings = summary["settings"]
    assert (settings["guide_ckpt"], settings["guidance_scale"], settings["guidance"]) == (str(guide), 2.5, 2.5)
    assert summary["guide"] == {"train_step": None, "source": None}


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--guidance-scale", "2"], "--guidance-scale needs --guide-ckpt"),
        (["--guide-ckpt", "{guide}"], "--guide-ckpt needs --guidance-scale"),
        (["--guide-ckpt", "{guide}", "--guidance-scale", "2", "--cfg-scale", "1.5"], "use one guidance, not both"),
        (["--guide-ckpt", "{sit}", "--guidance-scale", "2"], "its objective.kind is 'transport', the model's is"),
        (["--guide-ckpt", "{missing}", "--guidance-scale", "2"], "--guide-ckpt: .*no such file or folder"),
    ],
)
def test_a_guide_that_cannot_guide_is_refused_in_one_line_before_anything_is_written(
    exports, tmp_path, arguments, message
):
    sit = tiny_export(tmp_path / "sit", family="SiT")
    paths = {"guide": exports[1], "sit": sit, "missing": tmp_path / "missing"}
    argv = ["--ckpt", str(exports[0]), "--out", str(tmp_path / "s.npz"), "--num-samples", "4"]
    with pytest.raises(SampleError, match=message):
        sample.main(argv + [item.format(**paths) for item in arguments])
    assert not list(tmp_path.glob("s.*"))


def test_a_protocol_with_a_guide_autoguides_instead_of_its_classifier_free_guidance(exports):
    args = sample.parse_args(
        ["--ckpt", "x", "--out", "x.npz", "--num-samples", "1", "--protocol", "dit"]
        + ["--guide-ckpt", str(exports[1]), "--guidance-scale", "2"]
    )
    assert (args.cfg_scale, args.guidance_scale, args.guidance_channels, args.sampler) == (1.0, 2.0, 3, "ddpm")


def test_sampling_md_compares_autoguidance_scales_with_cfg_scales_in_the_studys_figures():
    """docs/sampling.md's "Autoguidance scales are not CFG scales" quotes the post-hoc EMA and autoguidance study
    (studies/results/posthoc-digits.json, docs/evidence.md): every accuracy and FID it names is the study's."""
    study = json.loads((REPO / "studies" / "results" / "posthoc-digits.json").read_text())["arms"]
    text = (REPO / "docs" / "sampling.md").read_text()
    prose = " ".join(text.split("**Autoguidance scales are not CFG scales.**", 1)[1].split("\n- **", 1)[0].split())

    def figure(arm: str, method: str, scale: str, key: str) -> str:
        value = study[arm]["settings"][f"sigma_rel 0.06 {method} {scale}"][key]["mean"]
        return f"{100 * value:.1f}" if key == "accuracy" else f"{value:.2f}"

    def both(method: str, scale: str, key: str = "accuracy") -> str:
        return f"{figure('vca', method, scale, key)} / {figure('mhsa', method, scale, key)}"

    quoted = [
        f"autoguidance 1.5 reached {both('autoguidance', '1.5')} %",
        f"what CFG 1.5 reached ({both('cfg', '1.5')} %)",
        f"autoguidance 2 reached {both('autoguidance', '2')} %",
        f"less than CFG 2 ({both('cfg', '2')} %)",
        f"autoguidance 3 reached {both('autoguidance', '3')} %",
        ", ".join(figure("vca", "autoguidance", scale, "fid") for scale in ("1.5", "2", "3"))
        + " / "
        + ", ".join(figure("mhsa", "autoguidance", scale, "fid") for scale in ("1.5", "2", "3")),
        f"against CFG's {figure('vca', 'cfg', '1.5', 'fid')}, {figure('vca', 'cfg', '2', 'fid')} / "
        f"{figure('mhsa', 'cfg', '1.5', 'fid')}, {figure('mhsa', 'cfg', '2', 'fid')} at 1.5 and 2",
    ]
    for fragment in quoted:
        assert fragment in prose, fragment
