"""Scored points: an export sampled with sample.py's options, scored, recorded, and read back when a later run asks
for the same point with the same settings. sweep.py and the studies (studies.runner, studies.posthoc_digits) score
every point through here, so that they share one sampling path, one record format and one rule of reuse.

A point is one export (anything sample.py --ckpt takes), one guidance (classifier-free `cfg` at a scale, 1 being
none; or `autoguidance` at a scale, by a guide export) and a label (its name in tables and progress lines; made
file-safe, with the guidance, its file stem). A `ScoredPoints` folder holds, per point:

    samples/<point>.npz    sampled by sample.py's own code (`sample.main`): the file a separate sample.py run with
                           the same options writes (and its .json and .png beside it); a point killed while
                           sampling continues from its finished shards
    scores/<point>.json    the record, written atomically once the point is scored:
        point              the export, label, guidance, scale and guide
        sampling           sample.py's settings (`sample.run_settings`), the sha256 of the weights among them
        scoring            the scorer's settings: what a score depends on besides the samples
        metrics            the scores (`FidScorer`: python -m fid's metrics; a study's judge: FID, the FID of the
                           first samples and a classifier's accuracy)
        samples, train_step, inception_weights, seconds (of sampling and of scoring)

A record is read back when its point, sampling and scoring are those asked for: an export replaced in place (other
weights), other sample.py options or another scorer make the point sampled (sample.py refuses samples of other
settings rather than replacing them) and scored again. A file at a record's path that is not such a record was not
written here and is never replaced (atomic_files.ownership).
"""

from __future__ import annotations

import json
import re
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Protocol

from atomic_files import write_json_atomic
from atomic_files.ownership import json_object_with, refuse_foreign
from fid.request import DEFAULT_BATCH_SIZE

RECORD_KEYS = ("point", "sampling", "scoring", "metrics")  # what makes <folder>/scores/<point>.json a record
SETTINGS_KEYS = ("point", "sampling", "scoring")  # what a record is reused for: all three as stored
COLUMN_NAMES = {"fid": "FID", "sfid": "sFID", "is": "IS", "precision": "precision", "recall": "recall"}


@dataclass(frozen=True)
class Point:
    """One point: the export to sample (as sample.py --ckpt takes it), its name in tables, the guidance ("cfg" at
    `scale`, or "autoguidance" at `scale` by the export `guide`; cfg at scale 1 is none)."""

    ckpt: str
    label: str
    guidance: str
    scale: float
    guide: str | None = None

    @property
    def name(self) -> str:
        """The file stem of its samples and record: the label made file-safe, the guidance and the scale."""
        guidance = "none" if self.unguided else f"{self.guidance}{self.scale:g}"
        return f"{re.sub(r'[^A-Za-z0-9._-]+', '_', self.label).strip('_')}-{guidance}"

    @property
    def unguided(self) -> bool:
        return self.guidance == "cfg" and self.scale == 1

    def sample_arguments(self) -> list[str]:
        """sample.py's flags for this export and guidance."""
        if self.guidance == "autoguidance":
            guidance = ["--guide-ckpt", str(self.guide), "--guidance-scale", repr(self.scale)]
        else:
            guidance = ["--cfg-scale", repr(self.scale)]
        return ["--ckpt", self.ckpt, *guidance]


class Scorer(Protocol):
    """What scores a point's samples: its settings (recorded, and compared when a record is read back) and the
    scores of a samples file, with the description of the Inception weights that made them."""

    @property
    def settings(self) -> dict[str, Any]: ...

    def score(self, samples: Path) -> tuple[dict[str, float], str | None]: ...


@dataclass
class FidScorer:
    """Scores as `python -m fid SAMPLES ref --metrics ... --weights ... --batch-size ...` does (fid.evaluate), with
    Inception loaded once per process (at the first scoring: a rerun that finds every point scored loads none) and
    fid's warning of sets too small for an unbiased FID said once per scorer."""

    ref: str
    metrics: tuple[str, ...] = ("fid",)
    weights: str | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    device: str | None = None  # Inception's (default: cuda when available); not part of a score's settings
    small_sets_said: bool = field(default=False, init=False, compare=False)

    @property
    def settings(self) -> dict[str, Any]:
        ref = Path(self.ref)
        return {
            "ref": str(ref.resolve()) if ref.exists() else self.ref,
            "metrics": sorted(self.metrics),
            "weights": self.weights,
            "batch_size": self.batch_size,
        }

    def score(self, samples: Path) -> tuple[dict[str, float], str | None]:
        from fid import evaluate
        from fid.cli import one_line_warnings
        from fid.evaluation import SmallSetWarning

        with one_line_warnings():
            if self.small_sets_said:  # every point has as many samples: said at the first
                warnings.simplefilter("ignore", SmallSetWarning)
            self.small_sets_said = True
            evaluation = evaluate(
                samples,
                self.ref,
                self.metrics,
                batch_size=self.batch_size,
                extractor=inception(self.weights, self.device, "is" in self.metrics),
            )
        return dict(evaluation.metrics), evaluation.inception_weights


@cache
def inception(weights: str | None, device: str | None, require_classifier: bool):
    """Inception with these weights on this device, loaded once per process (a study's sweeps share it)."""
    from fid import load_inception

    return load_inception(weights, device, require_classifier=require_classifier)


@dataclass
class ScoredPoints:
    """A folder of points sampled with `sample_options` (sample.py options shared by every point, not those a point
    sets: --ckpt, guidance, --num-samples, --out) into <folder>/samples/, scored by `scorer` into
    <folder>/scores/, one record each. `command` names the writer in the refusal of a file it did not write,
    `progress` begins each progress line."""

    folder: Path
    num_samples: int
    sample_options: Sequence[str]
    scorer: Scorer
    command: str = "sweep.py"
    progress: str = "sweep"

    @property
    def samples_folder(self) -> Path:
        return self.folder / "samples"  # the points' own, not a run's

    def samples_path(self, point: Point) -> Path:
        return self.samples_folder / f"{point.name}.npz"

    def record_path(self, point: Point) -> Path:
        return self.folder / "scores" / f"{point.name}.json"

    def sample_argv(self, point: Point) -> list[str]:
        """sample.py's command line for `point`."""
        samples = ["--num-samples", str(self.num_samples), "--out", str(self.samples_path(point))]
        return [*point.sample_arguments(), *samples, *self.sample_options]

    def settings_of(self, point: Point) -> dict[str, Any]:
        """What a record of `point` is made with: the point, sample.py's settings, the scorer's."""
        import sample
        from sample_arguments import parse_args

        sampling = sample.run_settings(parse_args(self.sample_argv(point)))
        return {"point": asdict(point), "sampling": sampling, "scoring": self.scorer.settings}

    def refuse_foreign(self, point: Point) -> None:
        """Refuse a file at `point`'s record path that is not a record (ForeignFileError, naming it)."""
        refuse_foreign(self.record_path(point), is_score_record, self.command, choose="choose another --out")

    def stored(self, point: Point, expected: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The record an earlier run made of `point` with the same settings (`expected`: `settings_of(point)`),
        else None."""
        self.refuse_foreign(point)
        record_path = self.record_path(point)
        if not record_path.is_file():
            return None
        stored = json.loads(record_path.read_text())
        expected = self.settings_of(point) if expected is None else expected
        return stored if all(stored.get(key) == expected[key] for key in SETTINGS_KEYS) else None

    def score(self, point: Point) -> dict[str, Any]:
        """The record of `point`: read back when an earlier run made it with the same settings, else sampled
        (sample.py resumes its shards, or finds its samples complete) and scored, then written atomically."""
        import sample

        expected = self.settings_of(point)
        stored = self.stored(point, expected)
        if stored is not None:
            return stored
        print(f"{self.progress}: sampling and scoring {describe(point)} ({self.num_samples} samples)", flush=True)
        started = time.perf_counter()
        samples = self.samples_path(point)
        samples.parent.mkdir(parents=True, exist_ok=True)
        sample.main(self.sample_argv(point))
        sampled = time.perf_counter()
        metrics, weights = self.scorer.score(samples)
        summary = json.loads(samples.with_suffix(".json").read_text())
        record = {
            **expected,
            "samples": str(samples),
            "train_step": summary["train_step"],
            "metrics": metrics,
            "inception_weights": weights,
            "seconds": {"sample": round(sampled - started, 1), "score": round(time.perf_counter() - sampled, 1)},
        }
        write_json_atomic(self.record_path(point), record)
        print(f"{self.progress}: {describe(point)}: {format_metrics(metrics)}", flush=True)
        return record


def is_score_record(path: Path) -> bool:
    """Whether `path` is a point's record (<folder>/scores/<point>.json) that sweep.py or a study wrote."""
    return json_object_with(path, RECORD_KEYS)


def describe(point: Point) -> str:
    guidance = "no guidance" if point.unguided else f"{point.guidance} {point.scale:g}"
    return f"{point.label}, {guidance}"


def format_metrics(metrics: dict[str, float]) -> str:
    return ", ".join(f"{COLUMN_NAMES.get(name, name)} {value:.4f}" for name, value in metrics.items())
