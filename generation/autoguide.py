"""Which exports can guide which (autoguidance, `sample.py --guide-ckpt`): a guide predicts the same quantity,
on the same inputs, for the same classes as the model it guides; its size, attention, patch, training length and
EMA are free (a smaller model, or an earlier or shorter-EMA export of the same run, is the usual guide)."""

from __future__ import annotations

from typing import Any

from generation.export import ExportDescription

# The objective settings that change what a prediction means (the others only change how a model was trained);
# a DDPM spec has neither path nor prediction (it predicts epsilon).
PREDICTION_SETTINGS = ("kind", "path", "prediction")


def guide_mismatch(model: ExportDescription, guide: ExportDescription) -> tuple[str, Any, Any] | None:
    """The first property that the guide does not share with the model, as (name, model's value, guide's), or
    None when `guide` can guide `model`."""
    properties = [
        *(
            (f"objective.{key}", getattr(model.objective, key, None), getattr(guide.objective, key, None))
            for key in PREDICTION_SETTINGS
        ),
        ("space", model.space, guide.space),
        ("image_size", model.image_size, guide.image_size),
        ("model.in_channels", model.channels, guide.channels),
        ("model.input_size", model.model.input_size, guide.model.input_size),
        ("num_classes", model.num_classes, guide.num_classes),
        ("latent_scale", model.latent_scale, guide.latent_scale),
        ("latent_mean", model.latent_mean, guide.latent_mean),
        ("latent_std", model.latent_std, guide.latent_std),
    ]
    return next(((name, ours, theirs) for name, ours, theirs in properties if ours != theirs), None)
