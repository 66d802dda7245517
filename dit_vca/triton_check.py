"""The first-use check of VCA's Triton core, and the fall-back to the ATen core when it fails.

The Triton kernels are compiled for the GPU they run on, by the Triton the installed torch pins, and a compiler can
fail on a target nobody tried (issue 37: two configurations of one kernel on sm_100 with Triton 3.6) or, worse,
compile code that runs and computes wrong but finite numbers. So the first time the Triton core is to run for a
key, the device, the dtype it computes in, the head dimension, the four switches and, in float32, whether TF32 is
on (each a different compilation), this process checks it once on a small slice of the layer: two images and two
heads of the layer's head dimension on its token and contrast grids, with random weights, forward and backward
through `dit_vca.vca_core.vca_core` with the Triton layout, against the ATen core in float32 (TF32 off) on the
same inputs. It passes when nothing raised and the output and every gradient lie within `TOLERANCES` of the ATen
result. Otherwise this process runs the ATen core for that key from then on and says so in one line on stderr
(every process of a launch checks and speaks for itself: each has its own GPU); when the user chose the Triton
kernel explicitly (`train.vca_kernel=triton`, `sample.py --vca-kernel triton`, `VisualContrastAttention.kernel =
"triton"`) the same event is a UserError (one line, exit status 2 from a command).

Where the check runs, and why there. `VisualContrastAttention.forward` asks `triton_core_passes` before it builds
the core's layout, whose `triton` argument is static: under torch.compile it is a constant of the graph, and the
operator is opaque to Dynamo, so the choice has to be made while the graph is traced, not inside it. Eagerly the
question is a call (a dictionary look-up after the first); while Dynamo traces, `torch.compiler.
assume_constant_result` makes Dynamo run it as plain Python, on real tensors, and put its answer into the graph as
a constant: the check runs once, eagerly, and `fullgraph=True` holds. The commands do not wait for that: train.py
and sample.py run the check when they set the kernel (`dit_vca.attention.set_vca_kernel`), before compiling and
before any heavy work, so that a refusal is their one-line error rather than an exception Dynamo wraps in its own
(it does for any exception raised while it traces).

The check leaves no trace: it runs under `torch.random.fork_rng` (a run resumed bit for bit draws the same
numbers) and restores the TF32 switches it turns off for the reference (the kernels are not autotuned: their tiles
are declared per platform, dit_vca.vca_triton_configs, so the slice chooses nothing for the real batch). It runs
only on
CUDA devices (`CHECKED_DEVICE_TYPES`): under Triton's interpreter the kernels run as Python, not compiled code,
and the test suite checks them there (tests/test_triton_first_use.py checks this module under the interpreter by
adding "cpu").
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from commands import UserError
from dit_vca.model_options import VCAOptions

CHECKED_DEVICE_TYPES = ("cuda",)
SLICE_IMAGES, SLICE_HEADS = 2, 2  # the slice: images × heads of the layer's head dimension
SLICE_BLOCK_INDEX = 2  # λ_init = 0.47: both streams of each stage weigh in

# The bounds on the norm-wise relative error ‖triton − aten‖ / ‖aten‖ of each tensor compared (the output, dx and
# each parameter's gradient), by the dtype the Triton core computes in: (every tensor, the λ vectors' gradients).
# The ATen reference computes in float32 with TF32 off, from the same inputs. The kernels accumulate in float32 and
# round to the dtype where they store (q, k, v, the streams, V̂, the output, then each gradient): about ten
# roundings lie between x and dx, and sums over the batch and the tokens (E±, the biases, the norm weights) cancel
# in part. Measured under the interpreter (bf16 tiles multiplied as on tensor cores: exact products, float32
# sums) on the check's slices: head dim 16 on a 6×6 grid with every switch combination, head dims 40 and 72 on
# 4×4 and 8×8 grids with three of them, seeds 0-4 (fp32 and fp16: head dims 16 and 72, two combinations):
# - bf16 (8 significant bits, 0.4 % per rounding): up to 8.4 % on the Triton core (the ATen core in bf16, the
#   yardstick of what bf16 gives, is of the same order: 1-6 % on the same slices); bound 20 %;
# - fp16 and TF32 (11 bits, 8× finer): fp16 up to 0.81 % (the ATen core in fp16: 0.85 %); bound 3 %;
# - float32 (IEEE): up to 3.1e-6 (the kernels sum in another order than the GEMMs: tiles, an online softmax,
#   atomics across programs); bound 1e-4.
# The λ vectors' gradients are dλ·∂λ/∂vector, and dλ is a sum over N·n·d products that cancels to far less than
# its terms (the λ-weighted stream is nearly parallel to the difference it is taken from), so their relative
# error is that of the cancellation: up to 42 % in bf16 (the ATen core in bf16: 23 %), 1.4 % in fp16, 4.5e-5 in
# float32. In bf16 they are held to their sign and order of magnitude (< 100 %: a zero or a sign flip fails), in
# fp16 and TF32 to 25 % (bf16's worst case scaled to 11 bits is 5 %), in float32 to 1e-3. A kernel that computes
# something else, drops a tile or reads another head's numbers is off by O(1) in the output or a gradient
# (tests/test_triton_first_use.py injects such results).
TOLERANCES = {
    torch.bfloat16: (0.2, 1.0),
    torch.float16: (0.03, 0.25),
    "tf32": (0.03, 0.25),
    torch.float32: (1e-4, 1e-3),
}


@dataclass(frozen=True)
class CheckKey:
    """What one compilation of the Triton core depends on (besides the shapes, which it handles)."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    joint_softmax: bool
    stage1_differential: bool
    stage2_differential: bool
    pooled_content: bool
    tf32: bool  # float32 products on TF32 tensor cores (CUDA, torch.backends.cuda.matmul.allow_tf32)

    def describe(self) -> str:
        """ "cuda:0, bfloat16, head dim 72, all switches on" (one line's worth)."""
        switches = ("joint_softmax", "stage1_differential", "stage2_differential", "pooled_content")
        off = [name for name in switches if not getattr(self, name)]
        dtype = str(self.dtype).removeprefix("torch.") + (" with TF32" if self.tf32 else "")
        return f"{self.device}, {dtype}, head dim {self.head_dim}, " + (
            f"{', '.join(off)} off" if off else "all switches on"
        )


_VERDICTS: dict[CheckKey, str | None] = {}  # key -> None (passed) or why it failed; one entry per key and process


@torch.compiler.assume_constant_result
def triton_core_passes(
    layer_type: type[torch.nn.Module],
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    grid_size: int,
    contrast_grid: int,
    switches: tuple[bool, bool, bool, bool],
    forced_by: str | None,
) -> bool:
    """Whether the Triton core may run for this device, dtype, head dim and `switches` (joint_softmax,
    stage1_differential, stage2_differential, pooled_content): True when its first-use check (on a slice of a
    `layer_type` layer, VisualContrastAttention, with this token grid and contrast grid) passed or does not apply
    to the device type. A failed check returns False after one line on stderr, or, with `forced_by` (the option
    that chose Triton explicitly, e.g. "train.vca_kernel"), raises a UserError naming it. Constant for Dynamo (see
    the module docstring)."""
    if device.type not in CHECKED_DEVICE_TYPES:
        return True
    tf32 = device.type == "cuda" and dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    key = CheckKey(_with_index(device), dtype, head_dim, *switches, tf32)
    if key not in _VERDICTS:
        _VERDICTS[key] = check_triton_core(key, layer_type, grid_size, contrast_grid)
        if _VERDICTS[key] is not None and forced_by is None:
            print(
                f"warning: VCA's Triton core failed its first-use check ({key.describe()}): {_VERDICTS[key]}; this "
                "process runs VCA's core on ATen there instead. Choose the core with train.vca_kernel, "
                "sample.py --vca-kernel or VisualContrastAttention.kernel: aten (no check), triton (this becomes "
                "an error)",
                file=sys.stderr,
                flush=True,
            )
    reason = _VERDICTS[key]
    if reason is not None and forced_by is not None:
        raise UserError(
            f"{forced_by} is triton, but VCA's Triton core failed its first-use check ({key.describe()}): {reason}; "
            "use aten, or auto to fall back to ATen with a warning"
        )
    return reason is None


def _with_index(device: torch.device) -> torch.device:
    """cuda -> cuda:<current device>: one key per GPU however the device was spelled."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_triton_core(
    key: CheckKey, layer_type: type[torch.nn.Module], grid_size: int, contrast_grid: int
) -> str | None:
    """Run the slice of `key` (see the module docstring), a `layer_type` layer (VisualContrastAttention: passed in,
    since that module imports this one), on the Triton core and the ATen core: None when they agree,
    else why not, in a few words ("CompilationError: ...", "dx differs from the ATen core's by 0.93 ...")."""
    with _apart(key.device):
        layer, x, grad = _slice(key, layer_type, grid_size, contrast_grid)
        tensors = [x, *layer.parameters()]
        names = ["dx", *(f"d{name}" for name, _ in layer.named_parameters())]
        try:
            out = layer.core(x.to(key.dtype), triton=True)
            results = [out, *torch.autograd.grad(out, tensors, grad.to(key.dtype), allow_unused=True)]
        except Exception as error:  # a compile error, no configuration that fits, ...: anything the kernels raise
            message = str(error).strip().splitlines()
            return f"{type(error).__name__}: {message[0] if message else 'no message'}"[:300]
        with _tf32_off():
            out = layer.core(x, triton=False)  # float32
            expected = [out, *torch.autograd.grad(out, tensors, grad, allow_unused=True)]
    tolerance, lambda_tolerance = TOLERANCES["tf32" if key.tf32 else key.dtype]
    for name, result, reference in zip(["output", *names], results, expected):
        if reference is None:
            continue  # a parameter the core does not use
        if result is None or not torch.isfinite(result).all():
            return f"{name} is {'missing' if result is None else 'not finite'} on the Triton core"
        error = relative_error(result, reference)
        allowed = lambda_tolerance if name.startswith("dlambda") else tolerance
        if not error < allowed:
            return f"{name} differs from the ATen core's by {error:.3g} (relative, norm-wise; allowed {allowed:.3g})"
    return None


def relative_error(result: Tensor, reference: Tensor) -> float:
    """‖result − reference‖ / ‖reference‖ in float64 (0 when both are zero)."""
    result, reference = result.double(), reference.double()
    scale = reference.norm().item()
    difference = (result - reference).norm().item()
    return difference / scale if scale else difference


def _slice(key: CheckKey, layer_type: type[torch.nn.Module], grid_size: int, contrast_grid: int, seed: int = 0):
    """A VCA layer (`layer_type`) of SLICE_HEADS heads of the key's head dim and switches on the given grids, its λ
    vectors and norm weights moved off their initial values (so that each matters), on the key's device; float32
    tokens x (SLICE_IMAGES, N, C) and a gradient for the core's output, both rounded to the key's dtype (the ATen
    reference then sees what the Triton core sees). Drawn on the CPU from seed 0, the same slice on every device."""
    options = VCAOptions(
        contrast_grid, key.joint_softmax, key.stage1_differential, key.stage2_differential, key.pooled_content
    )
    dim = SLICE_HEADS * key.head_dim
    torch.random.default_generator.manual_seed(seed)  # the CPU's stream alone (torch.manual_seed reseeds every GPU)
    layer = layer_type(dim, SLICE_HEADS, grid_size, SLICE_BLOCK_INDEX, options)
    with torch.no_grad():
        for name, parameter in layer.named_parameters():
            if name.startswith(("lambda", "norm")):
                parameter.add_(0.3 * torch.randn_like(parameter))
    shape = (SLICE_IMAGES, grid_size * grid_size, dim)
    x, grad = (torch.randn(shape).to(key.dtype).float().to(key.device) for _ in range(2))
    return layer.to(key.device), x.requires_grad_(), grad


@contextlib.contextmanager
def _apart(device: torch.device) -> Iterator[None]:
    """The check's surroundings: its own random numbers (the caller's CPU stream restored after; the GPU's is not
    used), gradients whatever the caller's mode (sampling runs under no_grad or inference_mode), no autocast, and
    the key's GPU as the current device."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(torch.autocast(device.type, enabled=False))
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        yield


class _tf32_off:
    """float32 products in IEEE float32 (the reference), the switches restored after."""

    def __enter__(self) -> None:
        self.saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc) -> None:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved
