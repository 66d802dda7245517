"""The phases of VCA's core on one head, each over a part of its tokens or contrast tokens, that both Triton paths
run: a split kernel (dit_vca.vca_triton_split) runs one phase per program on its part; the per-head backward
(dit_vca.vca_triton_per_head) runs all of them one after the other on a whole head, its intermediate results in a
scratch area of its own between them. Pointers arrive at the head's (or its part's) first row; tensors are
row-major with contiguous columns. Also the fixed-order sum of both paths' per-program partial gradients
(`sum_partials_kernel`).

In the names of docs/VCA.md's notation table: T± the contrast tokens (`streams`, S·n rows: T⁺ then T⁻), R± Stage
I's reads (m1 rows), V̂ the contrast values (n rows), O Stage II's output before its norm (O⁺ and O⁻ for two
softmaxes: `outs`, and O⁻ `outs_neg` elements further), lse the softmaxes' log-sum-exps, δ their row terms.
A phase that sums over its part into a block of contrast rows adds into its own rows of a float32 partial as it
goes (after a barrier of the program's threads: what any of them stored on earlier trips is then visible to all),
so that only a tile's worth of sums is in registers at a time.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dit_vca.vca_triton_stages import (
    contrast_values,
    contrast_values_backward,
    stage1_backward_block,
    stage1_forward_range,
    stage2_forward_block,
    stage2_output,
    stage2_output_backward,
)
from dit_vca.vca_triton_tiles import (
    dot_pieces,
    dot_rows,
    inlined_and_called,
    load_rows,
    load_rows_f32,
    load_vector,
    store_rows,
    store_vector,
)


@triton.jit
def stage2_parameters(lam2, norm2, d, out_scale, DIFF2: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr):
    """λ₂ and Stage II's norm weight scaled by 1 − λ_init, float32 (0 and zeros when Stage II is plain)."""
    lam = 0.0
    w0, w1 = tl.zeros((D0,), tl.float32), tl.zeros((D1,), tl.float32)
    if DIFF2:
        lam = tl.load(lam2).to(tl.float32)
        w0, w1 = load_vector(norm2, d, D0, D1)
        w0, w1 = w0 * out_scale, w1 * out_scale
    return lam, w0, w1


@triton.jit
def store_parameter_row(part, d, grad_lam, w0, w1, D0: tl.constexpr, D1: tl.constexpr):
    """One row of a (rows, 1 + d) partial of a stage's parameter gradients: dλ, then the norm weight's."""
    tl.store(part, grad_lam)
    store_vector(part + 1, d, w0, w1, D0, D1)


@triton.jit
def add_parameter_row(part, d, grad_lam, w0, w1, trip, D0: tl.constexpr, D1: tl.constexpr):
    """store_parameter_row, added into the row (written on the first trip, `trip` 0)."""
    tl.debug_barrier()
    c0, c1 = tl.arange(0, D0), D0 + tl.arange(0, D1)
    grad_lam += tl.load(part, mask=trip > 0, other=0.0)
    w0 += tl.load(part + 1 + c0, mask=(c0 < d) & (trip > 0), other=0.0)
    w1 += tl.load(part + 1 + c1, mask=(c1 < d) & (trip > 0), other=0.0)
    store_parameter_row(part, d, grad_lam, w0, w1, D0, D1)


@triton.jit
def add_rows(ptr, rows, ok, d, x0, x1, trip, D0: tl.constexpr, D1: tl.constexpr):
    """Rows `rows` of a program's own float32 (·, d) partial += x (x alone on its first trip, `trip` 0: nothing to
    read yet)."""
    tl.debug_barrier()
    y0, y1 = load_rows(ptr, rows, ok & (trip > 0), d, d, D0, D1)
    store_rows(ptr, rows, ok, d, d, x0 + y0, x1 + y1, D0, D1)


@triton.jit
def _contrast_rows(streams, rows, ok, n, d, S: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr):
    """Rows of T⁺ and T⁻ (T⁺ again when S = 1) of one head."""
    t_pos0, t_pos1 = load_rows(streams, rows, ok, d, d, D0, D1)
    t_neg0, t_neg1 = t_pos0, t_pos1
    if S == 2:
        t_neg0, t_neg1 = load_rows(streams + n * d, rows, ok, d, d, D0, D1)
    return t_pos0, t_pos1, t_neg0, t_neg1


# ----------------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def stage1_partial_phase(
    streams, k, v, stride_n, start, stop, reads, stats, m1, d, scale, PRECISION: tl.constexpr, D0: tl.constexpr,
    D1: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, CALLS: tl.constexpr,
):  # fmt: skip
    """Step 4 over keys [start, stop) of one head, for its m1 contrast rows (T⁺'s, then T⁻'s: each row its own
    softmax) in blocks of BLOCK_C: the unnormalised reads (`reads`, (m1, d)) and each row's running max and sum
    (`stats`, (2, m1)) of its online softmax. With CALLS one non-inlined call per block of rows."""
    for first in range(0, m1, BLOCK_C):
        if CALLS:
            _stage1_partial_rows_call(streams, k, v, stride_n, start, stop, reads, stats, first, m1, d, scale,
                                      PRECISION, D0, D1, BLOCK_C, BLOCK_N)  # fmt: skip
        else:
            _stage1_partial_rows(streams, k, v, stride_n, start, stop, reads, stats, first, m1, d, scale, PRECISION,
                                 D0, D1, BLOCK_C, BLOCK_N)  # fmt: skip


def _stage1_partial_rows_body(
    streams, k, v, stride_n, start, stop, reads, stats, first, m1, d, scale, PRECISION: tl.constexpr,
    D0: tl.constexpr, D1: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """stage1_partial_phase's work on rows [first, first + BLOCK_C)."""
    j = first + tl.arange(0, BLOCK_C)
    ok = j < m1
    t0, t1 = load_rows(streams, j, ok, d, d, D0, D1)
    m, l, acc0, acc1, _m, _l, _acc0, _acc1 = stage1_forward_range(  # noqa: E741
        t0, t1, t0, t1, k, v, stride_n, start, stop, d, scale, False, PRECISION, D0, D1, BLOCK_C, BLOCK_N
    )
    store_rows(reads, j, ok, d, d, acc0, acc1, D0, D1)
    tl.store(stats + j, m, mask=ok)
    tl.store(stats + m1 + j, l, mask=ok)


_stage1_partial_rows, _stage1_partial_rows_call = inlined_and_called(_stage1_partial_rows_body)


@triton.jit
def _combined_reads(partial_reads, partial_stats, rows, ok, K, m1, d, D0: tl.constexpr, D1: tl.constexpr,
                    BLOCK_J: tl.constexpr):  # fmt: skip
    """Stage I's reads of contrast rows `rows` (of m1) from K key splits ((K, m1, d) and (K, 2, m1) partials),
    combined in split order by their log-sum-exps: R (float32 pieces) and its lse."""
    m = tl.full((BLOCK_J,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_J,), tl.float32)
    acc0, acc1 = tl.zeros((BLOCK_J, D0), tl.float32), tl.zeros((BLOCK_J, D1), tl.float32)
    for split in range(0, K):
        stats = partial_stats + split * 2 * m1
        m_split = tl.load(stats + rows, mask=ok, other=0.0)
        l_split = tl.load(stats + m1 + rows, mask=ok, other=1.0)
        x0, x1 = load_rows(partial_reads + split * m1 * d, rows, ok, d, d, D0, D1)
        m_new = tl.maximum(m, m_split)
        old, new = tl.exp(m - m_new), tl.exp(m_split - m_new)
        total = total * old + l_split * new
        acc0, acc1 = acc0 * old[:, None] + x0 * new[:, None], acc1 * old[:, None] + x1 * new[:, None]
        m = m_new
    return acc0 / total[:, None], acc1 / total[:, None], m + tl.log(total)


@triton.jit(noinline=True)
def stage1_combine_rows(
    partial_reads, partial_stats, K, lam1, norm1, reads, lse, v_hat, first, n, d, eps, out_scale,
    DIFF1: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    """Step 4's end for contrast tokens [first, first + BLOCK_J) of one head: R± from the key splits (`reads`
    (m1, d), `lse` (m1), float32) and V̂ (`v_hat` (n, d), in its dtype)."""
    j = first + tl.arange(0, BLOCK_J)
    ok = j < n
    m1 = 2 * n if DIFF1 else n
    r_pos0, r_pos1, lse_pos = _combined_reads(partial_reads, partial_stats, j, ok, K, m1, d, D0, D1, BLOCK_J)
    store_rows(reads, j, ok, d, d, r_pos0, r_pos1, D0, D1)
    tl.store(lse + j, lse_pos, mask=ok)
    r_neg0, r_neg1 = r_pos0, r_pos1
    if DIFF1:
        r_neg0, r_neg1, lse_neg = _combined_reads(partial_reads, partial_stats, n + j, ok, K, m1, d, D0, D1, BLOCK_J)
        store_rows(reads, n + j, ok, d, d, r_neg0, r_neg1, D0, D1)
        tl.store(lse + n + j, lse_neg, mask=ok)
    x0, x1 = contrast_values(r_pos0, r_pos1, r_neg0, r_neg1, lam1, norm1, d, eps, out_scale, DIFF1, D0, D1)
    store_rows(v_hat, j, ok, d, d, x0, x1, D0, D1)


@triton.jit
def stage2_forward_rows(
    q, stride_n, streams, v_hat, lam, w0, w1, outs, outs_neg, lse, lse_neg, result, result_n, i, i_ok, n, d, scale,
    eps, S: tl.constexpr, DIFF2: tl.constexpr, JOINT: tl.constexpr, ADD: tl.constexpr, PRECISION: tl.constexpr,
    D0: tl.constexpr, D1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Step 5 for queries i of one head over the blocks of contrast columns: O (and O⁻ for two softmaxes, at
    `outs_neg` elements further) and their log-sum-exps stored; with ADD, Y added into `result` (rows of stride
    `result_n`). `w`: the norm weight, already scaled by 1 − λ_init."""
    q0, q1 = load_rows(q, i, i_ok, stride_n, d, D0, D1)
    m_pos, l_pos = tl.full((BLOCK_M,), float("-inf"), tl.float32), tl.zeros((BLOCK_M,), tl.float32)
    acc_pos0, acc_pos1 = tl.zeros((BLOCK_M, D0), tl.float32), tl.zeros((BLOCK_M, D1), tl.float32)
    m_neg, l_neg = tl.full((BLOCK_M,), float("-inf"), tl.float32), tl.zeros((BLOCK_M,), tl.float32)
    acc_neg0, acc_neg1 = tl.zeros((BLOCK_M, D0), tl.float32), tl.zeros((BLOCK_M, D1), tl.float32)
    for first in range(0, n, BLOCK_C):
        cols = first + tl.arange(0, BLOCK_C)
        col_ok = cols < n
        t_pos0, t_pos1, t_neg0, t_neg1 = _contrast_rows(streams, cols, col_ok, n, d, S, D0, D1)
        v0, v1 = load_rows(v_hat, cols, col_ok, d, d, D0, D1)
        m_pos, l_pos, acc_pos0, acc_pos1, m_neg, l_neg, acc_neg0, acc_neg1 = stage2_forward_block(
            q0, q1, t_pos0, t_pos1, t_neg0, t_neg1, v0, v1, col_ok, lam, m_pos, l_pos, acc_pos0, acc_pos1,
            m_neg, l_neg, acc_neg0, acc_neg1, scale, DIFF2, JOINT, PRECISION,
        )  # fmt: skip
    o0, o1 = acc_pos0 / l_pos[:, None], acc_pos1 / l_pos[:, None]  # O (joint: (P⁺ − λ₂P⁻)·V̂ already), or O⁺
    store_rows(outs, i, i_ok, d, d, o0, o1, D0, D1)
    tl.store(lse + i, m_pos + tl.log(l_pos), mask=i_ok)
    o_neg0, o_neg1 = o0, o1
    if DIFF2 and not JOINT:
        o_neg0, o_neg1 = acc_neg0 / l_neg[:, None], acc_neg1 / l_neg[:, None]
        store_rows(outs + outs_neg, i, i_ok, d, d, o_neg0, o_neg1, D0, D1)
        tl.store(lse + lse_neg + i, m_neg + tl.log(l_neg), mask=i_ok)
    if ADD:
        y0, y1 = stage2_output(o0, o1, o_neg0, o_neg1, lam, w0, w1, d, eps, DIFF2, JOINT)
        x0, x1 = load_rows_f32(result, i, i_ok, result_n, d, D0, D1)
        store_rows(result, i, i_ok, result_n, d, x0 + y0, x1 + y1, D0, D1)


def _stage2_forward_tile_body(
    q, stride_n, streams, v_hat, lam2, norm2, outs, outs_neg, lse, lse_neg, result, result_n, tile, N, n, d, scale,
    eps, out_scale, S: tl.constexpr, DIFF2: tl.constexpr, JOINT: tl.constexpr, ADD: tl.constexpr,
    PRECISION: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """stage2_forward_rows for query tile `tile`, λ₂ and the norm weight read here (for a caller's loop over tiles:
    see inlined_and_called)."""
    lam, w0, w1 = stage2_parameters(lam2, norm2, d, out_scale, DIFF2, D0, D1)
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    stage2_forward_rows(q, stride_n, streams, v_hat, lam, w0, w1, outs, outs_neg, lse, lse_neg, result, result_n, i,
                        i < N, n, d, scale, eps, S, DIFF2, JOINT, ADD, PRECISION, D0, D1, BLOCK_M, BLOCK_C)  # fmt: skip


stage2_forward_tile, stage2_forward_tile_call = inlined_and_called(_stage2_forward_tile_body)


# ----------------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _stage2_backward_columns(q0, q1, do0, do1, t_rows, v_hat, part_t, part_v, cols, col_ok, i_ok, trip, trip_v,
                             row_lse, delta, gain, scale, d, PRECISION: tl.constexpr, D0: tl.constexpr,
                             D1: tl.constexpr):  # fmt: skip
    """A tile of queries against a block of one stream's contrast columns `cols`, from the queries' log-sum-exps and
    row terms δ for that stream and dO (in q's dtype); the stream's weight in W is `gain` (1 for T⁺, −λ₂ for T⁻):
    adds the shares of the stream's dT (dSᵀ·q/√d, into `part_t`) and of dV̂ (gain·Pᵀ·dO, into `part_v`) as soon as
    each is computed; returns the share of dq (dS·T, without 1/√d) and each query's Σ_j dW·P (for dλ₂ = −Σ dW·P⁻).
    One stream at a time, its probabilities from its scores (FlashAttention-2's dQ pass): few tiles live at once."""
    both_ok = i_ok[:, None] & col_ok[None, :]
    v0, v1 = load_rows(v_hat, cols, col_ok, d, d, D0, D1)
    grad_w = dot_rows(do0, do1, v0, v1, PRECISION)  # dW = dO·V̂ᵀ
    t0, t1 = load_rows(t_rows, cols, col_ok, d, d, D0, D1)
    probs = tl.where(both_ok, tl.exp(dot_rows(q0, q1, t0, t1, PRECISION) * scale - row_lse[:, None]), 0.0)  # P
    ds = (probs * (gain * grad_w - delta[:, None])).to(q0.dtype)  # dS = P ⊙ (dP − δ), dP = gain·dW
    dq0, dq1 = dot_pieces(ds, t0, t1, PRECISION)
    x0, x1 = dot_pieces(tl.trans(ds), q0, q1, PRECISION)
    add_rows(part_t, cols, col_ok, d, x0 * scale, x1 * scale, trip, D0, D1)
    x0, x1 = dot_pieces(tl.trans((probs * gain).to(q0.dtype)), do0, do1, PRECISION)
    add_rows(part_v, cols, col_ok, d, x0, x1, trip_v, D0, D1)
    return dq0, dq1, tl.sum(grad_w * probs, 1)


@triton.jit
def stage2_backward_range(
    q, stride_n, streams, v_hat, lam2, norm2, outs, outs_neg, lse, lse_neg, grad, grad_n, grad_q, grad_q_n, part,
    parameter_row, first_trip, first_tile, last_tile, N, n, d, scale, eps, out_scale, S: tl.constexpr,
    DIFF2: tl.constexpr, JOINT: tl.constexpr, PRECISION: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, CALLS: tl.constexpr,
):  # fmt: skip
    """Step 5, backward, over query tiles [first_tile, last_tile) of one head (a dQ pass): dq (without the pooling's
    share) into `grad_q`; the part's dT± (m2 rows) and dV̂ (n rows) summed into `part` ((m2 + n, d) float32); with
    DIFF2 its dλ₂ and norm weight's gradient added into `parameter_row` (1 + d; written on trip 0 if `first_trip`
    is 0). With CALLS one non-inlined call per tile (see inlined_and_called)."""
    for tile in range(first_tile, last_tile):
        if CALLS:
            _stage2_backward_tile_call(
                q, stride_n, streams, v_hat, lam2, norm2, outs, outs_neg, lse, lse_neg, grad, grad_n, grad_q,
                grad_q_n, part, parameter_row, first_trip + tile - first_tile, tile - first_tile, tile, N, n, d,
                scale, eps, out_scale, S, DIFF2, JOINT, PRECISION, D0, D1, BLOCK_M, BLOCK_C,
            )  # fmt: skip
        else:
            _stage2_backward_tile(
                q, stride_n, streams, v_hat, lam2, norm2, outs, outs_neg, lse, lse_neg, grad, grad_n, grad_q,
                grad_q_n, part, parameter_row, first_trip + tile - first_tile, tile - first_tile, tile, N, n, d,
                scale, eps, out_scale, S, DIFF2, JOINT, PRECISION, D0, D1, BLOCK_M, BLOCK_C,
            )  # fmt: skip


def _stage2_backward_tile_body(
    q, stride_n, streams, v_hat, lam2, norm2, outs, outs_neg, lse, lse_neg, grad, grad_n, grad_q, grad_q_n, part,
    parameter_row, parameter_trip, trip, tile, N, n, d, scale, eps, out_scale, S: tl.constexpr, DIFF2: tl.constexpr,
    JOINT: tl.constexpr, PRECISION: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """stage2_backward_range's work on query tile `tile` (its `trip`-th)."""
    M2: tl.constexpr = 2 if DIFF2 else 1
    m2 = M2 * n
    lam, w0, w1 = stage2_parameters(lam2, norm2, d, out_scale, DIFF2, D0, D1)
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    i_ok = i < N
    q0, q1 = load_rows(q, i, i_ok, stride_n, d, D0, D1)
    dy0, dy1 = load_rows_f32(grad, i, i_ok, grad_n, d, D0, D1)
    o0, o1 = load_rows_f32(outs, i, i_ok, d, d, D0, D1)
    lse_pos = tl.load(lse + i, mask=i_ok, other=0.0)
    o_neg0, o_neg1, lse_neg2 = o0, o1, lse_pos
    if DIFF2 and not JOINT:
        o_neg0, o_neg1 = load_rows_f32(outs + outs_neg, i, i_ok, d, d, D0, D1)
        lse_neg2 = tl.load(lse + lse_neg + i, mask=i_ok, other=0.0)
    dy0, dy1, delta_pos, delta_neg, dw0, dw1 = stage2_output_backward(
        dy0, dy1, o0, o1, o_neg0, o_neg1, lam, w0, w1, d, eps, DIFF2, JOINT
    )
    do0, do1 = dy0.to(q0.dtype), dy1.to(q0.dtype)
    dq0, dq1 = tl.zeros((BLOCK_M, D0), tl.float32), tl.zeros((BLOCK_M, D1), tl.float32)
    lam_terms = tl.zeros((BLOCK_M,), tl.float32)
    for first in range(0, n, BLOCK_C):
        cols = first + tl.arange(0, BLOCK_C)
        a0, a1, terms = _stage2_backward_columns(
            q0, q1, do0, do1, streams, v_hat, part, part + m2 * d, cols, cols < n, i_ok, trip, trip * M2, lse_pos,
            delta_pos, 1.0, scale, d, PRECISION, D0, D1,
        )  # fmt: skip
        dq0, dq1 = dq0 + a0, dq1 + a1
        if DIFF2:
            a0, a1, terms = _stage2_backward_columns(
                q0, q1, do0, do1, streams + n * d, v_hat, part + n * d, part + m2 * d, cols, cols < n, i_ok, trip,
                trip * M2 + 1, lse_neg2, delta_neg, -lam, scale, d, PRECISION, D0, D1,
            )  # fmt: skip
            dq0, dq1 = dq0 + a0, dq1 + a1
            lam_terms += terms
    store_rows(grad_q, i, i_ok, grad_q_n, d, dq0 * scale, dq1 * scale, D0, D1)
    if DIFF2:
        add_parameter_row(parameter_row, d, -tl.sum(lam_terms, 0), dw0 * out_scale, dw1 * out_scale,
                          parameter_trip, D0, D1)  # fmt: skip


_stage2_backward_tile, _stage2_backward_tile_call = inlined_and_called(_stage2_backward_tile_body)


@triton.jit
def _split_sum(partial, splits, rows, ok, width, d, D0: tl.constexpr, D1: tl.constexpr, BLOCK_J: tl.constexpr):
    """Σ over the splits, in order, of rows `rows` of a (splits, width, d) float32 partial."""
    x0, x1 = tl.zeros((BLOCK_J, D0), tl.float32), tl.zeros((BLOCK_J, D1), tl.float32)
    for split in range(0, splits):
        y0, y1 = load_rows(partial + split * width * d, rows, ok, d, d, D0, D1)
        x0, x1 = x0 + y0, x1 + y1
    return x0, x1


@triton.jit(noinline=True)
def norm_backward_rows(
    partial, Q, reads, lam1, norm1, grad_reads, delta, parameter_row, trip, first, n, d, eps, out_scale,
    DIFF1: tl.constexpr, DIFF2: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    """Step 4's norm and λ₁, backward, for contrast tokens [first, first + BLOCK_J) of one head: dV̂ summed over the
    Q Stage II parts (`partial` (Q, m2 + n, d)) in order, then dR± (`grad_reads` (m1, d)) and δ± (`delta` (m1))
    from R± (`reads`); with DIFF1 the rows' shares of dλ₁ and the norm weight's gradient added into
    `parameter_row` (written on trip 0)."""
    j = first + tl.arange(0, BLOCK_J)
    ok = j < n
    m2 = 2 * n if DIFF2 else n
    grad0, grad1 = _split_sum(partial, Q, m2 + j, ok, m2 + n, d, D0, D1, BLOCK_J)
    r_pos0, r_pos1 = load_rows(reads, j, ok, d, d, D0, D1)
    r_neg0, r_neg1 = r_pos0, r_pos1
    if DIFF1:
        r_neg0, r_neg1 = load_rows(reads, n + j, ok, d, d, D0, D1)
    dr_pos0, dr_pos1, dr_neg0, dr_neg1, delta_pos, delta_neg, grad_lam, dw0, dw1 = contrast_values_backward(
        grad0, grad1, r_pos0, r_pos1, r_neg0, r_neg1, lam1, norm1, d, eps, out_scale, DIFF1, D0, D1
    )
    store_rows(grad_reads, j, ok, d, d, dr_pos0, dr_pos1, D0, D1)
    tl.store(delta + j, delta_pos, mask=ok)
    if DIFF1:
        store_rows(grad_reads, n + j, ok, d, d, dr_neg0, dr_neg1, D0, D1)
        tl.store(delta + n + j, delta_neg, mask=ok)
        add_parameter_row(parameter_row, d, grad_lam, dw0, dw1, trip, D0, D1)


@triton.jit
def stage1_backward_range(
    streams, k, v, stride_n, grad_reads, lse, delta, grad_local, local_n, grad_k, grad_v, grad_kv_n, part,
    first_tile, last_tile, N, m1, d, scale, PRECISION: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, CALLS: tl.constexpr,
):  # fmt: skip
    """Step 4, backward, over key tiles [first_tile, last_tile) of one head (a dK/dV pass): per key tile dk and dv
    (with the convolution's share `grad_local`) over its m1 contrast rows (T⁺'s, then T⁻'s) in blocks, into
    `grad_k`, `grad_v`; the part's dT± summed into `part` ((m1, d) float32). With CALLS one non-inlined call per
    tile (see inlined_and_called)."""
    for tile in range(first_tile, last_tile):
        if CALLS:
            _stage1_backward_tile_call(
                streams, k, v, stride_n, grad_reads, lse, delta, grad_local, local_n, grad_k, grad_v, grad_kv_n,
                part, tile - first_tile, tile, N, m1, d, scale, PRECISION, D0, D1, BLOCK_C, BLOCK_N,
            )  # fmt: skip
        else:
            _stage1_backward_tile(
                streams, k, v, stride_n, grad_reads, lse, delta, grad_local, local_n, grad_k, grad_v, grad_kv_n,
                part, tile - first_tile, tile, N, m1, d, scale, PRECISION, D0, D1, BLOCK_C, BLOCK_N,
            )  # fmt: skip


def _stage1_backward_tile_body(
    streams, k, v, stride_n, grad_reads, lse, delta, grad_local, local_n, grad_k, grad_v, grad_kv_n, part, trip,
    tile, N, m1, d, scale, PRECISION: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """stage1_backward_range's work on key tile `tile` (its `trip`-th)."""
    keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = keys < N
    k0, k1 = load_rows(k, keys, key_ok, stride_n, d, D0, D1)
    v0, v1 = load_rows(v, keys, key_ok, stride_n, d, D0, D1)
    dk0, dk1 = tl.zeros((BLOCK_N, D0), tl.float32), tl.zeros((BLOCK_N, D1), tl.float32)
    dv0, dv1 = tl.zeros((BLOCK_N, D0), tl.float32), tl.zeros((BLOCK_N, D1), tl.float32)
    for first in range(0, m1, BLOCK_C):
        j = first + tl.arange(0, BLOCK_C)
        ok = j < m1
        t0, t1 = load_rows(streams, j, ok, d, d, D0, D1)
        dr0, dr1 = load_rows(grad_reads, j, ok, d, d, D0, D1)
        row_lse, row_delta = tl.load(lse + j, mask=ok, other=0.0), tl.load(delta + j, mask=ok, other=0.0)
        a0, a1, c0, c1, dt0, dt1 = stage1_backward_block(
            t0, t1, dr0.to(t0.dtype), dr1.to(t0.dtype), row_lse, row_delta, ok, k0, k1, v0, v1, key_ok, scale,
            PRECISION,
        )  # fmt: skip
        dv0, dv1, dk0, dk1 = dv0 + a0, dv1 + a1, dk0 + c0, dk1 + c1
        add_rows(part, j, ok, d, dt0 * scale, dt1 * scale, trip, D0, D1)
    local0, local1 = load_rows_f32(grad_local, keys, key_ok, local_n, d, D0, D1)
    store_rows(grad_k, keys, key_ok, grad_kv_n, d, dk0 * scale, dk1 * scale, D0, D1)
    store_rows(grad_v, keys, key_ok, grad_kv_n, d, dv0 + local0, dv1 + local1, D0, D1)


_stage1_backward_tile, _stage1_backward_tile_call = inlined_and_called(_stage1_backward_tile_body)


@triton.jit(noinline=True)
def streams_backward_rows(
    stage1_partial, K, stage2_partial, Q, embed_part, trip, grad_content, first, n, d, S: tl.constexpr,
    DIFF1: tl.constexpr, DIFF2: tl.constexpr, CONTENT: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
    BLOCK_J: tl.constexpr,
):  # fmt: skip
    """Steps 1-2, backward, for contrast tokens [first, first + BLOCK_J) of one head: dT± summed over both stages'
    parts in order (`stage1_partial` (K, m1, d), `stage2_partial` (Q, m2 + n, d)), added into the program's dE±
    (`embed_part` (S, n, d); its first image's, `trip` 0, written); with CONTENT their sum dT into `grad_content`
    (n, d), float32."""
    j = first + tl.arange(0, BLOCK_J)
    ok = j < n
    m1, m2 = (2 * n if DIFF1 else n), (2 * n if DIFF2 else n)
    pos0, pos1 = _split_sum(stage1_partial, K, j, ok, m1, d, D0, D1, BLOCK_J)
    x0, x1 = _split_sum(stage2_partial, Q, j, ok, m2 + n, d, D0, D1, BLOCK_J)
    pos0, pos1 = pos0 + x0, pos1 + x1
    add_rows(embed_part, j, ok, d, pos0, pos1, trip, D0, D1)
    if S == 2:
        neg0, neg1 = tl.zeros((BLOCK_J, D0), tl.float32), tl.zeros((BLOCK_J, D1), tl.float32)
        if DIFF1:
            neg0, neg1 = _split_sum(stage1_partial, K, n + j, ok, m1, d, D0, D1, BLOCK_J)
        if DIFF2:
            x0, x1 = _split_sum(stage2_partial, Q, n + j, ok, m2 + n, d, D0, D1, BLOCK_J)
            neg0, neg1 = neg0 + x0, neg1 + x1
        add_rows(embed_part + n * d, j, ok, d, neg0, neg1, trip, D0, D1)
        pos0, pos1 = pos0 + neg0, pos1 + neg1
    if CONTENT:
        store_rows(grad_content, j, ok, d, d, pos0, pos1, D0, D1)


@triton.jit(noinline=True)
def pool_backward_tokens(grad_content, grad_q, grad_q_n, first, N, H, p, d, D0: tl.constexpr, D1: tl.constexpr,
                         BLOCK_T: tl.constexpr):  # fmt: skip
    """Step 1, backward, for tokens [first, first + BLOCK_T) of one head: dq += dT / r² of the token's window
    (`grad_content` (n, d) float32)."""
    token = first + tl.arange(0, BLOCK_T)
    ok = token < N
    r = H // p
    window = (token // H // r) * p + (token % H) // r
    x0, x1 = load_rows_f32(grad_q, token, ok, grad_q_n, d, D0, D1)
    t0, t1 = load_rows(grad_content, window, ok, d, d, D0, D1)
    store_rows(grad_q, token, ok, grad_q_n, d, x0 + t0 / (r * r), x1 + t1 / (r * r), D0, D1)


# ----------------------------------------------------------------------------------------------------------------
# The partial gradients' fixed-order sum
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _column_sums(part, rows, width, columns, BLOCK_R: tl.constexpr):
    """Σ_r part[r, c] for the columns `columns` (a vector, masked to c < width) of a (rows, width) float32 matrix,
    BLOCK_R rows per trip, in a fixed order (each tile's column sums, then the tiles in order)."""
    col_ok = columns < width
    total = tl.zeros(columns.shape, tl.float32)
    for first in range(0, rows, BLOCK_R):
        r = first + tl.arange(0, BLOCK_R)
        offsets = r.to(tl.int64)[:, None] * width + columns[None, :]
        total += tl.sum(tl.load(part + offsets, mask=(r < rows)[:, None] & col_ok[None, :], other=0.0), 0)
    return total


@triton.jit
def sum_partials_kernel(
    embed_part,  # (B, h·S·n·d) float32: each image's dE±
    grad_embed,  # out: dE± (h·S·n·d), float32
    first_part,  # (R1, 1 + d) float32: dλ₁ and the first norm weight's gradient per row (program or block)
    grad_lambda1,  # out: dλ₁, float32 (0-d)
    grad_norm1,  # out: (d,) float32
    second_part,  # (R2, 1 + d) float32: the same for λ₂ and the second norm weight
    grad_lambda2,
    grad_norm2,
    B,
    embed_width,
    R1,
    R2,
    d,
    EMBED_PROGRAMS,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Sums the per-program partial gradients of both paths in a fixed order, so that the backward is bitwise
    deterministic without atomics: programs [0, EMBED_PROGRAMS) sum BLOCK_W columns of dE± each over the images;
    the next two sum dλ₁ with d norm1 and dλ₂ with d norm2 (R1 = 0 or R2 = 0: that stage is not differential)."""
    program = tl.program_id(0)
    if program < EMBED_PROGRAMS:
        columns = program * BLOCK_W + tl.arange(0, BLOCK_W)
        total = _column_sums(embed_part, B, embed_width, columns, BLOCK_R)
        tl.store(grad_embed + columns, total, mask=columns < embed_width)
    else:
        part, rows, lam, norm = first_part, R1, grad_lambda1, grad_norm1
        if program == EMBED_PROGRAMS + 1:
            part, rows, lam, norm = second_part, R2, grad_lambda2, grad_norm2
        if rows > 0:
            columns = tl.arange(0, BLOCK_D)  # dλ in column 0, the norm weight's gradient in columns 1 to d
            total = _column_sums(part, rows, 1 + d, columns, BLOCK_P)
            tl.store(lam, tl.sum(tl.where(columns == 0, total, 0.0), 0))
            tl.store(norm + columns - 1, total, mask=(columns >= 1) & (columns <= d))
