"""VCA's core on the Triton kernels (dit_vca.vca_triton) against the readable path, outputs and every gradient;
the operators' registration (opcheck); the ATen operations a layer dispatches on the Triton path.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before triton is imported): the same kernels a GPU compiles, each program executed in numpy.
The interpreter executes programs one by one, so the shapes are small (N = 16–64, n = 4–36, d = 16, 40, 72);
they still cross every tile boundary of the interpreter's block sizes (16: several key, query and contrast
tiles, the last one partial) and the padding of head dimensions that are not powers of two.
"""

import itertools
from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dit_vca.attention import VCAOptions, VisualContrastAttention
from dit_vca.vca_core import KernelLayout
from test_attention import outputs_and_gradients, perturbed_vca, switch_ids

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ALL_OPTIONS = [VCAOptions(3, *values) for values in itertools.product((True, False), repeat=4)]  # p = 3


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
        # fp32 on both sides; the kernels sum in another order (online softmax over tiles, atomics across
        # programs) than the readable path's GEMMs, which moves results by a few fp32 roundings of the largest
        # terms (observed ≤ 1e-6 relative to the tensor's largest entry). The λ vectors' gradient is dλ·∂λ/∂vector
        # with dλ a sum of N·n terms that largely cancel, hence its looser bound (as in test_attention's
        # test_fast_path_equals_readable_path). A wrong formula is off by O(1).
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("options", ALL_OPTIONS, ids=switch_ids)
def test_triton_equals_readable_path_for_every_switch(options, dtype):
    """6×6 tokens (N = 36: three key and query tiles of 16, the last partial), p = 3 (n = 9: a partial block of
    contrast tokens, pooling windows of 2×2), d = 16; fp32, and bf16 under autocast."""
    module = perturbed_vca(32, 2, 6, block_index=3, options=options)
    x, grad = torch.randn(1, 36, 32), torch.randn(1, 36, 32)
    if dtype == torch.float32:
        assert_fp32_close(*triton_and_readable(module, x, grad))
    else:
        assert_half_close(module, x, grad, dtype)


@pytest.mark.parametrize(
    "dim,heads,grid,contrast_grid,batch,recompute",
    [
        (80, 2, 6, 6, 1, False),  # d = 40, n = 36 = N: Stage II streams 3 column tiles, pooling windows of 1
        (144, 2, 8, None, 2, True),  # d = 72 (DiT-XL/2's), N = 64, n = 16, two images (E± summed over the batch)
        (64, 2, 4, 2, 2, False),  # d = 32, N = 16, n = 4
    ],
)
def test_triton_head_dims_and_grids(dim, heads, grid, contrast_grid, batch, recompute):
    module = perturbed_vca(dim, heads, grid, block_index=1, options=VCAOptions(contrast_grid))
    module.recompute_qkv = recompute
    x, grad = torch.randn(batch, grid * grid, dim), torch.randn(batch, grid * grid, dim)
    assert_fp32_close(*triton_and_readable(module, x, grad))


@pytest.mark.parametrize(
    "options,dim,dtype",
    [(VCAOptions(joint_softmax=False), 144, torch.bfloat16), (VCAOptions(pooled_content=False), 80, torch.float16)],
    ids=["bf16-two-softmaxes-d72", "fp16-embeddings-only-d40"],
)
def test_triton_under_half_precision_autocast_matches_readable_path(options, dim, dtype):
    """Wider heads (d = 72 and 40, padded to 128 and 64) on 8×8 tokens, two images, in bf16 and fp16."""
    module = perturbed_vca(dim, 2, 8, block_index=3, options=options)
    assert_half_close(module, torch.randn(2, 64, dim), torch.randn(2, 64, dim), dtype)


def core_arguments(options: VCAOptions, recompute: bool) -> tuple:
    """The tensor and scalar arguments of dit_vca::vca_core for a small layer (N = 16, n = 4, d = 16), on the
    Triton path; tensors that require grad."""
    module = perturbed_vca(32, 2, 4, block_index=2, options=options).to(DEVICE)
    switches = (options.joint_softmax, options.stage1_differential, options.stage2_differential, options.pooled_content)
    layout = KernelLayout(2, 4, 2, *switches, module.lambda_init, 1e-5, recompute, stage2_sdpa=False, triton=True)
    with torch.no_grad():
        lambdas = [module.lambda1() if options.stage1_differential else None]
        lambdas += [module.lambda2() if options.stage2_differential else None]
    tensors = [
        torch.randn(2, 16, 32, device=DEVICE),
        module.qkv.weight,
        module.qkv.bias,
        module.contrast_embed,
        *lambdas,
        module.norm1.weight if options.stage1_differential else None,
        module.norm2.weight if options.stage2_differential else None,
        module.value_conv.weight,
        module.value_conv.bias,
    ]
    tensors = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    return (*tensors, *layout.as_args())


@pytest.mark.parametrize("options,recompute", [(VCAOptions(contrast_grid=2), False)])
def test_triton_operator_passes_opcheck(options, recompute):
    """The operator on the Triton path, as torch.compile and AOTAutograd see it: schema, fake kernel against
    the real one (shapes, strides, dtypes), autograd registration, AOT dispatch with its backward."""
    torch.library.opcheck(torch.ops.dit_vca.vca_core.default, core_arguments(options, recompute))


# Operators that compute nothing (views, allocations, dtype queries); one that copies (`to`, `reshape`) counts
# through the copy it dispatches.
METADATA_OPS = frozenset(
    "empty empty_like new_empty empty_strided view reshape _reshape_alias permute transpose t numpy_T select slice "
    "expand as_strided unsqueeze squeeze detach alias unflatten flatten unbind split lift_fresh _unsafe_view "
    "resolve_conj resolve_neg promote_types result_type contiguous to view_as expand_as".split()
)


def aten_compute_ops(module: VisualContrastAttention, x: torch.Tensor) -> tuple[Counter, int]:
    """The ATen operators that one forward + backward of `module` dispatches (each counted once, where the
    Python code calls it: the operators it calls in turn are its own work), without the kernels' own
    ranges (under the interpreter those copy their arguments); and how many of them the core's two custom
    operators dispatch."""
    x = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        module(x).sum().backward()

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
        if not event.name.startswith("aten::") or any(a.startswith(("aten::", "vca_triton.")) for a in ancestors):
            continue
        if computes(event):
            counted[event.name] += 1
            in_core += any(a.startswith("dit_vca::vca_core") for a in ancestors)
    return counted, in_core


def test_triton_layer_dispatches_a_small_constant_number_of_aten_ops():
    """The layer's forward + backward on the Triton path: the same count at two sizes (nothing per tile, token
    or head), the core's operators themselves only the projection and convolution with their gradients and a
    few allocations; ATen's path dispatches three times more (its element-wise work, one operator each)."""
    counts = {}
    for kernel, (grid, batch) in (("triton", (4, 1)), ("triton", (6, 2)), ("aten", (4, 1))):
        module = perturbed_vca(32, 2, grid, block_index=3, options=VCAOptions()).to(DEVICE)
        module.kernel = kernel
        counts[kernel, grid] = aten_compute_ops(module, torch.randn(batch, grid * grid, 32, device=DEVICE))
    (small, small_core), (large, large_core) = counts["triton", 4], counts["triton", 6]
    assert small == large and small_core == large_core, (small, large)
    # Measured (CPU, torch 2.14): 51 for the whole layer, 26 of them the two λ scalars and their backward
    # (outside the core) and the test's sum and its gradient; 18 inside the core's two operators: the qkv GEMM
    # and its bias, the value image, the convolution; the convolution's backward and its bias's sum, the qkv
    # backward's two GEMMs and bias sum, five zero-filled float32 accumulators of the kernels' atomic sums and
    # the conv weight's gradient laid out as the weight. ATen's path: 156 (119 inside the core).
    assert sum(small.values()) <= 52 and small_core <= 18, (small, small_core)
    aten, aten_core = counts["aten", 4]
    assert sum(aten.values()) >= 3 * sum(small.values()) - 10 and aten_core >= 5 * small_core, (aten, aten_core)


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
    from test_attention import core_multiply_adds

    dim, tokens, n = 384, 256, 64
    for joint, products in ((True, 7), (False, 8)):
        with torch.device("meta"):  # shapes only: the fake kernel runs, the formula counts
            vca = VisualContrastAttention(dim, 6, 16, 0, VCAOptions(contrast_grid=8, joint_softmax=joint))
            vca.kernel = "triton"
            assert (
                core_multiply_adds(vca, torch.empty(1, tokens, dim)) == products * n * tokens * dim + 9 * tokens * dim
            )
