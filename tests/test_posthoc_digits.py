"""bench/posthoc_digits.py (post-hoc EMA and autoguidance on the digits, issue 29) in --quick mode: it trains with
stored profiles, reconstructs, scores every setting, reports and resumes."""

import json

import numpy as np

from _study import run_quick
from bench.posthoc_digits import QUICK, QUICK_GRID, STEM, arms

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_quick_study_reconstructs_scores_every_setting_reports_and_resumes(tmp_path):
    out = tmp_path / "study"
    first = run_quick("bench.posthoc_digits", out)
    assert all(f"quality: training {arm.name}-seed0" in first for arm in arms(QUICK))
    results = json.loads((out / f"{STEM}.json").read_text())
    markdown = (out / f"{STEM}.md").read_text()
    assert (out / f"{STEM}.png").read_bytes().startswith(PNG_SIGNATURE)
    for name in ("mhsa", "vca"):
        run_dir = out / "runs" / f"{name}-seed0"
        assert len(list((run_dir / "posthoc_ema").iterdir())) == QUICK.max_steps  # a snapshot every step
        entry = results["arms"][name]
        assert entry["best_sigma_rel"] in QUICK_GRID.sigma_rels
        expected = {f"classic cfg {scale:g}" for scale in (1, QUICK_GRID.cfg_scale)}
        expected |= {f"sigma_rel {s:g} cfg {scale:g}" for s in QUICK_GRID.sigma_rels for scale in (1, 2)}
        expected |= {f"sigma_rel {entry['best_sigma_rel']:g} autoguidance {s:g}" for s in QUICK_GRID.guided_scales}
        assert set(entry["settings"]) == expected
        for setting in entry["settings"].values():
            assert setting["seeds"] == [0] and np.isfinite(setting["fid"]["mean"]) and setting["fid"]["mean"] > 0
            assert 0 <= setting["accuracy"]["mean"] <= 1
        guide = json.loads((out / "scores" / f"{name}-seed0" / "best-auto2.json").read_text())["settings"]["guide"]
        assert guide == f"runs/{name}-seed0/checkpoints/step-0000002/export"  # the run's own step-2 export
    assert "best sigma_rel" in markdown and "| autoguidance |" in markdown and "classic EMA" in markdown

    # A rerun finds everything done: it trains, reconstructs and scores nothing and writes the same report.
    stamps = {path: path.stat().st_mtime_ns for path in (out / "scores").glob("*/*.json")}
    second = run_quick("bench.posthoc_digits", out)
    assert "quality: training" not in second and "sampling and scoring" not in second
    assert {path: path.stat().st_mtime_ns for path in stamps} == stamps
    assert (out / f"{STEM}.md").read_text() == markdown
