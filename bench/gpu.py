"""GPU runbook: the speed figures of one CUDA GPU in one command of at most ~8 minutes (`make bench-gpu`).

    python -m bench.gpu                     # writes bench/results/{attention,train,samplers}-cuda.* and gpu-cuda.md
    python -m bench.gpu --out /tmp/gpu      # elsewhere

Runs, each part in its own process under a time limit so that one slow part cannot eat the others' time:
1. the attention benchmark up to N = 16384 (MHSA on SDPA, which picks the flash kernel in bf16, against VCA with
   n = 64 and n = N/4), fp32 and bf16;
2. the DiT-S/2 training step at 256 and 512 px in bf16, batch 32, with and without torch.compile;
3. the sampler benchmark in bf16, batch 32, VCA and MHSA;
then prints one summary table (and writes it as gpu-<device>.md) with every goal of the speed issue met or missed.
A part that fails or runs out of time is named in the table; the others still report.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from atomic_files import write_text_atomic
from bench._harness import benchmark_parser

# (name, module arguments, time limit in seconds): about 8 minutes in all on an H200-class GPU.
PARTS = (
    ("attention", ["--tokens", "256", "1024", "4096", "16384"], 180),
    ("train", ["--goal-rows", "--precision", "bf16", "--compile", "--batch-size", "32"], 210),
    ("samplers", ["--precisions", "bf16", "--batch-size", "32"], 90),
)
ATTENTION_GOAL = (16384, 1 / 3)  # fwd+bwd, n = 64: VCA at least 3x faster than flash MHSA


def run_part(name: str, arguments: list[str], limit: int, out: Path, quick: bool) -> dict:
    """Run `python -m bench.<name>` with a time limit (with `quick`: its smoke run instead of `arguments`);
    returns its status and wall time."""
    command = [sys.executable, "-m", f"bench.{name}", *(["--quick"] if quick else arguments), "--out", str(out)]
    print(f"bench.gpu: {' '.join(command[1:])} (limit {limit} s)", flush=True)
    started = time.perf_counter()
    try:
        status = "ok" if subprocess.run(command, timeout=limit).returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        status = f"stopped after {limit} s"
    return {"status": status, "seconds": round(time.perf_counter() - started, 1)}


def summary_rows(out: Path, device: str) -> list[tuple[str, str, str]]:
    """(benchmark, case, result) rows from the parts' JSON files."""
    rows = []
    attention = out / f"attention-{device}.json"
    if attention.exists():
        for entry in json.loads(attention.read_text())["comparisons"]:
            if entry["mode"] == "fwd+bwd" and entry["tokens"] >= 4096:
                goal = ""
                if entry["tokens"] == ATTENTION_GOAL[0]:
                    verdict = "met" if entry["ratio_64"] <= ATTENTION_GOAL[1] else "missed"
                    goal = f" (goal ≤ {ATTENTION_GOAL[1]:.2f}: {verdict})"
                rows.append(("attention", f"N = {entry['tokens']}, C = {entry['width']}, {entry['dtype']}, fwd+bwd",
                             f"VCA(n=64) / {entry['mhsa_best']} time {entry['ratio_64']:.3f}{goal}"))
    train = out / f"train-{device}.json"
    if train.exists():
        for speedup in json.loads(train.read_text())["vca_speedups"]:
            rows.append(("train", speedup["label"], f"VCA / MHSA time {speedup['time_ratio']:.2f}"))
    samplers = out / f"samplers-{device}.json"
    if samplers.exists():
        for row in json.loads(samplers.read_text())["rows"]:
            rows.append(("samplers", f"{row['model']} {row['label']} {row['precision']}",
                         f"{row['images_per_s']:.1f} images/s, {row['ms_per_nfe']:.1f} ms/NFE"))
    return rows


def main() -> None:
    parser = benchmark_parser(__doc__, quick="every part's smoke run (on any device)", device=False)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available() and not args.quick:
        print("error: bench.gpu: no CUDA GPU here; the CPU figures come from `make bench`", file=sys.stderr)
        raise SystemExit(2)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    statuses = {name: run_part(name, arguments, limit, args.out, args.quick) for name, arguments, limit in PARTS}
    suffix = "-quick" if args.quick else ""
    lines = [f"GPU runbook on {torch.cuda.get_device_name() if device == 'cuda' else 'the CPU (smoke run)'}", "",
             "| part | status | seconds |", "|---|---|---:|",
             *(f"| {name} | {status['status']} | {status['seconds']} |" for name, status in statuses.items()), "",
             "| benchmark | case | result |", "|---|---|---|",
             *(f"| {b} | {case} | {result} |" for b, case, result in summary_rows(args.out, device + suffix))]
    table = "\n".join(lines) + "\n"
    write_text_atomic(args.out / f"gpu-{device}{suffix}.md", table)
    print(table)


if __name__ == "__main__":
    main()
