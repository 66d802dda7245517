"""A Triton kernel with one atomic add, acq_rel (Triton's default) or relaxed: what tests/test_triton_compile.py
compiles to check that the compile matrix's detectors find an atomic instruction in the PTX and, for acq_rel, the
GPU-scope fence it costs in the SASS (issue 46: MEMBAR.ALL.GPU + ATOMG + CCTL.IVALL per element on sm_90)."""

import triton
import triton.language as tl


@triton.jit
def atomic_add_kernel(x, total, RELAXED: tl.constexpr):
    values = tl.load(x + tl.arange(0, 16))
    if RELAXED:
        tl.atomic_add(total + tl.arange(0, 16), values, sem="relaxed")
    else:
        tl.atomic_add(total + tl.arange(0, 16), values)
