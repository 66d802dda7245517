"""What the EMA holds at the last step (training.ema.ema_length), which the start-up summary states and warns of:
the product formula against timm's own update as training calls it, the closed form of a fixed decay against the
product formula, and the figures of issue 39 (EMA 0.9999 without warm-up after 320 steps: ~97 % the first step's
weights)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from training.config import TrainConfig, load_config
from training.ema import (
    FIRST_STEP_SHARE_WARNING,
    create_ema,
    describe_ema,
    ema_length,
    fixed_decay_length,
    length_of_weights,
    step_weights,
)

REPO = Path(__file__).resolve().parents[1]


def train_config(decay: float, warmup: bool = False, power: float = 0.75) -> TrainConfig:
    return TrainConfig(
        global_batch_size=1, max_steps=1, lr=1.0, ema_decay=decay, ema_warmup=warmup, ema_warmup_power=power
    )


@pytest.mark.parametrize(
    "decay, warmup, steps",
    [(0.9999, False, 320), (0.99, False, 300), (0.999, True, 300), (0.9, True, 200)],  # 0.9: the cap reached at 22
)
def test_the_step_weights_are_what_timms_update_makes_of_the_weights(decay, warmup, steps):
    """A "model" whose weight vector after step s is the unit vector e_s: the EMA after the last step is then the
    vector of the weights c_s themselves, made by timm's ModelEmaV3 as the training loop calls it
    (`ema.update(model, step=s)` after optimiser step s = 1, 2, ...)."""
    train = train_config(decay, warmup)
    model = torch.nn.Linear(steps, 1, bias=False)
    ema = create_ema(model, train)
    for step in range(1, steps + 1):
        with torch.no_grad():
            model.weight.zero_()
            model.weight[0, step - 1] = 1.0
        ema.update(model, step=step)
    held = ema.module.weight[0].detach().double().numpy()
    # float32 lerps of values in [0, 1]: each update rounds by ~6e-8 of the value, over 320 updates < 1e-5 in all
    np.testing.assert_allclose(held, step_weights(train, steps), atol=1e-5)
    assert held.sum() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("decay", [0.9999, 0.999, 0.9, 0.5])
@pytest.mark.parametrize("steps", [1, 2, 3, 320, 6932, 6933, 20000])
def test_the_closed_form_of_a_fixed_decay_is_the_product_formula(decay, steps):
    closed = fixed_decay_length(decay, steps)
    direct = length_of_weights(step_weights(train_config(decay), steps))
    # float64; the closed form's variance keeps ~9 digits at decay 0.9999 and 2 steps (its docstring), the direct
    # sums ~13: 1e-7 is far below the 3 digits the summary prints
    assert closed.first_step_share == pytest.approx(direct.first_step_share, rel=1e-9, abs=1e-300)
    assert closed.half_life == direct.half_life
    assert closed.sigma_rel == pytest.approx(direct.sigma_rel, rel=1e-7, abs=1e-12)


def test_the_issues_short_run_is_warned_of_and_the_recipes_are_not():
    short = fixed_decay_length(0.9999, 320)
    assert short.first_step_share == pytest.approx(0.9999**319) and round(100 * short.first_step_share, 1) == 96.9
    assert short.half_life == 320 and short.too_short  # half of the average is still the first step's weights
    assert fixed_decay_length(0.9999, 10**6).half_life == 6932  # ln 2 / -ln 0.9999 = 6931.1
    line, warning = describe_ema(train_config(0.9999), 320)
    assert "at step 320: 96.9 % the first step's weights, half-life longer than the run" in line
    assert warning is not None and "log.fid_weights=raw" in warning and "train.ema_warmup=true" in warning
    for name in ("dit-s2-vca", "sit-xl2-vca", "digits"):  # the paper's 400K steps, and the demo's warm-up EMA
        train = load_config(name).train
        length = ema_length(train, train.max_steps)
        assert not length.too_short and describe_ema(train, train.max_steps)[1] is None, (name, length)
        assert length.first_step_share < FIRST_STEP_SHARE_WARNING / 1000
    assert ema_length(load_config("digits").train, 2000).sigma_rel == pytest.approx(0.120, abs=0.001)  # evidence.md


def test_the_short_run_recipe_of_training_md_fits_its_length_and_quotes_the_figures():
    """docs/training.md, "Short runs": each command of the recipe either gives the run an EMA that fits its length
    (no warning) or draws grids and FID from other weights, where the paper's EMA at the same length is warned of;
    the figures the page quotes are ema_length's."""
    import shlex

    text = (REPO / "docs" / "training.md").read_text()
    section = text.split("- **Short runs.**", 1)[1].split("\n- **", 1)[0]
    prose = " ".join(section.split())
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line.split(" #")[0]) for line in block.strip().splitlines()]
    assert len(commands) == 3
    for tokens in commands:
        name = tokens[tokens.index("--config") + 1]
        config = load_config(name, [token for token in tokens if "=" in token])
        steps = config.train.max_steps
        assert describe_ema(config.train, steps)[1] is None or config.log.fid_weights != "ema", tokens
        paper = load_config(name, [f"train.max_steps={steps}"]).train
        assert describe_ema(paper, steps)[1] is not None  # the paper's EMA alone would be warned of
    warmup = ema_length(load_config("dit-s2-vca", ["train.ema_warmup=true"]).train, 20000)
    quoted = [
        f"{100 * fixed_decay_length(0.9999, 320).first_step_share:.1f} % of it after 320 steps",
        f"{100 * fixed_decay_length(0.9999, 20000).first_step_share:.1f} % after 20,000",
        f"newest {fixed_decay_length(0.9999, 10**6).half_life:,} steps",
        f"after 20,000 steps {100 * warmup.first_step_share:.1f} % the first step's weights, half-life "
        f"{warmup.half_life:,} steps, σ_rel {warmup.sigma_rel:.3f}",
        " ".join(describe_ema(train_config(0.9999), 320)[0].split()),
        f"more than {100 * FIRST_STEP_SHARE_WARNING:.0f} % of the EMA",
    ]
    for figure in quoted:
        assert figure in prose, figure
