"""The built-in coloured shapes (data.source=shapes) and the classifier that judges generated shapes."""

from pathlib import Path

import numpy as np
import pytest
import torch

from generation.images import to_uint8
from judges.shapes import centred_pixels, fit_shape_classifier
from training.build import build_model, model_input_shape
from training.builtin_data import (
    SHAPE_COLOURS,
    SHAPE_KINDS,
    SHAPES_CLASSES,
    ShapesDataset,
    render_shapes,
    shape_coverage,
)
from training.config import load_config
from training.data import build_dataset

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "shapes.yaml"


def test_render_shapes_is_deterministic_balanced_and_in_range():
    images, labels = render_shapes(per_class=20)
    again, _ = render_shapes(per_class=20)
    other, _ = render_shapes(per_class=20, seed=1)
    assert images.shape == (240, 3, 16, 16) and images.dtype == np.float32 and labels.shape == (240,)
    np.testing.assert_array_equal(images, again)
    assert np.abs(images - other).mean() > 0.01  # another seed draws other sizes and positions
    assert 0.0 <= images.min() and images.max() <= 1.0
    np.testing.assert_array_equal(labels, np.arange(240) % SHAPES_CLASSES)
    np.testing.assert_array_equal(np.bincount(labels), [20] * SHAPES_CLASSES)


@pytest.mark.parametrize(
    "kind, area", [("square", 1.7**2), ("disc", np.pi), ("triangle", 2.0), ("cross", 2 * 2 * 0.7 - 0.7**2)]
)
def test_shape_areas_match_their_closed_form(kind, area):
    # Areas in units of the half-size: square of side 1.7, unit disc, triangle of base 2 and height 2, plus sign
    # of two 2 x 0.7 bars overlapping in a 0.7 x 0.7 square. A 1200^2 grid over [-1.2, 1.2]^2 counts points
    # inside; the boundary cells (perimeter / spacing ~ 4000 of 1.44M) bound the error well below 1 %.
    points = (np.arange(1200) + 0.5) / 1200 * 2.4 - 1.2
    inside = shape_coverage(kind, points[None, :], points[:, None])
    assert inside.mean() * 2.4**2 == pytest.approx(area, rel=0.01)


def test_each_image_has_the_colour_of_its_class():
    images, labels = render_shapes(per_class=10)
    border = np.concatenate([images[:, :, 0], images[:, :, -1]], axis=2)  # (N, 3, 32)
    foreground = (images - np.median(border, axis=2)[:, :, None, None]).sum(axis=(2, 3))  # (N, 3)
    colours = np.array(list(SHAPE_COLOURS.values()))
    np.testing.assert_array_equal(foreground.argmax(axis=1), colours[labels % len(colours)].argmax(axis=1))
    assert len(SHAPE_KINDS) * len(SHAPE_COLOURS) == SHAPES_CLASSES


def test_shapes_config_builds_a_pixel_space_model_with_64_tokens():
    config = load_config(CONFIG)
    assert config.data.in_pixel_space and config.vae.name is None
    dataset = build_dataset(config)
    assert isinstance(dataset, ShapesDataset) and len(dataset) == 2400
    x, label = dataset[13]
    assert x.shape == (3, 16, 16) and label == 1 and -1.0 <= x.min() and x.max() <= 1.0
    assert model_input_shape(config, dataset, None) == (3, 16)
    model = build_model(config, 3, 16)
    assert (model.spec.input_size // model.patch_size) ** 2 == 64
    with torch.no_grad():
        out = model(x[None], torch.tensor([10]), torch.tensor([label]))
    assert out.shape == (1, 3, 16, 16)


def test_shapes_config_rejects_another_image_size():
    config = load_config(CONFIG, ["data.image_size=32"])
    with pytest.raises(ValueError, match="data.source=shapes needs data.image_size=16"):
        build_dataset(config)


def test_centred_pixels_do_not_depend_on_where_the_shape_sits():
    image = np.full((1, 16, 16, 3), 20, dtype=np.uint8)
    image[0, 2:7, 3:6] = (200, 30, 30)  # a red bar near the top left
    moved = np.roll(image, (6, 7), axis=(1, 2))  # the same bar further down and right
    np.testing.assert_allclose(centred_pixels(moved), centred_pixels(image), atol=1e-12)
    empty = np.full((1, 16, 16, 3), 20, dtype=np.uint8)  # no foreground: all zeros, no NaN
    np.testing.assert_array_equal(centred_pixels(empty), 0.0)


def test_classifier_reads_held_out_real_shapes():
    dataset = ShapesDataset()
    images, labels = to_uint8(dataset.images), dataset.labels.numpy()
    classifier = fit_shape_classifier(images, labels)
    assert classifier.held_out_accuracy >= 0.95 and classifier.test_size == 600
    # It reads the class, not something every image shares: the wrong labels are almost never predicted.
    assert classifier.accuracy(images, (labels + 1) % SHAPES_CLASSES) < 0.05
