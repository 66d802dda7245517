"""VCA's core as fused Triton kernels: the `kernel="triton"` implementation of dit_vca::vca_core and its backward.

dit_vca.vca_core calls the three entry points here, `add_attention`, `attention_backward` and `saved_like`, when
its layout's `triton` is set (VisualContrastAttention.kernel; by default on CUDA); dit_vca.vca_aten has the same
entry points on ATen operations (the CPU path and the reference). The qkv projection, the depthwise 3×3
convolution of v and the GEMMs of the qkv backward stay in vca_core (cuBLAS/cuDNN); both attention stages run in
the kernels, on one of two paths the launch plan (dit_vca.vca_triton_plan) picks per shape:
- per head (dit_vca.vca_triton_per_head): one program per (image, head), one kernel forward, one backward;
- split (dit_vca.vca_triton_split): a head's keys and queries split over many programs, for long sequences or
  more contrast tokens than one block holds;
then `sum_partials_kernel` (dit_vca.vca_triton_phases) sums the per-program partial gradients in a fixed order.
No kernel uses atomics, so two backward runs give the same bits. The tiles each kernel uses are declared, with
where they must not run, in dit_vca.vca_triton_configs.

Inputs as the kernels read them: q, k, v `heads` (3, B, h, N, d) may be any strided view whose last dimension has
stride 1 (e.g. the qkv GEMM's (B, N, 3C) output seen as (B, N, 3, h, d).permute(2, 0, 3, 1, 4)); `result` and
`grad` (B, N, C) and the convolution's share of dv `grad_local` (B, C, H, W) likewise (last dimension, or for
grad_local the channels, of stride 1, else they are copied); the parameters in the core's dtype. Offsets inside one
image are 32-bit: an image whose qkv gradient has 2³¹ elements or more is refused.

Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported) runs the same kernels on CPU tensors: that
is how the tests check them, with every configuration's blocks at 16 (dit_vca.vca_triton_configs).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from dit_vca.vca_triton_configs import INTERPRETED, current_platform
from dit_vca.vca_triton_per_head import per_head_backward_kernel, per_head_forward_kernel
from dit_vca.vca_triton_phases import sum_partials_kernel
from dit_vca.vca_triton_plan import (
    DEFAULT_MULTIPROCESSORS,
    CoreShape,
    Launch,
    Plan,
    backward_scratch,
    head_pieces,
    launch_plan,
)
from dit_vca.vca_triton_split import (
    pool_backward_kernel,
    pool_kernel,
    stage1_backward_kernel,
    stage1_combine_kernel,
    stage1_norm_backward_kernel,
    stage1_partial_forward_kernel,
    stage2_backward_kernel,
    stage2_forward_kernel,
    streams_backward_kernel,
)

FLOATS = torch.float32


def _check_device(x: Tensor) -> None:
    if x.device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"kernel='triton' on {x.device.type} tensors needs Triton's interpreter: set TRITON_INTERPRET=1 before "
            "triton is first imported, or use kernel='aten'"
        )


def precision_name(dtype: torch.dtype) -> str:
    """The case's precision (dit_vca.vca_triton_configs.PRECISIONS): bf16, fp16, or float32's tf32 or ieee."""
    if dtype == torch.float32:
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def _dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: TF32 for float32 where PyTorch allows it for matmuls, else IEEE; "upcast" for bf16
    under the interpreter (dit_vca.vca_triton_tiles.dot)."""
    if dtype == torch.bfloat16 and INTERPRETED:
        return "upcast"
    return "tf32" if precision_name(dtype) == "tf32" else "ieee"


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessors (the plan fills them); DEFAULT_MULTIPROCESSORS without a GPU (the interpreter, fake
    tensors)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_MULTIPROCESSORS


def core_shape(heads: Tensor, layout, given_content: bool = False) -> CoreShape:
    """The launch plan's view of q, k, v `heads` (3, B, h, N, d) and the layout (KernelLayout)."""
    _, B, h, N, d = heads.shape
    if N * 3 * h * d >= 2**31:  # offsets inside one image are 32-bit (see the module docstring)
        raise ValueError(f"kernel='triton' takes at most 2^31 - 1 elements per image of the qkv gradient; "
                         f"N·3C = {N}·{3 * h * d}: use kernel='aten'")  # fmt: skip
    return CoreShape(
        B, N, h, d, layout.grid_size, layout.contrast_grid, layout.joint_softmax, layout.stage1_differential,
        layout.stage2_differential, layout.pooled_content, given_content, precision_name(heads.dtype),
        heads.element_size(), _multiprocessors(heads.device), current_platform(),
    )  # fmt: skip


def saved_like(heads: Tensor, layout) -> list[Tensor]:
    """Empty tensors of the shapes and dtypes of what `add_attention` saves for the backward (the operator's fake
    kernel returns these). The per-head path saves nothing (its backward recomputes the contrast tokens and Stage
    I). The split path saves T± (G, S·n, d) and V̂ (G, n, d) in q's dtype, R± (G, m1, d) and their log-sum-exps
    (G, m1) in float32, O (O⁺ and O⁻ for two softmaxes, flat K·G·N·d) in q's dtype and its log-sum-exps (K·G·N) in
    float32, K = 1 or 2 softmaxes."""
    shape = core_shape(heads, layout)
    return _saved(heads, shape, launch_plan(shape))


def _saved(heads: Tensor, shape: CoreShape, plan: Plan) -> list[Tensor]:
    """`saved_like` for the shape and plan a call has already made."""
    if plan.path == "per_head":
        return []
    G, N, n, d = shape.G, shape.N, shape.n, shape.d
    K = 2 if shape.two_softmaxes else 1
    return [
        heads.new_empty(G, shape.S * n, d),
        heads.new_empty(G, n, d),
        heads.new_empty(G, shape.M1 * n, d, dtype=FLOATS),
        heads.new_empty(G, shape.M1 * n, dtype=FLOATS),
        heads.new_empty(K * G * N * d),
        heads.new_empty(K * G * N, dtype=FLOATS),
    ]


def _run(kernel, launch: Launch, *args, **constexprs) -> None:
    """`kernel[grid]` with the plan's grid, blocks and configuration, inside a profiler range named after it:
    profiles on the GPU show each launch by name, and the tests tell the kernels' own work (under the interpreter:
    copies of its arguments) from the ATen operations the core dispatches."""
    with torch.profiler.record_function(f"vca_triton.{launch.kernel}"):
        options = {"num_warps": launch.config.num_warps, "num_stages": launch.config.num_stages}
        kernel[launch.grid](*args, **constexprs, **launch.blocks, **options)


def _last_stride_one(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _Arguments:
    """What every launch of one core call shares: the tensors' pointers and strides, the sizes and switches."""

    def __init__(self, heads: Tensor, pooled: Tensor | None, embed: Tensor, layout, shape: CoreShape):
        self.shape, self.layout = shape, layout
        self.q, self.k, self.v = heads.unbind(0)
        self.strides = heads.stride()[1:4]  # batch, head, token: q, k and v share them
        self.given = heads if pooled is None else _last_stride_one(pooled)
        self.given_strides = (0, 0, 0) if pooled is None else self.given.stride()[:3]
        self.embed = embed.contiguous()
        self.scale, self.out_scale = shape.d**-0.5, 1 - layout.lambda_init
        D0, D1 = head_pieces(shape.d)
        self.switches = dict(S=shape.S, DIFF1=shape.stage1_differential, DIFF2=shape.stage2_differential)
        self.pieces = dict(PRECISION=_dot_precision(heads.dtype), D0=D0, D1=D1)

    def parameter(self, t: Tensor | None) -> Tensor:
        return self.q if t is None else t  # a pointer a kernel never reads (its switch is off)


def _plan(heads: Tensor, layout, pooled: Tensor | None) -> tuple[CoreShape, Plan]:
    shape = core_shape(heads, layout, given_content=pooled is not None and layout.pooled_content)
    return shape, launch_plan(shape)


def add_attention(
    result: Tensor,
    heads: Tensor,
    pooled: Tensor | None,
    embed: Tensor,
    lambda1: Tensor | None,
    lambda2: Tensor | None,
    norm1: Tensor | None,
    norm2: Tensor | None,
    layout,
) -> list[Tensor]:
    """Adds both attention stages of the VCA core, computed from q, k, v `heads` (3, B, h, N, d), into `result`
    (B, N, C) (the depthwise convolution's output); returns what `attention_backward` needs besides the
    operator's inputs (see `saved_like`). `pooled` (B, h, n, d): the streams' content T given (with RoPE:
    dit_vca.vca_qk), else the pool of q."""
    _check_device(heads)
    shape, plan = _plan(heads, layout, pooled)
    a = _Arguments(heads, pooled, embed, layout, shape)
    saved = _saved(heads, shape, plan)
    content = dict(CONTENT=layout.pooled_content, GIVEN=pooled is not None)
    if plan.path == "per_head":
        [launch] = plan.forward
        _run(per_head_forward_kernel, launch, a.q, a.k, a.v, a.given, a.embed, a.parameter(lambda1),
             a.parameter(norm1), a.parameter(lambda2), a.parameter(norm2), result, *a.strides, *a.given_strides,
             result.stride(0), result.stride(1), shape.h, shape.N, shape.H, shape.p, shape.d, a.scale, layout.eps,
             a.out_scale, JOINT=layout.joint_softmax, **a.switches, **content, **a.pieces)  # fmt: skip
        return saved
    streams, v_hat, reads, lse1, outs, lse2 = saved
    pool, partial_forward, combine, stage2 = plan.forward
    G, n, d = shape.G, shape.n, shape.d
    m1 = shape.M1 * n
    _run(pool_kernel, pool, a.q, a.given, a.embed, streams, *a.strides, *a.given_strides, shape.h, shape.H,
         shape.p, d, S=shape.S, **content, D0=a.pieces["D0"], D1=a.pieces["D1"])  # fmt: skip
    key_splits = partial_forward.grid[1]
    scratch = heads.new_empty(G * key_splits * m1 * (d + 2), dtype=FLOATS)
    partial_reads, partial_stats = scratch[: G * key_splits * m1 * d], scratch[G * key_splits * m1 * d :]
    _run(stage1_partial_forward_kernel, partial_forward, streams, a.k, a.v, partial_reads, partial_stats,
         *a.strides, shape.h, shape.N, n, d, a.scale, plan.tiles_per_split[partial_forward.kernel], S=shape.S,
         DIFF1=shape.stage1_differential,
         **a.pieces)  # fmt: skip
    _run(stage1_combine_kernel, combine, partial_reads, partial_stats, a.parameter(lambda1), a.parameter(norm1),
         reads, lse1, v_hat, key_splits, n, d, layout.eps, a.out_scale, DIFF1=shape.stage1_differential,
         D0=a.pieces["D0"], D1=a.pieces["D1"])  # fmt: skip
    _run(stage2_forward_kernel, stage2, a.q, streams, v_hat, a.parameter(lambda2), a.parameter(norm2), result, outs,
         lse2, *a.strides, result.stride(0), result.stride(1), shape.h, shape.N, n, d, a.scale, layout.eps,
         a.out_scale, S=shape.S, DIFF2=shape.stage2_differential, JOINT=layout.joint_softmax,
         **a.pieces)  # fmt: skip
    return saved


def attention_backward(
    grad: Tensor,
    heads: Tensor,
    pooled: Tensor | None,
    saved: list[Tensor],
    embed: Tensor,
    lambda1: Tensor | None,
    lambda2: Tensor | None,
    norm1: Tensor | None,
    norm2: Tensor | None,
    grad_local: Tensor,
    layout,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """The backward of both attention stages from the gradient `grad` (B, N, C) of the core's result and what
    `add_attention` saved: (the gradient of the qkv projection's output (B·N, 3C), the convolution's share
    `grad_local` (B, C, H, W) of dv included; then dE±, dλ₁, dλ₂, d norm1, d norm2 and dT of a given `pooled`
    in float32, None where a switch is off or T was pooled here: then its share is in dq)."""
    _check_device(heads)
    shape, plan = _plan(heads, layout, pooled)
    a = _Arguments(heads, pooled, embed, layout, shape)
    B, N, n, d, h = shape.B, shape.N, shape.n, shape.d, shape.h
    grad = _last_stride_one(grad)
    grad_local = _last_stride_one(grad_local.permute(0, 2, 3, 1).reshape(B, N, shape.C))  # a view when channels-last
    grad_qkv = heads.new_empty(B, N, 3 * shape.C)  # written by the kernels: dq, dk, dv in the projection's layout
    given = layout.pooled_content and pooled is not None
    grad_pooled = heads.new_empty(B, h, n, d, dtype=FLOATS) if given else None
    content = dict(CONTENT=layout.pooled_content, GIVEN=pooled is not None)
    sums = plan.backward[-1]
    rows1, rows2 = plan.partial_rows
    embed_width, images = h * shape.S * n * d, plan.embed_rows
    scratch = heads.new_empty(images * embed_width + (rows1 + rows2) * (d + 1), dtype=FLOATS)
    embed_part = scratch[: images * embed_width]
    first_part = scratch[images * embed_width : images * embed_width + rows1 * (d + 1)]
    second_part = scratch[images * embed_width + rows1 * (d + 1) :]
    if plan.path == "per_head":
        launch = plan.backward[0]
        in_dtype, in_floats = backward_scratch(shape)
        programs = launch.grid[0]
        _run(per_head_backward_kernel, launch, a.q, a.k, a.v, a.given, a.embed, a.parameter(lambda1),
             a.parameter(norm1), a.parameter(lambda2), a.parameter(norm2), grad, grad_local, grad_qkv,
             grad_pooled if given else scratch, embed_part, first_part, second_part,
             heads.new_empty(programs * in_dtype), heads.new_empty(programs * in_floats, dtype=FLOATS), *a.strides,
             *a.given_strides, grad.stride(0), grad.stride(1), grad_local.stride(0), grad_local.stride(1), in_floats,
             shape.G, h, N, shape.H, shape.p, d, a.scale, layout.eps, a.out_scale, JOINT=layout.joint_softmax,
             **a.switches, **content, **a.pieces)  # fmt: skip
    else:
        _split_backward(a, plan, saved, grad, grad_local, grad_qkv, grad_pooled, embed_part, first_part, second_part,
                        lambda1, lambda2, norm1, norm2)  # fmt: skip
    floats = {"device": heads.device, "dtype": FLOATS}
    grad_embed = torch.empty(1, h, shape.S, n, d, **floats)
    grad_lambda1, grad_lambda2 = (torch.empty((), **floats) if on else None for on in (rows1, rows2))
    grad_norm1, grad_norm2 = (torch.empty(d, **floats) if on else None for on in (rows1, rows2))
    outputs = [scratch if t is None else t for t in (grad_lambda1, grad_norm1, grad_lambda2, grad_norm2)]
    _run(sum_partials_kernel, sums, embed_part, grad_embed, first_part, *outputs[:2], second_part, *outputs[2:],
         images, embed_width, rows1, rows2, d, sums.grid[0] - 2)  # fmt: skip
    grad_qkv = grad_qkv.view(B * N, 3 * shape.C)
    return grad_qkv, grad_embed, grad_lambda1, grad_lambda2, grad_norm1, grad_norm2, grad_pooled


def _split_backward(a: _Arguments, plan: Plan, saved, grad, grad_local, grad_qkv, grad_pooled, embed_part, first_part,
                    second_part, lambda1, lambda2, norm1, norm2) -> None:  # fmt: skip
    """The split path's backward up to the partials `sum_partials_kernel` sums (see dit_vca.vca_triton_split)."""
    shape, layout = a.shape, a.layout
    G, N, n, d, h = shape.G, shape.N, shape.n, shape.d, shape.h
    m1, m2 = shape.M1 * n, shape.M2 * n
    streams, v_hat, reads, lse1, outs, lse2 = saved
    stage2, norm, stage1, streams_backward, *pool, _ = plan.backward
    query_splits, key_splits = stage2.grid[1], stage1.grid[1]
    sizes = [G * query_splits * (m2 + n) * d, G * m1 * d, G * m1, G * key_splits * m1 * d]
    sizes.append(0 if grad_pooled is not None or not layout.pooled_content else G * n * d)
    scratch = grad.new_empty(sum(sizes), dtype=FLOATS)
    partial2, grad_reads, delta, partial1, grad_content = scratch.split(sizes)
    grad_content = grad_pooled if grad_pooled is not None else grad_content
    one_block = {"ONE_BLOCK": n <= stage2.blocks["BLOCK_C"]}
    _run(stage2_backward_kernel, stage2, a.q, streams, v_hat, a.parameter(lambda2), a.parameter(norm2), outs, lse2,
         grad, grad_qkv, partial2, second_part, *a.strides, grad.stride(0), grad.stride(1), h, N, n, d, a.scale,
         layout.eps, a.out_scale, plan.tiles_per_split[stage2.kernel], S=shape.S, DIFF2=shape.stage2_differential,
         JOINT=layout.joint_softmax,
         **a.pieces, **one_block)  # fmt: skip
    _run(stage1_norm_backward_kernel, norm, partial2, reads, a.parameter(lambda1), a.parameter(norm1), grad_reads,
         delta, first_part, query_splits, n, d, layout.eps, a.out_scale, DIFF1=shape.stage1_differential,
         DIFF2=shape.stage2_differential, D0=a.pieces["D0"], D1=a.pieces["D1"])  # fmt: skip
    _run(stage1_backward_kernel, stage1, streams, a.k, a.v, grad_reads, lse1, delta, grad_local, grad_qkv, partial1,
         *a.strides, grad_local.stride(0), grad_local.stride(1), h, N, n, d, a.scale,
         plan.tiles_per_split[stage1.kernel], S=shape.S,
         DIFF1=shape.stage1_differential, **a.pieces, ONE_BLOCK=n <= stage1.blocks["BLOCK_C"])  # fmt: skip
    _run(streams_backward_kernel, streams_backward, partial1, partial2, embed_part, grad_content, key_splits,
         query_splits, n, d, **a.switches, CONTENT=layout.pooled_content, D0=a.pieces["D0"],
         D1=a.pieces["D1"])  # fmt: skip
    if pool:
        _run(pool_backward_kernel, pool[0], grad_content, grad_qkv, h, N, shape.H, shape.p, d, D0=a.pieces["D0"],
             D1=a.pieces["D1"])  # fmt: skip
