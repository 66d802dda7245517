"""Without gradient clipping (train.max_grad_norm null, the ImageNet recipe's setting) a training step computes no
gradient norm: the norm is a pass over every gradient of the model, done before only to log a number. The logs say
so: metrics.jsonl holds grad_norm null and the start-up summary says the norm is not computed."""

import json
from pathlib import Path

import pytest
from accelerate import Accelerator

from _tiny_runs import run_train

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", str(ROOT / "configs" / "digits.yaml"), "model.hidden_size=32", "model.depth=1"]
TINY += ["model.num_heads=2", "train.global_batch_size=8", "log.every=1", "log.sample_every=0", "log.trackers=[]"]


@pytest.mark.parametrize("max_grad_norm,steps,passes", [("null", 2, 0), ("1.0", 2, 2)])
def test_the_gradient_norm_is_computed_only_to_clip(tmp_path, monkeypatch, capsys, max_grad_norm, steps, passes):
    calls = []
    clip = Accelerator.clip_grad_norm_
    monkeypatch.setattr(Accelerator, "clip_grad_norm_", lambda self, *args: calls.append(args) or clip(self, *args))
    run_dir = tmp_path / "run"
    run_train(*TINY, f"train.max_grad_norm={max_grad_norm}", f"train.max_steps={steps}", f"run.dir={run_dir}")
    assert len(calls) == passes
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = (run_dir / "startup.txt").read_text()
    if passes:
        assert all(line["grad_norm"] > 0 for line in lines)
        assert "clipped to a global norm of 1; the norm before clipping is logged as grad_norm" in summary
    else:
        assert [line["grad_norm"] for line in lines] == [None] * steps
        assert (
            "not clipped (train.max_grad_norm null): their norm is not computed, metrics.jsonl says grad_norm null"
            in summary
        )
