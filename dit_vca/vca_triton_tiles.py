"""Tile helpers of VCA's Triton kernels: offsets, loads and stores of (rows, d) tiles in two column pieces, products,
softmax and RMSNorm steps. Shared by the per-head kernels (dit_vca.vca_triton_per_head), the split path
(dit_vca.vca_triton_split) and the stages' steps both run (dit_vca.vca_triton_stages).

Head dimensions: a (rows, d) tile is held as two column pieces of powers of two, x0 = x[:, :D0] and
x1 = x[:, D0:D0 + D1] (dit_vca.vca_triton_plan.head_pieces: 72 = 64 + 16 in 80 columns, 64 = 32 + 32, 40 = 32 + 16
in 48), so d = 72
costs 80 columns of products and registers, not 128; every product over d is the sum of the two pieces'.
Offsets: where a program's rows start (an image, a head, a split) is computed in 64 bits (`start64`), so a tensor
may pass 2³¹ elements; offsets inside one image's rows stay 32-bit (dit_vca.vca_triton refuses an image of 2³¹
elements or more).
"""

from __future__ import annotations

import triton
import triton.language as tl


def inlined_and_called(body):
    """A Triton function twice: inlined where it is called (Triton's default), and compiled as a function of its own
    that is called (noinline). A loop that calls a tile's work the second way keeps what one trip needs in registers
    from staying alive across the loop (Triton hoists loop-invariant tensors out of it): fewer spills on sm_90 and
    sm_80. sm_100 does not compile a called function with a tensor-core product in it (ConvertNVGPUToLLVM fails in
    Triton 3.5-3.8), so the kernels choose by their CALLS constexpr (dit_vca.vca_triton_configs)."""
    return triton.jit(body), triton.jit(noinline=True)(body)


@triton.jit
def start64(index, stride):
    """index·stride in 64 bits: where a program's image, head or split starts."""
    return tl.cast(index, tl.int64) * stride


@triton.jit
def load_rows(ptr, rows, ok, stride, d, D0: tl.constexpr, D1: tl.constexpr):
    """Rows `rows` (stride `stride`, columns contiguous) of a (·, d) matrix at `ptr` as two pieces (R, D0), (R, D1);
    rows not `ok` and columns ≥ d read as zero."""
    c0, c1 = tl.arange(0, D0), D0 + tl.arange(0, D1)
    x0 = tl.load(ptr + rows[:, None] * stride + c0[None, :], mask=ok[:, None] & (c0 < d)[None, :], other=0.0)
    x1 = tl.load(ptr + rows[:, None] * stride + c1[None, :], mask=ok[:, None] & (c1 < d)[None, :], other=0.0)
    return x0, x1


@triton.jit
def load_rows_f32(ptr, rows, ok, stride, d, D0: tl.constexpr, D1: tl.constexpr):
    """load_rows in float32."""
    x0, x1 = load_rows(ptr, rows, ok, stride, d, D0, D1)
    return x0.to(tl.float32), x1.to(tl.float32)


@triton.jit
def store_rows(ptr, rows, ok, stride, d, x0, x1, D0: tl.constexpr, D1: tl.constexpr):
    """Stores the pieces x0, x1 into rows `rows` of a (·, d) matrix at `ptr`, in its dtype."""
    c0, c1 = tl.arange(0, D0), D0 + tl.arange(0, D1)
    tl.store(
        ptr + rows[:, None] * stride + c0[None, :], x0.to(ptr.dtype.element_ty), mask=ok[:, None] & (c0 < d)[None, :]
    )
    tl.store(
        ptr + rows[:, None] * stride + c1[None, :], x1.to(ptr.dtype.element_ty), mask=ok[:, None] & (c1 < d)[None, :]
    )


@triton.jit
def load_vector(ptr, d, D0: tl.constexpr, D1: tl.constexpr):
    """A (d,) vector (an RMSNorm weight) as float32 pieces (D0,), (D1,)."""
    c0, c1 = tl.arange(0, D0), D0 + tl.arange(0, D1)
    w0 = tl.load(ptr + c0, mask=c0 < d, other=0.0)
    w1 = tl.load(ptr + c1, mask=c1 < d, other=0.0)
    return w0.to(tl.float32), w1.to(tl.float32)


@triton.jit
def store_vector(ptr, d, w0, w1, D0: tl.constexpr, D1: tl.constexpr):
    """Stores the pieces of a (d,) vector."""
    c0, c1 = tl.arange(0, D0), D0 + tl.arange(0, D1)
    tl.store(ptr + c0, w0.to(ptr.dtype.element_ty), mask=c0 < d)
    tl.store(ptr + c1, w1.to(ptr.dtype.element_ty), mask=c1 < d)


@triton.jit
def dot(a, b, PRECISION: tl.constexpr):
    """a @ b accumulated in float32. PRECISION "upcast" (only under the interpreter, for bf16): the operands
    in float32 first, because Triton 3.8's interpreter multiplies bf16 tiles as their integer bit patterns;
    the result is the GPU's (bf16 products are exact in float32, and tensor cores accumulate in float32)."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def dot_rows(a0, a1, b0, b1, PRECISION: tl.constexpr):
    """The (R, R') products of the rows of a with the rows of b over d, both in pieces: a·bᵀ."""
    return dot(a0, tl.trans(b0), PRECISION) + dot(a1, tl.trans(b1), PRECISION)


@triton.jit
def dot_pieces(a, b0, b1, PRECISION: tl.constexpr):
    """a @ b for a (R, K) tile and b in pieces (K, D0), (K, D1): the product in pieces."""
    return dot(a, b0, PRECISION), dot(a, b1, PRECISION)


@triton.jit
def row_dot(a0, a1, b0, b1):
    """Σ_d a·b per row of two piecewise tiles, (R,)."""
    return tl.sum(a0 * b0, 1) + tl.sum(a1 * b1, 1)


@triton.jit
def online_step(scores, m, l):  # noqa: E741
    """One tile of an online softmax: the new running max, the rescale of what was summed so far, the tile's
    unnormalised probabilities and the new running sum."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp(m - m_new)
    probs = tl.exp(scores - m_new[:, None])
    return m_new, alpha, probs, l * alpha + tl.sum(probs, 1)


@triton.jit
def rms_scale(x0, x1, w0, w1, d, eps):
    """RMSNorm(x)·w over the d columns of a piecewise tile (padding zero)."""
    inverse = 1.0 / tl.sqrt(row_dot(x0, x1, x0, x1) / d + eps)
    return x0 * inverse[:, None] * w0[None, :], x1 * inverse[:, None] * w1[None, :]


@triton.jit
def rms_backward(grad0, grad1, x0, x1, w0, w1, d, eps):
    """The gradient of y = RMSNorm(x)·w with respect to x, and the column sums of grad ⊙ RMSNorm(x) (the
    weight's gradient from these rows), for piecewise tiles."""
    inverse = 1.0 / tl.sqrt(row_dot(x0, x1, x0, x1) / d + eps)
    n0, n1 = x0 * inverse[:, None], x1 * inverse[:, None]  # RMSNorm(x)
    g0, g1 = grad0 * w0[None, :], grad1 * w1[None, :]
    mean = row_dot(g0, g1, n0, n1) / d
    dx0, dx1 = (g0 - n0 * mean[:, None]) * inverse[:, None], (g1 - n1 * mean[:, None]) * inverse[:, None]
    return dx0, dx1, tl.sum(grad0 * n0, 0), tl.sum(grad1 * n1, 0)
