"""CUDA graphs for sampling's model calls and for the training step (generation.cuda_graphs, train.cuda_graph).

Without a GPU nothing is captured: every call runs eagerly on the static buffers a graph would read, and must give
the numbers a plain call gives, bit for bit. The captures themselves run in the GPU runbook (bench.gpu_host)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from _tiny_runs import DIGITS, TINY, assert_same_checkpoint, logged, run_train
from generation.cuda_graphs import CapturedCalls


def test_calls_off_cuda_run_on_static_buffers_and_give_the_plain_numbers():
    """One static buffer set per signature (shapes, dtypes, autocast), reused by later calls of that signature;
    what comes back is what the function computes from the call's own inputs."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    captured = CapturedCalls(layer, pure=True)
    for batch in (3, 3, 5, 3):
        x = torch.randn(batch, 8)
        assert torch.equal(captured(x), layer(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.randn(3, 8)
        assert torch.equal(captured(x), layer(x))
    assert len(captured._signatures) == 3 and captured.graphs == 0  # (3, 8), (5, 8), (3, 8) under bf16


def test_sampling_through_captured_calls_gives_the_same_images(export):
    """ImageGenerator(cuda_graphs=True) off CUDA: the sampler's model calls (the classifier-free pair as one doubled
    batch) through CapturedCalls' buffers, the same images as plain calls."""
    from generation import ImageGenerator, read_export

    images = {}
    for graphs in (False, True):
        generator = ImageGenerator.from_export(read_export(export), cuda_graphs=graphs)
        images[graphs] = generator.generate([0, 1, 2], [5, 6, 7], guidance=2.0, sampler="ddim", steps=4)
        assert isinstance(generator.network, CapturedCalls) == graphs
    assert np.array_equal(images[False], images[True])


@pytest.mark.slow
def test_training_step_through_static_buffers_is_the_eager_step(tmp_path, single_process, capsys):
    """train.cuda_graph=true on the CPU: a note, then the step (loss, backward, clipping, AdamW) on static buffers
    with the gradients dropped before each step instead of after: the same metrics and the same checkpoint, byte
    for byte, with warm-up and clipping."""
    common = ["--config", str(DIGITS), *TINY, "train.max_steps=4", "log.every=1", "log.sample_every=0",
              "train.max_grad_norm=1.0", "train.cpu=true"]  # fmt: skip
    run_train(*common, f"run.dir={tmp_path / 'eager'}")
    capsys.readouterr()
    run_train(*common, "train.cuda_graph=true", f"run.dir={tmp_path / 'graph'}")
    assert "note: train.cuda_graph=true on cpu: no CUDA graph there" in capsys.readouterr().out
    assert logged(tmp_path / "eager") == logged(tmp_path / "graph")
    [ours] = (tmp_path / "graph" / "checkpoints").iterdir()
    [theirs] = (tmp_path / "eager" / "checkpoints").iterdir()
    assert_same_checkpoint(ours, theirs)


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.grad_accum_steps=2", "train.grad_accum_steps=2: a captured step needs 1"),
        ("train.mixed_precision=fp16", "train.mixed_precision=fp16: a captured step needs fp32 or bf16"),
        (
            "train.repa.encoder=vit_tiny_patch16_224",
            "train.repa.encoder=vit_tiny_patch16_224: a captured step needs no REPA",
        ),
    ],
)
def test_what_a_captured_step_cannot_do_is_refused_in_one_line(override, message):
    from training.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=f"'train.cuda_graph' is true, but {message}"):
        load_config(DIGITS, ["train.cuda_graph=true", override])


def test_a_launch_of_several_processes_or_fp16_is_refused():
    from training.build import check_cuda_graph_launch
    from training.config import ConfigError

    launch = SimpleNamespace(num_processes=2, mixed_precision="no", device=torch.device("cuda"), is_main_process=True)
    with pytest.raises(ConfigError, match="this launch has 2 processes: a captured step runs on one"):
        check_cuda_graph_launch(launch)
    launch.num_processes, launch.mixed_precision = 1, "fp16"
    with pytest.raises(ConfigError, match="mixed precision is fp16: use fp32 or bf16"):
        check_cuda_graph_launch(launch)
