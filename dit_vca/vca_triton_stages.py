"""The steps of VCA's two attention stages on tiles, forward and backward, that both Triton paths run: the per-head
kernels (dit_vca.vca_triton_per_head: one program per image and head) call them on a whole head, the split path
(dit_vca.vca_triton_split) on a part of its tokens or keys. Also the fixed-order sum of both paths' per-program
partial gradients (`sum_partials_kernel`).

The letters are those of docs/VCA.md's notation table, the step numbers its steps. In FlashAttention's terms Stage
I's queries are the contrast tokens T±, its keys and values k and v; Stage II's queries are q, its keys T±, its
values V̂. Tile names follow FlashAttention's: BLOCK_M rows of a stage's queries, BLOCK_N rows of its keys: in
Stage I BLOCK_C contrast tokens (its queries) against BLOCK_N keys, in Stage II BLOCK_M queries against BLOCK_C
contrast columns (its keys). A contrast block holds the rows j of both streams: T⁺ row j and T⁻ row j.
Everything is summed in float32; product operands are in the dtype of q, k, v.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dit_vca.vca_triton_tiles import (
    dot,
    dot_pieces,
    dot_rows,
    load_rows,
    load_rows_f32,
    load_vector,
    online_step,
    rms_backward,
    rms_scale,
    row_dot,
)

# ----------------------------------------------------------------------------------------------------------------
# Steps 1-2: the contrast tokens
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def pool_rows(q, stride_n, j, ok, H, p, d, D0: tl.constexpr, D1: tl.constexpr, BLOCK_C: tl.constexpr):
    """Step 1 for contrast tokens j of one head: the mean of q over each token's r×r window (r = H / p), float32
    pieces (BLOCK_C, D0), (BLOCK_C, D1); one window offset per loop trip (r² trips)."""
    r = H // p
    corner = (j // p) * r * H + (j % p) * r  # the first token of each window
    pooled0, pooled1 = tl.zeros((BLOCK_C, D0), tl.float32), tl.zeros((BLOCK_C, D1), tl.float32)
    for t in range(0, r * r):
        x0, x1 = load_rows_f32(q, corner + (t // r) * H + t % r, ok, stride_n, d, D0, D1)
        pooled0, pooled1 = pooled0 + x0, pooled1 + x1
    return pooled0 / (r * r), pooled1 / (r * r)


@triton.jit
def contrast_tokens(
    q,
    stride_n,
    given,
    stride_given,
    embed,
    j,
    ok,
    H,
    p,
    d,
    S: tl.constexpr,
    CONTENT: tl.constexpr,
    GIVEN: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Steps 1-2 for contrast tokens j of one head: T⁺ = T + E⁺ and T⁻ = T + E⁻ (T⁻ = T⁺ when S = 1) in q's dtype,
    T the pool of this head's q (`q`, rows of stride `stride_n`), or the rows of a `given` T (GIVEN: with RoPE), or
    zero (CONTENT off). `embed` points at this head's (S, n, d) embeddings."""
    n = p * p
    content0, content1 = tl.zeros((BLOCK_C, D0), tl.float32), tl.zeros((BLOCK_C, D1), tl.float32)
    if CONTENT:
        if GIVEN:
            content0, content1 = load_rows_f32(given, j, ok, stride_given, d, D0, D1)
        else:
            content0, content1 = pool_rows(q, stride_n, j, ok, H, p, d, D0, D1, BLOCK_C)
    e0, e1 = load_rows_f32(embed, j, ok, d, d, D0, D1)
    t_pos0, t_pos1 = (content0 + e0).to(q.dtype.element_ty), (content1 + e1).to(q.dtype.element_ty)
    t_neg0, t_neg1 = t_pos0, t_pos1
    if S == 2:
        e0, e1 = load_rows_f32(embed + n * d, j, ok, d, d, D0, D1)
        t_neg0, t_neg1 = (content0 + e0).to(q.dtype.element_ty), (content1 + e1).to(q.dtype.element_ty)
    return t_pos0, t_pos1, t_neg0, t_neg1


# ----------------------------------------------------------------------------------------------------------------
# Step 4, Stage I: the contrast tokens over the keys
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def stage1_step(t0, t1, k0, k1, v0, v1, key_ok, m, l, acc0, acc1, scale, PRECISION: tl.constexpr):  # noqa: E741
    """One key tile of Stage I for one stream: the online softmax of T·kᵀ/√d and its product with v."""
    scores = tl.where(key_ok[None, :], dot_rows(t0, t1, k0, k1, PRECISION) * scale, float("-inf"))
    m, alpha, probs, l = online_step(scores, m, l)  # noqa: E741
    probs = probs.to(v0.dtype)
    return m, l, acc0 * alpha[:, None] + dot(probs, v0, PRECISION), acc1 * alpha[:, None] + dot(probs, v1, PRECISION)


@triton.jit
def stage1_forward_range(
    t_pos0,
    t_pos1,
    t_neg0,
    t_neg1,
    k,
    v,
    stride_n,
    start,
    stop,
    d,
    scale,
    DIFF1: tl.constexpr,
    PRECISION: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Stage I's online softmax of a contrast block of both streams over keys [start, stop) (not empty), in tiles
    of BLOCK_N: for each stream the running max m, sum l and unnormalised read acc (BLOCK_C, D0 + D1)."""
    m_pos, l_pos = tl.full((BLOCK_C,), float("-inf"), tl.float32), tl.zeros((BLOCK_C,), tl.float32)
    acc_pos0, acc_pos1 = tl.zeros((BLOCK_C, D0), tl.float32), tl.zeros((BLOCK_C, D1), tl.float32)
    m_neg, l_neg = tl.full((BLOCK_C,), float("-inf"), tl.float32), tl.zeros((BLOCK_C,), tl.float32)
    acc_neg0, acc_neg1 = tl.zeros((BLOCK_C, D0), tl.float32), tl.zeros((BLOCK_C, D1), tl.float32)
    for first in range(start, stop, BLOCK_N):
        keys = first + tl.arange(0, BLOCK_N)
        key_ok = keys < stop
        k0, k1 = load_rows(k, keys, key_ok, stride_n, d, D0, D1)
        v0, v1 = load_rows(v, keys, key_ok, stride_n, d, D0, D1)
        m_pos, l_pos, acc_pos0, acc_pos1 = stage1_step(
            t_pos0, t_pos1, k0, k1, v0, v1, key_ok, m_pos, l_pos, acc_pos0, acc_pos1, scale, PRECISION
        )
        if DIFF1:
            m_neg, l_neg, acc_neg0, acc_neg1 = stage1_step(
                t_neg0, t_neg1, k0, k1, v0, v1, key_ok, m_neg, l_neg, acc_neg0, acc_neg1, scale, PRECISION
            )
    return m_pos, l_pos, acc_pos0, acc_pos1, m_neg, l_neg, acc_neg0, acc_neg1


@triton.jit
def contrast_values(r_pos0, r_pos1, r_neg0, r_neg1, lam, norm, d, eps, out_scale, DIFF1: tl.constexpr,
                    D0: tl.constexpr, D1: tl.constexpr):  # fmt: skip
    """Step 4's V̂ = (1 − λ_init)·RMSNorm(R⁺ − λ₁R⁻) (R⁺ when Stage I is plain), float32 pieces."""
    if DIFF1:
        lam1 = tl.load(lam).to(tl.float32)
        w0, w1 = load_vector(norm, d, D0, D1)
        return rms_scale(r_pos0 - lam1 * r_neg0, r_pos1 - lam1 * r_neg1, w0 * out_scale, w1 * out_scale, d, eps)
    return r_pos0, r_pos1


@triton.jit
def contrast_values_backward(grad0, grad1, r_pos0, r_pos1, r_neg0, r_neg1, lam, norm, d, eps, out_scale,
                             DIFF1: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr):  # fmt: skip
    """Backward of `contrast_values` for a contrast block, from dV̂ (grad): dR⁺, dR⁻, Stage I's softmax row terms
    δ⁺ = dR⁺·R⁺ and δ⁻ = dR⁻·R⁻, and the block's shares of dλ₁ (= −Σ dR⁺·R⁻) and of the norm weight's gradient."""
    if DIFF1:
        lam1 = tl.load(lam).to(tl.float32)
        w0, w1 = load_vector(norm, d, D0, D1)
        x0, x1 = r_pos0 - lam1 * r_neg0, r_pos1 - lam1 * r_neg1
        dx0, dx1, dw0, dw1 = rms_backward(grad0, grad1, x0, x1, w0 * out_scale, w1 * out_scale, d, eps)
        dn0, dn1 = -lam1 * dx0, -lam1 * dx1
        grad_lam = -tl.sum(row_dot(dx0, dx1, r_neg0, r_neg1), 0)
        delta_pos, delta_neg = row_dot(dx0, dx1, r_pos0, r_pos1), row_dot(dn0, dn1, r_neg0, r_neg1)
        return dx0, dx1, dn0, dn1, delta_pos, delta_neg, grad_lam, dw0 * out_scale, dw1 * out_scale
    delta = row_dot(grad0, grad1, r_pos0, r_pos1)
    no_weight0, no_weight1 = tl.zeros((D0,), tl.float32), tl.zeros((D1,), tl.float32)
    return grad0, grad1, grad0, grad1, delta, delta, 0.0, no_weight0, no_weight1


@triton.jit
def stage1_backward_block(t0, t1, dr0, dr1, lse, delta, row_ok, k0, k1, v0, v1, key_ok, scale,
                          PRECISION: tl.constexpr):  # fmt: skip
    """One stream's contrast block against one key tile, from the softmax's lse and row terms δ: the shares of dv
    (Pᵀ·dR), of dk (dSᵀ·T, without 1/√d) and of dT (dS·k, without 1/√d). dR in v's dtype."""
    scores = dot_rows(t0, t1, k0, k1, PRECISION) * scale
    probs = tl.where(row_ok[:, None] & key_ok[None, :], tl.exp(scores - lse[:, None]), 0.0)  # P
    probs_t = tl.trans(probs.to(v0.dtype))
    dv0, dv1 = dot_pieces(probs_t, dr0, dr1, PRECISION)
    ds = (probs * (dot_rows(dr0, dr1, v0, v1, PRECISION) - delta[:, None])).to(t0.dtype)  # dS
    dk0, dk1 = dot_pieces(tl.trans(ds), t0, t1, PRECISION)
    dt0, dt1 = dot_pieces(ds, k0, k1, PRECISION)
    return dv0, dv1, dk0, dk1, dt0, dt1


# ----------------------------------------------------------------------------------------------------------------
# Step 5, Stage II: the queries over the contrast tokens
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def stage2_scores(q0, q1, t_pos0, t_pos1, t_neg0, t_neg1, col_ok, scale, DIFF2: tl.constexpr,
                  PRECISION: tl.constexpr):  # fmt: skip
    """S⁺ = q·T⁺ᵀ/√d and S⁻ = q·T⁻ᵀ/√d (S⁻ = S⁺ when Stage II is plain), columns not `col_ok` at −∞."""
    s_pos = tl.where(col_ok[None, :], dot_rows(q0, q1, t_pos0, t_pos1, PRECISION) * scale, float("-inf"))
    s_neg = s_pos
    if DIFF2:
        s_neg = tl.where(col_ok[None, :], dot_rows(q0, q1, t_neg0, t_neg1, PRECISION) * scale, float("-inf"))
    return s_pos, s_neg


@triton.jit
def stage2_block_lse(s_pos, s_neg, DIFF2: tl.constexpr, JOINT: tl.constexpr):
    """The log-sum-exps of rows whose every column is in one block: one over [S⁺, S⁻] for a joint softmax, one
    per stream for two softmaxes, S⁺'s alone when Stage II is plain."""
    m_pos = tl.max(s_pos, 1)
    if DIFF2 and JOINT:
        m = tl.maximum(m_pos, tl.max(s_neg, 1))
        lse = m + tl.log(tl.sum(tl.exp(s_pos - m[:, None]), 1) + tl.sum(tl.exp(s_neg - m[:, None]), 1))
        return lse, lse
    lse_pos = m_pos + tl.log(tl.sum(tl.exp(s_pos - m_pos[:, None]), 1))
    lse_neg = lse_pos
    if DIFF2:
        m_neg = tl.max(s_neg, 1)
        lse_neg = m_neg + tl.log(tl.sum(tl.exp(s_neg - m_neg[:, None]), 1))
    return lse_pos, lse_neg


@triton.jit
def stage2_forward_block(q0, q1, t_pos0, t_pos1, t_neg0, t_neg1, v0, v1, col_ok, lam2, m_pos, l_pos, acc_pos0,
                         acc_pos1, m_neg, l_neg, acc_neg0, acc_neg1, scale, DIFF2: tl.constexpr, JOINT: tl.constexpr,
                         PRECISION: tl.constexpr):  # fmt: skip
    """One block of contrast columns of Stage II's online softmax for a tile of queries: the running max, sum and
    unnormalised output of the joint softmax (whose product with V̂ weighs the streams: W = P⁺ − λ₂P⁻), or of
    each stream's."""
    s_pos, s_neg = stage2_scores(q0, q1, t_pos0, t_pos1, t_neg0, t_neg1, col_ok, scale, DIFF2, PRECISION)
    if DIFF2 and JOINT:
        m_new = tl.maximum(m_pos, tl.maximum(tl.max(s_pos, 1), tl.max(s_neg, 1)))
        alpha = tl.exp(m_pos - m_new)
        p_pos, p_neg = tl.exp(s_pos - m_new[:, None]), tl.exp(s_neg - m_new[:, None])
        l_pos = l_pos * alpha + tl.sum(p_pos, 1) + tl.sum(p_neg, 1)
        weights = (p_pos - lam2 * p_neg).to(v0.dtype)
        acc_pos0 = acc_pos0 * alpha[:, None] + dot(weights, v0, PRECISION)
        acc_pos1 = acc_pos1 * alpha[:, None] + dot(weights, v1, PRECISION)
        m_pos = m_new
    else:
        m_pos, alpha, p_pos, l_pos = online_step(s_pos, m_pos, l_pos)
        acc_pos0 = acc_pos0 * alpha[:, None] + dot(p_pos.to(v0.dtype), v0, PRECISION)
        acc_pos1 = acc_pos1 * alpha[:, None] + dot(p_pos.to(v0.dtype), v1, PRECISION)
        if DIFF2:
            m_neg, alpha, p_neg, l_neg = online_step(s_neg, m_neg, l_neg)
            acc_neg0 = acc_neg0 * alpha[:, None] + dot(p_neg.to(v0.dtype), v0, PRECISION)
            acc_neg1 = acc_neg1 * alpha[:, None] + dot(p_neg.to(v0.dtype), v1, PRECISION)
    return m_pos, l_pos, acc_pos0, acc_pos1, m_neg, l_neg, acc_neg0, acc_neg1


@triton.jit
def stage2_output(o0, o1, o_neg0, o_neg1, lam2, w0, w1, d, eps, DIFF2: tl.constexpr, JOINT: tl.constexpr):
    """Y from O (O⁺ and O⁻ for two softmaxes: O = O⁺ − λ₂O⁻): (1 − λ_init)·RMSNorm(O)·w, `w` already scaled by
    (1 − λ_init); O itself when Stage II is plain."""
    if DIFF2:
        if not JOINT:
            o0, o1 = o0 - lam2 * o_neg0, o1 - lam2 * o_neg1
        o0, o1 = rms_scale(o0, o1, w0, w1, d, eps)
    return o0, o1


@triton.jit
def stage2_output_backward(dy0, dy1, o0, o1, o_neg0, o_neg1, lam2, w0, w1, d, eps, DIFF2: tl.constexpr,
                           JOINT: tl.constexpr):  # fmt: skip
    """From dY and O (O⁺ and O⁻ for two softmaxes), float32: dO, the softmax row terms δ⁺, δ⁻ and the rows' share
    of the norm weight's gradient (w: the weight already scaled by 1 − λ_init; the share without that scale).
    The row terms Σ_j P_ij·dP_ij: dO·O for one softmax (dP⁺ = dW, dP⁻ = −λ₂dW, W = P⁺ − λ₂P⁻); for two softmaxes
    one per stream, dO·O⁺ and −λ₂·dO·O⁻."""
    dw0, dw1 = tl.zeros_like(w0), tl.zeros_like(w1)
    if DIFF2:
        x0, x1 = o0, o1
        if not JOINT:
            x0, x1 = o0 - lam2 * o_neg0, o1 - lam2 * o_neg1
        dy0, dy1, dw0, dw1 = rms_backward(dy0, dy1, x0, x1, w0, w1, d, eps)
    delta_pos = row_dot(dy0, dy1, o0, o1)
    delta_neg = delta_pos
    if DIFF2 and not JOINT:
        delta_neg = -lam2 * row_dot(dy0, dy1, o_neg0, o_neg1)
    return dy0, dy1, delta_pos, delta_neg, dw0, dw1
