"""The fused core of Visual-Contrast Attention: a torch.library custom operator with a hand-written backward.

The core maps the input tokens of a VCA layer to the input of its output projection (qkv projection, both
attention stages, the depthwise convolution of v). Why an operator of its own, and not autograd over torch
operations (VisualContrastAttention.reference_forward, the specification):
- Memory. Through autograd the readable forward stores every intermediate (the N×2n probabilities among them)
  and pays for layout copies in backward; the backward written here recomputes the probabilities and saves
  only x and the head-major q, k, v (what MHSA on SDPA keeps), or x alone with `recompute_qkv`; the Triton
  path adds what FlashAttention saves, Stage II's output before its norm and its log-sum-exps (one or two
  (B, N, C) and (B, h, N) tensors), and the n-row tensors of the contrast tokens (dit_vca.vca_triton).
- torch.compile. A custom operator is opaque to Dynamo (its fake kernel gives the output shapes), so
  `torch.compile(model, fullgraph=True)` keeps this core, its memory and its fused kernels, and compiles the
  code around it; the backward is a second custom operator, which AOTAutograd calls as it is.
- Fused attention kernels. Every SDPA call here and in the readable path takes 4-D (B, h, L, d) tensors of one
  dtype whose last dimension has stride 1: what PyTorch's dispatcher requires of the flash and
  memory-efficient kernels (see SDPA_FUSED_CONSTRAINTS).
- Two implementations of the attention stages, chosen by the operators' `triton` argument
  (VisualContrastAttention.kernel), each a module with the entry points `add_attention`, `attention_backward`
  and `saved_like`: dit_vca.vca_aten (ATen operations, the CPU default and the reference) and dit_vca.vca_triton
  (fused Triton kernels, the CUDA default). The projection, the convolution and their gradients are here,
  shared.
- QK-norm and 2-D RoPE (the model options `qk_norm`, `rope`) apply inside the operator, as a pre-step on q and k
  that both implementations share and whose backward is chained by hand (dit_vca.vca_qk): with them a layer is
  still this one operator.
- Mixed precision. The core computes in the dtype of its input x (the caller casts x to the autocast dtype);
  the parameters arrive in their own dtype and their gradients are summed in float32, so that a loss scaled
  for fp16 cannot overflow sums over B·h·N rows (λ, RMSNorm weights, E±, the biases).
"""

from __future__ import annotations

import contextlib
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from dit_vca import vca_aten, vca_qk
from dit_vca.kernel_layout import KernelLayout
from dit_vca.vca_aten import sum_to_fp32
from dit_vca.vca_qk import RopeTables

# What PyTorch 2.14's SDPA dispatcher (aten/src/ATen/native/transformers/sdp_utils_cpp.h and
# cuda/sdp_utils.cpp) checks before it picks the flash or memory-efficient kernel for dense inputs; an input
# that fails any check falls back to the math kernel (the scores materialised, bf16 upcast):
SDPA_FUSED_CONSTRAINTS = (
    "query, key and value are 4-dimensional (check_tensor_shapes)",
    "same batch size and number of heads in dims 0 and 1 (check_batch_size_and_num_heads_dense)",
    "the last dimension of query, key and value has stride 1 (check_last_dim_stride_equals_1_dense)",
    "query, key and value share one dtype, fp16 or bf16 for flash (check_tensor_dtype)",
    "query, key and value share the head dimension, at most 256 for flash (check_head_dim_size_flash)",
    "no attention mask for flash, no dropout here, non-empty sequences (check_for_attn_mask, "
    "check_nonzero_sequence_lengths_dense)",
)

# Stage II as SDPA calls (softmax(q·Tᵀ/√d) against the values [V̂; −λ₂·V̂], or one call per softmax) or as the
# GEMM–softmax–GEMM of the backward's recomputation, per device type. The CPU keeps the GEMM form: measured
# faster there (`python -m bench.attention`, rows "vca-64" and "vca-64-sdpa2", see docs/benchmarks.md); on CUDA the
# SDPA form runs Stage II in the flash kernel (a GPU run has yet to confirm it is faster).
STAGE2_SDPA = {"cpu": False, "cuda": True}


# The operator's optional tensors after the conv bias: the QK-norm gains and the four RoPE tables (vca_qk.RopeTables).
CORE_OPTIONAL_TENSORS = 6


def stage2_uses_sdpa(device_type: str) -> bool:
    return STAGE2_SDPA.get(device_type, False)


def vca_core(
    x: Tensor,
    qkv_weight: Tensor,
    qkv_bias: Tensor,
    embed: Tensor,
    lambda1: Tensor | None,
    lambda2: Tensor | None,
    norm1: Tensor | None,
    norm2: Tensor | None,
    conv_weight: Tensor,
    conv_bias: Tensor,
    layout: KernelLayout,
    *,
    q_norm: Tensor | None = None,
    k_norm: Tensor | None = None,
    rope: RopeTables | None = None,
) -> Tensor:
    """The VCA core on tokens x (B, N, C), computed in x's dtype; returns the input of the output projection
    (B, N, C). Differentiable with respect to every tensor argument but the RoPE tables. QK-norm with the gains
    `q_norm`, `k_norm` (d,) (and layout.qk_norm_eps), 2-D RoPE with the tables `rope` (dit_vca.vca_qk)."""
    tables = rope or (None,) * 4
    result, _, _ = _core_op(
        x, qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight, conv_bias, q_norm, k_norm,
        *tables, *layout.as_args(),
    )  # fmt: skip
    return result


# ----------------------------------------------------------------------------------------------------------------
# The operators
# ----------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("dit_vca::vca_core", mutates_args=())
def _core_op(
    x: Tensor,
    qkv_weight: Tensor,
    qkv_bias: Tensor,
    embed: Tensor,
    lambda1: Tensor | None,
    lambda2: Tensor | None,
    norm1: Tensor | None,
    norm2: Tensor | None,
    conv_weight: Tensor,
    conv_bias: Tensor,
    q_norm: Tensor | None,
    k_norm: Tensor | None,
    rope_cos: Tensor | None,
    rope_sin: Tensor | None,
    contrast_cos: Tensor | None,
    contrast_sin: Tensor | None,
    num_heads: int,
    grid_size: int,
    contrast_grid: int,
    joint_softmax: bool,
    stage1_differential: bool,
    stage2_differential: bool,
    pooled_content: bool,
    lambda_init: float,
    eps: float,
    recompute_qkv: bool,
    stage2_sdpa: bool,
    triton: bool,
    qk_norm_eps: float | None,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(result (B, N, C), heads (3, B, h, N, d), saved): the core's output, the head-major q, k, v of the
    projection and what its attention stages save for the backward (`saved_like` of the implementation), returned
    so that backward can keep them instead of recomputing them. With QK-norm or RoPE the stages read q̃, k̃ of the
    pre-step (dit_vca.vca_qk), which backward recomputes from q, k."""
    layout = KernelLayout(
        num_heads,
        grid_size,
        contrast_grid,
        joint_softmax,
        stage1_differential,
        stage2_differential,
        pooled_content,
        lambda_init,
        eps,
        recompute_qkv,
        stage2_sdpa,
        triton,
        qk_norm_eps,
    )
    rope = _rope_tables(rope_cos, rope_sin, contrast_cos, contrast_sin)
    B, N, C = x.shape
    with _autocast_off(x.device.type):
        qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight, conv_bias = _in_dtype(
            x.dtype, qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight, conv_bias
        )
        heads = _project_heads(x, qkv_weight, qkv_bias, num_heads)  # (3, B, h, N, d)
        local = F.conv2d(_value_image(heads[2], grid_size), conv_weight, conv_bias, padding=1, groups=C)
        result = local.permute(0, 2, 3, 1).reshape(B, N, C).contiguous()  # (B, N, C); a view when channels-last
        attended, pooled = _prepared(heads, q_norm, k_norm, rope, layout)  # q̃, k̃, v; T at the cells' centres
        saved = _attention(layout).add_attention(
            result, attended, pooled, embed, lambda1, lambda2, norm1, norm2, layout
        )
    return result, heads, saved


def _rope_tables(*tables: Tensor | None) -> RopeTables | None:
    """The operator's four RoPE arguments as one value: all four tensors, or None (no RoPE)."""
    return None if tables[0] is None else tables


def _prepared(
    heads: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, rope: RopeTables | None, layout: KernelLayout
) -> tuple[Tensor, Tensor | None]:
    """What the attention stages read: q, k, v `heads` as they are, or after the pre-step (dit_vca.vca_qk)."""
    if q_norm is None and rope is None:
        return heads, None
    return vca_qk.prepare(heads, q_norm, k_norm, rope, layout)


@_core_op.register_fake
def _core_op_fake(
    x, qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight, conv_bias, *optional_and_layout
):
    num_heads, *layout = optional_and_layout[CORE_OPTIONAL_TENSORS:]
    B, N, C = x.shape
    heads = x.new_empty(3, B, num_heads, N, C // num_heads)
    layout = KernelLayout(num_heads, *layout)
    return x.new_empty(B, N, C), heads, _attention(layout).saved_like(heads, layout)


def _attention(layout: KernelLayout) -> ModuleType:
    """The module that implements the attention stages: dit_vca.vca_triton or dit_vca.vca_aten."""
    if layout.triton:
        from dit_vca import vca_triton  # imported on first use: importing triton costs a second

        return vca_triton
    return vca_aten


@torch.library.custom_op("dit_vca::vca_core_backward", mutates_args=())
def _core_backward_op(
    grad: Tensor,
    x: Tensor,
    qkv_weight: Tensor,
    qkv_bias: Tensor,
    heads: Tensor | None,
    saved_streams: Tensor | None,
    saved_v_hat: Tensor | None,
    saved_reads: Tensor | None,
    saved_stage1_lse: Tensor | None,
    saved_outs: Tensor | None,
    saved_stage2_lse: Tensor | None,
    embed: Tensor,
    lambda1: Tensor | None,
    lambda2: Tensor | None,
    norm1: Tensor | None,
    norm2: Tensor | None,
    conv_weight: Tensor,
    q_norm: Tensor | None,
    k_norm: Tensor | None,
    rope_cos: Tensor | None,
    rope_sin: Tensor | None,
    contrast_cos: Tensor | None,
    contrast_sin: Tensor | None,
    num_heads: int,
    grid_size: int,
    contrast_grid: int,
    joint_softmax: bool,
    stage1_differential: bool,
    stage2_differential: bool,
    pooled_content: bool,
    lambda_init: float,
    eps: float,
    recompute_qkv: bool,
    stage2_sdpa: bool,
    triton: bool,
    qk_norm_eps: float | None,
) -> list[Tensor]:
    """Gradients of x, qkv weight and bias, E±, λ₁, λ₂, both norm weights, conv weight and bias, the QK-norm
    gains, in that order (an empty tensor for an absent optional input), each in its input's dtype. The `saved_*`
    tensors are what the Triton forward saved (vca_triton.saved_like), None on the ATen path, which saves
    nothing."""
    saved = [
        t
        for t in (saved_streams, saved_v_hat, saved_reads, saved_stage1_lse, saved_outs, saved_stage2_lse)
        if t is not None
    ]
    layout = KernelLayout(
        num_heads,
        grid_size,
        contrast_grid,
        joint_softmax,
        stage1_differential,
        stage2_differential,
        pooled_content,
        lambda_init,
        eps,
        recompute_qkv,
        stage2_sdpa,
        triton,
        qk_norm_eps,
    )
    rope = _rope_tables(rope_cos, rope_sin, contrast_cos, contrast_sin)
    with _autocast_off(x.device.type):
        grads = _core_backward(
            grad, x, qkv_weight, qkv_bias, heads, saved, embed, lambda1, lambda2, norm1, norm2, conv_weight,
            q_norm, k_norm, rope, layout,
        )  # fmt: skip
    inputs = (x, qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight, conv_weight, q_norm, k_norm)
    return [x.new_empty(0) if g is None else _like(g, t) for g, t in zip(grads, inputs)]


def _like(grad: Tensor, tensor: Tensor) -> Tensor:
    """`grad` in `tensor`'s dtype and strides, as the fake promises. The convolution's weight gradient comes out
    channels-last ((9, 1, 3, 1) for a (C, 1, 3, 3) weight whose strides are (9, 9, 3, 1)): DDP would warn that the
    gradient's strides do not match its bucket view and copy it at every step, and a compiled graph would be
    told strides the kernel does not produce. The conv bias's gradient, which takes its dtype from the weight
    (the bias is not an input of the backward), keeps its own contiguous layout: hence the shape test."""
    grad = grad.to(tensor.dtype)
    if grad.shape == tensor.shape and grad.stride() != tensor.stride():
        grad = torch.empty_like(tensor).copy_(grad)
    return grad


@_core_backward_op.register_fake
def _core_backward_op_fake(grad, x, qkv_weight, qkv_bias, heads, *args):
    embed, lambda1, lambda2, norm1, norm2, conv_weight, q_norm, k_norm = args[6:14]
    inputs = (x, qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight)

    def like(t: Tensor | None) -> Tensor:
        return x.new_empty(0) if t is None else torch.empty_like(t)

    return [*map(like, inputs), conv_weight.new_empty(conv_weight.shape[0]), like(q_norm), like(k_norm)]


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    x, qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight, _conv_bias, *rest = inputs
    optional, layout = rest[:CORE_OPTIONAL_TENSORS], rest[CORE_OPTIONAL_TENSORS:]
    _, heads, saved = output
    ctx.layout = layout
    ctx.mark_non_differentiable(heads, *saved)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for them: only the result has one
    kept_heads = None if KernelLayout(*layout).recompute_qkv else heads
    kept = (x, qkv_weight, qkv_bias, kept_heads, embed, lambda1, lambda2, norm1, norm2, conv_weight, *optional)
    ctx.save_for_backward(*kept, *saved)


def _backward(ctx, grad: Tensor, _grad_heads: Tensor | None, _grad_saved: list[Tensor] | None):
    x, qkv_weight, qkv_bias, heads, embed, lambda1, lambda2, norm1, norm2, conv_weight, *rest = ctx.saved_tensors
    optional, saved = rest[:CORE_OPTIONAL_TENSORS], rest[CORE_OPTIONAL_TENSORS:]
    grads = _core_backward_op(
        grad,
        x,
        qkv_weight,
        qkv_bias,
        heads,
        *(saved or [None] * 6),
        embed,
        lambda1,
        lambda2,
        norm1,
        norm2,
        conv_weight,
        *optional,
        *ctx.layout,
    )
    q_norm, k_norm = optional[:2]
    present = (x, qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight, conv_weight)
    differentiable = [g if t is not None else None for g, t in zip(grads, present)]
    differentiable += [g if t is not None else None for g, t in zip(grads[len(present) :], (q_norm, k_norm))]
    rope_tables = (None,) * (CORE_OPTIONAL_TENSORS - 2)  # constants: no gradient
    return (*differentiable, *rope_tables, *(None for _ in ctx.layout))


_core_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------------
# The computation
# ----------------------------------------------------------------------------------------------------------------


@torch.compiler.assume_constant_result
def autocast_exists(device_type: str) -> bool:
    """Whether autocast exists on `device_type` (it does not on the meta device, for one). A constant to
    torch.compile, since it never changes in a process: Dynamo in torch 2.11 cannot trace
    torch.amp.is_autocast_available, and `train.compile=true` (fullgraph) stopped there on an H200."""
    return torch.amp.is_autocast_available(device_type)


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context with autocast disabled on `device_type` (nothing to disable where autocast does not exist, e.g.
    the meta device)."""
    if autocast_exists(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _in_dtype(dtype: torch.dtype, *tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def _project_heads(x: Tensor, weight: Tensor, bias: Tensor, num_heads: int) -> Tensor:
    """The qkv projection of tokens x (B, N, C) as one head-contiguous tensor (3, B, h, N, d): q, k, v of every
    head are then (N, d) matrices with a common batch stride, as batched GEMMs and SDPA want them. The bias is
    added in the same pass that reorders the GEMM's output."""
    B, N, C = x.shape
    d = C // num_heads
    product = torch.mm(x.reshape(B * N, C), weight.T).view(B, N, 3, num_heads, d)  # (B, N, 3, h, d)
    heads = x.new_empty(3, B, num_heads, N, d)
    torch.add(product.permute(2, 0, 3, 1, 4), bias.view(3, 1, num_heads, 1, d), out=heads)
    return heads  # (3, B, h, N, d)


def _value_image(v: Tensor, grid_size: int) -> Tensor:
    """Values v (B, h, N, d) of all heads as one channels-last image (B, C, H, W) for the depthwise convolution."""
    B, h, N, d = v.shape
    image = v.new_empty(B, N, h, d)  # (B, N, C): a channels-last image's memory
    image.copy_(v.transpose(1, 2))
    return image.view(B, grid_size, grid_size, h * d).permute(0, 3, 1, 2)  # (B, C, H, W), channels-last


def _core_backward(
    grad: Tensor,
    x: Tensor,
    qkv_weight: Tensor,
    qkv_bias: Tensor,
    heads: Tensor | None,
    saved: list[Tensor],
    embed: Tensor,
    lambda1: Tensor | None,
    lambda2: Tensor | None,
    norm1: Tensor | None,
    norm2: Tensor | None,
    conv_weight: Tensor,
    q_norm: Tensor | None,
    k_norm: Tensor | None,
    rope: RopeTables | None,
    layout: KernelLayout,
) -> tuple[Tensor | None, ...]:
    """The gradients of _core_op's inputs (see _core_backward_op), computed in x's dtype, parameter sums in
    float32: the convolution and the qkv projection here, the attention stages in dit_vca.vca_aten or on the
    Triton kernels (dit_vca.vca_triton), QK-norm and RoPE in dit_vca.vca_qk."""
    B, N, C = x.shape
    H = layout.grid_size
    qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight = _in_dtype(
        x.dtype, qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight
    )
    grad = grad.to(x.dtype).contiguous()  # (B, N, C)
    if heads is None:
        heads = _project_heads(x, qkv_weight, qkv_bias, layout.num_heads)  # (3, B, h, N, d)

    # Depthwise convolution of v (its bias gradient, a sum over B·N rows, in float32).
    value_image = _value_image(heads[2], H)
    grad_image = grad.view(B, H, H, C).permute(0, 3, 1, 2)  # (B, C, H, W), channels-last view
    grad_local, grad_conv_weight, _ = torch.ops.aten.convolution_backward(
        grad_image, value_image, conv_weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], C, [True, True, False]
    )
    grad_conv_bias = sum_to_fp32(grad.view(B * N, C), 0)  # (C,)

    attended, pooled = _prepared(heads, q_norm, k_norm, rope, layout)  # what the stages read in forward
    grad_qkv, *grad_attention, grad_pooled = _attention(layout).attention_backward(
        grad, attended, pooled, saved, embed, lambda1, lambda2, norm1, norm2, grad_local, layout
    )
    grad_gains = (None, None)  # of QK-norm: g_q, g_k
    if attended is not heads:  # dq̃, dk̃ back to dq, dk
        grad_gains = vca_qk.prepare_backward(grad_qkv, heads, grad_pooled, q_norm, k_norm, rope, layout)

    # The qkv projection (the weight's gradient a GEMM in x's dtype, as nn.Linear's under autocast).
    grad_x = (grad_qkv @ qkv_weight).view(B, N, C)
    grad_qkv_weight = grad_qkv.T @ x.reshape(B * N, C)  # (3C, C)
    grad_qkv_bias = sum_to_fp32(grad_qkv, 0)
    return (grad_x, grad_qkv_weight, grad_qkv_bias, *grad_attention, grad_conv_weight, grad_conv_bias, *grad_gains)


# ----------------------------------------------------------------------------------------------------------------
# FLOPs, for torch.utils.flop_counter (which does not look inside a custom operator)
# ----------------------------------------------------------------------------------------------------------------


def _attention_macs(x_shape, layout: KernelLayout) -> dict[str, int]:
    """Multiply-adds of the core's products per part, from the shape (B, N, C) of its input: the qkv GEMM, the
    GEMM-like products of the two stages over all B·h heads (Stage II as the SDPA calls or the GEMMs of
    `layout.stage2_sdpa`) and the 3×3 depthwise convolution. Element-wise work is not counted, as
    FlopCounterMode counts none."""
    B, N, C = x_shape
    n, m1, m2 = layout.contrast_grid**2, layout.stage1_rows, layout.stage2_cols
    if layout.triton:  # scores, then one value product for a joint softmax, one per stream for two
        stage2 = (m2 + (m2 if layout.stage2_differential and not layout.joint_softmax else n)) * N * C * B
    else:  # scores and values of every query: SDPA calls or GEMMs
        stage2 = (2 * m2 if layout.stage2_sdpa else m2 + n) * N * C * B
    return {"qkv": 3 * B * N * C * C, "stage1": 2 * m1 * N * C * B, "stage2": stage2, "conv": 9 * B * N * C}


@register_flop_formula(torch.ops.dit_vca.vca_core)
def _core_flops(x_shape, *args, out_shape=None, **kwargs) -> int:
    layout = KernelLayout(*args[9 + CORE_OPTIONAL_TENSORS :])
    return 2 * sum(_attention_macs(x_shape, layout).values())


@register_flop_formula(torch.ops.dit_vca.vca_core_backward)
def _core_backward_flops(grad_shape, x_shape, *args, out_shape=None, **kwargs) -> int:
    """The products of _core_backward: on the ATen path the recomputation of both stages in matmul form (Stage
    I's scores of m1 rows and values of n rows, Stage II's scores and values) and two products per forward
    product (the gradients of both operands); on the Triton path what its two backward kernels multiply (Stage
    II: scores, dq and dT per stream, dW and dV̂; Stage I: scores, dP, dk, dv and dT, see
    vca_triton.tile_products); then the convolution's and the qkv projection's gradients (and the qkv GEMM
    again with recompute_qkv)."""
    layout = KernelLayout(*args[15 + CORE_OPTIONAL_TENSORS :])
    B, N, C = x_shape
    n, m1, m2 = layout.contrast_grid**2, layout.stage1_rows, layout.stage2_cols
    if layout.triton:
        attention = (3 * m2 + 2 * n + 5 * m1) * N * C * B
    else:
        attention = 3 * (m1 + n + m2 + n) * N * C * B
    qkv = (3 if layout.recompute_qkv else 2) * 3 * B * N * C * C
    return 2 * (attention + 2 * 9 * B * N * C + qkv)
