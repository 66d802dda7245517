"""The fused core of Visual-Contrast Attention: a torch.library custom operator with a hand-written backward.

The core maps the input tokens of a VCA layer to the input of its output projection (qkv projection, both
attention stages, the depthwise convolution of v). Why an operator of its own, and not autograd over torch
operations (VisualContrastAttention.reference_forward, the specification):
- Memory. Through autograd the readable forward stores every intermediate (the N×2n probabilities among them)
  and pays for layout copies in backward; the backward written here recomputes the probabilities (GEMMs of n
  rows or columns) and saves only x and the head-major q, k, v (what MHSA on SDPA keeps), or x alone with
  `recompute_qkv`.
- torch.compile. A custom operator is opaque to Dynamo (its fake kernel gives the output shapes), so
  `torch.compile(model, fullgraph=True)` keeps this core, its memory and its fused kernels, and compiles the
  code around it; the backward is a second custom operator, which AOTAutograd calls as it is.
- Fused attention kernels. Every SDPA call here and in the readable path takes 4-D (B, h, L, d) tensors of one
  dtype whose last dimension has stride 1: what PyTorch's dispatcher requires of the flash and
  memory-efficient kernels (see SDPA_FUSED_CONSTRAINTS).
- Two implementations of the attention stages, chosen by the operators' `triton` argument
  (VisualContrastAttention.kernel): the ATen operations here, the CPU default and the reference, or the fused
  Triton kernels of dit_vca.vca_triton, the CUDA default. The projection, the convolution and their gradients
  are shared.
- Mixed precision. The core computes in the dtype of its input x (the caller casts x to the autocast dtype);
  the parameters arrive in their own dtype and their gradients are summed in float32, so that a loss scaled
  for fp16 cannot overflow sums over B·h·N rows (λ, RMSNorm weights, E±, the biases).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

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


def stage2_uses_sdpa(device_type: str) -> bool:
    return STAGE2_SDPA.get(device_type, False)


@dataclass(frozen=True)
class KernelLayout:
    """The static shape and switches the fused VCA core needs besides its tensors (scalar operator arguments)."""

    num_heads: int
    grid_size: int  # H (= W)
    contrast_grid: int  # p, a divisor of H
    joint_softmax: bool
    stage1_differential: bool
    stage2_differential: bool
    pooled_content: bool
    lambda_init: float
    eps: float  # of both RMSNorms
    recompute_qkv: bool  # recompute q, k, v in backward instead of saving them
    stage2_sdpa: bool  # Stage II of the forward as SDPA calls (see STAGE2_SDPA)
    triton: bool = False  # both attention stages on the Triton kernels of dit_vca.vca_triton

    def as_args(self) -> tuple:
        """The fields in order: the scalar arguments of the operators."""
        return (
            self.num_heads,
            self.grid_size,
            self.contrast_grid,
            self.joint_softmax,
            self.stage1_differential,
            self.stage2_differential,
            self.pooled_content,
            self.lambda_init,
            self.eps,
            self.recompute_qkv,
            self.stage2_sdpa,
            self.triton,
        )

    @property
    def stage1_rows(self) -> int:  # contrast tokens that read the keys in Stage I: [T⁺; T⁻] or T⁺
        return (2 if self.stage1_differential else 1) * self.contrast_grid**2

    @property
    def stage2_cols(self) -> int:  # contrast tokens that the queries read in Stage II
        return (2 if self.stage2_differential else 1) * self.contrast_grid**2


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
) -> Tensor:
    """The VCA core on tokens x (B, N, C), computed in x's dtype; returns the input of the output projection
    (B, N, C). Differentiable with respect to every tensor argument."""
    result, _ = _core_op(
        x, qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight, conv_bias, *layout.as_args()
    )
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
) -> tuple[Tensor, Tensor]:
    """(result (B, N, C), heads (3, B, h, N, d)): the core's output and the head-major q, k, v it computed
    (returned so that backward can keep them instead of recomputing them)."""
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
    )
    B, N, C = x.shape
    with _autocast_off(x.device.type):
        qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight, conv_bias = _in_dtype(
            x.dtype, qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight, conv_bias
        )
        heads = _project_heads(x, qkv_weight, qkv_bias, num_heads)  # (3, B, h, N, d)
        local = F.conv2d(_value_image(heads[2], grid_size), conv_weight, conv_bias, padding=1, groups=C)
        result = local.permute(0, 2, 3, 1).reshape(B, N, C).contiguous()  # (B, N, C); a view when channels-last
        if triton:
            from dit_vca import vca_triton  # imported on first use: importing triton costs a second

            vca_triton.add_attention(result, heads, embed, lambda1, lambda2, norm1, norm2, layout)
        else:
            out = _mixed_forward(heads, embed, lambda1, lambda2, norm1, layout)  # (B, h, N, d)
            if stage2_differential:
                out = out * _inverse_rms(out, eps) * (norm2 * (1 - lambda_init))
            result.view(B, N, num_heads, C // num_heads).add_(out.transpose(1, 2))
    return result, heads


@_core_op.register_fake
def _core_op_fake(
    x, qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight, conv_bias, num_heads, *layout
):
    B, N, C = x.shape
    return x.new_empty(B, N, C), x.new_empty(3, B, num_heads, N, C // num_heads)


@torch.library.custom_op("dit_vca::vca_core_backward", mutates_args=())
def _core_backward_op(
    grad: Tensor,
    x: Tensor,
    qkv_weight: Tensor,
    qkv_bias: Tensor,
    heads: Tensor | None,
    embed: Tensor,
    lambda1: Tensor | None,
    lambda2: Tensor | None,
    norm1: Tensor | None,
    norm2: Tensor | None,
    conv_weight: Tensor,
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
) -> list[Tensor]:
    """Gradients of x, qkv weight and bias, E±, λ₁, λ₂, both norm weights, conv weight and bias, in that order
    (an empty tensor for an absent optional input), each in its input's dtype."""
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
    )
    with _autocast_off(x.device.type):
        grads = _core_backward(
            grad, x, qkv_weight, qkv_bias, heads, embed, lambda1, lambda2, norm1, norm2, conv_weight, layout
        )
    inputs = (x, qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight, conv_weight)
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
def _core_backward_op_fake(
    grad, x, qkv_weight, qkv_bias, heads, embed, lambda1, lambda2, norm1, norm2, conv_weight, *layout
):
    inputs = (x, qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight)
    return [x.new_empty(0) if t is None else torch.empty_like(t) for t in inputs] + [
        conv_weight.new_empty(conv_weight.shape[0])
    ]


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    x, qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight, _conv_bias, *layout = inputs
    _, heads = output
    ctx.layout = layout
    ctx.mark_non_differentiable(heads)
    kept_heads = None if KernelLayout(*layout).recompute_qkv else heads
    ctx.save_for_backward(x, qkv_weight, qkv_bias, kept_heads, embed, lambda1, lambda2, norm1, norm2, conv_weight)


def _backward(ctx, grad: Tensor, _grad_heads: Tensor | None):
    x, qkv_weight, qkv_bias, heads, embed, lambda1, lambda2, norm1, norm2, conv_weight = ctx.saved_tensors
    grads = _core_backward_op(
        grad, x, qkv_weight, qkv_bias, heads, embed, lambda1, lambda2, norm1, norm2, conv_weight, *ctx.layout
    )
    present = (x, qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight, conv_weight)
    return (*(g if t is not None else None for g, t in zip(grads, present)), *(None for _ in ctx.layout))


_core_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------------
# The computation
# ----------------------------------------------------------------------------------------------------------------


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context with autocast disabled on `device_type` (nothing to disable where autocast does not exist, e.g.
    the meta device)."""
    if torch.amp.is_autocast_available(device_type):
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


def _inverse_rms(x: Tensor, eps: float) -> Tensor:
    """1 / sqrt(mean(x²) + eps) over the last dimension, accumulated in at least float32, shaped for
    broadcasting against x."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + eps).to(x.dtype)


def _contrast_streams(q: Tensor, embed: Tensor, layout: KernelLayout) -> Tensor:
    """[T⁺; T⁻] = E± + the p×p average pool of q (B, h, N, d), as (B, h, S·n, d): T⁺ rows first, contiguous.
    p divides H, so adaptive average pooling is a mean over r×r blocks."""
    B, h, N, d = q.shape
    p, H = layout.contrast_grid, layout.grid_size
    n = p * p
    streams = embed.expand(B, h, -1, n, d)  # (B, h, S, n, d)
    if layout.pooled_content:  # q of one head is a channels-last (d, H, W) image: pool it as one
        q_image = q.reshape(B * h, H, H, d).permute(0, 3, 1, 2)  # (G, d, H, W), a view
        pooled = F.avg_pool2d(q_image, H // p).permute(0, 2, 3, 1)  # (G, p, p, d)
        streams = streams + pooled.reshape(B, h, 1, n, d)
    return streams.reshape(B, h, -1, d).contiguous()  # (B, h, S·n, d)


def _mixed_forward(
    heads: Tensor,
    embed: Tensor,
    lambda1: Tensor | None,
    lambda2: Tensor | None,
    norm1: Tensor | None,
    layout: KernelLayout,
) -> Tensor:
    """The attention part of the forward pass up to Stage II's RMSNorm, (B, h, N, d), without materialising a
    probability matrix where SDPA can do the work: Stage I always, Stage II with `layout.stage2_sdpa`. Every
    SDPA operand is a 4-D (B, h, L, d) tensor with unit last stride, all in one dtype."""
    q, k, v = heads.unbind(0)  # (B, h, N, d) each, contiguous
    n = layout.contrast_grid**2
    streams = _contrast_streams(q, embed, layout)  # (B, h, S·n, d)

    # Stage I: the contrast tokens attend to all N keys: one fused call for both streams.
    read = F.scaled_dot_product_attention(streams[:, :, : layout.stage1_rows], k, v)  # (B, h, m1, d)
    contrast_values = read  # V̂, (B, h, n, d)
    if layout.stage1_differential:
        contrast = torch.addcmul(read[:, :, :n], read[:, :, n:], lambda1, value=-1)  # A⁺v − λ₁A⁻v
        contrast_values = contrast * _inverse_rms(contrast, layout.eps) * (norm1 * (1 - layout.lambda_init))

    # Stage II: every query reads V̂ through its attention to the contrast tokens.
    if layout.stage2_sdpa:
        if not layout.stage2_differential:
            return F.scaled_dot_product_attention(q, streams[:, :, :n], contrast_values)  # (B, h, N, d)
        if layout.joint_softmax:  # one softmax over 2n columns: S⁺V̂ − λ₂S⁻V̂ = softmax(q[T⁺;T⁻]ᵀ)·[V̂; −λ₂V̂]
            values = torch.cat([contrast_values, contrast_values * -lambda2], dim=2)  # (B, h, 2n, d)
            return F.scaled_dot_product_attention(q, streams[:, :, : 2 * n], values)
        positive = F.scaled_dot_product_attention(q, streams[:, :, :n], contrast_values)
        negative = F.scaled_dot_product_attention(q, streams[:, :, n : 2 * n], contrast_values)
        return torch.addcmul(positive, negative, lambda2, value=-1)
    keys = streams[:, :, : layout.stage2_cols] * q.shape[-1] ** -0.5  # (B, h, m2, d), scaled
    scores = q @ keys.transpose(-2, -1)  # (B, h, N, m2)
    probs = _stage2_softmax(scores, layout)
    weights = (
        torch.addcmul(probs[..., :n], probs[..., n:], lambda2, value=-1) if layout.stage2_differential else probs
    )  # S⁺ − λ₂S⁻ or S, (B, h, N, n)
    return weights @ contrast_values  # (B, h, N, d)


def _stage2_softmax(scores: Tensor, layout: KernelLayout) -> Tensor:
    """Stage II's probabilities from scores (..., N, m2): one softmax over all m2 columns, or one per stream."""
    if layout.stage2_differential and not layout.joint_softmax:
        n = layout.contrast_grid**2
        return scores.unflatten(-1, (2, n)).softmax(dim=-1).flatten(-2)  # two softmaxes
    return scores.softmax(dim=-1)


class _Recomputed:
    """The forward quantities the backward pass needs, recomputed from q, k, v in head-major layout (G = B·h
    batches of one head) with the probabilities materialised: GEMMs with n rows or columns."""

    def __init__(
        self,
        heads: Tensor,
        embed: Tensor,
        lambda1: Tensor | None,
        lambda2: Tensor | None,
        norm1: Tensor | None,
        layout: KernelLayout,
    ):
        _, B, h, N, d = heads.shape  # (3, B, h, N, d)
        n, G = layout.contrast_grid**2, B * h
        self.n, self.scale = n, d**-0.5
        self.q, self.k, self.v = (t.view(G, N, d) for t in heads.unbind(0))  # views, each (G, N, d)
        self.streams = _contrast_streams(heads[0], embed, layout).view(G, -1, d)  # (G, S·n, d)

        # Stage I (weighing the streams before the value product: (A⁺ − λ₁A⁻)v, one product of n rows).
        self.stage1_queries = self.streams[:, : layout.stage1_rows] * self.scale  # (G, m1, d), scaled
        self.stage1_probs = torch.bmm(self.stage1_queries, self.k.transpose(1, 2)).softmax(dim=-1)  # (G, m1, N)
        self.stage1_weights = self.stage1_probs  # (G, n, N)
        if layout.stage1_differential:
            probs = self.stage1_probs
            self.stage1_weights = torch.addcmul(probs[:, :n], probs[:, n:], lambda1, value=-1)
        contrast = torch.bmm(self.stage1_weights, self.v)  # (G, n, d)
        self.contrast_values = contrast  # V̂, (G, n, d)
        if layout.stage1_differential:
            self.inverse_rms1 = _inverse_rms(contrast, layout.eps)  # (G, n, 1)
            self.normed1 = contrast * self.inverse_rms1
            self.contrast_values = self.normed1 * (norm1 * (1 - layout.lambda_init))

        # Stage II.
        self.stage2_keys = self.streams[:, : layout.stage2_cols] * self.scale  # (G, m2, d), scaled
        self.stage2_probs = _stage2_softmax(torch.bmm(self.q, self.stage2_keys.transpose(1, 2)), layout)
        self.weights = self.stage2_probs  # (G, N, n)
        if layout.stage2_differential:
            probs = self.stage2_probs
            self.weights = torch.addcmul(probs[..., :n], probs[..., n:], lambda2, value=-1)  # S⁺ − λ₂S⁻
        self.mixed = torch.bmm(self.weights, self.contrast_values)  # (G, N, d)


def _sum_to_fp32(t: Tensor, dim) -> Tensor:
    """A sum accumulated and returned in (at least) float32: a parameter's gradient summed over B·h·N rows
    stays finite under a loss scaled for fp16."""
    return t.sum(dim=dim, dtype=torch.promote_types(t.dtype, torch.float32))


def _rms_norm_backward(grad: Tensor, normed: Tensor, inverse_rms: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients of y = normed·weight, normed = x·inverse_rms(x), with respect to x and to weight (the latter
    summed in float32; the products stay in grad's dtype, |normed| ≤ √d)."""
    grad_weight = _sum_to_fp32((grad * normed).flatten(0, -2), 0)  # (d,)
    grad_normed = grad * weight
    grad_x = (grad_normed - normed * (grad_normed * normed).mean(dim=-1, keepdim=True)) * inverse_rms
    return grad_x, grad_weight


def _weights_backward(
    grad_weights: Tensor,
    probs_pos: Tensor,
    probs_neg: Tensor | None,
    lam: Tensor | None,
    joint: bool,
    out_pos: Tensor,
    out_neg: Tensor | None,
) -> Tensor | None:
    """Backward of the attention weights W = S⁺ − λ·S⁻ (or W = S alone when probs_neg is None), where S± are
    softmaxes of scores over the last dimension: one joint softmax over the [S⁺, S⁻] columns, or one each.
    Writes the gradients of the scores of S⁺ and S⁻ into out_pos and out_neg; returns the gradient of λ
    (float32)."""
    pos = torch.mul(grad_weights, probs_pos, out=out_pos)  # dW ⊙ S⁺
    row_pos = pos.sum(dim=-1, keepdim=True)
    if probs_neg is None:  # softmax backward: S ⊙ (dW − Σ dW ⊙ S)
        pos.addcmul_(probs_pos, row_pos, value=-1)
        return None
    neg = torch.mul(grad_weights, probs_neg, out=out_neg)  # dW ⊙ S⁻; the gradient of S⁻ is −λ·dW
    row_neg = _sum_to_fp32(neg, -1).unsqueeze(-1)  # float32: summed again over all rows into dλ below
    grad_lambda = -row_neg.sum()
    row_neg = row_neg.to(neg.dtype)
    if joint:  # one softmax: both halves subtract the row sum of dS ⊙ S over all 2n columns, i.e. of dW ⊙ W
        row = row_pos - lam * row_neg
        pos.addcmul_(probs_pos, row, value=-1)
        neg.mul_(-lam).addcmul_(probs_neg, row, value=-1)
    else:
        pos.addcmul_(probs_pos, row_pos, value=-1)
        neg.addcmul_(probs_neg, row_neg, value=-1).mul_(-lam)
    return grad_lambda


def _core_backward(
    grad: Tensor,
    x: Tensor,
    qkv_weight: Tensor,
    qkv_bias: Tensor,
    heads: Tensor | None,
    embed: Tensor,
    lambda1: Tensor | None,
    lambda2: Tensor | None,
    norm1: Tensor | None,
    norm2: Tensor | None,
    conv_weight: Tensor,
    layout: KernelLayout,
) -> tuple[Tensor | None, ...]:
    """The gradients of _core_op's inputs (see _core_backward_op), computed in x's dtype, parameter sums in
    float32: the convolution and the qkv projection here, the attention stages in `_attention_backward` or on
    the Triton kernels (dit_vca.vca_triton)."""
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
    grad_conv_bias = _sum_to_fp32(grad.view(B * N, C), 0)  # (C,)

    if layout.triton:
        from dit_vca import vca_triton  # imported on first use, as in _core_op

        grad_qkv, *grad_attention = vca_triton.attention_backward(
            grad, heads, embed, lambda1, lambda2, norm1, norm2, grad_local, layout
        )
    else:
        grad_qkv, *grad_attention = _attention_backward(
            grad, heads, embed, lambda1, lambda2, norm1, norm2, grad_local, layout
        )

    # The qkv projection (the weight's gradient a GEMM in x's dtype, as nn.Linear's under autocast).
    grad_x = (grad_qkv @ qkv_weight).view(B, N, C)
    grad_qkv_weight = grad_qkv.T @ x.reshape(B * N, C)  # (3C, C)
    grad_qkv_bias = _sum_to_fp32(grad_qkv, 0)
    return (grad_x, grad_qkv_weight, grad_qkv_bias, *grad_attention, grad_conv_weight, grad_conv_bias)


def _attention_backward(
    grad: Tensor,
    heads: Tensor,
    embed: Tensor,
    lambda1: Tensor | None,
    lambda2: Tensor | None,
    norm1: Tensor | None,
    norm2: Tensor | None,
    grad_local: Tensor,
    layout: KernelLayout,
) -> tuple[Tensor | None, ...]:
    """The backward of both attention stages from the gradient `grad` (B, N, C) of the core's result: the
    gradient of the qkv projection's output (B·N, 3C), the convolution's share `grad_local` of dv included, then
    those of E±, λ₁, λ₂ and the norm weights (None where a switch is off)."""
    _, B, h, N, d = heads.shape
    H, p = layout.grid_size, layout.contrast_grid
    n, r, c, G = p * p, H // p, 1 - layout.lambda_init, B * h
    fwd = _Recomputed(heads, embed, lambda1, lambda2, norm1, layout)
    grad_heads = torch.empty_like(heads)  # (3, B, h, N, d): dq, dk, dv written in place
    grad_q, grad_k, grad_v = (t.view(G, N, d) for t in grad_heads.unbind(0))

    # Stage II (and its RMSNorm).
    grad_mixed = grad.view(B, N, h, d).transpose(1, 2).reshape(G, N, d)  # (G, N, d)
    grad_lambda2 = grad_norm2 = None
    if layout.stage2_differential:
        inverse_rms2 = _inverse_rms(fwd.mixed, layout.eps)
        grad_mixed, grad_norm2 = _rms_norm_backward(grad_mixed, fwd.mixed * inverse_rms2, inverse_rms2, norm2 * c)
        grad_norm2 = grad_norm2 * c
    grad_weights = torch.bmm(grad_mixed, fwd.contrast_values.transpose(1, 2))  # (G, N, n)
    grad_contrast_values = torch.bmm(fwd.weights.transpose(1, 2), grad_mixed)  # (G, n, d)
    grad_scores = torch.empty_like(fwd.stage2_probs)  # (G, N, m2)
    if layout.stage2_differential:
        grad_lambda2 = _weights_backward(
            grad_weights,
            fwd.stage2_probs[..., :n],
            fwd.stage2_probs[..., n:],
            lambda2,
            layout.joint_softmax,
            grad_scores[..., :n],
            grad_scores[..., n:],
        )
    else:
        _weights_backward(grad_weights, fwd.stage2_probs, None, None, False, grad_scores, None)
    torch.bmm(grad_scores, fwd.stage2_keys, out=grad_q)  # keys carry the 1/√d
    grad_stage2_keys = torch.bmm(grad_scores.transpose(1, 2), fwd.q).mul_(fwd.scale)  # (G, m2, d)

    # Stage I (and its RMSNorm).
    grad_lambda1 = grad_norm1 = None
    grad_contrast = grad_contrast_values  # (G, n, d)
    if layout.stage1_differential:
        grad_contrast, grad_norm1 = _rms_norm_backward(grad_contrast_values, fwd.normed1, fwd.inverse_rms1, norm1 * c)
        grad_norm1 = grad_norm1 * c
    grad_weights1 = torch.bmm(grad_contrast, fwd.v.transpose(1, 2))  # (G, n, N)
    torch.bmm(fwd.stage1_weights.transpose(1, 2), grad_contrast, out=grad_v)
    grad_scores1 = torch.empty_like(fwd.stage1_probs)  # (G, m1, N)
    if layout.stage1_differential:  # two streams, each with its own softmax over the N keys
        grad_lambda1 = _weights_backward(
            grad_weights1,
            fwd.stage1_probs[:, :n],
            fwd.stage1_probs[:, n:],
            lambda1,
            False,
            grad_scores1[:, :n],
            grad_scores1[:, n:],
        )
    else:
        _weights_backward(grad_weights1, fwd.stage1_probs, None, None, False, grad_scores1, None)
    torch.bmm(grad_scores1.transpose(1, 2), fwd.stage1_queries, out=grad_k)  # queries carry the 1/√d
    grad_stage1_queries = torch.bmm(grad_scores1, fwd.k).mul_(fwd.scale)  # (G, m1, d)

    # The contrast streams: to E± (summed over the batch, in float32) and, through the pooling, to q.
    grad_streams = torch.zeros_like(fwd.streams)  # (G, S·n, d)
    grad_streams[:, : layout.stage1_rows] += grad_stage1_queries
    grad_streams[:, : layout.stage2_cols] += grad_stage2_keys
    grad_streams = grad_streams.view(B, h, -1, n, d)
    grad_embed = _sum_to_fp32(grad_streams, 0).unsqueeze(0)  # (1, h, S, n, d)
    if layout.pooled_content:
        grad_pooled = grad_streams.sum(dim=2).div_(r * r).view(B, h, p, 1, p, 1, d)
        grad_q.view(B, h, p, r, p, r, d).add_(grad_pooled)
    grad_heads[2].add_(grad_local.permute(0, 2, 3, 1).reshape(B, N, h, d).transpose(1, 2))
    grad_qkv = heads.new_empty(B, N, 3, h, d)
    grad_qkv.copy_(grad_heads.permute(1, 3, 0, 2, 4))  # (B, N, 3, h, d)
    return grad_qkv.view(B * N, 3 * h * d), grad_embed, grad_lambda1, grad_lambda2, grad_norm1, grad_norm2


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
    layout = KernelLayout(*args[9:])
    return 2 * sum(_attention_macs(x_shape, layout).values())


@register_flop_formula(torch.ops.dit_vca.vca_core_backward)
def _core_backward_flops(grad_shape, x_shape, *args, out_shape=None, **kwargs) -> int:
    """The GEMMs of _core_backward: the recomputation of both stages in matmul form (Stage I's scores of m1
    rows and values of n rows, Stage II's scores and values; the qkv GEMM with recompute_qkv), then two
    products per forward product (the gradients of both operands)."""
    layout = KernelLayout(*args[9:])
    B, N, C = x_shape
    n, m1, m2 = layout.contrast_grid**2, layout.stage1_rows, layout.stage2_cols
    recomputed = (m1 + n + m2 + n) * N * C * B + (3 * B * N * C * C if layout.recompute_qkv else 0)
    gradients = 2 * (m1 + n + m2 + n) * N * C * B + 2 * 9 * B * N * C + 2 * 3 * B * N * C * C
    return 2 * (recomputed + gradients)
