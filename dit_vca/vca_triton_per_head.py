"""VCA's core for short sequences: one Triton program per (image, head) forward, one kernel each way.

The forward holds a head's contrast tokens of both streams in registers (n ≤ BLOCK_C) from the pooling to the last
stage and walks the head's tokens in tiles: it pools q, runs Stage I over the keys (online softmax), forms V̂ and runs
Stage II over the queries (every contrast column in one block: an exact softmax), adding Y into the convolution's
output. It saves nothing for the backward.

The backward recomputes what it needs (FLOPs for bytes: at short sequences the layer is bound by memory): its B′·h
programs each run the images b, b + B′, ... of one head, and for each image the split path's phases
(dit_vca.vca_triton_phases) on the whole head, one after the other, their results in the program's own scratch area
between them (a barrier of the program's threads after each): the contrast tokens, Stage I (one split of the keys)
and its combine, Stage II's output, Stage II's backward over the queries (dq; dT±, dV̂), Stage I's norm backward,
Stage I's backward over the keys (dk, dv; dT±), the images' dE± and the pooling's share of dq. Every gradient is
written by one program: rows of dq, dk, dv, and the program's row of partial sums (its images' dE±, its dλ and
norm-weight shares), which `sum_partials_kernel` sums in a fixed order. No atomics, no zero fills: the backward is
bitwise deterministic. The launch plan (dit_vca.vca_triton_plan) says when this path runs and with which tiles.
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
    stage2_forward_tile,
    stage2_forward_tile_call,
    stage2_parameters,
    streams_backward_rows,
)
from dit_vca.vca_triton_stages import (
    contrast_tokens,
    contrast_values,
    stage1_forward_range,
    stage2_block_lse,
    stage2_output,
    stage2_scores,
)
from dit_vca.vca_triton_tiles import (
    dot_pieces,
    inlined_and_called,
    load_rows,
    load_rows_f32,
    start64,
    store_rows,
)


@triton.jit
def _stage2_exact(q0, q1, t_pos0, t_pos1, t_neg0, t_neg1, v0, v1, col_ok, lam2, scale, DIFF2: tl.constexpr,
                  JOINT: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Stage II for a tile of queries whose contrast columns all lie in one block: P⁺, P⁻ and O (O⁺ and O⁻ for two
    softmaxes), float32."""
    s_pos, s_neg = stage2_scores(q0, q1, t_pos0, t_pos1, t_neg0, t_neg1, col_ok, scale, DIFF2, PRECISION)
    lse_pos, lse_neg = stage2_block_lse(s_pos, s_neg, DIFF2, JOINT)
    p_pos, p_neg = tl.exp(s_pos - lse_pos[:, None]), tl.exp(s_neg - lse_neg[:, None])
    weights = p_pos
    if DIFF2 and JOINT:
        weights = p_pos - lam2 * p_neg  # W: one product with V̂
    o0, o1 = dot_pieces(weights.to(v0.dtype), v0, v1, PRECISION)
    o_neg0, o_neg1 = o0, o1
    if DIFF2 and not JOINT:
        o_neg0, o_neg1 = dot_pieces(p_neg.to(v0.dtype), v0, v1, PRECISION)
    return p_pos, p_neg, o0, o1, o_neg0, o_neg1


@triton.jit
def _head_contrast(q, k, v, stride_n, given, stride_given, embed, lam1, norm1, j, ok, N, H, p, d, scale, eps,
                   out_scale, S: tl.constexpr, DIFF1: tl.constexpr, CONTENT: tl.constexpr, GIVEN: tl.constexpr,
                   PRECISION: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_N: tl.constexpr):  # fmt: skip
    """Steps 1-4 for one head: T± (q's dtype), Stage I's reads R± and log-sum-exps (float32) and V̂ (float32)."""
    t_pos0, t_pos1, t_neg0, t_neg1 = contrast_tokens(
        q, stride_n, given, stride_given, embed, j, ok, H, p, d, S, CONTENT, GIVEN, D0, D1, BLOCK_C
    )
    m_pos, l_pos, acc_pos0, acc_pos1, m_neg, l_neg, acc_neg0, acc_neg1 = stage1_forward_range(
        t_pos0, t_pos1, t_neg0, t_neg1, k, v, stride_n, 0, N, d, scale, DIFF1, PRECISION, D0, D1, BLOCK_C, BLOCK_N
    )
    r_pos0, r_pos1 = acc_pos0 / l_pos[:, None], acc_pos1 / l_pos[:, None]  # R⁺ = softmax(T⁺kᵀ/√d)·v
    lse_pos = m_pos + tl.log(l_pos)
    r_neg0, r_neg1, lse_neg = r_pos0, r_pos1, lse_pos  # R⁻ and its lse with a differential Stage I
    if DIFF1:
        r_neg0, r_neg1 = acc_neg0 / l_neg[:, None], acc_neg1 / l_neg[:, None]
        lse_neg = m_neg + tl.log(l_neg)
    v_hat0, v_hat1 = contrast_values(r_pos0, r_pos1, r_neg0, r_neg1, lam1, norm1, d, eps, out_scale, DIFF1, D0, D1)
    return t_pos0, t_pos1, t_neg0, t_neg1, r_pos0, r_pos1, r_neg0, r_neg1, lse_pos, lse_neg, v_hat0, v_hat1


@triton.jit
def per_head_forward_kernel(
    q,  # (B, h, N, d) with strides (stride_b, stride_h, stride_n, 1): q, k, v share them
    k,
    v,
    given,  # T given (with RoPE), (B, h, n, d) with strides (given_b, given_h, given_n, 1); any pointer without
    embed,  # E±, contiguous (h, S, n, d)
    lam1,  # λ₁, a 0-d tensor (any pointer when Stage I is plain)
    norm1,  # (d,) (any pointer when Stage I is plain)
    lam2,
    norm2,
    result,  # in/out: (B, N, C) with strides (result_b, result_n, 1): the convolution's output; Y is added
    stride_b,
    stride_h,
    stride_n,
    given_b,
    given_h,
    given_n,
    result_b,
    result_n,
    h,
    N,
    H,
    p,
    d,
    scale,
    eps,
    out_scale,
    S: tl.constexpr,
    DIFF1: tl.constexpr,
    DIFF2: tl.constexpr,
    JOINT: tl.constexpr,
    CONTENT: tl.constexpr,
    GIVEN: tl.constexpr,
    PRECISION: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Steps 1-5 for image g // h, head g % h: Y added into `result`. Saves nothing."""
    g = tl.program_id(0)
    b, head = g // h, g % h
    base = start64(b, stride_b) + start64(head, stride_h)
    q, k, v = q + base, k + base, v + base
    given = given + start64(b, given_b) + start64(head, given_h)
    embed = embed + start64(head, S * p * p * d)
    j = tl.arange(0, BLOCK_C)  # the contrast tokens, row-major on the p×p grid
    ok = j < p * p
    t_pos0, t_pos1, t_neg0, t_neg1, r_pos0, r_pos1, r_neg0, r_neg1, lse_pos, lse_neg, v_hat0, v_hat1 = _head_contrast(
        q, k, v, stride_n, given, given_n, embed, lam1, norm1, j, ok, N, H, p, d, scale, eps, out_scale,
        S, DIFF1, CONTENT, GIVEN, PRECISION, D0, D1, BLOCK_C, BLOCK_N,
    )  # fmt: skip
    v_hat0, v_hat1 = v_hat0.to(q.dtype.element_ty), v_hat1.to(q.dtype.element_ty)
    lam, w0, w1 = stage2_parameters(lam2, norm2, d, out_scale, DIFF2, D0, D1)
    result = result + start64(b, result_b) + head * d
    for first in range(0, N, BLOCK_M):
        i = first + tl.arange(0, BLOCK_M)  # queries
        i_ok = i < N
        q0, q1 = load_rows(q, i, i_ok, stride_n, d, D0, D1)
        p_pos, p_neg, o0, o1, o_neg0, o_neg1 = _stage2_exact(
            q0, q1, t_pos0, t_pos1, t_neg0, t_neg1, v_hat0, v_hat1, ok, lam, scale, DIFF2, JOINT, PRECISION
        )
        y0, y1 = stage2_output(o0, o1, o_neg0, o_neg1, lam, w0, w1, d, eps, DIFF2, JOINT)
        x0, x1 = load_rows_f32(result, i, i_ok, result_n, d, D0, D1)
        store_rows(result, i, i_ok, result_n, d, x0 + y0, x1 + y1, D0, D1)


@triton.jit
def per_head_backward_kernel(
    q,  # as the forward's
    k,
    v,
    given,
    embed,
    lam1,
    norm1,
    lam2,
    norm2,
    grad,  # dY: (B, N, C) with strides (grad_b, grad_n, 1)
    grad_local,  # the convolution's share of dv: (B, N, C) with strides (local_b, local_n, 1)
    grad_qkv,  # out: dq, dk, dv into the contiguous (B, N, 3C) gradient of the qkv projection
    grad_given,  # out with GIVEN: dT of the given T, float32 (B, h, n, d) contiguous
    embed_part,  # out: dE± summed over each program's images, float32 (programs, S, n, d) = (B', h, S, n, d)
    first_part,  # out with DIFF1: each program's heads' dλ₁ and d norm1, float32 (programs, 1 + d)
    second_part,  # out with DIFF2: each program's heads' dλ₂ and d norm2, float32 (programs, 1 + d)
    scratch,  # each program's: T± (S·n rows), V̂ (n), O (K2·N), in q's dtype, rows of d
    floats,  # each program's float32 scratch (float_slot elements): see dit_vca.vca_triton_plan.backward_scratch
    stride_b,
    stride_h,
    stride_n,
    given_b,
    given_h,
    given_n,
    grad_b,
    grad_n,
    local_b,
    local_n,
    float_slot,
    G,
    h,
    N,
    H,
    p,
    d,
    scale,
    eps,
    out_scale,
    S: tl.constexpr,
    DIFF1: tl.constexpr,
    DIFF2: tl.constexpr,
    JOINT: tl.constexpr,
    CONTENT: tl.constexpr,
    GIVEN: tl.constexpr,
    PRECISION: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    CALLS: tl.constexpr,
):
    """The backward of steps 1-5 for head `program % h` of images b = program // h, program // h + programs // h, ...
    (programs = B'·h, see the module docstring): the split path's phases (dit_vca.vca_triton_phases) on one whole
    head each, their results in this program's scratch between them, a barrier of the program's threads after each;
    the images' dE± summed into the program's row of `embed_part`."""
    program, programs = tl.program_id(0), tl.num_programs(0)
    for b in range(program // h, G // h, programs // h):  # with CALLS a call per image: see inlined_and_called
        if CALLS:
            _image_backward_call(
                q, k, v, given, embed, lam1, norm1, lam2, norm2, grad, grad_local, grad_qkv, grad_given, embed_part,
                first_part, second_part, scratch, floats, stride_b, stride_h, stride_n, given_b, given_h, given_n,
                grad_b, grad_n, local_b, local_n, float_slot, program, b, h, N, H, p, d, scale, eps, out_scale, S,
                DIFF1, DIFF2, JOINT, CONTENT, GIVEN, PRECISION, D0, D1, BLOCK_C, BLOCK_N, BLOCK_M, BLOCK_T, CALLS,
            )  # fmt: skip
        else:
            _image_backward(
                q, k, v, given, embed, lam1, norm1, lam2, norm2, grad, grad_local, grad_qkv, grad_given, embed_part,
                first_part, second_part, scratch, floats, stride_b, stride_h, stride_n, given_b, given_h, given_n,
                grad_b, grad_n, local_b, local_n, float_slot, program, b, h, N, H, p, d, scale, eps, out_scale, S,
                DIFF1, DIFF2, JOINT, CONTENT, GIVEN, PRECISION, D0, D1, BLOCK_C, BLOCK_N, BLOCK_M, BLOCK_T, CALLS,
            )  # fmt: skip


def _image_backward_body(
    q, k, v, given, embed, lam1, norm1, lam2, norm2, grad, grad_local, grad_qkv, grad_given, embed_part, first_part,
    second_part, scratch, floats, stride_b, stride_h, stride_n, given_b, given_h, given_n, grad_b, grad_n, local_b,
    local_n, float_slot, program, b, h, N, H, p, d, scale, eps, out_scale, S: tl.constexpr, DIFF1: tl.constexpr,
    DIFF2: tl.constexpr, JOINT: tl.constexpr, CONTENT: tl.constexpr, GIVEN: tl.constexpr, PRECISION: tl.constexpr,
    D0: tl.constexpr, D1: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr, CALLS: tl.constexpr,
):  # fmt: skip
    """The backward of steps 1-5 for image b, head `program % h`, in `program`'s scratch; its dE± and parameter
    gradients added into the program's rows (written by the program's first image, b = program // h)."""
    n = p * p
    C = h * d
    head = program % h
    g = b * h + head
    trip = b - program // h
    m1 = 2 * n if DIFF1 else n
    two = DIFF2 and not JOINT
    outs_rows = 2 * N if two else N
    scratch = scratch + start64(program, (S * n + n + outs_rows) * d)
    streams, v_hat, outs = scratch, scratch + S * n * d, scratch + (S * n + n) * d
    floats = floats + start64(program, float_slot)  # in the order of backward_scratch's float32 regions
    partial_reads, stats = floats, floats + m1 * d
    reads, lse1 = stats + 2 * m1, stats + 2 * m1 + m1 * d
    lse2, stage2_part = lse1 + m1, lse1 + m1 + outs_rows
    grad_reads, delta = partial_reads, stats  # where Stage I's partials were: combined by then
    stage1_part = reads  # where R± were: the norm's backward has read them by then
    grad_content = partial_reads  # where dR± were: Stage I's backward has read them by then
    base = start64(b, stride_b) + start64(head, stride_h)
    head_q, head_k, head_v = q + base, k + base, v + base
    grad_q = grad_qkv + start64(b, N * 3 * C) + head * d
    # Steps 1-4 again: T±, then Stage I over all keys (one split), R±, their lse and V̂.
    for first in range(0, n, BLOCK_C):
        _store_contrast_tokens(head_q, stride_n, given + start64(b, given_b) + start64(head, given_h), given_n,
                               embed + start64(head, S * n * d), streams, first, H, p, d, S, CONTENT, GIVEN, D0, D1,
                               BLOCK_C)  # fmt: skip
    tl.debug_barrier()
    stage1_partial_phase(streams, head_k, head_v, stride_n, 0, N, partial_reads, stats, m1, d, scale, PRECISION,
                         D0, D1, BLOCK_C, BLOCK_N, CALLS)  # fmt: skip
    tl.debug_barrier()
    for first in range(0, n, BLOCK_C):
        stage1_combine_rows(partial_reads, stats, 1, lam1, norm1, reads, lse1, v_hat, first, n, d, eps, out_scale,
                            DIFF1, D0, D1, BLOCK_C)  # fmt: skip
    tl.debug_barrier()
    # Step 5 again: O and its lse; then its backward: dq, and dT±, dV̂ summed in the scratch.
    for tile in range(0, tl.cdiv(N, BLOCK_M)):
        if CALLS:
            stage2_forward_tile_call(head_q, stride_n, streams, v_hat, lam2, norm2, outs, N * d, lse2, N, grad_q, 0,
                                     tile, N, n, d, scale, eps, out_scale, S, DIFF2, JOINT, False, PRECISION, D0, D1,
                                     BLOCK_M, BLOCK_C)  # fmt: skip
        else:
            stage2_forward_tile(head_q, stride_n, streams, v_hat, lam2, norm2, outs, N * d, lse2, N, grad_q, 0, tile,
                                N, n, d, scale, eps, out_scale, S, DIFF2, JOINT, False, PRECISION, D0, D1, BLOCK_M,
                                BLOCK_C)  # fmt: skip
    tl.debug_barrier()
    stage2_backward_range(
        head_q, stride_n, streams, v_hat, lam2, norm2, outs, N * d, lse2, N, grad + start64(b, grad_b) + head * d,
        grad_n, grad_q, 3 * C, stage2_part, second_part + start64(program, 1 + d), trip * tl.cdiv(N, BLOCK_M), 0,
        tl.cdiv(N, BLOCK_M), N, n, d, scale, eps, out_scale, S, DIFF2, JOINT, PRECISION, D0, D1, BLOCK_M, BLOCK_C,
        CALLS,
    )  # fmt: skip
    tl.debug_barrier()
    # Step 4's norm and λ₁, backward; then Stage I's backward over all keys: dk, dv, and dT± summed.
    for first in range(0, n, BLOCK_C):
        norm_backward_rows(stage2_part, 1, reads, lam1, norm1, grad_reads, delta, first_part + start64(program, 1 + d),
                           trip * tl.cdiv(n, BLOCK_C) + first // BLOCK_C, first, n, d, eps, out_scale, DIFF1, DIFF2,
                           D0, D1, BLOCK_C)  # fmt: skip
    tl.debug_barrier()
    stage1_backward_range(
        streams, head_k, head_v, stride_n, grad_reads, lse1, delta,
        grad_local + start64(b, local_b) + head * d, local_n, grad_q + C, grad_q + 2 * C, 3 * C, stage1_part, 0,
        tl.cdiv(N, BLOCK_N), N, m1, d, scale, PRECISION, D0, D1, BLOCK_C, BLOCK_N, CALLS,
    )  # fmt: skip
    tl.debug_barrier()
    # Steps 1-2, backward: this image's dE±; dT to the given T, or through the pooling to dq.
    content = grad_given + start64(g, n * d) if GIVEN else grad_content
    for first in range(0, n, BLOCK_C):
        streams_backward_rows(stage1_part, 1, stage2_part, 1, embed_part + start64(program, S * n * d), trip,
                              content, first, n, d, S, DIFF1, DIFF2, CONTENT, D0, D1, BLOCK_C)  # fmt: skip
    tl.debug_barrier()
    if CONTENT and not GIVEN:
        for first in range(0, N, BLOCK_T):
            pool_backward_tokens(grad_content, grad_q, 3 * C, first, N, H, p, d, D0, D1, BLOCK_T)
    tl.debug_barrier()  # the next image reuses the scratch


_image_backward, _image_backward_call = inlined_and_called(_image_backward_body)


@triton.jit(noinline=True)
def _store_contrast_tokens(q, stride_n, given, given_n, embed, streams, first, H, p, d, S: tl.constexpr,
                           CONTENT: tl.constexpr, GIVEN: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
                           BLOCK_C: tl.constexpr):  # fmt: skip
    """Steps 1-2 for contrast tokens [first, first + BLOCK_C) of one head, stored into its T± (`streams`)."""
    n = p * p
    j = first + tl.arange(0, BLOCK_C)
    t_pos0, t_pos1, t_neg0, t_neg1 = contrast_tokens(
        q, stride_n, given, given_n, embed, j, j < n, H, p, d, S, CONTENT, GIVEN, D0, D1, BLOCK_C
    )
    store_rows(streams, j, j < n, d, d, t_pos0, t_pos1, D0, D1)
    if S == 2:
        store_rows(streams + n * d, j, j < n, d, d, t_neg0, t_neg1, D0, D1)
