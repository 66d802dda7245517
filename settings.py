"""A setting's allowed values, declared on its dataclass field: one of a few choices, or a number in a range.

The dataclasses that a config section is (the model's spec, `dit_vca.model_spec.ModelSpec`; the objectives' specs,
`objectives.DiffusionSpec` and `objectives.TransportSpec`; training's own sections in `training.config`) declare
their fields with these, so that each setting's default and allowed values are written once, beside it:
`training.config` checks every value against them, `train.py --help` (`training.config_help`) lists them.

Plain data on the ground floor (no torch, no project module), so that every floor may declare settings.
"""

from __future__ import annotations

import math
from dataclasses import field
from typing import Any


def choice(default: Any, *choices: Any) -> Any:
    """A field whose value must be one of `choices` (checked after all sources are merged)."""
    return field(default=default, metadata={"choices": choices})


def value_range(default: Any, minimum: float, maximum: float = math.inf, above: bool = False) -> Any:
    """A number (or list of numbers) in [minimum, maximum], or (minimum, maximum] when `above`; finite; None
    passes where the type allows it (checked after all sources are merged)."""
    return field(default=default, metadata={"range": (minimum, maximum, above)})


def decided_by(what: str) -> Any:
    """A field that a config leaves None: what is named by `what` (another key, the data) decides its value when
    the part is built (training.config refuses a value for it, naming `what`)."""
    return field(default=None, metadata={"decided_by": what})
