"""VCA's core on ATen operations: the `kernel="aten"` implementation of dit_vca::vca_core's attention stages.

The same two entry points as dit_vca.vca_triton, `add_attention` and `attention_backward`, on PyTorch operations:
SDPA and batched GEMMs. It is the CPU default and the reference the Triton kernels are checked against. The
letters are those of docs/VCA.md's notation table, the step numbers its steps. The forward saves nothing beyond
the operator's inputs and q, k, v; the backward recomputes both stages with their probabilities materialised
(GEMMs of n rows or columns, N×2n values per head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dit_vca.kernel_layout import KernelLayout


def saved_like(heads: Tensor, layout: KernelLayout) -> list[Tensor]:
    """What `add_attention` saves for the backward: nothing."""
    return []


def add_attention(
    result: Tensor,
    heads: Tensor,
    pooled: Tensor | None,
    embed: Tensor,
    lambda1: Tensor | None,
    lambda2: Tensor | None,
    norm1: Tensor | None,
    norm2: Tensor | None,
    layout: KernelLayout,
) -> list[Tensor]:
    """Adds both attention stages of the VCA core, computed from q, k, v `heads` (3, B, h, N, d), into `result`
    (B, N, C) (the depthwise convolution's output); returns what `attention_backward` needs besides the
    operator's inputs: nothing. `pooled` (B, h, n, d): the streams' content T given (with RoPE: dit_vca.vca_qk),
    else the pool of q."""
    _, B, h, N, d = heads.shape
    out = _attention_forward(heads, pooled, embed, lambda1, lambda2, norm1, layout)  # O, (B, h, N, d)
    if layout.stage2_differential:  # step 5: Y = (1 − λ_init)·RMSNorm(O)
        out = out * inverse_rms(out, layout.eps) * (norm2 * (1 - layout.lambda_init))
    result.view(B, N, h, d).add_(out.transpose(1, 2))
    return []


def sum_to_fp32(t: Tensor, dim) -> Tensor:
    """A sum accumulated and returned in (at least) float32: a parameter's gradient summed over B·h·N rows
    stays finite under a loss scaled for fp16."""
    return t.sum(dim=dim, dtype=torch.promote_types(t.dtype, torch.float32))


def inverse_rms(x: Tensor, eps: float) -> Tensor:
    """1 / sqrt(mean(x²) + eps) over the last dimension, accumulated in at least float32, shaped for
    broadcasting against x."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + eps).to(x.dtype)


def pool_queries(q: Tensor, layout: KernelLayout) -> Tensor:
    """Step 1: T, the p×p average pool of q (B, h, N, d), as (B, h, n, d). p divides H, so adaptive average
    pooling is a mean over r×r blocks; q of one head is a channels-last (d, H, W) image, pooled as one."""
    B, h, N, d = q.shape
    p, H = layout.contrast_grid, layout.grid_size
    q_image = q.reshape(B * h, H, H, d).permute(0, 3, 1, 2)  # (G, d, H, W), a view
    return F.avg_pool2d(q_image, H // p).permute(0, 2, 3, 1).reshape(B, h, p * p, d)  # (B, h, n, d)


def _contrast_streams(q: Tensor, pooled: Tensor | None, embed: Tensor, layout: KernelLayout) -> Tensor:
    """Steps 1–2: [T⁺; T⁻] = E± + T, T the p×p average pool of q (B, h, N, d) or `pooled` (B, h, n, d) where
    given, as (B, h, S·n, d): T⁺ rows first, contiguous."""
    B, h, N, d = q.shape
    n = layout.contrast_grid**2
    streams = embed.expand(B, h, -1, n, d)  # (B, h, S, n, d)
    if layout.pooled_content:
        content = pool_queries(q, layout) if pooled is None else pooled  # (B, h, n, d)
        streams = streams + content.unsqueeze(2)
    return streams.reshape(B, h, -1, d).contiguous()  # (B, h, S·n, d)


def _attention_forward(
    heads: Tensor,
    pooled: Tensor | None,
    embed: Tensor,
    lambda1: Tensor | None,
    lambda2: Tensor | None,
    norm1: Tensor | None,
    layout: KernelLayout,
) -> Tensor:
    """Steps 1–5 up to Stage II's RMSNorm: O = W·V̂, (B, h, N, d), without materialising a
    probability matrix where SDPA can do the work: Stage I always, Stage II with `layout.stage2_sdpa`. Every
    SDPA operand is a 4-D (B, h, L, d) tensor with unit last stride, all in one dtype."""
    q, k, v = heads.unbind(0)  # (B, h, N, d) each, contiguous
    n = layout.contrast_grid**2
    streams = _contrast_streams(q, pooled, embed, layout)  # steps 1–2: T±, (B, h, S·n, d)

    # Step 4, Stage I: the contrast tokens attend to all N keys: one fused call for both streams.
    read = F.scaled_dot_product_attention(streams[:, :, : layout.stage1_rows], k, v)  # (B, h, m1, d)
    v_hat = read  # V̂, (B, h, n, d)
    if layout.stage1_differential:
        contrast = torch.addcmul(read[:, :, :n], read[:, :, n:], lambda1, value=-1)  # R⁺ − λ₁R⁻
        v_hat = contrast * inverse_rms(contrast, layout.eps) * (norm1 * (1 - layout.lambda_init))

    # Step 5, Stage II: every query reads V̂ through its attention to the contrast tokens.
    if layout.stage2_sdpa:
        if not layout.stage2_differential:
            return F.scaled_dot_product_attention(q, streams[:, :, :n], v_hat)  # (B, h, N, d)
        if layout.joint_softmax:  # one softmax over 2n columns: P⁺V̂ − λ₂P⁻V̂ = softmax(q[T⁺;T⁻]ᵀ)·[V̂; −λ₂V̂]
            values = torch.cat([v_hat, v_hat * -lambda2], dim=2)  # (B, h, 2n, d)
            return F.scaled_dot_product_attention(q, streams[:, :, : 2 * n], values)
        positive = F.scaled_dot_product_attention(q, streams[:, :, :n], v_hat)
        negative = F.scaled_dot_product_attention(q, streams[:, :, n : 2 * n], v_hat)
        return torch.addcmul(positive, negative, lambda2, value=-1)
    keys = streams[:, :, : layout.stage2_cols] * q.shape[-1] ** -0.5  # (B, h, m2, d), scaled
    scores = q @ keys.transpose(-2, -1)  # (B, h, N, m2)
    probs = _stage2_softmax(scores, layout)
    weights = (
        torch.addcmul(probs[..., :n], probs[..., n:], lambda2, value=-1) if layout.stage2_differential else probs
    )  # W = P⁺ − λ₂P⁻, or P, (B, h, N, n)
    return weights @ v_hat  # (B, h, N, d)


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
        pooled: Tensor | None,
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
        self.streams = _contrast_streams(heads[0], pooled, embed, layout).view(G, -1, d)  # (G, S·n, d)

        # Step 4, Stage I (weighing the streams before the value product: (P⁺ − λ₁P⁻)·v, one product of n rows).
        self.stage1_queries = self.streams[:, : layout.stage1_rows] * self.scale  # (G, m1, d), scaled
        self.stage1_probs = torch.bmm(self.stage1_queries, self.k.transpose(1, 2)).softmax(dim=-1)  # (G, m1, N)
        self.stage1_weights = self.stage1_probs  # (G, n, N)
        if layout.stage1_differential:
            probs = self.stage1_probs
            self.stage1_weights = torch.addcmul(probs[:, :n], probs[:, n:], lambda1, value=-1)
        contrast = torch.bmm(self.stage1_weights, self.v)  # R⁺ − λ₁R⁻, (G, n, d)
        self.v_hat = contrast  # V̂, (G, n, d)
        if layout.stage1_differential:
            self.inverse_rms1 = inverse_rms(contrast, layout.eps)  # (G, n, 1)
            self.normed1 = contrast * self.inverse_rms1
            self.v_hat = self.normed1 * (norm1 * (1 - layout.lambda_init))

        # Step 5, Stage II.
        self.stage2_keys = self.streams[:, : layout.stage2_cols] * self.scale  # (G, m2, d), scaled
        self.stage2_probs = _stage2_softmax(torch.bmm(self.q, self.stage2_keys.transpose(1, 2)), layout)
        self.weights = self.stage2_probs  # (G, N, n)
        if layout.stage2_differential:
            probs = self.stage2_probs
            self.weights = torch.addcmul(probs[..., :n], probs[..., n:], lambda2, value=-1)  # W = P⁺ − λ₂P⁻
        self.out = torch.bmm(self.weights, self.v_hat)  # O, (G, N, d)


def rms_norm_backward(grad: Tensor, normed: Tensor, inverse_rms: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients of y = normed·weight, normed = x·inverse_rms(x), with respect to x and to weight (the latter
    summed in float32 over the dimensions the weight is broadcast along: a (d,) weight over all rows, a stack of
    weights (S, 1, …, 1, d) over the rows of each; the products stay in grad's dtype, |normed| ≤ √d)."""
    shape = (1,) * (grad.dim() - weight.dim()) + tuple(weight.shape)
    broadcast = tuple(dim for dim, size in enumerate(shape) if size == 1)
    grad_weight = sum_to_fp32(grad * normed, broadcast).view(weight.shape)  # as weight
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
    """Backward of the attention weights W = P⁺ − λ·P⁻ (or W = P alone when probs_neg is None), where P± are
    softmaxes of scores S over the last dimension: one joint softmax over the [S⁺, S⁻] columns, or one each.
    Writes the gradients dS⁺ and dS⁻ of the scores into out_pos and out_neg; returns the gradient of λ
    (float32)."""
    pos = torch.mul(grad_weights, probs_pos, out=out_pos)  # dW ⊙ P⁺
    row_pos = pos.sum(dim=-1, keepdim=True)
    if probs_neg is None:  # softmax backward: P ⊙ (dW − Σ dW ⊙ P)
        pos.addcmul_(probs_pos, row_pos, value=-1)
        return None
    neg = torch.mul(grad_weights, probs_neg, out=out_neg)  # dW ⊙ P⁻; the gradient of P⁻ is −λ·dW
    row_neg = sum_to_fp32(neg, -1).unsqueeze(-1)  # float32: summed again over all rows into dλ below
    grad_lambda = -row_neg.sum()
    row_neg = row_neg.to(neg.dtype)
    if joint:  # one softmax: both halves subtract the row sum of dP ⊙ P over all 2n columns, i.e. of dW ⊙ W
        row = row_pos - lam * row_neg
        pos.addcmul_(probs_pos, row, value=-1)
        neg.mul_(-lam).addcmul_(probs_neg, row, value=-1)
    else:
        pos.addcmul_(probs_pos, row_pos, value=-1)
        neg.addcmul_(probs_neg, row_neg, value=-1).mul_(-lam)
    return grad_lambda


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
    layout: KernelLayout,
) -> tuple[Tensor | None, ...]:
    """The backward of both attention stages from the gradient `grad` (B, N, C) of the core's result (`saved`
    is unused: add_attention saves nothing): the gradient of the qkv projection's output (B·N, 3C), the
    convolution's share `grad_local` of dv included, then those of E±, λ₁, λ₂, the norm weights and the given
    streams' content `pooled` (None where a switch is off or T was pooled here: then its share is in dq)."""
    _, B, h, N, d = heads.shape
    H, p = layout.grid_size, layout.contrast_grid
    n, r, c, G = p * p, H // p, 1 - layout.lambda_init, B * h
    fwd = _Recomputed(heads, pooled, embed, lambda1, lambda2, norm1, layout)
    grad_heads = torch.empty_like(heads)  # (3, B, h, N, d): dq, dk, dv written in place
    grad_q, grad_k, grad_v = (t.view(G, N, d) for t in grad_heads.unbind(0))

    # Step 5, Stage II (and its RMSNorm): dO from dY.
    grad_out = grad.view(B, N, h, d).transpose(1, 2).reshape(G, N, d)  # (G, N, d)
    grad_lambda2 = grad_norm2 = None
    if layout.stage2_differential:
        inverse_rms2 = inverse_rms(fwd.out, layout.eps)
        grad_out, grad_norm2 = rms_norm_backward(grad_out, fwd.out * inverse_rms2, inverse_rms2, norm2 * c)
        grad_norm2 = grad_norm2 * c
    grad_weights = torch.bmm(grad_out, fwd.v_hat.transpose(1, 2))  # dW, (G, N, n)
    grad_v_hat = torch.bmm(fwd.weights.transpose(1, 2), grad_out)  # dV̂, (G, n, d)
    grad_scores = torch.empty_like(fwd.stage2_probs)  # dS, (G, N, m2)
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

    # Step 4, Stage I (and its RMSNorm).
    grad_lambda1 = grad_norm1 = None
    grad_contrast = grad_v_hat  # (G, n, d)
    if layout.stage1_differential:
        grad_contrast, grad_norm1 = rms_norm_backward(grad_v_hat, fwd.normed1, fwd.inverse_rms1, norm1 * c)
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

    # Steps 1–2, the contrast streams: to E± (summed over the batch, in float32) and, through the pooling, to q.
    # Each stage's share covers the first m1 or m2 of the S·n stream rows, and one of them covers all: with a second
    # stream one stage at least is differential. Its share is the sum's start (no zero fill), the other is added.
    whole, part = (grad_stage1_queries, grad_stage2_keys)
    if layout.stage1_rows < layout.stage2_cols:
        whole, part = part, whole
    grad_streams = whole  # (G, S·n, d)
    grad_streams[:, : part.shape[1]] += part
    grad_streams = grad_streams.view(B, h, -1, n, d)
    grad_embed = sum_to_fp32(grad_streams, 0).unsqueeze(0)  # (1, h, S, n, d)
    grad_pooled = grad_streams.sum(dim=2) if layout.pooled_content else None  # dT, (B, h, n, d)
    if grad_pooled is not None and pooled is None:  # T pooled from q here: dq gains dT / r² in every window
        grad_q.view(B, h, p, r, p, r, d).add_(grad_pooled.div(r * r).view(B, h, p, 1, p, 1, d))
        grad_pooled = None
    grad_heads[2].add_(grad_local.permute(0, 2, 3, 1).reshape(B, N, h, d).transpose(1, 2))
    grad_qkv = heads.new_empty(B, N, 3, h, d)
    grad_qkv.copy_(grad_heads.permute(1, 3, 0, 2, 4))  # (B, N, 3, h, d)
    return (
        grad_qkv.view(B * N, 3 * h * d),
        grad_embed,
        grad_lambda1,
        grad_lambda2,
        grad_norm1,
        grad_norm2,
        grad_pooled,
    )
