"""Exponential moving average of the weights, in float32, updated after every optimiser step, and how long it is.

timm's ModelEmaV3 does the averaging (foreach lerp, optional warm-up); this module fixes how it is
configured and how its weights are stored (plain tensors, no pickling), and says what the average holds at a
given step (`ema_length`: the start-up summary states it at train.max_steps and warns of a run too short for it).

The training loop calls `ema.update(model, step=s)` after optimiser step s = 1, 2, ...; timm's decay for that call
is d(1) = 0 (the first update copies the weights) and, for s >= 2, d(s) = ema_decay, or with warm-up
min(1 - s^-power, ema_decay). After T steps the EMA is sum_s c_s w_s over the weights w_s after step s, with

    c_s = (1 - d(s)) * prod_{j = s+1..T} d(j)          (the weights sum to 1; c_1 = prod_{j = 2..T} d(j))

For a fixed decay D (no warm-up) that is c_1 = D^(T-1) and c_s = (1 - D) D^(T-s): the first step's weights, which
are the initial weights after one step, keep a share D^(T-1) (0.9999 keeps 96.9 % of them after 320 steps), and
the newest h steps carry 1 - D^h of the average, half of it from h = ln 2 / -ln D on (6 932 steps for 0.9999).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from timm.utils import ModelEmaV3
from torch import nn

from training.config import TrainConfig

# A run whose EMA still holds more than this share of the first step's weights at its last step is warned of:
# its exports, grids and FID mix that much of a barely trained network into the trained one.
FIRST_STEP_SHARE_WARNING = 0.05


def create_ema(model: nn.Module, train: TrainConfig) -> ModelEmaV3:
    """A float32 copy of `model` (build it before wrapping or compiling the model).

    The first update (step 1) copies the weights; after it the decay is `ema_decay` (DiT's recipe). With warm-up it is
    1 - (1 + step)^-power capped at ema_decay, so short runs are not dominated by the initial weights
    (0.9999 keeps ~74 % of them after 3 000 steps).
    """
    return ModelEmaV3(
        model,
        decay=train.ema_decay,
        use_warmup=train.ema_warmup,
        warmup_power=train.ema_warmup_power,
        dtype=torch.float32,
    )


def ema_state_dict(ema: ModelEmaV3) -> dict[str, torch.Tensor]:
    """The averaged weights under the model's own state-dict keys, ready for safetensors."""
    return {key: value.detach().contiguous() for key, value in ema.module.state_dict().items()}


def load_ema_state_dict(ema: ModelEmaV3, state: dict[str, torch.Tensor]) -> None:
    ema.module.load_state_dict(state, strict=True)


# --------------------------------------------------------------------------------------------------
#                                  What the average holds at step T
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EMALength:
    """What the EMA is made of after `steps` optimiser steps (see the module docstring)."""

    steps: int
    first_step_share: float  # c_1: the share of the first step's weights (about the initial ones)
    half_life: int  # the newest this many steps carry at least half of the average (all `steps` when none do)
    sigma_rel: float  # the average's standard deviation in steps over `steps`: EDM2's relative width

    @property
    def too_short(self) -> bool:
        return self.first_step_share > FIRST_STEP_SHARE_WARNING


def step_decays(train: TrainConfig, steps: int) -> np.ndarray:
    """d(s) for s = 1..steps, float64, as timm computes it for `ema.update(model, step=s)`."""
    s = np.arange(1, steps + 1, dtype=np.float64)
    if train.ema_warmup:
        decays = np.minimum(1.0 - s**-train.ema_warmup_power, train.ema_decay)
    else:
        decays = np.full(steps, float(train.ema_decay))
    decays[0] = 0.0
    return decays


def step_weights(train: TrainConfig, steps: int) -> np.ndarray:
    """c_s for s = 1..steps (float64, summing to 1): how much of the weights after step s the EMA holds after
    `steps` steps, from the product formula (any decay schedule)."""
    decays = step_decays(train, steps)
    with np.errstate(divide="ignore"):
        log_decays = np.log(decays)  # log 0 = -inf at step 1 (and for a decay of 0)
    later = np.concatenate([np.cumsum(log_decays[::-1])[::-1][1:], [0.0]])  # sum_{j > s} log d(j)
    return (1.0 - decays) * np.exp(later)


def ema_length(train: TrainConfig, steps: int) -> EMALength:
    """The first step's share, half-life and sigma_rel of the EMA after `steps` steps: in closed form for a fixed
    decay, from `step_weights` with warm-up."""
    if not train.ema_warmup:
        return fixed_decay_length(float(train.ema_decay), steps)
    return length_of_weights(step_weights(train, steps))


def length_of_weights(weights: np.ndarray) -> EMALength:
    """`EMALength` of an average that holds weights[s - 1] of the weights after step s (summing to 1)."""
    steps = len(weights)
    newest_first = np.cumsum(weights[::-1])
    half_life = int(np.searchsorted(newest_first, 0.5 - 1e-12) + 1)  # the first count whose weights reach 1/2
    s = np.arange(1, steps + 1, dtype=np.float64)
    mean = float(weights @ s)
    variance = float(weights @ (s - mean) ** 2)
    return EMALength(steps, float(weights[0]), min(half_life, steps), math.sqrt(max(variance, 0.0)) / steps)


def fixed_decay_length(decay: float, steps: int) -> EMALength:
    """`ema_length` of a fixed decay D in closed form. With n = T - 1, q = 1 - D and the age k = T - s of step s's
    weights (geometric weights q D^k for k < n, and D^n at k = n):

        E[k]   = D (1 - D^n) / q
        Var[k] = D (1 - D^n) (1 + D^(n+1)) / q^2 - 2 n D^(n+1) / q

    (Var written so that its two terms stay of the size 2n/q as D -> 1, not 1/q^2: float64 then keeps ~12 digits
    where E[k^2] - E[k]^2 kept 4) and sigma_rel = sqrt(Var[k]) / T; the half-life is ceil(ln 2 / -ln D) where that
    many steps are fewer than T, else T (half of the average is still the first step's)."""
    n = steps - 1
    if decay == 0.0 or n == 0:  # the average is the latest weights
        return EMALength(steps, 1.0 if n == 0 else 0.0, 1, 0.0)
    if decay == 1.0:  # the average never moves from the first step's weights
        return EMALength(steps, 1.0, steps, 0.0)
    q = 1.0 - decay
    share = math.exp(n * math.log1p(-q))  # D^n
    variance = decay * -math.expm1(n * math.log1p(-q)) * (1.0 + decay * share) / q**2 - 2 * n * decay * share / q
    half_life = math.ceil(math.log(2.0) / -math.log1p(-q))
    return EMALength(steps, share, half_life if half_life < steps else steps, math.sqrt(max(variance, 0.0)) / steps)


def describe_ema(train: TrainConfig, steps: int) -> tuple[str, str | None]:
    """The start-up summary's EMA line at `steps` (train.max_steps), and a warning when the run is too short for
    the average (None otherwise)."""
    length = ema_length(train, steps)
    warmup = f"with warm-up (power {train.ema_warmup_power:g})" if train.ema_warmup else "no warm-up"
    half = (
        f"half-life {length.half_life:,} step{'s' if length.half_life != 1 else ''} (the newest carry half of it)"
        if length.first_step_share < 0.5
        else "half-life longer than the run"
    )
    line = (
        f"decay {train.ema_decay:g}, {warmup}; at step {steps:,}: {100 * length.first_step_share:.1f} % the first "
        f"step's weights, {half}, sigma_rel {length.sigma_rel:.3f}"
    )
    if not length.too_short:
        return line, None
    warning = (
        f"the EMA (train.ema_decay={train.ema_decay:g}, {warmup}) is still {100 * length.first_step_share:.1f} % the "
        f"first step's weights at step {steps:,}: its exports, grids and FID will look barely trained. For a short "
        f"run set train.ema_warmup=true or a lower train.ema_decay, or draw grids and FID from other weights "
        f'(log.fid_weights=raw); see docs/training.md, "Short runs"'
    )
    return line, warning
