"""The static shape and switches of VCA's fused core (`KernelLayout`): what dit_vca.vca_core's operators take
besides their tensors, and what both implementations of its attention stages (dit_vca.vca_aten, dit_vca.vca_triton)
read. A module of its own so that the implementations and the operator share it without importing each other."""

from __future__ import annotations

from typing import NamedTuple


class KernelLayout(NamedTuple):
    """The static shape and switches the fused VCA core needs besides its tensors (scalar operator arguments). A
    named tuple: built at every call of a layer, and a tuple is the cheapest immutable record to build."""

    num_heads: int
    grid_size: int  # H (= W)
    contrast_grid: int  # p, a divisor of H
    joint_softmax: bool
    stage1_differential: bool
    stage2_differential: bool
    pooled_content: bool
    lambda_init: float
    eps: float  # of both RMSNorms
    recompute_qkv: bool  # recompute q, k, v in backward instead of saving them
    stage2_sdpa: bool  # Stage II of the forward as SDPA calls (see STAGE2_SDPA)
    triton: bool = False  # both attention stages on the Triton kernels of dit_vca.vca_triton
    qk_norm_eps: float | None = None  # eps of QK-norm's RMSNorms of q and k (dit_vca.vca_qk); None: no QK-norm

    def as_args(self) -> tuple:
        """The fields in order: the scalar arguments of the operators."""
        return tuple(self)

    @property
    def stage1_rows(self) -> int:  # contrast tokens that read the keys in Stage I: [T⁺; T⁻] or T⁺
        return (2 if self.stage1_differential else 1) * self.contrast_grid**2

    @property
    def stage2_cols(self) -> int:  # contrast tokens that the queries read in Stage II
        return (2 if self.stage2_differential else 1) * self.contrast_grid**2
