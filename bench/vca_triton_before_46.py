"""The kernels of VCA's core before issue 46 (dit_vca/vca_triton.py at commit 90b9006), kept for the GPU check's
per-kernel comparison of old and new only (bench/kernels_before_46.py switches them in); nothing else imports it.
Verbatim but for `usable_configs` below. Its own description follows.

VCA's core as fused Triton kernels: the `kernel="triton"` implementation of dit_vca::vca_core and its backward.

dit_vca.vca_core calls the two entry points here, `add_attention` and `attention_backward`, when its `triton`
argument is set (VisualContrastAttention.kernel; by default on CUDA); dit_vca.vca_aten has the same two entry
points on ATen operations (the CPU path and the reference). The qkv projection, the depthwise 3×3 convolution of
v and the GEMMs of the qkv backward stay in vca_core (cuBLAS/cuDNN); everything between them runs in the kernels
below, one program per (image·head, block of rows). The letters are those of docs/VCA.md's notation table, the
step numbers its steps; in FlashAttention's terms Stage I's queries are the contrast tokens T±, its keys and
values k and v; Stage II's queries are q, its keys T±, its values V̂.

Forward (FlashAttention's forward, twice):
- `_contrast_streams_kernel` (steps 1–2): T± = E± + the r×r average pool of q.
- `_stage1_forward_kernel` (step 4): a block of contrast tokens streams over the N keys with an online softmax
  per stream; R± = softmax(T±kᵀ/√d)·v, V̂ = (1 − λ_init)·RMSNorm(R⁺ − λ₁R⁻). Saves R± and their log-sum-exps.
- `_stage2_forward_kernel` (step 5): a block of queries streams over the n contrast columns;
  O = (P⁺ − λ₂P⁻)·V̂, Y = (1 − λ_init)·RMSNorm(O) added into the convolution's output. Saves O (O⁺ and O⁻ for
  two softmaxes) and the queries' log-sum-exps, as FlashAttention saves its output and log-sum-exps.
Backward (FlashAttention-2's, with what the forward saved: no score is recomputed twice, no forward reruns):
- `_stage2_backward_kernel` (step 5), a dQ pass: per block of queries, Stage II's RMSNorm backward from the
  saved O, dO, the softmax row terms, then over the contrast columns dq in registers; Stage II's keys and values
  (T±, V̂: 3n ≤ 768 rows per head) gather their gradients by float32 atomic adds.
- `_stage1_norm_backward_kernel` (step 4's RMSNorm and λ₁): dR± and Stage I's row terms from the saved R±.
- `_stage1_backward_kernel` (step 4), a dK/dV pass: per block of keys, over the 2n contrast rows, dk and dv in
  registers; Stage I's queries (T±, 2n rows per head) gather theirs by float32 atomic adds.
- `_contrast_streams_backward_kernel` (steps 1–2): dE± summed over the batch, dq through the pooling.
`tile_products` counts the multiply-adds of every tl.dot these launches run (tests/test_vca_triton.py checks it
against the interpreter): the backward runs 18·n·N·d' of them against the forward's 7·n·N·d' (d' = D0 + D1,
below), FlashAttention's ratio of 2.5 plus the atomics' share.

Head dimensions: a (rows, d) tile is held as two column pieces of powers of two, x0 = x[:, :D0] and
x1 = x[:, D0:D0 + D1] (`_head_pieces`: 72 = 64 + 16 in 80 columns, 64 = 32 + 32, 40 = 32 + 16 in 48), so d = 72
costs 80 columns of products and registers, not 128; every product over d is the sum of the two pieces'.
Offsets: the start of a head's rows is computed in 64 bits (`_head_start`, `_image_head_start`), so B·N·3C may
exceed 2³¹; offsets inside one head or one image stay 32-bit (refused past 2³¹ by `_Shape`). Sums are float32;
parameter gradients summed over heads and rows (λ, norm weights) and the gradients of T± and V̂ are float32
atomic adds (their last bits vary from run to run on a GPU).

Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported) runs the same kernels on CPU tensors:
that is how the tests check them. Under the interpreter autotuning keeps one configuration.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor


def usable_configs(kernel: str, names: tuple[str, ...], configs: list[tuple]) -> list[tuple]:
    """This copy's only change: every configuration (none failed to compile on sm_90, the GPU it is compared on; the
    exclusion table it read is gone)."""
    return configs


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


# One declaration per kernel. Block sizes ≥ 16 (tl.dot's smallest): BLOCK_M contrast rows, BLOCK_N keys or
# queries, BLOCK_C contrast columns. Chosen by registers and spills compiled for sm_90 at d = 72 in bf16 (each
# first spills at most 40 bytes; docs/benchmarks.md); the last, unpipelined, is the one for fp32, where the
# others may need more shared memory than the GPU has. On Hopper a tile product wants 64 rows per warp group. The
# 32x32 ones with 4 warps are for an A100 (sm_80): the backward's fit its 163 KiB in fp32-TF32 at d = 128 (112 and 88
# KiB, where the others need 168-304 KiB), and Stage I's forward spills 152 bytes a thread there in bf16 at d = 72,
# where its 64x64 ones spill 8.6 KB with Triton 3.5 and 3.6 (compiled for sm_80; 0 and 200 bytes with 3.8).
_STAGE1_FORWARD_BLOCKS = _configs(
    "_stage1_forward_kernel",
    ("BLOCK_M", "BLOCK_N"),
    (16, 16, 4, 1),
    [(64, 64, 8, 3), (64, 64, 8, 2), (64, 64, 8, 1), (32, 32, 4, 2)],
)
_STAGE2_FORWARD_BLOCKS = _configs(
    "_stage2_forward_kernel", ("BLOCK_N", "BLOCK_C"), (16, 16, 4, 1), [(64, 64, 4, 3), (128, 32, 8, 2), (64, 64, 8, 1)]
)
_STAGE2_BACKWARD_BLOCKS = _configs(
    "_stage2_backward_kernel",
    ("BLOCK_N", "BLOCK_C"),
    (16, 16, 4, 1),
    [(128, 32, 8, 2), (64, 32, 4, 2), (128, 32, 8, 1), (32, 32, 4, 1)],
)
_STAGE1_BACKWARD_BLOCKS = _configs(
    "_stage1_backward_kernel", ("BLOCK_M", "BLOCK_N"), (16, 16, 4, 1), [(64, 64, 8, 2), (64, 64, 8, 1), (32, 32, 4, 1)]
)
_AUTOTUNED = {  # the autotuned kernels' configurations, by kernel (tile_products)
    "_stage1_forward_kernel": _STAGE1_FORWARD_BLOCKS,
    "_stage2_forward_kernel": _STAGE2_FORWARD_BLOCKS,
    "_stage2_backward_kernel": _STAGE2_BACKWARD_BLOCKS,
    "_stage1_backward_kernel": _STAGE1_BACKWARD_BLOCKS,
}
_TOKEN_BLOCK = 32  # contrast tokens per program of the element-wise kernels (streams, Stage I's norm)
_TOKEN_WARPS = 8  # their warps: 4 spill registers in the streams' backward at d = 72 (sm_90)


def _head_pieces(d: int) -> tuple[int, int]:
    """(D0, D1): the widths of a head's two column pieces, powers of two ≥ 16 (tl.dot's smallest) with
    D0 + D1 ≥ d: halves for a power of two, else the largest power of two below d and the rest rounded up."""
    if d <= 16:
        return 16, 16
    if d & (d - 1) == 0:
        return d // 2, d // 2
    first = triton.next_power_of_2(d) // 2
    return first, max(16, triton.next_power_of_2(d - first))


# ----------------------------------------------------------------------------------------------------------------
# Tiles: offsets, loads and stores of (rows, d) tiles in two column pieces, products, softmax and RMSNorm steps
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _head_start(g, length, d):
    """The offset of head g's first element in a head-major (G, length, d) tensor, in 64 bits."""
    return g.to(tl.int64) * length * d


@triton.jit
def _image_head_start(g, N, h, width, d):
    """The offset of head g's first column (image g // h, head g % h, token 0) in a token-major (B, N, width)
    tensor (width C for the core's result, 3C for the gradient of the qkv projection), in 64 bits."""
    g = g.to(tl.int64)
    return (g // h) * N * width + (g % h) * d


@triton.jit
def _load(ptr, rows, ok, stride, d, D0: tl.constexpr, D1: tl.constexpr):
    """Rows `rows` (stride `stride`) of a (·, d) matrix at `ptr` as two pieces (R, D0), (R, D1); rows not `ok`
    and columns ≥ d read as zero."""
    c0, c1 = tl.arange(0, D0), D0 + tl.arange(0, D1)
    x0 = tl.load(ptr + rows[:, None] * stride + c0[None, :], mask=ok[:, None] & (c0 < d)[None, :], other=0.0)
    x1 = tl.load(ptr + rows[:, None] * stride + c1[None, :], mask=ok[:, None] & (c1 < d)[None, :], other=0.0)
    return x0, x1


@triton.jit
def _store(ptr, rows, ok, stride, d, x0, x1, D0: tl.constexpr, D1: tl.constexpr):
    """Stores the pieces x0, x1 into rows `rows` of a (·, d) matrix at `ptr`, in its dtype."""
    c0, c1 = tl.arange(0, D0), D0 + tl.arange(0, D1)
    tl.store(
        ptr + rows[:, None] * stride + c0[None, :], x0.to(ptr.dtype.element_ty), mask=ok[:, None] & (c0 < d)[None, :]
    )
    tl.store(
        ptr + rows[:, None] * stride + c1[None, :], x1.to(ptr.dtype.element_ty), mask=ok[:, None] & (c1 < d)[None, :]
    )


@triton.jit
def _atomic_add(ptr, rows, ok, stride, d, x0, x1, D0: tl.constexpr, D1: tl.constexpr):
    """Adds the float32 pieces x0, x1 into rows `rows` of a float32 (·, d) matrix at `ptr`, atomically."""
    c0, c1 = tl.arange(0, D0), D0 + tl.arange(0, D1)
    tl.atomic_add(ptr + rows[:, None] * stride + c0[None, :], x0, mask=ok[:, None] & (c0 < d)[None, :])
    tl.atomic_add(ptr + rows[:, None] * stride + c1[None, :], x1, mask=ok[:, None] & (c1 < d)[None, :])


@triton.jit
def _load_vector(ptr, d, D0: tl.constexpr, D1: tl.constexpr):
    """A (d,) vector (an RMSNorm weight) as float32 pieces (D0,), (D1,)."""
    c0, c1 = tl.arange(0, D0), D0 + tl.arange(0, D1)
    w0 = tl.load(ptr + c0, mask=c0 < d, other=0.0)
    w1 = tl.load(ptr + c1, mask=c1 < d, other=0.0)
    return w0.to(tl.float32), w1.to(tl.float32)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b accumulated in float32. PRECISION "upcast" (only under the interpreter, for bf16): the operands
    in float32 first, because Triton 3.8's interpreter multiplies bf16 tiles as their integer bit patterns;
    the result is the GPU's (bf16 products are exact in float32, and tensor cores accumulate in float32)."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _dot_rows(a0, a1, b0, b1, PRECISION: tl.constexpr):
    """The (R, R') products of the rows of a with the rows of b over d, both in pieces: a·bᵀ."""
    return _dot(a0, tl.trans(b0), PRECISION) + _dot(a1, tl.trans(b1), PRECISION)


@triton.jit
def _row_dot(a0, a1, b0, b1):
    """Σ_d a·b per row of two piecewise tiles, (R,)."""
    return tl.sum(a0 * b0, 1) + tl.sum(a1 * b1, 1)


@triton.jit
def _online_step(scores, m, l):  # noqa: E741
    """One tile of an online softmax: the new running max, the rescale of what was summed so far, the tile's
    unnormalised probabilities and the new running sum."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp(m - m_new)
    probs = tl.exp(scores - m_new[:, None])
    return m_new, alpha, probs, l * alpha + tl.sum(probs, 1)


@triton.jit
def _rms_scale(x0, x1, w0, w1, d, eps):
    """RMSNorm(x)·w over the d columns of a piecewise tile (padding zero)."""
    inverse = 1.0 / tl.sqrt(_row_dot(x0, x1, x0, x1) / d + eps)
    return x0 * inverse[:, None] * w0[None, :], x1 * inverse[:, None] * w1[None, :]


@triton.jit
def _rms_backward(grad0, grad1, x0, x1, w0, w1, d, eps):
    """The gradient of y = RMSNorm(x)·w with respect to x, and the column sums of grad ⊙ RMSNorm(x) (the
    weight's gradient from these rows), for piecewise tiles."""
    inverse = 1.0 / tl.sqrt(_row_dot(x0, x1, x0, x1) / d + eps)
    n0, n1 = x0 * inverse[:, None], x1 * inverse[:, None]  # RMSNorm(x)
    g0, g1 = grad0 * w0[None, :], grad1 * w1[None, :]
    mean = _row_dot(g0, g1, n0, n1) / d
    dx0, dx1 = (g0 - n0 * mean[:, None]) * inverse[:, None], (g1 - n1 * mean[:, None]) * inverse[:, None]
    return dx0, dx1, tl.sum(grad0 * n0, 0), tl.sum(grad1 * n1, 0)


# ----------------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _contrast_streams_kernel(
    q,  # (G, N, d)
    embed,  # E±, (h, S, n, d)
    streams,  # out: T±, (G, S·n, d)
    h,
    H,
    p,
    d,
    S: tl.constexpr,
    POOLED: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """Steps 1–2: T± = E± + the r×r average pool of q, for a block of contrast tokens of head g."""
    g, block = tl.program_id(0), tl.program_id(1)
    n, r = p * p, H // p
    j = block * BLOCK_J + tl.arange(0, BLOCK_J)  # contrast tokens, row-major on the p×p grid
    ok = j < n
    pooled0 = tl.zeros((BLOCK_J, D0), tl.float32)
    pooled1 = tl.zeros((BLOCK_J, D1), tl.float32)
    if POOLED:
        corner = (j // p) * r * H + (j % p) * r  # the first token of each r×r window
        for t in range(0, r * r):
            x0, x1 = _load(q + _head_start(g, H * H, d), corner + (t // r) * H + t % r, ok, d, d, D0, D1)
            pooled0 += x0.to(tl.float32)
            pooled1 += x1.to(tl.float32)
        pooled0, pooled1 = pooled0 / (r * r), pooled1 / (r * r)
    for s in tl.static_range(S):
        e0, e1 = _load(embed + _head_start((g % h) * S + s, n, d), j, ok, d, d, D0, D1)
        t0, t1 = pooled0 + e0.to(tl.float32), pooled1 + e1.to(tl.float32)
        _store(streams + _head_start(g * S + s, n, d), j, ok, d, d, t0, t1, D0, D1)


@triton.jit
def _stage1_step(t0, t1, k0, k1, v0, v1, key_ok, m, l, acc0, acc1, scale, PRECISION: tl.constexpr):  # noqa: E741
    """One key tile of Stage I for one stream: the online softmax of T·kᵀ/√d and its product with v."""
    scores = tl.where(key_ok[None, :], _dot_rows(t0, t1, k0, k1, PRECISION) * scale, float("-inf"))
    m, alpha, probs, l = _online_step(scores, m, l)  # noqa: E741
    probs = probs.to(v0.dtype)
    acc0 = acc0 * alpha[:, None] + _dot(probs, v0, PRECISION)
    acc1 = acc1 * alpha[:, None] + _dot(probs, v1, PRECISION)
    return m, l, acc0, acc1


@triton.autotune(configs=_STAGE1_FORWARD_BLOCKS, key=["N", "n", "D0", "D1", "DIFF"])
@triton.jit
def _stage1_forward_kernel(
    streams,  # T±, (G, rows, d): T⁺ rows [0, n), T⁻ rows [n, 2n)
    k,  # (G, N, d)
    v,  # (G, N, d)
    lam,  # λ₁, a 0-d tensor (any pointer when not DIFF)
    norm,  # (d,) RMSNorm weight (any pointer when not DIFF)
    v_hat,  # out: V̂, (G, n, d)
    reads,  # out: R±, float32 (G, m1, d)
    lse,  # out: the log-sum-exp of each contrast row's scores, float32 (G, m1)
    N,
    n,
    d,
    rows,
    scale,
    eps,
    out_scale,
    DIFF: tl.constexpr,
    PRECISION: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Step 4, forward: a block of contrast tokens of both streams against all N keys of head g."""
    g, block = tl.program_id(0), tl.program_id(1)
    i = block * BLOCK_M + tl.arange(0, BLOCK_M)  # contrast tokens
    ok = i < n
    streams, k, v = streams + _head_start(g, rows, d), k + _head_start(g, N, d), v + _head_start(g, N, d)
    t_pos0, t_pos1 = _load(streams, i, ok, d, d, D0, D1)
    m_pos = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_pos = tl.zeros((BLOCK_M,), tl.float32)
    acc_pos0, acc_pos1 = tl.zeros((BLOCK_M, D0), tl.float32), tl.zeros((BLOCK_M, D1), tl.float32)
    if DIFF:
        t_neg0, t_neg1 = _load(streams, n + i, ok, d, d, D0, D1)
        m_neg = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_neg = tl.zeros((BLOCK_M,), tl.float32)
        acc_neg0, acc_neg1 = tl.zeros((BLOCK_M, D0), tl.float32), tl.zeros((BLOCK_M, D1), tl.float32)
    for start in range(0, N, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < N
        k0, k1 = _load(k, keys, key_ok, d, d, D0, D1)
        v0, v1 = _load(v, keys, key_ok, d, d, D0, D1)
        m_pos, l_pos, acc_pos0, acc_pos1 = _stage1_step(
            t_pos0, t_pos1, k0, k1, v0, v1, key_ok, m_pos, l_pos, acc_pos0, acc_pos1, scale, PRECISION
        )
        if DIFF:
            m_neg, l_neg, acc_neg0, acc_neg1 = _stage1_step(
                t_neg0, t_neg1, k0, k1, v0, v1, key_ok, m_neg, l_neg, acc_neg0, acc_neg1, scale, PRECISION
            )
    m1 = 2 * n if DIFF else n
    reads, lse = reads + _head_start(g, m1, d), lse + _head_start(g, m1, 1)
    r_pos0, r_pos1 = acc_pos0 / l_pos[:, None], acc_pos1 / l_pos[:, None]  # R⁺ = softmax(T⁺kᵀ/√d)·v
    _store(reads, i, ok, d, d, r_pos0, r_pos1, D0, D1)
    tl.store(lse + i, m_pos + tl.log(l_pos), mask=ok)
    if DIFF:
        r_neg0, r_neg1 = acc_neg0 / l_neg[:, None], acc_neg1 / l_neg[:, None]
        _store(reads, n + i, ok, d, d, r_neg0, r_neg1, D0, D1)
        tl.store(lse + n + i, m_neg + tl.log(l_neg), mask=ok)
        lam1 = tl.load(lam).to(tl.float32)
        w0, w1 = _load_vector(norm, d, D0, D1)
        r_pos0, r_pos1 = _rms_scale(
            r_pos0 - lam1 * r_neg0, r_pos1 - lam1 * r_neg1, w0 * out_scale, w1 * out_scale, d, eps
        )
    _store(v_hat + _head_start(g, n, d), i, ok, d, d, r_pos0, r_pos1, D0, D1)


@triton.autotune(configs=_STAGE2_FORWARD_BLOCKS, key=["N", "n", "D0", "D1", "DIFF", "JOINT"], restore_value=["result"])
@triton.jit
def _stage2_forward_kernel(
    q,  # (G, N, d)
    streams,  # T±, (G, rows, d)
    v_hat,  # V̂, (G, n, d)
    lam,  # λ₂ (0-d)
    norm,  # (d,)
    result,  # in/out: (B, N, C), the convolution's output; Y is added
    out_pos,  # out: O, or O⁺ for two softmaxes, (G, N, d)
    out_neg,  # out for two softmaxes: O⁻, (G, N, d)
    lse_pos,  # out: the log-sum-exp of each query's scores (of S⁺ for two softmaxes), float32 (G, N)
    lse_neg,  # out for two softmaxes: that of S⁻, float32 (G, N)
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
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Step 5, forward: a block of queries of head g against its n contrast columns (both streams)."""
    g, block = tl.program_id(0), tl.program_id(1)
    i = block * BLOCK_N + tl.arange(0, BLOCK_N)  # queries
    ok = i < N
    streams, v_hat = streams + _head_start(g, rows, d), v_hat + _head_start(g, n, d)
    q0, q1 = _load(q + _head_start(g, N, d), i, ok, d, d, D0, D1)
    lam2 = tl.load(lam).to(tl.float32) if DIFF else 0.0
    m_pos = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    l_pos = tl.zeros((BLOCK_N,), tl.float32)
    acc_pos0, acc_pos1 = tl.zeros((BLOCK_N, D0), tl.float32), tl.zeros((BLOCK_N, D1), tl.float32)
    m_neg = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    l_neg = tl.zeros((BLOCK_N,), tl.float32)
    acc_neg0, acc_neg1 = tl.zeros((BLOCK_N, D0), tl.float32), tl.zeros((BLOCK_N, D1), tl.float32)
    for start in range(0, n, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        col_ok = cols < n
        t_pos0, t_pos1 = _load(streams, cols, col_ok, d, d, D0, D1)
        v0, v1 = _load(v_hat, cols, col_ok, d, d, D0, D1)
        s_pos = tl.where(col_ok[None, :], _dot_rows(q0, q1, t_pos0, t_pos1, PRECISION) * scale, float("-inf"))
        if DIFF:
            t_neg0, t_neg1 = _load(streams, n + cols, col_ok, d, d, D0, D1)
            s_neg = tl.where(col_ok[None, :], _dot_rows(q0, q1, t_neg0, t_neg1, PRECISION) * scale, float("-inf"))
            if JOINT:  # one softmax over both streams: one product of P⁺ − λ₂P⁻ with V̂
                m_new = tl.maximum(m_pos, tl.maximum(tl.max(s_pos, 1), tl.max(s_neg, 1)))
                alpha = tl.exp(m_pos - m_new)
                p_pos, p_neg = tl.exp(s_pos - m_new[:, None]), tl.exp(s_neg - m_new[:, None])
                l_pos = l_pos * alpha + tl.sum(p_pos, 1) + tl.sum(p_neg, 1)
                m_pos = m_new
                weights = (p_pos - lam2 * p_neg).to(v0.dtype)
                acc_pos0 = acc_pos0 * alpha[:, None] + _dot(weights, v0, PRECISION)
                acc_pos1 = acc_pos1 * alpha[:, None] + _dot(weights, v1, PRECISION)
            else:
                m_pos, alpha, p_pos, l_pos = _online_step(s_pos, m_pos, l_pos)
                acc_pos0 = acc_pos0 * alpha[:, None] + _dot(p_pos.to(v0.dtype), v0, PRECISION)
                acc_pos1 = acc_pos1 * alpha[:, None] + _dot(p_pos.to(v0.dtype), v1, PRECISION)
                m_neg, alpha, p_neg, l_neg = _online_step(s_neg, m_neg, l_neg)
                acc_neg0 = acc_neg0 * alpha[:, None] + _dot(p_neg.to(v0.dtype), v0, PRECISION)
                acc_neg1 = acc_neg1 * alpha[:, None] + _dot(p_neg.to(v0.dtype), v1, PRECISION)
        else:
            m_pos, alpha, p_pos, l_pos = _online_step(s_pos, m_pos, l_pos)
            acc_pos0 = acc_pos0 * alpha[:, None] + _dot(p_pos.to(v0.dtype), v0, PRECISION)
            acc_pos1 = acc_pos1 * alpha[:, None] + _dot(p_pos.to(v0.dtype), v1, PRECISION)
    o0, o1 = acc_pos0 / l_pos[:, None], acc_pos1 / l_pos[:, None]  # O (joint: (P⁺ − λ₂P⁻)·V̂ already), or O⁺
    _store(out_pos + _head_start(g, N, d), i, ok, d, d, o0, o1, D0, D1)
    tl.store(lse_pos + _head_start(g, N, 1) + i, m_pos + tl.log(l_pos), mask=ok)
    if DIFF:
        if not JOINT:
            o_neg0, o_neg1 = acc_neg0 / l_neg[:, None], acc_neg1 / l_neg[:, None]
            _store(out_neg + _head_start(g, N, d), i, ok, d, d, o_neg0, o_neg1, D0, D1)
            tl.store(lse_neg + _head_start(g, N, 1) + i, m_neg + tl.log(l_neg), mask=ok)
            o0, o1 = o0 - lam2 * o_neg0, o1 - lam2 * o_neg1
        w0, w1 = _load_vector(norm, d, D0, D1)
        o0, o1 = _rms_scale(o0, o1, w0 * out_scale, w1 * out_scale, d, eps)  # Y
    result = result + _image_head_start(g, N, h, h * d, d)
    y0, y1 = _load(result, i, ok, h * d, d, D0, D1)
    _store(result, i, ok, h * d, d, o0 + y0.to(tl.float32), o1 + y1.to(tl.float32), D0, D1)


# ----------------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------------


@triton.autotune(
    configs=_STAGE2_BACKWARD_BLOCKS,
    key=["N", "n", "D0", "D1", "DIFF", "JOINT"],
    reset_to_zero=["grad_streams", "grad_v_hat", "grad_lam", "grad_norm"],
)
@triton.jit
def _stage2_backward_kernel(
    q,  # (G, N, d)
    streams,  # T±, (G, rows, d)
    v_hat,  # V̂, (G, n, d)
    lam,  # λ₂
    norm,  # (d,)
    out_pos,  # the forward's O (O⁺), (G, N, d)
    out_neg,  # the forward's O⁻ for two softmaxes, (G, N, d)
    lse_pos,  # the forward's log-sum-exps, float32 (G, N)
    lse_neg,  # those of S⁻ for two softmaxes, float32 (G, N)
    grad,  # dY, (B, N, C)
    grad_qkv,  # out: dq of Stage II into the (B, N, 3C) gradient of the qkv projection
    grad_streams,  # += dT± of Stage II, float32 (G, m2, d)
    grad_v_hat,  # += dV̂, float32 (G, n, d)
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
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Step 5, backward, a dQ pass: a block of queries of head g against its n contrast columns."""
    g, block = tl.program_id(0), tl.program_id(1)
    i = block * BLOCK_N + tl.arange(0, BLOCK_N)  # queries
    ok = i < N
    streams, v_hat = streams + _head_start(g, rows, d), v_hat + _head_start(g, n, d)
    m2 = 2 * n if DIFF else n
    grad_streams, grad_v_hat = grad_streams + _head_start(g, m2, d), grad_v_hat + _head_start(g, n, d)
    q0, q1 = _load(q + _head_start(g, N, d), i, ok, d, d, D0, D1)
    dy0, dy1 = _load(grad + _image_head_start(g, N, h, h * d, d), i, ok, h * d, d, D0, D1)
    o0, o1 = _load(out_pos + _head_start(g, N, d), i, ok, d, d, D0, D1)
    dy0, dy1, o0, o1 = dy0.to(tl.float32), dy1.to(tl.float32), o0.to(tl.float32), o1.to(tl.float32)
    row_lse_pos = tl.load(lse_pos + _head_start(g, N, 1) + i, mask=ok, other=0.0)
    row_lse_neg = row_lse_pos  # a joint softmax has one
    lam2 = 0.0
    if DIFF:  # Y = (1 − λ_init)·RMSNorm(O): dO from dY and the saved O
        lam2 = tl.load(lam).to(tl.float32)
        x0, x1 = o0, o1
        if not JOINT:  # O = O⁺ − λ₂O⁻
            o_neg0, o_neg1 = _load(out_neg + _head_start(g, N, d), i, ok, d, d, D0, D1)
            o_neg0, o_neg1 = o_neg0.to(tl.float32), o_neg1.to(tl.float32)
            x0, x1 = o0 - lam2 * o_neg0, o1 - lam2 * o_neg1
            row_lse_neg = tl.load(lse_neg + _head_start(g, N, 1) + i, mask=ok, other=0.0)
        w0, w1 = _load_vector(norm, d, D0, D1)
        dy0, dy1, dw0, dw1 = _rms_backward(dy0, dy1, x0, x1, w0 * out_scale, w1 * out_scale, d, eps)
        c0, c1 = tl.arange(0, D0), D0 + tl.arange(0, D1)
        tl.atomic_add(grad_norm + c0, dw0 * out_scale, mask=c0 < d)
        tl.atomic_add(grad_norm + c1, dw1 * out_scale, mask=c1 < d)
    # The softmax's row terms Σ_j P_ij·dP_ij: dO·O for one softmax (dP⁺ = dW, dP⁻ = −λ₂dW, W = P⁺ − λ₂P⁻);
    # for two softmaxes one per stream, dO·O⁺ and −λ₂·dO·O⁻.
    delta_pos = _row_dot(dy0, dy1, o0, o1)
    delta_neg = delta_pos
    if DIFF and not JOINT:
        delta_neg = -lam2 * _row_dot(dy0, dy1, o_neg0, o_neg1)
    do0, do1 = dy0.to(q0.dtype), dy1.to(q0.dtype)  # dO, as the products' operand
    dq0, dq1 = tl.zeros((BLOCK_N, D0), tl.float32), tl.zeros((BLOCK_N, D1), tl.float32)
    lam_terms = tl.zeros((BLOCK_N,), tl.float32)  # Σ_j dW_ij·P⁻_ij: dλ₂ = −Σ dO·(P⁻V̂)
    for start in range(0, n, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        col_ok = cols < n
        both_ok = ok[:, None] & col_ok[None, :]
        t_pos0, t_pos1 = _load(streams, cols, col_ok, d, d, D0, D1)
        v0, v1 = _load(v_hat, cols, col_ok, d, d, D0, D1)
        scores = _dot_rows(q0, q1, t_pos0, t_pos1, PRECISION) * scale
        p_pos = tl.where(both_ok, tl.exp(scores - row_lse_pos[:, None]), 0.0)  # P⁺, (BLOCK_N, BLOCK_C)
        grad_w = _dot_rows(do0, do1, v0, v1, PRECISION)  # dW = dO·V̂ᵀ
        ds = (p_pos * (grad_w - delta_pos[:, None])).to(q0.dtype)  # dS⁺
        dq0 += _dot(ds, t_pos0, PRECISION)
        dq1 += _dot(ds, t_pos1, PRECISION)
        ds_t = tl.trans(ds)
        _atomic_add(
            grad_streams, cols, col_ok, d, d, _dot(ds_t, q0, PRECISION) * scale, _dot(ds_t, q1, PRECISION) * scale,
            D0, D1,
        )  # fmt: skip
        weights = p_pos
        if DIFF:
            t_neg0, t_neg1 = _load(streams, n + cols, col_ok, d, d, D0, D1)
            scores = _dot_rows(q0, q1, t_neg0, t_neg1, PRECISION) * scale
            p_neg = tl.where(both_ok, tl.exp(scores - row_lse_neg[:, None]), 0.0)  # P⁻
            lam_terms += tl.sum(grad_w * p_neg, 1)
            weights = p_pos - lam2 * p_neg  # W
            ds = (p_neg * (-lam2 * grad_w - delta_neg[:, None])).to(q0.dtype)  # dS⁻
            dq0 += _dot(ds, t_neg0, PRECISION)
            dq1 += _dot(ds, t_neg1, PRECISION)
            ds_t = tl.trans(ds)
            _atomic_add(
                grad_streams, n + cols, col_ok, d, d, _dot(ds_t, q0, PRECISION) * scale,
                _dot(ds_t, q1, PRECISION) * scale, D0, D1,
            )  # fmt: skip
        weights_t = tl.trans(weights.to(q0.dtype))
        _atomic_add(
            grad_v_hat, cols, col_ok, d, d, _dot(weights_t, do0, PRECISION), _dot(weights_t, do1, PRECISION), D0, D1
        )
    grad_q = grad_qkv + _image_head_start(g, N, h, 3 * h * d, d)
    _store(grad_q, i, ok, 3 * h * d, d, dq0 * scale, dq1 * scale, D0, D1)
    if DIFF:
        tl.atomic_add(grad_lam, -tl.sum(lam_terms, 0))


@triton.jit
def _stage1_norm_backward_kernel(
    reads,  # R±, float32 (G, m1, d)
    grad_v_hat,  # dV̂, float32 (G, n, d)
    lam,  # λ₁
    norm,  # (d,)
    grad_reads,  # out: dR±, float32 (G, m1, d)
    delta,  # out: Σ_d dR·R per contrast row (the softmax's row term), float32 (G, m1)
    grad_lam,  # += dλ₁
    grad_norm,  # += the norm weight's gradient (d)
    n,
    d,
    eps,
    out_scale,
    DIFF: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Step 4's V̂ = (1 − λ_init)·RMSNorm(R⁺ − λ₁R⁻), backward: for a block of contrast tokens of head g."""
    g, block = tl.program_id(0), tl.program_id(1)
    i = block * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = i < n
    m1 = 2 * n if DIFF else n
    reads, grad_reads, delta = (
        reads + _head_start(g, m1, d),
        grad_reads + _head_start(g, m1, d),
        delta + _head_start(g, m1, 1),
    )
    grad0, grad1 = _load(grad_v_hat + _head_start(g, n, d), i, ok, d, d, D0, D1)
    r_pos0, r_pos1 = _load(reads, i, ok, d, d, D0, D1)
    if DIFF:
        r_neg0, r_neg1 = _load(reads, n + i, ok, d, d, D0, D1)
        lam1 = tl.load(lam).to(tl.float32)
        w0, w1 = _load_vector(norm, d, D0, D1)
        x0, x1 = r_pos0 - lam1 * r_neg0, r_pos1 - lam1 * r_neg1
        grad0, grad1, dw0, dw1 = _rms_backward(grad0, grad1, x0, x1, w0 * out_scale, w1 * out_scale, d, eps)
        c0, c1 = tl.arange(0, D0), D0 + tl.arange(0, D1)
        tl.atomic_add(grad_norm + c0, dw0 * out_scale, mask=c0 < d)
        tl.atomic_add(grad_norm + c1, dw1 * out_scale, mask=c1 < d)
        tl.atomic_add(grad_lam, -tl.sum(_row_dot(grad0, grad1, r_neg0, r_neg1), 0))  # dλ₁ = −Σ dR⁺·R⁻
        neg0, neg1 = -lam1 * grad0, -lam1 * grad1  # dR⁻
        _store(grad_reads, n + i, ok, d, d, neg0, neg1, D0, D1)
        tl.store(delta + n + i, _row_dot(neg0, neg1, r_neg0, r_neg1), mask=ok)
    _store(grad_reads, i, ok, d, d, grad0, grad1, D0, D1)
    tl.store(delta + i, _row_dot(grad0, grad1, r_pos0, r_pos1), mask=ok)


@triton.autotune(configs=_STAGE1_BACKWARD_BLOCKS, key=["N", "m1", "D0", "D1"], reset_to_zero=["grad_streams"])
@triton.jit
def _stage1_backward_kernel(
    streams,  # T±, (G, rows, d)
    k,  # (G, N, d)
    v,  # (G, N, d)
    grad_reads,  # dR±, float32 (G, m1, d)
    lse,  # the forward's log-sum-exps, float32 (G, m1)
    delta,  # float32 (G, m1)
    grad_local,  # the convolution's gradient of v, (B, N, C) memory
    grad_qkv,  # out: dk and dv (Stage I's + the convolution's) into (B, N, 3C)
    grad_streams,  # += dT± of Stage I, float32 (G, m1, d)
    N,
    m1,
    d,
    rows,
    h,
    scale,
    PRECISION: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Step 4, backward, a dK/dV pass: a block of keys of head g against its m1 contrast rows."""
    g, block = tl.program_id(0), tl.program_id(1)
    keys = block * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = keys < N
    k0, k1 = _load(k + _head_start(g, N, d), keys, key_ok, d, d, D0, D1)
    v0, v1 = _load(v + _head_start(g, N, d), keys, key_ok, d, d, D0, D1)
    streams, grad_reads = streams + _head_start(g, rows, d), grad_reads + _head_start(g, m1, d)
    lse, delta = lse + _head_start(g, m1, 1), delta + _head_start(g, m1, 1)
    grad_streams = grad_streams + _head_start(g, m1, d)
    dk0, dk1 = tl.zeros((BLOCK_N, D0), tl.float32), tl.zeros((BLOCK_N, D1), tl.float32)
    dv0, dv1 = tl.zeros((BLOCK_N, D0), tl.float32), tl.zeros((BLOCK_N, D1), tl.float32)
    for start in range(0, m1, BLOCK_M):
        i = start + tl.arange(0, BLOCK_M)  # contrast rows of both streams
        ok = i < m1
        t0, t1 = _load(streams, i, ok, d, d, D0, D1)
        dr0, dr1 = _load(grad_reads, i, ok, d, d, D0, D1)
        dr0, dr1 = dr0.to(v0.dtype), dr1.to(v0.dtype)
        row_lse = tl.load(lse + i, mask=ok, other=0.0)
        row_delta = tl.load(delta + i, mask=ok, other=0.0)
        scores = _dot_rows(t0, t1, k0, k1, PRECISION) * scale  # (BLOCK_M, BLOCK_N)
        probs = tl.where(ok[:, None] & key_ok[None, :], tl.exp(scores - row_lse[:, None]), 0.0)  # P
        probs_t = tl.trans(probs.to(v0.dtype))
        dv0 += _dot(probs_t, dr0, PRECISION)
        dv1 += _dot(probs_t, dr1, PRECISION)
        ds = (probs * (_dot_rows(dr0, dr1, v0, v1, PRECISION) - row_delta[:, None])).to(t0.dtype)  # dS
        ds_t = tl.trans(ds)
        dk0 += _dot(ds_t, t0, PRECISION)
        dk1 += _dot(ds_t, t1, PRECISION)
        _atomic_add(grad_streams, i, ok, d, d, _dot(ds, k0, PRECISION) * scale, _dot(ds, k1, PRECISION) * scale, D0, D1)
    local0, local1 = _load(grad_local + _image_head_start(g, N, h, h * d, d), keys, key_ok, h * d, d, D0, D1)
    grad_k = grad_qkv + _image_head_start(g, N, h, 3 * h * d, d) + h * d
    _store(grad_k, keys, key_ok, 3 * h * d, d, dk0 * scale, dk1 * scale, D0, D1)
    dv0, dv1 = dv0 + local0.to(tl.float32), dv1 + local1.to(tl.float32)
    _store(grad_k + h * d, keys, key_ok, 3 * h * d, d, dv0, dv1, D0, D1)


@triton.jit
def _stream_gradient(
    grad_stage1,
    grad_stage2,
    g,
    s: tl.constexpr,
    j,
    ok,
    n,
    d,
    M1: tl.constexpr,
    M2: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """dT of stream s (0: T⁺, 1: T⁻) of head g, contrast tokens j: the sum of both stages' shares (a stage that
    does not read stream s has none)."""
    grad0, grad1 = tl.zeros((BLOCK_J, D0), tl.float32), tl.zeros((BLOCK_J, D1), tl.float32)
    if s < M1:
        x0, x1 = _load(grad_stage1 + _head_start(g * M1 + s, n, d), j, ok, d, d, D0, D1)
        grad0, grad1 = grad0 + x0, grad1 + x1
    if s < M2:
        x0, x1 = _load(grad_stage2 + _head_start(g * M2 + s, n, d), j, ok, d, d, D0, D1)
        grad0, grad1 = grad0 + x0, grad1 + x1
    return grad0, grad1


@triton.jit
def _contrast_streams_backward_kernel(
    grad_stage1,  # dT± of Stage I, float32 (G, m1, d)
    grad_stage2,  # dT± of Stage II, float32 (G, m2, d)
    grad_embed,  # out: dE±, float32 (h, S, n, d)
    grad_qkv,  # in/out: (B, N, 3C); dq gains the pooling's share
    B,
    h,
    H,
    p,
    d,
    S: tl.constexpr,
    M1: tl.constexpr,  # streams in Stage I (1 or 2)
    M2: tl.constexpr,  # streams in Stage II
    POOLED: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """Steps 1–2, backward: for a block of contrast tokens of one head, over the B images, dE± (summed) and
    dq through the pooling. Every token lies in one window: no two programs write the same dq."""
    head, block = tl.program_id(0), tl.program_id(1)
    n, r = p * p, H // p
    j = block * BLOCK_J + tl.arange(0, BLOCK_J)
    ok = j < n
    embed_pos0, embed_pos1 = tl.zeros((BLOCK_J, D0), tl.float32), tl.zeros((BLOCK_J, D1), tl.float32)
    embed_neg0, embed_neg1 = tl.zeros((BLOCK_J, D0), tl.float32), tl.zeros((BLOCK_J, D1), tl.float32)
    corner = (j // p) * r * H + (j % p) * r  # the first token of each r×r window
    for b in range(0, B):
        g = b * h + head
        pooled0, pooled1 = _stream_gradient(grad_stage1, grad_stage2, g, 0, j, ok, n, d, M1, M2, D0, D1, BLOCK_J)
        embed_pos0, embed_pos1 = embed_pos0 + pooled0, embed_pos1 + pooled1
        if S == 2:
            neg0, neg1 = _stream_gradient(grad_stage1, grad_stage2, g, 1, j, ok, n, d, M1, M2, D0, D1, BLOCK_J)
            embed_neg0, embed_neg1 = embed_neg0 + neg0, embed_neg1 + neg1
            pooled0, pooled1 = pooled0 + neg0, pooled1 + neg1
        if POOLED:
            grad_q = grad_qkv + _image_head_start(g, H * H, h, 3 * h * d, d)
            pooled0, pooled1 = pooled0 / (r * r), pooled1 / (r * r)
            for t in range(0, r * r):
                token = corner + (t // r) * H + t % r
                x0, x1 = _load(grad_q, token, ok, 3 * h * d, d, D0, D1)
                x0, x1 = x0.to(tl.float32) + pooled0, x1.to(tl.float32) + pooled1
                _store(grad_q, token, ok, 3 * h * d, d, x0, x1, D0, D1)
    _store(grad_embed + _head_start(head * S, n, d), j, ok, d, d, embed_pos0, embed_pos1, D0, D1)
    if S == 2:
        _store(grad_embed + _head_start(head * S + 1, n, d), j, ok, d, d, embed_neg0, embed_neg1, D0, D1)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


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
    """The sizes every launcher needs, from q, k, v `heads` (3, B, h, N, d) and the layout."""

    def __init__(self, heads: Tensor, layout):
        _, self.B, self.h, self.N, self.d = heads.shape
        self.G, self.C = self.B * self.h, self.h * self.d
        self.H, self.p = layout.grid_size, layout.contrast_grid
        self.n = self.p**2
        self.S = 2 if layout.stage1_differential or layout.stage2_differential else 1  # streams: T⁺ (and T⁻)
        self.rows = self.S * self.n  # rows of the streams tensor
        self.m1, self.m2 = layout.stage1_rows, layout.stage2_cols
        self.scale, self.out_scale = self.d**-0.5, 1 - layout.lambda_init
        self.D0, self.D1 = _head_pieces(self.d)
        if self.N * 3 * self.C >= 2**31:  # offsets inside one image are 32-bit (see the module docstring)
            raise ValueError(f"kernel='triton' takes at most 2^31 - 1 elements per image of the qkv gradient; "
                             f"N·3C = {self.N}·{3 * self.C}: use kernel='aten'")  # fmt: skip


def _with_dummy(t: Tensor | None, fallback: Tensor) -> Tensor:
    return fallback if t is None else t  # a pointer a kernel never reads (its switch is off)


def saved_like(heads: Tensor, layout) -> list[Tensor]:
    """Empty tensors of the shapes and dtypes of what `add_attention` saves for the backward (the operator's fake
    kernel returns these): T± (G, S·n, d), V̂ (G, n, d), R± (G, m1, d) and Stage I's log-sum-exps (G, m1) in
    float32, O (O⁺ and O⁻ for two softmaxes, flat (K·G·N·d)) in q's dtype and its log-sum-exps (K·G·N) in float32,
    K = 1 or 2 softmaxes."""
    s = _Shape(heads, layout)
    two = layout.stage2_differential and not layout.joint_softmax  # Stage II's softmaxes
    floats = {"dtype": torch.float32}
    return [
        heads.new_empty(s.G, s.rows, s.d),
        heads.new_empty(s.G, s.n, s.d),
        heads.new_empty(s.G, s.m1, s.d, **floats),
        heads.new_empty(s.G, s.m1, **floats),
        heads.new_empty((2 if two else 1) * s.G * s.N * s.d),
        heads.new_empty((2 if two else 1) * s.G * s.N, **floats),
    ]


def add_attention(
    result: Tensor,
    heads: Tensor,
    pooled: Tensor | None,
    embed: Tensor,
    lambda1: Tensor | None,
    lambda2: Tensor | None,
    norm1: Tensor | None,
    norm2: Tensor | None,
    layout,
) -> list[Tensor]:
    """Adds both attention stages of the VCA core, computed from q, k, v `heads` (3, B, h, N, d), into `result`
    (B, N, C) (the depthwise convolution's output); returns what `attention_backward` needs besides the
    operator's inputs (see `saved_like`; FlashAttention saves its output and log-sum-exps alike). `pooled`
    (B, h, n, d): the streams' content T given (with RoPE: dit_vca.vca_qk), else the pool of q."""
    _check_device(heads)
    s = _Shape(heads, layout)
    saved = saved_like(heads, layout)
    streams, v_hat, reads, lse1, outs, lse2 = saved
    precision = _precision(heads.dtype)
    # T given: the streams kernel "pools" the p×p grid of T by windows of one token (its H = p), i.e. copies it.
    content, side = (heads[0], s.H) if pooled is None else (pooled, s.p)
    _launch(_contrast_streams_kernel, (s.G, triton.cdiv(s.n, _TOKEN_BLOCK)))(
        content, embed, streams, s.h, side, s.p, s.d, s.S, layout.pooled_content, s.D0, s.D1, _TOKEN_BLOCK
    )
    _launch(_stage1_forward_kernel, lambda meta: (s.G, triton.cdiv(s.n, meta["BLOCK_M"])))(
        streams, heads[1], heads[2], _with_dummy(lambda1, streams), _with_dummy(norm1, streams), v_hat, reads,
        lse1, s.N, s.n, s.d, s.rows, s.scale, layout.eps, s.out_scale,
        DIFF=layout.stage1_differential, PRECISION=precision, D0=s.D0, D1=s.D1,
    )  # fmt: skip
    outs, lse2 = outs.view(-1, s.G, s.N, s.d), lse2.view(-1, s.G, s.N)  # O (O⁺, O⁻), their log-sum-exps
    _launch(_stage2_forward_kernel, lambda meta: (s.G, triton.cdiv(s.N, meta["BLOCK_N"])))(
        heads[0], streams, v_hat, _with_dummy(lambda2, streams), _with_dummy(norm2, streams), result, outs[0],
        outs[-1], lse2[0], lse2[-1], s.N, s.n, s.d, s.rows, s.h, s.scale, layout.eps, s.out_scale,
        DIFF=layout.stage2_differential, JOINT=layout.joint_softmax, PRECISION=precision, D0=s.D0, D1=s.D1,
    )  # fmt: skip
    return saved


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
    layout,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """The backward of both attention stages from the gradient `grad` (B, N, C) of the core's result and what
    `add_attention` saved: (the gradient of the qkv projection's output (B·N, 3C), the convolution's share
    `grad_local` (B, C, H, W) of dv included; then dE±, dλ₁, dλ₂, d norm1, d norm2 and dT of a given `pooled`
    in float32, None where a switch is off or T was pooled here: then its share is in dq)."""
    _check_device(heads)
    s = _Shape(heads, layout)
    B, N, G, n, d, h = s.B, s.N, s.G, s.n, s.d, s.h
    streams, v_hat, reads, lse1, outs, lse2 = saved
    outs, lse2 = outs.view(-1, G, N, d), lse2.view(-1, G, N)
    precision = _precision(heads.dtype)
    floats = {"device": heads.device, "dtype": torch.float32}
    grad_local = grad_local.permute(0, 2, 3, 1).reshape(B, N, s.C)  # a view when channels-last
    # dλ₁, dλ₂, d norm1, d norm2: float32 atomic sums (each its own tensor: an operator's outputs never alias)
    grad_lambda1, grad_lambda2 = torch.zeros((), **floats), torch.zeros((), **floats)
    grad_norm1, grad_norm2 = torch.zeros(d, **floats), torch.zeros(d, **floats)
    # The atomic sums of the stages' keys and values: dT± of Stage II, dV̂, dT± of Stage I; one zero fill.
    sums = torch.zeros(G * (s.m2 + n + s.m1) * d, **floats)
    grad_stage2 = sums[: G * s.m2 * d].view(G, s.m2, d)
    grad_v_hat = sums[G * s.m2 * d : G * (s.m2 + n) * d].view(G, n, d)
    grad_stage1 = sums[G * (s.m2 + n) * d :].view(G, s.m1, d)
    grad_qkv = heads.new_empty(B, N, 3 * s.C)  # written by the kernels: dq, dk, dv in the projection's layout

    _launch(_stage2_backward_kernel, lambda meta: (G, triton.cdiv(N, meta["BLOCK_N"])))(
        heads[0], streams, v_hat, _with_dummy(lambda2, streams), _with_dummy(norm2, streams), outs[0], outs[-1],
        lse2[0], lse2[-1], grad, grad_qkv, grad_stage2, grad_v_hat, grad_lambda2, grad_norm2, N, n, d, s.rows, h,
        s.scale, layout.eps, s.out_scale,
        DIFF=layout.stage2_differential, JOINT=layout.joint_softmax, PRECISION=precision, D0=s.D0, D1=s.D1,
    )  # fmt: skip
    grad_reads = torch.empty(G, s.m1, d, **floats)
    delta1 = torch.empty(G, s.m1, **floats)
    _launch(_stage1_norm_backward_kernel, (G, triton.cdiv(n, _TOKEN_BLOCK)))(
        reads, grad_v_hat, _with_dummy(lambda1, streams), _with_dummy(norm1, streams), grad_reads, delta1,
        grad_lambda1, grad_norm1, n, d, layout.eps, s.out_scale,
        DIFF=layout.stage1_differential, D0=s.D0, D1=s.D1, BLOCK_M=_TOKEN_BLOCK,
    )  # fmt: skip
    _launch(_stage1_backward_kernel, lambda meta: (G, triton.cdiv(N, meta["BLOCK_N"])))(
        streams, heads[1], heads[2], grad_reads, lse1, delta1, grad_local, grad_qkv, grad_stage1, N, s.m1, d,
        s.rows, h, s.scale, PRECISION=precision, D0=s.D0, D1=s.D1,
    )  # fmt: skip
    grad_embed = torch.empty(1, h, s.S, n, d, **floats)
    pools_q = layout.pooled_content and pooled is None  # dq gains the pooling's share in the kernel
    _launch(_contrast_streams_backward_kernel, (h, triton.cdiv(n, _TOKEN_BLOCK)))(
        grad_stage1, grad_stage2, grad_embed, grad_qkv, B, h, s.H, s.p, d,
        S=s.S, M1=s.m1 // n, M2=s.m2 // n, POOLED=pools_q, D0=s.D0, D1=s.D1, BLOCK_J=_TOKEN_BLOCK,
        num_warps=_TOKEN_WARPS,
    )  # fmt: skip
    grad_pooled = None  # dT of a given T: the sum of every stream's gradient from both stages, (B, h, n, d)
    if layout.pooled_content and pooled is not None:
        grad_pooled = grad_stage1.view(G, -1, n, d).sum(1) + grad_stage2.view(G, -1, n, d).sum(1)
        grad_pooled = grad_pooled.view(B, h, n, d)

    return (
        grad_qkv.view(B * N, 3 * s.C),
        grad_embed,
        grad_lambda1 if layout.stage1_differential else None,
        grad_lambda2 if layout.stage2_differential else None,
        grad_norm1 if layout.stage1_differential else None,
        grad_norm2 if layout.stage2_differential else None,
        grad_pooled,
    )


# ----------------------------------------------------------------------------------------------------------------
# Tile products
# ----------------------------------------------------------------------------------------------------------------


def tile_products(B: int, N: int, C: int, layout, blocks: dict[str, dict[str, int]] | None = None) -> dict[str, int]:
    """Multiply-adds of every tl.dot the kernels run for one core on tokens (B, N, C), per kernel: programs
    (the launch grid) × loop trips × the products of one trip, on the padded tiles (blocks and D0 + D1 columns)
    the GPU multiplies. `blocks`: each autotuned kernel's block sizes (by default its first configuration)."""
    h = layout.num_heads
    d, n, m1 = C // h, layout.contrast_grid**2, layout.stage1_rows
    width, G = sum(_head_pieces(d)), B * h  # D0 + D1
    diff2, two2 = layout.stage2_differential, layout.stage2_differential and not layout.joint_softmax
    chosen = {name: dict(configs[0].kwargs) for name, configs in _AUTOTUNED.items()} | (blocks or {})
    cdiv = triton.cdiv

    b = chosen["_stage1_forward_kernel"]
    streams1 = m1 // n  # each trip: scores and the product with v, per stream
    stage1_forward = G * cdiv(n, b["BLOCK_M"]) * cdiv(N, b["BLOCK_N"]) * streams1 * 2 * b["BLOCK_M"] * b["BLOCK_N"]
    b = chosen["_stage2_forward_kernel"]
    per_trip = (2 if diff2 else 1) + (2 if two2 else 1)  # scores per stream, the value products
    stage2_forward = G * cdiv(N, b["BLOCK_N"]) * cdiv(n, b["BLOCK_C"]) * per_trip * b["BLOCK_N"] * b["BLOCK_C"]
    b = chosen["_stage2_backward_kernel"]
    per_trip = 3 * (2 if diff2 else 1) + 2  # scores, dq, dT per stream; dW, dV̂
    stage2_backward = G * cdiv(N, b["BLOCK_N"]) * cdiv(n, b["BLOCK_C"]) * per_trip * b["BLOCK_N"] * b["BLOCK_C"]
    b = chosen["_stage1_backward_kernel"]
    stage1_backward = G * cdiv(N, b["BLOCK_N"]) * cdiv(m1, b["BLOCK_M"]) * 5 * b["BLOCK_M"] * b["BLOCK_N"]
    return {  # each product's third dimension is the head's padded width (or a block, of a product over d)
        "_stage1_forward_kernel": stage1_forward * width,
        "_stage2_forward_kernel": stage2_forward * width,
        "_stage2_backward_kernel": stage2_backward * width,
        "_stage1_backward_kernel": stage1_backward * width,
    }
