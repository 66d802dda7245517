"""The benchmark scripts still run: each one's --quick mode end to end, into a temporary folder.

Their numbers are not checked (timings belong in bench/results, never in assertions); what is checked is that
every script finishes, writes its JSON, table and plot, and measures something finite and positive.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# script -> (stem of its quick result files, path to the list of measured rows, the positive figure in each row)
SCRIPTS = {
    "attention": ("attention-cpu-quick", "rows", "ms"),
    "samplers": ("samplers-cpu-quick", "rows", "images_per_s"),
    "train": ("train-cpu-quick", "results", "images_per_s"),
    "fid": ("fid-cpu-quick", "inception", "images_per_s"),
    "solvers": ("solvers-cpu-quick", "rows", "images_per_s"),
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_quick_benchmark_writes_its_results(script: str, tmp_path: Path) -> None:
    stem, rows_key, figure = SCRIPTS[script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", f"bench.{script}", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for suffix in (".json", ".md", ".png"):
        assert (tmp_path / f"{stem}{suffix}").stat().st_size > 0, f"{stem}{suffix} missing or empty"
    rows = json.loads((tmp_path / f"{stem}.json").read_text())[rows_key]
    assert rows, f"{stem}.json has no {rows_key}"
    for row in rows:
        assert math.isfinite(row[figure]) and row[figure] > 0, row


def test_gpu_runbook_summarises_the_parts_and_marks_the_goal(tmp_path: Path) -> None:
    from bench.gpu import ATTENTION_GOAL, summary_rows

    tokens, limit = ATTENTION_GOAL
    attention = {"comparisons": [
        {"mode": "fwd+bwd", "tokens": tokens, "width": 384, "dtype": "bf16", "ratio_64": 0.25, "mhsa_best": "mhsa-sdpa"},
        {"mode": "fwd+bwd", "tokens": tokens, "width": 1152, "dtype": "bf16", "ratio_64": 0.5, "mhsa_best": "mhsa-sdpa"},
        {"mode": "fwd", "tokens": tokens, "width": 384, "dtype": "bf16", "ratio_64": 0.1, "mhsa_best": "mhsa-sdpa"},
        {"mode": "fwd+bwd", "tokens": 256, "width": 384, "dtype": "bf16", "ratio_64": 1.2, "mhsa_best": "mhsa-bmm"}]}
    (tmp_path / "attention-cuda.json").write_text(json.dumps(attention))
    train = {"vca_speedups": [{"label": "DiT-S/2 256px vca bf16 latents compiled", "time_ratio": 0.8}]}
    (tmp_path / "train-cuda.json").write_text(json.dumps(train))
    rows = summary_rows(tmp_path, "cuda")  # no sampler results: that part is left out, not an error
    assert [row[0] for row in rows] == ["attention", "attention", "train"]  # fwd+bwd at N >= 4096 only
    assert rows[0][2].endswith(f"(goal ≤ {limit:.2f}: met)") and rows[1][2].endswith("missed)")
    assert rows[2] == ("train", "DiT-S/2 256px vca bf16 latents compiled", "VCA / MHSA time 0.80")


def test_gpu_runbook_refuses_to_run_without_a_gpu() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "bench.gpu"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: bench.gpu: no CUDA GPU here; the CPU figures come from `make bench`"]
