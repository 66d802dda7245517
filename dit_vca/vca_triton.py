"""VCA's core as fused Triton kernels: the `kernel="triton"` implementation of dit_vca::vca_core and its backward.

The operators of dit_vca.vca_core call `add_attention` / `attention_backward` here when their `triton` argument
is set (VisualContrastAttention.kernel; by default on CUDA); the ATen implementation there stays the CPU path
and the reference. The qkv projection, the depthwise 3×3 convolution of v and the GEMMs of the qkv backward stay
there (cuBLAS/cuDNN); everything between them runs in these kernels, one program per (image·head, block of
rows):

- `_streams_kernel`: [T⁺; T⁻] = E± + the r×r average pool of q, per contrast token.
- `_stage1_kernel`: Stage I, flash-style: the contrast rows of both streams stream over the N keys in tiles with
  an online softmax each; the λ₁-difference, RMSNorm and (1 − λ_init) scale at the end; writes V̂ (n, d).
- `_stage2_kernel`: Stage II: a block of queries against the contrast tokens [T⁺; T⁻] (the 2n ≤ 512 columns
  stream through in tiles, an online softmax joint over both streams or one per stream), (S⁺ − λ₂S⁻)·V̂,
  RMSNorm and scale, added into the convolution's output: the core's result.
- Backward, FlashAttention-2 style: nothing of size N×n is stored (per query only dO, (N, d), and two
  statistics per stream); every kernel recomputes its probabilities from row log-sum-exps, every sum is
  accumulated in float32:
  `_stage1_kernel` again (V̂ and, for backward, R± and the log-sum-exps, (n, d) and (n,) per stream),
  `_stage2_rows_kernel` (per query block: Stage II's RMSNorm backward, dq of Stage II, dλ₂, the norm weight),
  `_stage2_columns_kernel` (per block of contrast tokens over all queries: dV̂ and dT± of Stage II),
  `_stage1_norm_kernel` (Stage I's RMSNorm and λ₁ backward), `_stage1_keys_kernel` (per key block: dk, dv),
  `_stage1_rows_kernel` (per contrast block: dT± of Stage I) and `_streams_backward_kernel` (dE±, and dq
  through the pooling).
Parameter gradients summed over heads and rows (λ, norm weights, E±) are float32 atomic adds.

Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported) runs the same kernels on CPU tensors:
that is how the tests check them. Under the interpreter autotuning keeps one configuration.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from dit_vca.triton_exclusions import usable_configs

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _configs(kernel: str, names: tuple[str, ...], interpreted: tuple, compiled: list[tuple]) -> list[triton.Config]:
    """`kernel`'s autotuning configurations from (block sizes..., num_warps, num_stages) tuples: on the GPU the few
    of `compiled` (each is one more compilation per kernel, dtype and head dim: 5–20 s each on a CPU core for the
    backward's kernels) less those that failed to compile for this GPU and Triton version (the compile matrix's
    table, dit_vca.triton_exclusions), under the interpreter `interpreted` alone (timing there means nothing;
    small blocks, so that the tests' small shapes cross tile boundaries). A configuration that needs more shared
    memory than the GPU has is skipped by the autotuner (OutOfResources)."""
    choices = [interpreted] if INTERPRETED else usable_configs(kernel, names, compiled)
    return [triton.Config(dict(zip(names, c[:-2])), num_warps=c[-2], num_stages=c[-1]) for c in choices]


# Block sizes ≥ 16 (tl.dot's smallest), one declaration per kernel. Rows: contrast tokens (BLOCK_M) against key or
# query tiles (BLOCK_N). The last of each list, unpipelined, fits fp32 with d = 72 (128-wide tiles), for which the
# others need more shared memory than an H100/H200 has (≥ 311 KiB against 227 KiB, compiled for sm_90).
_ROW_TILES = [(64, 64, 4, 3), (32, 128, 4, 3), (32, 64, 4, 1)]
# Queries: query tiles (BLOCK_N) against tiles of contrast columns (BLOCK_C).
_QUERY_TILES = [(64, 64, 4, 3), (128, 32, 4, 2), (32, 64, 4, 1)]
_ROWS, _QUERIES, _SMALL = ("BLOCK_M", "BLOCK_N"), ("BLOCK_N", "BLOCK_C"), (16, 16, 4, 1)
_STAGE1_CONFIGS = _configs("_stage1_kernel", _ROWS, _SMALL, _ROW_TILES)
_STAGE2_CONFIGS = _configs("_stage2_kernel", _QUERIES, _SMALL, _QUERY_TILES)
_STAGE2_ROWS_CONFIGS = _configs("_stage2_rows_kernel", _QUERIES, _SMALL, _QUERY_TILES)
_STAGE2_COLUMNS_CONFIGS = _configs("_stage2_columns_kernel", _ROWS, _SMALL, _ROW_TILES)
_STAGE1_KEYS_CONFIGS = _configs("_stage1_keys_kernel", _ROWS, _SMALL, _ROW_TILES)
_STAGE1_ROWS_CONFIGS = _configs("_stage1_rows_kernel", _ROWS, _SMALL, _ROW_TILES)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b accumulated in float32. PRECISION "upcast" (only under the interpreter, for bf16): the operands
    in float32 first, because Triton 3.8's interpreter multiplies bf16 tiles as their integer bit patterns;
    the result is the GPU's (bf16 products are exact in float32, and tensor cores accumulate in float32)."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _online_step(scores, m, l):  # noqa: E741
    """One tile of an online softmax: the new running max, the rescale of what was summed so far, the tile's
    unnormalised probabilities and the new running sum."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp(m - m_new)
    probs = tl.exp(scores - m_new[:, None])
    return m_new, alpha, probs, l * alpha + tl.sum(probs, 1)


@triton.jit
def _rms_scale(x, weight, dmask, d, eps):
    """x · rsqrt(mean(x²) + eps) · weight over the last dimension of a (rows, BLOCK_D) tile (padding zero)."""
    inverse = 1.0 / tl.sqrt(tl.sum(x * x, 1) / d + eps)
    return x * inverse[:, None] * weight[None, :], inverse


@triton.jit
def _rms_backward(grad, x, weight, d, eps):
    """Gradient of y = RMSNorm(x)·weight with respect to x, and (grad ⊙ normed) for the weight's gradient."""
    inverse = 1.0 / tl.sqrt(tl.sum(x * x, 1) / d + eps)
    normed = x * inverse[:, None]
    grad_normed = grad * weight[None, :]
    mean = tl.sum(grad_normed * normed, 1) / d
    return (grad_normed - normed * mean[:, None]) * inverse[:, None], grad * normed


# ----------------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _streams_kernel(
    q,  # (G, N, d)
    embed,  # (h, S, n, d)
    streams,  # out: (G, S·n, d)
    h,
    H,
    p,
    d,
    S: tl.constexpr,
    POOLED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    g, block = tl.program_id(0), tl.program_id(1)  # head g = b·h + head, a block of contrast tokens
    n, r = p * p, H // p
    j = block * BLOCK_J + tl.arange(0, BLOCK_J)  # contrast tokens, row-major on the p×p grid
    dims = tl.arange(0, BLOCK_D)
    tile = (j < n)[:, None] & (dims < d)[None, :]
    pooled = tl.zeros((BLOCK_J, BLOCK_D), dtype=tl.float32)
    if POOLED:
        corner = (j // p) * r * H + (j % p) * r  # the first token of each r×r window
        for t in range(0, r * r):
            token = corner + (t // r) * H + t % r
            pooled += tl.load(q + (g * H * H + token[:, None]) * d + dims[None, :], mask=tile, other=0.0).to(tl.float32)
        pooled = pooled / (r * r)
    for s in tl.static_range(S):
        e = tl.load(embed + (((g % h) * S + s) * n + j[:, None]) * d + dims[None, :], mask=tile, other=0.0)
        place = streams + (g * S * n + s * n + j[:, None]) * d + dims[None, :]
        tl.store(place, (pooled + e.to(tl.float32)).to(streams.dtype.element_ty), mask=tile)


@triton.autotune(configs=_STAGE1_CONFIGS, key=["N", "n", "BLOCK_D", "DIFF"])
@triton.jit
def _stage1_kernel(
    streams,  # (G, rows, d): T⁺ rows [0, n), T⁻ rows [n, 2n)
    k,  # (G, N, d)
    v,  # (G, N, d)
    lam,  # λ₁, a 0-d tensor (any pointer when not DIFF)
    norm,  # (d,) RMSNorm weight (any pointer when not DIFF)
    values,  # out: V̂, (G, n, d)
    reads,  # out when SAVE: R⁺, R⁻ in float32, (G, m1, d)
    lse,  # out when SAVE: the rows' log-sum-exp over the keys, float32, (G, m1)
    N,
    n,
    d,
    rows,
    scale,
    eps,
    out_scale,
    DIFF: tl.constexpr,
    SAVE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    g, block = tl.program_id(0), tl.program_id(1)
    i = block * BLOCK_M + tl.arange(0, BLOCK_M)  # contrast tokens
    dims = tl.arange(0, BLOCK_D)
    imask, dmask = i < n, dims < d
    tile = imask[:, None] & dmask[None, :]
    t_pos = tl.load(streams + (g * rows + i[:, None]) * d + dims[None, :], mask=tile, other=0.0)
    m_pos = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_pos = tl.zeros((BLOCK_M,), tl.float32)
    acc_pos = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    if DIFF:
        t_neg = tl.load(streams + (g * rows + n + i[:, None]) * d + dims[None, :], mask=tile, other=0.0)
        m_neg = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_neg = tl.zeros((BLOCK_M,), tl.float32)
        acc_neg = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start in range(0, N, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        kmask = keys < N
        k_t = tl.load(k + (g * N + keys[None, :]) * d + dims[:, None], mask=kmask[None, :] & dmask[:, None], other=0.0)
        v_tile = tl.load(
            v + (g * N + keys[:, None]) * d + dims[None, :], mask=kmask[:, None] & dmask[None, :], other=0.0
        )
        scores = _dot(t_pos, k_t, PRECISION) * scale  # (BLOCK_M, BLOCK_N)
        scores = tl.where(kmask[None, :], scores, float("-inf"))
        m_pos, alpha, probs, l_pos = _online_step(scores, m_pos, l_pos)
        acc_pos = acc_pos * alpha[:, None] + _dot(probs.to(v_tile.dtype), v_tile, PRECISION)
        if DIFF:
            scores = _dot(t_neg, k_t, PRECISION) * scale
            scores = tl.where(kmask[None, :], scores, float("-inf"))
            m_neg, alpha, probs, l_neg = _online_step(scores, m_neg, l_neg)
            acc_neg = acc_neg * alpha[:, None] + _dot(probs.to(v_tile.dtype), v_tile, PRECISION)
    read_pos = acc_pos / l_pos[:, None]  # R⁺ = softmax(T⁺kᵀ/√d)·v, (BLOCK_M, BLOCK_D)
    result = read_pos
    if DIFF:
        read_neg = acc_neg / l_neg[:, None]
        weight = tl.load(norm + dims, mask=dmask, other=0.0).to(tl.float32) * out_scale
        result, _ = _rms_scale(read_pos - tl.load(lam).to(tl.float32) * read_neg, weight, dmask, d, eps)
    tl.store(values + (g * n + i[:, None]) * d + dims[None, :], result.to(values.dtype.element_ty), mask=tile)
    if SAVE:
        m1 = 2 * n if DIFF else n
        tl.store(reads + (g * m1 + i[:, None]) * d + dims[None, :], read_pos, mask=tile)
        tl.store(lse + g * m1 + i, m_pos + tl.log(l_pos), mask=imask)
        if DIFF:
            tl.store(reads + (g * m1 + n + i[:, None]) * d + dims[None, :], read_neg, mask=tile)
            tl.store(lse + g * m1 + n + i, m_neg + tl.log(l_neg), mask=imask)


@triton.jit
def _stage2_pass(
    q_tile,
    streams,
    values,
    g,
    n,
    d,
    rows,
    scale,
    lam,
    DIFF: tl.constexpr,
    JOINT: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Stage II's online softmax of a query tile over the n contrast columns of T⁺ (and T⁻), reading V̂.
    Returns (O⁺, O⁻, m⁺, l⁺, m⁻, l⁻) unnormalised: with JOINT the two streams share max and sum (m⁻, l⁻ are
    then m⁺, l⁺). Unless SPLIT, a joint softmax weighs V̂ once by S⁺ − λ₂S⁻ (O⁺ holds the difference)."""
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < d
    m_pos = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    l_pos = tl.zeros((BLOCK_N,), tl.float32)
    acc_pos = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    m_neg = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    l_neg = tl.zeros((BLOCK_N,), tl.float32)
    acc_neg = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    for start in range(0, n, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        cmask = cols < n
        t_mask = dmask[:, None] & cmask[None, :]
        t_pos = tl.load(streams + (g * rows + cols[None, :]) * d + dims[:, None], mask=t_mask, other=0.0)
        v_tile = tl.load(
            values + (g * n + cols[:, None]) * d + dims[None, :], mask=cmask[:, None] & dmask[None, :], other=0.0
        )
        s_pos = tl.where(cmask[None, :], _dot(q_tile, t_pos, PRECISION) * scale, float("-inf"))
        if DIFF:
            t_neg = tl.load(streams + (g * rows + n + cols[None, :]) * d + dims[:, None], mask=t_mask, other=0.0)
            s_neg = _dot(q_tile, t_neg, PRECISION) * scale
            s_neg = tl.where(cmask[None, :], s_neg, float("-inf"))
            if JOINT:
                m_new = tl.maximum(m_pos, tl.maximum(tl.max(s_pos, 1), tl.max(s_neg, 1)))
                alpha = tl.exp(m_pos - m_new)
                p_pos, p_neg = tl.exp(s_pos - m_new[:, None]), tl.exp(s_neg - m_new[:, None])
                l_pos = l_pos * alpha + tl.sum(p_pos, 1) + tl.sum(p_neg, 1)
                m_pos = m_new
                if SPLIT:
                    acc_pos = acc_pos * alpha[:, None] + _dot(p_pos.to(v_tile.dtype), v_tile, PRECISION)
                    acc_neg = acc_neg * alpha[:, None] + _dot(p_neg.to(v_tile.dtype), v_tile, PRECISION)
                else:
                    weights = (p_pos - lam * p_neg).to(v_tile.dtype)
                    acc_pos = acc_pos * alpha[:, None] + _dot(weights, v_tile, PRECISION)
            else:
                m_pos, alpha, p_pos, l_pos = _online_step(s_pos, m_pos, l_pos)
                acc_pos = acc_pos * alpha[:, None] + _dot(p_pos.to(v_tile.dtype), v_tile, PRECISION)
                m_neg, alpha, p_neg, l_neg = _online_step(s_neg, m_neg, l_neg)
                acc_neg = acc_neg * alpha[:, None] + _dot(p_neg.to(v_tile.dtype), v_tile, PRECISION)
        else:
            m_pos, alpha, p_pos, l_pos = _online_step(s_pos, m_pos, l_pos)
            acc_pos = acc_pos * alpha[:, None] + _dot(p_pos.to(v_tile.dtype), v_tile, PRECISION)
    if JOINT:
        m_neg, l_neg = m_pos, l_pos
    return acc_pos, acc_neg, m_pos, l_pos, m_neg, l_neg


@triton.autotune(configs=_STAGE2_CONFIGS, key=["N", "n", "BLOCK_D", "DIFF", "JOINT"], restore_value=["result"])
@triton.jit
def _stage2_kernel(
    q,  # (G, N, d)
    streams,  # (G, rows, d)
    values,  # V̂, (G, n, d)
    lam,  # λ₂ (0-d)
    norm,  # (d,)
    result,  # in/out: (B, N, C), the convolution's output; the attention is added
    N,
    n,
    d,
    rows,
    h,
    scale,
    eps,
    out_scale,
    DIFF: tl.constexpr,
    JOINT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    g, block = tl.program_id(0), tl.program_id(1)
    i = block * BLOCK_N + tl.arange(0, BLOCK_N)  # queries
    dims = tl.arange(0, BLOCK_D)
    imask, dmask = i < N, dims < d
    tile = imask[:, None] & dmask[None, :]
    q_tile = tl.load(q + (g * N + i[:, None]) * d + dims[None, :], mask=tile, other=0.0)
    lam2 = tl.load(lam).to(tl.float32) if DIFF else 0.0
    acc_pos, acc_neg, _, l_pos, _, l_neg = _stage2_pass(
        q_tile, streams, values, g, n, d, rows, scale, lam2, DIFF, JOINT, False, PRECISION, BLOCK_N, BLOCK_C, BLOCK_D
    )
    out = acc_pos / l_pos[:, None]  # joint: (S⁺ − λ₂S⁻)·V̂ already
    if DIFF:
        if not JOINT:
            out = out - lam2 * acc_neg / l_neg[:, None]
        weight = tl.load(norm + dims, mask=dmask, other=0.0).to(tl.float32) * out_scale
        out, _ = _rms_scale(out, weight, dmask, d, eps)
    place = result + ((g // h) * N + i[:, None]) * (h * d) + (g % h) * d + dims[None, :]
    out += tl.load(place, mask=tile, other=0.0).to(tl.float32)
    tl.store(place, out.to(result.dtype.element_ty), mask=tile)


# ----------------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------------


@triton.autotune(
    configs=_STAGE2_ROWS_CONFIGS, key=["N", "n", "BLOCK_D", "DIFF", "JOINT"], reset_to_zero=["grad_lam", "grad_norm"]
)
@triton.jit
def _stage2_rows_kernel(
    q,  # (G, N, d)
    streams,  # (G, rows, d)
    values,  # V̂, (G, n, d)
    lam,  # λ₂
    norm,  # (d,)
    grad,  # dY, (B, N, C)
    grad_q,  # out: dq of Stage II in the (B, N, 3C) gradient of the qkv projection
    grad_out,  # out: dO, the gradient of (S⁺ − λ₂S⁻)·V̂, float32 (G, N, d)
    lse,  # out: float32 (G, N, 2): per query the log-sum-exp of each stream (joint: the same twice)
    delta,  # out: float32 (G, N, 2): per query and stream Σ_j S_ij·dS_ij, the softmax backward's row term
    grad_lam,  # += dλ₂ (float32, 1 element)
    grad_norm,  # += the norm weight's gradient (float32, d)
    N,
    n,
    d,
    rows,
    h,
    scale,
    eps,
    out_scale,
    DIFF: tl.constexpr,
    JOINT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    g, block = tl.program_id(0), tl.program_id(1)
    i = block * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    imask, dmask = i < N, dims < d
    tile = imask[:, None] & dmask[None, :]
    q_tile = tl.load(q + (g * N + i[:, None]) * d + dims[None, :], mask=tile, other=0.0)
    lam2 = tl.load(lam).to(tl.float32) if DIFF else 0.0
    acc_pos, acc_neg, m_pos, l_pos, m_neg, l_neg = _stage2_pass(
        q_tile, streams, values, g, n, d, rows, scale, lam2, DIFF, JOINT, True, PRECISION, BLOCK_N, BLOCK_C, BLOCK_D
    )
    out_pos = acc_pos / l_pos[:, None]  # S⁺·V̂
    place = ((g // h) * N + i[:, None]) * (h * d) + (g % h) * d + dims[None, :]
    grad_tile = tl.load(grad + place, mask=tile, other=0.0).to(tl.float32)
    if DIFF:
        out_neg = acc_neg / l_neg[:, None]  # S⁻·V̂
        weight = tl.load(norm + dims, mask=dmask, other=0.0).to(tl.float32) * out_scale
        grad_tile, weight_terms = _rms_backward(grad_tile, out_pos - lam2 * out_neg, weight, d, eps)
        tl.atomic_add(grad_norm + dims, tl.sum(weight_terms, 0) * out_scale, mask=dmask)
        tl.atomic_add(grad_lam, -tl.sum(tl.sum(grad_tile * out_neg, 1), 0))  # dλ₂ = −Σ dO·(S⁻V̂)
        delta_neg = -lam2 * tl.sum(grad_tile * out_neg, 1)  # dS⁻ = −λ₂·dW
        delta_pos = tl.sum(grad_tile * out_pos, 1)
        if JOINT:  # one softmax: one row term, Σ over both streams
            delta_pos += delta_neg
            delta_neg = delta_pos
        lse_pos, lse_neg = m_pos + tl.log(l_pos), m_neg + tl.log(l_neg)
    else:
        delta_pos = tl.sum(grad_tile * out_pos, 1)
        delta_neg = delta_pos
        lse_pos = m_pos + tl.log(l_pos)
        lse_neg = lse_pos
    tl.store(grad_out + (g * N + i[:, None]) * d + dims[None, :], grad_tile, mask=tile)
    tl.store(lse + (g * N + i) * 2, lse_pos, mask=imask)
    tl.store(lse + (g * N + i) * 2 + 1, lse_neg, mask=imask)
    tl.store(delta + (g * N + i) * 2, delta_pos, mask=imask)
    tl.store(delta + (g * N + i) * 2 + 1, delta_neg, mask=imask)

    # dq = Σ_j dS_ij·T_j/√d over both streams, the probabilities recomputed from the log-sum-exps.
    grad_o = grad_tile.to(values.dtype.element_ty)
    acc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    for start in range(0, n, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        cmask = cols < n
        t_mask = cmask[:, None] & dmask[None, :]
        t_pos = tl.load(streams + (g * rows + cols[:, None]) * d + dims[None, :], mask=t_mask, other=0.0)
        v_tile = tl.load(values + (g * n + cols[:, None]) * d + dims[None, :], mask=t_mask, other=0.0)
        grad_w = _dot(grad_o, tl.trans(v_tile), PRECISION)  # dW, (BLOCK_N, BLOCK_C)
        s_pos = _dot(q_tile, tl.trans(t_pos), PRECISION) * scale
        p_pos = tl.where(cmask[None, :], tl.exp(s_pos - lse_pos[:, None]), 0.0)
        ds = p_pos * (grad_w - delta_pos[:, None])
        acc += _dot(ds.to(t_pos.dtype), t_pos, PRECISION)
        if DIFF:
            t_neg = tl.load(streams + (g * rows + n + cols[:, None]) * d + dims[None, :], mask=t_mask, other=0.0)
            s_neg = _dot(q_tile, tl.trans(t_neg), PRECISION) * scale
            p_neg = tl.where(cmask[None, :], tl.exp(s_neg - lse_neg[:, None]), 0.0)
            ds = p_neg * (-lam2 * grad_w - delta_neg[:, None])
            acc += _dot(ds.to(t_neg.dtype), t_neg, PRECISION)
    q_place = ((g // h) * N + i[:, None]) * (3 * h * d) + (g % h) * d + dims[None, :]
    tl.store(grad_q + q_place, (acc * scale).to(grad_q.dtype.element_ty), mask=tile)


@triton.autotune(configs=_STAGE2_COLUMNS_CONFIGS, key=["N", "n", "BLOCK_D", "DIFF", "JOINT"])
@triton.jit
def _stage2_columns_kernel(
    q,  # (G, N, d)
    streams,  # (G, rows, d)
    values,  # V̂, (G, n, d)
    lam,  # λ₂
    grad_out,  # dO, float32 (G, N, d)
    lse,  # float32 (G, N, 2)
    delta,  # float32 (G, N, 2)
    grad_values,  # out: dV̂, float32 (G, n, d)
    grad_streams,  # out: dT± of Stage II, float32 (G, m2, d)
    N,
    n,
    d,
    rows,
    scale,
    DIFF: tl.constexpr,
    JOINT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    g, block = tl.program_id(0), tl.program_id(1)
    j = block * BLOCK_M + tl.arange(0, BLOCK_M)  # contrast tokens
    dims = tl.arange(0, BLOCK_D)
    jmask, dmask = j < n, dims < d
    tile = jmask[:, None] & dmask[None, :]
    t_pos = tl.load(streams + (g * rows + j[:, None]) * d + dims[None, :], mask=tile, other=0.0)
    v_tile = tl.load(values + (g * n + j[:, None]) * d + dims[None, :], mask=tile, other=0.0)
    lam2 = tl.load(lam).to(tl.float32) if DIFF else 0.0
    acc_values = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    acc_pos = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    acc_neg = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    if DIFF:
        t_neg = tl.load(streams + (g * rows + n + j[:, None]) * d + dims[None, :], mask=tile, other=0.0)
    for start in range(0, N, BLOCK_N):
        i = start + tl.arange(0, BLOCK_N)
        imask = i < N
        q_mask = imask[:, None] & dmask[None, :]
        q_tile = tl.load(q + (g * N + i[:, None]) * d + dims[None, :], mask=q_mask, other=0.0)
        grad_o = tl.load(grad_out + (g * N + i[:, None]) * d + dims[None, :], mask=q_mask, other=0.0)
        grad_o = grad_o.to(v_tile.dtype)
        lse_pos = tl.load(lse + (g * N + i) * 2, mask=imask, other=0.0)
        delta_pos = tl.load(delta + (g * N + i) * 2, mask=imask, other=0.0)
        grad_w = _dot(grad_o, tl.trans(v_tile), PRECISION)  # dW, (BLOCK_N, BLOCK_M)
        s_pos = _dot(q_tile, tl.trans(t_pos), PRECISION) * scale
        p_pos = tl.where(imask[:, None], tl.exp(s_pos - lse_pos[:, None]), 0.0)
        weights = p_pos
        ds = p_pos * (grad_w - delta_pos[:, None])
        acc_pos += _dot(tl.trans(ds.to(q_tile.dtype)), q_tile, PRECISION)
        if DIFF:
            lse_neg = tl.load(lse + (g * N + i) * 2 + 1, mask=imask, other=0.0)
            delta_neg = tl.load(delta + (g * N + i) * 2 + 1, mask=imask, other=0.0)
            s_neg = _dot(q_tile, tl.trans(t_neg), PRECISION) * scale
            p_neg = tl.where(imask[:, None], tl.exp(s_neg - lse_neg[:, None]), 0.0)
            weights = p_pos - lam2 * p_neg  # S⁺ − λ₂S⁻
            ds = p_neg * (-lam2 * grad_w - delta_neg[:, None])
            acc_neg += _dot(tl.trans(ds.to(q_tile.dtype)), q_tile, PRECISION)
        acc_values += _dot(tl.trans(weights.to(grad_o.dtype)), grad_o, PRECISION)
    m2 = 2 * n if DIFF else n
    tl.store(grad_values + (g * n + j[:, None]) * d + dims[None, :], acc_values, mask=tile)
    tl.store(grad_streams + (g * m2 + j[:, None]) * d + dims[None, :], acc_pos * scale, mask=tile)
    if DIFF:
        tl.store(grad_streams + (g * m2 + n + j[:, None]) * d + dims[None, :], acc_neg * scale, mask=tile)


@triton.jit
def _stage1_norm_kernel(
    reads,  # R±, float32 (G, m1, d)
    grad_values,  # dV̂, float32 (G, n, d)
    lam,  # λ₁
    norm,  # (d,)
    grad_reads,  # out: dR±, float32 (G, m1, d)
    delta,  # out: Σ_d dR·R per contrast row, float32 (G, m1)
    grad_lam,  # += dλ₁
    grad_norm,  # += the norm weight's gradient (d)
    n,
    d,
    eps,
    out_scale,
    DIFF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    g, block = tl.program_id(0), tl.program_id(1)
    i = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    imask, dmask = i < n, dims < d
    tile = imask[:, None] & dmask[None, :]
    m1 = 2 * n if DIFF else n
    grad_tile = tl.load(grad_values + (g * n + i[:, None]) * d + dims[None, :], mask=tile, other=0.0)
    read_pos = tl.load(reads + (g * m1 + i[:, None]) * d + dims[None, :], mask=tile, other=0.0)
    if DIFF:
        read_neg = tl.load(reads + (g * m1 + n + i[:, None]) * d + dims[None, :], mask=tile, other=0.0)
        lam1 = tl.load(lam).to(tl.float32)
        weight = tl.load(norm + dims, mask=dmask, other=0.0).to(tl.float32) * out_scale
        grad_tile, weight_terms = _rms_backward(grad_tile, read_pos - lam1 * read_neg, weight, d, eps)
        tl.atomic_add(grad_norm + dims, tl.sum(weight_terms, 0) * out_scale, mask=dmask)
        tl.atomic_add(grad_lam, -tl.sum(tl.sum(grad_tile * read_neg, 1), 0))
        grad_neg = -lam1 * grad_tile
        tl.store(grad_reads + (g * m1 + n + i[:, None]) * d + dims[None, :], grad_neg, mask=tile)
        tl.store(delta + g * m1 + n + i, tl.sum(grad_neg * read_neg, 1), mask=imask)
    tl.store(grad_reads + (g * m1 + i[:, None]) * d + dims[None, :], grad_tile, mask=tile)
    tl.store(delta + g * m1 + i, tl.sum(grad_tile * read_pos, 1), mask=imask)


@triton.autotune(configs=_STAGE1_KEYS_CONFIGS, key=["N", "m1", "BLOCK_D"])
@triton.jit
def _stage1_keys_kernel(
    streams,  # (G, rows, d)
    k,  # (G, N, d)
    v,  # (G, N, d)
    grad_reads,  # dR±, float32 (G, m1, d)
    lse,  # float32 (G, m1)
    delta,  # float32 (G, m1)
    grad_local,  # the convolution's gradient of v, (B, N, C) memory
    grad_qkv,  # out: dk and dv = Stage I's + the convolution's, in (B, N, 3C)
    N,
    m1,
    d,
    rows,
    h,
    scale,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    g, block = tl.program_id(0), tl.program_id(1)
    keys = block * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    kmask, dmask = keys < N, dims < d
    tile = kmask[:, None] & dmask[None, :]
    k_tile = tl.load(k + (g * N + keys[:, None]) * d + dims[None, :], mask=tile, other=0.0)
    v_tile = tl.load(v + (g * N + keys[:, None]) * d + dims[None, :], mask=tile, other=0.0)
    acc_k = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    acc_v = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    for start in range(0, m1, BLOCK_M):
        i = start + tl.arange(0, BLOCK_M)  # contrast rows of both streams
        imask = i < m1
        row_mask = imask[:, None] & dmask[None, :]
        t_tile = tl.load(streams + (g * rows + i[:, None]) * d + dims[None, :], mask=row_mask, other=0.0)
        grad_r = tl.load(grad_reads + (g * m1 + i[:, None]) * d + dims[None, :], mask=row_mask, other=0.0)
        row_lse = tl.load(lse + g * m1 + i, mask=imask, other=0.0)
        row_delta = tl.load(delta + g * m1 + i, mask=imask, other=0.0)
        scores = _dot(t_tile, tl.trans(k_tile), PRECISION) * scale  # (BLOCK_M, BLOCK_N)
        probs = tl.where(imask[:, None], tl.exp(scores - row_lse[:, None]), 0.0)
        grad_r = grad_r.to(v_tile.dtype)
        acc_v += _dot(tl.trans(probs.to(v_tile.dtype)), grad_r, PRECISION)
        grad_p = _dot(grad_r, tl.trans(v_tile), PRECISION)
        ds = probs * (grad_p - row_delta[:, None])
        acc_k += _dot(tl.trans(ds.to(t_tile.dtype)), t_tile, PRECISION)
    b, head = g // h, g % h
    local = tl.load(grad_local + (b * N + keys[:, None]) * (h * d) + head * d + dims[None, :], mask=tile, other=0.0)
    place = grad_qkv + (b * N + keys[:, None]) * (3 * h * d) + head * d + dims[None, :]
    tl.store(place + h * d, (acc_k * scale).to(grad_qkv.dtype.element_ty), mask=tile)
    tl.store(place + 2 * h * d, (acc_v + local.to(tl.float32)).to(grad_qkv.dtype.element_ty), mask=tile)


@triton.autotune(configs=_STAGE1_ROWS_CONFIGS, key=["N", "m1", "BLOCK_D"])
@triton.jit
def _stage1_rows_kernel(
    streams,  # (G, rows, d)
    k,  # (G, N, d)
    v,  # (G, N, d)
    grad_reads,  # dR±, float32 (G, m1, d)
    lse,  # float32 (G, m1)
    delta,  # float32 (G, m1)
    grad_streams,  # out: dT± of Stage I, float32 (G, m1, d)
    N,
    m1,
    d,
    rows,
    scale,
    PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    g, block = tl.program_id(0), tl.program_id(1)
    i = block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    imask, dmask = i < m1, dims < d
    tile = imask[:, None] & dmask[None, :]
    t_tile = tl.load(streams + (g * rows + i[:, None]) * d + dims[None, :], mask=tile, other=0.0)
    grad_r = tl.load(grad_reads + (g * m1 + i[:, None]) * d + dims[None, :], mask=tile, other=0.0)
    row_lse = tl.load(lse + g * m1 + i, mask=imask, other=0.0)
    row_delta = tl.load(delta + g * m1 + i, mask=imask, other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start in range(0, N, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        kmask = keys < N
        k_mask = kmask[:, None] & dmask[None, :]
        k_tile = tl.load(k + (g * N + keys[:, None]) * d + dims[None, :], mask=k_mask, other=0.0)
        v_tile = tl.load(v + (g * N + keys[:, None]) * d + dims[None, :], mask=k_mask, other=0.0)
        scores = _dot(t_tile, tl.trans(k_tile), PRECISION) * scale
        probs = tl.where(kmask[None, :], tl.exp(scores - row_lse[:, None]), 0.0)
        grad_p = _dot(grad_r.to(v_tile.dtype), tl.trans(v_tile), PRECISION)
        ds = probs * (grad_p - row_delta[:, None])
        acc += _dot(ds.to(k_tile.dtype), k_tile, PRECISION)
    tl.store(grad_streams + (g * m1 + i[:, None]) * d + dims[None, :], acc * scale, mask=tile)


@triton.jit
def _streams_backward_kernel(
    grad_stage1,  # dT± of Stage I, float32 (G, m1, d)
    grad_stage2,  # dT± of Stage II, float32 (G, m2, d)
    grad_embed,  # += dE±, float32 (h, S, n, d)
    grad_qkv,  # in/out: (B, N, 3C); dq gains the pooling's share
    h,
    H,
    p,
    d,
    S: tl.constexpr,
    M1: tl.constexpr,  # streams in Stage I (1 or 2)
    M2: tl.constexpr,  # streams in Stage II
    POOLED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    g, block = tl.program_id(0), tl.program_id(1)
    n, r = p * p, H // p
    j = block * BLOCK_J + tl.arange(0, BLOCK_J)
    dims = tl.arange(0, BLOCK_D)
    tile = (j < n)[:, None] & (dims < d)[None, :]
    pooled = tl.zeros((BLOCK_J, BLOCK_D), tl.float32)
    for s in tl.static_range(S):
        grad = tl.zeros((BLOCK_J, BLOCK_D), tl.float32)
        if s < M1:
            grad += tl.load(grad_stage1 + ((g * M1 + s) * n + j[:, None]) * d + dims[None, :], mask=tile, other=0.0)
        if s < M2:
            grad += tl.load(grad_stage2 + ((g * M2 + s) * n + j[:, None]) * d + dims[None, :], mask=tile, other=0.0)
        tl.atomic_add(grad_embed + (((g % h) * S + s) * n + j[:, None]) * d + dims[None, :], grad, mask=tile)
        pooled += grad
    if POOLED:  # every token lies in one window: no two programs write the same dq
        pooled = pooled / (r * r)
        b, head = g // h, g % h
        corner = (j // p) * r * H + (j % p) * r
        for t in range(0, r * r):
            token = corner + (t // r) * H + t % r
            place = grad_qkv + (b * H * H + token[:, None]) * (3 * h * d) + head * d + dims[None, :]
            value = tl.load(place, mask=tile, other=0.0).to(tl.float32) + pooled
            tl.store(place, value.to(grad_qkv.dtype.element_ty), mask=tile)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


_TOKEN_BLOCK = 32  # contrast tokens per program of the element-wise kernels (streams, Stage I's norm)


def _launch(kernel, grid):
    """`kernel[grid]` inside a profiler range named after the kernel: profiles on the GPU show each launch by
    name, and the tests tell the kernels' own work (under the interpreter: copies of its arguments) from the
    ATen operations the core dispatches."""

    def run(*args, **meta):
        jitted = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel
        name = jitted.fn.__name__  # the Python function (JITFunction and the interpreter's both keep it)
        with torch.profiler.record_function(f"vca_triton.{name}"):
            kernel[grid](*args, **meta)

    return run


def _check_device(x: Tensor) -> None:
    if x.device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"kernel='triton' on {x.device.type} tensors needs Triton's interpreter: set TRITON_INTERPRET=1 before "
            "triton is first imported, or use kernel='aten'"
        )


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision for float32 operands: TF32 where PyTorch allows it for matmuls, else IEEE (see
    _dot for "upcast")."""
    if dtype == torch.bfloat16 and INTERPRETED:
        return "upcast"
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


class _Shape:
    """The sizes every launcher needs, from q, k, v (3, B, h, N, d) and the layout."""

    def __init__(self, heads: Tensor, embed: Tensor, layout):
        _, self.B, self.h, self.N, self.d = heads.shape
        self.G, self.C = self.B * self.h, self.h * self.d
        self.H, self.p = layout.grid_size, layout.contrast_grid
        self.n, self.S = self.p**2, embed.shape[2]
        self.rows = self.S * self.n  # rows of the streams tensor
        self.m1, self.m2 = layout.stage1_rows, layout.stage2_cols
        self.scale, self.out_scale = self.d**-0.5, 1 - layout.lambda_init
        self.block_d = max(16, triton.next_power_of_2(self.d))


def _with_dummy(t: Tensor | None, fallback: Tensor) -> Tensor:
    return fallback if t is None else t  # a pointer a kernel never reads (its switch is off)


def _forward_streams(heads: Tensor, embed: Tensor, layout, shape: _Shape) -> Tensor:
    streams = heads.new_empty(shape.G, shape.rows, shape.d)  # (G, S·n, d)
    _launch(_streams_kernel, (shape.G, triton.cdiv(shape.n, _TOKEN_BLOCK)))(
        heads[0], embed, streams, shape.h, shape.H, shape.p, shape.d, shape.S, layout.pooled_content, shape.block_d,
        _TOKEN_BLOCK,
    )  # fmt: skip
    return streams


def _forward_stage1(heads, streams, lambda1, norm1, layout, shape: _Shape, save: bool):
    """V̂ (G, n, d) and, with `save`, R± (G, m1, d) and their log-sum-exps (G, m1), both float32."""
    values = heads.new_empty(shape.G, shape.n, shape.d)
    reads = heads.new_empty((shape.G, shape.m1, shape.d) if save else (0,), dtype=torch.float32)
    lse = heads.new_empty((shape.G, shape.m1) if save else (0,), dtype=torch.float32)
    _launch(_stage1_kernel, lambda meta: (shape.G, triton.cdiv(shape.n, meta["BLOCK_M"])))(
        streams,
        heads[1],
        heads[2],
        _with_dummy(lambda1, streams),
        _with_dummy(norm1, streams),
        values,
        reads,
        lse,
        shape.N,
        shape.n,
        shape.d,
        shape.rows,
        shape.scale,
        layout.eps,
        shape.out_scale,
        DIFF=layout.stage1_differential,
        SAVE=save,
        PRECISION=_precision(heads.dtype),
        BLOCK_D=shape.block_d,
    )
    return values, reads, lse


def add_attention(
    result: Tensor,
    heads: Tensor,
    embed: Tensor,
    lambda1: Tensor | None,
    lambda2: Tensor | None,
    norm1: Tensor | None,
    norm2: Tensor | None,
    layout,
) -> None:
    """Adds both attention stages of the VCA core, computed from q, k, v `heads` (3, B, h, N, d), into `result`
    (B, N, C) (the depthwise convolution's output): the kernels of dit_vca::vca_core's forward."""
    _check_device(heads)
    shape = _Shape(heads, embed, layout)
    streams = _forward_streams(heads, embed, layout, shape)
    values, _, _ = _forward_stage1(heads, streams, lambda1, norm1, layout, shape, save=False)
    _launch(_stage2_kernel, lambda meta: (shape.G, triton.cdiv(shape.N, meta["BLOCK_N"])))(
        heads[0],
        streams,
        values,
        _with_dummy(lambda2, streams),
        _with_dummy(norm2, streams),
        result,
        shape.N,
        shape.n,
        shape.d,
        shape.rows,
        shape.h,
        shape.scale,
        layout.eps,
        shape.out_scale,
        DIFF=layout.stage2_differential,
        JOINT=layout.joint_softmax,
        PRECISION=_precision(heads.dtype),
        BLOCK_D=shape.block_d,
    )


def attention_backward(
    grad: Tensor,
    heads: Tensor,
    embed: Tensor,
    lambda1: Tensor | None,
    lambda2: Tensor | None,
    norm1: Tensor | None,
    norm2: Tensor | None,
    grad_local: Tensor,
    layout,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """The backward of both attention stages from the gradient `grad` (B, N, C) of the core's result:
    (the gradient of the qkv projection's output (B·N, 3C), the convolution's share `grad_local` (B, C, H, W)
    of dv included; then dE±, dλ₁, dλ₂, d norm1, d norm2 in float32, None where a switch is off)."""
    _check_device(heads)
    shape = _Shape(heads, embed, layout)
    B, N, G, n, d, h = shape.B, shape.N, shape.G, shape.n, shape.d, shape.h
    precision = _precision(heads.dtype)
    floats = {"device": heads.device, "dtype": torch.float32}
    grad_local = grad_local.permute(0, 2, 3, 1).reshape(B, N, shape.C)  # a view when channels-last

    # Recomputed: the streams, V̂, R± and Stage I's log-sum-exps (n-row tensors).
    streams = _forward_streams(heads, embed, layout, shape)
    values, reads, lse1 = _forward_stage1(heads, streams, lambda1, norm1, layout, shape, save=True)

    # Stage II: rows (dq, dO, the row statistics), then columns (dV̂, dT± of Stage II).
    # dλ₁, dλ₂, d norm1, d norm2: float32 atomic sums (each its own tensor: an operator's outputs never alias)
    grad_lambda1, grad_lambda2 = torch.zeros((), **floats), torch.zeros((), **floats)
    grad_norm1, grad_norm2 = torch.zeros(d, **floats), torch.zeros(d, **floats)
    grad_qkv = heads.new_empty(B, N, 3 * shape.C)  # written by the kernels: dq, dk, dv in the projection's layout
    grad_out = torch.empty(G, N, d, **floats)
    stats = torch.empty(2, G, N, 2, **floats)  # log-sum-exps and row terms, per query and stream
    _launch(_stage2_rows_kernel, lambda meta: (G, triton.cdiv(N, meta["BLOCK_N"])))(
        heads[0],
        streams,
        values,
        _with_dummy(lambda2, streams),
        _with_dummy(norm2, streams),
        grad,
        grad_qkv,
        grad_out,
        stats[0],
        stats[1],
        grad_lambda2,
        grad_norm2,
        N,
        n,
        d,
        shape.rows,
        h,
        shape.scale,
        layout.eps,
        shape.out_scale,
        DIFF=layout.stage2_differential,
        JOINT=layout.joint_softmax,
        PRECISION=precision,
        BLOCK_D=shape.block_d,
    )
    grad_values = torch.empty(G, n, d, **floats)
    grad_stage2 = torch.empty(G, shape.m2, d, **floats)
    _launch(_stage2_columns_kernel, lambda meta: (G, triton.cdiv(n, meta["BLOCK_M"])))(
        heads[0],
        streams,
        values,
        _with_dummy(lambda2, streams),
        grad_out,
        stats[0],
        stats[1],
        grad_values,
        grad_stage2,
        N,
        n,
        d,
        shape.rows,
        shape.scale,
        DIFF=layout.stage2_differential,
        JOINT=layout.joint_softmax,
        PRECISION=precision,
        BLOCK_D=shape.block_d,
    )

    # Stage I: its RMSNorm and λ₁, then per key block (dk, dv) and per contrast block (dT± of Stage I).
    grad_reads = torch.empty(G, shape.m1, d, **floats)
    delta1 = torch.empty(G, shape.m1, **floats)
    _launch(_stage1_norm_kernel, (G, triton.cdiv(n, _TOKEN_BLOCK)))(
        reads,
        grad_values,
        _with_dummy(lambda1, streams),
        _with_dummy(norm1, streams),
        grad_reads,
        delta1,
        grad_lambda1,
        grad_norm1,
        n,
        d,
        layout.eps,
        shape.out_scale,
        DIFF=layout.stage1_differential,
        BLOCK_D=shape.block_d,
        BLOCK_M=_TOKEN_BLOCK,
    )
    stage1 = (streams, heads[1], heads[2], grad_reads, lse1, delta1)
    _launch(_stage1_keys_kernel, lambda meta: (G, triton.cdiv(N, meta["BLOCK_N"])))(
        *stage1,
        grad_local,
        grad_qkv,
        N,
        shape.m1,
        d,
        shape.rows,
        h,
        shape.scale,
        PRECISION=precision,
        BLOCK_D=shape.block_d,
    )
    grad_stage1 = torch.empty(G, shape.m1, d, **floats)
    _launch(_stage1_rows_kernel, lambda meta: (G, triton.cdiv(shape.m1, meta["BLOCK_M"])))(
        *stage1,
        grad_stage1,
        N,
        shape.m1,
        d,
        shape.rows,
        shape.scale,
        PRECISION=precision,
        BLOCK_D=shape.block_d,
    )

    # The streams: dE± (summed over the batch) and, through the pooling, dq.
    grad_embed = torch.zeros(1, h, shape.S, n, d, **floats)
    _launch(_streams_backward_kernel, (G, triton.cdiv(n, _TOKEN_BLOCK)))(
        grad_stage1,
        grad_stage2,
        grad_embed,
        grad_qkv,
        h,
        shape.H,
        shape.p,
        d,
        S=shape.S,
        M1=shape.m1 // n,
        M2=shape.m2 // n,
        POOLED=layout.pooled_content,
        BLOCK_D=shape.block_d,
        BLOCK_J=_TOKEN_BLOCK,
    )

    return (
        grad_qkv.view(B * N, 3 * shape.C),
        grad_embed,
        grad_lambda1 if layout.stage1_differential else None,
        grad_lambda2 if layout.stage2_differential else None,
        grad_norm1 if layout.stage1_differential else None,
        grad_norm2 if layout.stage2_differential else None,
    )
