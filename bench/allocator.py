"""Inception-v3 on the CPU under glibc's allocator as it comes, as the Makefile's environment sets it, and as a
command sets it from Python at start-up (`commands.keep_freed_memory`, mallopt).

    python -m bench.allocator            # 3 rounds, 4 batches of 8 images each
    python -m bench.allocator --quick    # 1 round, 1 batch

Each setting runs in a fresh process (an allocator setting holds for a whole process), the settings interleaved
round by round so that a change in the machine's load falls on all alike. Writes bench/results/allocator-cpu.json,
a Markdown table (.md) and a plot (.png).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from matplotlib.figure import Figure

from bench._harness import benchmark_parser, describe_device, save_results, subplots

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {  # name -> (environment added, whether the process calls keep_freed_memory)
    "glibc default": ({}, False),
    "environment (Makefile)": ({"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "100000000000"}, False),
    "mallopt at start-up": ({}, True),
}
TIMED = """
import json, sys, time
import numpy as np
from commands import keep_freed_memory
if sys.argv[1] == "1":
    assert keep_freed_memory()
from fid import load_inception
extractor = load_inception("bundled", "cpu")
images = np.random.default_rng(0).integers(0, 256, (8, 256, 256, 3), dtype=np.uint8)
extractor(images)  # warm-up
start = time.perf_counter()
for _ in range(int(sys.argv[2])):
    extractor(images)
print(json.dumps(8 * int(sys.argv[2]) / (time.perf_counter() - start)))
"""


def images_per_second(environment: dict[str, str], mallopt: bool, batches: int) -> float:
    clean = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    done = subprocess.run(
        [sys.executable, "-c", TIMED, str(int(mallopt)), str(batches)],
        cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **environment},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.split()[-1])


def markdown(results: dict) -> str:
    base = results["rows"][0]["images_per_s"]
    lines = [
        f"# Inception-v3 on the CPU by allocator setting, {results['cpu']}",
        "",
        f"median of {results['rounds']} rounds of {results['batches']} batches of 8 images (256 px) after a warm-up "
        f"batch, each in a fresh process; load average {results['load_before']:.2f} before, "
        f"{results['load_after']:.2f} after",
        "",
        "| allocator | images/s | speed-up | rounds (images/s) |",
        "|---|---:|---:|---|",
    ]
    for row in results["rows"]:
        runs = ", ".join(f"{value:.2f}" for value in row["runs"])
        lines.append(f"| {row['setting']} | {row['images_per_s']:.2f} | {row['images_per_s'] / base:.2f}x | {runs} |")
    return "\n".join(lines) + "\n"


def plot(results: dict) -> Figure:
    figure, axes = subplots(figsize=(6, 2.6))
    names = [row["setting"] for row in results["rows"]]
    axes.barh(names, [row["images_per_s"] for row in results["rows"]])
    axes.invert_yaxis()
    axes.set_xlabel("Inception-v3 images/s (median)")
    axes.set_title(results["cpu"], fontsize=9)
    figure.tight_layout()
    return figure


def main() -> None:
    parser = benchmark_parser(__doc__, quick="1 round of 1 batch", device=False)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rounds, batches = (1, 1) if args.quick else (args.rounds, 4)
    load_before = os.getloadavg()[0]
    runs: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(rounds):
        for name, (environment, mallopt) in SETTINGS.items():
            runs[name].append(images_per_second(environment, mallopt, batches))
    results = {
        "cpu": describe_device(torch.device("cpu")),
        "rounds": rounds,
        "batches": batches,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "rows": [
            {"setting": name, "images_per_s": statistics.median(values), "runs": values}
            for name, values in runs.items()
        ],
    }
    save_results(args.out, "allocator-cpu-quick" if args.quick else "allocator-cpu", results, markdown(results), plot)
    print(markdown(results))


if __name__ == "__main__":
    main()
