"""How long a command takes to answer what needs no model: `--help`, an unknown config key, a bad value (also of a
resume's own config), a bad argument to `python -m fid`.

    python -m bench.startup --before /work/main      # this tree against another checkout, in one run
    python -m bench.startup --quick                  # one timing of each command, this tree only

Each command runs as a user runs it (`python train.py ...` from the tree's root, a fresh interpreter each time);
the wall time of the whole process is timed, `--repeats` times per tree, interleaved between the trees so that a
change in the machine's load falls on both alike, and the median is kept. `{run}` in a command is a run folder
made for the measurement (configs/digits.yaml as its config.yaml, as a launch leaves it before its first
checkpoint). Writes bench/results/startup-cpu.json, a Markdown table (.md) and a plot (.png); the CPU and its
load are recorded with them.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from matplotlib.figure import Figure

from bench._harness import benchmark_parser, describe_device, save_results, subplots
from generation.run_layout import TRAIN_CONFIG

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {  # what a user types, after `python`
    "train.py --help": ["train.py", "--help"],
    "sample.py --help": ["sample.py", "--help"],
    "python -m fid --help": ["-m", "fid", "--help"],
    "train.py: unknown config key": ["train.py", "--config", "digits", "no_such_section.key=1"],
    "train.py: bad model.num_heads": ["train.py", "--config", "digits", "model.num_heads=5"],
    "train.py --resume RUN: bad model.depth": ["train.py", "--resume", "{run}", "model.depth=0"],
    "python -m fid: unknown metric": ["-m", "fid", "samples.npz", "--metrics", "kid"],
    "python -m fid.reference --help": ["-m", "fid.reference", "--help"],
}


def time_command(tree: Path, arguments: list[str]) -> float:
    """Seconds from starting `python ARGUMENTS` in `tree` to its exit (status 0 or 2, anything else is a bug)."""
    environment = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *arguments], cwd=tree, env=environment, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode not in (0, 2):
        raise RuntimeError(f"{arguments} in {tree} exited with {result.returncode}: {result.stderr[-2000:]}")
    return seconds


def measure(trees: dict[str, Path], repeats: int) -> list[dict]:
    """One row per command and tree: the median and every run's seconds, the trees' runs interleaved."""
    runs: dict[tuple[str, str], list[float]] = {(name, label): [] for name in COMMANDS for label in trees}
    with tempfile.TemporaryDirectory() as run:
        shutil.copy(ROOT / "configs" / "digits.yaml", Path(run) / TRAIN_CONFIG)
        for _ in range(repeats):
            for name, arguments in COMMANDS.items():
                for label, tree in trees.items():
                    runs[name, label].append(time_command(tree, [argument.format(run=run) for argument in arguments]))
    return [
        {"command": name, "tree": label, "seconds": statistics.median(values), "runs": values}
        for (name, label), values in runs.items()
    ]


def seconds_by_command(results: dict) -> dict[str, dict[str, float]]:
    """{command: {tree: median seconds}} of the rows."""
    table: dict[str, dict[str, float]] = {}
    for row in results["rows"]:
        table.setdefault(row["command"], {})[row["tree"]] = row["seconds"]
    return table


def tree_commit(tree: Path) -> str:
    """The commit a tree has checked out (its path would name this machine's folders, not what was measured)."""
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "not a git checkout"


def markdown(results: dict) -> str:
    labels = results["trees"]
    ratio = len(labels) == 2
    header = "| command | " + " | ".join(f"{label} s" for label in labels) + (" | before / after |" if ratio else " |")
    lines = [
        f"# Start-up times on {results['cpu']}",
        "",
        f"median of {results['repeats']} runs of each command (wall time of a fresh `python` process), trees "
        + ", ".join(f"{label}: commit {commit}" for label, commit in results["tree_commits"].items())
        + f"; load average {results['load_before']:.2f} before, {results['load_after']:.2f} after",
        "",
        header,
        "|---|" + "---:|" * (len(labels) + ratio),
    ]
    for name, seconds in seconds_by_command(results).items():
        row = f"| {name} | " + " | ".join(f"{seconds[label]:.2f}" for label in labels) + " |"
        if ratio:
            row += f" {seconds[labels[0]] / seconds[labels[1]]:.1f}x |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def plot(results: dict) -> Figure:
    figure, axes = subplots(figsize=(7, 4.4))
    table = seconds_by_command(results)
    names = list(table)
    height = 0.8 / len(results["trees"])
    for index, label in enumerate(results["trees"]):
        positions = [row + index * height for row in range(len(names))]
        axes.barh(positions, [table[name][label] for name in names], height, label=label)
    axes.set_yticks([row + 0.4 - height / 2 for row in range(len(names))], names)
    axes.invert_yaxis()
    axes.set_xlabel("seconds to answer (median)")
    axes.set_title(f"Start-up times, {results['cpu']}", fontsize=9)
    axes.legend()
    figure.tight_layout()
    return figure


def main() -> None:
    parser = benchmark_parser(__doc__, quick="one run of each command, this tree only", device=False)
    parser.add_argument("--before", type=Path, help="another checkout (e.g. the main branch) timed alongside")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    trees = {"this tree": ROOT} if args.before is None or args.quick else {"before": args.before, "after": ROOT}
    repeats = 1 if args.quick else args.repeats
    load_before = os.getloadavg()[0]
    rows = measure(trees, repeats)
    results = {
        "cpu": describe_device(torch.device("cpu")),
        "trees": list(trees),
        "tree_commits": {label: tree_commit(path) for label, path in trees.items()},
        "repeats": repeats,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "rows": rows,
    }
    save_results(args.out, "startup-cpu-quick" if args.quick else "startup-cpu", results, markdown(results), plot)
    print(markdown(results))


if __name__ == "__main__":
    main()
