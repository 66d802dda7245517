"""Benchmark: sampling throughput (images/s) and function evaluations (NFE) of every sampler on DiT-S/2-VCA
(DDPM-250, DDIM-50) and SiT-S/2-VCA (Euler-50, Heun-50, dopri5, SDE Euler-250), batch 32, fp32 and bf16.

The models have random weights; their zero-initialised layers (adaLN-Zero, final layer) are filled with small
noise first, otherwise the network is the zero function and an adaptive solver would stop after its minimum
number of steps. dopri5's NFE therefore describes this random field, not a trained model (SiT reports ~100-250
NFE for trained SiT-XL). bf16 runs the model under autocast; the sampler state stays fp32. No guidance (a
guided run doubles each batch). Each configuration is warmed up with a 2-step run and then timed once, whole.
Where bf16 GEMMs are not native (an AVX2-only CPU runs them at ~1 % of fp32) the bf16 rows are skipped and the
reason is recorded. --batch-size trades the batch for time on a CPU (the table states the batch used).

Writes bench/results/samplers-<device>[-quick].{json,md,png}. On the CPU run it as `make bench` does, with
MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 (glibc's default allocator returns large blocks
to the OS, and the first-touch page faults skew CPU timings by up to 2x). --quick is a smoke run (2-block
models on a 16x16 latent, batch 4, a tenth of the steps).

Usage: python -m bench.samplers [--quick] [--device cpu|cuda] [--batch-size B] [--out bench/results] [--threads N]
"""

import argparse
import os
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from torch import nn

import dit_vca
import sit_vca
from bench._harness import benchmark_parser, bf16_skip_reason, describe_device, save_results, subplots, synchronize
from samplers import SampleResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# (model, sampler, steps); steps None = adaptive.
RUNS = (
    ("DiT-S/2", "ddpm", 250),
    ("DiT-S/2", "ddim", 50),
    ("SiT-S/2", "euler", 50),
    ("SiT-S/2", "heun", 50),
    ("SiT-S/2", "dopri5", None),
    ("SiT-S/2", "sde-euler", 250),
)
SAMPLER_LABELS = {
    "ddpm": "DDPM",
    "ddim": "DDIM",
    "euler": "Euler",
    "heun": "Heun",
    "dopri5": "dopri5",
    "sde-euler": "SDE-Euler",
}
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
ATTENTIONS = ("vca", "mhsa")
ALLOCATOR_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")
FULL = {"batch": 32, "input_size": 32, "depth": None, "step_divisor": 1}  # 256 px images, 32x32x4 latents
QUICK = {"batch": 4, "input_size": 16, "depth": 2, "step_divisor": 10}
NUM_CLASSES = 1000


def build(name: str, attention: str, settings: dict, device: torch.device) -> tuple[nn.Module, object]:
    """A randomly initialised model and its objective (DiT: DDPM; SiT: linear-path velocity transport)."""
    family = dit_vca if name.startswith("DiT") else sit_vca
    depth = {} if settings["depth"] is None else {"depth": settings["depth"]}
    model = family.create_model(
        name, attention=attention, input_size=settings["input_size"], num_classes=NUM_CLASSES, **depth
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if not parameter.any():  # zero-initialised: give the random network a non-trivial output
                parameter.copy_(0.02 * torch.randn(parameter.shape, generator=generator))
    objective = dit_vca.create_diffusion() if family is dit_vca else sit_vca.create_transport()
    return model.to(device).eval(), objective


def time_sampler(
    model: nn.Module, objective, sampler: str, steps: int | None, batch: int, precision: str, device: torch.device
) -> tuple[float, SampleResult]:
    """Seconds for one whole sampling run of a batch, after a 2-step warm-up (Euler for an adaptive solver)."""
    autocast = (
        torch.autocast(device.type, dtype=PRECISIONS[precision]) if PRECISIONS[precision] is not None else nullcontext()
    )
    generator = torch.Generator(device).manual_seed(0)
    side = model.spec.input_size
    x_T = torch.randn(batch, model.spec.in_channels, side, side, generator=generator, device=device)
    labels = torch.randint(0, NUM_CLASSES, (batch,), generator=generator, device=device)
    with torch.no_grad(), autocast:
        objective.sample(model, x_T, labels, sampler="euler" if steps is None else sampler, steps=2)
        synchronize(device)
        start = time.perf_counter()
        result = objective.sample(model, x_T, labels, sampler=sampler, steps=steps)
        synchronize(device)
    return time.perf_counter() - start, result


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    settings = dict(QUICK if args.quick else FULL)
    if args.batch_size:
        settings["batch"] = args.batch_size
    precisions, notes = {name: PRECISIONS[name] for name in args.precisions}, []
    skip_bf16 = bf16_skip_reason(device)
    if skip_bf16 and "bf16" in precisions:
        del precisions["bf16"]
        notes.append(skip_bf16)
    rows, models = [], {}
    for name, sampler, steps in RUNS:
        steps = None if steps is None else max(2, steps // settings["step_divisor"])
        label = SAMPLER_LABELS[sampler] + ("" if steps is None else f"-{steps}")
        for attention in ATTENTIONS:
            if (name, attention) not in models:
                models[name, attention] = build(name, attention, settings, device)
            model, objective = models[name, attention]
            for precision in precisions:
                seconds, result = time_sampler(model, objective, sampler, steps, settings["batch"], precision, device)
                if not torch.isfinite(result.samples).all():
                    raise RuntimeError(f"{name} {attention} {sampler} {precision}: non-finite samples")
                rows.append(
                    {
                        "model": f"{name}-{attention.upper()}",
                        "name": name,
                        "attention": attention,
                        "sampler": sampler,
                        "label": label,
                        "steps": steps,
                        "precision": precision,
                        "nfe": result.nfe,
                        "seconds": seconds,
                        "images_per_s": settings["batch"] / seconds,
                        "ms_per_nfe": 1e3 * seconds / result.nfe,
                    }
                )
                print(
                    f"{name} {attention} {label:>14} {precision}: {result.nfe:4d} NFE, {seconds:8.2f} s, "
                    f"{settings['batch'] / seconds:8.3f} images/s",
                    flush=True,
                )
    return {
        "device": describe_device(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "quick": args.quick,
        "settings": settings,
        "allocator": {key: os.environ.get(key) for key in ALLOCATOR_ENV},
        "notes": notes,
        "rows": rows,
    }


def markdown(results: dict) -> str:
    settings = results["settings"]
    depth = "full depth" if settings["depth"] is None else f"depth {settings['depth']}"
    lines = [
        f"Sampler benchmark on {results['device']} (torch {results['torch']}; random-weight VCA and MHSA models, "
        f"{depth}, "
        f"{settings['input_size']}x{settings['input_size']}x4 latents, batch {settings['batch']}, no guidance; "
        f"allocator env {results['allocator']}).",
        "",
        "| model | sampler | precision | NFE | s / batch | images/s | ms / NFE | VCA / MHSA time per NFE |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    mhsa = {
        (row["name"], row["label"], row["precision"]): row["ms_per_nfe"]
        for row in results["rows"]
        if row["attention"] == "mhsa"
    }
    for row in results["rows"]:
        baseline = mhsa.get((row["name"], row["label"], row["precision"]))
        ratio = f"{row['ms_per_nfe'] / baseline:.2f}" if row["attention"] == "vca" and baseline else ""
        lines.append(
            f"| {row['model']} | {row['label']} | {row['precision']} | {row['nfe']} | {row['seconds']:.2f} "
            f"| {row['images_per_s']:.3f} | {row['ms_per_nfe']:.1f} | {ratio} |"
        )
    lines += [
        "",
        "dopri5's NFE is that of a random network's field; a trained model's differs.",
        *(f"{note}." for note in results["notes"]),
    ]
    return "\n".join(lines) + "\n"


def plot(results: dict) -> "Figure":
    labels = list(dict.fromkeys(row["label"] for row in results["rows"]))
    series = list(dict.fromkeys(f"{row['attention'].upper()} {row['precision']}" for row in results["rows"]))
    fig, ax = subplots(figsize=(9, 4))
    width = 0.8 / len(series)
    for i, name in enumerate(series):
        rate = {
            row["label"]: row["images_per_s"]
            for row in results["rows"]
            if f"{row['attention'].upper()} {row['precision']}" == name
        }
        ax.bar([j + i * width for j in range(len(labels))], [rate[label] for label in labels], width, label=name)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(labels))], labels)
    ax.set_ylabel("images / s")
    ax.set_title(f"Sampler throughput, {results['device']}, batch {results['settings']['batch']}")
    ax.legend()
    fig.tight_layout()
    return fig


def main() -> None:
    parser = benchmark_parser(__doc__, quick="smoke run: tiny models, batch 4, 1/10 of the steps")
    parser.add_argument("--batch-size", type=int, help="images per batch (default 32; 4 with --quick)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    parser.add_argument(
        "--precisions",
        nargs="+",
        choices=tuple(PRECISIONS),
        default=tuple(PRECISIONS),
        help="precisions to time (bf16 only where the device has native bf16)",
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    results = run(args)
    stem = f"samplers-{torch.device(args.device).type}" + ("-quick" if args.quick else "")
    save_results(args.out, stem, results, markdown(results), plot)
    print(markdown(results))


if __name__ == "__main__":
    main()
