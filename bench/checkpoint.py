"""How long a checkpoint takes to write: DiT-XL/2's model, EMA and AdamW state, with the writers training.checkpoint
uses (safetensors for the weights and the EMA, torch.save for the optimiser, as Accelerate's save_state does), each
file flushed to disk (fsync). The figure sizes a scheduler's grace time: the stop after a signal must be on disk
before SIGKILL (Slurm's KillWait, 30 s by default; docs/training.md).

    python -m bench.checkpoint [--quick] [--folder /shared/results/tmp]   # --folder: the disk to measure
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench._harness import benchmark_parser, describe_device, save_results, subplots


def timed_write(write, path: Path) -> float:
    """Seconds to write `path` with `write(path)` and flush it to the disk."""
    started = time.perf_counter()
    write(path)
    with path.open("rb") as file:
        os.fsync(file.fileno())
    return time.perf_counter() - started


def measure(model_name: str, folder: Path) -> dict:
    import dit_vca

    model = dit_vca.create_model(model_name)
    weights = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    ema = {name: tensor.clone() for name, tensor in weights.items()}
    optimizer = torch.optim.AdamW(model.parameters())
    for parameter in model.parameters():  # the state AdamW holds after its first step
        optimizer.state[parameter] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.zeros_like(parameter),
            "exp_avg_sq": torch.zeros_like(parameter),
        }
    state = optimizer.state_dict()
    seconds = {
        "model": timed_write(lambda path: save_file(weights, path), folder / "model.safetensors"),
        "ema": timed_write(lambda path: save_file(ema, path), folder / "ema.safetensors"),
        "optimizer": timed_write(lambda path: torch.save(state, path), folder / "optimizer.bin"),
    }
    sizes = {
        part: (folder / name).stat().st_size
        for part, name in (("model", "model.safetensors"), ("ema", "ema.safetensors"), ("optimizer", "optimizer.bin"))
    }
    total_bytes, total_seconds = sum(sizes.values()), sum(seconds.values())
    return {
        "model_name": model_name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": seconds,
        "bytes": sizes,
        "total_seconds": total_seconds,
        "total_gb": total_bytes / 1e9,
        "gb_per_s": total_bytes / 1e9 / total_seconds,
    }


def main() -> None:
    parser = benchmark_parser(__doc__, quick="DiT-S/2 instead of DiT-XL/2", device=False)
    parser.add_argument("--folder", type=Path, help="where to write (default: a temporary folder under /tmp)")
    args = parser.parse_args()
    model_name = "DiT-S/2" if args.quick else "DiT-XL/2"
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        result = measure(model_name, Path(folder))
    result["device"] = describe_device(torch.device("cpu"))
    table = (
        "| model | parameters | model s | EMA s | optimizer s | total s | GB | GB/s |\n"
        "|---|---|---|---|---|---|---|---|\n"
        f"| {model_name} | {result['parameters'] / 1e6:.0f} M | {result['seconds']['model']:.1f} | "
        f"{result['seconds']['ema']:.1f} | {result['seconds']['optimizer']:.1f} | {result['total_seconds']:.1f} | "
        f"{result['total_gb']:.1f} | {result['gb_per_s']:.2f} |\n\n{result['device']}\n"
    )

    def plot(results: dict):
        figure, axis = subplots(figsize=(5, 3))
        axis.bar(list(results["seconds"]), list(results["seconds"].values()))
        axis.set_ylabel("seconds to write and fsync")
        axis.set_title(f"{model_name} checkpoint, {results['total_gb']:.1f} GB")
        return figure

    stem = "checkpoint-quick" if args.quick else "checkpoint"
    save_results(args.out, stem, result, table, plot)
    print(table)


if __name__ == "__main__":
    main()
