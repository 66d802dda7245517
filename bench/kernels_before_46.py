"""The Triton kernels of VCA's core before issue 46, switched in for a benchmark's old-against-new comparison.

`bench/vca_triton_before_46.py` is that module as it was (atomic sums with GPU fences, seven kernels); a benchmark
that sets `VCA_BENCH_KERNELS=before-46` and calls `install_from_environment()` before it builds a layer runs VCA's
core on it: dit_vca.vca_core finds its Triton implementation as `dit_vca.vca_triton`, which this module replaces
for the process with an adapter. The adapter gives the old kernels what they assume, q, k, v as one head-major
contiguous (3, B, h, N, d) tensor (the operator may pass a strided view of the qkv projection), and passes the rest
through. Only benchmarks read the switch; it is not a kernel choice users have.
"""

from __future__ import annotations

import os
import sys
import types

SWITCH = "VCA_BENCH_KERNELS"
BEFORE_46 = "before-46"


def adapter() -> types.ModuleType:
    """A module with the entry points dit_vca.vca_core calls (add_attention, attention_backward, saved_like) on the
    kernels before issue 46."""
    from bench import vca_triton_before_46 as old

    module = types.ModuleType("dit_vca.vca_triton", "VCA's Triton core before issue 46 (bench/kernels_before_46.py)")
    module.saved_like = lambda heads, layout: old.saved_like(heads.contiguous(), layout)
    module.add_attention = lambda result, heads, *rest: old.add_attention(result, heads.contiguous(), *rest)
    module.attention_backward = lambda grad, heads, *rest: old.attention_backward(grad, heads.contiguous(), *rest)
    return module


def install() -> None:
    """From now on in this process, dit_vca.vca_triton is the adapter of the old kernels."""
    import dit_vca

    module = adapter()
    sys.modules["dit_vca.vca_triton"] = module
    dit_vca.vca_triton = module


def install_from_environment() -> bool:
    """Installs the old kernels when VCA_BENCH_KERNELS=before-46; whether it did. Any other value is refused."""
    value = os.environ.get(SWITCH)
    if value in (None, ""):
        return False
    if value != BEFORE_46:
        raise ValueError(f"{SWITCH}={value!r}: expected {BEFORE_46!r} or unset")
    install()
    return True
