"""Training throughput (steps/s, images/s) of the real training step, VCA against MHSA.

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 python bench/train.py           # full matrix
    python bench/train.py --quick                                                         # smoke run, < 1 min

Cases: DiT-S/2 and SiT-S/2 (the experiment configs of configs/) at 256 px (32x32 latents) and 512 px
(64x64 latents); MHSA, VCA with its default contrast grid (half the token grid) and, at 512 px, VCA with a
fixed 8x8 grid; fp32 and bf16 autocast; from pre-extracted latents and with online encoding by a randomly
initialised VAE of the SD architecture (no download). Each step is `Trainer.train_step`: data loading,
(encoding,) forward, backward, clipping, AdamW and the EMA update. Batch 32 on GPU; on the CPU 8 by default,
online encoding for DiT-S/2 at 256 px only, and no bf16 rows where bf16 GEMMs are not native (the full GPU
matrix would take hours on two cores). --quick runs one case per code path with 2-block
models at batch 2 for 2 timed steps: it checks that the benchmark works; its numbers are not meaningful.

Writes bench/results/train-<device>.json, a Markdown table (.md) and a bar plot (.png).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _harness import bf16_skip_reason, describe_device, plt, save_results, synchronize  # noqa: E402  (bench/ is on sys.path)
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from diffusers import AutoencoderKL  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from training.build import build_model, create_objective, objective_spec  # noqa: E402
from training.config import Config, load_config  # noqa: E402
from training.data import ShardedBatches  # noqa: E402
from training.ema import create_ema  # noqa: E402
from training.loop import Trainer, TrainerState, create_optimizer  # noqa: E402
from training.run import RunDirectory, create_accelerator  # noqa: E402
from generation.vae import SD_VAE_ARCHITECTURE, latent_downsampling  # noqa: E402

RESULTS = ROOT / "bench" / "results"
LATENT_CHANNELS = SD_VAE_ARCHITECTURE["latent_channels"]
DOWNSAMPLING = latent_downsampling(SD_VAE_ARCHITECTURE)
FIXED_GRID = 8
QUICK_DEPTH = 2


@dataclass(frozen=True)
class Case:
    model: str              # "DiT-S/2" or "SiT-S/2"
    image_size: int         # pixels; latents are image_size / 8
    attention: str          # "mhsa" or "vca"
    contrast_grid: Optional[int]
    precision: str          # "fp32" or "bf16"
    source: str             # "latents" or "images" (online VAE encoding)

    @property
    def label(self) -> str:
        grid = f" grid {self.contrast_grid}" if self.contrast_grid else ""
        return f"{self.model} {self.image_size}px {self.attention}{grid} {self.precision} {self.source}"


def all_cases(precisions: tuple[str, ...], online: set[tuple[str, int]]) -> list[Case]:
    """Every model x size x attention x precision from latents, and from images for the (model, size) pairs
    in `online`."""
    cases = []
    for model in ("DiT-S/2", "SiT-S/2"):
        for size in (256, 512):
            attentions = [("mhsa", None), ("vca", None)] + ([("vca", FIXED_GRID)] if size == 512 else [])
            sources = ("latents", "images") if (model, size) in online else ("latents",)
            for attention, grid in attentions:
                for precision in precisions:
                    for source in sources:
                        cases.append(Case(model, size, attention, grid, precision, source))
    return cases


def quick_cases() -> list[Case]:
    """One case per code path (MHSA, VCA, fixed grid, SiT, bf16, online encoding), small enough for seconds."""
    return [Case("DiT-S/2", 256, "mhsa", None, "fp32", "latents"),
            Case("DiT-S/2", 256, "vca", None, "fp32", "latents"),
            Case("SiT-S/2", 256, "vca", FIXED_GRID, "bf16", "latents"),
            Case("DiT-S/2", 64, "vca", None, "fp32", "images")]


class RandomExamples(Dataset):
    """A fixed pool of random inputs (latents or images in [-1, 1]) with labels, cycled by index."""

    def __init__(self, shape: tuple[int, ...], pool: int, num_classes: int = 1000) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(pool, *shape, generator=generator).clamp(-1, 1)
        self.num_classes = num_classes

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int):
        return self.inputs[index % len(self.inputs)], index % self.num_classes


def case_config(case: Case, batch_size: int, run_dir: Path, extra: list[str]) -> Config:
    family = case.model.split("-")[0].lower()
    overrides = [*extra, f"train.global_batch_size={batch_size}", f"train.mixed_precision={case.precision}",
                 f"data.image_size={case.image_size}", "log.trackers=[]", f"run.dir={run_dir}",
                 f"train.cpu={not torch.cuda.is_available()}"]
    if case.contrast_grid:
        overrides.append(f"model.contrast_grid={case.contrast_grid}")
    return load_config(ROOT / "configs" / f"{family}-s2-{case.attention}.yaml", overrides)


def measure(case: Case, batch_size: int, warmup: int, steps: int, extra: list[str]) -> dict:
    """Seconds per optimiser step of `case` (config overrides `extra`), after `warmup` untimed steps."""
    with tempfile.TemporaryDirectory() as run_dir:
        config = case_config(case, batch_size, Path(run_dir), extra)
        accelerator = create_accelerator(config, RunDirectory(Path(run_dir)))
        device = accelerator.device
        vae = None
        latent_side = case.image_size // DOWNSAMPLING
        if case.source == "images":
            vae = AutoencoderKL(**SD_VAE_ARCHITECTURE).eval().requires_grad_(False).to(device)
            dataset = RandomExamples((3, case.image_size, case.image_size), pool=batch_size)
        else:
            dataset = RandomExamples((LATENT_CHANNELS, latent_side, latent_side), pool=batch_size)
        model = build_model(config, LATENT_CHANNELS, latent_side)
        ema = create_ema(model, config.train).to(device)
        optimizer, scheduler = create_optimizer(model, config)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        batches = ShardedBatches(dataset, batch_size, 0, 1, seed=0, num_workers=0)
        trainer = Trainer(accelerator, config, RunDirectory(Path(run_dir)), model, ema,
                          create_objective(objective_spec(config)), optimizer, scheduler, batches, vae,
                          sampler=None, export={}, state=TrainerState())
        stream = batches.stream()
        for _ in range(warmup):
            trainer.train_step(stream)
        synchronize(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train_step(stream)
        synchronize(device)
        seconds = (time.perf_counter() - start) / steps
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return {**asdict(case), "label": case.label, "batch_size": batch_size, "steps_per_s": 1 / seconds,
            "images_per_s": batch_size / seconds, "peak_memory_gib": peak}


def vca_speedups(results: list[dict]) -> list[dict]:
    """images/s of each VCA case over the MHSA case with the same model, size, precision and source."""
    key = lambda r: (r["model"], r["image_size"], r["precision"], r["source"])
    mhsa = {key(r): r["images_per_s"] for r in results if r["attention"] == "mhsa"}
    return [{"label": r["label"], "speedup_over_mhsa": r["images_per_s"] / mhsa[key(r)]}
            for r in results if r["attention"] == "vca" and key(r) in mhsa]


def markdown(report: dict) -> str:
    quick = " (--quick: smoke run, not meaningful)" if report["quick"] else ""
    lines = [f"# Training throughput on {report['device']}", "",
             f"batch {report['batch_size']}, {report['steps']} timed steps after {report['warmup']} warm-up steps"
             f"{quick}; allocator: {report['allocator']}", "",
             "| case | steps/s | images/s | VCA / MHSA | peak GiB |", "|---|---:|---:|---:|---:|"]
    speedups = {s["label"]: s["speedup_over_mhsa"] for s in report["vca_speedups"]}
    for r in report["results"]:
        ratio = f"{speedups[r['label']]:.2f}x" if r["label"] in speedups else ""
        memory = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] is not None else ""
        lines.append(f"| {r['label']} | {r['steps_per_s']:.3f} | {r['images_per_s']:.2f} | {ratio} | {memory} |")
    lines += [""] + [f"{note}." for note in report["notes"]]
    return "\n".join(lines) + "\n"


def plot(report: dict):
    """Bar chart of images/s per case (VCA orange, MHSA blue)."""
    results = report["results"]
    figure, axis = plt.subplots(figsize=(9, 0.35 * len(results) + 1.2))
    axis.barh([r["label"] for r in results], [r["images_per_s"] for r in results],
              color=["tab:orange" if r["attention"] == "vca" else "tab:blue" for r in results])
    axis.invert_yaxis()
    axis.set_xlabel("images / s (training)")
    axis.set_title(f"Training throughput, {report['device']}, batch {report['batch_size']}")
    figure.tight_layout()
    return figure


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few cases, tiny batch: checks the script runs")
    parser.add_argument("--batch-size", type=int, help="default: 32 on GPU, 8 on CPU (2 with --quick)")
    parser.add_argument("--steps", type=int, help="timed steps per case (default 20 GPU, 3 CPU, 2 quick)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 5 GPU, 1 CPU/quick)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON, table and plot")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    batch_size = args.batch_size or (2 if args.quick else 32 if gpu else 8)
    steps = args.steps or (2 if args.quick else 20 if gpu else 3)
    warmup = args.warmup or (5 if gpu and not args.quick else 1)
    notes, precisions = [], ("fp32", "bf16")
    skip_bf16 = bf16_skip_reason(device)
    if skip_bf16:
        notes.append(skip_bf16)
        precisions = ("fp32",)
    online = {(model, size) for model in ("DiT-S/2", "SiT-S/2") for size in (256, 512)} if gpu \
        else {("DiT-S/2", 256)}
    if not gpu:
        notes.append("online encoding timed for DiT-S/2 at 256 px only: the SD-VAE encoder (0.27 TFLOP per 256 px "
                     "image, 1.12 at 512 px) dominates such a step on the CPU, and SiT-S/2's network costs the same")
    cases = [case for case in quick_cases() if case.precision in precisions] if args.quick \
        else all_cases(precisions, online)
    results = []
    extra = [f"model.depth={QUICK_DEPTH}"] if args.quick else []
    for case in cases:
        results.append(measure(case, batch_size, warmup, steps, extra))
        print(f"{case.label:45s} {results[-1]['steps_per_s']:8.3f} steps/s {results[-1]['images_per_s']:9.2f} images/s",
              flush=True)
    allocator = "glibc, MALLOC_MMAP_MAX_=0" if os.environ.get("MALLOC_MMAP_MAX_") == "0" else "glibc defaults"
    report = {"device": describe_device(device), "quick": args.quick, "overrides": extra, "batch_size": batch_size,
              "steps": steps, "warmup": warmup, "allocator": allocator, "torch": torch.__version__, "notes": notes,
              "results": results, "vca_speedups": vca_speedups(results)}
    save_results(args.out, f"train-{device.type}{'-quick' if args.quick else ''}", report, markdown(report), plot)
    print(markdown(report))

if __name__ == "__main__":
    main()
