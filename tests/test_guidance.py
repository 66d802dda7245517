"""Classifier-free guidance: the formula on the right channels, the interval, the null label and the single
forward pass at scale 1, checked against separate conditional and unconditional calls of the model."""

import pytest
import torch
from torch import nn

import dit_vca
import sit_vca
from _labelled_stub import NUM_CLASSES, LabelledStub, stub_inputs
from samplers.guidance import classifier_free_guidance


def cond_and_uncond(model, x, t, y):
    return model(x, t, y), model(x, t, torch.full_like(y, NUM_CLASSES))


def test_scale_one_is_the_model_alone():
    model = LabelledStub()
    guided = classifier_free_guidance(model, 1.0, NUM_CLASSES)
    x, t, y = stub_inputs()
    assert torch.equal(guided(x, t, y), model(x, t, y))
    assert [batch for batch, _ in model.calls] == [5, 5], "one forward pass of the batch, no doubling"


@pytest.mark.parametrize("scale", [0.0, 1.5, 4.0])
def test_guidance_on_all_prediction_channels(scale):
    model = LabelledStub()
    x, t, y = stub_inputs()
    out = classifier_free_guidance(model, scale, NUM_CLASSES)(x, t, y)
    assert [batch for batch, _ in model.calls] == [10], "cond and uncond share one doubled forward pass"
    assert torch.equal(model.calls[0][1][5:], torch.full((5,), NUM_CLASSES)), "null label = num_classes"
    cond, uncond = cond_and_uncond(model, x, t, y)
    # Same float32 operations as the formula: agreement to float32 rounding of uncond + s (cond - uncond).
    torch.testing.assert_close(out[:, :4], uncond[:, :4] + scale * (cond[:, :4] - uncond[:, :4]))
    assert torch.equal(out[:, 4:], cond[:, 4:]), "variance channels come from the conditional half"


def test_guidance_limited_to_the_first_k_channels():
    model = LabelledStub()
    x, t, y = stub_inputs()
    out = classifier_free_guidance(model, 4.0, NUM_CLASSES, guided_channels=3)(x, t, y)
    cond, uncond = cond_and_uncond(model, x, t, y)
    torch.testing.assert_close(out[:, :3], uncond[:, :3] + 4.0 * (cond[:, :3] - uncond[:, :3]))
    assert torch.equal(out[:, 3:], cond[:, 3:])


def test_guidance_interval():
    model = LabelledStub(learn_sigma=False)
    x, t, y = stub_inputs()  # t = 0.1, 0.3, 0.5, 0.7, 0.9
    guided = classifier_free_guidance(model, 3.0, NUM_CLASSES, interval=(0.25, 0.7))
    out = guided(x, t, y)
    cond, uncond = cond_and_uncond(model, x, t, y)
    inside = torch.tensor([False, True, True, True, False])
    torch.testing.assert_close(out[inside], (uncond + 3.0 * (cond - uncond))[inside])
    assert torch.equal(out[~inside], cond[~inside])
    # A batch entirely outside the interval costs one plain forward pass.
    model.calls.clear()
    outside = torch.full((5,), 0.95)
    assert torch.equal(guided(x, outside, y), model(x, outside, y))
    assert [batch for batch, _ in model.calls] == [5, 5]


def test_interval_in_ddpm_timestep_units():
    model = LabelledStub()
    x, _, y = stub_inputs()
    t = torch.tensor([0, 100, 500, 999, 300])
    out = classifier_free_guidance(model, 2.0, NUM_CLASSES, interval=(100, 500))(x, t, y)
    cond, uncond = cond_and_uncond(model, x, t, y)
    inside = torch.tensor([False, True, True, False, True])
    torch.testing.assert_close(out[inside, :4], (uncond + 2.0 * (cond - uncond))[inside, :4])
    assert torch.equal(out[~inside], cond[~inside])


@pytest.mark.parametrize(
    "kwargs, message",
    [({"guided_channels": 0}, "guided_channels must be >= 1"), ({"interval": (0.8, 0.2)}, "t_lo <= t_hi")],
)
def test_bad_guidance_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        classifier_free_guidance(LabelledStub(), 2.0, NUM_CLASSES, **kwargs)


def test_plain_function_needs_guided_channels():
    function = lambda x, t, y: x  # noqa: E731
    with pytest.raises(ValueError, match="in_channels"):
        classifier_free_guidance(function, 2.0, NUM_CLASSES)
    x, t, y = stub_inputs()
    torch.testing.assert_close(classifier_free_guidance(function, 2.0, NUM_CLASSES, guided_channels=4)(x, t, y), x)


@pytest.mark.parametrize(
    "family, t", [(dit_vca, torch.tensor([10, 500, 999])), (sit_vca, torch.tensor([0.1, 0.5, 0.9]))]
)
def test_guidance_on_a_tiny_backbone(family, t):
    """On the real backbone (DiT: learn_sigma, 8 output channels; SiT: 4) the doubled batch runs through the
    network together, so agreement with separate passes is to float32 GEMM rounding: atol 1e-5."""
    torch.manual_seed(0)
    name = "DiT-S/2" if family is dit_vca else "SiT-S/2"
    model = family.create_model(name, depth=1, hidden_size=32, num_heads=2, input_size=4, num_classes=NUM_CLASSES)
    model.eval()
    for p in model.parameters():  # adaLN-Zero starts as the zero function: give it some output
        nn.init.normal_(p, std=0.05)
    x, y = torch.randn(3, 4, 4, 4), torch.tensor([1, 2, 3])
    with torch.no_grad():
        out = classifier_free_guidance(model, 2.5, model.spec.num_classes)(x, t, y)
        cond, uncond = cond_and_uncond(model, x, t, y)
    torch.testing.assert_close(out[:, :4], uncond[:, :4] + 2.5 * (cond[:, :4] - uncond[:, :4]), rtol=0, atol=1e-5)
    torch.testing.assert_close(out[:, 4:], cond[:, 4:], rtol=0, atol=1e-5)
