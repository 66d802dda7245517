"""studies/recipe_digits.py (VCA vs MHSA on the 2022 and the modern recipe, and each modern option alone, on the
digits; issue 41 item 4): its arms, the --quick study end to end, and the one-channel cosine-loss claim its
docstring makes."""

import json

import pytest
import torch

from _study import run_quick
from _user_errors import one_line_error
from bench._harness import STAMP_KEY, stamped_table
from dit_vca.model_options import BLOCK_PRESETS
from generation import read_export
from studies.recipe_digits import (
    ALONE,
    BLOCKS,
    CONFIG,
    FULL_BUDGET,
    FULL_DESIGN,
    MHSA_2022,
    MHSA_MODERN,
    MODERN_CONFIG,
    MODERN_KEYS,
    QUICK_BUDGET,
    STEM,
    VCA_2022,
    VCA_MODERN,
    main,
    render_markdown,
)
from studies.runner import REPO, checkpoint_export, checkpoint_steps, run_name
from training.config import config_to_dict, load_config

# The resolved config of every arm as the code before the modern recipe became a config built it (3b1f189,
# tests/data/README.md): the published results (studies/results/recipe-digits.*) were trained from these.
PUBLISHED_ARMS = REPO / "tests" / "data" / "recipe-digits-arms.json"

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_the_runs_go_seed_by_seed_and_each_option_alone_changes_only_its_keys():
    runs = [(arm.name, seed) for arm, seed in FULL_DESIGN.runs((0, 1, 2))]
    recipes = [arm.name for arm in (MHSA_2022, VCA_2022, MHSA_MODERN, VCA_MODERN)]
    # The four attention x recipe arms at seed 0, then seeds 1 and 2, then the one-option arms at seed 0: a study
    # stopped early has whole seeds.
    assert runs == [(name, seed) for seed in (0, 1, 2) for name in recipes] + [(arm.name, 0) for arm in ALONE]
    reference = load_config(CONFIG, list(VCA_2022.overrides))
    modern = load_config(MODERN_CONFIG, list(VCA_MODERN.overrides))
    assert modern.model.block_options == BLOCK_PRESETS["lightning-qknorm"] and modern.train.betas == [0.9, 0.95]
    assert (modern.transport.time_distribution, modern.transport.cosine_loss_weight) == ("logit-normal", 1.0)
    mhsa = load_config(MODERN_CONFIG, list(MHSA_MODERN.overrides))
    assert mhsa.model.block_options == BLOCK_PRESETS["lightning-qknorm"]
    for arm in ALONE:  # a misspelt key fails here rather than after an hour of training
        config = load_config(CONFIG, list(arm.overrides))
        assert config.train.lr == reference.train.lr and config.train.max_steps == reference.train.max_steps
        changed = {key for key, value in config.model.block_options.items() if value != BLOCK_PRESETS["dit"][key]}
        assert len(changed) <= 1, (arm.name, changed)  # one block option at most, the others the 2022 recipe's


def test_every_arm_trains_the_config_the_published_results_were_trained_with():
    """The modern arm reads configs/digits-modern.yaml, the one-option arms the modern config's values: each arm's
    resolved config is the one of the published study, key for key, under today's names (model.recipe is
    model.blocks; the model settings training takes from the data, new in the section, are left null; settings
    added since, such as train.cuda_graph, are off)."""
    published = json.loads(PUBLISHED_ARMS.read_text())["arms"]
    arms = (*FULL_DESIGN.recipes, *FULL_DESIGN.alone)
    assert {arm.name for arm in arms} == set(published)
    for arm in arms:
        config = config_to_dict(load_config(arm.config or CONFIG, [*arm.overrides, "run.dir=RUN"]))
        model = config["model"]
        assert [model.pop(key) for key in ("input_size", "in_channels", "num_classes", "learn_sigma")] == [None] * 4
        model["recipe"] = model.pop("blocks")
        assert config["train"].pop("cuda_graph") is False, arm.name  # issue 46's switch: off, the step as before
        assert config == published[arm.name], arm.name


def test_the_one_option_arms_cover_every_setting_the_modern_config_changes():
    """What configs/digits-modern.yaml changes in configs/digits.yaml, key by key, is the union of the options the
    study takes one at a time (and the preset, whose options are one arm each): no modern setting is left out of
    the one-option arms, and no option names a key the modern config leaves alone."""

    def flat(values: dict, prefix: str = "") -> dict:
        return {
            key: value
            for name, item in values.items()
            for key, value in (
                flat(item, f"{prefix}{name}.") if isinstance(item, dict) else {f"{prefix}{name}": item}
            ).items()
        }

    base, modern = (flat(config_to_dict(load_config(path, ["run.dir=RUN"]))) for path in (CONFIG, MODERN_CONFIG))
    changed = {key for key in modern if modern[key] != base[key]}
    # SiT's defaults, which the modern config spells out
    defaults = {
        "transport.path",
        "transport.prediction",
        "transport.logit_normal_location",
        "transport.logit_normal_scale",
    }
    assert changed == set(MODERN_KEYS) - defaults and defaults <= set(MODERN_KEYS)
    alone = {item.split("=")[0] for arm in ALONE for item in arm.overrides} - {"model.attention"}
    assert alone == set(MODERN_KEYS) - {BLOCKS} | {f"model.{option}" for option in BLOCK_PRESETS[modern[BLOCKS]]}


def test_one_channel_cosine_loss_moves_no_weight_except_from_a_zero_prediction():
    """The docstring's claim: on one channel 1 - cos(v, u) is 0 or 2 per pixel, so its gradient is 0 wherever the
    prediction is away from 0; at a prediction of exactly 0 (a zero-initialised output layer) cosine_similarity's
    eps (1e-8) turns it into u / 1e-8."""
    from sit_vca.transport import velocity_direction_loss

    target = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))  # (B, 1, H, W)
    for scale in (1.0, 1e-3):
        prediction = (scale * torch.randn(2, 1, 8, 8)).requires_grad_()
        velocity_direction_loss(prediction, target).sum().backward()
        assert torch.count_nonzero(prediction.grad) == 0
    zero = torch.zeros(2, 1, 8, 8, requires_grad=True)
    velocity_direction_loss(zero, target).sum().backward()
    assert zero.grad.abs().max() > 1e5  # of order max|u| / (64 pixels x 1e-8)


def test_finished_only_with_nothing_trained_is_one_line_and_exit_2(tmp_path, capsys):
    message = one_line_error(main, ["--finished-only", "--out", str(tmp_path / "empty")], capsys)
    assert str(tmp_path / "empty") in message and not (tmp_path / "empty").exists()
    assert message.startswith("error: --finished-only: no run of the study is trained")


@pytest.mark.slow
def test_quick_study_trains_both_recipes_scores_run_by_run_and_reports(tmp_path):
    out = tmp_path / "study"
    first = run_quick("studies.recipe_digits", out)
    # Each run is scored as soon as it is trained (a study stopped early has its first runs scored).
    assert first.index("sampling and scoring vca-2022-seed0 step 4") < first.index("training vca-modern-seed0")
    results = json.loads((out / f"{STEM}.json").read_text())
    markdown = (out / f"{STEM}.md").read_text()
    assert (out / f"{STEM}.png").read_bytes().startswith(PNG_SIGNATURE)
    assert list(results["arms"]) == ["vca-2022", "vca-modern"] and results["design"]["missing"] == []
    for name, kind in (("vca-2022", "diffusion"), ("vca-modern", "transport")):
        entry = results["arms"][name]
        assert entry["seeds"] == [0] and entry["fid"]["mean"] > 0 and 0 <= entry["accuracy"]["mean"] <= 1
        assert [point[0] for point in entry["curves"]["0"]] == checkpoint_steps(QUICK_BUDGET) == [4]  # final only
        assert entry["train_seconds"][0] > 0 and entry["parameters"] > 0
        points = out / "sweeps" / f"{name}-seed0"  # the run's scored points (scored_points)
        record = json.loads((points / "scores" / f"{name}-seed0_step_4-none.json").read_text())
        metrics = record["metrics"]  # one FID, of all the samples
        assert metrics["fid"] == metrics["fid_curve"] and record["sampling"]["num_samples"] == 12
        export = read_export(checkpoint_export(out / "runs" / f"{name}-seed0", 4))
        assert export.description.objective.kind == kind
    assert "| VCA, modern recipe | 0 |" in markdown and "Only the final model of each run is scored" in markdown
    assert "Every planned run was trained and scored." in markdown

    # Reporting what is trained trains and scores nothing and writes the same report.
    second = run_quick("studies.recipe_digits", out, "--finished-only")
    assert "quality: training" not in second and "sampling and scoring" not in second
    assert (out / f"{STEM}.md").read_text() == markdown


def test_the_published_study_is_the_committed_result():
    """studies/results/recipe-digits.md is the committed JSON rendered, and docs/evidence.md carries its tables row
    for row and names the runs that were not trained: a rerun that changes a figure must change the page too."""
    results = json.loads((REPO / "studies" / "results" / f"{STEM}.json").read_text())
    assert results["budget"]["max_steps"] == 2000 and results["budget"]["seeds"] == list(FULL_BUDGET.seeds)
    assert results["budget"]["checkpoint_fractions"] == [1.0] and results["budget"]["final_samples"] == 1000
    planned = {run_name(arm, seed) for arm, seed in FULL_DESIGN.runs(FULL_BUDGET.seeds)}
    reported = {f"{name}-seed{seed}" for name, entry in results["arms"].items() for seed in entry["seeds"]}
    assert reported | set(results["design"]["missing"]) == planned and not reported & set(results["design"]["missing"])
    markdown = render_markdown(results)
    assert (REPO / "studies" / "results" / f"{STEM}.md").read_text() == stamped_table(markdown, results[STAMP_KEY])
    page = (REPO / "docs" / "evidence.md").read_text()
    rows = [line for line in markdown.splitlines() if line.startswith("| ") and not line.startswith("| arm")]
    assert len(rows) >= len(results["design"]["recipes"])
    for row in rows:
        assert row in page.splitlines(), row
    for run in results["design"]["missing"]:
        assert run in page, run
