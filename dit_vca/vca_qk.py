"""QK-norm and 2-D RoPE inside VCA's core: the queries and keys the attention stages read, and the way back.

A pre-step of dit_vca::vca_core between the qkv projection and the attention stages, shared by both
implementations of the stages (dit_vca.vca_aten, dit_vca.vca_triton): they read the prepared q̃, k̃ (and, with
RoPE, the streams' content T placed at the cells' centres) instead of the projection's q, k, and their backward
returns the gradients of what they read, which `prepare_backward` carries back to q, k and the norm gains. Written
by hand, not as autograd operations around the core, so that the options keep VCA on its fused core (one custom
operator, its memory and torch.compile's view of it). docs/VCA.md ("QK-norm and 2-D RoPE") gives the reasons:

    q̂ = RMSNorm(q)·g_q,  k̂ = RMSNorm(k)·g_k          (QK-norm, eps QK_NORM_EPS; else q̂ = q, k̂ = k)
    T = AvgPool_{p×p}(q̂)                              (of the normalised queries; not normalised again)
    q̃ = R(position)·q̂,  k̃ = R(position)·k̂,  T ← R(cell centre)·T      (RoPE; else q̃ = q̂, k̃ = k̂)

Everything is computed in at least float32 (the gains and the RoPE tables are float32) and rounded once to the
core's dtype, as MHSA's QK-norm and RoPE compute. Nothing is saved: the backward recomputes the pre-step from
q and k (element-wise work) rather than keeping q̃, k̃ beside them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dit_vca.kernel_layout import KernelLayout
from dit_vca.rope import rotate_pairs
from dit_vca.vca_aten import inverse_rms, pool_queries, rms_norm_backward

# RoPE's tables as the core takes them: cosines and sines (N, d/2) of the tokens' positions, then of the contrast
# tokens' (n, d/2), the centres of their pooling cells (dit_vca.rope.grid_positions).
RopeTables = tuple[Tensor, Tensor, Tensor, Tensor]


def _wide(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _gains(q_norm: Tensor, k_norm: Tensor, dtype: torch.dtype) -> Tensor:
    """g_q and g_k stacked to scale q and k together, (2, 1, 1, 1, d)."""
    return torch.stack([q_norm, k_norm]).to(dtype).view(2, 1, 1, 1, -1)


def prepare(
    heads: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, rope: RopeTables | None, layout: KernelLayout
) -> tuple[Tensor, Tensor | None]:
    """From the projection's q, k, v `heads` (3, B, h, N, d): (the attention stages' q̃, k̃, v as one new
    (3, B, h, N, d) tensor, and with RoPE the streams' content R(centre)·T (B, h, n, d), else None: the stages
    pool q̃ = q̂ themselves). QK-norm where `q_norm` and `k_norm` (gains, (d,)) are given, RoPE where `rope` is.
    q and k go through each step together, as one (2, B, h, N, d) tensor: half the operations."""
    dtype = _wide(heads)
    prepared = torch.empty_like(heads)
    prepared[2].copy_(heads[2])  # v as it is
    qk = heads[:2].to(dtype)  # (2, B, h, N, d): q, k
    if q_norm is not None:
        qk = F.rms_norm(qk, (qk.shape[-1],), eps=layout.qk_norm_eps) * _gains(q_norm, k_norm, dtype)  # q̂, k̂
    pooled = None
    if rope is not None:
        token_cos, token_sin, contrast_cos, contrast_sin = (t.to(dtype) for t in rope)
        if layout.pooled_content:  # T of the unrotated q̂, then turned to its cell's centre
            pooled = rotate_pairs(pool_queries(qk[0], layout), contrast_cos, contrast_sin).to(heads.dtype)
        qk = rotate_pairs(qk, token_cos, token_sin)  # q̃, k̃
    prepared[:2].copy_(qk)
    return prepared, pooled


def prepare_backward(
    grad_qkv: Tensor,
    heads: Tensor,
    grad_pooled: Tensor | None,
    q_norm: Tensor | None,
    k_norm: Tensor | None,
    rope: RopeTables | None,
    layout: KernelLayout,
) -> tuple[Tensor | None, Tensor | None]:
    """The pre-step's backward, in place: `grad_qkv` (B·N, 3C) holds dq̃, dk̃ (and dv) as the attention stages
    return them and leaves with dq, dk; `grad_pooled` (B, h, n, d) is dT of the content `prepare` gave them (with
    RoPE). Returns the gradients of the gains g_q, g_k (float32; None without QK-norm). `heads` are the
    projection's q, k, v (3, B, h, N, d), from which the forward quantities are recomputed."""
    _, B, h, N, d = heads.shape
    dtype = _wide(heads)
    grad_out = grad_qkv.view(B, N, 3, h, d)[:, :, :2].permute(2, 0, 3, 1, 4)  # (2, B, h, N, d): dq, dk, a view
    grad = grad_out.to(dtype)
    if rope is not None:  # a rotation's gradient turns back: Rᵀ = R(−angle)
        token_cos, token_sin, contrast_cos, contrast_sin = (t.to(dtype) for t in rope)
        grad = rotate_pairs(grad, token_cos, -token_sin)  # (2, B, h, N, d), contiguous
        if grad_pooled is not None:  # T = mean of q̂ over each r×r window: every token of it gains dT / r²
            p, r = layout.contrast_grid, layout.grid_size // layout.contrast_grid
            grad_content = rotate_pairs(grad_pooled.to(dtype), contrast_cos, -contrast_sin) / (r * r)
            grad[0].view(B, h, p, r, p, r, d).add_(grad_content.view(B, h, p, 1, p, 1, d))
    grad_gains = (None, None)
    if q_norm is not None:
        qk = heads[:2].to(dtype)
        inverse = inverse_rms(qk, layout.qk_norm_eps)  # (2, B, h, N, 1)
        grad, stacked = rms_norm_backward(grad, qk * inverse, inverse, _gains(q_norm, k_norm, dtype))
        grad_gains = tuple(g.clone() for g in stacked.view(2, d))  # two tensors: an operator's outputs never alias
    grad_out.copy_(grad)
    return grad_gains
