"""VCA's core on the Triton kernels (dit_vca.vca_triton) against the readable path, outputs and every gradient, on
both of its paths (the per-head kernels and the split path, each forced), also with QK-norm and RoPE (the core's
pre-step, dit_vca.vca_qk); the results bitwise the same whatever order the programs run in; the launch plan
(dit_vca.vca_triton_plan) against the launches made and the products run, and its grids against the GPU's size;
the operators' registration (opcheck); the ATen operations a layer dispatches on the Triton path.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before triton is imported): the same kernels a GPU compiles, each program executed in numpy.
The interpreter executes programs one by one, so the shapes are small (N = 16–64, n = 4–36, d = 16, 40, 72);
they still cross every tile boundary of the interpreter's block sizes (16: several key, query and contrast tiles,
the last one partial; several key and query splits on the split path) and the padding of head dimensions that
are not powers of two.
"""

import dataclasses
import itertools
import json
import math
import sys
import warnings
from collections import Counter
from unittest import mock

import pytest
import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile
from triton.runtime.interpreter import InterpreterBuilder

from _attention_cases import (
    BLOCK_OPTIONS,
    block_ids,
    core_multiply_adds,
    outputs_and_gradients,
    perturbed_vca,
    switch_ids,
)
from dit_vca import vca_core, vca_triton, vca_triton_plan
from dit_vca.attention import MultiHeadSelfAttention, VCAOptions, VisualContrastAttention
from dit_vca.kernel_layout import KernelLayout
from dit_vca.vca_triton_tiles import start64

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ALL_OPTIONS = [VCAOptions(3, *values) for values in itertools.product((True, False), repeat=4)]  # p = 3
PATHS = ("per_head", "split")


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """The core's path forced: the per-head kernels or the split path (the plan picks by shape otherwise)."""
    monkeypatch.setattr(vca_triton_plan, "per_head_fits", lambda shape: request.param == "per_head")
    return request.param


def triton_and_readable(module: VisualContrastAttention, x: torch.Tensor, grad: torch.Tensor, dtype=None):
    """Outputs and gradients of the Triton path and of the readable path (`reference_forward`), under autocast
    to `dtype` when given."""
    module = module.to(DEVICE)
    x, grad = x.to(DEVICE), grad.to(DEVICE)
    module.kernel = "triton"
    with torch.autocast(DEVICE.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        fast = outputs_and_gradients(module, "forward", x, grad)
        readable = outputs_and_gradients(module, "reference_forward", x, grad)
    assert fast.keys() == readable.keys() and all(value is not None for value in fast.values())
    return fast, readable


def assert_fp32_close(fast: dict, readable: dict) -> None:
    for name, expected in readable.items():
        # fp32 on both sides; the kernels sum in another order (online softmax over tiles, partials over splits
        # and programs) than the readable path's GEMMs, which moves results by a few fp32 roundings of the largest
        # terms (observed ≤ 6e-6 relative to the tensor's largest entry, the λ vectors' gradients included). The λ
        # vectors' gradient is dλ·∂λ/∂vector with dλ a sum of N·n terms that largely cancel, hence its looser bound
        # (as in test_attention's test_fast_path_equals_readable_path). A wrong formula is off by O(1).
        tolerance = 1e-4 if name.startswith("lambda") else 1e-5
        error = (fast[name].float() - expected.float()).abs().max().item()
        assert error <= tolerance * max(1.0, expected.abs().max().item()), (name, error)


def assert_half_close(module: VisualContrastAttention, x, grad, dtype: torch.dtype) -> None:
    """The Triton path under autocast to `dtype` against the readable path in fp32. Errors are relative to the
    largest entry of each tensor. 5 %: bf16 has an 8-bit mantissa, 0.4 % per rounding, and about ten roundings
    lie between x and dx (the scores' operands, P, the output, dO, dS, dq twice, the qkv GEMMs); observed up to
    3.8 % (dx on 36 tokens; the readable path in bf16: 1.5 %). 20 % for the λ vectors: their gradient is
    dλ·∂λ/∂vector with dλ a sum of N·n·d products of order 1 that cancel to far less, so the 0.4 % of each
    product's rounding leaves an absolute error of 0.03–0.19 on gradients of at most 1.3–9.2 (observed over the
    switches, for the Triton path and the ATen path alike; the readable path in bf16 up to 0.17). A wrong
    formula is off by O(1)."""
    fast, _ = triton_and_readable(module, x, grad, dtype)
    exact = outputs_and_gradients(module, "reference_forward", x.to(DEVICE), grad.to(DEVICE))  # fp32
    assert fast["output"].dtype == dtype and fast["qkv.weight"].dtype == torch.float32
    for name, expected in exact.items():
        tolerance = 0.2 if name.startswith("lambda") else 0.05
        error = (fast[name].float() - expected).abs().max().item()
        assert error <= tolerance * expected.abs().max().item(), (name, error)


@pytest.mark.slow
@pytest.mark.parametrize("options", ALL_OPTIONS, ids=switch_ids)
def test_triton_equals_readable_path_for_every_switch(path, options):
    """4×4 tokens, p = 2 (pooling windows of 2×2), d = 16, fp32, every switch combination on both paths (the tiles'
    boundaries are crossed by the cases below: 6×6 tokens and more)."""
    module = perturbed_vca(32, 2, 4, block_index=3, options=dataclasses.replace(options, contrast_grid=2))
    assert_fp32_close(*triton_and_readable(module, torch.randn(1, 16, 32), torch.randn(1, 16, 32)))


# The switches that change how the contrast tokens are formed and read back: both stages differential (T⁻ read by
# both), Stage I plain (T⁻ read by Stage II only), Stage II plain (by Stage I only), and no pooled content.
TOKEN_OPTIONS = [ALL_OPTIONS[0], ALL_OPTIONS[4], ALL_OPTIONS[2], ALL_OPTIONS[1]]


@pytest.mark.parametrize("options", ALL_OPTIONS[:1] + ALL_OPTIONS[9:10], ids=switch_ids)
def test_triton_crosses_its_tiles_under_bf16_autocast(path, options):
    """6×6 tokens (N = 36: three key and query tiles of 16, the last partial), p = 3 (n = 9: a partial block of
    contrast tokens, pooling windows of 2×2), d = 16, bf16 under autocast against the fp32 readable path; on the
    split path three key splits and three query splits per head. One and two softmaxes."""
    module = perturbed_vca(32, 2, 6, block_index=3, options=options)
    assert_half_close(module, torch.randn(1, 36, 32), torch.randn(1, 36, 32), torch.bfloat16)


@pytest.mark.parametrize("options", TOKEN_OPTIONS, ids=switch_ids)
def test_triton_with_qk_norm_and_rope_equals_readable_path(path, options):
    """QK-norm and RoPE on the Triton path: 4×4 tokens, p = 2 (pooling cells of 2×2, whose centres are half-integer),
    d = 16, fp32, for the switches that form and read the contrast tokens differently (the others are the plain
    cases'). The stages read the pre-step's q̃, k̃ and, with RoPE, a given content T (read in place of the pool; dT
    comes back apart from dq)."""
    module = perturbed_vca(
        32, 2, 4, block_index=3, options=dataclasses.replace(options, contrast_grid=2), qk_norm=True, rope=True
    )
    assert_fp32_close(*triton_and_readable(module, torch.randn(1, 16, 32), torch.randn(1, 16, 32)))


@pytest.mark.slow
@pytest.mark.parametrize("block_options", BLOCK_OPTIONS[:2], ids=block_ids)
def test_triton_with_qk_norm_or_rope_alone_equals_readable_path(path, block_options):
    """Each option alone on the default switches, 6×6 tokens and p = 3: QK-norm alone leaves the pooling to the
    kernels (dT into dq̂ there), RoPE alone has no gains."""
    module = perturbed_vca(32, 2, 6, block_index=1, options=VCAOptions(3), **block_options)
    module.recompute_qkv = True
    assert_fp32_close(*triton_and_readable(module, torch.randn(1, 36, 32), torch.randn(1, 36, 32)))


@pytest.mark.parametrize(
    "dim,heads,grid,contrast_grid,batch,recompute",
    [
        (80, 2, 6, 6, 1, False),  # d = 40, n = 36 = N: three blocks of contrast tokens (the last partial), windows of 1
        (144, 2, 8, None, 2, True),  # d = 72 (DiT-XL/2's), N = 64, n = 16, two images (E± summed over the batch)
        (64, 2, 4, 2, 2, False),  # d = 32, N = 16, n = 4
    ],
)
def test_triton_head_dims_and_grids(path, dim, heads, grid, contrast_grid, batch, recompute, monkeypatch):
    """On a GPU of one multiprocessor: the per-head backward's two programs each run two of the four heads in
    turn (its scratch reused), the split path's splits fill two programs' worth."""
    if path == "per_head" and contrast_grid == 6:
        pytest.skip("n = 36 > the per-head forward's block of contrast tokens under the interpreter (64 compiled)")
    monkeypatch.setattr(vca_triton, "_multiprocessors", lambda device: 1)
    module = perturbed_vca(dim, heads, grid, block_index=1, options=VCAOptions(contrast_grid))
    module.recompute_qkv = recompute
    x, grad = torch.randn(batch, grid * grid, dim), torch.randn(batch, grid * grid, dim)
    assert_fp32_close(*triton_and_readable(module, x, grad))


@pytest.mark.parametrize(
    "forced,options,dim,dtype",
    [
        ("per_head", VCAOptions(joint_softmax=False), 144, torch.bfloat16),
        ("split", VCAOptions(pooled_content=False), 80, torch.float16),
    ],
    ids=["per_head-bf16-two-softmaxes-d72", "split-fp16-embeddings-only-d40"],
)
def test_triton_under_half_precision_autocast_matches_readable_path(forced, options, dim, dtype, monkeypatch):
    """Wider heads (d = 72 and 40, padded to 80 and 48) on 8×8 tokens, two images, in bf16 and fp16."""
    monkeypatch.setattr(vca_triton_plan, "per_head_fits", lambda shape: forced == "per_head")
    module = perturbed_vca(dim, 2, 8, block_index=3, options=options)
    assert_half_close(module, torch.randn(2, 64, dim), torch.randn(2, 64, dim), dtype)


@pytest.mark.slow
def test_triton_with_qk_norm_and_rope_under_bf16_is_as_close_as_the_readable_path():
    """QK-norm and RoPE under bf16 autocast (their gains and tables in float32, q̃ and k̃ rounded once to bf16),
    d = 72 on 8×8 tokens, two images, against the readable path in fp32: each tensor within 5 % of its largest
    entry (20 % for the λ vectors, as assert_half_close says), or where bf16 itself loses more, within what the
    readable path loses in bf16. It does here: QK-norm's backward keeps only the part of dq̂ orthogonal to q̂,
    and where that part is small against the rest, what bf16 rounded in the rest remains (observed: the readable
    path in bf16 13 % off on dx, the Triton path 5.6 %, the ATen core 13 %)."""
    module = perturbed_vca(144, 2, 8, block_index=3, options=VCAOptions(), qk_norm=True, rope=True)
    x, grad = torch.randn(2, 64, 144), torch.randn(2, 64, 144)
    fast, readable_bf16 = triton_and_readable(module, x, grad, torch.bfloat16)
    exact = outputs_and_gradients(module, "reference_forward", x.to(DEVICE), grad.to(DEVICE))  # fp32
    assert fast["output"].dtype == torch.bfloat16 and fast["q_norm.weight"].dtype == torch.float32
    for name, expected in exact.items():
        tolerance = (0.2 if name.startswith("lambda") else 0.05) * expected.abs().max().item()
        bf16_loss = (readable_bf16[name].float() - expected).abs().max().item()
        error = (fast[name].float() - expected).abs().max().item()
        assert error <= max(tolerance, bf16_loss), (name, error, tolerance, bf16_loss)


def test_the_entry_points_read_q_k_v_as_a_strided_view_of_the_projection(path):
    """The operator may pass q, k, v as the qkv GEMM's (B, N, 3C) output seen as (B, N, 3, h, d).permute(2, 0, 3, 1,
    4), with no head-major copy: the kernels read every stride, and give the same bits as from a contiguous copy,
    forward (with the saved tensors) and backward, T pooled from the strided q."""
    B, N, h, d, grid = 2, 16, 2, 16, 4
    layout = triton_layout(h, grid, VCAOptions(2))
    torch.manual_seed(0)
    projection = torch.randn(B, N, 3 * h * d)
    strided = projection.view(B, N, 3, h, d).permute(2, 0, 3, 1, 4)  # (3, B, h, N, d), token stride 3C
    embed = torch.randn(1, h, 2, 4, d)
    lam1, lam2, norm1, norm2 = torch.tensor(0.3), torch.tensor(0.4), torch.randn(d), torch.randn(d)
    grad, grad_local = torch.randn(B, N, h * d), torch.randn(B, h * d, grid, grid)
    outputs = []
    for heads in (strided, strided.contiguous()):
        result = torch.randn(B, N, h * d, generator=torch.Generator().manual_seed(1))
        saved = vca_triton.add_attention(result, heads, None, embed, lam1, lam2, norm1, norm2, layout)
        grads = vca_triton.attention_backward(grad, heads, None, saved, embed, lam1, lam2, norm1, norm2, grad_local,
                                              layout)  # fmt: skip
        outputs.append([result, *saved, *(g for g in grads if g is not None)])
    for view, copy in zip(*outputs):
        assert torch.equal(view, copy)


# ----------------------------------------------------------------------------------------------------------------
# Determinism: no atomics, every sum in a fixed order
# ----------------------------------------------------------------------------------------------------------------


def in_reversed_program_order(run):
    """run() with Triton's interpreter running every launch's programs in reverse order (it runs them one by one in
    grid order): a kernel whose result depends on the order its programs finish in, as atomic sums on a GPU do,
    gives other bits."""
    set_index = InterpreterBuilder.set_grid_idx

    def reversed_index(self, i, j, k):
        nx, ny, nz = self.grid_dim
        set_index(self, nx - 1 - i, ny - 1 - j, nz - 1 - k)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InterpreterBuilder, "set_grid_idx", reversed_index)
        return run()


def test_results_do_not_depend_on_the_order_programs_run_in(path):
    """Every output and gradient bitwise the same when each launch's programs run in reverse order: the sums over
    programs (E± over images, λ and the norm weights over heads and rows, T± and V̂ over key and query splits)
    are partials summed in a fixed order, not atomic adds (which on a GPU sum in the order programs finish).
    Two heads of two images: on the split path 6×6 tokens, p = 3 (three key and query splits per head), on the
    per-head path 4×4, p = 2 (its programs and the sum of their partials)."""
    grid, p = (4, 2) if path == "per_head" else (6, 3)
    module = perturbed_vca(32, 2, grid, block_index=2, options=VCAOptions(p)).to(DEVICE)
    module.kernel = "triton"
    x, grad = torch.randn(2, grid**2, 32, device=DEVICE), torch.randn(2, grid**2, 32, device=DEVICE)
    in_order = outputs_and_gradients(module, "forward", x, grad)
    reversed_order = in_reversed_program_order(lambda: outputs_and_gradients(module, "forward", x, grad))
    for name in in_order:
        assert torch.equal(in_order[name], reversed_order[name]), name


def test_the_kernels_before_issue_46_run_for_the_gpu_check_and_fail_the_order_test(monkeypatch):
    """The old kernels (bench/vca_triton_before_46.py, switched in by bench.kernels_before_46 for the GPU check's
    old-against-new comparison) still run through the adapter, from a strided view of q, k, v as the operator now
    passes them, and match the readable path; and the test above tells them apart: their atomic sums give other
    bits when the programs run in reverse order."""
    from bench import kernels_before_46

    monkeypatch.setattr(sys.modules["dit_vca"], "vca_triton", kernels_before_46.adapter())
    module = perturbed_vca(32, 2, 6, block_index=2, options=VCAOptions(3)).to(DEVICE)
    x, grad = torch.randn(2, 36, 32, device=DEVICE), torch.randn(2, 36, 32, device=DEVICE)
    fast, readable = triton_and_readable(module, x, grad)
    assert_fp32_close(fast, readable)
    reversed_order = in_reversed_program_order(lambda: outputs_and_gradients(module, "forward", x, grad))
    assert not all(torch.equal(fast[name], reversed_order[name]) for name in fast)


def test_no_kernel_uses_atomics():
    """No Triton function of the core calls an atomic operation (the compiled code is checked too: the compile
    matrix records every kernel's atomic and fence instructions, tests/test_triton_compile.py)."""
    import inspect

    from dit_vca import vca_triton_per_head, vca_triton_phases, vca_triton_split, vca_triton_stages, vca_triton_tiles

    for module in (vca_triton_tiles, vca_triton_stages, vca_triton_phases, vca_triton_per_head, vca_triton_split):
        assert "tl.atomic_" not in inspect.getsource(module), module.__name__


def core_arguments(
    options: VCAOptions, recompute: bool, qk_norm: bool = False, rope: bool = False, triton: bool = True
) -> tuple:
    """The arguments of dit_vca::vca_core for a small layer (N = 16, n = 4, d = 16), on the Triton path (or the
    ATen path), computed in float32: x, the layer's tensors that exist (copies that require grad; the RoPE tables:
    constants), which of CoreTensors' fields they fill, the dtype and the layout."""
    module = perturbed_vca(32, 2, 4, block_index=2, options=options, qk_norm=qk_norm, rope=rope).to(DEVICE)
    switches = (options.joint_softmax, options.stage1_differential, options.stage2_differential, options.pooled_content)
    qk_norm_eps = 1e-6 if qk_norm else None
    layout = KernelLayout(2, 4, 2, *switches, module.lambda_init, 1e-5, recompute, False, triton, qk_norm_eps)
    captured = {}

    def capture(x, tensors, layout, dtype=None):  # the core's arguments as the layer passes them
        captured["tensors"] = tensors
        return x

    with mock.patch("dit_vca.attention.vca_core", capture):
        module.core(torch.randn(2, 16, 32, device=DEVICE), triton)
    tables = {"rope_cos", "rope_sin", "contrast_cos", "contrast_sin"}
    present = [t is not None for t in captured["tensors"]]
    tensors = [
        t.detach().clone().requires_grad_(name not in tables)
        for name, t in captured["tensors"]._asdict().items()
        if t is not None
    ]
    x = torch.randn(2, 16, 32, device=DEVICE, requires_grad=True)
    return (x, tensors, present, torch.float32, *layout.as_args())


@pytest.mark.parametrize(
    "options,recompute,block_options,triton",
    [
        (VCAOptions(contrast_grid=2), False, {}, True),
        (VCAOptions(contrast_grid=2), True, dict(qk_norm=True, rope=True), False),
    ],
    ids=["plain", "qk_norm+rope-aten"],
)
def test_triton_operator_passes_opcheck(options, recompute, block_options, triton):
    """The operator on the Triton path, as torch.compile and AOTAutograd see it: schema, fake kernel against
    the real one (shapes, strides, dtypes), autograd registration, AOT dispatch with its backward. With QK-norm's
    gains and RoPE's tables among its arguments on the ATen path: the options change the schema and the
    backward's outputs, not what the Triton path saves (the plain case checks that), and the interpreter would
    take ten times as long (18 s against 1.6 s here)."""
    arguments = core_arguments(options, recompute, **block_options, triton=triton)
    torch.library.opcheck(torch.ops.dit_vca.vca_core.default, arguments)


# Operators that compute nothing (views, allocations, dtype queries); one that copies (`to`, `reshape`) counts
# through the copy it dispatches.
METADATA_OPS = frozenset(
    "empty empty_like new_empty empty_strided new_empty_strided view reshape _reshape_alias permute transpose t "
    "numpy_T select slice expand as_strided unsqueeze squeeze detach alias unflatten flatten unbind split lift_fresh "
    "_unsafe_view resolve_conj resolve_neg promote_types result_type contiguous to view_as expand_as "
    "split_with_sizes".split()
)
TRITON_LAUNCH = "triton launch"  # the profiler range around each kernel launch (layer_launches)
CORE = "vca core"  # the profiler range around the core's forward and backward (layer_launches)


@dataclasses.dataclass
class Launches:
    """What one forward + backward of a layer launches: ATen operators that compute (each counted once, where the
    Python code calls it: the operators it calls in turn are its own work), how many of them run inside the core
    (dit_vca/vca_core.py), and the Triton kernels, by name."""

    aten: Counter
    in_core: int
    triton: Counter

    @property
    def total(self) -> int:
        return sum(self.aten.values()) + sum(self.triton.values())


def layer_launches(module: torch.nn.Module, x: torch.Tensor, autocast: torch.dtype | None = None) -> Launches:
    """The launches of `module(x)` and its backward (of the output's sum), under autocast to `autocast` if given.
    Every Triton launch (`kernel[grid](...)`, whatever the kernel module calls it) runs inside a profiler range of
    its own, so that the interpreter's work inside it (copies of its arguments) is not counted as ATen's; so do the
    core's forward and backward (dit_vca.vca_core), which tells the operators inside it from those around it."""
    x = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    original = triton.runtime.jit.KernelInterface.__getitem__
    launched = Counter()

    def launch(kernel, grid):
        run = original(kernel, grid)

        def ranged(*args, **kwargs):
            launched[kernel_function(kernel).__name__] += 1
            with torch.profiler.record_function(TRITON_LAUNCH):
                return run(*args, **kwargs)

        return ranged

    def in_range(function):  # the core's forward or backward inside a profiler range of its own
        def ranged(*args, **kwargs):
            with torch.profiler.record_function(CORE):
                return function(*args, **kwargs)

        return ranged

    with (
        mock.patch.object(triton.runtime.jit.KernelInterface, "__getitem__", launch),
        mock.patch.object(vca_core, "_core_forward", in_range(vca_core._core_forward)),
        mock.patch.object(vca_core, "_core_backward", in_range(vca_core._core_backward)),
        profile(activities=[ProfilerActivity.CPU]) as prof,
    ):
        with torch.autocast(x.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = module(x)
        out.float().sum().backward()

    def computes(event) -> bool:
        if event.name.removeprefix("aten::") not in METADATA_OPS:
            return True
        return any(computes(child) for child in event.cpu_children if child.name.startswith("aten::"))

    counted, in_core = Counter(), 0
    for event in prof.events():
        ancestors, parent = [], event.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        if not event.name.startswith("aten::") or any(a.startswith(("aten::", TRITON_LAUNCH)) for a in ancestors):
            continue
        if computes(event):
            counted[event.name] += 1
            in_core += CORE in ancestors
    return Launches(counted, in_core, launched)


def kernel_function(kernel):
    """The Python function under a Triton kernel object (an autotuner, a JIT or an interpreted function)."""
    while hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel


def test_triton_layer_launches_a_small_constant_number_of_kernels(path):
    """The layer's forward + backward on either Triton path: the same launches at two sizes (nothing per tile,
    token, head or image), all but the test's loss inside the core; ATen's path dispatches three times more
    operators (its element-wise work, one operator each)."""
    counts = {}
    for kernel, (grid, batch) in (("triton", (4, 1)), ("triton", (6, 2)), ("aten", (4, 1))):
        module = perturbed_vca(32, 2, grid, block_index=3, options=VCAOptions()).to(DEVICE)
        module.kernel = kernel
        counts[kernel, grid] = layer_launches(module, torch.randn(batch, grid * grid, 32, device=DEVICE))
    small, large, aten = counts["triton", 4], counts["triton", 6], counts["aten", 4]
    assert small == large, (small, large)
    # Outside the core: the loss's sum, the gradient of that sum (ones_like).
    assert sum(small.aten.values()) - small.in_core == 2, small
    assert sum(aten.aten.values()) >= 3 * sum(small.aten.values()), (aten, small)


# The issue's bound (issue 46): launches of one VCA layer's forward + backward under bf16 autocast, ATen operators
# that compute and Triton kernels together, where MHSA launches some twenty and VCA launched 80 before.
LAYER_LAUNCHES = 36


def test_layer_launches_at_most_36_kernels_forward_and_backward_under_bf16_autocast():
    """A small layer (C = 32, 2 heads, 4×4 tokens) on the Triton path, bf16 autocast, forward + backward of the
    output's sum: x and the parameters cast to bf16 once, together, and kept for the backward (no cast there; the
    gradients cast back together), λ₁ and λ₂ from their vectors inside the core in ten launches, forward and
    backward, the value image built once, q, k, v read through strides. Measured (CPU, torch 2.14, the per-head
    kernels): 28 ATen operators (4 of them the loss's: its .float(), sum and their gradients; no zero fill, no copy
    of q, k, v) and 3 Triton launches: 31; MHSA 21 operators; 80 before issue 46 (73 operators, 26 of them λ's),
    41 with the lean host path on issue 37's kernels (their 5 zero fills, a head-major copy, 7 launches)."""
    module = perturbed_vca(32, 2, 4, block_index=3, options=VCAOptions()).to(DEVICE)
    module.kernel = "triton"
    x = torch.randn(1, 16, 32, device=DEVICE)
    launches = layer_launches(module, x, torch.bfloat16)
    ops = launches.aten
    assert ops["aten::_foreach_copy_"] == 2 and ops["aten::to"] == 2, launches  # the loss's .float() and its grad
    # λ: stack, mul, sum, exp_, sub, add_ forward; stack, mul, neg_, mul backward. The five sums: λ's, the three
    # biases' gradients, the loss.
    lambdas = [ops[f"aten::{op}"] for op in ("stack", "mul", "exp_", "sub", "add_", "neg_", "sum")]
    assert lambdas == [2, 3, 1, 1, 1, 1, 5], launches
    assert launches.total <= LAYER_LAUNCHES, launches
    mhsa = layer_launches(MultiHeadSelfAttention(32, 2).to(DEVICE), x, torch.bfloat16)
    assert mhsa.total < launches.total, mhsa


@pytest.mark.slow
def test_qk_norm_and_rope_add_only_a_constant_number_of_aten_ops_inside_the_core():
    """With QK-norm and RoPE the layer is still the one core: the operations outside it are those of the plain
    layer (the test's loss), and inside it the pre-step (dit_vca.vca_qk) adds element-wise operations whose number
    does not grow with the tokens, images or heads. Measured (CPU, torch 2.14): 100 inside the core against 22
    plain: norms and rotations of q and k together, forward, recomputed in backward, and turned back."""
    counts = {}
    for block_options, (grid, batch) in (({}, (4, 1)), (dict(qk_norm=True, rope=True), (4, 1)),
                                         (dict(qk_norm=True, rope=True), (6, 2))):  # fmt: skip
        module = perturbed_vca(32, 2, grid, block_index=3, options=VCAOptions(), **block_options).to(DEVICE)
        module.kernel = "triton"
        launches = layer_launches(module, torch.randn(batch, grid * grid, 32, device=DEVICE))
        counts[bool(block_options), grid] = sum(launches.aten.values()), launches.in_core
    (plain, plain_core), (small, small_core), (large, large_core) = counts.values()
    assert (small, small_core) == (large, large_core), counts
    assert small - small_core == plain - plain_core, counts  # nothing around the core
    assert small_core <= plain_core + 80, counts


def test_kernel_choice():
    module = VisualContrastAttention(32, 2, 4, 0)
    assert module.kernel is None and module.uses_triton("cuda") and not module.uses_triton("cpu")
    module.kernel = "aten"
    assert not module.uses_triton("cuda")
    module.kernel = "cuda"
    with pytest.raises(ValueError, match="kernel='cuda'"):
        module(torch.randn(1, 16, 32))


def test_triton_core_counts_the_products_it_runs():
    """FlopCounterMode sees the operator, not its kernels: its formula for the Triton path counts their products,
    Stage II's value product once for a joint softmax (7·n·N·C + 9·N·C, as VCA.md's cost) and once per stream
    for two softmaxes (8·n·N·C + 9·N·C)."""

    dim, tokens, n = 384, 256, 64
    for joint, products in ((True, 7), (False, 8)):
        with torch.device("meta"):  # shapes only: the fake kernel runs, the formula counts
            vca = VisualContrastAttention(dim, 6, 16, 0, VCAOptions(contrast_grid=8, joint_softmax=joint))
            vca.kernel = "triton"
            assert (
                core_multiply_adds(vca, torch.empty(1, tokens, dim)) == products * n * tokens * dim + 9 * tokens * dim
            )


# ----------------------------------------------------------------------------------------------------------------
# The launch plan: products, grids
# ----------------------------------------------------------------------------------------------------------------


def triton_layout(heads: int, grid: int, options: VCAOptions) -> KernelLayout:
    """The core's layout for a layer of `heads` heads on grid×grid tokens, on the Triton path."""
    p = grid // 2 if options.contrast_grid is None else options.contrast_grid
    switches = (options.joint_softmax, options.stage1_differential, options.stage2_differential, options.pooled_content)
    return KernelLayout(heads, grid, p, *switches, 0.2, 1e-5, recompute_qkv=False, stage2_sdpa=False, triton=True)


def plan_of(B: int, grid: int, C: int, heads: int, options: VCAOptions, path: str | None = None, **platform):
    """The launch plan of a layer of width C on grid×grid tokens, B images, bf16, on the given platform (by default
    the interpreter's)."""
    heads_tensor = torch.empty(3, B, heads, grid * grid, C // heads, dtype=torch.bfloat16, device="meta")
    shape = vca_triton.core_shape(heads_tensor, triton_layout(heads, grid, options))
    shape = dataclasses.replace(shape, **platform)
    return vca_triton_plan.launch_plan(shape, path)


def products_by_kernel(run) -> Counter:
    """Multiply-adds of every tl.dot that Triton's interpreter executes during `run()`, by kernel: each call of
    the interpreter's dot, (M, K) @ (K, N) tiles, counts M·K·N for the innermost `*_kernel` function on the
    Python stack (the kernels call tl.dot through helpers)."""
    counts, dot = Counter(), InterpreterBuilder.create_dot

    def counting_dot(self, a, b, *args):
        frame = sys._getframe(1)
        while not frame.f_code.co_name.endswith("_kernel"):
            frame = frame.f_back
        (m, k), n = a.data.shape, b.data.shape[1]
        counts[frame.f_code.co_name] += m * k * n
        return dot(self, a, b, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InterpreterBuilder, "create_dot", counting_dot)
        run()
    return counts


@pytest.mark.parametrize(
    "options",
    [VCAOptions(3), VCAOptions(3, joint_softmax=False, stage1_differential=False, pooled_content=False)],
    ids=switch_ids,
)
def test_the_plan_counts_the_products_the_kernels_run(path, options):
    """The plan's tile products (grid × loop trips × products per trip, per launch) against every tl.dot the
    interpreter runs in one forward + backward: N = 36 tokens and n = 9 contrast tokens in tiles of 16 (partial
    tiles padded), d = 40 in pieces of 32 + 16; one softmax with both stages differential, and two softmaxes with
    Stage I plain."""
    module = perturbed_vca(80, 2, 6, block_index=3, options=options)
    module.kernel = "triton"
    x = torch.randn(1, 36, 80, requires_grad=True)
    counted = products_by_kernel(lambda: module(x).sum().backward())
    plan = vca_triton_plan.launch_plan(
        vca_triton.core_shape(torch.empty(3, 1, 2, 36, 40, device="meta"), triton_layout(2, 6, options)), path
    )
    planned = Counter()
    for launch in (*plan.forward, *plan.backward):
        planned[launch.kernel] += launch.tile_products
    assert counted == +planned, (counted, planned)


XL_SHAPES = [(64, 256), (32, 256), (1, 4096), (1, 16384), (1, 65536)]  # (B, N)


@pytest.mark.parametrize("B,N", XL_SHAPES, ids=[f"{b}x{n}" for b, n in XL_SHAPES])
def test_every_launch_fills_the_gpu_or_keeps_its_loops_short(B, N):
    """Issue 46's bound at DiT-XL/2's width (C = 1152, 16 heads, d = 72, n = 64 contrast tokens) on an H100 or H200
    (132 multiprocessors) with its compiled tiles: every launch of the path the plan picks has ≥ 2 × 132 programs
    or ≤ 16 serial loop trips per program. The short sequences take the per-head path, the long ones the split
    path."""
    plan = plan_of(B, math.isqrt(N), 1152, 16, VCAOptions(8), platform=("sm_90", "3.6.0"))
    assert plan.path == ("per_head" if N == 256 else "split"), plan.path
    for launch in (*plan.forward, *plan.backward):
        assert launch.programs >= 2 * 132 or launch.trips <= 16, launch.as_row()


@pytest.mark.parametrize("B,N", XL_SHAPES, ids=[f"{b}x{n}" for b, n in XL_SHAPES])
def test_both_paths_multiply_what_the_method_costs(B, N):
    """Tile products against VCA.md's count of the core's products (7·n·N·C forward, one softmax) at the XL shapes
    on the compiled tiles: the padding (d = 72 in 80 columns, partial tiles) and the backward's recomputation of the
    forward keep the forward within 1.2× of the count and the backward within 4.1× (the split path, which reads
    what its forward saved: within 3×)."""
    for path in PATHS:
        plan = plan_of(B, math.isqrt(N), 1152, 16, VCAOptions(8), path, platform=("sm_90", "3.6.0"))
        forward = sum(launch.tile_products for launch in plan.forward)
        backward = sum(launch.tile_products for launch in plan.backward)
        method = 7 * 64 * N * 1152 * B
        assert method <= forward <= 1.2 * method, (path, forward / method)
        assert backward <= (4.1 if path == "per_head" else 3) * forward, (path, backward / forward)


# ----------------------------------------------------------------------------------------------------------------
# 64-bit offsets
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _offsets_probe(out, g, length, d):
    """Stores the kernels' 64-bit offset of head g (an argument: a launch of B·h programs is not needed to see
    its arithmetic) and the same product in the 32 bits of g."""
    tl.store(out, start64(g, length * d))
    tl.store(out + 1, g * length * d)


def test_head_offsets_are_64_bit_past_two_to_the_31():
    """The last head of DiT-XL/2 at N = 16384 tokens and B = 120 images: its offset into a (G, N, d) tensor
    (B·N·C = 2.26·10⁹ > 2³¹) is exact; the same product in 32 bits wraps (the control: the interpreter shows
    int32 overflow as the GPU has it)."""
    B, h, N, d = 120, 16, 16384, 72
    g = B * h - 1
    out = torch.zeros(2, dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's overflow warning of the control
        _offsets_probe[(1,)](out, g, N, d)
    assert out[0] == g * N * d > 2**31 - 1
    assert out[1] != g * N * d  # wrapped


def test_an_image_past_two_to_the_31_elements_is_refused_in_one_line():
    layout = triton_layout(16, 128, VCAOptions(8))  # N = 16384 tokens of C = 49152 channels: N·3C = 2.4·10⁹
    heads = torch.empty(3, 1, 16, 2**14, 3 * 2**10, device="meta")
    with pytest.raises(ValueError, match=r"^kernel='triton' takes at most 2\^31 - 1 elements per image"):
        vca_triton.saved_like(heads, layout)


def test_the_roofline_estimates_the_xl_layer_at_256_tokens_by_64_images_no_slower_than_mhsa():
    """Issue 46's bound on the estimate (bench/roofline.py: the plan's bytes and FLOPs against the datasheets'
    peaks, MHSA's FlashAttention-2 counted the same way): DiT-XL/2's layer, forward + backward in bf16 at N = 256
    and B = 64, at or below MHSA's on an H100 and an H200."""
    from bench import roofline

    for gpu in roofline.GPUS[:2]:
        estimate = roofline.estimate(64, 256, gpu)
        assert estimate["path"] == "per_head" and estimate["layer_ratio"] <= 1.0, (gpu.name, estimate["layer_ratio"])


def test_the_roofline_shows_measured_times_beside_its_estimates():
    from bench import roofline

    profile = {"device": "NVIDIA H200 SXM", "cases": {"64x256": {"per_head_forward_kernel": 0.25, "other": 0.5}}}
    table = roofline.markdown(roofline.results(profile))
    assert "| core forward | `per_head_forward_kernel` | 1024 |" in table and " | 250.0 |" in table
    assert "| measured only | `other` | | | | | 500.0 |" in table


def test_the_roofline_writes_its_table_and_plot(tmp_path):
    from bench import roofline

    roofline.main(["--out", str(tmp_path)])
    for suffix in (".json", ".md", ".png"):
        assert (tmp_path / f"roofline{suffix}").stat().st_size > 0
    estimates = json.loads((tmp_path / "roofline.json").read_text())["estimates"]
    assert len(estimates) == len(roofline.GPUS) * len(roofline.SHAPES)


def test_only_the_benchmark_switch_brings_the_old_kernels_back(monkeypatch):
    """bench.kernels_before_46 installs the old kernels when VCA_BENCH_KERNELS=before-46 (for the GPU check's
    comparison), not otherwise, and refuses another value."""
    from bench import kernels_before_46

    monkeypatch.setattr(sys.modules["dit_vca"], "vca_triton", vca_triton)
    monkeypatch.setitem(sys.modules, "dit_vca.vca_triton", vca_triton)
    monkeypatch.delenv(kernels_before_46.SWITCH, raising=False)
    assert not kernels_before_46.install_from_environment() and sys.modules["dit_vca.vca_triton"] is vca_triton
    monkeypatch.setenv(kernels_before_46.SWITCH, "new")
    with pytest.raises(ValueError, match="VCA_BENCH_KERNELS='new': expected 'before-46' or unset"):
        kernels_before_46.install_from_environment()
    monkeypatch.setenv(kernels_before_46.SWITCH, "before-46")
    assert kernels_before_46.install_from_environment()
    from dit_vca import vca_triton as installed

    assert installed is not vca_triton and "before issue 46" in installed.__doc__
