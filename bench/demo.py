"""Where `make demo`'s time goes on a CPU, natively and with an AVX2-only CPU emulated, measured in one run.

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 python -m bench.demo   # ~15 min on 2 busy cores
    python -m bench.demo --quick                                                # one round of fewer units

Each configuration runs in a child process of its own (the CPU-capability switches are read when torch loads):
"native", and "avx2", with ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2, which keep ATen's vectorised
kernels and oneDNN to AVX2 on a CPU that has AVX-512 (MKL's GEMMs keep their own dispatch). A probe checks that
the emulation takes the slow path a real AVX2 CPU takes: a bf16 matmul, native on AVX-512 BF16, is emulated
there (bench._harness.matmul_gflops, one thread). The children run in turn, for --rounds rounds, and every
figure is the median over the rounds, so a machine shared with other jobs slows both alike. Figures are CPU
time (user + sys of the child, resource.getrusage) per unit of work, which other jobs barely change, and
wall-clock rates, which they do change:

- train: one optimiser step of configs/digits.yaml (Trainer.train_step: forward, backward, clipping, AdamW,
  EMA), with `threads` intra-op threads, TF32 as the config says (train.tf32=true) and off;
- sample: one DDPM step of the demo's sampler on a batch of demo.SAMPLE_BATCH, unguided and guided;
- inception: the bundled Inception-v3 on judges.digits.INCEPTION_BATCH digits (FID's preprocessing included).

Writes bench/results/demo-cpu.json and a Markdown table (.md); the plot shows the CPU seconds per unit.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from bench._harness import (
    benchmark_parser,
    cpu_vector_flags,
    describe_device,
    matmul_gflops,
    save_results,
    subplots,
)

ROOT = Path(__file__).resolve().parents[1]
EMULATIONS = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(work, repeats: int) -> dict[str, float]:
    """CPU seconds and wall seconds per call of `work()` over `repeats` calls (after one untimed call)."""
    work()
    cpu, wall = cpu_seconds(), time.perf_counter()
    for _ in range(repeats):
        work()
    return {"cpu_s": (cpu_seconds() - cpu) / repeats, "wall_s": (time.perf_counter() - wall) / repeats}


def bf16_probe() -> dict[str, float]:
    """GFLOP/s of a bf16 and an fp32 matmul on one thread (the fastest of 5): does bf16 take a native path?"""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    fp32, bf16 = (matmul_gflops(torch.device("cpu"), dtype) for dtype in (torch.float32, torch.bfloat16))
    torch.set_num_threads(threads)
    return {"fp32_gflops": fp32, "bf16_gflops": bf16, "bf16_over_fp32": bf16 / fp32}


def train_rows(threads: list[int], steps: int) -> list[dict]:
    import torch

    from training.accelerator import create_accelerator
    from training.build import build_training
    from training.config import load_config
    from training.loop import Trainer, TrainerState
    from training.run import RunDirectory

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        run = RunDirectory(Path(folder))
        config = load_config(ROOT / "configs" / "digits.yaml", [f"run.dir={folder}", "log.trackers=[]"])
        accelerator = create_accelerator(config, run)
        parts = build_training(config, accelerator)
        trainer = Trainer(accelerator, config, run, parts, TrainerState())
        stream = parts.batches.stream()
        precision = torch.get_float32_matmul_precision()  # what the run sets (train.tf32)
        for count in threads:
            for tf32 in (True, False):
                torch.set_num_threads(count)
                torch.set_float32_matmul_precision("high" if tf32 else "highest")
                figures = timed(lambda: trainer.train_step(stream), steps)
                rows.append({"part": "train step", "threads": count, "tf32": tf32, **figures})
        torch.set_float32_matmul_precision(precision)
    return rows


def sample_and_inception_rows(threads: int, repeats: int) -> list[dict]:
    import numpy as np
    import torch

    import demo
    from fid import extract_features, load_inception
    from generation import ImageGenerator
    from generation.objective_builder import create_objective
    from judges.digits import INCEPTION_BATCH, real_digits
    from training.build import build_model, objective_spec
    from training.config import load_config

    torch.set_num_threads(threads)
    config = load_config(ROOT / "configs" / "digits.yaml", ["run.dir=unused"])
    model = build_model(config, 1, config.data.image_size).eval()
    generator = ImageGenerator(model, create_objective(objective_spec(config)), lambda x: x.clamp(-1, 1), 10)
    labels = np.arange(demo.SAMPLE_BATCH) % 10
    seeds = list(range(demo.SAMPLE_BATCH))
    rows = []
    for guidance in (1.0, 2.0):
        step = partial(generator.generate, labels, seeds, guidance=guidance, sampler=demo.SAMPLER, steps=1)
        figures = timed(step, repeats)
        rows.append({"part": f"sample step, guidance {guidance:g}", "threads": threads, "tf32": False, **figures})
    images, _ = real_digits()
    extractor = load_inception("bundled", device="cpu")
    batch = images[:INCEPTION_BATCH]
    figures = timed(lambda: extract_features([batch], extractor), max(1, repeats // 4))
    rows.append({"part": f"inception, {INCEPTION_BATCH} images", "threads": threads, "tf32": False, **figures})
    return rows


def child(quick: bool, threads: list[int]) -> dict:
    """The figures of this process's CPU configuration (run by the parent with the emulation's environment)."""
    import torch

    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "default_threads": torch.get_num_threads(),
        "bf16_probe": bf16_probe(),
        "rows": train_rows(threads, 2 if quick else 10) + sample_and_inception_rows(threads[-1], 2 if quick else 4),
    }


def run_child(emulation: str, quick: bool, threads: list[int]) -> dict:
    environment = {**os.environ, **EMULATIONS[emulation], "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    options = [*(["--quick"] if quick else []), "--threads", *map(str, threads)]
    command = [sys.executable, "-m", "bench.demo", "--child", *options]
    done = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench.demo: the {emulation} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_rows(runs: list[dict]) -> list[dict]:
    """Every row's figures as the median over the rounds (rows are in the same order in every round)."""
    rows = []
    for same in zip(*(run["rows"] for run in runs), strict=True):
        row = dict(same[0])
        for key in ("cpu_s", "wall_s"):
            row[key] = statistics.median(r[key] for r in same)
        row["per_s"] = 1 / row["wall_s"]
        rows.append(row)
    return rows


def markdown(report: dict) -> str:
    lines = [
        f"# Where `make demo`'s time goes on {report['cpu']}",
        "",
        f"CPU flags: {' '.join(report['cpu_flags'])}. Medians over {report['rounds']} rounds, the configurations "
        f"interleaved; machine load (1-minute average) {report['load_before']:.1f} before, "
        f"{report['load_after']:.1f} after. CPU s = user + sys per unit (barely moved by other jobs); per s = "
        "wall-clock rate (moved by them). avx2 = " + ", ".join(f"{k}={v}" for k, v in EMULATIONS["avx2"].items()),
        "",
        "| CPU | capability | bf16 / fp32 matmul speed | part | threads | TF32 | CPU s | per s | CPU s vs native |",
        "|---|---|---:|---|---:|---|---:|---:|---:|",
    ]
    native = {(r["part"], r["threads"], r["tf32"]): r["cpu_s"] for r in report["results"]["native"]["rows"]}
    for emulation, result in report["results"].items():
        probe = result["bf16_probe"]["bf16_over_fp32"]
        for row in result["rows"]:
            ratio = row["cpu_s"] / native[(row["part"], row["threads"], row["tf32"])]
            lines.append(
                f"| {emulation} | {result['capability']} | {probe:.3g}x | {row['part']} | {row['threads']} | "
                f"{'on' if row['tf32'] else 'off'} | {row['cpu_s']:.4f} | {row['per_s']:.2f} | {ratio:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def plot(report: dict):
    figure, axes = subplots(figsize=(8, 4))
    for offset, (emulation, result) in enumerate(report["results"].items()):
        rows = result["rows"]
        labels = [f"{r['part']} ({r['threads']}t{', TF32' if r['tf32'] else ''})" for r in rows]
        axes.barh([i + 0.4 * offset for i in range(len(rows))], [r["cpu_s"] for r in rows], 0.4, label=emulation)
    axes.set_yticks([i + 0.2 for i in range(len(labels))], labels, fontsize=7)
    axes.set_xscale("log")
    axes.set_xlabel("CPU seconds per unit")
    axes.legend()
    figure.tight_layout()
    return figure


def main() -> None:
    parser = benchmark_parser(__doc__, "one round, 1 thread, 2 timed units each", device=False)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, nargs="+", help="intra-op threads of the training rows (default: 1 and torch's default)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    threads = args.threads or ([1] if args.quick else sorted({1, torch.get_num_threads()}))
    if args.child:
        print(json.dumps(child(args.quick, threads)))
        return

    rounds = 1 if args.quick else args.rounds
    load_before = os.getloadavg()[0]
    runs = {name: [] for name in EMULATIONS}
    for _ in range(rounds):
        for name in EMULATIONS:
            runs[name].append(run_child(name, args.quick, threads))
    results = {
        name: {
            "capability": found[0]["capability"],
            "default_threads": found[0]["default_threads"],
            "bf16_probe": {
                key: statistics.median(f["bf16_probe"][key] for f in found) for key in found[0]["bf16_probe"]
            },
            "rows": median_rows(found),
        }
        for name, found in runs.items()
    }
    report = {
        "cpu": describe_device(torch.device("cpu")),
        "cpu_flags": cpu_vector_flags(),
        "emulations": EMULATIONS,
        "rounds": rounds,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "results": results,
    }
    stem = "demo-cpu-quick" if args.quick else "demo-cpu"
    save_results(args.out, stem, report, markdown(report), plot)
    print(markdown(report))


if __name__ == "__main__":
    main()
