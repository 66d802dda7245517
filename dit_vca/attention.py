"""Token mixers for DiT/SiT blocks: the official multi-head self-attention and Visual-Contrast Attention.

Both map tokens (B, N, C), laid out row-major on a square H×W grid, to tokens of the same shape, and both
keep the official DiT parameter names (`qkv`, a fused Linear(C, 3C), and `proj`), so a block holds either.
VCA follows docs/VCA.md (Pu et al., NeurIPS 2025, "Linear Differential Vision Transformer").
"""

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ATTENTION_KINDS = ("mhsa", "vca")
NORM_EPS = 1e-5  # of VCA's two RMSNorms


@dataclass(frozen=True)
class VCAOptions:
    """Switches of Visual-Contrast Attention. The defaults are the released code; the others give the paper's
    ablation rows (see VisualContrastAttention for what each switch turns off)."""

    contrast_grid: int | None = None  # side p of the pooled p×p grid; None means H/2 (n = N/4)
    joint_softmax: bool = True  # Stage II: one softmax over the 2n columns (released code) or two (paper text)
    stage1_differential: bool = True
    stage2_differential: bool = True
    pooled_content: bool = True  # False: the streams are the embeddings E± alone


def resolve_contrast_grid(grid_size: int, contrast_grid: int | None) -> int:
    """Side p of the contrast grid for an H×W = grid_size×grid_size token grid; p must divide grid_size."""
    if contrast_grid is None:
        if grid_size % 2:
            raise ValueError(
                f"the default contrast grid is H/2, but the token grid is {grid_size}x{grid_size} (odd); "
                f"pass contrast_grid= a divisor of {grid_size}"
            )
        return grid_size // 2
    if contrast_grid < 1 or grid_size % contrast_grid:
        raise ValueError(
            f"contrast_grid={contrast_grid} must be a positive divisor of the token grid side {grid_size} "
            f"(token grid {grid_size}x{grid_size})"
        )
    return contrast_grid


def lambda_init(block_index: int) -> float:
    """Initial differential weight of block ℓ (0-based): 0.8 − 0.6·exp(−0.3·ℓ), as in the Differential Transformer."""
    return 0.8 - 0.6 * math.exp(-0.3 * block_index)


class MultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention on SDPA with the official DiT layout (`qkv`, `proj`): the baseline."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """softmax(qkᵀ/√d)·v per head; a separate method so benchmarks can swap the kernel."""
        return F.scaled_dot_product_attention(q, k, v)  # (B, h, N, d)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4).unbind(0)
        out = self.attend(q, k, v)  # (B, h, N, d)
        return self.proj(out.transpose(1, 2).reshape(B, N, C))  # (B, N, C)


def _scaled_rms_norm(norm: nn.RMSNorm, x: Tensor, scale: float) -> Tensor:
    """scale · RMSNorm(x) over the last dimension, the scale folded into the norm's weight. Computed in the
    weight's dtype (float32 under bf16 autocast, for accuracy) and returned in x's dtype."""
    weight = norm.weight * scale
    return F.rms_norm(x.to(weight.dtype), norm.normalized_shape, weight, norm.eps).to(x.dtype)


class DifferentialWeight(nn.Module):
    """The scalar λ = exp(⟨λ_q1, λ_k1⟩) − exp(⟨λ_q2, λ_k2⟩) + λ_init that weighs a negative stream."""

    def __init__(self, head_dim: int, init: float):
        super().__init__()
        self.init = init
        self.q1, self.k1, self.q2, self.k2 = (nn.Parameter(torch.empty(head_dim)) for _ in range(4))
        for vector in (self.q1, self.k1, self.q2, self.k2):
            nn.init.normal_(vector, std=0.1)

    def forward(self) -> Tensor:
        return torch.exp(torch.dot(self.q1, self.k1)) - torch.exp(torch.dot(self.q2, self.k2)) + self.init


@dataclass(frozen=True)
class _KernelLayout:
    """The static shape and switches the fused VCA kernel needs besides its tensors."""

    num_heads: int
    grid_size: int  # H (= W)
    contrast_grid: int  # p, a divisor of H
    options: VCAOptions
    lambda_init: float
    eps: float  # of both RMSNorms
    recompute_qkv: bool  # recompute q, k, v in backward instead of saving them

    @property
    def stage1_rows(self) -> int:  # contrast tokens that read the keys in Stage I: [T⁺; T⁻] or T⁺
        return (2 if self.options.stage1_differential else 1) * self.contrast_grid**2

    @property
    def stage2_cols(self) -> int:  # contrast tokens that the queries read in Stage II
        return (2 if self.options.stage2_differential else 1) * self.contrast_grid**2


def _inverse_rms(x: Tensor, eps: float) -> Tensor:
    """1 / sqrt(mean(x²) + eps) over the last dimension, accumulated in at least float32, shaped for
    broadcasting against x."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + eps).to(x.dtype)


def _rms_norm_backward(grad: Tensor, normed: Tensor, inverse_rms: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients of y = normed·weight, normed = x·inverse_rms(x), with respect to x and to weight."""
    grad_weight = (grad * normed).flatten(0, -2).sum(0)  # (d,)
    grad_normed = grad * weight
    grad_x = (grad_normed - normed * (grad_normed * normed).mean(dim=-1, keepdim=True)) * inverse_rms
    return grad_x, grad_weight


def _weights_backward(grad_weights: Tensor, probs_pos: Tensor, probs_neg: Tensor | None, lam: Tensor | None,
                      joint: bool, out_pos: Tensor, out_neg: Tensor | None) -> Tensor | None:
    """Backward of the attention weights W = S⁺ − λ·S⁻ (or W = S alone when probs_neg is None), where S± are
    softmaxes of scores over the last dimension: one joint softmax over the [S⁺, S⁻] columns, or one each.
    Writes the gradients of the scores of S⁺ and S⁻ into out_pos and out_neg; returns the gradient of λ."""
    pos = torch.mul(grad_weights, probs_pos, out=out_pos)  # dW ⊙ S⁺
    row_pos = pos.sum(dim=-1, keepdim=True)
    if probs_neg is None:  # softmax backward: S ⊙ (dW − Σ dW ⊙ S)
        pos.addcmul_(probs_pos, row_pos, value=-1)
        return None
    neg = torch.mul(grad_weights, probs_neg, out=out_neg)  # dW ⊙ S⁻; the gradient of S⁻ is −λ·dW
    row_neg = neg.sum(dim=-1, keepdim=True)
    if joint:  # one softmax: both halves subtract the row sum of dS ⊙ S over all 2n columns, i.e. of dW ⊙ W
        row = row_pos - lam * row_neg
        pos.addcmul_(probs_pos, row, value=-1)
        neg.mul_(-lam).addcmul_(probs_neg, row, value=-1)
    else:
        pos.addcmul_(probs_pos, row_pos, value=-1)
        neg.addcmul_(probs_neg, row_neg, value=-1).mul_(-lam)
    return -row_neg.sum()


class _VCAForward:
    """The forward quantities of the VCA core for one batch, in head-major layout (G = B·h batches of one head),
    computed once in the forward pass and again (recomputation instead of storage) in the backward pass."""

    def __init__(self, heads: Tensor, embed: Tensor, lambda1: Tensor | None, lambda2: Tensor | None,
                 norm1: Tensor | None, layout: _KernelLayout, for_backward: bool):
        """for_backward: also keep Stage I's probabilities and weights (the backward pass needs them); without it
        Stage I runs as one fused SDPA call that never materialises them."""
        _, B, h, N, d = heads.shape  # (3, B, h, N, d)
        options, p, H = layout.options, layout.contrast_grid, layout.grid_size
        n, r, G = p * p, H // p, B * h
        self.layout, self.n, self.scale = layout, n, d**-0.5
        self.q, self.k, self.v = (t.view(G, N, d) for t in heads.unbind(0))  # views, each (G, N, d)

        # [T⁺; T⁻] = E± + pooled q; p divides H, so adaptive average pooling is a mean over r×r blocks.
        streams = embed.expand(B, h, -1, n, d)  # (B, h, S, n, d)
        if options.pooled_content:  # q of one head is a channels-last (d, H, W) image: pool it as one
            q_image = self.q.view(G, H, H, d).permute(0, 3, 1, 2)  # (G, d, H, W), a view
            pooled = F.avg_pool2d(q_image, r).permute(0, 2, 3, 1)  # (G, p, p, d)
            streams = streams + pooled.reshape(B, h, 1, n, d)
        self.streams = streams.reshape(G, -1, d)  # (G, S·n, d): T⁺ rows first, then T⁻

        # Stage I: the contrast tokens attend to all N keys.
        stage1_streams = self.streams[:, : layout.stage1_rows]  # (G, m1, d)
        if for_backward:
            self.stage1_queries = stage1_streams * self.scale  # scaled
            self.stage1_probs = torch.bmm(self.stage1_queries, self.k.transpose(1, 2)).softmax(dim=-1)  # (G, m1, N)
            self.stage1_weights = self.stage1_probs  # (G, n, N)
            if options.stage1_differential:  # A⁺v − λ₁A⁻v = (A⁺ − λ₁A⁻)v: one value product of n rows, not two
                probs = self.stage1_probs
                self.stage1_weights = torch.addcmul(probs[:, :n], probs[:, n:], lambda1, value=-1)
            contrast = torch.bmm(self.stage1_weights, self.v)  # (G, n, d)
        else:
            read = F.scaled_dot_product_attention(stage1_streams, self.k, self.v)  # (G, m1, d)
            contrast = torch.addcmul(read[:, :n], read[:, n:], lambda1, value=-1) if options.stage1_differential \
                else read  # (G, n, d)
        self.contrast_values = contrast  # V̂, (G, n, d)
        if options.stage1_differential:
            self.inverse_rms1 = _inverse_rms(contrast, layout.eps)  # (G, n, 1)
            self.normed1 = contrast * self.inverse_rms1
            self.contrast_values = self.normed1 * (norm1 * (1 - layout.lambda_init))

        # Stage II: every query reads V̂ through its attention to the contrast tokens.
        self.stage2_keys = self.streams[:, : layout.stage2_cols] * self.scale  # (G, m2, d), scaled
        scores = torch.bmm(self.q, self.stage2_keys.transpose(1, 2))  # (G, N, m2)
        if options.stage2_differential and not options.joint_softmax:
            self.stage2_probs = scores.view(G, N, 2, n).softmax(dim=-1).view(G, N, 2 * n)  # two softmaxes
        else:
            self.stage2_probs = scores.softmax(dim=-1)  # one softmax over all m2 columns
        if options.stage2_differential:
            probs = self.stage2_probs
            self.weights = torch.addcmul(probs[..., :n], probs[..., n:], lambda2, value=-1)  # S⁺ − λ₂S⁻, (G, N, n)
        else:
            self.weights = self.stage2_probs
        self.mixed = torch.bmm(self.weights, self.contrast_values)  # (G, N, d)


class _VCACore(torch.autograd.Function):
    """The VCA layer from its input tokens to the input of the output projection (qkv projection, attention and
    the depthwise convolution of v), with a hand-written backward pass.

    Why: through autograd the readable forward pays for layout copies and concatenations (the backward of
    unbind/stack, of the pooling, of the N×2n probability split) and stores every intermediate. Here q, k, v
    are made head-contiguous once, their gradients are written into one buffer, and the backward pass
    recomputes the attention probabilities (a few GEMMs of n rows or columns) instead of storing them.
    What is saved for backward: the input tokens and the head-major q, k, v (4·B·N·C values, what MHSA on
    SDPA keeps too), or with `layout.recompute_qkv` the input tokens alone (B·N·C values), at the price of one
    more qkv projection GEMM in the backward pass.
    """

    @staticmethod
    def forward(ctx, x: Tensor, qkv_weight: Tensor, qkv_bias: Tensor, embed: Tensor, lambda1: Tensor | None,
                lambda2: Tensor | None, norm1: Tensor | None, norm2: Tensor | None, conv_weight: Tensor,
                conv_bias: Tensor, layout: _KernelLayout) -> Tensor:
        B, N, C = x.shape
        h, d, device_type = layout.num_heads, C // layout.num_heads, x.device.type
        # Under autocast, compute in its dtype (as nn.Linear would); everything below runs with autocast off.
        autocast = torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type) if autocast else x.dtype
        with _autocast_off(device_type):
            x, qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight, conv_bias = (
                None if t is None else t.to(dtype)
                for t in (x, qkv_weight, qkv_bias, embed, lambda1, lambda2, norm1, norm2, conv_weight, conv_bias))
            heads = _project_heads(x, qkv_weight, qkv_bias, h)  # (3, B, h, N, d)
            fwd = _VCAForward(heads, embed, lambda1, lambda2, norm1, layout, for_backward=False)
            out = fwd.mixed  # (G, N, d)
            if layout.options.stage2_differential:
                out = out * _inverse_rms(out, layout.eps) * (norm2 * (1 - layout.lambda_init))
            local = F.conv2d(_value_image(heads[2], layout.grid_size), conv_weight, conv_bias,
                             padding=1, groups=C)  # (B, C, H, W)
            result = local.permute(0, 2, 3, 1).reshape(B, N, C)  # (B, N, C), a view when channels-last
            result.view(B, N, h, d).add_(out.view(B, h, N, d).transpose(1, 2))
        ctx.layout = layout
        kept_heads = None if layout.recompute_qkv else heads
        ctx.save_for_backward(x, qkv_weight, qkv_bias, kept_heads, embed, lambda1, lambda2, norm1, norm2, conv_weight)
        return result

    @staticmethod
    def backward(ctx, grad: Tensor):
        layout: _KernelLayout = ctx.layout
        x, qkv_weight, qkv_bias, heads, embed, lambda1, lambda2, norm1, norm2, conv_weight = ctx.saved_tensors
        B, N, C = x.shape
        h, options, H, p = layout.num_heads, layout.options, layout.grid_size, layout.contrast_grid
        d = C // h
        n, r, c, G = p * p, H // p, 1 - layout.lambda_init, B * h
        needs = ctx.needs_input_grad
        with _autocast_off(grad.device.type):
            grad = grad.to(x.dtype).contiguous()  # (B, N, C)
            if heads is None:
                heads = _project_heads(x, qkv_weight, qkv_bias, h)  # (3, B, h, N, d)
            fwd = _VCAForward(heads, embed, lambda1, lambda2, norm1, layout, for_backward=True)
            grad_heads = torch.empty_like(heads)  # (3, B, h, N, d): dq, dk, dv written in place
            grad_q, grad_k, grad_v = (t.view(G, N, d) for t in grad_heads.unbind(0))

            # Depthwise convolution of v.
            value_image = _value_image(heads[2], H)
            grad_image = grad.view(B, H, H, C).permute(0, 3, 1, 2)  # (B, C, H, W), channels-last view
            grad_local, grad_conv_weight, grad_conv_bias = torch.ops.aten.convolution_backward(
                grad_image, value_image, conv_weight, [C], [1, 1], [1, 1], [1, 1], False, [0, 0], C,
                [True, needs[8], needs[9]])

            # Stage II (and its RMSNorm).
            grad_mixed = grad.view(B, N, h, d).transpose(1, 2).reshape(G, N, d)  # (G, N, d)
            grad_lambda2 = grad_norm2 = None
            if options.stage2_differential:
                inverse_rms2 = _inverse_rms(fwd.mixed, layout.eps)
                grad_mixed, grad_norm2 = _rms_norm_backward(grad_mixed, fwd.mixed * inverse_rms2, inverse_rms2,
                                                            norm2 * c)
                grad_norm2 = grad_norm2 * c
            grad_weights = torch.bmm(grad_mixed, fwd.contrast_values.transpose(1, 2))  # (G, N, n)
            grad_contrast_values = torch.bmm(fwd.weights.transpose(1, 2), grad_mixed)  # (G, n, d)
            grad_scores = torch.empty_like(fwd.stage2_probs)  # (G, N, m2)
            if options.stage2_differential:
                grad_lambda2 = _weights_backward(grad_weights, fwd.stage2_probs[..., :n], fwd.stage2_probs[..., n:],
                                                 lambda2, options.joint_softmax, grad_scores[..., :n],
                                                 grad_scores[..., n:])
            else:
                _weights_backward(grad_weights, fwd.stage2_probs, None, None, False, grad_scores, None)
            torch.bmm(grad_scores, fwd.stage2_keys, out=grad_q)  # keys carry the 1/√d
            grad_stage2_keys = torch.bmm(grad_scores.transpose(1, 2), fwd.q).mul_(fwd.scale)  # (G, m2, d)

            # Stage I (and its RMSNorm).
            grad_lambda1 = grad_norm1 = None
            grad_contrast = grad_contrast_values  # (G, n, d)
            if options.stage1_differential:
                grad_contrast, grad_norm1 = _rms_norm_backward(grad_contrast_values, fwd.normed1, fwd.inverse_rms1,
                                                               norm1 * c)
                grad_norm1 = grad_norm1 * c
            grad_weights1 = torch.bmm(grad_contrast, fwd.v.transpose(1, 2))  # (G, n, N)
            torch.bmm(fwd.stage1_weights.transpose(1, 2), grad_contrast, out=grad_v)
            grad_scores1 = torch.empty_like(fwd.stage1_probs)  # (G, m1, N)
            if options.stage1_differential:  # two streams, each with its own softmax over the N keys
                grad_lambda1 = _weights_backward(grad_weights1, fwd.stage1_probs[:, :n], fwd.stage1_probs[:, n:],
                                                 lambda1, False, grad_scores1[:, :n], grad_scores1[:, n:])
            else:
                _weights_backward(grad_weights1, fwd.stage1_probs, None, None, False, grad_scores1, None)
            torch.bmm(grad_scores1.transpose(1, 2), fwd.stage1_queries, out=grad_k)  # queries carry the 1/√d
            grad_stage1_queries = torch.bmm(grad_scores1, fwd.k).mul_(fwd.scale)  # (G, m1, d)

            # The contrast streams: to E± (summed over the batch) and, through the pooling, to q.
            grad_streams = torch.zeros_like(fwd.streams)  # (G, S·n, d)
            grad_streams[:, : layout.stage1_rows] += grad_stage1_queries
            grad_streams[:, : layout.stage2_cols] += grad_stage2_keys
            grad_streams = grad_streams.view(B, h, -1, n, d)
            grad_embed = grad_streams.sum(dim=0, keepdim=True) if needs[3] else None  # (1, h, S, n, d)
            if options.pooled_content:
                grad_pooled = grad_streams.sum(dim=2).div_(r * r).view(B, h, p, 1, p, 1, d)
                grad_q.view(B, h, p, r, p, r, d).add_(grad_pooled)
            grad_heads[2].add_(grad_local.permute(0, 2, 3, 1).reshape(B, N, h, d).transpose(1, 2))

            # The qkv projection.
            grad_qkv = x.new_empty(B, N, 3, h, d)
            grad_qkv.copy_(grad_heads.permute(1, 3, 0, 2, 4))  # (B, N, 3, h, d)
            grad_qkv = grad_qkv.view(B * N, 3 * C)
            grad_x = (grad_qkv @ qkv_weight).view(B, N, C) if needs[0] else None
            grad_qkv_weight = grad_qkv.T @ x.reshape(B * N, C) if needs[1] else None  # (3C, C)
            grad_qkv_bias = grad_qkv.sum(dim=0) if needs[2] else None
        return (grad_x, grad_qkv_weight, grad_qkv_bias, grad_embed, grad_lambda1, grad_lambda2, grad_norm1,
                grad_norm2, grad_conv_weight, grad_conv_bias, None)


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context with autocast disabled on `device_type` (nothing to disable where autocast does not exist, e.g.
    the meta device)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _project_heads(x: Tensor, weight: Tensor, bias: Tensor, num_heads: int) -> Tensor:
    """The qkv projection of tokens x (B, N, C) as one head-contiguous tensor (3, B, h, N, d): q, k, v of every
    head are then (N, d) matrices with a common batch stride, as batched GEMMs need them. The bias is added
    in the same pass that reorders the GEMM's output."""
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


class VisualContrastAttention(nn.Module):
    """Visual-Contrast Attention: O(N·n·C) attention through n = p² pooled contrast tokens (VCA.md).

    Stage I lets the positive and negative contrast streams T± = pool(q) + E± read all tokens and takes their
    λ₁-weighted difference V̂; Stage II lets every query read V̂ through the λ₂-weighted difference of its
    attention to T⁺ and T⁻. A depthwise 3×3 convolution of v adds local detail before the output projection.

    Ablation switches (our reading of the paper's rows; VCA.md does not spell out the "off" states):
    - `stage1_differential=False` ("Stage II only"): Stage I is plain attention of T⁺ over the tokens,
      V̂ = softmax(T⁺kᵀ/√d)·v, with no negative stream, λ₁, RMSNorm or (1 − λ_init) scale.
    - `stage2_differential=False` ("Stage I only"): Stage II is plain attention of the queries over the
      positive contrast tokens, O = softmax(qT⁺ᵀ/√d)·V̂, likewise without λ₂, RMSNorm or scale.
    - `pooled_content=False` ("streams from embeddings only"): T± = E±, the pooled queries are not used.
    - `joint_softmax=False`: Stage II uses two softmaxes (paper text) instead of one over 2n columns.
    The paper's "plain differential attention in both stages" row is not defined precisely enough in
    VCA.md to reproduce, so it has no switch. Parameters that a configuration never uses are not created.
    """

    def __init__(self, dim: int, num_heads: int, grid_size: int, block_index: int, options: VCAOptions = VCAOptions()):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.grid_size = grid_size
        self.contrast_grid = resolve_contrast_grid(grid_size, options.contrast_grid)
        self.options = options
        self.lambda_init = lambda_init(block_index)
        num_contrast = self.contrast_grid**2

        self.qkv = nn.Linear(dim, 3 * dim)
        # E⁺ = contrast_embed[:, :, 0] and E⁻ = contrast_embed[:, :, 1] (absent when no stage is differential),
        # stored together so that both streams come out of one broadcast add, already stacked.
        num_streams = 2 if options.stage1_differential or options.stage2_differential else 1
        self.contrast_embed = nn.Parameter(torch.empty(1, num_heads, num_streams, num_contrast, self.head_dim))
        nn.init.normal_(self.contrast_embed)
        if options.stage1_differential:
            self.lambda1 = DifferentialWeight(self.head_dim, self.lambda_init)
            self.norm1 = nn.RMSNorm(self.head_dim, eps=NORM_EPS)
        if options.stage2_differential:
            self.lambda2 = DifferentialWeight(self.head_dim, self.lambda_init)
            self.norm2 = nn.RMSNorm(self.head_dim, eps=NORM_EPS)
        self.value_conv = nn.Conv2d(dim, dim, kernel_size=3, padding=1, groups=dim)
        self.proj = nn.Linear(dim, dim)

        # Not a parameter or buffer (exports are unchanged): True trades one more qkv GEMM in backward for
        # 3·B·N·C fewer values saved for it (see _VCACore).
        self.recompute_qkv = False

    def forward(self, x: Tensor) -> Tensor:
        """The fast path: the core as one autograd Function with a hand-written backward (`_VCACore`).
        Equal to `reference_forward` up to float rounding, outputs and gradients (tested). Under torch.compile
        the readable path is traced instead: the compiler fuses its element-wise steps itself, and Dynamo
        cannot trace the in-place writes of the hand-written backward."""
        if torch.compiler.is_compiling():
            return self.reference_forward(x)
        options = self.options
        core = _VCACore.apply(
            x,  # (B, N, C)
            self.qkv.weight,
            self.qkv.bias,
            self.contrast_embed,
            self.lambda1() if options.stage1_differential else None,
            self.lambda2() if options.stage2_differential else None,
            self.norm1.weight if options.stage1_differential else None,
            self.norm2.weight if options.stage2_differential else None,
            self.value_conv.weight,
            self.value_conv.bias,
            _KernelLayout(self.num_heads, self.grid_size, self.contrast_grid, options, self.lambda_init, NORM_EPS,
                          self.recompute_qkv),
        )  # (B, N, C)
        return self.proj(core)  # (B, N, C)

    def reference_forward(self, x: Tensor) -> Tensor:
        """The readable path: VCA step by step in autograd-differentiated torch operations. It is the
        specification `forward` is tested against, and the one to read to understand VCA."""
        B, N, C = x.shape
        h, d, H, p = self.num_heads, self.head_dim, self.grid_size, self.contrast_grid
        options = self.options
        q, k, v = self.qkv(x).view(B, N, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)  # 3 × (B, h, N, d)
        n = p * p

        # 1-2. Contrast streams [T⁺; T⁻] = adaptive average pool of q to p×p, plus E±.
        streams = self.contrast_embed.expand(B, -1, -1, -1, -1)  # (B, h, 2 or 1, n, d)
        if options.pooled_content:
            q_image = q.transpose(1, 2).reshape(B, H, H, C).permute(0, 3, 1, 2)  # (B, C, H, W), a view
            pooled = F.adaptive_avg_pool2d(q_image, p).flatten(2).unflatten(1, (h, d)).transpose(2, 3)  # (B, h, n, d)
            streams = streams + pooled.unsqueeze(2)
        streams = streams.flatten(2, 3)  # (B, h, 2n, d): T⁺ rows first, then T⁻
        t_pos = streams[:, :, :n]  # (B, h, n, d)

        # 4. Stage I: the contrast tokens attend to all N keys (one fused call for both streams).
        if options.stage1_differential:
            read_pos, read_neg = F.scaled_dot_product_attention(streams, k, v).unflatten(2, (2, n)).unbind(2)
            contrast_values = _scaled_rms_norm(self.norm1, read_pos - self.lambda1() * read_neg, 1 - self.lambda_init)
        else:
            contrast_values = F.scaled_dot_product_attention(t_pos, k, v)  # (B, h, n, d)

        # 5. Stage II: every query reads the contrast values: one matmul and a softmax over the n (or 2n) columns.
        # Combining the two maps before the value product keeps it at 3·n·N·C multiply-adds.
        if options.stage2_differential:
            scores = q @ (streams * d**-0.5).transpose(-2, -1)  # (B, h, N, 2n)
            if options.joint_softmax:
                probs = scores.softmax(dim=-1).unflatten(-1, (2, n))  # (B, h, N, 2, n)
            else:
                probs = scores.unflatten(-1, (2, n)).softmax(dim=-1)  # (B, h, N, 2, n)
            probs_pos, probs_neg = probs.unbind(-2)  # (B, h, N, n) each
            weights = torch.addcmul(probs_pos, probs_neg, -self.lambda2())  # S⁺ − λ₂·S⁻
            out = _scaled_rms_norm(self.norm2, weights @ contrast_values, 1 - self.lambda_init)  # (B, h, N, d)
        else:
            out = (q @ (t_pos * d**-0.5).transpose(-2, -1)).softmax(dim=-1) @ contrast_values  # (B, h, N, d)
        out = out.transpose(1, 2).reshape(B, N, C)  # heads concatenated

        # 6. Local detail: depthwise 3×3 convolution of v (channels-last, its natural token layout).
        v_image = v.transpose(1, 2).reshape(B, H, H, C).permute(0, 3, 1, 2)  # (B, C, H, W)
        local = self.value_conv(v_image.contiguous(memory_format=torch.channels_last))  # (B, C, H, W)
        return self.proj(out + local.flatten(2).transpose(1, 2))  # (B, N, C)


def build_attention(
    kind: str, dim: int, num_heads: int, grid_size: int, block_index: int, vca_options: VCAOptions
) -> nn.Module:
    """The token mixer of block `block_index`: "mhsa" (official DiT) or "vca"."""
    if kind == "mhsa":
        return MultiHeadSelfAttention(dim, num_heads)
    if kind == "vca":
        return VisualContrastAttention(dim, num_heads, grid_size, block_index, vca_options)
    raise ValueError(f"unknown attention {kind!r}; expected one of {ATTENTION_KINDS}")
