"""studies/repa_digits.py (the REPA x attention study on the digits) in --quick mode, and the committed digits
encoder that stands in for DINOv2."""

import json
from pathlib import Path

import numpy as np
import pytest

from _study import run_quick as run_study_quick
from studies.digits_encoder import FOLDER, accuracy, split_digits
from studies.repa_digits import QUICK_PROJECTOR, arms
from studies.report import format_spread, spread
from studies.runner import QUICK, checkpoint_steps
from training.config import RepaConfig
from training.repa import load_encoder

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_committed_digits_encoder_loads_and_has_its_recorded_accuracy():
    record = json.loads((FOLDER / "training.json").read_text())
    encoder = load_encoder(RepaConfig(encoder=str(FOLDER), input_size=8), image_channels=1, model_grid=4)
    assert (encoder.grid, encoder.width, encoder.in_channels) == (4, 64, 1)
    _, _, test_x, test_y = split_digits()
    # The classifier head on the average of the encoder's patch features (what REPA aligns with): the accuracy
    # training.json recorded, on the same 450 held-out digits (the same float32 ops: equal to 1e-6).
    assert accuracy(encoder.vit, test_x, test_y) == pytest.approx(record["held_out_accuracy"], abs=1e-6)
    features = encoder(test_x)  # (450, 16, 64)
    logits = encoder.vit.head(encoder.vit.fc_norm(features.mean(1)))
    assert float((logits.argmax(-1) == test_y).float().mean()) == pytest.approx(record["held_out_accuracy"], abs=1e-6)


def run_quick(out: Path) -> str:
    return run_study_quick("studies.repa_digits", out)


def test_quick_study_trains_the_four_arms_reports_and_resumes(tmp_path):
    out = tmp_path / "study"
    first = run_quick(out)
    names = [arm.name for arm in arms(QUICK_PROJECTOR)]
    assert names == ["mhsa", "vca", "mhsa-repa", "vca-repa"]
    assert all(f"quality: training {name}-seed0" in first for name in names)
    results = json.loads((out / "repa-digits.json").read_text())
    markdown = (out / "repa-digits.md").read_text()
    assert (out / "repa-digits.png").read_bytes().startswith(PNG_SIGNATURE)
    for name in names:
        entry = results["arms"][name]
        assert entry["seeds"] == [0] and np.isfinite(entry["fid"]["mean"]) and entry["fid"]["mean"] > 0
        assert [point[0] for point in entry["curves"]["0"]] == checkpoint_steps(QUICK)
        assert all(0 <= value <= 1 for _, value in entry["accuracy_curves"]["0"])
    for name in ("mhsa-repa", "vca-repa"):  # REPA arms logged the alignment loss; the others did not
        lines = (out / "runs" / f"{name}-seed0" / "metrics.jsonl").read_text().splitlines()
        assert all("alignment_loss" in json.loads(line) for line in lines)
    assert "alignment_loss" not in (out / "runs" / "vca-seed0" / "metrics.jsonl").read_text()
    assert "VCA + REPA" in markdown and "One seed per arm" in markdown and "real digits" in markdown
    assert "studies/digits_encoder" in markdown and str(REPO) not in markdown
    assert str(REPO) not in (out / "repa-digits.json").read_text()  # paths in the repository, not on this machine

    # A rerun finds everything done: it trains and scores nothing and writes the same report.
    stamps = {path: path.stat().st_mtime_ns for path in (out / "sweeps").glob("*/scores/*.json")}
    assert len(stamps) == len(names) * len(checkpoint_steps(QUICK))
    second = run_quick(out)
    assert "quality: training" not in second and "sampling and scoring" not in second
    assert {path: path.stat().st_mtime_ns for path in stamps} == stamps
    assert (out / "repa-digits.md").read_text() == markdown


def test_the_published_study_table_is_the_committed_result():
    """docs/evidence.md's REPA table says what studies/results/repa-digits.json holds: a rerun of the study that
    changes a figure must change the page too (the README's sentence quotes the same figures)."""
    results = json.loads((REPO / "studies" / "results" / "repa-digits.json").read_text())
    assert results["budget"]["max_steps"] == 2000 and results["budget"]["seeds"] == [0, 1, 2]
    page = (REPO / "docs" / "evidence.md").read_text()
    readme = (REPO / "README.md").read_text()
    for entry in results["arms"].values():
        fid, accuracy_ = entry["fid"], entry["accuracy"]
        early_fid = spread([curve[0][1] for curve in entry["curves"].values()])
        early_accuracy = np.mean([curve[0][1] for curve in entry["accuracy_curves"].values()])
        row = (
            f"| {entry['label']} | {format_spread(fid)} | {', '.join(f'{value:.2f}' for value in fid['values'])} | "
            f"{format_spread(accuracy_, percent=True)} | {format_spread(early_fid)} | {100 * early_accuracy:.1f} % |"
        )
        assert row in page.splitlines(), row
        assert f"{entry['label']} {format_spread(fid)}" in " ".join(readme.split())  # line breaks aside
