"""The first-use check of VCA's Triton core and its fall-back to ATen (dit_vca.triton_check), on the CPU under Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1), with the two failures the check exists for injected into the
Triton core's public entry points (dit_vca.vca_triton.add_attention / attention_backward): a compile error (what
Triton 3.6 raises for two configurations of a backward kernel on sm_100, issue 37; or no configuration that fits) and
a wrong but finite result (a kernel that writes another head's numbers).

The check applies to CUDA devices; these tests add the CPU (`checked_on_cpu`), where the kernels run interpreted, and
let the automatic choice pick Triton there as it does on CUDA.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import triton

import dit_vca.attention
import sample as sample_script
from _tiny_models import tiny_export
from _tiny_runs import run_train
from commands import UserError, run_command
from dit_vca import triton_check, vca_triton
from dit_vca.attention import VCAOptions, VisualContrastAttention

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "configs" / "digits.yaml"
WARNING = "warning: VCA's Triton core failed its first-use check"
HOW_TO_CHOOSE = (
    "this process runs VCA's core on ATen there instead. Choose the core with train.vca_kernel, sample.py "
    "--vca-kernel or VisualContrastAttention.kernel: aten (no check), triton (this becomes an error)"
)


@pytest.fixture
def checked_on_cpu(monkeypatch):
    """No verdict yet in this process; the check applies to CPU tensors and the automatic choice picks Triton on
    the CPU, as both do on CUDA."""
    monkeypatch.setattr(triton_check, "_VERDICTS", {})
    monkeypatch.setattr(triton_check, "CHECKED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(dit_vca.attention, "TRITON_DEVICE_TYPES", ("cuda", "cpu"))


class TritonCalls:
    """Counts the calls of the Triton core's entry points; `fail` makes one of them misbehave."""

    def __init__(self, monkeypatch) -> None:
        self.forward, self.backward = 0, 0
        self.real_forward, self.real_backward = vca_triton.add_attention, vca_triton.attention_backward
        monkeypatch.setattr(vca_triton, "add_attention", self.add_attention)
        monkeypatch.setattr(vca_triton, "attention_backward", self.attention_backward)
        self.failure = None

    def add_attention(self, result, heads, *rest):
        self.forward += 1
        if self.failure == "wrong head":  # the attention of each head added to the other head's channels
            before = result.clone()
            saved = self.real_forward(result, heads, *rest)
            B, N, C = result.shape
            attention = (result - before).view(B, N, heads.shape[2], -1)  # (B, N, h, d)
            result.copy_(before + attention.flip(2).reshape(B, N, C))
            return saved  # what the backward reads, as the operator's outputs must hold it
        return self.real_forward(result, heads, *rest)

    def attention_backward(self, *args):
        self.backward += 1
        if self.failure == "compile error":  # what the MLIR pass manager raises when a kernel does not compile
            raise RuntimeError("PassManager::run failed")
        if self.failure == "out of resources":  # every configuration needs more shared memory than there is
            raise triton.runtime.errors.OutOfResources(262144, 232448, "shared memory")
        return self.real_backward(*args)


def layer(kernel: str | None, seed: int = 0) -> VisualContrastAttention:
    """d = 16 on a 4×4 grid (n = 4): a slice the interpreter runs in a fraction of a second."""
    torch.manual_seed(seed)
    module = VisualContrastAttention(32, 2, 4, 1, VCAOptions())
    module.kernel = kernel
    return module


def outputs_and_gradients(module: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = module(x)
    out.backward(torch.ones_like(out))
    return [out.detach(), x.grad, *(p.grad for p in module.parameters())]


def warnings_in(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(WARNING)]


@pytest.mark.parametrize(
    "failure,reason",
    [
        ("compile error", "RuntimeError: PassManager::run failed"),
        ("out of resources", "OutOfResources: out of resource: shared memory, Required: 262144, Hardware limit: "),
        ("wrong head", "output differs from the ATen core's by "),
    ],
)
def test_a_failed_check_falls_back_to_aten_with_one_line(checked_on_cpu, monkeypatch, capsys, failure, reason):
    calls = TritonCalls(monkeypatch)
    calls.failure = failure
    x = torch.randn(2, 16, 32)
    automatic = outputs_and_gradients(layer(None), x)
    [line] = warnings_in(capsys.readouterr().err)
    assert line.startswith(f"{WARNING} (cpu, float32, head dim 16, all switches on): {reason}")
    assert line.endswith(HOW_TO_CHOOSE)
    checked = calls.forward + calls.backward
    assert checked >= 1  # the check ran the Triton core once ...
    again = outputs_and_gradients(layer(None), x)  # ... and only once: the verdict stands for the process
    assert calls.forward + calls.backward == checked and capsys.readouterr().err == ""
    aten = outputs_and_gradients(layer("aten"), x)
    for fallback, expected in zip([*automatic, *again], aten * 2):
        assert torch.equal(fallback, expected)  # the layer ran the ATen core


def test_triton_chosen_explicitly_makes_a_failed_check_an_error(checked_on_cpu, monkeypatch, capsys):
    TritonCalls(monkeypatch).failure = "compile error"
    expected = (
        "VisualContrastAttention.kernel is triton, but VCA's Triton core failed its first-use check (cpu, float32, "
        "head dim 16, all switches on): RuntimeError: PassManager::run failed; use aten, or auto to fall back to "
        "ATen with a warning"
    )
    for _ in range(2):  # every call, not only the one that ran the check
        with pytest.raises(UserError) as raised:
            layer("triton")(torch.randn(1, 16, 32))
        assert str(raised.value) == expected
    assert capsys.readouterr().err == ""  # the error says it all, no warning besides


@pytest.mark.slow
def test_under_torch_compile_the_check_runs_once_eagerly_and_fullgraph_holds(checked_on_cpu, monkeypatch, capsys):
    """Dynamo runs the check while it traces (torch.compiler.assume_constant_result) and puts the verdict into the
    graph: no graph break (fullgraph), the compiled layer calls the ATen core, the check ran once."""
    calls = TritonCalls(monkeypatch)
    calls.failure = "wrong head"
    checks = []
    real_check = triton_check.check_triton_core
    monkeypatch.setattr(triton_check, "check_triton_core", lambda *args: checks.append(args) or real_check(*args))
    module = layer(None)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 16, 32)
    first = outputs_and_gradients(compiled, x)
    checked = calls.forward + calls.backward
    second = outputs_and_gradients(compiled, x)
    assert len(checks) == 1 and calls.forward + calls.backward == checked  # the compiled graph never calls Triton
    assert len(warnings_in(capsys.readouterr().err)) == 1
    aten = outputs_and_gradients(layer("aten"), x)
    for result, expected in zip(first, aten):
        torch.testing.assert_close(result, expected)  # aot_eager decomposes the rest of the layer: rounding apart
    for a, b in zip(first[:2], second[:2]):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_a_passing_check_keeps_triton_and_leaves_no_trace(checked_on_cpu, monkeypatch, capsys):
    calls = TritonCalls(monkeypatch)
    saved, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, True
    try:
        for dtype in (torch.float32, torch.bfloat16):
            module, x = layer(None), torch.randn(1, 16, 32)
            stream = torch.random.get_rng_state()
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                module(x)
            assert torch.equal(torch.random.get_rng_state(), stream)  # the check drew from its own stream
            assert torch.backends.cuda.matmul.allow_tf32  # restored after the reference ran with TF32 off
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert list(triton_check._VERDICTS.values()) == [None, None]
    assert capsys.readouterr().err == ""
    assert calls.forward == 4  # each dtype: the check's slice, then the layer on the Triton core


# --------------------------------------------------------------------------------------------------------------------
# The commands: the check runs when they set the kernel, before compiling or any step
# --------------------------------------------------------------------------------------------------------------------


def train(tmp_path: Path, capsys, *overrides: str) -> tuple[int | None, str]:
    """train.py on a 1-block digits model in this process, as the command runs it; (exit status, stderr)."""
    argv = ["--config", str(DIGITS), "model.hidden_size=32", "model.depth=1", "model.num_heads=2"]
    argv += ["train.global_batch_size=8", "train.max_steps=1", "log.sample_every=0", "log.trackers=[]"]
    try:
        run_command(lambda arguments: run_train(*arguments), [*argv, f"run.dir={tmp_path / 'run'}", *overrides])
    except SystemExit as exit_:
        return exit_.code, capsys.readouterr().err
    return None, capsys.readouterr().err


def test_train_py_with_triton_chosen_stops_in_one_line_before_training(checked_on_cpu, monkeypatch, tmp_path, capsys):
    TritonCalls(monkeypatch).failure = "compile error"
    status, err = train(tmp_path, capsys, "train.vca_kernel=triton")
    assert status == 2
    assert err.strip().splitlines() == [
        "error: train.vca_kernel is triton, but VCA's Triton core failed its first-use check (cpu, float32, head dim "
        "16, all switches on): RuntimeError: PassManager::run failed; use aten, or auto to fall back to ATen with a "
        "warning"
    ]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_train_py_falls_back_to_aten_with_one_line_and_trains(checked_on_cpu, monkeypatch, tmp_path, capsys):
    calls = TritonCalls(monkeypatch)
    calls.failure = "wrong head"
    status, err = train(tmp_path, capsys, "train.vca_kernel=auto")
    assert status is None
    [line] = warnings_in(err)
    assert line.startswith(f"{WARNING} (cpu, float32, head dim 16, all switches on): output differs")
    assert calls.forward == 1  # the check's slice alone: the step ran on ATen
    assert (tmp_path / "run" / "checkpoints" / "step-0000001").is_dir()


def sample(export: Path, out: Path, kernel: str, capsys) -> tuple[int | None, str]:
    """sample.py in this process, as the command runs it; (exit status, stderr)."""
    argv = ["--ckpt", str(export), "--out", str(out), "--num-samples", "2", "--per-proc-batch-size", "2"]
    argv += ["--grid-size", "0", "--sampler", "ddim", "--steps", "2", "--vca-kernel", kernel]
    try:
        run_command(sample_script.main, argv)
    except SystemExit as exit_:
        return exit_.code, capsys.readouterr().err
    return None, capsys.readouterr().err


def test_sample_py_checks_the_core_when_it_loads_the_model(checked_on_cpu, monkeypatch, tmp_path, capsys):
    """sample.py: --vca-kernel triton stops in one line before any sample; auto samples on ATen after one warning,
    the same images as --vca-kernel aten."""
    export = tiny_export(tmp_path / "export")
    TritonCalls(monkeypatch).failure = "compile error"
    status, err = sample(export, tmp_path / "triton.npz", "triton", capsys)
    assert status == 2 and err.strip().splitlines() == [
        "error: --vca-kernel is triton, but VCA's Triton core failed its first-use check (cpu, float32, head dim 16, "
        "all switches on): RuntimeError: PassManager::run failed; use aten, or auto to fall back to ATen with a "
        "warning"
    ]
    assert not (tmp_path / "triton.npz").exists()
    monkeypatch.setattr(triton_check, "_VERDICTS", {})  # another sample.py process
    status, err = sample(export, tmp_path / "auto.npz", "auto", capsys)
    assert status is None and len(warnings_in(err)) == 1
    status, err = sample(export, tmp_path / "aten.npz", "aten", capsys)
    assert status is None and warnings_in(err) == []
    with np.load(tmp_path / "auto.npz") as auto, np.load(tmp_path / "aten.npz") as aten:
        assert np.array_equal(auto["arr_0"], aten["arr_0"])
