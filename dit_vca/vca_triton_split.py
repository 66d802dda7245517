"""VCA's core for long sequences (or many contrast tokens): a head's work split over many programs.

Where one program per (image, head) would leave the GPU idle (B·h programs walking thousands of tiles each) or a
head's contrast tokens do not fit the per-head forward's block, the layer runs these kernels instead (the launch
plan, dit_vca.vca_triton_plan, decides and sizes them), each one phase of dit_vca.vca_triton_phases on its part:
- forward: `pool_kernel` (steps 1-2, one program per contrast token, its window in tiles),
  `stage1_partial_forward_kernel` (step 4 over one split of the keys: each contrast row's online softmax state),
  `stage1_combine_kernel` (the splits combined by their log-sum-exps, in order; R±, their lse, V̂),
  `stage2_forward_kernel` (step 5, one tile of queries per program; Y added into the convolution's output).
  Saved for the backward: T±, V̂, R± and their lse, O (O⁺, O⁻) and its lse.
- backward: `stage2_backward_kernel` (one split of the queries: dq, and the split's dT±, dV̂, dλ₂, d norm2),
  `stage1_norm_backward_kernel` (dV̂ summed over the splits in order; dR±, δ±, dλ₁, d norm1 per block),
  `stage1_backward_kernel` (one split of the keys: dk, dv, and the split's dT±), `streams_backward_kernel` (dT±
  summed over both stages' splits in order: each image's dE±, and dT), `pool_backward_kernel` (dT / r² into the dq
  of every token of its window), then `sum_partials_kernel`.
No atomics: every element has one writer and every sum a fixed order. Programs are (image·head g, part); tensors
of the partials are (G, splits, rows, d), of the saved (G, rows, d); q, k, v (B, h, N, d) views with strides.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dit_vca.vca_triton_phases import (
    norm_backward_rows,
    pool_backward_tokens,
    stage1_backward_range,
    stage1_combine_rows,
    stage1_partial_phase,
    stage2_backward_range,
    stage2_forward_rows,
    stage2_parameters,
    streams_backward_rows,
)
from dit_vca.vca_triton_tiles import load_rows_f32, load_vector, start64, store_vector


@triton.jit
def pool_kernel(
    q,  # (B, h, N, d) with strides (stride_b, stride_h, stride_n, 1)
    given,  # T given (with RoPE), (B, h, n, d) with strides (given_b, given_h, given_n, 1); any pointer without
    embed,  # E±, contiguous (h, S, n, d)
    streams,  # out: T±, (G, S·n, d) in q's dtype
    stride_b,
    stride_h,
    stride_n,
    given_b,
    given_h,
    given_n,
    h,
    H,
    p,
    d,
    S: tl.constexpr,
    CONTENT: tl.constexpr,
    GIVEN: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_R: tl.constexpr,  # ≥ r: a window's row
    BLOCK_T: tl.constexpr,  # tokens per trip: BLOCK_T // BLOCK_R window rows
):
    """Steps 1-2 for contrast token j of image g // h, head g % h: T± = E± + T, T the mean of q over j's r×r window
    (or row j of the given T, or zero)."""
    g, j = tl.program_id(0), tl.program_id(1)
    b, head = g // h, g % h
    n, r = p * p, H // p
    content0, content1 = tl.zeros((D0,), tl.float32), tl.zeros((D1,), tl.float32)
    if CONTENT:
        if GIVEN:
            content0, content1 = load_vector(given + start64(b, given_b) + start64(head, given_h) + j * given_n,
                                             d, D0, D1)  # fmt: skip
        else:
            q = q + start64(b, stride_b) + start64(head, stride_h)
            t = tl.arange(0, BLOCK_T)
            corner = (j // p) * r * H + (j % p) * r
            for first in range(0, r, BLOCK_T // BLOCK_R):
                row, column = first + t // BLOCK_R, t % BLOCK_R  # in the window
                x0, x1 = load_rows_f32(q, corner + row * H + column, (row < r) & (column < r), stride_n, d, D0, D1)
                content0, content1 = content0 + tl.sum(x0, 0), content1 + tl.sum(x1, 0)
            content0, content1 = content0 / (r * r), content1 / (r * r)
    for s in tl.static_range(S):
        e0, e1 = load_vector(embed + start64(head * S + s, n * d) + j * d, d, D0, D1)
        store_vector(streams + start64(g * S + s, n * d) + j * d, d, content0 + e0, content1 + e1, D0, D1)


@triton.jit
def stage1_partial_forward_kernel(
    streams,  # T±, (G, S·n, d)
    k,  # (B, h, N, d) with strides (stride_b, stride_h, stride_n, 1), as v
    v,
    partial_reads,  # out: each split's unnormalised R±, float32 (G, K, m1, d)
    partial_stats,  # out: each split's running max and sum per contrast row, float32 (G, K, 2, m1)
    stride_b,
    stride_h,
    stride_n,
    h,
    N,
    n,
    d,
    scale,
    TILES,  # key tiles per split
    S: tl.constexpr,
    DIFF1: tl.constexpr,
    PRECISION: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CALLS: tl.constexpr,  # the tiles' work as non-inlined calls (see dit_vca.vca_triton_tiles)
):
    """Step 4 over split s of the keys of image g // h, head g % h."""
    g, split = tl.program_id(0), tl.program_id(1)
    K = tl.num_programs(1)
    m1 = 2 * n if DIFF1 else n
    base = start64(g // h, stride_b) + start64(g % h, stride_h)
    start = split * TILES * BLOCK_N
    stage1_partial_phase(
        streams + start64(g, S * n * d), k + base, v + base, stride_n, start, tl.minimum(start + TILES * BLOCK_N, N),
        partial_reads + start64(g * K + split, m1 * d), partial_stats + start64(g * K + split, 2 * m1), m1, d, scale,
        PRECISION, D0, D1, BLOCK_C, BLOCK_N, CALLS,
    )  # fmt: skip


@triton.jit
def stage1_combine_kernel(
    partial_reads,  # (G, K, m1, d), float32
    partial_stats,  # (G, K, 2, m1), float32
    lam1,
    norm1,
    reads,  # out: R±, float32 (G, m1, d)
    lse,  # out: their log-sum-exps, float32 (G, m1)
    v_hat,  # out: V̂ in the core's dtype, (G, n, d)
    K,
    n,
    d,
    eps,
    out_scale,
    DIFF1: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """Step 4's end for a block of contrast tokens of one head: R± from the splits, and V̂."""
    g, block = tl.program_id(0), tl.program_id(1)
    m1 = 2 * n if DIFF1 else n
    stage1_combine_rows(
        partial_reads + start64(g, K * m1 * d), partial_stats + start64(g, K * 2 * m1), K, lam1, norm1,
        reads + start64(g, m1 * d), lse + start64(g, m1), v_hat + start64(g, n * d), block * BLOCK_J, n, d, eps,
        out_scale, DIFF1, D0, D1, BLOCK_J,
    )  # fmt: skip


@triton.jit
def stage2_forward_kernel(
    q,  # (B, h, N, d) with strides (stride_b, stride_h, stride_n, 1)
    streams,  # T±, (G, S·n, d)
    v_hat,  # V̂, (G, n, d)
    lam2,
    norm2,
    result,  # in/out: (B, N, C) with strides (result_b, result_n, 1); Y is added
    outs,  # out: O (O⁺, then O⁻ for two softmaxes), (K2, G, N, d) in q's dtype
    lse,  # out: the queries' log-sum-exps (of S⁺, then S⁻ for two softmaxes), float32 (K2, G, N)
    stride_b,
    stride_h,
    stride_n,
    result_b,
    result_n,
    h,
    N,
    n,
    d,
    scale,
    eps,
    out_scale,
    S: tl.constexpr,
    DIFF2: tl.constexpr,
    JOINT: tl.constexpr,
    PRECISION: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Step 5 for a tile of queries of image g // h, head g % h."""
    g, tile = tl.program_id(0), tl.program_id(1)
    G = tl.num_programs(0)
    b, head = g // h, g % h
    lam, w0, w1 = stage2_parameters(lam2, norm2, d, out_scale, DIFF2, D0, D1)
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    stage2_forward_rows(
        q + start64(b, stride_b) + start64(head, stride_h), stride_n, streams + start64(g, S * n * d),
        v_hat + start64(g, n * d), lam, w0, w1, outs + start64(g, N * d), start64(G, N * d), lse + start64(g, N),
        start64(G, N), result + start64(b, result_b) + head * d, result_n, i, i < N, n, d, scale, eps,
        S, DIFF2, JOINT, True, PRECISION, D0, D1, BLOCK_M, BLOCK_C,
    )  # fmt: skip


@triton.jit
def stage2_backward_kernel(
    q,  # (B, h, N, d) with strides (stride_b, stride_h, stride_n, 1)
    streams,  # T±, (G, S·n, d)
    v_hat,  # V̂, (G, n, d)
    lam2,
    norm2,
    outs,  # the forward's O (O⁺, O⁻), (K2, G, N, d)
    lse,  # their log-sum-exps, float32 (K2, G, N)
    grad,  # dY: (B, N, C) with strides (grad_b, grad_n, 1)
    grad_qkv,  # out: dq (before the pooling's share) into the contiguous (B, N, 3C) gradient of the projection
    partial,  # out: each split's dT± (m2 rows) and dV̂ (n rows), float32 (G, Q, m2 + n, d)
    second_part,  # out with DIFF2: each split's dλ₂ and d norm2, float32 (G·Q, 1 + d)
    stride_b,
    stride_h,
    stride_n,
    grad_b,
    grad_n,
    h,
    N,
    n,
    d,
    scale,
    eps,
    out_scale,
    TILES,  # query tiles per split
    S: tl.constexpr,
    DIFF2: tl.constexpr,
    JOINT: tl.constexpr,
    PRECISION: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CALLS: tl.constexpr,  # the tiles' work as non-inlined calls (see dit_vca.vca_triton_tiles)
):
    """Step 5, backward, over split s of the queries of image g // h, head g % h."""
    g, split = tl.program_id(0), tl.program_id(1)
    G, Q = tl.num_programs(0), tl.num_programs(1)
    b, head = g // h, g % h
    m2 = 2 * n if DIFF2 else n
    first = split * TILES
    stage2_backward_range(
        q + start64(b, stride_b) + start64(head, stride_h), stride_n, streams + start64(g, S * n * d),
        v_hat + start64(g, n * d), lam2, norm2, outs + start64(g, N * d), start64(G, N * d), lse + start64(g, N),
        start64(G, N), grad + start64(b, grad_b) + head * d, grad_n,
        grad_qkv + start64(b, N * 3 * h * d) + head * d, 3 * h * d, partial + start64(g * Q + split, (m2 + n) * d),
        second_part + start64(g * Q + split, 1 + d), 0, first, tl.minimum(first + TILES, tl.cdiv(N, BLOCK_M)), N, n,
        d, scale, eps, out_scale, S, DIFF2, JOINT, PRECISION, D0, D1, BLOCK_M, BLOCK_C, CALLS,
    )  # fmt: skip


@triton.jit
def stage1_norm_backward_kernel(
    partial,  # the Stage II splits' dT± and dV̂, float32 (G, Q, m2 + n, d)
    reads,  # R±, float32 (G, m1, d)
    lam1,
    norm1,
    grad_reads,  # out: dR±, float32 (G, m1, d)
    delta,  # out: Stage I's softmax row terms δ± = dR±·R±, float32 (G, m1)
    first_part,  # out with DIFF1: each program's dλ₁ and d norm1, float32 (G·blocks, 1 + d)
    Q,
    n,
    d,
    eps,
    out_scale,
    DIFF1: tl.constexpr,
    DIFF2: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """Step 4's norm and λ₁, backward, for a block of contrast tokens of one head."""
    g, block = tl.program_id(0), tl.program_id(1)
    m1, m2 = (2 * n if DIFF1 else n), (2 * n if DIFF2 else n)
    row = first_part + start64(g * tl.num_programs(1) + block, 1 + d)  # the block's dλ₁ and d norm1
    norm_backward_rows(
        partial + start64(g, Q * (m2 + n) * d), Q, reads + start64(g, m1 * d), lam1, norm1,
        grad_reads + start64(g, m1 * d), delta + start64(g, m1), row, 0, block * BLOCK_J, n, d, eps, out_scale,
        DIFF1, DIFF2, D0, D1, BLOCK_J,
    )  # fmt: skip


@triton.jit
def stage1_backward_kernel(
    streams,  # T±, (G, S·n, d)
    k,  # (B, h, N, d) with strides (stride_b, stride_h, stride_n, 1), as v
    v,
    grad_reads,  # dR±, float32 (G, m1, d)
    lse,  # the forward's log-sum-exps, float32 (G, m1)
    delta,  # float32 (G, m1)
    grad_local,  # the convolution's share of dv: (B, N, C) with strides (local_b, local_n, 1)
    grad_qkv,  # out: dk and dv into the contiguous (B, N, 3C) gradient of the projection
    partial,  # out: each split's dT±, float32 (G, K, m1, d)
    stride_b,
    stride_h,
    stride_n,
    local_b,
    local_n,
    h,
    N,
    n,
    d,
    scale,
    TILES,  # key tiles per split
    S: tl.constexpr,
    DIFF1: tl.constexpr,
    PRECISION: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CALLS: tl.constexpr,  # the tiles' work as non-inlined calls (see dit_vca.vca_triton_tiles)
):
    """Step 4, backward, over split s of the keys of image g // h, head g % h."""
    g, split = tl.program_id(0), tl.program_id(1)
    K = tl.num_programs(1)
    b, head = g // h, g % h
    C = h * d
    m1 = 2 * n if DIFF1 else n
    base = start64(b, stride_b) + start64(head, stride_h)
    grad_k = grad_qkv + start64(b, N * 3 * C) + C + head * d
    first = split * TILES
    stage1_backward_range(
        streams + start64(g, S * n * d), k + base, v + base, stride_n, grad_reads + start64(g, m1 * d),
        lse + start64(g, m1), delta + start64(g, m1), grad_local + start64(b, local_b) + head * d, local_n, grad_k,
        grad_k + C, 3 * C, partial + start64(g * K + split, m1 * d), first,
        tl.minimum(first + TILES, tl.cdiv(N, BLOCK_N)), N, m1, d, scale, PRECISION, D0, D1, BLOCK_C, BLOCK_N, CALLS,
    )  # fmt: skip


@triton.jit
def streams_backward_kernel(
    stage1_partial,  # the Stage I splits' dT±, float32 (G, K, m1, d)
    stage2_partial,  # the Stage II splits' dT± and dV̂, float32 (G, Q, m2 + n, d)
    embed_part,  # out: each image's dE±, float32 (G, S, n, d)
    grad_content,  # out with CONTENT: dT (both streams' share), float32 (G, n, d)
    K,
    Q,
    n,
    d,
    S: tl.constexpr,
    DIFF1: tl.constexpr,
    DIFF2: tl.constexpr,
    CONTENT: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """Steps 1-2, backward, for a block of contrast tokens of one head."""
    g, block = tl.program_id(0), tl.program_id(1)
    m1, m2 = (2 * n if DIFF1 else n), (2 * n if DIFF2 else n)
    streams_backward_rows(
        stage1_partial + start64(g, K * m1 * d), K, stage2_partial + start64(g, Q * (m2 + n) * d), Q,
        embed_part + start64(g, S * n * d), 0, grad_content + start64(g, n * d), block * BLOCK_J, n, d, S, DIFF1,
        DIFF2, CONTENT, D0, D1, BLOCK_J,
    )  # fmt: skip


@triton.jit
def pool_backward_kernel(
    grad_content,  # dT, float32 (G, n, d)
    grad_qkv,  # in/out: the contiguous (B, N, 3C) gradient of the projection; dq gains the pooling's share
    h,
    N,
    H,
    p,
    d,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Step 1, backward, for a tile of tokens of one head."""
    g, tile = tl.program_id(0), tl.program_id(1)
    grad_q = grad_qkv + start64(g // h, N * 3 * h * d) + (g % h) * d
    pool_backward_tokens(grad_content + start64(g, p * p * d), grad_q, 3 * h * d, tile * BLOCK_T, N, H, p, d, D0, D1,
                         BLOCK_T)  # fmt: skip
