"""How many intra-op threads `make demo`'s training should use on a loaded CPU: 1 against 2, measured in one run.

    python -m bench.threads                       # 3 rounds of 60 steps with 1 and with 2 threads
    python -m bench.threads --quick               # one round of 20 steps

Each round runs train.py on configs/digits.yaml (the demo's model and batch) once per thread count, in turn, so
the other jobs of a shared machine slow each alike over the rounds, in a child process with OMP_NUM_THREADS set,
and reads its rate from its metrics.jsonl: steps per second over the logging windows after the first (start-up
and the first steps excluded). The 1-minute load average is recorded before each run (what the other jobs put
on the machine: the measuring process adds its own threads once it runs) with the threads demo.choose_threads
would pick at that load. Writes bench/results/threads-cpu.{json,md,png}.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench._harness import benchmark_parser, describe_device, save_results, subplots
from generation.run_layout import METRICS_FILE

ROOT = Path(__file__).resolve().parents[1]
LOG_EVERY = 10


def steady_rate(metrics: Path) -> float:
    """Steps per second over every logging window but the first (which holds the start-up's first steps)."""
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    later = lines[1:]
    steps = [line["step"] - before["step"] for before, line in zip(lines, later)]
    return sum(steps) / sum(count / line["steps_per_s"] for count, line in zip(steps, later))


def run_training(threads: int, steps: int) -> dict:
    import demo

    load = os.getloadavg()[0]
    cpus = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as folder:
        command = [
            sys.executable,
            str(ROOT / "train.py"),
            "--config",
            "digits",
            f"train.max_steps={steps}",
            f"log.every={LOG_EVERY}",
            f"log.checkpoint_every={10 * steps}",
            "log.sample_every=0",
            "log.trackers=[]",
            f"run.dir={folder}/run",
        ]
        environment = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
        done = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"bench.threads: train.py with {threads} threads failed:\n{done.stderr[-3000:]}")
        rate = steady_rate(Path(folder) / "run" / METRICS_FILE)
    return {
        "threads": threads,
        "load_before": load,
        "cpus": cpus,
        "demo_would_choose": demo.choose_threads(cpus, load),
        "steps_per_s": rate,
    }


def markdown(report: dict) -> str:
    lines = [
        f"# Training the demo's model with 1 and 2 threads on {report['cpu']}",
        "",
        f"{report['rounds']} rounds of {report['steps']} steps of configs/digits.yaml per thread count, in turn; "
        f"steps/s after the first {LOG_EVERY}-step window; load = 1-minute load average before the run; the "
        f"measuring processes ran at niceness {report['niceness']}.",
        "",
        "| round | threads | load before | demo would pick | steps/s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in report["runs"]:
        lines.append(
            f"| {row['round']} | {row['threads']} | {row['load_before']:.1f} | {row['demo_would_choose']} | "
            f"{row['steps_per_s']:.3f} |"
        )
    lines += ["", "| threads | median steps/s | median load before |", "|---:|---:|---:|"]
    for threads, summary in report["summary"].items():
        lines.append(f"| {threads} | {summary['steps_per_s']:.3f} | {summary['load_before']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(report: dict):
    figure, axes = subplots(figsize=(6, 4))
    for threads in report["summary"]:
        rows = [row for row in report["runs"] if str(row["threads"]) == threads]
        axes.scatter([r["load_before"] for r in rows], [r["steps_per_s"] for r in rows], label=f"{threads} thread(s)")
    axes.set(xlabel="1-minute load average before the run", ylabel="training steps/s", ylim=(0, None))
    axes.legend()
    figure.tight_layout()
    return figure


def main() -> None:
    parser = benchmark_parser(__doc__, "one round of 20 steps", device=False)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    import torch

    rounds, steps = (1, 20) if args.quick else (args.rounds, args.steps)
    runs = []
    for round_ in range(1, rounds + 1):
        for threads in args.threads:
            runs.append({"round": round_, **run_training(threads, steps)})
            print(json.dumps(runs[-1]), flush=True)
    summary = {
        str(threads): {
            key: statistics.median(row[key] for row in runs if row["threads"] == threads)
            for key in ("steps_per_s", "load_before")
        }
        for threads in args.threads
    }
    report = {
        "cpu": describe_device(torch.device("cpu")).rsplit(",", 1)[0],
        "niceness": os.nice(0),
        "rounds": rounds,
        "steps": steps,
        "runs": runs,
        "summary": summary,
    }
    stem = "threads-cpu-quick" if args.quick else "threads-cpu"
    save_results(args.out, stem, report, markdown(report), plot)
    print(markdown(report))


if __name__ == "__main__":
    main()
