"""Tiny training runs the tests share: the digits config and the override lists that make a run take seconds,
train.py's main run in the test process, and what reads a finished run back (its logs, its checkpoints, its FID,
its start-up summary)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "configs" / "digits.yaml"

# A 1-block model of width 32, short warm-up, small previews; the config's trackers (TensorBoard) kept.
TINY_WITH_TENSORBOARD = [
    "model.hidden_size=32",
    "model.depth=1",
    "model.num_heads=2",
    "train.global_batch_size=64",
    "train.warmup_steps=5",
    "log.sample_count=8",
    "log.sample_steps=5",
]
TINY = [*TINY_WITH_TENSORBOARD, "log.trackers=[]"]  # the same, logging to metrics.jsonl only

# A 2-block model aligned to an encoder's patch features at its first block (REPA), no previews, no trackers.
TINY_REPA = [
    "model.hidden_size=32",
    "model.depth=2",
    "model.num_heads=2",
    "train.global_batch_size=32",
    "train.warmup_steps=2",
    "log.sample_every=0",
    "log.trackers=[]",
    "train.repa.depth=1",
    "train.repa.input_size=8",
    "train.repa.projector_dim=16",
]

# Two processes, 2 accumulation steps, 8 steps with checkpoints at 4 and 8: the run stopped and resumed.
TWO_PROCESSES_8_STEPS = [
    "--config",
    str(DIGITS),
    *TINY,
    "train.cpu=true",
    "train.grad_accum_steps=2",
    "train.max_steps=8",
    "log.every=2",
    "log.checkpoint_every=4",
    "log.sample_every=0",
]

# 20 steps over two processes with 2 accumulation steps: micro-batches of 16, 56 per process per epoch. Overrides
# only: the caller names the config (and adds fid_monitoring's).
TWO_PROCESSES_20_STEPS = TINY_WITH_TENSORBOARD + [
    "train.cpu=true",
    "train.grad_accum_steps=2",
    "train.max_steps=20",
    "log.every=5",
    "log.checkpoint_every=10",
    "log.sample_every=10",
]
FID_SAMPLES = 6  # fid_monitoring's samples: 3 per process


def run_train(*arguments: str) -> None:
    """train.py's main in this process; Accelerate's process-wide state is reset after the run."""
    import importlib.util

    from accelerate.state import AcceleratorState, GradientState

    spec = importlib.util.spec_from_file_location("train_in_test", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.main(list(arguments))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def latent_run(folder: Path) -> list[str]:
    """train.py arguments for a tiny run on latent_shards(folder) whose VAE name loads nothing."""
    return [
        "--config",
        str(DIGITS),
        *TINY,
        "data.source=latents",
        f"data.latents={folder}",
        "data.image_size=32",
        "data.num_classes=3",
        "vae.name=not-loaded/anywhere",
        "vae.scale=0.5",
        "train.global_batch_size=4",
    ]


def fid_monitoring(folder: Path) -> list[str]:
    """FID of the EMA samples at the last step against a stand-in reference (mu = 0, sigma = I) with the bundled
    Inception weights: enough to compare the value logged by 2 processes with the one of all samples."""
    import numpy as np

    reference = folder / "reference.npz"
    np.savez(reference, mu=np.zeros(2048), sigma=np.eye(2048))
    return [
        "log.fid_every=20",
        f"log.fid_samples={FID_SAMPLES}",
        f"log.fid_reference={reference}",
        "log.fid_inception=bundled",
    ]


TIMING = ("steps_per_s", "images_per_s")  # the only fields of a metrics line that depend on the clock


def logged(run_dir: Path) -> list[dict]:
    """metrics.jsonl without its timings."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{key: value for key, value in line.items() if key not in TIMING} for line in lines]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_checkpoint(ours: Path, theirs: Path) -> None:
    """Byte for byte: weights, EMA, optimiser and scheduler state, trainer state."""
    for name in ("model.safetensors", "export/ema.safetensors", "optimizer.bin", "scheduler.bin", "trainer_state.json"):
        if name.endswith(".safetensors"):  # the header records no time, but compare tensors for a clear message
            a, b = load_file(ours / name), load_file(theirs / name)
            assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a), name
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


def assert_fid_is_that_of_all_samples(run_dir: Path, extractor) -> None:
    """The FID a run of `fid_monitoring` logged at step 20 is the FID of all its samples drawn by one process
    (Inception: `extractor`, the bundled weights)."""
    from fid import fid_from_batches
    from generation import ImageGenerator, read_export
    from generation.sample_plan import sample_seeds

    [logged] = [json.loads(line) for line in (run_dir / "fid.jsonl").read_text().splitlines()]
    assert logged["step"] == 20 and logged["samples"] == FID_SAMPLES
    # One process, all samples, the same (label, seed) per index and the preview's sampler (digits.yaml: DDIM;
    # log.sample_steps=5 in TINY_WITH_TENSORBOARD).
    generator = ImageGenerator.from_export(read_export(run_dir))
    indices = list(range(FID_SAMPLES))
    images = generator.generate([i % 10 for i in indices], sample_seeds(0, indices), sampler="ddim", steps=5)
    expected = fid_from_batches([images], run_dir.parent / "reference.npz", extractor)
    # Per-sample noise makes the images independent of the split; Inception's float32 kernels round differently
    # per batch size (~1e-6 relative). Half of the samples alone gives a FID several percent away.
    assert logged["fid"] == pytest.approx(expected, rel=1e-4)


def summary_rows(text: str) -> dict[str, str]:
    """{key: value} of the summary's indented rows (keys and values are separated by two spaces or more)."""
    lines = text[text.index("train.py start-up\n") :].splitlines()[1:]
    rows = {}
    for line in lines:
        if not line.startswith("  "):
            break
        key, _, value = line.strip().partition("  ")
        rows[key] = value.strip()
    return rows
