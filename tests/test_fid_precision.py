"""FID stays in fp32 whatever encloses it: Inception under a bf16 autocast context gives the fp32 features, and
the FID that a bf16 training run logs is the FID that `python -m fid` computes from the same samples."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate.state import AcceleratorState, GradientState

from fid import Gaussian, StatisticsFile, save_statistics
from fid.__main__ import main as fid_main
from generation import ImageGenerator, read_export
from generation.images import to_uint8
from generation.sample_plan import sample_seeds
from training.builtin_data import DigitsDataset

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "configs" / "digits.yaml"
FID_SAMPLES = 8


def test_inception_features_under_bf16_autocast_equal_fp32(bundled_inception):
    images = np.random.default_rng(0).integers(0, 256, (4, 64, 64, 3), dtype=np.uint8)
    expected = bundled_inception(images)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        features = bundled_inception(images)
    for name in ("pool", "spatial"):
        got, want = getattr(features, name), getattr(expected, name)
        assert got.dtype == torch.float32
        # The same fp32 kernels on the same batch: equal up to 1e-5 relative (bf16 convolutions: ~1.6e-2).
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), name


def test_fid_logged_by_a_bf16_training_run_equals_python_m_fid(bundled_inception, tmp_path):
    """train.py with mixed_precision=bf16 logs FID of its EMA samples; the same samples (regenerated from the
    export under the same bf16 autocast, the same (label, seed) pairs, sampler and batch) written to an .npz
    and scored by `python -m fid` against the same reference give the same FID."""
    real = to_uint8(DigitsDataset().images[:FID_SAMPLES])
    reference_features = bundled_inception(real).pool.double().numpy()
    reference = tmp_path / "reference.npz"
    save_statistics(
        reference, StatisticsFile(pool=Gaussian(reference_features.mean(0), np.cov(reference_features, rowvar=False)))
    )
    run_dir = tmp_path / "run"
    spec = importlib.util.spec_from_file_location("train_for_fid", ROOT / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    try:
        train.main(
            [
                "--config",
                str(DIGITS),
                "model.hidden_size=32",
                "model.depth=1",
                "model.num_heads=2",
                "train.global_batch_size=16",
                "train.max_steps=2",
                "train.mixed_precision=bf16",
                "train.cpu=true",
                "log.every=2",
                "log.checkpoint_every=100",
                "log.sample_every=0",
                "log.trackers=[]",
                "log.fid_every=2",
                f"log.fid_samples={FID_SAMPLES}",
                "log.fid_inception=bundled",
                f"log.fid_reference={reference}",
                "log.sample_sampler=ddim",
                "log.sample_steps=3",
                f"run.dir={run_dir}",
            ]
        )
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    [logged] = [json.loads(line) for line in (run_dir / "fid.jsonl").read_text().splitlines()]

    generator = ImageGenerator.from_export(read_export(run_dir))
    indices = list(range(FID_SAMPLES))  # one batch of 8 < the loader's batch of 16, as in training
    with torch.autocast("cpu", dtype=torch.bfloat16):
        images = generator.generate([i % 10 for i in indices], sample_seeds(0, indices), sampler="ddim", steps=3)
    samples = tmp_path / "samples.npz"
    np.savez(samples, arr_0=images)
    report = fid_main(
        [
            str(samples),
            str(reference),
            "--metrics",
            "fid",
            "--weights",
            "bundled",
            "--device",
            "cpu",
            "--json",
            str(tmp_path / "fid.json"),
        ]
    )
    # Same images, same fp32 Inception; the batch sizes differ (8 in both here), float64 statistics.
    assert logged["fid"] == pytest.approx(report["fid"], rel=1e-6)
