"""The user's switch of VCA's core between ATen and Triton: `train.vca_kernel` and `sample.py --vca-kernel`, both
applied by dit_vca.attention.set_vca_kernel. Without a GPU the Triton path runs under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1), the same kernels a GPU compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import sample_arguments as sample
from _launch import sample_env
from dit_vca.attention import VCA_KERNEL_SETTINGS
from training.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "configs" / "digits.yaml"
TINY = ["model.hidden_size=32", "model.depth=2", "model.num_heads=2", "log.sample_every=0", "log.trackers=[]"]

# Builds the digits run twice in one process without CUDA or the interpreter: train.vca_kernel=aten must reach
# every VCA module of the model and its EMA copies; train.vca_kernel=triton must be refused in one line.
BUILD_CHECK = """
import sys
from pathlib import Path
from commands import UserError
from dit_vca.attention import VisualContrastAttention
from training.accelerator import create_accelerator
from training.build import build_training
from training.config import load_config
from training.run import RunDirectory

def built(kernel):
    config = load_config(sys.argv[1], [*sys.argv[3:], f"train.vca_kernel={kernel}", f"run.dir={sys.argv[2]}"])
    return build_training(config, create_accelerator(config, RunDirectory(Path(config.run.dir))))

parts = built("aten")
modules = [m for net in (parts.model, parts.ema) for m in net.modules()]
kernels = [m.kernel for m in modules if isinstance(m, VisualContrastAttention)]
print("kernels", " ".join(map(str, kernels)))
try:
    built("triton")
except UserError as error:
    print("refused", error)
"""


def without_cuda_or_interpreter(env: dict[str, str]) -> dict[str, str]:
    """`env` where neither a GPU nor Triton's interpreter is available to a child process."""
    return {**{key: value for key, value in env.items() if key != "TRITON_INTERPRET"}, "CUDA_VISIBLE_DEVICES": ""}


def test_sample_choices_are_the_attention_modules_settings():
    (option,) = [action for action in sample.build_parser()._actions if action.dest == "vca_kernel"]
    assert tuple(option.choices) == VCA_KERNEL_SETTINGS


def test_bad_config_value_names_the_key_and_the_choices():
    with pytest.raises(ConfigError, match=r"^'train.vca_kernel' is 'cuda'; valid choices: auto, aten, triton$"):
        load_config(DIGITS, ["train.vca_kernel=cuda"])
    assert load_config(DIGITS).train.vca_kernel == "auto"


def test_config_sets_every_vca_module_and_triton_needs_cuda_or_the_interpreter(tmp_path):
    script = tmp_path / "build_check.py"
    script.write_text(BUILD_CHECK)
    command = [sys.executable, str(script), str(DIGITS), str(tmp_path / "run"), *TINY, "train.cpu=true"]
    env = without_cuda_or_interpreter({**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "kernels " + " ".join(["aten"] * 4), lines  # 2 blocks, in the model and its EMA
    assert lines[1] == (
        "refused train.vca_kernel triton on cpu needs a CUDA device or Triton's interpreter (TRITON_INTERPRET=1 in "
        "the environment); use aten or auto"
    )


SAMPLES = ["--num-samples", "2", "--per-proc-batch-size", "2", "--grid-size", "0"]
SAMPLING = ["--sampler", "ddpm", "--steps", "4", "--cfg-scale", "2", "--seed", "3"]


def sample_with(export: Path, out: Path, kernel: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "sample.py"), "--ckpt", str(export), "--out", str(out), *SAMPLES]
    return subprocess.run(
        [*command, *SAMPLING, "--vca-kernel", kernel], env=env, capture_output=True, text=True, timeout=240
    )


def test_sampling_on_aten_and_triton_gives_the_same_images(export, tmp_path):
    images = {}
    for kernel in ("aten", "triton"):
        out = tmp_path / f"{kernel}.npz"
        done = sample_with(export, out, kernel, sample_env())
        assert done.returncode == 0, done.stderr[-3000:]
        with np.load(out) as data:
            images[kernel] = data["arr_0"].astype(int)
        settings = json.loads(out.with_suffix(".json").read_text())["settings"]
        assert settings["vca_kernel"] == kernel  # a different kernel is a different run
    # The two cores agree to float32 rounding (~1e-6 relative, tests/test_vca_triton.py), which 4 DDPM steps with
    # identical noise carry into pixels: at most one uint8 level where a value lies at a rounding boundary.
    assert np.abs(images["aten"] - images["triton"]).max() <= 1
    assert images["aten"].std() > 10  # real pictures, not a constant that any two paths would share


def test_triton_without_cuda_or_interpreter_is_one_line(export, tmp_path):
    done = sample_with(export, tmp_path / "samples.npz", "triton", without_cuda_or_interpreter(sample_env()))
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        "error: --vca-kernel triton on cpu needs a CUDA device or Triton's interpreter (TRITON_INTERPRET=1 in the "
        "environment); use aten or auto"
    ]
    assert not (tmp_path / "samples.npz").exists()
