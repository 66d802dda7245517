"""Training throughput (steps/s, images/s) of the real training step, VCA against MHSA.

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 python -m bench.train           # full matrix
    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 python -m bench.train --goal-rows --rounds 3
    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 python -m bench.train --options --rounds 3
    python -m bench.train --quick                                                         # smoke run, < 1 min

Cases: DiT-S/2 and SiT-S/2 (the experiment configs of configs/) at 256 px (32x32 latents) and 512 px
(64x64 latents); MHSA, VCA with its default contrast grid (half the token grid) and, at 512 px, VCA with a
fixed 8x8 grid; fp32 and bf16 autocast; from pre-extracted latents and with online encoding by a randomly
initialised VAE of the SD architecture (no download). Each step is `Trainer.train_step`: data loading,
(encoding,) forward, backward, clipping, AdamW and the EMA update. Batch 32 on GPU; on the CPU 8 by default,
online encoding for DiT-S/2 at 256 px only, and no bf16 rows where bf16 GEMMs are not native (the full GPU
matrix would take hours on two cores). --quick runs one case per code path with 2-block
models at batch 2 for 2 timed steps: it checks that the benchmark works; its numbers are not meaningful.
--goal-rows runs only the cases of the issue's goals (DiT-S/2, fp32, from latents: 256 px, 512 px with the
default and the 8x8 grid); --options runs DiT-S/2 at 256 px from latents, MHSA and VCA, plain and with each of
LightningDiT's block options that enter the attention and its presets: RoPE, QK-norm, model.blocks=lightning
(RMSNorm, SwiGLU, RoPE) and lightning-qknorm (all four), each VCA case against MHSA with the same options (VCA
applies QK-norm and RoPE inside its fused core). --rounds R measures every case R times in turn (interleaved,
so a machine shared with other jobs slows all cases alike) and keeps the median. Each case also reports the
activation memory one forward pass of the model saves for backward (saved-tensor hooks: a count, independent of
the machine).

Writes bench/results/train-<device>[-options].json, a Markdown table (.md) and a bar plot (.png).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from accelerate.state import AcceleratorState, GradientState
from diffusers import AutoencoderKL
from torch.utils.data import Dataset

from bench._harness import (
    benchmark_parser,
    bf16_skip_reason,
    cpu_vector_flags,
    describe_device,
    save_results,
    saved_activation_bytes,
    subplots,
    synchronize,
)
from bench.gpu_training import FIXED_GRID, TIME_GOALS
from generation.objective_builder import create_objective
from generation.vae import SD_VAE_ARCHITECTURE, latent_downsampling
from training.accelerator import create_accelerator
from training.build import TrainingParts, build_model, create_optimizer, export_description, objective_spec
from training.config import Config, load_config
from training.data import ShardedBatches
from training.ema import create_ema
from training.loop import Trainer, TrainerState
from training.run import RunDirectory

ROOT = Path(__file__).resolve().parents[1]
LATENT_CHANNELS = SD_VAE_ARCHITECTURE["latent_channels"]
DOWNSAMPLING = latent_downsampling(SD_VAE_ARCHITECTURE)
QUICK_DEPTH = 2
# Block options of --options (Case.options): config overrides, by the name a case's label carries.
BLOCK_OPTIONS = {
    "rope": ["model.rope=true"],
    "qk-norm": ["model.qk_norm=true"],
    "lightning": ["model.blocks=lightning"],
    "lightning-qknorm": ["model.blocks=lightning-qknorm"],
}


@dataclass(frozen=True)
class Case:
    model: str  # "DiT-S/2" or "SiT-S/2"
    image_size: int  # pixels; latents are image_size / 8
    attention: str  # "mhsa" or "vca"
    contrast_grid: int | None
    precision: str  # "fp32" or "bf16"
    source: str  # "latents" or "images" (online VAE encoding)
    compiled: bool = False  # the model under torch.compile (train.compile=true)
    options: str = ""  # block options: a key of BLOCK_OPTIONS, or "" for DiT's

    @property
    def label(self) -> str:
        grid = f" grid {self.contrast_grid}" if self.contrast_grid else ""
        compiled = " compiled" if self.compiled else ""
        options = f" {self.options}" if self.options else ""
        return (
            f"{self.model} {self.image_size}px {self.attention}{grid}{options} {self.precision} {self.source}{compiled}"
        )


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


def goal_cases(precision: str = "fp32") -> list[Case]:
    """The cases of TIME_GOALS and their MHSA baselines (the goals are written for fp32)."""
    sizes = sorted({size for size, _ in TIME_GOALS})
    return [
        Case("DiT-S/2", size, attention, grid, precision, "latents")
        for size in sizes
        for attention, grid in [("mhsa", None)] + [("vca", g) for s, g in TIME_GOALS if s == size]
    ]


def option_cases(precision: str = "fp32") -> list[Case]:
    """DiT-S/2 at 256 px from latents, MHSA and VCA, plain and with each of BLOCK_OPTIONS."""
    return [
        Case("DiT-S/2", 256, attention, None, precision, "latents", options=options)
        for options in ("", *BLOCK_OPTIONS)
        for attention in ("mhsa", "vca")
    ]


def quick_cases() -> list[Case]:
    """One case per code path (MHSA, VCA, fixed grid, SiT, bf16, online encoding), small enough for seconds."""
    return [
        Case("DiT-S/2", 256, "mhsa", None, "fp32", "latents"),
        Case("DiT-S/2", 256, "vca", None, "fp32", "latents"),
        Case("SiT-S/2", 256, "vca", FIXED_GRID, "bf16", "latents"),
        Case("DiT-S/2", 64, "vca", None, "fp32", "images"),
        Case("DiT-S/2", 256, "vca", None, "fp32", "latents", options="lightning-qknorm"),
    ]


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
    overrides = [
        *extra,
        f"train.global_batch_size={batch_size}",
        f"train.mixed_precision={case.precision}",
        f"data.image_size={case.image_size}",
        "log.trackers=[]",
        f"run.dir={run_dir}",
        f"train.cpu={not torch.cuda.is_available()}",
    ]
    if case.contrast_grid:
        overrides.append(f"model.vca.contrast_grid={case.contrast_grid}")
    if case.compiled:
        overrides.append("train.compile=true")
    overrides += BLOCK_OPTIONS.get(case.options, [])
    return load_config(ROOT / "configs" / f"{family}-s2-{case.attention}.yaml", overrides)


def measure(case: Case, batch_size: int, warmup: int, steps: int, extra: list[str], count_memory: bool) -> dict:
    """Seconds per optimiser step of `case` (config overrides `extra`), after `warmup` untimed steps, and (with
    count_memory) the MiB of activations one forward pass of the model saves for backward."""
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
        if config.train.compile:
            model.compile(fullgraph=True)  # compiled on the first (warm-up) step, as in training.build
        ema = create_ema(model, config.train).to(device)
        optimizer, scheduler = create_optimizer(model, config, device)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        batches = ShardedBatches(dataset, batch_size, 0, 1, seed=0, num_workers=0)
        parts = TrainingParts(
            model,
            ema,
            create_objective(objective_spec(config)),
            optimizer,
            scheduler,
            batches,
            encoder=vae,
            preview=None,
            export=export_description(config, model),  # the latents' normalisation for online encoding
            fid_extractor=None,
        )  # no grids, checkpoints, FID
        trainer = Trainer(accelerator, config, RunDirectory(Path(run_dir)), parts, TrainerState())
        stream = batches.stream()
        first_started = time.perf_counter()
        trainer.train_step(stream)  # compiles forward and backward when compiled
        synchronize(device)
        first_step = time.perf_counter() - first_started
        for _ in range(warmup - 1):
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
        saved = saved_forward_mib(model, batch_size, latent_side, case.precision, device) if count_memory else None
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return {
        **asdict(case),
        "label": case.label,
        "batch_size": batch_size,
        "seconds_per_step": seconds,
        "steps_per_s": 1 / seconds,
        "images_per_s": batch_size / seconds,
        "peak_memory_gib": peak,
        "saved_mib": saved,
        "first_step_seconds": first_step,
        "compile_seconds": first_step - seconds if case.compiled else None,
    }


def saved_forward_mib(
    model: torch.nn.Module, batch_size: int, latent_side: int, precision: str, device: torch.device
) -> float:
    """MiB of activations saved for backward by one forward pass of `model` on a batch of random latents."""
    latents = torch.randn(batch_size, LATENT_CHANNELS, latent_side, latent_side, device=device)
    timesteps = torch.randint(0, 1000, (batch_size,), device=device)
    labels = torch.randint(0, 1000, (batch_size,), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    with autocast:
        forward = lambda: model(latents, timesteps, labels)  # noqa: E731
        return saved_activation_bytes(forward, [*model.parameters(), *model.buffers()]) / 2**20


def median_over_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Per case, the median over the rounds of the seconds per step (the memory count is the first round's)."""
    results = []
    for measured in zip(*rounds):
        seconds = statistics.median(r["seconds_per_step"] for r in measured)
        results.append(
            {
                **measured[0],
                "seconds_per_step": seconds,
                "steps_per_s": 1 / seconds,
                "images_per_s": measured[0]["batch_size"] / seconds,
                "rounds_seconds_per_step": [r["seconds_per_step"] for r in measured],
            }
        )
    return results


def vca_speedups(results: list[dict]) -> list[dict]:
    """images/s of each VCA case over the MHSA case with the same model, size, precision and source, and the
    inverse, VCA's time per step over MHSA's (the issue's goals are written in it)."""

    def key(r):
        return (
            r["model"],
            r["image_size"],
            r["precision"],
            r["source"],
            r.get("compiled", False),
            r.get("options", ""),
        )

    mhsa = {key(r): r for r in results if r["attention"] == "mhsa"}
    return [
        {
            "label": r["label"],
            "speedup_over_mhsa": r["images_per_s"] / mhsa[key(r)]["images_per_s"],
            "time_ratio": r["seconds_per_step"] / mhsa[key(r)]["seconds_per_step"],
            "saved_ratio": (
                r["saved_mib"] / mhsa[key(r)]["saved_mib"]
                if r["saved_mib"] is not None and mhsa[key(r)]["saved_mib"]
                else None
            ),
        }
        for r in results
        if r["attention"] == "vca" and key(r) in mhsa
    ]


def goal_verdicts(speedups: list[dict]) -> list[dict]:
    """Met or missed, with the measured ratio, for every goal case present in `speedups` (vca_speedups):
    each TIME_GOALS case in fp32 and bf16, eager and compiled."""
    ratios = {s["label"]: s["time_ratio"] for s in speedups}
    verdicts = []
    for (size, grid), limit in TIME_GOALS.items():
        for precision in ("fp32", "bf16"):
            for compiled in (False, True):
                label = Case("DiT-S/2", size, "vca", grid, precision, "latents", compiled).label
                if label in ratios:
                    ratio = ratios[label]
                    verdict = "met" if ratio <= limit else f"missed by {ratio / limit:.2f}x"
                    verdicts.append({"label": label, "ratio": ratio, "limit": limit, "verdict": verdict})
    return verdicts


def goal_lines(report: dict) -> list[str]:
    return [
        f"- {v['label']}: VCA/MHSA time = {v['ratio']:.2f} (goal <= {v['limit']:.2f}, {v['verdict']})"
        for v in goal_verdicts(report["vca_speedups"])
    ]


def markdown(report: dict) -> str:
    quick = " (--quick: smoke run, not meaningful)" if report["quick"] else ""
    rounds = f", median of {report['rounds']} interleaved rounds" if report["rounds"] > 1 else ""
    lines = [
        f"# Training throughput on {report['device']} ({' '.join(report['cpu_flags']) or 'no AVX'})",
        "",
        f"batch {report['batch_size']}, {report['steps']} timed steps after {report['warmup']} warm-up steps"
        f"{rounds}{quick}; allocator: {report['allocator']}; saved MiB = activations one forward pass saves "
        f"for backward; compile s = the first step's time minus a steady step's (torch.compile, inductor, "
        f"default settings), apart from the timed steps",
        "",
        "| case | steps/s | images/s | VCA / MHSA speed | VCA / MHSA time | saved MiB | VCA / MHSA saved "
        "| peak GiB | compile s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    speedups = {s["label"]: s for s in report["vca_speedups"]}
    for r in report["results"]:
        s = speedups.get(r["label"])
        speed = f"{s['speedup_over_mhsa']:.2f}x" if s else ""
        time_ratio = f"{s['time_ratio']:.2f}" if s else ""
        saved_ratio = f"{s['saved_ratio']:.2f}" if s and s["saved_ratio"] is not None else ""
        saved = f"{r['saved_mib']:.0f}" if r["saved_mib"] is not None else ""
        memory = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] is not None else ""
        compile_time = f"{r['compile_seconds']:.1f}" if r.get("compile_seconds") is not None else ""
        lines.append(
            f"| {r['label']} | {r['steps_per_s']:.3f} | {r['images_per_s']:.2f} | {speed} | {time_ratio} "
            f"| {saved} | {saved_ratio} | {memory} | {compile_time} |"
        )
    goals = goal_lines(report)
    lines += [""] + ["Goals (VCA / MHSA time per training step):"] + goals if goals else []
    lines += [""] + [f"{note}." for note in report["notes"]]
    return "\n".join(lines) + "\n"


def plot(report: dict):
    """Bar chart of images/s per case (VCA orange, MHSA blue)."""
    results = report["results"]
    figure, axis = subplots(figsize=(9, 0.35 * len(results) + 1.2))
    axis.barh(
        [r["label"] for r in results],
        [r["images_per_s"] for r in results],
        color=["tab:orange" if r["attention"] == "vca" else "tab:blue" for r in results],
    )
    axis.invert_yaxis()
    axis.set_xlabel("images / s (training)")
    axis.set_title(f"Training throughput, {report['device']}, batch {report['batch_size']}")
    figure.tight_layout()
    return figure


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__, quick="a few cases, tiny batch: checks the script runs", device=False)
    parser.add_argument("--batch-size", type=int, help="default: 32 on GPU, 8 on CPU (2 with --quick)")
    parser.add_argument("--steps", type=int, help="timed steps per case (default 20 GPU, 3 CPU, 2 quick)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 5 GPU, 1 CPU/quick)")
    parser.add_argument("--goal-rows", action="store_true", help="only the cases of the issue's time goals")
    parser.add_argument(
        "--options", action="store_true", help="DiT-S/2 256 px, MHSA and VCA, plain and with each block option"
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="precision of the --goal-rows and --options cases (the goals are written for fp32)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time every case under torch.compile (the warm-up steps include compiling)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="measure every case this many times in turn; median")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads for the run (default: torch's)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: expected at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
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
    online = {(model, size) for model in ("DiT-S/2", "SiT-S/2") for size in (256, 512)} if gpu else {("DiT-S/2", 256)}
    if not gpu:
        notes.append(
            "online encoding timed for DiT-S/2 at 256 px only: the SD-VAE encoder (0.27 TFLOP per 256 px "
            "image, 1.12 at 512 px) dominates such a step on the CPU, and SiT-S/2's network costs the same"
        )
    if args.quick:
        cases = [case for case in quick_cases() if case.precision in precisions]
    elif args.goal_rows:
        cases = goal_cases(args.precision)
    elif args.options:
        cases = option_cases(args.precision)
    else:
        cases = all_cases(precisions, online)
    if args.compile:
        cases += [replace(case, compiled=True) for case in cases]
    rounds = []
    extra = [f"model.depth={QUICK_DEPTH}"] if args.quick else []
    for round_index in range(args.rounds):
        rounds.append([])
        for case in cases:
            rounds[-1].append(measure(case, batch_size, warmup, steps, extra, count_memory=round_index == 0))
            r = rounds[-1][-1]
            print(
                f"round {round_index + 1}: {case.label:45s} {r['steps_per_s']:8.3f} steps/s "
                f"{r['images_per_s']:9.2f} images/s",
                flush=True,
            )
    results = median_over_rounds(rounds)
    allocator = "glibc, MALLOC_MMAP_MAX_=0" if os.environ.get("MALLOC_MMAP_MAX_") == "0" else "glibc defaults"
    report = {
        "device": describe_device(device),
        "cpu_flags": cpu_vector_flags(),
        "quick": args.quick,
        "overrides": extra,
        "batch_size": batch_size,
        "steps": steps,
        "warmup": warmup,
        "rounds": args.rounds,
        "allocator": allocator,
        "torch": torch.__version__,
        "notes": notes,
        "results": results,
        "vca_speedups": vca_speedups(results),
    }
    suffix = ("-options" if args.options and not args.quick else "") + ("-quick" if args.quick else "")
    save_results(args.out, f"train-{device.type}{suffix}", report, markdown(report), plot)
    print(markdown(report))


if __name__ == "__main__":
    main()
